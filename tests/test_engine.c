/* The engine at W ranks against one rank on the combined batch (DESIGN.md section 9).
 *
 * Gradients are small multiples of 1/8 (|g| <= 2/8), so sums over up to 4 ranks and 3
 * micro-batches are exact in f32, bf16 and f16, so the parameters, master weights and moments
 * must be bitwise equal to the single-rank run fed with sum_r g_r / W (W = 2, 4, averaging on)
 * or sum_r g_r (W = 3, averaging off: 1/3 is inexact). Random gradients: the tolerance is
 * stated in compare_result. Cases with reduce_dtype != grad_dtype: see make_cases; run_wire
 * checks that the wire rounds to reduce_dtype (bitwise, against a host model), that an f16 wire
 * overflows into a skipped step, and run_wire_ckpt that a checkpoint loads across wire dtypes.
 *
 * Usage: test_engine --local W   (ranks as threads; W in 2..4, or 0 for all of 2, 3, 4)
 *        test_engine --mpi       (one rank per process under mpirun)
 *        test_engine --nccl      (W = 1 with an NCCL communicator, on SG_DEVICE_CUDA: what one
 *                                 GPU can check, since NCCL refuses two ranks on one GPU)
 *        add --quick (or SG_TEST_QUICK=1) for a smaller matrix: no f16, no_sync only for f32,
 *        two reduce_dtype cases, a smaller wire check;
 *        add --device cuda (or SG_TEST_DEVICE=cuda) to run the ranks under test on
 *        SG_DEVICE_CUDA (GPU 0); the reference stays on SG_DEVICE_CPU, so every check becomes
 *        "CUDA engine at W ranks == CPU engine on the combined batch".
 * Gradients are built in host memory and uploaded into the sg_grad_ptr slot through the
 * engine's own device vtable (a memcpy on CPU; on CUDA an H2D copy on the compute queue that
 * is complete when it returns), so this file needs no CUDA header. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/sg_elem.h" /* dtype conversions for the test's own gradients */
#include "engine/sg_engine_internal.h" /* e->dev: uploads into device gradient slots */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_state.h" /* sg_test_mix, reading and freeing the engine's state */

static const size_t k_sizes[] = {1, 63, 64, 65, 1000, 4097, 100003, 300000};
#define NP ((int)(sizeof k_sizes / sizeof k_sizes[0]))
#define BUCKET_BYTES (256u * 1024u)

typedef struct {
  sg_strategy strategy;
  sg_dtype pdt, gdt, rdt, adt; /* rdt: reduce_dtype (the wire), = gdt unless testing it */
  int mb;          /* micro-batches per step */
  int nosync;      /* sg_set_sync(0) for all but the last micro-batch */
  int random;      /* random gradients (tolerance) instead of exact ones */
  int shuffle;     /* gradients in random order, one staging bucket */
  float clip;
  int steps;
  int sr;          /* stochastic rounding of bf16 params (the bits must not depend on W) */
  int overlap;     /* overlap_param_gather: the next forward pass reads each parameter right
                      after sg_param_wait, while later buckets are still being gathered */
} tcase;

typedef struct {
  float *param[NP], *master[NP], *m[NP], *v[NP];
  float norm[8];
  uint64_t fwd_hash[8]; /* overlap: the parameters the forward pass of each step read */
  int ok;
} result;

/* ---------------------------------------------------------------------------------------- */

/* Gradient of element i of param p for (rank, step, micro-batch). */
static float grad_val(const tcase *tc, int rank, int step, int k, int p, size_t i) {
  uint64_t h = sg_test_mix(((uint64_t)rank << 56) ^ ((uint64_t)step << 48) ^
                           ((uint64_t)k << 40) ^ ((uint64_t)p << 32) ^ i);
  if (tc->random) return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0) * 0.01f;
  return (float)((int)(h % 5) - 2) * 0.125f;
}

static float init_val(int p, size_t i) {
  return (float)sin(0.37 * (double)i + (double)p) * 0.5f;
}

static void store(void *dst, int dtype, size_t i, float x) { sg_elem_store(dst, dtype, i, x); }

/* ---------------------------------------------------------------------------------------- */

typedef struct {
  const tcase *tc;
  sg_comm *comm;
  int world;  /* world of the run being fed; 1 for the reference */
  int feed_w; /* number of ranks whose gradients are combined (reference: W) */
  int cuda;   /* SG_DEVICE_CUDA (GPU 0) instead of SG_DEVICE_CPU */
  int average;/* grad_average: on for W = 2, 4 (1/W exact); off for W = 3, so that the
                 reference's gradient (the plain sum) is exact too */
  result *res;
  char err[512];
} run_arg;

static int g_cuda;  /* --device cuda: the runs under test (never the reference) on CUDA */
static int g_quick; /* --quick or SG_TEST_QUICK: the smaller matrix */

