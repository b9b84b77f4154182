/* mlp_cuda: the MLP of examples/mlp trained on GPUs, with forward and backward as cuBLAS GEMMs.
 *
 *   mlp_cuda --ranks 2 --dtype bf16                 (2 ranks as threads on one GPU, local comm)
 *   mpirun -np 8 mlp_cuda --nccl                    (one GPU per rank, NCCL)
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
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef MLP_CUDA_HAVE_MPI
#include <mpi.h>
#endif

#include "mlp_cuda_kernels.h"
#include "mlp_model.h"
#include "shardgrad.h"

typedef struct options {
  sg_strategy strategy;
  sg_dtype dtype; /* SG_F32 or SG_BF16 */
  int ranks, nccl, gpu, steps, micro, batch, hidden, layers, check, log_every;
  double bucket_mb;
  float lr, clip;
  uint64_t seed;
} options;

typedef struct rank_run {
  const options *o;
  sg_comm *comm;
  int gpu; /* the GPU this rank computes on */
  int rc;  /* 0 ok, 1 a call failed, 2 --check failed */
} rank_run;

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

static const char *strategy_name(sg_strategy s) {
  return s == SG_NO_SHARD ? "NO_SHARD" : s == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP";
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

static int failed(int rank, const char *what, sg_status st) {
  fprintf(stderr, "mlp_cuda: rank %d: %s failed: %s: %s\n", rank, what, sg_status_string(st),
          sg_last_error());
  return 1;
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
static int forward(gpu_model *g, int rank) {
  const mlp_model *m = g->m;
  for (int l = 0; l < m->layers; l++) {
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
  const uint64_t slot = ((uint64_t)step * (uint64_t)o->micro + (uint64_t)mb) * (uint64_t)world;
  mlp_make_batch(m, (slot + (uint64_t)rank) * (uint64_t)o->batch);
  const size_t nx = (size_t)m->batch * MLP_IN, ny = (size_t)m->batch * MLP_OUT;
  /* pageable sources: the copies are staged before they return, so the host may refill */
  cudaError_t ce = cudaMemcpyAsync(g->act[0], m->act[0], nx * 4, cudaMemcpyHostToDevice, g->stream);
  if (!ce) ce = cudaMemcpyAsync(g->target, m->target, ny * 4, cudaMemcpyHostToDevice, g->stream);
  if (!ce && g->bf16) ce = (cudaError_t)mlpc_to_bf16(g->stream, g->act_lo[0], g->act[0], nx);
  if (ce) return cuda_failed(rank, "batch upload", ce);
  if (forward(g, rank)) return 1;
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
  cfg->strategy = o->strategy;
  cfg->device = SG_DEVICE_CUDA;
  cfg->cuda_device = gpu;
  cfg->param_dtype = o->dtype;
  cfg->grad_dtype = o->dtype;
  cfg->reduce_dtype = o->dtype;
  cfg->bucket_bytes = (size_t)(o->bucket_mb * 1024.0 * 1024.0);
  cfg->lr = o->lr;
  cfg->max_grad_norm = o->clip;
  cfg->seed = o->seed;
  cfg->timeout_ms = 120000; /* a failed rank makes the others fail within 2 minutes, not hang */
}

static void print_memory(const options *o, const mlp_model *m, const sg_memory_stats *mem,
                         const sg_memory_stats *ddp, int world, int gpu) {
  struct cudaDeviceProp prop;
  const int have_prop = cudaGetDeviceProperties(&prop, gpu) == cudaSuccess;
  printf("mlp_cuda: %s, W=%d (%s), %s params, %d layers x %d hidden, %zu params, batch %d x %d "
         "micro-batch(es) per rank, GPU %d (%s)\n",
         strategy_name(o->strategy), world, o->nccl ? "NCCL" : "threads on one GPU",
         o->dtype == SG_BF16 ? "bf16" : "f32", m->layers, o->hidden, m->total_numel, o->batch,
         o->micro, gpu, have_prop ? prop.name : "?");
  printf("memory per rank: %.3f MiB (params %.3f, grads %.3f, master %.3f, optim %.3f, comm %.3f)"
         " vs %.3f MiB with NO_SHARD\n",
         mib(mem->total_bytes), mib(mem->params_bytes), mib(mem->grads_bytes),
         mib(mem->master_bytes), mib(mem->optim_bytes), mib(mem->comm_bytes),
         mib(ddp->total_bytes));
  printf("loss below is rank 0's local loss (each rank trains on its own slice of the data)\n");
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
  rank_run *r = arg;
  const options *o = r->o;
  const int rank = sg_comm_rank(r->comm), world = sg_comm_size(r->comm);
  sg_engine *e = NULL;
  mlp_model m;
  gpu_model g;
  memset(&g, 0, sizeof g);
  if (mlp_init(&m, o->layers, o->hidden, o->batch, o->seed) != 0) {
    fprintf(stderr, "mlp_cuda: rank %d: out of memory\n", rank);
    r->rc = 1;
    return NULL;
  }
  g.m = &m;
  g.bf16 = o->dtype == SG_BF16;
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
  CU(gpu_alloc(&g, o->micro));

  sg_memory_stats mem = {.struct_size = sizeof mem}, ddp = {.struct_size = sizeof ddp};
  CHECK(sg_memory(e, &mem));
  sg_config ddp_cfg = cfg;
  ddp_cfg.strategy = SG_NO_SHARD;
  CHECK(sg_estimate_memory(&ddp_cfg, m.numel, m.nparams, world, &ddp));
  if (rank == 0) print_memory(o, &m, &mem, &ddp, world, r->gpu);

  float first = 0.0f, last = 0.0f;
  int skipped = 0;
  const double t_start = now_s();
  for (int step = 0; step < o->steps; step++) {
    const double t0 = now_s();
    float scale = 1.0f;
    CHECK(sg_get_loss_scale(e, &scale));
    for (int mb = 0; mb < o->micro; mb++) {
      if (micro_batch(&g, e, o, step, mb, rank, world, scale / (float)o->micro)) {
        r->rc = 1;
        goto done;
      }
      CHECK(sg_backward_end(e));
    }
    sg_step_info info = {.struct_size = sizeof info};
    CHECK(sg_step(e, &info));
    if (read_loss(&g, o->micro, rank, &last)) {
      r->rc = 1;
      goto done;
    }
    const double dt = now_s() - t0;
    if (step == 0) first = last;
    skipped += info.skipped;
    if (rank == 0 && (step % o->log_every == 0 || step == o->steps - 1))
      printf("step %5d  loss %.6f  grad_norm %.5f  %.1f steps/s%s\n", step, (double)last,
             (double)info.grad_norm, 1.0 / dt, info.skipped ? "  (skipped: non-finite gradients)" : "");
  }
  const double rate = (double)o->steps / (now_s() - t_start);
  if (rank == 0) {
    printf("loss %.4g -> %.4g (%.1fx lower) in %d steps, %.1f steps/s, %s, W=%d, %.3f MiB/rank "
           "vs %.3f MiB NO_SHARD%s\n",
           (double)first, (double)last, (double)(first / last), o->steps, rate,
           strategy_name(o->strategy), world, mib(mem.total_bytes), mib(ddp.total_bytes),
           skipped ? " (some steps skipped)" : "");
    if (o->check && !(last < 0.5f * first)) {
      fprintf(stderr, "mlp_cuda: --check failed: final loss %g is not below 0.5 x first loss %g\n",
              (double)last, (double)first);
      r->rc = 2;
    }
  }
done:
  if (g.stream) (void)cudaStreamSynchronize(g.stream); /* our kernels may still read the buffers */
  sg_engine_destroy(e);
  gpu_free(&g);
  mlp_free(&m);
  return NULL;
}

/* ---- command line -------------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: mlp_cuda [--ranks N [--gpu G] | --nccl] [--strategy no_shard|shard_opt|"
          "shard_grad_op]\n"
          "                [--dtype f32|bf16] [--steps N] [--micro-batches N] [--batch N]\n"
          "                [--hidden N] [--layers N] [--bucket-mb X] [--lr X] [--clip X]\n"
          "                [--seed N] [--log-every N] [--check]\n"
          "  --ranks N: N ranks as threads on GPU G (local communicator); --nccl: one rank per\n"
          "  process under mpirun, one GPU each (NCCL)\n");
}

static int parse_int(const char *s, int lo_, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo_ || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static int parse_num(const char *s, double lo_, double *out) {
  char *end = NULL;
  errno = 0;
  const double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo_)) return -1;
  *out = v;
  return 0;
}

static int parse_enum(const char *s, const char *const *names, int n, int *out) {
  for (int i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = i;
      return 0;
    }
  return -1;
}

static int parse_value(options *o, const char *flag, const char *v) {
  static const char *const strategies[] = {"no_shard", "shard_opt", "shard_grad_op"};
  static const char *const dtypes[] = {"f32", "bf16"}; /* f16 needs loss scaling: not here */
  double d = 0.0;
  int i = 0, rc = 0;
  if (!strcmp(flag, "--strategy")) {
    rc = parse_enum(v, strategies, 3, &i);
    o->strategy = (sg_strategy)i;
  } else if (!strcmp(flag, "--dtype")) {
    rc = parse_enum(v, dtypes, 2, &i);
    o->dtype = (sg_dtype)i;
  } else if (!strcmp(flag, "--ranks"))
    rc = parse_int(v, 1, 64, &o->ranks);
  else if (!strcmp(flag, "--gpu"))
    rc = parse_int(v, 0, 1023, &o->gpu);
  else if (!strcmp(flag, "--steps"))
    rc = parse_int(v, 1, 100000000, &o->steps);
  else if (!strcmp(flag, "--micro-batches"))
    rc = parse_int(v, 1, 1000000, &o->micro);
  else if (!strcmp(flag, "--batch"))
    rc = parse_int(v, 1, 1 << 20, &o->batch);
  else if (!strcmp(flag, "--hidden"))
    rc = parse_int(v, 1, 1 << 16, &o->hidden);
  else if (!strcmp(flag, "--layers"))
    rc = parse_int(v, 1, MLP_MAX_LAYERS, &o->layers);
  else if (!strcmp(flag, "--log-every"))
    rc = parse_int(v, 1, 1 << 30, &o->log_every);
  else if (!strcmp(flag, "--bucket-mb"))
    rc = parse_num(v, 1e-6, &o->bucket_mb);
  else if (!strcmp(flag, "--lr")) {
    rc = parse_num(v, 0.0, &d);
    o->lr = (float)d;
  } else if (!strcmp(flag, "--clip")) {
    rc = parse_num(v, 0.0, &d);
    o->clip = (float)d;
  } else if (!strcmp(flag, "--seed")) {
    rc = parse_num(v, 0.0, &d);
    o->seed = (uint64_t)d;
  } else
    rc = -1;
  if (rc) fprintf(stderr, "mlp_cuda: bad value for %s: '%s'\n", flag, v);
  return rc;
}

static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.strategy = SG_SHARD_GRAD_OP,
                 .dtype = SG_F32,
                 .ranks = 2,
                 .steps = 200,
                 .micro = 1,
                 .batch = 32,
                 .hidden = 128,
                 .layers = 3,
                 .bucket_mb = 0.25,
                 .lr = 3e-3f,
                 .clip = 1.0f,
                 .seed = 1,
                 .log_every = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--nccl"))
      o->nccl = 1;
    else if (!strcmp(a, "--check"))
      o->check = 1;
    else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage();
      exit(0);
    } else if (!strncmp(a, "--", 2) && i + 1 < argc) {
      if (parse_value(o, a, argv[++i])) return -1;
    } else {
      fprintf(stderr, "mlp_cuda: unknown argument '%s'\n", a);
      return -1;
    }
  }
  return 0;
}

