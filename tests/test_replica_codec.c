/* Replica codecs (cfg.replica_codec: int8 and 4-bit codes with error feedback) on hybrid engines
 * of N replicas x L shard ranks, ranks as threads (--local) or MPI processes (--mpi):
 *
 *  - after every step every rank holds the same parameters, bit for bit;
 *  - the summed gradient each rank's accumulator holds before the step (read after
 *    sg_grad_norm) is bitwise that of the test's own implementation of the scheme
 *    (ref_reduce: two stages of blockwise codes with a residual per rank and stage), fed with
 *    the same per-node sums (L = 1 or 2: one fp32 addition, the same in any order);
 *  - error feedback: with a gradient that is the same every step, the sum over S steps of what
 *    the codec delivered stays within the bound the residuals give (derived at ef_bound),
 *    while without feedback the systematic error would grow S-fold;
 *  - a non-finite gradient on one replica makes every rank skip the step;
 *  - checkpoints: new engines that load one (also after 4x1 engines loaded it and saved it
 *    again: every replica's residuals through another node count and size; also with 8-bit
 *    optimizer state) go on bit for bit as the reference does without a reload; a load at
 *    fewer nodes (4x1 saved, 2x2 loaded) gives each rank the residuals of the documented rule,
 *    element by element;
 *  - sg_memory counts the codec's buffers as the formula of DESIGN.md section 3 says, and
 *    sg_estimate_memory agrees;
 *  - bad settings fail at create with a clear message.
 *
 * Ranks are threads over the local backend, or over the caller's transport (an in-process
 * mailbox), whose collectives are the point-to-point algorithms that MPI runs too.
 * Usage: test_replica_codec --local | --mpi (under mpirun -np 4: 2x2, a rank per process) */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sg_engine_internal.h" /* e->plan (slices), e->g.accum (the summed gradient) */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_mailbox.h" /* mb_group: communicators over the caller's transport */
#include "sg_test_codec_ref.h" /* ref_reduce: the scheme written out on its own */
#include "sg_test_state.h"   /* sg_test_mix */

static const size_t k_sizes[] = {700, 4097, 2500, 65};
#define NP ((int)(sizeof k_sizes / sizeof k_sizes[0]))
#define BUCKET_BYTES (16u * 1024u)
#define MAXW 8
#define STEPS 6
#define EF_STEPS 24

typedef struct {
  const char *name;
  sg_codec codec;
  int n, l;
  int steps;
  int constant; /* the same gradient every step (error feedback) */
  int inject;   /* a NaN from rank W-1 at step 1 */
  sg_strategy strategy;
  int xport; /* ranks over the caller's transport (an in-process mailbox): the point-to-point
                algorithms MPI uses (src/comm/sg_coll.c), all-to-all included */
  int reload; /* > 0: after this many steps sg_save, the engines destroyed, new ones made and
                sg_load: the run goes on bit for bit as without (every residual is in the
                checkpoint) */
  int via_l;  /* > 0: between those, engines of N L / via_l replicas x via_l ranks (the same
                 ranks) load the checkpoint and save it again: another node count and size */
  int q8;     /* the optimizer's state in 8 bits (its checkpoint sections before the codec's) */
} tcase;

/* One rank's view of a run: its accumulator before every step and its parameters after. */
typedef struct {
  float *acc[EF_STEPS];   /* shard_numel each */
  float *param[EF_STEPS]; /* all parameters, concatenated */
  int skipped[EF_STEPS];
  size_t shard_numel;
  sg_memory_stats mem;
  sg__plan *plan; /* rank 0's copy of what it needs: slices (a borrowed view, see copy_plan) */
  int ok;
  char err[400];
} result;

/* ---- data ---------------------------------------------------------------------------------- */

