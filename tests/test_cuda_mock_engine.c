/* The engine on the CUDA device, without a GPU: the mock CUDA runtime and mock NCCL of
 * tests/cudamock (lazy streams over host memory, the emulated CUDA kernels, ranks as threads)
 * under src/device/cuda.c and src/comm/nccl.c. Each case trains W ranks (threads) on
 * SG_DEVICE_CPU with the local communicator (the reference), then on SG_DEVICE_CUDA with the
 * local communicator (host-driven comm jobs) and with the NCCL one (stream-ordered comm jobs),
 * with the same gradients; parameters, master weights and AdamW moments must agree bit for bit
 * (the CUDA kernels and the CPU kernels run the same element math, and the mock NCCL sums like
 * the local communicator), the reported gradient norm within 1e-6 (its sum of squares is
 * partitioned differently). With overlap_param_gather the forward pass of every step reads each
 * parameter on the caller's stream right after sg_param_wait: the bytes read must be those of
 * the CPU run.
 *
 * Gradients reach the CUDA engine the way a training program's kernels would: in stream order
 * on the caller's stream (sg_set_stream): a host function fills a pinned buffer, a copy moves
 * it into an sg_grad_ptr slot or into a device buffer passed to sg_grad_add. Since the mock runs
 * stream work only when something waits for it, a dependency the engine fails to express (an
 * event between its streams, a wait before reading) shows up as wrong numbers here.
 *
 * Optimizer offload (cfg.offload_optimizer): every sharded case runs once more on each CUDA
 * communicator with the master, moments and accumulator in pinned host memory; the results must
 * be those of the same run without offload, bit for bit, and sg_memory must count the host
 * arrays (host_bytes) instead of the device's, as sg_estimate_memory does. The CPU reference
 * runs with offload_optimizer set where the strategy is sharded (accepted, changes nothing).
 * Cases with `groups` give two parameters groups of their own lr and weight decay. Cases with
 * `ckpt` save after training, load into a second engine with the other offload
 * setting, and step both once more: state and the next step bitwise equal.
 *
 * Built a second time against the real CUDA runtime and NCCL (SG_TEST_REAL_GPU, target
 * test_cuda_engine, run by tests/gpu/run.sh): the same comparisons on a GPU, where NCCL runs
 * only at W = 1 (it refuses two ranks on one GPU). */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* rmdir */

#include <cuda_runtime.h> /* streams, host functions, device buffers (the mock's, or CUDA's) */
#ifndef SG_TEST_REAL_GPU
#include <nccl.h> /* the mock's: sg_ncclmock_live */
#endif

#include "shardgrad.h"
#include "sg_elem.h"       /* sg_elem_store: gradients in their dtype */
#include "sg_test_check.h" /* CHECK, counted under one lock across threads */
#include "sg_test_state.h" /* reading and freeing the engine's state */

#define NP 6
#define MAXW 3
#define STEPS 3
static const size_t k_sizes[NP] = {1, 63, 1000, 4097, 100, 30011};

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

typedef struct tcase {
  const char *name;
  sg_strategy strategy;
  sg_dtype pdt, gdt, adt;
  int world, mb, nosync;
  int overlap; /* overlap_param_gather: the next forward pass reads each parameter on the
                  caller's stream right after sg_param_wait */
  float clip;   /* max_grad_norm */
  int inf_step; /* > 0: rank 0 writes an inf into a gradient of that step (dynamic loss scale
                   for f16: the step is skipped) */
  int ckpt;     /* save, load into an engine with the other offload setting, one more step */
  int groups;   /* p3 in parameter group 1, p4 in group 2, each with its own lr and decay */
} tcase;

typedef struct result {
  float *param[NP], *master[NP], *m[NP], *v[NP];
  float norm[STEPS + 1];
  int skipped;
  uint64_t fwd_hash[STEPS]; /* overlap: the bytes each step's forward pass read */
} result;

typedef struct rank_arg {
  const tcase *tc;
  sg_comm *comm;
  int cuda;
  int offload;
  const char *ckpt_dir; /* tc->ckpt: the checkpoint this run writes */
  int rank;
  const unsigned char *nccl_id; /* NCCL: the rank creates its communicator */
  result res;
  char err[512];
} rank_arg;

