/* mlp_cuda: the MLP of examples/mlp trained on GPUs, with forward and backward as cuBLAS GEMMs.
 *
 *   mlp_cuda --ranks 2 --dtype bf16                 (2 ranks as threads on one GPU, local comm)
 *   mpirun -np 8 mlp_cuda --nccl                    (one GPU per rank, NCCL)
 *   mlp_cuda --nccl-solo --trace t.json             (one rank, NCCL of world 1, traced)
 *
 * Same model and data as examples/mlp (mlp_model.c: the teacher network, the data stream, the
 * initial values). Each rank keeps its activations on the GPU, runs every matrix product with
 * cublasGemmEx (fp32 compute; in bf16 mode the GEMM inputs are bf16 copies, the outputs fp32,
 * as autocast would do) on a stream of its own, which the engine learns through sg_set_stream.
 * The weight and bias gradients are written by the GEMMs straight into the engine's gradient
 * slots (sg_grad_ptr, device memory, grad dtype), last layer first; sg_grad_ready orders the
 * engine's reduction after them, so no host synchronization is needed until the loss is read
 * after sg_step. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef MLP_CUDA_HAVE_MPI
#include <mpi.h>
#define MLP_GPU_HAVE_MPI
#endif

#include "mlp_cli.h"
#include "mlp_gpu.h" /* --nccl, --nccl-solo, --gpu */
#include "mlp_cuda_kernels.h"
#include "mlp_model.h"
#include "shardgrad.h"

typedef struct options {
  mlp_cli c; /* the flags shared with examples/mlp; dtype SG_F32 or SG_BF16 */
  mlp_gpu_flags g;
} options;

/* The GPU side of one rank's model: f32 activations and deltas, their bf16 mirrors in bf16
 * mode (the GEMM inputs), a column of ones (bias gradients as a GEMM), the per-micro-batch
 * losses. */
typedef struct gpu_model {
  mlp_model *m; /* dims, host batch */
  int bf16;
  float *act[MLP_MAX_LAYERS + 1];
  void *act_lo[MLP_MAX_LAYERS + 1];
  float *target, *delta, *delta_prev;
  void *delta_lo, *delta_prev_lo;
  void *ones;
  float *loss;      /* device, one per micro-batch */
  float *loss_host; /* pinned */
  void *params[2 * MLP_MAX_LAYERS];
  int ids[2 * MLP_MAX_LAYERS];
  cudaStream_t stream;
  cublasHandle_t blas;
} gpu_model;

static int failed(int rank, const char *what, sg_status st) {
  return mlp_cli_failed("mlp_cuda", rank, what, st);
}

static int cuda_failed(int rank, const char *what, cudaError_t e) {
  fprintf(stderr, "mlp_cuda: rank %d: %s failed: %s\n", rank, what, cudaGetErrorString(e));
  return 1;
}

static int blas_failed(int rank, const char *what, cublasStatus_t s) {
  fprintf(stderr, "mlp_cuda: rank %d: %s failed: cuBLAS status %d\n", rank, what, (int)s);
  return 1;
}