static float grad_val(const tcase *tc, int rank, int step, int p, size_t i) {
  if (tc->inject && rank == tc->n * tc->l - 1 && step == 1 && p == 1 && i == 5) return NAN;
  const int s = tc->constant ? 0 : step;
  const uint64_t h = sg_test_mix(((uint64_t)rank << 56) ^ ((uint64_t)s << 48) ^
                                 ((uint64_t)p << 32) ^ i);
  /* magnitudes that vary along the vector, so blocks get different scales */
  const double u = (double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  return (float)(u * (0.05 + 0.45 * (double)((i / 97) % 7) / 6.0));
}

static size_t total_numel(void) {
  size_t t = 0;
  for (int p = 0; p < NP; p++) t += k_sizes[p];
  return t;
}

/* ---- one rank ------------------------------------------------------------------------------ */

typedef struct {
  const tcase *tc;
  sg_comm *world;
  int rank;
  result *res;
  const char *dir; /* the checkpoint of tc->reload */
} run_arg;

static sg_status make_engine(const run_arg *a, int l, sg_comm **shard, sg_comm **rep,
                             sg_engine **e) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.strategy = a->tc->strategy;
  cfg.bucket_bytes = BUCKET_BYTES;
  cfg.grad_average = 0;
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  cfg.replica_codec = a->tc->codec;
  if (a->tc->q8) {
    cfg.optim_state_dtype = SG_Q8;
    cfg.optim_state_min_numel = 0;
  }
  sg_status st = sg_comm_split(a->world, a->rank / l, a->rank, shard);
  if (!st) st = sg_comm_split(a->world, a->rank % l, a->rank, rep);
  if (!st) st = sg_engine_create_hybrid(*shard, *rep, &cfg, e);
  return st;
}

static sg_status setup(sg_engine *e, int *ids) {
  sg_status st = SG_OK;
  for (int p = 0; p < NP && !st; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, k_sizes[p], 0, &ids[p]);
  }
  if (!st) st = sg_finalize(e);
  float *buf = malloc(k_sizes[1] * sizeof *buf);
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = (float)sin(0.3 * (double)i + p) * 0.5f;
    st = sg_set_param(e, ids[p], buf, SG_F32);
  }
  free(buf);
  return st;
}

static sg_status one_step(const run_arg *a, sg_engine *e, const int *ids, int s) {
  sg_status st = SG_OK;
  for (int p = NP - 1; p >= 0 && !st; p--) {
    float *g = NULL;
    st = sg_grad_ptr(e, ids[p], (void **)&g);
    for (size_t i = 0; !st && i < k_sizes[p]; i++) g[i] = grad_val(a->tc, a->rank, s, p, i);
    if (!st) st = sg_grad_ready(e, ids[p]);
  }
  if (!st) st = sg_backward_end(e);
  float norm = 0;
  if (!st) st = sg_grad_norm(e, &norm); /* the sums across replicas are done after it */
  result *r = a->res;
  if (!st) memcpy(r->acc[s], e->g.accum, r->shard_numel * sizeof(float));
  sg_step_info info = {.struct_size = sizeof info};
  if (!st) st = sg_step(e, &info);
  r->skipped[s] = info.skipped;
  size_t off = 0;
  for (int p = 0; p < NP && !st; p++, off += k_sizes[p - 1])
    st = sg_get_param(e, ids[p], r->param[s] + off, SG_F32);
  return st;
}

static void drop_engine(sg_engine **e, sg_comm **shard, sg_comm **rep) {
  sg_engine_destroy(*e);
  sg_comm_destroy(*shard);
  sg_comm_destroy(*rep);
  *e = NULL, *shard = NULL, *rep = NULL;
}

/* tc->reload: the checkpoint, loaded by new engines (through engines of another layout first
 * with tc->via_l), as a resumed run would. */
static sg_status reload(const run_arg *a, sg_engine **e, sg_comm **shard, sg_comm **rep,
                        int *ids) {
  sg_status st = sg_save(*e, a->dir);
  drop_engine(e, shard, rep);
  if (!st && a->tc->via_l) {
    st = make_engine(a, a->tc->via_l, shard, rep, e);
    if (!st) st = setup(*e, ids);
    if (!st) st = sg_load(*e, a->dir);
    if (!st) st = sg_save(*e, a->dir);
    drop_engine(e, shard, rep);
  }
  if (!st) st = make_engine(a, a->tc->l, shard, rep, e);
  if (!st) st = setup(*e, ids);
  return st ? st : sg_load(*e, a->dir);
}