static float grad_val(int rank, int step, int k, int p, size_t i) {
  uint64_t x = ((uint64_t)rank * 1000003u + (uint64_t)step * 7919u + (uint64_t)k * 104729u +
                (uint64_t)p * 15485863u + i) *
               0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return (float)((double)(x >> 11) * 0x1.0p-53 - 0.5);
}

/* ---- gradient writers queued on the caller's stream -------------------------------------- */

typedef struct gwrite {
  void *dst;
  sg_dtype dtype;
  size_t n;
  int rank, step, k, p;
  int inf; /* element 0 is +inf */
} gwrite;

static void CUDART_CB gwrite_fn(void *arg) {
  gwrite *w = (gwrite *)arg;
  for (size_t i = 0; i < w->n; i++)
    sg_elem_store(w->dst, w->dtype, i, grad_val(w->rank, w->step, w->k, w->p, i));
  if (w->inf) sg_elem_store(w->dst, w->dtype, 0, INFINITY);
  free(w);
}

/* Writes the gradient of param p into dst: now (CPU), or on stream s: a host function fills
 * the pinned buffer `stage`, then a copy moves it to device memory (stream order makes both
 * reuses of `stage` safe). */
static void write_grad(void *dst, sg_dtype dt, cudaStream_t s, void *stage, int rank, int step,
                       int k, int p, int inf) {
  gwrite *w = (gwrite *)malloc(sizeof *w);
  gwrite tmp = {s ? stage : dst, dt, k_sizes[p], rank, step, k, p, inf};
  *w = tmp;
  if (!s) {
    gwrite_fn(w);
    return;
  }
  cudaLaunchHostFunc(s, gwrite_fn, w);
  cudaMemcpyAsync(dst, stage, k_sizes[p] * (dt == SG_F32 ? 4 : 2), cudaMemcpyHostToDevice, s);
}

/* ---- one rank -------------------------------------------------------------------------------- */

static sg_status setup(rank_arg *a, int offload, sg_engine **e, int *ids, sg_config *cfg_out) {
  const tcase *tc = a->tc;
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = tc->strategy;
  cfg.device = a->cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg.param_dtype = tc->pdt;
  cfg.grad_dtype = tc->gdt;
  cfg.reduce_dtype = tc->gdt;
  cfg.accum_dtype = tc->adt;
  cfg.bucket_bytes = 8192;
  cfg.lr = 0.01f;
  cfg.loss_scale = tc->pdt == SG_F16 ? 0.0f : 1.0f; /* f16: dynamic */
  cfg.timeout_ms = 60000;
  cfg.overlap_param_gather = tc->overlap;
  cfg.max_grad_norm = tc->clip;
  cfg.offload_optimizer = offload;
  *cfg_out = cfg;
  if ((st = sg_engine_create(a->comm, &cfg, e))) return st;
  for (int p = 0; p < NP && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(*e, name, k_sizes[p], p % 3 == 1 ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st && tc->groups) st = sg_set_param_group(*e, ids[3], 1);
  if (!st && tc->groups) st = sg_set_param_group(*e, ids[4], 2);
  if (!st) st = sg_finalize(*e);
  if (!st && tc->groups) st = sg_set_group(*e, 1, 0.03f, 0.0f);
  if (!st && tc->groups) st = sg_set_group(*e, 2, 0.004f, 0.3f);
  float *init = (float *)malloc(k_sizes[NP - 1] * sizeof *init);
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) init[i] = 0.01f * (float)((i * 37 + (size_t)p) % 101);
    st = sg_set_param(*e, ids[p], init, SG_F32);
  }
  free(init);
  return st;
}