static sg_status setup(const tcase *tc, int average, int cuda, sg_comm *comm, sg_engine **out,
                       int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = tc->strategy;
  cfg.device = cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg.cuda_device = 0;
  cfg.param_dtype = tc->pdt;
  cfg.grad_dtype = tc->gdt;
  cfg.reduce_dtype = tc->rdt;
  cfg.accum_dtype = tc->adt;
  cfg.bucket_bytes = BUCKET_BYTES;
  cfg.staging_buckets = tc->shuffle ? 1 : 2;
  cfg.max_grad_norm = tc->clip;
  cfg.grad_average = average;
  cfg.stochastic_rounding = tc->sr;
  cfg.overlap_param_gather = tc->overlap;
  cfg.seed = 1234;
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  cfg.loss_scale = 1.0f; /* static: the test's gradients are not scaled */
  if ((st = sg_engine_create(comm, &cfg, out))) return st;
  for (int p = 0; p < NP; p++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d.%s", p, p % 3 == 1 ? "bias" : "weight");
    if ((st = sg_add_param(*out, name, k_sizes[p], p % 3 == 1 ? SG_PARAM_NO_DECAY : 0, &ids[p])))
      return st;
  }
  if ((st = sg_finalize(*out))) return st;
  float *buf = malloc(k_sizes[NP - 1] * sizeof *buf);
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = init_val(p, i);
    st = sg_set_param(*out, ids[p], buf, SG_F32);
  }
  free(buf);
  return st;
}

/* Writes this rank's gradient (or, for the reference, the average over feed_w ranks). */
static sg_status write_grad(run_arg *a, sg_engine *e, int id, int p, int step, int k) {
  void *g = NULL, *h = NULL;
  sg_status st = sg_grad_ptr(e, id, &g);
  if (st) return st;
  if (!(h = malloc(k_sizes[p] * 4))) return SG_ERR_OUT_OF_MEMORY;
  const int rank = sg_comm_rank(a->comm);
  for (size_t i = 0; i < k_sizes[p]; i++) {
    double v = 0;
    if (a->world == 1)
      for (int r = 0; r < a->feed_w; r++) v += grad_val(a->tc, r, step, k, p, i);
    else
      v = grad_val(a->tc, rank, step, k, p, i);
    store(h, a->tc->gdt, i, (float)(a->world == 1 && a->average ? v / a->feed_w : v));
  }
  st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, g, h, k_sizes[p] * (a->tc->gdt == SG_F32 ? 4 : 2),
                         SG_COPY_H2D);
  free(h);
  return st ? st : sg_grad_ready(e, id);
}

static void order_for(const tcase *tc, int step, int k, int rank, int *order) {
  for (int p = 0; p < NP; p++) order[p] = NP - 1 - p; /* backward order */
  if (!tc->shuffle) return;
  uint64_t s = sg_test_mix((uint64_t)step * 131 + (uint64_t)k * 7 + (uint64_t)rank);
  for (int p = NP - 1; p > 0; p--) {
    s = sg_test_mix(s);
    int q = (int)(s % (uint64_t)(p + 1));
    int t = order[p];
    order[p] = order[q];
    order[q] = t;
  }
}

/* A forward pass: each parameter is read (copied to the host on the caller's queue) right after
 * sg_param_wait, in registration order on even steps and in a shuffled order on odd ones (a
 * model whose forward order differs from its registration order: Megatron-LM #950). Hashes the
 * bytes read, in registration order. */
static sg_status forward_read(run_arg *a, sg_engine *e, const int *ids, int step, uint64_t *hash) {
  const size_t psz = a->tc->pdt == SG_F32 ? 4 : 2;
  unsigned char *h = malloc(k_sizes[NP - 1] * 4);
  sg_status st = h ? SG_OK : SG_ERR_OUT_OF_MEMORY;
  uint64_t x[NP] = {0}, all = 0x9e3779b97f4a7c15ull;
  int order[NP];
  for (int p = 0; p < NP; p++) order[p] = p;
  for (int p = NP - 1; step % 2 && p > 0; p--) { /* a fixed shuffle, the same on every rank */
    const int q = (int)(sg_test_mix((uint64_t)step * 31 + (uint64_t)p) % (uint64_t)(p + 1));
    const int t = order[p];
    order[p] = order[q];
    order[q] = t;
  }
  for (int j = 0; j < NP && !st; j++) {
    const int p = order[j];
    void *dev = NULL;
    st = sg_param_wait(e, ids[p]);
    if (!st) st = sg_param_ptr(e, ids[p], &dev);
    if (!st) st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, h, dev, k_sizes[p] * psz, SG_COPY_D2H);
    x[p] = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; !st && i < k_sizes[p] * psz; i++) x[p] = sg_test_mix(x[p] ^ h[i]);
  }
  free(h);
  for (int p = 0; p < NP; p++) all = sg_test_mix(all ^ x[p]);
  *hash = all;
  return st;
}