static void *run_thread(void *arg) {
  run_arg *a = arg;
  result *r = a->res;
  sg_comm *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  int ids[NP];
  sg_status st = make_engine(a, a->tc->l, &shard, &rep, &e);
  if (!st) st = setup(e, ids);
  if (!st) {
    r->shard_numel = e->plan->shard_numel;
    r->plan = e->plan;
    for (int s = 0; s < a->tc->steps; s++) {
      r->acc[s] = calloc(r->shard_numel, sizeof(float));
      r->param[s] = calloc(total_numel(), sizeof(float));
    }
    r->mem.struct_size = sizeof r->mem;
    st = sg_memory(e, &r->mem);
  }
  for (int s = 0; s < a->tc->steps && !st; s++) {
    if (a->tc->reload && s == a->tc->reload) st = reload(a, &e, &shard, &rep, ids);
    if (!st) st = one_step(a, e, ids, s);
  }
  r->ok = st == SG_OK;
  if (st) snprintf(r->err, sizeof r->err, "%s: %s", sg_status_string(st), sg_last_error());
  /* the plan is read by the checks after the threads: the engine stays until then */
  r->plan = st ? NULL : e->plan;
  a->res->err[sizeof a->res->err - 1] = 0;
  if (st) sg_engine_destroy(e), e = NULL;
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  return e; /* destroyed by the caller once the checks are done */
}

/* ---- the reference: the scheme written out on its own ---------------------------------------- */

typedef struct {
  float *r1[MAXW]; /* per replica: its residual of the slice (all buckets, shard offsets) */
  float *r2[MAXW]; /* per replica: the residual of its chunk, per bucket at chunk_base */
} ref_state;

static float qmax_of(sg_codec c) { return c == SG_CODEC_INT8 ? 127.0f : 7.0f; }

/* The slice of shard rank j of bucket b of node i's sum (its L ranks' gradients, rank order). */
static void node_slice(const tcase *tc, const sg__plan *p, int i, int j, int b, int step,
                       float *out) {
  const size_t n = sg__plan_slice_numel(p, b), start = sg__plan_slice_start(p, b, j);
  for (size_t e = 0; e < n; e++) out[e] = 0.0f;
  for (int q = 0; q < p->nparams; q++) {
    const sg__plan_param *pp = &p->params[q];
    for (size_t e = 0; e < n; e++) {
      const size_t f = start + e;
      if (f < pp->offset || f >= pp->offset + pp->numel) continue;
      float s = grad_val(tc, i * tc->l, step, q, f - pp->offset);
      for (int k = 1; k < tc->l; k++) s += grad_val(tc, i * tc->l + k, step, q, f - pp->offset);
      out[e] = s;
    }
  }
}

/* What every rank of shard position j must hold at each step (out[step][shard_numel]). */
static void ref_run(const tcase *tc, const sg__plan *p, int j, float **out) {
  const int N = tc->n;
  ref_state rs;
  size_t r2_len = 0;
  for (int b = 0; b < p->nbuckets; b++) r2_len += sg__plan_slice_numel(p, b);
  for (int i = 0; i < N; i++) {
    rs.r1[i] = calloc(p->shard_numel, sizeof(float));
    rs.r2[i] = calloc(r2_len, sizeof(float));
  }
  float *in[MAXW];
  for (int i = 0; i < N; i++) in[i] = malloc(p->shard_numel * sizeof(float));
  for (int s = 0; s < tc->steps; s++) { /* a reload changes nothing: the residuals go on */
    size_t r2_off = 0;
    for (int b = 0; b < p->nbuckets; b++) {
      const size_t n = sg__plan_slice_numel(p, b), so = p->buckets[b].shard_offset;
      float *r1[MAXW], *r2[MAXW];
      for (int i = 0; i < N; i++) {
        node_slice(tc, p, i, j, b, s, in[i] + so);
        r1[i] = rs.r1[i] + so;
      }
      /* replica k keeps the residual of its own chunk only, from the start of its region */
      for (int k = 0; k < N; k++) r2[k] = rs.r2[k] + r2_off;
      float *in_b[MAXW];
      for (int i = 0; i < N; i++) in_b[i] = in[i] + so;
      ref_reduce(in_b, r1, r2, N, n, qmax_of(tc->codec), out[s] + so);
      r2_off += n;
    }
  }
  for (int i = 0; i < N; i++) free(rs.r1[i]), free(rs.r2[i]), free(in[i]);
}

/* ---- checks -------------------------------------------------------------------------------- */