/* Even params through sg_grad_ptr, odd ones through sg_grad_add from a buffer of the device. */
static sg_status micro_batch(rank_arg *a, sg_engine *e, const int *ids, void *const *src,
                             void *const *stage, cudaStream_t s, int step, int k) {
  const int rank = sg_comm_rank(a->comm);
  const sg_dtype gdt = a->tc->gdt;
  sg_status st = SG_OK;
  if (a->tc->nosync) st = sg_set_sync(e, k == a->tc->mb - 1);
  for (int p = NP - 1; p >= 0 && !st; p--) {
    const int inf = a->tc->inf_step > 0 && a->tc->inf_step == step && rank == 0 && k == 0 && p == 2;
    if (p % 2 == 0) {
      void *g = NULL;
      st = sg_grad_ptr(e, ids[p], &g);
      if (!st) write_grad(g, gdt, s, stage[p], rank, step, k, p, inf);
      if (!st) st = sg_grad_ready(e, ids[p]);
    } else {
      write_grad(src[p], gdt, s, stage[p], rank, step, k, p, inf);
      st = sg_grad_add(e, ids[p], src[p], gdt);
    }
  }
  return st;
}

/* The forward pass with overlap_param_gather: each parameter is copied to the host on the
 * caller's stream right after sg_param_wait. On the mock a gather the stream was not ordered
 * after has not run yet when the copy does: the hash then differs from the CPU run's. */
static sg_status forward_read(rank_arg *a, sg_engine *e, const int *ids, cudaStream_t s,
                              uint64_t *hash) {
  const size_t psz = a->tc->pdt == SG_F32 ? 4 : 2;
  unsigned char *h = (unsigned char *)malloc(k_sizes[NP - 1] * 4);
  sg_status st = h ? SG_OK : SG_ERR_OUT_OF_MEMORY;
  uint64_t x = 1469598103934665603ull;
  for (int p = 0; p < NP && !st; p++) {
    void *dev = NULL;
    st = sg_param_wait(e, ids[p]);
    if (!st) st = sg_param_ptr(e, ids[p], &dev);
    if (st) break;
    if (s) {
      /* polled: the mock's streams move only when queried (a gather needs every rank's) */
      cudaError_t ce = cudaMemcpyAsync(h, dev, k_sizes[p] * psz, cudaMemcpyDeviceToHost, s);
      for (long spin = 0; ce == cudaSuccess; spin++) {
        if ((ce = cudaStreamQuery(s)) != cudaErrorNotReady) break;
        if (spin == 100000000) break; /* a stream that never finishes: fail, do not hang */
        ce = cudaSuccess;
        sched_yield();
      }
      if (ce != cudaSuccess) {
        st = SG_ERR_CUDA;
        h = NULL; /* the copy may still come: leaked rather than freed under it */
        break;
      }
    } else {
      memcpy(h, dev, k_sizes[p] * psz);
    }
    for (size_t i = 0; i < k_sizes[p] * psz; i++) x = (x ^ h[i]) * 1099511628211ull;
  }
  free(h);
  *hash = x;
  return st;
}

static sg_status collect(sg_engine *e, const int *ids, result *r) {
  return sg_test_read_state(e, ids, k_sizes, NP, SG_TEST_STATE_OF(r));
}

static size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

/* sg_memory equals sg_estimate_memory; offloaded on CUDA: no device master or moments, the
 * device accumulator gone from grads, and host_bytes = (A + 8 + 4 unless f32) x shard + the
 * pipeline's buffers (2 landing buffers of the largest slice in reduce dtype, a ring of 3
 * chunks of min(slice, 2M) working values). The largest bucket is p5's own: 30011 elements
 * padded to 64 W. */