static sg_status train(run_arg *a, sg_engine *e, const int *ids) {
  const tcase *tc = a->tc;
  sg_status st = SG_OK;
  for (int step = 0; step < tc->steps && !st; step++) {
    if (tc->overlap && step > 0) st = forward_read(a, e, ids, step, &a->res->fwd_hash[step]);
    for (int k = 0; k < tc->mb && !st; k++) {
      if (tc->nosync && (st = sg_set_sync(e, k == tc->mb - 1))) break;
      int order[NP];
      order_for(tc, step, k, sg_comm_rank(a->comm), order);
      for (int j = 0; j < NP && !st; j++) st = write_grad(a, e, ids[order[j]], order[j], step, k);
    }
    sg_step_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (!st) st = sg_step(e, &info);
    if (!st) a->res->norm[step] = info.grad_norm;
  }
  return st;
}

static sg_status collect(run_arg *a, sg_engine *e, const int *ids) {
  return sg_test_read_state(e, ids, k_sizes, NP, SG_TEST_STATE_OF(a->res));
}

static void *run_thread(void *arg) {
  run_arg *a = arg;
  sg_engine *e = NULL;
  int ids[NP];
  sg_status st = setup(a->tc, a->average, a->cuda, a->comm, &e, ids);
  if (!st) st = train(a, e, ids);
  if (!st) st = collect(a, e, ids);
  a->res->ok = st == SG_OK;
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  return NULL;
}