static int bits_equal(const float *a, const float *b, size_t n) { return !memcmp(a, b, n * 4); }

static void check_identical(const tcase *tc, result *res, int w) {
  for (int s = 0; s < tc->steps; s++)
    for (int r = 1; r < w; r++)
      CHECK(bits_equal(res[r].param[s], res[0].param[s], total_numel()) &&
                res[r].skipped[s] == res[0].skipped[s],
            "[%s] step %d: rank %d's parameters are rank 0's, bit for bit", tc->name, s, r);
  /* every replica of one shard position holds the same summed gradient */
  for (int s = 0; s < tc->steps; s++)
    for (int r = tc->l; r < w; r++)
      CHECK(bits_equal(res[r].acc[s], res[r % tc->l].acc[s], res[r].shard_numel),
            "[%s] step %d: rank %d's summed gradient is rank %d's", tc->name, s, r, r % tc->l);
}

/* One rank's summed gradients (shard position j) against the reference's, every step. */
static void check_reference_of(const tcase *tc, const result *r, int j) {
  const sg__plan *p = r->plan;
  float *ref[EF_STEPS];
  for (int s = 0; s < tc->steps; s++) ref[s] = calloc(p->shard_numel, sizeof(float));
  ref_run(tc, p, j, ref);
  for (int s = 0; s < tc->steps; s++) {
    size_t bad = SIZE_MAX;
    for (size_t e = 0; e < p->shard_numel && bad == SIZE_MAX; e++)
      if (memcmp(&ref[s][e], &r->acc[s][e], 4) != 0 && !(isnan(ref[s][e]) && isnan(r->acc[s][e])))
        bad = e;
    CHECK(bad == SIZE_MAX, "[%s] step %d shard %d: the sum is the reference scheme's (first "
          "difference at %zu: %g vs %g)", tc->name, s, j, bad,
          bad == SIZE_MAX ? 0.0 : (double)r->acc[s][bad], bad == SIZE_MAX ? 0.0 : (double)ref[s][bad]);
    free(ref[s]);
  }
}

static void check_reference(const tcase *tc, result *res) {
  for (int j = 0; j < tc->l; j++) check_reference_of(tc, &res[j], j);
}

/* Error feedback. Per element, replica i's stage-1 residual telescopes: the sum over S steps of
 * its decoded values is sum x_s - r1(S); likewise stage 2 on the owner. So the sum of what the
 * codec delivered differs from the exact sum of the nodes' slices by at most
 * sum_i |r1_i(S)| + |r2(S)| + the fp32 roundings of the sums, and a residual is at most half a
 * scale step: |r| <= amax / (2 qmax). With |slice| <= A (A = L * max |g|, grown by the residual
 * it carries, at most 1/(2 qmax) of it), stage 1's amax <= A (1 + 1/qmax), stage 2's <=
 * N A (1 + 1/qmax)^2. The fp32 roundings: 2 N + 2 additions of values <= N A per step. */
static double ef_bound(const tcase *tc, double A) {
  const double q = qmax_of(tc->codec), g = 1.0 + 1.0 / q;
  const double resid = (tc->n * A * g + tc->n * A * g * g) / (2.0 * q);
  const double round = tc->steps * (2.0 * tc->n + 2.0) * tc->n * A * ldexp(1.0, -24);
  return resid + round;
}