static void check_memory(rank_arg *a, sg_engine *e, const sg_config *cfg) {
  const tcase *tc = a->tc;
  sg_memory_stats m, est, plain;
  memset(&m, 0, sizeof m);
  m.struct_size = est.struct_size = plain.struct_size = sizeof m;
  sg_config pc = *cfg;
  pc.offload_optimizer = 0;
  int ok = sg_memory(e, &m) == SG_OK &&
           sg_estimate_memory(cfg, k_sizes, NP, tc->world, &est) == SG_OK &&
           sg_estimate_memory(&pc, k_sizes, NP, tc->world, &plain) == SG_OK;
  ok = ok && m.params_bytes == est.params_bytes && m.grads_bytes == est.grads_bytes &&
       m.master_bytes == est.master_bytes && m.optim_bytes == est.optim_bytes &&
       m.comm_bytes == est.comm_bytes && m.total_bytes == est.total_bytes &&
       m.host_bytes == est.host_bytes && m.shard_numel == est.shard_numel;
  const size_t P = tc->pdt == SG_F32 ? 4 : 2, A = tc->adt == SG_F32 ? 4 : 2;
  const size_t R = tc->gdt == SG_F32 ? 4 : 2;
  const size_t maxw = round_up(30011, 64 * (size_t)tc->world) / (size_t)tc->world;
  const size_t chunk = maxw < ((size_t)2 << 20) ? maxw : (size_t)2 << 20;
  const size_t host = (A + 8 + (P < 4 ? 4 : 0)) * m.shard_numel + 2 * maxw * R + 3 * chunk * P;
  const int off = a->cuda && a->offload;
  if (off)
    ok = ok && m.master_bytes == 0 && m.optim_bytes == 0 && m.host_bytes == host &&
         m.params_bytes == plain.params_bytes && m.comm_bytes == plain.comm_bytes &&
         m.grads_bytes == plain.grads_bytes - round_up(A * m.shard_numel, 256);
  else
    ok = ok && m.host_bytes == 0 && m.total_bytes == plain.total_bytes;
  char what[300];
  snprintf(what, sizeof what, "%s rank %d (%s%s): sg_memory == sg_estimate_memory, host_bytes "
           "%zu (formula %zu)", tc->name, a->rank, a->cuda ? "cuda" : "cpu",
           a->offload ? ", offload" : "", m.host_bytes, off ? host : (size_t)0);
  check(ok, what);
}

static void free_result(result *r) { sg_test_free_state(NP, SG_TEST_STATE_OF(r)); }

static int same_result(const result *x, const result *y) {
  for (int p = 0; p < NP; p++) {
    const size_t n = k_sizes[p] * 4;
    if (memcmp(x->param[p], y->param[p], n) || memcmp(x->master[p], y->master[p], n) ||
        memcmp(x->m[p], y->m[p], n) || memcmp(x->v[p], y->v[p], n))
      return 0;
  }
  return 1;
}

static sg_status one_step(rank_arg *a, sg_engine *e, const int *ids, void *const *src,
                          void *const *stage, cudaStream_t s, int step, sg_step_info *info) {
  sg_status st = SG_OK;
  for (int k = 0; k < a->tc->mb && !st; k++) st = micro_batch(a, e, ids, src, stage, s, step, k);
  memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
  return st ? st : sg_step(e, info);
}

/* The checkpoint of e (trained, state in a->res) loaded into an engine with the other offload
 * setting: the same state, then one more step on both gives the same bits. */
static sg_status cross_load(rank_arg *a, sg_engine *e, const int *ids, void *const *src,
                            void *const *stage, cudaStream_t s) {
  sg_engine *e2 = NULL;
  int ids2[NP];
  result r2, n1, n2;
  memset(&r2, 0, sizeof r2), memset(&n1, 0, sizeof n1), memset(&n2, 0, sizeof n2);
  sg_config c2;
  sg_status st = sg_save(e, a->ckpt_dir);
  if (!st) st = setup(a, !a->offload, &e2, ids2, &c2);
  if (!st && s) st = sg_set_stream(e2, s);
  if (!st) st = sg_load(e2, a->ckpt_dir);
  if (!st) st = collect(e2, ids2, &r2);
  char what[200];
  snprintf(what, sizeof what, "%s rank %d: a checkpoint saved %s offload loads %s it bitwise",
           a->tc->name, a->rank, a->offload ? "with" : "without", a->offload ? "without" : "with");
  if (!st) check(same_result(&a->res, &r2), what);
  sg_step_info i1, i2;
  if (!st) st = one_step(a, e, ids, src, stage, s, STEPS, &i1);
  if (!st) st = one_step(a, e2, ids2, src, stage, s, STEPS, &i2);
  if (!st) st = collect(e, ids, &n1);
  if (!st) st = collect(e2, ids2, &n2);
  snprintf(what, sizeof what, "%s rank %d: the next step after the cross-load is bitwise the "
           "saving engine's (step %llu, loss scale %g)", a->tc->name, a->rank,
           (unsigned long long)i1.step, (double)i1.loss_scale);
  if (!st) check(same_result(&n1, &n2) && i1.step == i2.step && i1.loss_scale == i2.loss_scale &&
                 i1.skipped == i2.skipped, what);
  sg_engine_destroy(e2);
  free_result(&r2), free_result(&n1), free_result(&n2);
  return st;
}