#define CHECK(call)                     \
  do {                                  \
    sg_status st_ = (call);             \
    if (st_ != SG_OK) {                 \
      r->rc = failed(rank, #call, st_); \
      goto done;                        \
    }                                   \
  } while (0)

#define CU(call)                             \
  do {                                       \
    cudaError_t ce_ = (cudaError_t)(call);   \
    if (ce_ != cudaSuccess) {                \
      r->rc = cuda_failed(rank, #call, ce_); \
      goto done;                             \
    }                                        \
  } while (0)

#define BLAS(call)                             \
  do {                                         \
    cublasStatus_t bs_ = (call);               \
    if (bs_ != CUBLAS_STATUS_SUCCESS) {        \
      r->rc = blas_failed(rank, #call, bs_);   \
      goto done;                               \
    }                                          \
  } while (0)

/* C = op(A) op(B) in column-major terms, fp32 compute. A and B are f32 or bf16 (ab_bf16), C f32
 * or bf16 (c_bf16). The row-major layouts of the model map to these calls as noted at the
 * call sites. */
static cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const void *a, int lda, const void *b, int ldb,
                           int ab_bf16, void *c, int ldc, int c_bf16) {
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t ab = ab_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  return cublasGemmEx(h, ta, tb, m, n, k, &one, a, ab, lda, b, ab, ldb, &zero, c,
                      c_bf16 ? CUDA_R_16BF : CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

/* The GEMM input copy of an f32 buffer: its bf16 mirror in bf16 mode, else itself. */
static const void *lo(const gpu_model *g, const float *f, const void *mirror) {
  return g->bf16 ? mirror : (const void *)f;
}

static void gpu_free(gpu_model *g) {
  for (int l = 0; l <= MLP_MAX_LAYERS; l++) cudaFree(g->act[l]), cudaFree(g->act_lo[l]);
  cudaFree(g->target), cudaFree(g->delta), cudaFree(g->delta_prev);
  cudaFree(g->delta_lo), cudaFree(g->delta_prev_lo), cudaFree(g->ones), cudaFree(g->loss);
  cudaFreeHost(g->loss_host);
  if (g->blas) cublasDestroy(g->blas);
  if (g->stream) cudaStreamDestroy(g->stream);
  memset(g, 0, sizeof *g);
}

/* Device buffers for the model's shapes; cudaSuccess or the first error. */
static cudaError_t gpu_alloc(gpu_model *g, int micro) {
  const mlp_model *m = g->m;
  const size_t b = (size_t)m->batch, es = g->bf16 ? 2 : 4;
  size_t wide = 0;
  for (int l = 0; l <= m->layers; l++) wide = (size_t)m->dims[l] > wide ? (size_t)m->dims[l] : wide;
  cudaError_t e = cudaSuccess;
  for (int l = 0; l <= m->layers && !e; l++) {
    e = cudaMalloc((void **)&g->act[l], b * m->dims[l] * sizeof(float));
    if (!e && g->bf16) e = cudaMalloc(&g->act_lo[l], b * m->dims[l] * 2);
  }
  if (!e) e = cudaMalloc((void **)&g->target, b * MLP_OUT * sizeof(float));
  if (!e) e = cudaMalloc((void **)&g->delta, b * wide * sizeof(float));
  if (!e) e = cudaMalloc((void **)&g->delta_prev, b * wide * sizeof(float));
  if (!e && g->bf16) e = cudaMalloc(&g->delta_lo, b * wide * 2);
  if (!e && g->bf16) e = cudaMalloc(&g->delta_prev_lo, b * wide * 2);
  if (!e) e = cudaMalloc(&g->ones, b * es);
  if (!e) e = cudaMalloc((void **)&g->loss, (size_t)micro * sizeof(float));
  if (!e) e = cudaMallocHost((void **)&g->loss_host, (size_t)micro * sizeof(float));
  if (!e) e = (cudaError_t)mlpc_fill(g->stream, g->ones, g->bf16, b, 1.0f);
  return e;
}

/* Registers W0, b0, W1, b1, ... (as examples/mlp), finalizes, sets the initial values and
 * fetches the device pointers of the working parameters. */
static sg_status setup_params(gpu_model *g, sg_engine *e) {
  const mlp_model *m = g->m;
  sg_status st = SG_OK;
  for (int p = 0; p < m->nparams && st == SG_OK; p++) {
    char name[32];
    snprintf(name, sizeof name, "fc%d.%s", p / 2, p % 2 ? "bias" : "weight");
    st = sg_add_param(e, name, m->numel[p], p % 2 ? SG_PARAM_NO_DECAY : 0u, &g->ids[p]);
  }
  if (st == SG_OK) st = sg_finalize(e);
  float *tmp = NULL;
  for (int p = 0; p < m->nparams && st == SG_OK; p++) {
    float *v = realloc(tmp, m->numel[p] * sizeof(float));
    if (!v) {
      st = SG_ERR_OUT_OF_MEMORY;
      break;
    }
    tmp = v;
    mlp_init_param(m, p, tmp);
    st = sg_set_param(e, g->ids[p], tmp, SG_F32);
    if (st == SG_OK) st = sg_param_ptr(e, g->ids[p], &g->params[p]);
  }
  free(tmp);
  return st;
}

/* Forward of the current batch (already on the GPU): act[l+1] = act(act[l] W^T + b). Row-major
 * act[l] (batch x nin) is column-major nin x batch, W (nout x nin) is column-major nin x nout,
 * so act[l+1]^T = W^T act[l]^T is gemm(T, N, nout, batch, nin). */
static int forward(gpu_model *g, sg_engine *e, int rank) {
  const mlp_model *m = g->m;
  for (int l = 0; l < m->layers; l++) {
    /* --overlap-gather: the stream waits for this layer's all-gather only (else a no-op) */
    sg_status st = sg_param_wait(e, g->ids[2 * l]);
    if (st == SG_OK) st = sg_param_wait(e, g->ids[2 * l + 1]);
    if (st != SG_OK) return failed(rank, "sg_param_wait", st);
    const int nin = m->dims[l], nout = m->dims[l + 1], hidden = l + 1 < m->layers;
    cublasStatus_t bs = gemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, nout, m->batch, nin, g->params[2 * l],
                             nin, lo(g, g->act[l], g->act_lo[l]), nin, g->bf16, g->act[l + 1],
                             nout, 0);
    if (bs != CUBLAS_STATUS_SUCCESS) return blas_failed(rank, "forward gemm", bs);
    int e = mlpc_bias_act(g->stream, g->act[l + 1], hidden ? g->act_lo[l + 1] : NULL,
                          g->params[2 * l + 1], g->bf16, m->batch, nout, hidden);
    if (e) return cuda_failed(rank, "mlpc_bias_act", (cudaError_t)e);
  }
  return 0;
}

/* Gradients of layer l from delta (batch x nout): bias = delta^T 1 (gemm(N, N, nout, 1, batch)),
 * weight = delta^T act[l], column-major nin x nout = act[l]^T delta (gemm(N, T, nin, nout,
 * batch)); each written by the GEMM into the engine's slot, then marked ready. 0 on success. */
static int layer_grads(gpu_model *g, sg_engine *e, int l, int rank) {
  const mlp_model *m = g->m;
  const int nin = m->dims[l], nout = m->dims[l + 1];
  const void *d = lo(g, g->delta, g->delta_lo);
  void *slot = NULL;
  sg_status st = sg_grad_ptr(e, g->ids[2 * l + 1], &slot);
  if (st != SG_OK) return failed(rank, "sg_grad_ptr (bias)", st);
  cublasStatus_t bs = gemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, nout, 1, m->batch, d, nout, g->ones,
                           m->batch, g->bf16, slot, nout, g->bf16);
  if (bs != CUBLAS_STATUS_SUCCESS) return blas_failed(rank, "bias gradient gemm", bs);
  if ((st = sg_grad_ready(e, g->ids[2 * l + 1])) != SG_OK)
    return failed(rank, "sg_grad_ready (bias)", st);
  if ((st = sg_grad_ptr(e, g->ids[2 * l], &slot)) != SG_OK)
    return failed(rank, "sg_grad_ptr (weight)", st);
  bs = gemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, nin, nout, m->batch, lo(g, g->act[l], g->act_lo[l]),
            nin, d, nout, g->bf16, slot, nin, g->bf16);
  if (bs != CUBLAS_STATUS_SUCCESS) return blas_failed(rank, "weight gradient gemm", bs);
  if ((st = sg_grad_ready(e, g->ids[2 * l])) != SG_OK)
    return failed(rank, "sg_grad_ready (weight)", st);
  return 0;
}

/* delta_prev = (delta W) * tanh'(act[l]): column-major nin x batch = W delta^T, so
 * gemm(N, N, nin, batch, nout); then delta and delta_prev swap. */
static int propagate(gpu_model *g, int l, int rank) {
  const mlp_model *m = g->m;
  const int nin = m->dims[l], nout = m->dims[l + 1];
  cublasStatus_t bs = gemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, nin, m->batch, nout, g->params[2 * l],
                           nin, lo(g, g->delta, g->delta_lo), nout, g->bf16, g->delta_prev, nin, 0);
  if (bs != CUBLAS_STATUS_SUCCESS) return blas_failed(rank, "backward gemm", bs);
  int e = mlpc_tanh_grad(g->stream, g->delta_prev, g->delta_prev_lo, g->act[l],
                         (size_t)m->batch * nin);
  if (e) return cuda_failed(rank, "mlpc_tanh_grad", (cudaError_t)e);
  float *t = g->delta;
  g->delta = g->delta_prev, g->delta_prev = t;
  void *u = g->delta_lo;
  g->delta_lo = g->delta_prev_lo, g->delta_prev_lo = u;
  return 0;
}