static void check_feedback(const tcase *tc, result *res) {
  const sg__plan *p = res[0].plan;
  const double A = tc->l * 0.5;
  double worst = 0, worst_step = 0;
  for (int j = 0; j < tc->l; j++) {
    float *tmp = malloc(p->shard_numel * sizeof(float));
    double *exact = calloc(p->shard_numel, sizeof(double));
    double *got = calloc(p->shard_numel, sizeof(double));
    for (int s = 0; s < tc->steps; s++) {
      for (int i = 0; i < tc->n; i++)
        for (int b = 0; b < p->nbuckets; b++) {
          const size_t so = p->buckets[b].shard_offset;
          node_slice(tc, p, i, j, b, s, tmp + so);
          for (size_t e = 0; e < sg__plan_slice_numel(p, b); e++) exact[so + e] += tmp[so + e];
        }
      for (size_t e = 0; e < p->shard_numel; e++) {
        got[e] += res[j].acc[s][e];
        if (s == 0 && fabs(got[e] - exact[e]) > worst_step) worst_step = fabs(got[e] - exact[e]);
      }
    }
    for (size_t e = 0; e < p->shard_numel; e++)
      if (fabs(got[e] - exact[e]) > worst) worst = fabs(got[e] - exact[e]);
    free(tmp), free(exact), free(got);
  }
  printf("[%s] error of the summed delivery over %d steps %.3g (bound %.3g), of one step %.3g\n",
         tc->name, tc->steps, worst, ef_bound(tc, A), worst_step);
  CHECK(worst <= ef_bound(tc, A), "[%s] over %d steps the delivered sum is within %.3g of the "
        "exact one (%.3g; one step's error: %.3g)", tc->name, tc->steps, ef_bound(tc, A), worst,
        worst_step);
  /* without feedback a constant gradient's error would repeat every step: the bound must be
   * far below steps x one step's error for this check to tell the two apart */
  CHECK(worst_step * tc->steps > 4.0 * ef_bound(tc, A), "[%s] the bound (%.3g) separates feedback "
        "from none (%d x %.3g)", tc->name, ef_bound(tc, A), tc->steps, worst_step);
}

/* DESIGN.md section 3: the codec's buffer in comm_bytes: 4 (shard + sum_b max chunk) for the
 * residuals, 2 N max_b(code bytes of a chunk) for the exchange, carved from the arena in
 * whole SG_MEM_ALIGN units. */
static size_t codec_bytes(const sg__plan *p, int N, sg_codec c) {
  const size_t bits = c == SG_CODEC_INT8 ? 8 : 4;
  size_t r2 = 0, region = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const size_t nb = (sg__plan_slice_numel(p, b) + BLK - 1) / BLK, mb = (nb + N - 1) / N;
    r2 += mb * BLK;
    if (mb * (4 + BLK * bits / 8) > region) region = mb * (4 + BLK * bits / 8);
  }
  const size_t bytes = 4 * (p->shard_numel + r2) + 2 * (size_t)N * region;
  return (bytes + SG_MEM_ALIGN - 1) / SG_MEM_ALIGN * SG_MEM_ALIGN;
}

static void check_memory(const tcase *tc, result *res) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.strategy = tc->strategy;
  cfg.bucket_bytes = BUCKET_BYTES;
  cfg.shard_ranks = tc->l;
  if (tc->q8) {
    cfg.optim_state_dtype = SG_Q8;
    cfg.optim_state_min_numel = 0;
  }
  sg_memory_stats exact = {.struct_size = sizeof exact}, coded = {.struct_size = sizeof coded};
  CHECK(sg_estimate_memory(&cfg, k_sizes, NP, tc->n * tc->l, &exact) == SG_OK, "estimate");
  cfg.replica_codec = tc->codec;
  CHECK(sg_estimate_memory(&cfg, k_sizes, NP, tc->n * tc->l, &coded) == SG_OK, "estimate");
  const size_t want = codec_bytes(res[0].plan, tc->n, tc->codec);
  CHECK(coded.comm_bytes - exact.comm_bytes == want && coded.total_bytes - exact.total_bytes == want,
        "[%s] the codec's buffers are comm bytes: %zu more (estimate: %zu)", tc->name, want,
        coded.comm_bytes - exact.comm_bytes);
  CHECK(res[0].mem.comm_bytes == coded.comm_bytes && res[0].mem.total_bytes == coded.total_bytes,
        "[%s] sg_memory (%zu comm bytes) agrees with sg_estimate_memory (%zu)", tc->name,
        res[0].mem.comm_bytes, coded.comm_bytes);
}

static void check_skip(const tcase *tc, result *res, int w) {
  for (int r = 0; r < w; r++)
    CHECK(res[r].skipped[1] == 1 && res[r].skipped[0] == 0 && res[r].skipped[2] == 0,
          "[%s] rank %d skipped step 1 (a NaN on rank %d) and no other", tc->name, r, w - 1);
}

/* ---- runs ---------------------------------------------------------------------------------- */

static void free_result(const tcase *tc, result *r) {
  for (int s = 0; s < tc->steps; s++) free(r->acc[s]), free(r->param[s]);
  memset(r, 0, sizeof *r);
}