static void *rank_main(void *arg) {
  rank_arg *a = (rank_arg *)arg;
  sg_engine *e = NULL;
  int ids[NP];
  void *src[NP] = {0}, *stage[NP] = {0};
  cudaStream_t s = NULL;
  sg_config cfg;
  sg_status st = SG_OK;
  if (a->nccl_id) st = sg_comm_create_nccl(a->rank, a->tc->world, a->nccl_id, 0, &a->comm);
  if (!st) st = setup(a, a->offload, &e, ids, &cfg);
  if (!st) check_memory(a, e, &cfg);
  if (!st && a->cuda) {
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    st = sg_set_stream(e, s);
  }
  for (int p = 0; p < NP && !st; p++) {
    size_t bytes = k_sizes[p] * 4;
    if (a->cuda ? cudaMalloc(&src[p], bytes) != cudaSuccess : !(src[p] = malloc(bytes)))
      st = SG_ERR_OUT_OF_MEMORY;
    if (a->cuda && cudaMallocHost(&stage[p], bytes) != cudaSuccess) st = SG_ERR_OUT_OF_MEMORY;
  }
  for (int step = 0; step < STEPS && !st; step++) {
    if (a->tc->overlap && step > 0) st = forward_read(a, e, ids, s, &a->res.fwd_hash[step]);
    sg_step_info info;
    if (!st) st = one_step(a, e, ids, src, stage, s, step, &info);
    a->res.norm[step] = info.grad_norm;
    a->res.skipped += !st && info.skipped;
  }
  if (!st) st = collect(e, ids, &a->res);
  if (!st && a->tc->ckpt) st = cross_load(a, e, ids, src, stage, s);
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  if (s) cudaStreamSynchronize(s); /* host functions may still use the staging buffers */
  for (int p = 0; p < NP; p++) {
    a->cuda ? (void)cudaFree(src[p]) : free(src[p]);
    if (stage[p]) cudaFreeHost(stage[p]);
  }
  if (s) cudaStreamDestroy(s);
  if (a->nccl_id) sg_comm_destroy(a->comm);
  return NULL;
}

enum { RUN_CPU, RUN_CUDA_LOCAL, RUN_CUDA_NCCL, RUN_OFF_LOCAL, RUN_OFF_NCCL };
static const char *const k_runs[] = {"cpu+local", "cuda+local", "cuda+nccl", "cuda+local+offload",
                                     "cuda+nccl+offload"};

static int sharded(const tcase *tc) { return tc->strategy != SG_NO_SHARD; }

/* W ranks of one kind; 0 when anything failed (reported). */
static int run(const tcase *tc, int kind, rank_arg *args) {
  sg_comm *comms[MAXW] = {0};
  unsigned char id[128];
  pthread_t th[MAXW];
  char what[800]; /* the case, the run and a rank's error text (512) */
  const int nccl = kind == RUN_CUDA_NCCL || kind == RUN_OFF_NCCL;
  char dir[64] = "/tmp/sg_cuda_engine_XXXXXX";
  if (tc->ckpt && !mkdtemp(dir)) {
    check(0, "mkdtemp");
    return 0;
  }
  if (nccl ? sg_nccl_unique_id(id) != SG_OK : sg_comm_create_local(tc->world, comms) != SG_OK) {
    check(0, "communicator");
    return 0;
  }
  for (int r = 0; r < tc->world; r++) {
    memset(&args[r], 0, sizeof args[r]);
    args[r].tc = tc;
    args[r].comm = comms[r];
    args[r].cuda = kind != RUN_CPU;
    /* the CPU device accepts offload and changes nothing: the reference runs with it */
    args[r].offload = kind >= RUN_OFF_LOCAL || (kind == RUN_CPU && sharded(tc));
    args[r].ckpt_dir = tc->ckpt ? dir : NULL;
    args[r].rank = r;
    args[r].nccl_id = nccl ? id : NULL;
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  int ok = 1;
  for (int r = 0; r < tc->world; r++) {
    pthread_join(th[r], NULL);
    if (!nccl) sg_comm_destroy(comms[r]);
    snprintf(what, sizeof what, "%s on %s, rank %d: trains %s%s", tc->name, k_runs[kind], r,
             args[r].err[0] ? "-- " : "", args[r].err);
    check(!args[r].err[0], what);
    ok &= !args[r].err[0];
    if (args[r].err[0]) continue;
    snprintf(what, sizeof what, "%s on %s, rank %d: %d step(s) skipped", tc->name, k_runs[kind], r,
             args[r].res.skipped);
    check(args[r].res.skipped == (tc->inf_step > 0), what);
  }
  if (tc->ckpt) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) check(0, "removing the checkpoint directory");
  }
  return ok;
}