/* One micro-batch: the rank's slice of the data stream (as examples/mlp), forward, MSE loss
 * into g->loss[mb], backward with gradients scaled by `scale` into the engine. */
static int micro_batch(gpu_model *g, sg_engine *e, const options *o, int step, int mb, int rank,
                       int world, float scale) {
  mlp_model *m = g->m;
  const uint64_t slot = ((uint64_t)step * (uint64_t)o->c.micro + (uint64_t)mb) * (uint64_t)world;
  mlp_make_batch(m, (slot + (uint64_t)rank) * (uint64_t)o->c.batch);
  const size_t nx = (size_t)m->batch * MLP_IN, ny = (size_t)m->batch * MLP_OUT;
  /* pageable sources: the copies are staged before they return, so the host may refill */
  cudaError_t ce = cudaMemcpyAsync(g->act[0], m->act[0], nx * 4, cudaMemcpyHostToDevice, g->stream);
  if (!ce) ce = cudaMemcpyAsync(g->target, m->target, ny * 4, cudaMemcpyHostToDevice, g->stream);
  if (!ce && g->bf16) ce = (cudaError_t)mlpc_to_bf16(g->stream, g->act_lo[0], g->act[0], nx);
  if (ce) return cuda_failed(rank, "batch upload", ce);
  if (forward(g, e, rank)) return 1;
  const float k = 2.0f * scale / (float)ny; /* d(mean of squares) */
  int ke = mlpc_mse(g->stream, g->act[m->layers], g->target, g->delta, g->delta_lo, (int)ny, k,
                    g->loss + mb);
  if (ke) return cuda_failed(rank, "mlpc_mse", (cudaError_t)ke);
  for (int l = m->layers - 1; l >= 0; l--) {
    if (layer_grads(g, e, l, rank)) return 1;
    if (l > 0 && propagate(g, l, rank)) return 1;
  }
  return 0;
}