static void run_case(const tcase *tc) {
  const int w = tc->n * tc->l;
  sg_comm *comms[MAXW];
  mailbox mb;
  xuser us[MAXW];
  mb_init(&mb);
  const sg_status made = tc->xport ? mb_group(&mb, us, w, comms) : sg_comm_create_local(w, comms);
  if (!CHECK(made == SG_OK, "%s comm of %d", tc->xport ? "xport" : "local", w)) return;
  result res[MAXW];
  run_arg a[MAXW];
  pthread_t th[MAXW];
  memset(res, 0, sizeof res);
  char dir[] = "/tmp/sg_codec_ckpt_XXXXXX";
  if (tc->reload && !CHECK(mkdtemp(dir) != NULL, "temp dir")) return;
  for (int r = 0; r < w; r++) {
    a[r] = (run_arg){tc, comms[r], r, &res[r], dir};
    pthread_create(&th[r], NULL, run_thread, &a[r]);
  }
  sg_engine *engines[MAXW];
  int ok = 1;
  for (int r = 0; r < w; r++) {
    void *out = NULL;
    pthread_join(th[r], &out);
    engines[r] = out;
    ok &= CHECK(res[r].ok, "[%s] rank %d ran: %s", tc->name, r, res[r].err);
  }
  if (ok) {
    check_identical(tc, res, w);
    if (!tc->inject) check_reference(tc, res);
    if (tc->constant) check_feedback(tc, res);
    if (tc->inject) check_skip(tc, res, w);
    check_memory(tc, res);
  }
  for (int r = 0; r < w; r++) {
    sg_engine_destroy(engines[r]);
    sg_comm_destroy(comms[r]);
    free_result(tc, &res[r]);
  }
  mb_free(&mb);
  if (tc->reload) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "removed %s", dir);
  }
  printf("case %s: done\n", tc->name);
}

/* ---- bad settings ---------------------------------------------------------------------------- */

static void check_errors(void) {
  sg_comm *one = NULL;
  sg_engine *e = NULL;
  if (!CHECK(sg_comm_create_local(1, &one) == SG_OK, "comm")) return;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.replica_codec = SG_CODEC_INT8;
  CHECK(sg_engine_create(one, &cfg, &e) == SG_ERR_INVALID_ARGUMENT && !e &&
            strstr(sg_last_error(), "replica_codec") && strstr(sg_last_error(), "hybrid"),
        "a codec on a flat engine is refused: %s", sg_last_error());
  cfg.replica_codec = (sg_codec)7;
  CHECK(sg_engine_create(one, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "replica_codec must be"),
        "an unknown codec is refused: %s", sg_last_error());
  cfg.replica_codec = SG_CODEC_INT4;
  cfg.accum_dtype = SG_BF16;
  CHECK(sg_engine_create(one, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "accum_dtype"),
        "a codec with a bf16 accumulator is refused: %s", sg_last_error());
  sg_memory_stats st = {.struct_size = sizeof st}, none = {.struct_size = sizeof none};
  size_t n = 1000;
  cfg.accum_dtype = SG_F32;
  const sg_status s1 = sg_estimate_memory(&cfg, &n, 1, 4, &st);
  cfg.replica_codec = SG_CODEC_NONE;
  const sg_status s2 = sg_estimate_memory(&cfg, &n, 1, 4, &none);
  CHECK(s1 == SG_OK && s2 == SG_OK && st.total_bytes == none.total_bytes,
        "a codec estimated at shard_ranks 0 (flat: one replica) counts nothing for it");
  /* one node's engine with a replica communicator of one rank: nothing to compress */
  sg_comm *alone = NULL;
  if (CHECK(sg_comm_create_local(1, &alone) == SG_OK, "comm")) {
    cfg.replica_codec = SG_CODEC_INT8;
    CHECK(sg_engine_create_hybrid(one, alone, &cfg, &e) == SG_ERR_INVALID_ARGUMENT && !e &&
              strstr(sg_last_error(), "one replica"),
          "a codec with one replica is refused: %s", sg_last_error());
    sg_engine_destroy(e); /* NULL unless the check failed */
    e = NULL;
    sg_comm_destroy(alone);
  }
  sg_comm_destroy(one);
}

/* ---- a load at fewer nodes: the documented rule, element by element ------------------------ */