static int same_bits(const float *a, const float *b, size_t n, size_t *at) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], 4) != 0) {
      *at = i;
      return 0;
    }
  return 1;
}

static const char *const k_fields[4] = {"param", "master", "m", "v"};

static const float *field(const result *r, int f, int p) {
  return f == 0 ? r->param[p] : f == 1 ? r->master[p] : f == 2 ? r->m[p] : r->v[p];
}

static void compare(const tcase *tc, const char *run, const char *refname, const rank_arg *cpu,
                    const rank_arg *gpu) {
  char what[200];
  for (int r = 0; r < tc->world; r++) {
    int bad_f = -1, bad_p = -1;
    size_t at = 0;
    for (int p = 0; p < NP && bad_f < 0; p++)
      for (int f = 0; f < 4 && bad_f < 0; f++)
        if (!same_bits(field(&cpu[r].res, f, p), field(&gpu[r].res, f, p), k_sizes[p], &at))
          bad_f = f, bad_p = p;
    if (bad_f < 0)
      snprintf(what, sizeof what, "%s rank %d: %s == %s bitwise (params, master, m, v)",
               tc->name, r, run, refname);
    else
      snprintf(what, sizeof what, "%s rank %d: %s != %s: %s of p%d at %zu (%.9g, %.9g)",
               tc->name, r, run, refname, k_fields[bad_f], bad_p, at,
               (double)field(&cpu[r].res, bad_f, bad_p)[at],
               (double)field(&gpu[r].res, bad_f, bad_p)[at]);
    check(bad_f < 0, what);
    int norms = 1;
    for (int s = 0; s < STEPS; s++)
    {
      const float x = cpu[r].res.norm[s], y = gpu[r].res.norm[s];
      norms &= (!isfinite(x) && !isfinite(y)) || fabsf(x - y) <= 1e-6f * fabsf(x);
    }
    snprintf(what, sizeof what, "%s rank %d: %s gradient norms agree (1e-6)", tc->name, r, run);
    check(norms, what);
    if (!tc->overlap) continue;
    int fwd = 1;
    for (int s = 1; s < STEPS; s++) fwd &= cpu[r].res.fwd_hash[s] == gpu[r].res.fwd_hash[s];
    snprintf(what, sizeof what, "%s rank %d: %s forward passes read what the cpu run read "
             "(sg_param_wait)", tc->name, r, run);
    check(fwd, what);
  }
}

static void free_results(rank_arg *args, int w) {
  for (int r = 0; r < w; r++) free_result(&args[r].res);
}

/* A sharded strategy offloads on CUDA; NO_SHARD is refused with a clear message. */
static void test_refusal(void) {
  sg_comm *c = NULL;
  sg_config cfg;
  sg_engine *e = NULL;
  sg_config_init(&cfg, sizeof cfg);
  cfg.device = SG_DEVICE_CUDA;
  cfg.strategy = SG_NO_SHARD;
  cfg.offload_optimizer = 1;
  sg_memory_stats m;
  m.struct_size = sizeof m;
  if (sg_comm_create_local(1, &c) != SG_OK) return check(0, "communicator");
  check(sg_engine_create(c, &cfg, &e) == SG_ERR_UNSUPPORTED && !e &&
            strstr(sg_last_error(), "needs a sharded strategy"),
        "offload with SG_NO_SHARD on CUDA: SG_ERR_UNSUPPORTED, 'needs a sharded strategy'");
  check(sg_estimate_memory(&cfg, k_sizes, NP, 1, &m) == SG_OK && m.host_bytes == 0,
        "sg_estimate_memory of NO_SHARD with offload: nothing on the host");
  sg_comm_destroy(c);
}