static void make_config(const options *o, int gpu, sg_config *cfg) {
  mlp_cli_config(&o->c, cfg);
  cfg->device = SG_DEVICE_CUDA;
  cfg->cuda_device = gpu;
}

static void print_memory(const options *o, const mlp_model *m, const sg_memory_stats *mem,
                         const sg_memory_stats *ddp, int world, int gpu) {
  struct cudaDeviceProp prop;
  const int have_prop = cudaGetDeviceProperties(&prop, gpu) == cudaSuccess;
  printf("mlp_cuda: %s, W=%d (%s), %s params, %d layers x %d hidden, %zu params, batch %d x %d "
         "micro-batch(es) per rank, GPU %d (%s)\n",
         mlp_cli_strategy_name(o->c.strategy), world, o->g.nccl || o->g.nccl_solo ? "NCCL" : "threads on one GPU",
         o->c.dtype == SG_BF16 ? "bf16" : "f32", m->layers, o->c.hidden, m->total_numel, o->c.batch,
         o->c.micro, gpu, have_prop ? prop.name : "?");
  mlp_cli_print_memory(mem, ddp);
}

/* The step's mean loss over its micro-batches (waits for the stream: the loss is a host value). */
static int read_loss(gpu_model *g, int micro, int rank, float *loss) {
  cudaError_t ce = cudaMemcpyAsync(g->loss_host, g->loss, (size_t)micro * sizeof(float),
                                   cudaMemcpyDeviceToHost, g->stream);
  if (!ce) ce = cudaStreamSynchronize(g->stream);
  if (ce) return cuda_failed(rank, "loss read-back", ce);
  float s = 0.0f;
  for (int i = 0; i < micro; i++) s += g->loss_host[i];
  *loss = s / (float)micro;
  return 0;
}