/* Ranks as threads on one GPU: NCCL refuses two ranks on one device, the local communicator
 * does not. */
static int run_threads(const options *o) {
  sg_comm **comms = calloc((size_t)o->ranks, sizeof *comms);
  rank_run *runs = calloc((size_t)o->ranks, sizeof *runs);
  pthread_t *th = calloc((size_t)o->ranks, sizeof *th);
  int rc = 1, started = 0;
  if (!comms || !runs || !th) goto done;
  const sg_status st = sg_comm_create_local(o->ranks, comms);
  if (st != SG_OK) {
    failed(0, "sg_comm_create_local", st);
    goto done;
  }
  for (; started < o->ranks; started++) {
    runs[started] = (rank_run){.o = o, .comm = comms[started], .gpu = o->gpu};
    if (pthread_create(&th[started], NULL, train, &runs[started]) != 0) break;
  }
  rc = started == o->ranks ? 0 : 1;
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    if (runs[i].rc > rc) rc = runs[i].rc;
  }
  for (int i = 0; i < o->ranks; i++) sg_comm_destroy(comms[i]);
done:
  free(comms);
  free(runs);
  free(th);
  return rc;
}

#ifdef MLP_CUDA_HAVE_MPI
/* The GPU the library gives this rank: (rank within its node) mod (GPUs on the node). */
static int node_local_gpu(void) {
  MPI_Comm node;
  int local = 0, count = 0;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
      MPI_SUCCESS) {
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
  }
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) count = 1;
  return local % count;
}

static int run_nccl(const options *o) {
  int provided = 0, rc = 1;
  if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    fprintf(stderr, "mlp_cuda: MPI_Init_thread failed\n");
    return 1;
  }
  rank_run run = {.o = o};
  const sg_status st = sg_comm_create_nccl_mpi(NULL, &run.comm);
  if (st != SG_OK) {
    rc = failed(-1, "sg_comm_create_nccl_mpi", st);
    goto done;
  }
  run.gpu = node_local_gpu();
  train(&run);
  rc = run.rc;
done:
  sg_comm_destroy(run.comm);
  MPI_Finalize(); /* we initialized MPI; the NCCL communicator used it only to start */
  return rc;
}
#else
static int run_nccl(const options *o) {
  (void)o;
  fprintf(stderr, "mlp_cuda: --nccl needs MPI: this example was built without it\n");
  return 1;
}
#endif

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) {
    usage();
    return 64;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  return o.nccl ? run_nccl(&o) : run_threads(&o);
}