int main(void) {
  static const tcase cases[] = {
      {"zero2 f32 W1", SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, 1, 1, 0, 0, 0, 0, 1, 0},
      {"zero2 bf16 W2", SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_F32, 2, 2, 0, 0, 0, 0, 1, 0},
      {"zero2 bf16 accum W3", SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_BF16, 3, 1, 0, 0, 0, 0, 0, 0},
      {"zero2 f32 no_sync W2", SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, 2, 3, 1, 0, 0, 0, 0, 0},
      {"zero1 f32/bf16 W3", SG_SHARD_OPT, SG_F32, SG_BF16, SG_F32, 3, 2, 0, 0, 0, 0, 0, 0},
      {"ddp f16 W2", SG_NO_SHARD, SG_F16, SG_F16, SG_F32, 2, 1, 0, 0, 0, 0, 0, 0},
      {"zero2 bf16 overlap W2", SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_F32, 2, 2, 0, 1, 0, 0, 0, 0},
      {"zero1 f32 overlap W3", SG_SHARD_OPT, SG_F32, SG_F32, SG_F32, 3, 1, 0, 1, 0, 0, 0, 0},
      {"zero2 bf16 3 mb clip W3", SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_F32, 3, 3, 0, 0, 0.05f, 0,
       1, 0},
      {"zero2 f16 skip W2", SG_SHARD_GRAD_OP, SG_F16, SG_F16, SG_F32, 2, 1, 0, 0, 0, 1, 1, 0},
      {"zero2 f32 clip W1", SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, 1, 3, 0, 0, 0.1f, 0, 0, 0},
      {"zero2 bf16 groups W2", SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_F32, 2, 1, 0, 0, 0, 0, 1, 1},
      {"zero1 f32 groups W3", SG_SHARD_OPT, SG_F32, SG_F32, SG_F32, 3, 2, 0, 0, 0, 0, 0, 1},
  };
  /* SG_TEST_QUICK (the TSan stage, ~10x slower): the offloaded runs for the first three cases
   * only, and no group cases; the worker-thread interleavings are the same. */
  const int quick = getenv("SG_TEST_QUICK") != NULL;
  test_refusal();
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (quick && cases[i].groups) continue;
    static rank_arg ref[MAXW], plain[2][MAXW], got[MAXW];
    const tcase *tc = &cases[i];
    const int ok_ref = run(tc, RUN_CPU, ref);
    int ok_plain[2] = {0, 0};
    for (int kind = RUN_CUDA_LOCAL; kind <= RUN_OFF_NCCL; kind++) {
      const int nccl = kind == RUN_CUDA_NCCL || kind == RUN_OFF_NCCL;
#ifdef SG_TEST_REAL_GPU
      if (nccl && tc->world > 1) continue; /* one GPU: NCCL needs W == 1 */
#endif
      if (kind >= RUN_OFF_LOCAL && (!sharded(tc) || (quick && i >= 3))) continue;
      rank_arg *out = kind < RUN_OFF_LOCAL ? plain[nccl] : got;
      const int ok = run(tc, kind, out);
      if (ok && ok_ref) compare(tc, k_runs[kind], "cpu", ref, out);
      if (kind < RUN_OFF_LOCAL) ok_plain[nccl] = ok;
      else if (ok && ok_plain[nccl]) compare(tc, k_runs[kind], k_runs[kind - 2], plain[nccl], out);
      if (kind >= RUN_OFF_LOCAL) free_results(got, tc->world);
    }
    free_results(plain[0], tc->world);
    free_results(plain[1], tc->world);
    free_results(ref, tc->world);
  }
#ifndef SG_TEST_REAL_GPU
  sg_cudamock_drain();
  check(sg_ncclmock_live() == 0, "every NCCL communicator destroyed");
#endif
  return sg_test_summary("");
}