/* 4 x 1 engines train, save and hand their residuals over (every element's: r1 of each replica,
 * r2 of its chunk's owner); 2 x 2 engines load, and each rank's residuals must be the rule's:
 * replica r's r1 the sum of the saved r1 of replicas r and r + 2 (in that order), each
 * element's r2 the saved one wherever its chunk is now. The residuals are read where the
 * codec keeps them: the layout's replica buffer, r1 (shard) then r2 (per bucket, from the
 * start of each replica's chunk region). */
#define FEW_TOTAL (700 + 4097 + 2500 + 65)
static float g_r1a[4][FEW_TOTAL], g_r2a[FEW_TOTAL];

static float *resid_of(sg_engine *e) {
  return (float *)((char *)e->ar.base[SG_MEM_COMM] + e->lay.replica_off);
}

/* Element e (all parameters, concatenated) of bucket b's slice position p, shard rank j (-1:
 * padding). */
static long elem_at(const sg__plan *p, int b, int j, size_t pos) {
  const size_t f = sg__plan_slice_start(p, b, j) + pos;
  long off = 0;
  for (int q = 0; q < NP; off += (long)k_sizes[q], q++)
    if (f >= p->params[q].offset && f < p->params[q].offset + k_sizes[q])
      return off + (long)(f - p->params[q].offset);
  return -1;
}

/* Visits every (bucket, slice position, element, r1 index, r2 index or -1) of this rank. */
static int walk(sg_engine *e, int N, int me, int save) {
  const sg__plan *p = e->plan;
  const float *r1 = resid_of(e), *r2 = r1 + p->shard_numel;
  size_t r2_base = 0;
  int bad = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const size_t n = sg__plan_slice_numel(p, b), nb = (n + BLK - 1) / BLK;
    size_t off, len;
    ref_chunk(n, N, me, &off, &len);
    for (size_t t = 0; t < n; t++) {
      const long x = elem_at(p, b, e->rank, t);
      if (x < 0) continue;
      const float v1 = r1[p->buckets[b].shard_offset + t];
      const int mine = t >= off && t < off + len;
      const float v2 = mine ? r2[r2_base + t - off] : 0.0f;
      if (save) {
        g_r1a[me][x] = v1;
        if (mine) g_r2a[x] = v2;
        continue;
      }
      const float want = g_r1a[me][x] + g_r1a[me + 2][x];
      bad += memcmp(&v1, &want, 4) != 0 || (mine && memcmp(&v2, &g_r2a[x], 4) != 0);
    }
    r2_base += (nb + (size_t)N - 1) / (size_t)N * BLK;
  }
  return bad;
}

typedef struct {
  sg_comm *world;
  int rank, bad;
  char dir[64], err[400];
} fewer_arg;

static void *fewer_thread(void *arg) {
  fewer_arg *f = arg;
  static const tcase a4 = {"fewer 4x1", SG_CODEC_INT8, 4, 1, 3, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0};
  static const tcase b2 = {"fewer 2x2", SG_CODEC_INT8, 2, 2, 3, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0};
  result r;
  memset(&r, 0, sizeof r);
  run_arg a = {&a4, f->world, f->rank, &r, f->dir};
  sg_engine *e = run_thread(&a); /* 3 steps at 4 x 1 */
  sg_status st = r.ok ? SG_OK : SG_ERR_INTERNAL;
  if (!st) {
    (void)walk(e, 4, f->rank, 1);
    st = sg_save(e, f->dir);
  }
  sg_engine_destroy(e);
  free_result(&a4, &r);
  sg_comm *shard = NULL, *rep = NULL;
  int ids[NP];
  a.tc = &b2;
  if (!st) st = make_engine(&a, 2, &shard, &rep, &e);
  if (!st) st = setup(e, ids);
  if (!st) st = sg_load(e, f->dir);
  if (!st) f->bad = walk(e, 2, f->rank / 2, 0);
  if (st)
    snprintf(f->err, sizeof f->err, "%s: %.300s", sg_status_string(st), r.ok ? sg_last_error() : r.err);
  else f->err[0] = 0;
  drop_engine(&e, &shard, &rep);
  return NULL;
}