static void free_result(result *r) {
  sg_test_free_state(NP, SG_TEST_STATE_OF(r));
  memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------------------------------- */
/* comparison                                                                                */

/* Root-mean-square of (got - ref) over the root-mean-square of (ref - base): how large the
 * disagreement is against the size of what training changed (base NULL: against ref itself). */
static double rms_rel(const float *got, const float *ref, const float *base, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    const double d = (double)got[i] - ref[i], r = (double)ref[i] - (base ? base[i] : 0.0);
    num += d * d;
    den += r * r;
  }
  if (isnan(num)) return INFINITY;
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static const char *sname(sg_strategy s) {
  return s == SG_NO_SHARD ? "NO_SHARD" : s == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP";
}
static const char *dname(sg_dtype d) { return d == SG_F32 ? "f32" : d == SG_BF16 ? "bf16" : "f16"; }

/* Bitwise when exact is set, else rms_rel(got, ref, base) <= tol. */
static void compare(const char *what, const tcase *tc, int w, int rank, float *const *got,
                    float *const *ref, int against_init, int exact, double tol) {
  for (int p = 0; p < NP; p++) {
    const size_t n = k_sizes[p];
    if (exact) {
      const int same = memcmp(got[p], ref[p], n * 4) == 0;
      const size_t bad = same ? 0 : sg_test_first_diff(got[p], ref[p], n);
      CHECK(same, "%s W=%d rank %d p%s g%s r%s mb%d%s%s%s%s: %s of param %d (numel %zu) differs "
            "at %zu: %.9g vs %.9g", sname(tc->strategy), w, rank, dname(tc->pdt), dname(tc->gdt),
            dname(tc->rdt), tc->mb, tc->nosync ? " nosync" : "", tc->shuffle ? " shuffled" : "",
            tc->adt == SG_BF16 ? " accum-bf16" : "", tc->sr ? " sr" : "", what, p, n, bad, got[p][bad], ref[p][bad]);
      continue;
    }
    float *base = NULL;
    if (against_init) {
      base = malloc(n * 4);
      for (size_t i = 0; i < n; i++) base[i] = init_val(p, i);
    }
    const double d = rms_rel(got[p], ref[p], base, n);
    free(base);
    CHECK(d <= tol, "%s W=%d rank %d p%s g%s r%s mb%d: %s of param %d: rms difference %.3g of "
          "the update > %.3g", sname(tc->strategy), w, rank, dname(tc->pdt), dname(tc->gdt),
          dname(tc->rdt), tc->mb, what, p, d, tol);
  }
}

static void compare_result(const tcase *tc, int w, int rank, const result *got, const result *ref) {
  const int exact = !tc->random;
  /* Stated tolerances, as the rms of the disagreement over the rms of what training changed.
   * Random gradients: each
   * rank's gradient is rounded to the grad dtype before the sum, the reference rounds the sum
   * once, and near-zero sums can flip the sign of an element's first AdamW update (an lr-sized
   * difference, large in the rms of a 64-element parameter): 1e-3 for f32 gradients, 0.1 for
   * bf16/f16 gradients or wire (reduce_dtype). */
  const double tol = tc->gdt == SG_F32 && tc->rdt == SG_F32 ? 1e-3 : 0.1;
  compare("param", tc, w, rank, got->param, ref->param, 1, exact, tol);
  compare("master", tc, w, rank, got->master, ref->master, 1, exact, tol);
  compare("m", tc, w, rank, got->m, ref->m, 0, exact, tol);
  compare("v", tc, w, rank, got->v, ref->v, 0, exact, tol);
  for (int s = 1; tc->overlap && exact && s < tc->steps; s++)
    CHECK(got->fwd_hash[s] == ref->fwd_hash[s], "%s W=%d rank %d: the forward pass of step %d "
          "read other parameters than the reference (sg_param_wait)", sname(tc->strategy), w,
          rank, s);
  for (int s = 0; s < tc->steps; s++) {
    const double d = fabs((double)got->norm[s] - (double)ref->norm[s]) / ((double)ref->norm[s] + 1e-12);
    CHECK(exact ? got->norm[s] == ref->norm[s] : d < 1e-5, "%s W=%d grad_norm step %d: %.9g vs %.9g",
          sname(tc->strategy), w, s, got->norm[s], ref->norm[s]);
  }
}

static int avg_for(int w) { return (w & (w - 1)) == 0; }

static int run_reference(const tcase *tc, int feed_w, result *ref) {
  sg_comm *c = NULL;
  if (sg_comm_create_local(1, &c)) return 0;
  run_arg a = {tc, c, 1, feed_w, 0, avg_for(feed_w), ref, ""};
  run_thread(&a);
  CHECK(ref->ok, "reference run failed: %s", a.err);
  sg_comm_destroy(c);
  return ref->ok;
}

static void run_local(const tcase *tc, int w) {
  result ref, res[4];
  memset(&ref, 0, sizeof ref);
  memset(res, 0, sizeof res);
  if (!run_reference(tc, w, &ref)) return;
  sg_comm *comms[4];
  sg_status st = sg_comm_create_local(w, comms);
  CHECK(st == SG_OK, "sg_comm_create_local(%d): %s", w, sg_last_error());
  if (st) return;
  pthread_t th[4];
  run_arg args[4];
  for (int r = 0; r < w; r++) {
    args[r] = (run_arg){tc, comms[r], w, w, g_cuda, avg_for(w), &res[r], ""};
    pthread_create(&th[r], NULL, run_thread, &args[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) {
    CHECK(res[r].ok, "%s W=%d rank %d failed: %s", sname(tc->strategy), w, r, args[r].err);
    if (res[r].ok) compare_result(tc, w, r, &res[r], &ref);
    if (res[r].ok && r > 0)
      for (int p = 0; p < NP; p++)
        CHECK(memcmp(res[r].param[p], res[0].param[p], k_sizes[p] * 4) == 0,
              "W=%d: working params of rank %d differ from rank 0 (param %d)", w, r, p);
  }
  for (int r = 0; r < w; r++) {
    free_result(&res[r]);
    sg_comm_destroy(comms[r]);
  }
  free_result(&ref);
}

#ifdef SG_HAVE_MPI
static void run_mpi(const tcase *tc, sg_comm *comm) {
  const int w = sg_comm_size(comm), rank = sg_comm_rank(comm);
  result ref = {0}, res = {0};
  if (!run_reference(tc, w, &ref)) return;
  run_arg a = {tc, comm, w, w, g_cuda, avg_for(w), &res, ""};
  run_thread(&a);
  CHECK(res.ok, "%s W=%d rank %d failed: %s", sname(tc->strategy), w, rank, a.err);
  if (res.ok) compare_result(tc, w, rank, &res, &ref);
  free_result(&res);
  free_result(&ref);
}
#endif

/* W = 1 on SG_DEVICE_CUDA with an NCCL communicator against the CPU reference. */
static void run_nccl(const tcase *tc) {
  result ref, res;
  memset(&ref, 0, sizeof ref);
  memset(&res, 0, sizeof res);
  if (!run_reference(tc, 1, &ref)) return;
  unsigned char id[128];
  sg_comm *c = NULL;
  sg_status st = sg_nccl_unique_id(id);
  if (!st) st = sg_comm_create_nccl(0, 1, id, 0, &c);
  CHECK(st == SG_OK, "sg_comm_create_nccl(0, 1): %s", sg_last_error());
  if (!st) {
    run_arg a = {tc, c, 1, 1, 1, avg_for(1), &res, ""};
    run_thread(&a);
    CHECK(res.ok, "%s nccl W=1 failed: %s", sname(tc->strategy), a.err);
    if (res.ok) compare_result(tc, 1, 0, &res, &ref);
    sg_comm_destroy(c);
  }
  free_result(&res);
  free_result(&ref);
}

/* ---------------------------------------------------------------------------------------- */
/* the wire dtype                                                                            */

/* That buckets really travel in reduce_dtype: every rank writes gradients that are multiples of
 * 2^-16 of magnitude <= 1 (exact in f32; bf16 and f16 round most of them), two micro-batches,
 * over several buckets (bucket_bytes 4096) that share the one reduce buffer. With
 * grad_average 0, loss scale 1, no clipping and beta1 = 0, Adam's m after the step is the
 * accumulator itself, which the host predicts bit for bit:
 *     m = sum over micro-batches of R(sum over ranks of R(G(g)))    (R, G: round to rdt, gdt)
 * Every sum here is exact in fp32 (<= 20 significant bits), so neither the order of the
 * ranks nor the communicator's algorithm can change it; only the two roundings to reduce_dtype
 * can, and the host also counts the elements where R differs from no rounding at all (the run
 * with reduce_dtype = grad_dtype, checked against the same model): the check can fail. */
static const size_t k_wire_sizes[] = {1000, 4097, 300};
#define NW ((int)(sizeof k_wire_sizes / sizeof k_wire_sizes[0]))
#define WIRE_MB 2
#define WIRE_BIG 1.0e6f /* overflow run: beyond f16's 65504, finite in bf16 */

typedef struct {
  sg_strategy strategy;
  sg_dtype gdt, rdt;
  int big;            /* rank 0's first element of param 0 is WIRE_BIG in micro-batch 0 */
  const char *save;   /* sg_save here after the step */
  const char *load;   /* sg_load from here instead of training */
  sg_comm *comm;
  int world, cuda;
  float *m[NW];       /* out: Adam's m after the step */
  sg_step_info info;  /* out */
  int ok;
  char err[512];
} wire_arg;

static float wire_grad(int rank, int k, int p, size_t i) {
  const uint64_t h = sg_test_mix(0x5157ull ^ ((uint64_t)rank << 56) ^ ((uint64_t)k << 48) ^
                         ((uint64_t)p << 40) ^ i);
  return (float)((int)(h % 131073u) - 65536) / 65536.0f;
}

static float round_to(int dtype, float x) {
  uint32_t b[1];
  sg_elem_store(b, dtype, 0, x);
  return sg_elem_load(b, dtype, 0);
}

/* The host model of m for element i of param p (big runs aside). */
static float wire_model(const wire_arg *a, int p, size_t i) {
  float acc = 0.0f;
  for (int k = 0; k < WIRE_MB; k++) {
    float sum = 0.0f;
    for (int r = 0; r < a->world; r++)
      sum += round_to(a->rdt, round_to(a->gdt, wire_grad(r, k, p, i)));
    acc += round_to(a->rdt, sum);
  }
  return acc;
}

static sg_status wire_setup(wire_arg *a, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = a->strategy;
  cfg.device = a->cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg.cuda_device = 0;
  cfg.param_dtype = SG_F32;
  cfg.grad_dtype = a->gdt;
  cfg.reduce_dtype = a->rdt;
  cfg.bucket_bytes = 4096;
  cfg.grad_average = 0;
  cfg.loss_scale = 1.0f;
  cfg.beta1 = 0.0f; /* m = the gradient */
  cfg.timeout_ms = 60000;
  if ((st = sg_engine_create(a->comm, &cfg, e))) return st;
  for (int p = 0; p < NW && !st; p++) {
    char name[16];
    snprintf(name, sizeof name, "w%d", p);
    st = sg_add_param(*e, name, k_wire_sizes[p], 0, &ids[p]);
  }
  return st ? st : sg_finalize(*e);
}

static sg_status wire_write(wire_arg *a, sg_engine *e, int id, int p, int k) {
  const size_t n = k_wire_sizes[p];
  const int rank = sg_comm_rank(a->comm);
  void *g = NULL, *h = malloc(n * 4);
  if (!h) return SG_ERR_OUT_OF_MEMORY;
  for (size_t i = 0; i < n; i++)
    store(h, a->gdt, i, a->big && rank == 0 && k == 0 && p == 0 && i == 0 ? WIRE_BIG
                                                                          : wire_grad(rank, k, p, i));
  sg_status st = sg_grad_ptr(e, id, &g);
  if (!st)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, g, h, n * (a->gdt == SG_F32 ? 4 : 2),
                           SG_COPY_H2D);
  free(h);
  return st ? st : sg_grad_ready(e, id);
}

static void *wire_thread(void *arg) {
  wire_arg *a = arg;
  sg_engine *e = NULL;
  int ids[NW];
  sg_status st = wire_setup(a, &e, ids);
  if (a->load) {
    if (!st) st = sg_load(e, a->load);
  } else {
    for (int k = 0; k < WIRE_MB && !st; k++)
      for (int p = NW - 1; p >= 0 && !st; p--) st = wire_write(a, e, ids[p], p, k);
    a->info.struct_size = sizeof a->info;
    if (!st) st = sg_step(e, &a->info);
    if (!st && a->save) st = sg_save(e, a->save);
  }
  for (int p = 0; p < NW && !st; p++) {
    if (!(a->m[p] = malloc(k_wire_sizes[p] * 4))) st = SG_ERR_OUT_OF_MEMORY;
    if (!st) st = sg_get_optim_state(e, ids[p], 0, a->m[p]);
  }
  a->ok = st == SG_OK;
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  return NULL;
}

/* m against the model; returns the elements where R changed the sum (vs no rounding). */
static size_t wire_check(const wire_arg *a, int rank) {
  size_t bad = 0, rounded = 0, first = 0;
  int first_p = -1;
  wire_arg exact = *a;
  exact.rdt = SG_F32;
  exact.gdt = a->gdt;
  for (int p = 0; p < NW; p++)
    for (size_t i = 0; i < k_wire_sizes[p]; i++) {
      const float want = wire_model(a, p, i);
      if (memcmp(&want, &a->m[p][i], 4) != 0 && bad++ == 0) {
        first_p = p;
        first = i;
      }
      rounded += wire_model(&exact, p, i) != want;
    }
  CHECK(bad == 0, "wire %s W=%d rank %d g%s r%s: %zu elements of m differ from the model of a "
        "%s wire (first: param %d [%zu] = %.9g, want %.9g)", sname(a->strategy), a->world, rank,
        dname(a->gdt), dname(a->rdt), bad, dname(a->rdt), first_p, first,
        first_p >= 0 ? a->m[first_p][first] : 0.0, first_p >= 0 ? wire_model(a, first_p, first) : 0.0);
  return rounded;
}

/* Runs args[0..nthreads-1] (one per rank thread; one: on this thread) to the end. */
static void wire_go(wire_arg *args, int nthreads) {
  pthread_t th[4];
  if (nthreads == 1) {
    wire_thread(&args[0]);
    return;
  }
  for (int r = 0; r < nthreads; r++) pthread_create(&th[r], NULL, wire_thread, &args[r]);
  for (int r = 0; r < nthreads; r++) pthread_join(th[r], NULL);
}

/* One run of the wire check on `world` ranks: comms[0..world-1] (threads) or one MPI comm. */
static void wire_run(sg_strategy s, sg_dtype gdt, sg_dtype rdt, int big, sg_comm **comms,
                     int nthreads, int world) {
  wire_arg args[4];
  for (int r = 0; r < nthreads; r++)
    args[r] = (wire_arg){.strategy = s, .gdt = gdt, .rdt = rdt, .big = big, .comm = comms[r],
                         .world = world, .cuda = g_cuda};
  wire_go(args, nthreads);
  for (int r = 0; r < nthreads; r++) {
    const wire_arg *a = &args[r];
    const int rank = sg_comm_rank(comms[r]);
    if (!CHECK(a->ok, "wire %s W=%d rank %d g%s r%s%s failed: %s", sname(s), world, rank,
               dname(gdt), dname(rdt), big ? " big" : "", a->err))
      continue;
    if (!big) {
      const size_t rounded = wire_check(a, rank);
      if (world > 1 || gdt != rdt) /* one rank, same dtype: nothing to round */
        CHECK(rdt == SG_F32 ? rounded == 0 : rounded > 100, "wire %s W=%d g%s r%s: the %s wire "
            "rounds %zu elements of the sums", sname(s), world, dname(gdt), dname(rdt),
            dname(rdt), rounded);
      continue;
    }
    /* WIRE_BIG overflows only an f16 wire: inf in the accumulator, the step skipped (no silent
     * garbage); a bf16 or f32 wire carries it and the step is taken. */
    const int want_skip = rdt == SG_F16;
    CHECK(a->info.skipped == want_skip && a->info.step == (uint64_t)!want_skip,
          "wire %s W=%d rank %d g%s r%s: gradient %g: skipped %d (want %d), step %llu",
          sname(s), world, rank, dname(gdt), dname(rdt), (double)WIRE_BIG, a->info.skipped,
          want_skip, (unsigned long long)a->info.step);
    if (want_skip)
      CHECK(a->m[0][0] == 0.0f && a->m[0][1] == 0.0f, "wire r%s: a skipped step leaves m zero",
            dname(rdt));
    else
      CHECK(fabsf(a->m[0][0] - WIRE_BIG) <= WIRE_BIG / 128, "wire %s W=%d g%s r%s: m[0] = %.9g, "
            "want %g within a bf16 ulp", sname(s), world, dname(gdt), dname(rdt), a->m[0][0],
            (double)WIRE_BIG);
  }
  for (int r = 0; r < nthreads; r++)
    for (int p = 0; p < NW; p++) free(args[r].m[p]);
}

/* Every (grad, reduce) pair that differs, each grad dtype with its own wire as the control,
 * then the f32 gradient of WIRE_BIG on f16, bf16 and f32 wires. The quick matrix: the first
 * four pairs and the f16 overflow, without SHARD_OPT. */
static void run_wire(sg_comm **comms, int nthreads, int world) {
  static const sg_dtype pairs[][2] = {{SG_F32, SG_BF16}, {SG_F32, SG_F16}, {SG_BF16, SG_F32},
                                      {SG_BF16, SG_BF16}, {SG_F16, SG_F32}, {SG_F32, SG_F32},
                                      {SG_F16, SG_F16}};
  const sg_strategy ss[] = {SG_NO_SHARD, SG_SHARD_GRAD_OP, SG_SHARD_OPT};
  for (int s = 0; s < (g_quick ? 2 : 3); s++) {
    for (size_t k = 0; k < (g_quick ? 4 : sizeof pairs / sizeof pairs[0]); k++)
      wire_run(ss[s], pairs[k][0], pairs[k][1], 0, comms, nthreads, world);
    for (int rd = 0; rd < (g_quick ? 1 : 3); rd++)
      wire_run(ss[s], SG_F32, rd == 0 ? SG_F16 : rd == 1 ? SG_BF16 : SG_F32, 1, comms, nthreads,
               world);
  }
}

static void run_wire_local(int w) {
  sg_comm *comms[4];
  sg_status st = sg_comm_create_local(w, comms);
  if (!CHECK(st == SG_OK, "sg_comm_create_local(%d): %s", w, sg_last_error())) return;
  run_wire(comms, w, w);
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
}

/* reduce_dtype changes no saved state: a checkpoint of a SHARD_GRAD_OP run with a bf16 wire
 * loads into a NO_SHARD engine with an f32 wire (W = 2, threads), and Adam's m comes back
 * bit for bit. */
static void run_wire_ckpt(void) {
  char dir[256];
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/sg_engine_wire_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!CHECK(mkdtemp(dir) != NULL, "mkdtemp(%s)", dir)) return;
  sg_comm *comms[2];
  wire_arg saved[2], loaded[2];
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "sg_comm_create_local(2)")) return;
  for (int r = 0; r < 2; r++)
    saved[r] = (wire_arg){.strategy = SG_SHARD_GRAD_OP, .gdt = SG_F32, .rdt = SG_BF16,
                          .comm = comms[r], .world = 2, .cuda = g_cuda, .save = dir};
  wire_go(saved, 2);
  for (int r = 0; r < 2; r++)
    loaded[r] = (wire_arg){.strategy = SG_NO_SHARD, .gdt = SG_F32, .rdt = SG_F32,
                           .comm = comms[r], .world = 2, .cuda = g_cuda, .load = dir};
  if (saved[0].ok && saved[1].ok) wire_go(loaded, 2);
  for (int r = 0; r < 2; r++) {
    CHECK(saved[r].ok, "wire ckpt: rank %d: the run with a bf16 wire and sg_save: %s", r,
          saved[r].err);
    if (!saved[r].ok) break;
    CHECK(loaded[r].ok, "wire ckpt: rank %d: sg_load into an f32-wire NO_SHARD engine: %s", r,
          loaded[r].err);
    for (int p = 0; p < NW && loaded[r].ok; p++)
      CHECK(memcmp(saved[r].m[p], loaded[r].m[p], k_wire_sizes[p] * 4) == 0,
            "wire ckpt: rank %d: m of param %d is the same after the load", r, p);
    if (loaded[r].ok) wire_check(&saved[r], r); /* and it was the bf16 wire's */
  }
  for (int r = 0; r < 2; r++)
    for (int p = 0; p < NW; p++) {
      free(saved[r].m[p]);
      free(loaded[r].m[p]);
    }
  for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK(system(cmd) == 0, "%s", cmd);
}