static void *train(void *arg) {
  mlp_rank_run *r = arg;
  const options *o = r->o;
  const int rank = sg_comm_rank(r->comm), world = sg_comm_size(r->comm);
  sg_engine *e = NULL;
  mlp_model m;
  gpu_model g;
  memset(&g, 0, sizeof g);
  if (mlp_init(&m, o->c.layers, o->c.hidden, o->c.batch, o->c.seed) != 0) {
    fprintf(stderr, "mlp_cuda: rank %d: out of memory\n", rank);
    r->rc = 1;
    return NULL;
  }
  g.m = &m;
  g.bf16 = o->c.dtype == SG_BF16;
  sg_config cfg;
  CHECK(sg_config_init(&cfg, sizeof cfg));
  make_config(o, r->gpu, &cfg);
  /* The engine first: on a machine without a GPU it fails here with the library's message. */
  CHECK(sg_engine_create(r->comm, &cfg, &e));
  CU(cudaSetDevice(r->gpu));
  CU(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
  BLAS(cublasCreate(&g.blas));
  BLAS(cublasSetStream(g.blas, g.stream));
  CHECK(sg_set_stream(e, g.stream));
  CHECK(setup_params(&g, e));
  CU(gpu_alloc(&g, o->c.micro));

  sg_memory_stats mem = {.struct_size = sizeof mem}, ddp = {.struct_size = sizeof ddp};
  CHECK(sg_memory(e, &mem));
  sg_config ddp_cfg = cfg;
  ddp_cfg.strategy = SG_NO_SHARD;
  ddp_cfg.offload_optimizer = 0;
  CHECK(sg_estimate_memory(&ddp_cfg, m.numel, m.nparams, world, &ddp));
  if (rank == 0) print_memory(o, &m, &mem, &ddp, world, r->gpu);

  float first = 0.0f, last = 0.0f;
  int skipped = 0;
  const double t_start = mlp_cli_now_s();
  for (int step = 0; step < o->c.steps; step++) {
    const double t0 = mlp_cli_now_s();
    float scale = 1.0f;
    CHECK(sg_get_loss_scale(e, &scale));
    CHECK(mlp_cli_trace_step(&o->c, e, step, 0));
    for (int mb = 0; mb < o->c.micro; mb++) {
      CHECK(mlp_cli_trace_micro(&o->c, e, step, 0));
      if (micro_batch(&g, e, o, step, mb, rank, world, scale / (float)o->c.micro)) {
        r->rc = 1;
        goto done;
      }
      CHECK(sg_backward_end(e));
    }
    sg_step_info info = {.struct_size = sizeof info};
    CHECK(sg_step(e, &info));
    if (read_loss(&g, o->c.micro, rank, &last)) {
      r->rc = 1;
      goto done;
    }
    const double dt = mlp_cli_now_s() - t0;
    if (step == 0) first = last;
    skipped += info.skipped;
    if (rank == 0 && (step % o->c.log_every == 0 || step == o->c.steps - 1))
      printf("step %5d  loss %.6f  grad_norm %.5f  %.1f steps/s%s\n", step, (double)last,
             (double)info.grad_norm, 1.0 / dt, info.skipped ? "  (skipped: non-finite gradients)" : "");
  }
  const double rate = (double)o->c.steps / (mlp_cli_now_s() - t_start);
  CHECK(mlp_cli_trace_finish(&o->c, e, rank));
  if (rank == 0)
    r->rc = mlp_cli_report("mlp_cuda", &o->c, first, last, o->c.steps, rate, world, &mem, &ddp,
                           skipped);
done:
  if (g.stream) (void)cudaStreamSynchronize(g.stream); /* our kernels may still read the buffers */
  sg_engine_destroy(e);
  gpu_free(&g);
  mlp_free(&m);
  return NULL;
}

/* ---- command line -------------------------------------------------------------------------- */

static const mlp_cli_prog *prog_info(void);

static void usage(void) {
  printf("usage: mlp_cuda [options]: the MLP example with cuBLAS GEMMs on GPUs\n"
         "  --ranks N: N ranks as threads on GPU G (local communicator); --nccl: one rank per\n"
         "  process under mpirun, one GPU each (NCCL); --nccl-solo: one rank, an NCCL\n"
         "  communicator of world 1 on GPU G, no MPI (stream-ordered reductions on one GPU)\n"
         "  --nccl              one rank per process under mpirun, one GPU each\n"
         "  --nccl-solo         one rank on GPU G over an NCCL communicator of world 1\n"
         "  --gpu G             the GPU of --ranks and --nccl-solo (default 0)\n");
  mlp_cli_help_common(stdout, prog_info());
}

static int switch_flag(void *opts, const char *flag) {
  return mlp_gpu_switch_flag(&((options *)opts)->g, flag);
}

static int value_flag(void *opts, const char *flag, const char *v, int *bad) {
  options *o = opts;
  if (strcmp(flag, "--gpu")) return 0;
  *bad = mlp_cli_parse_int(v, 0, 1023, &o->g.gpu) != 0;
  return 1;
}

/* f16 needs loss scaling, which this example does not do: --dtype takes f32 and bf16 only. */
static const mlp_cli_prog *prog_info(void) {
  static const char *const values[] = {"--gpu", "a GPU index in 0..1023", NULL};
  static const mlp_cli_prog prog = {.name = "mlp_cuda",
                                    .max_ranks = 64,
                                    .n_dtypes = 2,
                                    .usage = usage,
                                    .switch_flag = switch_flag,
                                    .value_flag = value_flag,
                                    .value_flags = values};
  return &prog;
}

/* Under mpirun or srun only --nccl makes the processes one training. */
static int parse_args(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  if (mlp_cli_parse(prog_info(), argc, argv, &o->c, o) != 0) return -1;
  return mlp_gpu_check_launch("mlp_cuda", &o->g, &o->c);
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) return 64;
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* Ranks as threads on one GPU: NCCL refuses two ranks on one device, the local communicator
   * does not. */
  return mlp_gpu_run("mlp_cuda", &o, &o.g, o.c.ranks, train);
}