static void check_fewer_nodes(void) {
  sg_comm *comms[4];
  if (!CHECK(sg_comm_create_local(4, comms) == SG_OK, "local comm of 4")) return;
  fewer_arg f[4];
  char dir[] = "/tmp/sg_codec_fewer_XXXXXX";
  if (!CHECK(mkdtemp(dir) != NULL, "temp dir")) return;
  pthread_t th[4];
  for (int r = 0; r < 4; r++) {
    f[r] = (fewer_arg){comms[r], r, 0, "", ""};
    snprintf(f[r].dir, sizeof f[r].dir, "%s", dir);
    pthread_create(&th[r], NULL, fewer_thread, &f[r]);
  }
  for (int r = 0; r < 4; r++) {
    pthread_join(th[r], NULL);
    CHECK(!f[r].err[0] && f[r].bad == 0, "4x1 saved, 2x2 loaded: rank %d's residuals are the "
          "rule's (replica r: saved r and r + 2 summed; r2 to the chunk's owner; %d differ) %s",
          r, f[r].bad, f[r].err);
    sg_comm_destroy(comms[r]);
  }
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK(system(cmd) == 0, "removed %s", dir);
}

static const tcase k_cases[] = {
    {"int8 2x2", SG_CODEC_INT8, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int8 3x2", SG_CODEC_INT8, 3, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int8 3x1 zero1", SG_CODEC_INT8, 3, 1, STEPS, 0, 0, SG_SHARD_OPT, 0, 0, 0, 0},
    {"int4 2x2", SG_CODEC_INT4, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int4 3x2", SG_CODEC_INT4, 3, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int8 feedback 2x2", SG_CODEC_INT8, 2, 2, EF_STEPS, 1, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int4 feedback 3x1", SG_CODEC_INT4, 3, 1, EF_STEPS, 1, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int8 nan 2x2", SG_CODEC_INT8, 2, 2, 3, 0, 1, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    {"int8 2x2 xport", SG_CODEC_INT8, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 1, 0, 0, 0},
    {"int4 3x2 xport", SG_CODEC_INT4, 3, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 1, 0, 0, 0},
    {"int8 2x2 save+load", SG_CODEC_INT8, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 3, 0, 0},
    {"int4 2x2 save, load+save at 4x1, load", SG_CODEC_INT4, 2, 2, STEPS, 0, 0,
     SG_SHARD_GRAD_OP, 0, 3, 1, 0},
    {"int8 2x2 8-bit state save+load", SG_CODEC_INT8, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 3,
     0, 1},
};

/* --mpi, under mpirun -np 4 as 2x2: each process one rank, which checks its own summed
 * gradients against the reference (the same on every replica of its shard position, so the
 * ranks agree when each does). */
static int run_mpi(void) {
  sg_comm *world = NULL;
  if (!CHECK(sg_comm_create_mpi(NULL, &world) == SG_OK, "MPI communicator")) return 1;
  const int rank = sg_comm_rank(world), size = sg_comm_size(world);
  if (CHECK(size == 4, "run under mpirun -np 4 (got %d ranks)", size)) {
    static const tcase mpi_cases[] = {
        {"mpi int8 2x2", SG_CODEC_INT8, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
        {"mpi int4 2x2", SG_CODEC_INT4, 2, 2, STEPS, 0, 0, SG_SHARD_GRAD_OP, 0, 0, 0, 0},
    };
    for (int c = 0; c < 2; c++) {
      result r;
      memset(&r, 0, sizeof r);
      run_arg a = {&mpi_cases[c], world, rank, &r, NULL};
      sg_engine *e = run_thread(&a);
      if (CHECK(r.ok, "[%s] rank %d ran: %s", mpi_cases[c].name, rank, r.err))
        check_reference_of(&mpi_cases[c], &r, rank % 2);
      sg_engine_destroy(e);
      free_result(&mpi_cases[c], &r);
    }
  }
  sg_comm_destroy(world);
  char tag[64];
  snprintf(tag, sizeof tag, "test_replica_codec (mpi rank %d)", rank);
  return sg_test_summary(tag);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--mpi")) return run_mpi();
  check_errors();
  for (size_t k = 0; k < sizeof k_cases / sizeof k_cases[0]; k++) run_case(&k_cases[k]);
  check_fewer_nodes();
  return sg_test_summary("test_replica_codec");
}