/* W = 1 with NCCL on the CUDA device: the cast and the NCCL call on the comm stream. */
static void run_wire_nccl(void) {
  unsigned char id[128];
  sg_comm *c = NULL;
  sg_status st = sg_nccl_unique_id(id);
  if (!st) st = sg_comm_create_nccl(0, 1, id, 0, &c);
  if (!CHECK(st == SG_OK, "sg_comm_create_nccl(0, 1): %s", sg_last_error())) return;
  run_wire(&c, 1, 1);
  sg_comm_destroy(c);
}

/* ---------------------------------------------------------------------------------------- */

/* Cases with reduce_dtype != grad_dtype stay exact: every gradient the test feeds, and every
 * sum of them (over ranks, micro-batches, and the reference's averaged feed), is a multiple of
 * 1/32 of magnitude <= 3, exact in f32, bf16 and f16. The reference (W = 1, same config, so
 * also the same reduce_dtype) casts its slot to reduce_dtype and "reduces" over one rank; the W
 * ranks cast their own slots and sum. Both casts and both sums are exact, so the W-rank result
 * is still bitwise equal to the reference: this checks the plumbing (buffer, counts, offsets,
 * dtypes of the collective and of the accumulate) for every strategy. That the wire really
 * rounds to reduce_dtype is checked by run_wire. */
static int make_cases(tcase *out, int quick) {
  int n = 0;
  const sg_strategy strategies[] = {SG_NO_SHARD, SG_SHARD_OPT, SG_SHARD_GRAD_OP};
  const sg_dtype dts[] = {SG_F32, SG_BF16, SG_F16};
  for (int s = 0; s < 3; s++)
    for (int d = 0; d < 3; d++)
      for (int mb = 1; mb <= 3; mb += 2)
        for (int ns = 0; ns <= (mb > 1); ns++) {
          if (quick && (d == 2 || (ns && d != 0))) continue;
          out[n++] = (tcase){strategies[s], dts[d], dts[d], dts[d], SG_F32, mb, ns, 0, 0, 0.0f, 3, 0, 0};
        }
  /* clipping, bf16 accumulator, shuffled order with one staging bucket, random gradients,
   * stochastic rounding */
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, SG_F32, 2, 0, 0, 0, 0.05f, 3, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_BF16, SG_BF16, 1, 0, 0, 0, 0.0f, 3, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_BF16, SG_F32, SG_F32, SG_F32, 3, 0, 0, 1, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_SHARD_OPT, SG_F32, SG_F32, SG_F32, SG_F32, 3, 1, 0, 1, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, SG_F32, 2, 0, 1, 0, 1.0f, 3, 0, 0};
  out[n++] = (tcase){SG_NO_SHARD, SG_BF16, SG_BF16, SG_BF16, SG_F32, 1, 0, 1, 0, 0.0f, 3, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_BF16, SG_F32, 2, 0, 0, 0, 0.0f, 3, 1, 0};
  out[n++] = (tcase){SG_SHARD_OPT, SG_BF16, SG_F32, SG_F32, SG_F32, 1, 0, 0, 1, 0.0f, 2, 1, 0};
  /* reduce_dtype != grad_dtype: fp32 reductions of bf16/f16 gradients, bf16 reductions of fp32
   * gradients (the quick matrix keeps one of each direction) */
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_F32, SG_F32, 2, 0, 0, 0, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_NO_SHARD, SG_F32, SG_F32, SG_BF16, SG_F32, 3, 1, 0, 0, 0.0f, 2, 0, 0};
  /* overlap_param_gather: the forward pass reads what it waited for */
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, SG_BF16, SG_F32, 2, 0, 0, 0, 0.05f, 3, 1, 1};
  out[n++] = (tcase){SG_SHARD_OPT, SG_F32, SG_F32, SG_F32, SG_F32, 1, 0, 0, 0, 0.0f, 3, 0, 1};
  if (quick) return n;
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_F32, SG_F32, 3, 1, 1, 0, 0.0f, 3, 0, 1};
  out[n++] = (tcase){SG_NO_SHARD, SG_F16, SG_F16, SG_F16, SG_F32, 1, 0, 0, 0, 0.0f, 2, 0, 1};
  out[n++] = (tcase){SG_NO_SHARD, SG_BF16, SG_BF16, SG_F32, SG_F32, 1, 0, 0, 0, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_F32, SG_F32, SG_BF16, SG_F32, 3, 0, 0, 0, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_NO_SHARD, SG_F16, SG_F16, SG_F32, SG_F32, 2, 0, 0, 0, 0.0f, 2, 0, 0};
  out[n++] = (tcase){SG_SHARD_GRAD_OP, SG_F16, SG_F16, SG_F32, SG_BF16, 3, 1, 0, 0, 0.0f, 2, 0, 0};
  /* random bf16 gradients summed in fp32: the tolerance of compare_result */
  out[n++] = (tcase){SG_SHARD_OPT, SG_BF16, SG_BF16, SG_F32, SG_F32, 2, 0, 1, 0, 0.0f, 2, 0, 0};
  return n;
}

int main(int argc, char **argv) {
  int local_w = -1, use_mpi = 0, use_nccl = 0, quick = 0;
  const char *device = getenv("SG_TEST_DEVICE");
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--local") && i + 1 < argc) local_w = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--mpi")) use_mpi = 1;
    else if (!strcmp(argv[i], "--nccl")) use_nccl = 1;
    else if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
  }
  if (device && *device && strcmp(device, "cpu") && strcmp(device, "cuda")) {
    printf("unknown device '%s' (cpu or cuda)\n", device);
    return 2;
  }
  g_cuda = device && !strcmp(device, "cuda");
  if (use_nccl) g_cuda = 1; /* NCCL collectives need the CUDA device */
  if ((g_cuda && !sg_has_backend("cuda")) || (use_nccl && !sg_has_backend("nccl"))) {
    printf("built without %s\n", use_nccl && sg_has_backend("cuda") ? "NCCL" : "CUDA");
    return 1;
  }
  printf("engine under test on %s%s, reference on cpu\n", g_cuda ? "cuda" : "cpu",
         use_nccl ? " with NCCL (W = 1)" : "");
  if (local_w < 0 && !use_mpi) local_w = 0;
  /* sanitizer builds (scripts/test.sh) run the smaller matrix: 5-20x slower per element */
  if (getenv("SG_TEST_QUICK") && atoi(getenv("SG_TEST_QUICK")) > 0) quick = 1;
  g_quick = quick;
  tcase cases[64] = {{0}};
  const int nc = make_cases(cases, quick);
  int rank = 0;
  if (use_mpi) {
#ifdef SG_HAVE_MPI
    sg_comm *comm = NULL;
    sg_status st = sg_comm_create_mpi(NULL, &comm);
    CHECK(st == SG_OK, "sg_comm_create_mpi: %s", sg_last_error());
    if (st) return 1;
    rank = sg_comm_rank(comm);
    for (int c = 0; c < nc; c++) run_mpi(&cases[c], comm);
    run_wire(&comm, 1, sg_comm_size(comm));
    sg_comm_destroy(comm);
#else
    printf("built without MPI\n");
    return 1;
#endif
  } else if (use_nccl) {
    for (int c = 0; c < nc; c++) run_nccl(&cases[c]);
    run_wire_nccl();
  } else {
    for (int c = 0; c < nc; c++)
      for (int w = 2; w <= 4; w++)
        if (local_w == 0 || local_w == w) run_local(&cases[c], w);
    for (int w = 2; w <= 4; w++)
      if (local_w == 0 || local_w == w) run_wire_local(w);
    if (local_w == 0 || local_w == 2) run_wire_ckpt();
  }
  if (rank == 0 || sg_test_failures()) return sg_test_summary(use_mpi ? "mpi: " : "");
  return sg_test_failures() != 0;
}
