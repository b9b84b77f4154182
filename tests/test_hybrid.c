/* Hybrid sharding (sg_engine_create_hybrid): N replicas x L shard ranks against flat ZeRO-2 at
 * W = N x L ranks and against one rank on the combined batch.
 *
 * Gradients are small multiples of 1/8 (|g| <= 2/8), so every sum over up to 6 ranks and 3
 * micro-batches is exact in f32, bf16 and f16 (and, per rank and per node, on a bf16 wire):
 * parameters, master weights, moments, norms and skip decisions must be bitwise equal. With
 * averaging on (W a power of two) the single rank is fed sum_r g_r / W, else the plain sum with
 * averaging off everywhere. Data-parallel rank g of a layout with D ranks is fed the sum of the
 * gradients of the "virtual" ranks v = g mod D of the experiment (times D / V with averaging),
 * so any layout can continue a run of another (the checkpoint cases).
 * Random gradients with a bf16 replica wire: the tolerance is stated in check_bf16_wire.
 *
 * Usage: test_hybrid --local   (ranks as threads: 2x2, 3x2, 2x3, 4x1, 1x4 and the rest)
 *        test_hybrid --mpi     (under mpirun -np 4: 2x2 against flat W=4 and one rank; with
 *                      --cuda local local [--offload] the hybrid engine on the (mock) GPU)
 *        test_hybrid --cuda SHARD REPLICA [--offload]   (the hybrid engines on SG_DEVICE_CUDA,
 *                      the mock runtime in CI or a GPU: their shard and replica communicators
 *                      split from a world of threads (local) or of NCCL ranks (nccl); every
 *                      reference (flat W, one rank, the same hybrid layout) on the CPU device;
 *                      --offload: cfg.offload_optimizer, also against the hybrid engine without)
 *        add --quick (or SG_TEST_QUICK) for fewer cases, --smoke for two 2x2 cases and one
 *        traffic check (the TSan stage). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../kernels/sg_elem.h"        /* dtype conversions for the test's own gradients */
#include "engine/sg_engine_internal.h" /* e->plan (slice sizes), e->dev (draining the queue) */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_state.h" /* sg_test_mix, reading and freeing the engine's state */

static const size_t k_sizes[] = {1, 63, 65, 1000, 4097, 30000};
#define NP ((int)(sizeof k_sizes / sizeof k_sizes[0]))
#define BUCKET_BYTES (32u * 1024u)
#define MAXW 8
#define LR 0.01f

typedef struct {
  const char *name;
  sg_strategy strategy;
  sg_dtype pdt;
  int mb, nosync, declare; /* micro-batches; sg_set_sync(0) for all but the last; sg_set_microbatches */
  float clip;
  sg_dtype wire; /* replica_reduce_dtype */
  int inject;    /* +inf in one gradient of the last virtual rank at step 1 (f16: dynamic scale) */
  int random;    /* random gradients (tolerance) */
  int steps;
  int empty_step; /* step 1 has no micro-batch at all (every bucket counts as zeros) */
  int redo;       /* step 1: sg_grad_zero after its micro-batches (the replica sums queued when
                     declared), then the micro-batches again */
} tcase;

typedef struct {
  float *param[NP], *master[NP], *m[NP], *v[NP];
  float norm[8], scale[8];
  int skipped[8];
  int ok;
} result;

enum { K_SINGLE, K_FLAT, K_HYBRID };

/* One engine's part of a run. */
typedef struct {
  const tcase *tc;
  int kind, n, l; /* hybrid: n replicas x l shard ranks; flat: n x l ranks; single: 1 x 1 */
  int vw;         /* virtual ranks whose gradients are fed (the experiment's W) */
  int avg;        /* grad_average */
  int step0;      /* first step's index (data after a checkpoint) */
  int zeros;      /* a step without gradients: the flat and one-rank references give every
                     parameter zeros (sg_grad_ready), as the hybrid engine of several replicas
                     they are compared with updates every parameter (docs/limits.md) */
  sg_comm *world; /* this rank's world communicator (K_SINGLE: a world of 1) */
  int rank;       /* rank in world */
  result *res;
  char err[600];
  /* the checkpoint cases */
  const char *save_dir, *load_dir;
  int save_after; /* steps before sg_save */
  /* --cuda: the hybrid engine of this rank on SG_DEVICE_CUDA (flat and one rank stay on the
   * CPU), offloaded, its shard / replica communicator split from the NCCL world of nccl_id */
  int cuda, offload, shard_nccl, rep_nccl;
  const unsigned char *nccl_id;
} run_arg;

/* --cuda SHARD REPLICA [--offload]: what the hybrid runs under test use (run_arg's fields). */
typedef struct {
  int cuda, offload, shard_nccl, rep_nccl;
} dev_opts;
static dev_opts g_dev;

static int g_quick;
static int g_smoke; /* --smoke (the TSan stage): 2x2, two cases, one traffic check */
static int g_timeout_ms = 60000; /* the engines' timeout_ms */

/* ---------------------------------------------------------------------------------------- */
/* data                                                                                      */

static float grad_val(const tcase *tc, int v, int step, int k, int p, size_t i) {
  if (tc->inject && v == MAXW - 1 && step == 1 && k == tc->mb - 1 && p == 0 && i == 0)
    return INFINITY;
  const uint64_t h = sg_test_mix(((uint64_t)v << 56) ^ ((uint64_t)step << 48) ^
                                 ((uint64_t)k << 40) ^ ((uint64_t)p << 32) ^ i);
  if (tc->random) return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0) * 0.01f;
  return (float)((int)(h % 5) - 2) * 0.125f;
}

/* The virtual rank that injects: mapped onto the experiment's last rank. */
static int virt(const run_arg *a, int v) { return a->tc->inject && v == a->vw - 1 ? MAXW - 1 : v; }

static float fed_val(const run_arg *a, int g, int d, int step, int k, int p, size_t i) {
  double s = 0;
  for (int v = g; v < a->vw; v += d) s += grad_val(a->tc, virt(a, v), step, k, p, i);
  return (float)(a->avg ? s * (double)d / (double)a->vw : s);
}

static float init_val(int p, size_t i) { return (float)sin(0.37 * (double)i + (double)p) * 0.5f; }

/* ---------------------------------------------------------------------------------------- */
/* one engine                                                                                */

static void fill_config(const run_arg *a, sg_config *cfg) {
  const tcase *tc = a->tc;
  sg_config_init(cfg, sizeof *cfg);
  cfg->strategy = tc->strategy;
  cfg->param_dtype = cfg->grad_dtype = cfg->reduce_dtype = tc->pdt;
  cfg->bucket_bytes = BUCKET_BYTES;
  cfg->max_grad_norm = tc->clip;
  cfg->grad_average = a->avg;
  cfg->lr = LR;
  cfg->timeout_ms = g_timeout_ms;
  cfg->replica_reduce_dtype = tc->wire;
  cfg->loss_scale = tc->pdt == SG_F16 ? 0.0f : 1.0f; /* f16: dynamic */
  cfg->init_loss_scale = 8.0f;
  cfg->device = a->cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg->offload_optimizer = a->offload;
}

/* The device fields of rank r's run_arg for a run of `kind` (--cuda: the hybrid runs only). */
static void device_fields(run_arg *a, const dev_opts *d, int kind, const unsigned char *id) {
  a->cuda = d->cuda && kind == K_HYBRID;
  a->offload = a->cuda && d->offload;
  a->shard_nccl = a->cuda && d->shard_nccl;
  a->rep_nccl = a->cuda && d->rep_nccl;
  a->nccl_id = a->shard_nccl || a->rep_nccl ? id : NULL;
}

/* The engine of this rank's layout; *shard / *replica: the split communicators (hybrid). */
static sg_status make_engine(run_arg *a, sg_comm **shard, sg_comm **replica, sg_engine **e) {
  sg_config cfg;
  fill_config(a, &cfg);
  if (a->kind != K_HYBRID) return sg_engine_create(a->world, &cfg, e);
  sg_comm *nw = NULL; /* the NCCL world: its splits outlive it */
  sg_status st = SG_OK;
  if (a->nccl_id) st = sg_comm_create_nccl(a->rank, a->n * a->l, a->nccl_id, 0, &nw);
  if (!st) st = sg_comm_split(a->shard_nccl ? nw : a->world, a->rank / a->l, a->rank, shard);
  if (!st) st = sg_comm_split(a->rep_nccl ? nw : a->world, a->rank % a->l, a->rank, replica);
  if (!st) st = sg_engine_create_hybrid(*shard, *replica, &cfg, e);
  sg_comm_destroy(nw);
  return st;
}

static sg_status setup(run_arg *a, sg_engine *e, int *ids) {
  sg_status st = SG_OK;
  for (int p = 0; p < NP && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d.%s", p, p % 3 == 1 ? "bias" : "weight");
    st = sg_add_param(e, name, k_sizes[p], p % 3 == 1 ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st) st = sg_finalize(e);
  float *buf = malloc(k_sizes[NP - 1] * sizeof *buf);
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = init_val(p, i);
    st = sg_set_param(e, ids[p], buf, SG_F32);
  }
  free(buf);
  if (!st && a->tc->declare) st = sg_set_microbatches(e, a->tc->mb);
  return st;
}

/* Through the device's copy: on CUDA the slot is device memory, zeroed on the compute queue. */
static sg_status write_grad(run_arg *a, sg_engine *e, int id, int p, int step, int k) {
  void *g = NULL, *h = malloc(k_sizes[p] * 4);
  sg_status st = h ? sg_grad_ptr(e, id, &g) : SG_ERR_OUT_OF_MEMORY;
  const int d = a->n * a->l;
  for (size_t i = 0; !st && i < k_sizes[p]; i++)
    sg_elem_store(h, a->tc->pdt, i, fed_val(a, a->rank, d, step, k, p, i));
  if (!st)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, g, h, k_sizes[p] * (a->tc->pdt == SG_F32 ? 4u : 2u),
                           SG_COPY_H2D);
  free(h);
  return st ? st : sg_grad_ready(e, id);
}

static sg_status micro_batch(run_arg *a, sg_engine *e, const int *ids, int step, int k) {
  sg_status st = SG_OK;
  if (a->tc->nosync) st = sg_set_sync(e, k == a->tc->mb - 1);
  for (int p = NP - 1; p >= 0 && !st; p--) st = write_grad(a, e, ids[p], p, step, k);
  return st ? st : sg_backward_end(e);
}

static sg_status one_step(run_arg *a, sg_engine *e, const int *ids, int s) {
  sg_status st = SG_OK;
  const int step = a->step0 + s;
  const int mbs = a->tc->empty_step && step == 1 ? 0 : a->tc->mb;
  for (int k = 0; k < mbs && !st; k++) st = micro_batch(a, e, ids, step, k);
  /* a step without gradients: see run_arg.zeros */
  for (int p = 0; mbs == 0 && a->zeros && a->kind != K_HYBRID && p < NP && !st; p++)
    st = sg_grad_ready(e, ids[p]);
  if (a->tc->redo && step == 1) {
    if (!st) st = sg_grad_zero(e);
    for (int k = 0; k < mbs && !st; k++) st = micro_batch(a, e, ids, step + 7, k);
  }
  sg_step_info info;
  memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  if (!st) st = sg_step(e, &info);
  if (!st) {
    a->res->norm[s] = info.grad_norm;
    a->res->scale[s] = info.loss_scale;
    a->res->skipped[s] = info.skipped;
  }
  return st;
}

static sg_status collect(run_arg *a, sg_engine *e, const int *ids) {
  return sg_test_read_state(e, ids, k_sizes, NP, SG_TEST_STATE_OF(a->res));
}

static sg_status train(run_arg *a, sg_engine *e, const int *ids) {
  sg_status st = SG_OK;
  if (a->load_dir) st = sg_load(e, a->load_dir);
  for (int s = 0; s < a->tc->steps && !st; s++) {
    if (a->save_dir && s == a->save_after) st = sg_save(e, a->save_dir);
    if (!st) st = one_step(a, e, ids, s);
  }
  return st;
}

static void *run_thread(void *arg) {
  run_arg *a = arg;
  sg_comm *shard = NULL, *replica = NULL;
  sg_engine *e = NULL;
  int ids[NP];
  sg_status st = make_engine(a, &shard, &replica, &e);
  if (!st) st = setup(a, e, ids);
  if (!st) st = train(a, e, ids);
  if (!st) st = collect(a, e, ids);
  a->res->ok = st == SG_OK;
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  return NULL;
}

static void free_result(result *r) {
  sg_test_free_state(NP, SG_TEST_STATE_OF(r));
  memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------------------------------- */
/* runs and comparisons                                                                      */

/* The world communicators of a run of w ranks (threads) and, for NCCL splits, an id. */
static int make_worlds(int w, const dev_opts *d, sg_comm **comms, unsigned char id[128]) {
  if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "local comm of %d", w)) return 0;
  if (!d->shard_nccl && !d->rep_nccl) return 1;
  return CHECK(sg_nccl_unique_id(id) == SG_OK, "NCCL id: %s", sg_last_error());
}

static const char *kind_name(const run_arg *a) {
  if (a->kind == K_HYBRID)
    return !a->cuda ? "hybrid" : a->offload ? "hybrid cuda+offload" : "hybrid cuda";
  return a->kind == K_FLAT ? "flat" : "single";
}

/* Runs a layout as threads; res[w] gets every rank's result. `d`: the devices (NULL: g_dev). */
static void run_layout_on(const run_arg *proto, const dev_opts *d, int kind, int n, int l,
                          result *res) {
  const int w = kind == K_SINGLE ? 1 : n * l;
  sg_comm *comms[MAXW];
  unsigned char id[128];
  run_arg a[MAXW];
  pthread_t th[MAXW];
  if (!d) d = &g_dev;
  if (!make_worlds(w, d, comms, id)) return;
  for (int r = 0; r < w; r++) {
    a[r] = *proto;
    a[r].kind = kind;
    a[r].n = kind == K_SINGLE ? 1 : n;
    a[r].l = kind == K_SINGLE ? 1 : l;
    a[r].world = comms[r];
    a[r].rank = r;
    a[r].res = &res[r];
    a[r].err[0] = 0;
    device_fields(&a[r], d, kind, id);
    pthread_create(&th[r], NULL, run_thread, &a[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) {
    CHECK(res[r].ok, "%s: %s %dx%d rank %d ran (%s)", proto->tc->name, kind_name(&a[r]), n, l,
          r, a[r].err);
    sg_comm_destroy(comms[r]);
  }
}

static void run_layout(const run_arg *proto, int kind, int n, int l, result *res) {
  run_layout_on(proto, NULL, kind, n, l, res);
}

static void compare_steps(const char *what, const result *got, const result *ref, int steps,
                          int ref0) {
  if (!got->ok || !ref->ok) return;
  const char *names[4] = {"param", "master", "m", "v"};
  for (int p = 0; p < NP; p++) {
    float *const g4[4] = {got->param[p], got->master[p], got->m[p], got->v[p]};
    float *const r4[4] = {ref->param[p], ref->master[p], ref->m[p], ref->v[p]};
    for (int k = 0; k < 4; k++) {
      const size_t i = sg_test_first_diff(g4[k], r4[k], k_sizes[p]);
      CHECK(i == k_sizes[p], "%s: %s of param %d bitwise (first difference at %zu: %.9g vs %.9g)",
            what, names[k], p, i, i < k_sizes[p] ? g4[k][i] : 0.0, i < k_sizes[p] ? r4[k][i] : 0.0);
    }
  }
  for (int s = 0; s < steps; s++) {
    const int t = s + ref0;
    CHECK(memcmp(&got->norm[s], &ref->norm[t], 4) == 0 && got->skipped[s] == ref->skipped[t] &&
              got->scale[s] == ref->scale[t],
          "%s: step %d norm %.9g/%.9g skipped %d/%d scale %g/%g", what, s, got->norm[s],
          ref->norm[t], got->skipped[s], ref->skipped[t], got->scale[s], ref->scale[t]);
  }
}

static void compare_bitwise(const char *what, const result *got, const result *ref, int steps) {
  compare_steps(what, got, ref, steps, 0);
}

static int avg_for(int w) { return (w & (w - 1)) == 0; }

/* Hybrid n x l against flat at W = n x l and one rank on the combined batch. */
static void run_matrix_case(const tcase *tc, int n, int l) {
  const int w = n * l;
  run_arg proto;
  memset(&proto, 0, sizeof proto);
  proto.tc = tc;
  proto.vw = w;
  proto.avg = avg_for(w);
  proto.zeros = n > 1;
  result hy[MAXW], fl[MAXW], one[1];
  memset(hy, 0, sizeof hy);
  memset(fl, 0, sizeof fl);
  memset(one, 0, sizeof one);
  run_layout(&proto, K_HYBRID, n, l, hy);
  run_layout(&proto, K_FLAT, n, l, fl);
  run_layout(&proto, K_SINGLE, 1, 1, one);
  char what[200];
  const char *dev = !g_dev.cuda ? "" : g_dev.offload ? " (cuda+offload)" : " (cuda)";
  for (int r = 0; r < w; r++) {
    snprintf(what, sizeof what, "%s %dx%d%s rank %d vs flat W=%d", tc->name, n, l, dev, r, w);
    compare_bitwise(what, &hy[r], &fl[r], tc->steps);
    snprintf(what, sizeof what, "%s %dx%d%s rank %d vs one rank", tc->name, n, l, dev, r);
    compare_bitwise(what, &hy[r], &one[0], tc->steps);
  }
  /* --cuda: against the CPU's hybrid engine of the same layout, and offloaded against the
   * same engine (the same communicators) without offload */
  for (int ref = 0; g_dev.cuda && !g_smoke && ref < 1 + g_dev.offload; ref++) {
    dev_opts d = {0, 0, 0, 0};
    if (ref == 1) d = (dev_opts){1, 0, g_dev.shard_nccl, g_dev.rep_nccl};
    result other[MAXW];
    memset(other, 0, sizeof other);
    run_layout_on(&proto, &d, K_HYBRID, n, l, other);
    for (int r = 0; r < w; r++) {
      snprintf(what, sizeof what, "%s %dx%d%s rank %d vs the hybrid engine %s", tc->name, n, l,
               dev, r, ref ? "on cuda without offload" : "on the cpu");
      compare_bitwise(what, &hy[r], &other[r], tc->steps);
      free_result(&other[r]);
    }
  }
  if (tc->inject && hy[0].ok)
    for (int r = 0; r < w; r++)
      CHECK(hy[r].skipped[1] == 1 && hy[r].skipped[0] == 0 && hy[r].scale[2] == hy[r].scale[1] / 2,
            "%s %dx%d rank %d: the non-finite step is skipped and the scale halves", tc->name, n,
            l, r);
  for (int r = 0; r < w; r++) {
    free_result(&hy[r]);
    free_result(&fl[r]);
  }
  free_result(&one[0]);
}

static const tcase k_cases[] = {
    {"grad_op f32 mb1", SG_SHARD_GRAD_OP, SG_F32, 1, 0, 0, 0.0f, SG_F32, 0, 0, 3, 0, 0},
    {"grad_op f32 mb3 declared", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f, SG_F32, 0, 0, 3, 0, 0},
    {"grad_op f32 mb3 no_sync", SG_SHARD_GRAD_OP, SG_F32, 3, 1, 0, 0.0f, SG_F32, 0, 0, 3, 0, 0},
    {"grad_op bf16 mb3 declared clip", SG_SHARD_GRAD_OP, SG_BF16, 3, 0, 1, 1.0f, SG_F32, 0, 0, 3, 0, 0},
    {"shard_opt f32 mb3 no_sync declared", SG_SHARD_OPT, SG_F32, 3, 1, 1, 0.0f, SG_F32, 0, 0, 3, 0, 0},
    {"grad_op bf16 mb1 clip", SG_SHARD_GRAD_OP, SG_BF16, 1, 0, 0, 1.0f, SG_F32, 0, 0, 3, 0, 0},
    {"grad_op f16 mb2 declared inf on one rank", SG_SHARD_GRAD_OP, SG_F16, 2, 0, 1, 0.0f, SG_F32,
     1, 0, 3, 0, 0},
    {"grad_op f32 mb3 declared bf16 wire (exact)", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f,
     SG_BF16, 0, 0, 3, 0, 0},
    {"grad_op bf16 mb2 declared, a step without gradients", SG_SHARD_GRAD_OP, SG_BF16, 2, 0, 1,
     0.0f, SG_BF16, 0, 0, 3, 1, 0},
    {"grad_op f32 mb2 declared, sg_grad_zero after the replica sums", SG_SHARD_GRAD_OP, SG_F32, 2,
     0, 1, 0.0f, SG_F32, 0, 0, 3, 0, 1},
};
#define NCASES ((int)(sizeof k_cases / sizeof k_cases[0]))

static const int k_layouts[][2] = {{2, 2}, {3, 2}, {2, 3}, {4, 1}, {1, 4}};

/* --cuda: 2x2 and 3x2 (quick: the even cases), 4x1 and 1x4 (the first two cases) */
static const int k_cuda_layouts[][2] = {{2, 2}, {3, 2}, {4, 1}, {1, 4}};

static void run_matrix(void) {
  const int nl = g_dev.cuda ? (g_quick ? 2 : 4) : 5;
  for (int li = 0; li < nl; li++)
    for (int c = 0; c < NCASES; c++) {
      if (!g_dev.cuda && g_quick && c % 2 && li > 1) continue;
      if (g_dev.cuda && ((g_quick && c % 2) || (li > 1 && c > 1))) continue;
      if (g_smoke && (li > 0 || (c != 6 && c != 8))) continue;
      const int *lay = g_dev.cuda ? k_cuda_layouts[li] : k_layouts[li];
      const int before = sg_test_failures();
      run_matrix_case(&k_cases[c], lay[0], lay[1]);
      printf("%s  matrix %dx%d: %s\n", sg_test_failures() == before ? "ok  " : "FAIL", lay[0],
             lay[1], k_cases[c].name);
      fflush(stdout);
    }
}


/* ---------------------------------------------------------------------------------------- */
/* a body per rank on a finalized engine                                                     */

/* The engine's comm queue, and a staged replica stage's host queue (its all-reduces). */
static sg_status drain(sg_engine *e) {
  sg_status st = e->dev->ops->comm_wait(e->dev, e->last_ticket, sg__now_ms() + 60000);
  sg__device *h = e->rep.host_dev;
  if (!st && h && e->rep.host_last) st = h->ops->comm_wait(h, e->rep.host_last, sg__now_ms() + 60000);
  return st;
}

typedef void (*body_fn)(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                        sg_comm *replica, void *ctx);
typedef struct {
  run_arg a;
  body_fn fn;
  void *ctx;
} body_arg;

static void *body_thread(void *arg) {
  body_arg *b = arg;
  run_arg *a = &b->a;
  sg_comm *shard = NULL, *replica = NULL;
  sg_engine *e = NULL;
  int ids[NP];
  sg_status st = make_engine(a, &shard, &replica, &e);
  if (!st) st = setup(a, e, ids);
  if (CHECK(!st, "%s %dx%d rank %d: engine", a->tc->name, a->n, a->l, a->rank))
    b->fn(a, e, ids, shard, replica, b->ctx);
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  return NULL;
}

static void run_bodies_res(const tcase *tc, int kind, int n, int l, body_fn fn, void *ctx,
                           result *res) {
  const int w = n * l;
  sg_comm *comms[MAXW];
  unsigned char id[128];
  body_arg b[MAXW];
  pthread_t th[MAXW];
  if (!make_worlds(w, &g_dev, comms, id)) return;
  for (int r = 0; r < w; r++) {
    memset(&b[r], 0, sizeof b[r]);
    b[r].a = (run_arg){.tc = tc, .kind = kind, .n = n, .l = l, .vw = w, .avg = avg_for(w),
                       .world = comms[r], .rank = r, .res = &res[r]};
    device_fields(&b[r].a, &g_dev, kind, id);
    b[r].fn = fn;
    b[r].ctx = ctx;
    pthread_create(&th[r], NULL, body_thread, &b[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
}

static void run_bodies(const tcase *tc, int kind, int n, int l, body_fn fn, void *ctx) {
  result res[MAXW];
  memset(res, 0, sizeof res);
  run_bodies_res(tc, kind, n, l, fn, ctx, res);
  for (int r = 0; r < n * l; r++) free_result(&res[r]);
}

/* ---------------------------------------------------------------------------------------- */
/* bf16 on the replica wire, random gradients                                                */

/* The reduced gradient on the shard against its exact sum (double, from the data): each node's
 * fp32 sum is rounded to bf16 (8 significant bits: error <= 2^-8 of its magnitude), the fp32
 * sum over replicas is rounded once more, so |bf16 wire - exact| <= 2^-7 x sum of |g| over every
 * rank and micro-batch (x 1.01 for the fp32 sums); an f32 wire stays within 2^-20 of it. Some
 * elements must differ from the exact sum (the wire did round), the norm is within 2^-7 of the
 * f32 wire's, and every rank holds the same bits after the steps. */
static void wire_body(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                      sg_comm *replica, void *ctx) {
  const double tol = a->tc->wire == SG_BF16 ? ldexp(1.0, -7) * 1.01 : ldexp(1.0, -20);
  sg_status st = SG_OK;
  for (int k = 0; k < a->tc->mb && !st; k++) st = micro_batch(a, e, ids, 0, k);
  float norm = 0;
  if (!st) st = sg_grad_norm(e, &norm);
  if (!st) st = drain(e);
  if (!CHECK(!st, "wire: micro-batches and norm")) return;
  float *acc = malloc(e->plan->shard_numel * 4); /* the accumulator (device memory on CUDA) */
  if (!CHECK(acc && e->dev->ops->copy(e->dev, SG_Q_COMPUTE, acc, e->g.accum,
                                      e->plan->shard_numel * 4, SG_COPY_D2H) == SG_OK,
             "wire: the accumulator")) {
    free(acc);
    return;
  }
  double worst = 0;
  size_t differ = 0, checked = 0;
  for (int p = 0; p < NP; p++) {
    const sg__plan_param *pp = &e->plan->params[ids[p]];
    sg__owned o;
    e->strat->owned(e->plan, e->rank, pp->bucket, &o);
    for (size_t i = 0; i < k_sizes[p]; i++) {
      const size_t flat = pp->offset + i;
      if (flat < o.flat0 || flat >= o.flat0 + o.n) continue;
      double exact = 0, sabs = 0;
      for (int k = 0; k < a->tc->mb; k++)
        for (int v = 0; v < a->vw; v++) {
          const double g = grad_val(a->tc, v, 0, k, p, i);
          exact += g;
          sabs += fabs(g);
        }
      const double got = acc[o.state0 + (flat - o.flat0)], d = fabs(got - exact);
      if (d / sabs > worst) worst = d / sabs;
      differ += (float)exact != (float)got;
      checked++;
    }
  }
  free(acc);
  ((double *)ctx)[a->rank] = worst;
  ((double *)ctx)[MAXW + a->rank] = (double)differ;
  ((double *)ctx)[2 * MAXW + a->rank] = norm;
  CHECK(worst <= tol, "%s %dx%d rank %d: reduced gradient within %.3g x sum|g| of the exact sum "
        "(worst %.3g over %zu elements)", a->tc->name, a->n, a->l, a->rank, tol, worst, checked);
  CHECK(sg_step(e, NULL) == SG_OK, "wire: step");
  CHECK(collect(a, e, ids) == SG_OK, "wire: collect");
  a->res->ok = 1;
}

static void check_bf16_wire(int n, int l) {
  const int w = n * l;
  double f[3 * MAXW] = {0}, b[3 * MAXW] = {0};
  tcase tf = {"random f32 wire", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f, SG_F32, 0, 1, 1, 0, 0};
  tcase tb = tf;
  tb.name = "random bf16 wire";
  tb.wire = SG_BF16;
  result rf[MAXW], rb[MAXW];
  memset(rf, 0, sizeof rf);
  memset(rb, 0, sizeof rb);
  run_bodies_res(&tf, K_HYBRID, n, l, wire_body, f, rf);
  run_bodies_res(&tb, K_HYBRID, n, l, wire_body, b, rb);
  double differ = 0, worst = 0;
  for (int r = 0; r < w; r++) {
    differ += b[MAXW + r];
    if (b[r] > worst) worst = b[r];
  }
  CHECK(differ > 0, "bf16 wire %dx%d: the wire rounded (%.0f elements differ from the exact sum)",
        n, l, differ);
  CHECK(fabs(b[2 * MAXW] - f[2 * MAXW]) <= ldexp(1.0, -7) * f[2 * MAXW],
        "bf16 wire %dx%d: norm %.9g within 2^-7 of the f32 wire's %.9g", n, l, b[2 * MAXW],
        f[2 * MAXW]);
  for (int r = 1; r < w; r++) {
    compare_bitwise("bf16 wire: every rank holds the same bits", &rb[r], &rb[0], 0);
    compare_bitwise("f32 wire: every rank holds the same bits", &rf[r], &rf[0], 0);
  }
  printf("bf16 wire %dx%d: worst |error| %.3g x sum|g| (bound 2^-7 = %.3g), %.0f of the shard "
         "elements rounded; norm %.9g vs %.9g\n", n, l, worst, ldexp(1.0, -7), differ,
         b[2 * MAXW], f[2 * MAXW]);
  for (int r = 0; r < w; r++) {
    free_result(&rf[r]);
    free_result(&rb[r]);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* traffic                                                                                   */

static sg_comm_traffic traffic(sg_comm *c) {
  sg_comm_traffic t;
  memset(&t, 0, sizeof t);
  t.struct_size = sizeof t;
  if (sg_comm_stats(c, &t) != SG_OK) t.bytes_sent = t.collectives = UINT64_MAX;
  return t;
}


/* Bytes the replica all-reduces of one step send, as sg_comm_stats counts them (rounded down
 * per collective), and the formula 2(N-1)/N x shard bytes. */
static void expected_bytes(const sg_engine *e, int n, size_t wsz, uint64_t *exact, double *formula) {
  *exact = 0;
  for (int b = 0; b < e->plan->nbuckets; b++)
    *exact += 2u * (uint64_t)(n - 1) * (uint64_t)(sg__plan_slice_numel(e->plan, b) * wsz) /
              (uint64_t)n;
  *formula = 2.0 * (n - 1) / n * (double)(e->plan->shard_numel * wsz);
}

/* ctx: 1 when the micro-batches are declared (the all-reduces run in the last micro-batch). */
static void stats_body(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                       sg_comm *replica, void *ctx) {
  const int declare = *(const int *)ctx, n = a->n, mb = a->tc->mb;
  const size_t wsz = a->tc->wire == SG_F32 ? 4 : 2;
  if (!declare) CHECK(sg_set_microbatches(e, 0) == SG_OK, "undeclare");
  uint64_t exact = 0;
  double formula = 0;
  expected_bytes(e, n, wsz, &exact, &formula);
  sg_test_quiet = 1;
  for (int step = 0; step < 2; step++) {
    const sg_comm_traffic r0 = traffic(replica), h0 = traffic(shard);
    sg_status st = SG_OK;
    for (int k = 0; k < mb && !st; k++) {
      st = micro_batch(a, e, ids, step, k);
      if (!st) st = drain(e);
      /* offloaded: the slices are summed across replicas at the step, once folded on the host */
      const uint64_t want = k < mb - 1 || !declare || a->offload ? 0 : exact;
      const uint64_t got = traffic(replica).bytes_sent - r0.bytes_sent;
      CHECK(!st && got == want, "%dx%d rank %d %s step %d micro-batch %d: %llu replica bytes "
            "so far (expected %llu)", n, a->l, a->rank, declare ? "declared" : "not declared",
            step, k, (unsigned long long)got, (unsigned long long)want);
      if (a->l > 1)
        CHECK(traffic(shard).bytes_sent > h0.bytes_sent, "micro-batch %d reduce-scattered "
              "inside the node", k);
    }
    if (!st) st = sg_step(e, NULL);
    CHECK(!st, "step %d", step);
    const sg_comm_traffic r1 = traffic(replica);
    const uint64_t got = r1.bytes_sent - r0.bytes_sent, gotc = r1.collectives - r0.collectives;
    CHECK(got == exact && gotc == (uint64_t)e->plan->nbuckets, "%dx%d rank %d step %d: %llu "
          "replica bytes in %llu all-reduces, expected %llu in %d", n, a->l, a->rank, step,
          (unsigned long long)got, (unsigned long long)gotc, (unsigned long long)exact,
          e->plan->nbuckets);
    CHECK(fabs((double)got - formula) < e->plan->nbuckets, "%dx%d: %llu bytes = 2(N-1)/N x "
          "shard bytes (%.1f) up to the per-collective rounding", n, a->l,
          (unsigned long long)got, formula);
    if (a->rank == 0 && step == 0)
      printf("traffic %dx%d %s, %s wire: %llu replica bytes per step in %llu all-reduces "
             "(2(N-1)/N x %zu shard bytes = %.1f), shard %llu\n", n, a->l,
             declare ? "declared" : "not declared", wsz == 4 ? "f32" : "bf16",
             (unsigned long long)got, (unsigned long long)gotc, e->plan->shard_numel * wsz,
             formula, (unsigned long long)(traffic(shard).bytes_sent - h0.bytes_sent));
  }
  sg_test_quiet = 0;
}

static void run_stats(void) {
  static const int lay[][2] = {{2, 2}, {3, 2}, {2, 3}};
  const int nl = !g_dev.cuda ? 3 : g_quick ? 1 : 2;
  for (int li = 0; li < nl; li++)
    for (int declare = 0; declare < 2; declare++)
      for (int wi = 0; wi < 2; wi++) {
        tcase tc = {"traffic", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f, wi ? SG_BF16 : SG_F32,
                    0, 0, 2, 0, 0};
        run_bodies(&tc, K_HYBRID, lay[li][0], lay[li][1], stats_body, &declare);
      }
}

/* ---------------------------------------------------------------------------------------- */
/* memory                                                                                    */

static void memory_body(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                        sg_comm *replica, void *ctx) {
  sg_memory_stats got, est, flat;
  memset(&got, 0, sizeof got);
  got.struct_size = est.struct_size = flat.struct_size = sizeof got;
  sg_config cfg;
  fill_config(a, &cfg);
  size_t numels[NP];
  for (int p = 0; p < NP; p++) numels[p] = k_sizes[p];
  CHECK(sg_memory(e, &got) == SG_OK, "sg_memory");
  cfg.shard_ranks = a->l;
  CHECK(sg_estimate_memory(&cfg, numels, NP, a->n * a->l, &est) == SG_OK, "estimate hybrid");
  cfg.shard_ranks = 0;
  CHECK(sg_estimate_memory(&cfg, numels, NP, a->l, &flat) == SG_OK, "estimate flat at L");
  const size_t extra = a->tc->wire != SG_F32 && a->n > 1 ? 1 : 0;
  CHECK(got.params_bytes == est.params_bytes && got.grads_bytes == est.grads_bytes &&
            got.master_bytes == est.master_bytes && got.optim_bytes == est.optim_bytes &&
            got.comm_bytes == est.comm_bytes && got.total_bytes == est.total_bytes &&
            got.shard_numel == est.shard_numel && got.numel == est.numel &&
            got.host_bytes == est.host_bytes,
        "%dx%d: sg_memory equals sg_estimate_memory(shard_ranks %d, world %d) (total %zu vs %zu, "
        "host %zu vs %zu)", a->n, a->l, a->l, a->n * a->l, got.total_bytes, est.total_bytes,
        got.host_bytes, est.host_bytes);
  /* the bf16 wire buffer: communication scratch, or host memory beside an offloaded accumulator */
  CHECK(est.params_bytes == flat.params_bytes && est.grads_bytes == flat.grads_bytes &&
            est.master_bytes == flat.master_bytes && est.optim_bytes == flat.optim_bytes &&
            (extra && !a->offload ? est.comm_bytes > flat.comm_bytes
                                  : est.comm_bytes == flat.comm_bytes) &&
            (extra && a->offload ? est.host_bytes > flat.host_bytes
                                 : est.host_bytes == flat.host_bytes),
        "%dx%d: the layout of a flat engine over L = %d ranks (comm + the bf16 wire buffer, or "
        "host + it when offloaded)", a->n, a->l, a->l);
  if (a->offload) return; /* the shard's state is host memory: host_bytes, checked above */
  /* 2 + 16/L bytes per parameter: bf16 params, fp32 master, m, v and accumulator on the shard */
  const double per = (double)(got.params_bytes + got.master_bytes + got.optim_bytes +
                              4 * got.shard_numel) / (double)got.numel;
  CHECK(got.shard_numel * (size_t)a->l == got.numel && got.params_bytes == 2 * got.numel &&
            got.master_bytes == 4 * got.shard_numel && got.optim_bytes == 8 * got.shard_numel &&
            fabs(per - (2.0 + 16.0 / a->l)) < 1e-12,
        "%dx%d: %.4f bytes per parameter = 2 + 16/%d", a->n, a->l, per, a->l);
  if (a->rank == 0)
    printf("memory %dx%d: %.4f bytes/param (2 + 16/L = %.4f), staging %zu, comm %zu bytes\n",
           a->n, a->l, per, 2.0 + 16.0 / a->l, got.grads_bytes - 4 * got.shard_numel,
           got.comm_bytes);
}

static void run_memory(void) {
  tcase tc = {"memory", SG_SHARD_GRAD_OP, SG_BF16, 1, 0, 0, 0.0f, SG_F32, 0, 0, 0, 0, 0};
  run_bodies(&tc, K_HYBRID, 2, 2, memory_body, NULL);
  run_bodies(&tc, K_HYBRID, 2, 3, memory_body, NULL);
  tc.wire = SG_BF16;
  run_bodies(&tc, K_HYBRID, 3, 2, memory_body, NULL);
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  size_t numels[2] = {1000, 10};
  sg_memory_stats st;
  st.struct_size = sizeof st;
  cfg.shard_ranks = 3;
  CHECK(sg_estimate_memory(&cfg, numels, 2, 4, &st) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "multiple"),
        "estimate: world 4 is not a multiple of shard_ranks 3");
  cfg.shard_ranks = 2;
  cfg.strategy = SG_NO_SHARD;
  CHECK(sg_estimate_memory(&cfg, numels, 2, 4, &st) == SG_ERR_INVALID_ARGUMENT,
        "estimate: shard_ranks with NO_SHARD");
}

/* ---------------------------------------------------------------------------------------- */
/* errors                                                                                    */

static void run_argument_errors(void) {
  sg_comm *a = NULL, *b = NULL;
  sg_engine *e = (sg_engine *)1;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  if (!CHECK(sg_comm_create_local(1, &a) == SG_OK && sg_comm_create_local(1, &b) == SG_OK,
             "comms"))
    return;
  CHECK(sg_engine_create_hybrid(a, b, &cfg, NULL) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "out is NULL"), "NULL out");
  CHECK(sg_engine_create_hybrid(NULL, b, &cfg, &e) == SG_ERR_INVALID_ARGUMENT && e == NULL &&
            strstr(sg_last_error(), "shard is NULL"), "NULL shard");
  CHECK(sg_engine_create_hybrid(a, NULL, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "replica is NULL"), "NULL replica");
  CHECK(sg_engine_create_hybrid(a, b, NULL, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "cfg is NULL"), "NULL cfg");
  CHECK(sg_engine_create_hybrid(a, a, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "same communicator"), "the same communicator twice");
  cfg.strategy = SG_NO_SHARD;
  CHECK(sg_engine_create_hybrid(a, b, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "nothing to shard"), "NO_SHARD refused");
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.shard_ranks = 2;
  CHECK(sg_engine_create_hybrid(a, b, &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "shard_ranks"), "shard_ranks 2 with a shard of 1");
  cfg.shard_ranks = 1;
  cfg.device = SG_DEVICE_CUDA; /* threads on the CUDA device: both channels host-driven */
  const sg_status cst = sg_engine_create_hybrid(a, b, &cfg, &e);
  CHECK(cst == SG_OK || (!g_dev.cuda && (cst == SG_ERR_UNSUPPORTED || cst == SG_ERR_CUDA)),
        "CUDA: a hybrid engine, or no CUDA here (%s)", sg_status_string(cst));
  if (cst == SG_OK) sg_engine_destroy(e);
  cfg.device = SG_DEVICE_CPU;
  CHECK(sg_engine_create_hybrid(a, b, &cfg, &e) == SG_OK, "shard_ranks = L is fine");
  CHECK(sg_set_microbatches(NULL, 1) == SG_ERR_INVALID_ARGUMENT, "set_microbatches NULL");
  CHECK(sg_set_microbatches(e, 1) == SG_ERR_INVALID_STATE, "set_microbatches before finalize");
  int id = 0;
  CHECK(sg_add_param(e, "w", 100, 0, &id) == SG_OK && sg_finalize(e) == SG_OK, "finalize 1x1");
  CHECK(sg_set_microbatches(e, -1) == SG_ERR_INVALID_ARGUMENT, "set_microbatches -1");
  CHECK(sg_broadcast_params(e, 1) == SG_ERR_INVALID_ARGUMENT, "broadcast root outside W");
  CHECK(sg_broadcast_params(e, 0) == SG_OK, "broadcast root 0");
  sg_engine_destroy(e);
  sg_comm_destroy(a);
  sg_comm_destroy(b);
}

typedef struct {
  sg_comm *world;
  int rank, shard_color, replica_color, extra_param;
  sg_status st;
  char msg[600];
} split_arg;

static void *split_thread(void *arg) {
  split_arg *s = arg;
  sg_comm *shard = NULL, *replica = NULL;
  sg_engine *e = NULL;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 20000;
  int id = 0;
  sg_status st = sg_comm_split(s->world, s->shard_color, s->rank, &shard);
  if (!st) st = sg_comm_split(s->world, s->replica_color, s->rank, &replica);
  if (!st) st = sg_engine_create_hybrid(shard, replica, &cfg, &e);
  if (!st) st = sg_add_param(e, "w", 1000, 0, &id);
  if (!st && s->extra_param) st = sg_add_param(e, "extra", 10, 0, &id);
  if (!st) st = sg_finalize(e);
  s->st = st;
  snprintf(s->msg, sizeof s->msg, "%s", st ? sg_last_error() : "");
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  return NULL;
}

/* Every rank's sg_finalize fails with SG_ERR_MISMATCH and a message containing `want`
 * (on the ranks that see the difference first; the others name the failing replica or rank). */
static void run_split_case(const char *what, int w, const int *shard_color,
                           const int *replica_color, int extra_rank) {
  sg_comm *comms[MAXW];
  split_arg s[MAXW];
  pthread_t th[MAXW];
  if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "comm")) return;
  for (int r = 0; r < w; r++) {
    s[r] = (split_arg){comms[r], r, shard_color[r], replica_color[r], r == extra_rank, SG_OK, ""};
    pthread_create(&th[r], NULL, split_thread, &s[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) {
    CHECK(s[r].st == SG_ERR_MISMATCH && strstr(s[r].msg, "sg_finalize"),
          "%s: rank %d gets SG_ERR_MISMATCH (%s: %s)", what, r, sg_status_string(s[r].st),
          s[r].msg);
    if (r == 0 || r == w - 1) printf("%s, rank %d: %s\n", what, r, s[r].msg);
    sg_comm_destroy(comms[r]);
  }
}

static void run_layout_errors(void) {
  /* 5 ranks as a node of 3 and a node of 2; the replica communicators join equal indices */
  const int sh5[] = {0, 0, 0, 1, 1}, rp5[] = {0, 1, 2, 0, 1};
  run_split_case("nodes of 3 and 2 ranks", 5, sh5, rp5, -1);
  /* 2x2 with replicas that pair index 0 with index 1 */
  const int sh4[] = {0, 0, 1, 1}, rp4[] = {0, 1, 1, 0};
  run_split_case("replica communicator across shard indices", 4, sh4, rp4, -1);
  /* 2x2, rank 3 registers one parameter more */
  const int rq4[] = {0, 1, 0, 1};
  run_split_case("rank 3 registers another parameter", 4, sh4, rq4, 3);
}

/* A further micro-batch after the declared last one: refused, the engine still steps. */
static void extra_mb_body(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                          sg_comm *replica, void *ctx) {
  void *g = NULL;
  CHECK(micro_batch(a, e, ids, 0, 0) == SG_OK, "the declared micro-batch");
  CHECK(sg_grad_ptr(e, ids[0], &g) == SG_ERR_INVALID_STATE &&
            strstr(sg_last_error(), "call sg_step first"), "a second micro-batch is refused");
  CHECK(sg_step(e, NULL) == SG_OK, "the step runs");
  CHECK(micro_batch(a, e, ids, 1, 0) == SG_OK && sg_step(e, NULL) == SG_OK, "and the next one");
}

/* Rank `dead` stops after its micro-batch (killed while the others sum across replicas): the
 * others' sg_step ends with SG_ERR_TIMEOUT at timeout_ms. */
typedef struct {
  pthread_barrier_t bar;
  int dead;
  sg_status st[MAXW];
  double ms[MAXW];
} kill_ctx;

static void kill_body(run_arg *a, sg_engine *e, const int *ids, sg_comm *shard,
                      sg_comm *replica, void *ctx) {
  kill_ctx *k = ctx;
  sg_status st = micro_batch(a, e, ids, 0, 0);
  if (!st) st = drain(e);
  if (a->rank != k->dead) {
    const int64_t t0 = sg__now_ms();
    st = sg_step(e, NULL);
    k->ms[a->rank] = (double)(sg__now_ms() - t0);
  }
  k->st[a->rank] = st;
  pthread_barrier_wait(&k->bar);
}

static void run_kill(void) {
  tcase tc = {"kill", SG_SHARD_GRAD_OP, SG_F32, 1, 0, 0, 0.0f, SG_F32, 0, 0, 1, 0, 0};
  kill_ctx k;
  memset(&k, 0, sizeof k);
  k.dead = 3;
  pthread_barrier_init(&k.bar, NULL, 4);
  g_timeout_ms = 1500;
  run_bodies(&tc, K_HYBRID, 2, 2, kill_body, &k);
  g_timeout_ms = 60000;
  pthread_barrier_destroy(&k.bar);
  for (int r = 0; r < 4; r++)
    if (r != k.dead)
      CHECK(k.st[r] == SG_ERR_TIMEOUT && k.ms[r] < 20000, "rank %d: SG_ERR_TIMEOUT after %.0f ms "
            "(got %s)", r, k.ms[r], sg_status_string(k.st[r]));
  printf("rank 3 killed before the replica all-reduce: ranks 0-2 %s/%s/%s after %.0f/%.0f/%.0f ms\n",
         sg_status_string(k.st[0]), sg_status_string(k.st[1]), sg_status_string(k.st[2]), k.ms[0],
         k.ms[1], k.ms[2]);
}

/* --cuda: an NCCL shard with a host replica, staged through host memory or offloaded. */
static void run_cuda_staged(void) {
  unsigned char id[128];
  sg_comm *nc = NULL, *loc = NULL;
  sg_engine *e = (sg_engine *)1;
  if (!CHECK(sg_nccl_unique_id(id) == SG_OK && sg_comm_create_nccl(0, 1, id, 0, &nc) == SG_OK &&
                 sg_comm_create_local(1, &loc) == SG_OK,
             "comms: %s", sg_last_error()))
    return;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.device = SG_DEVICE_CUDA;
  for (int off = 0; off < 2; off++) {
    cfg.offload_optimizer = off;
    int id0 = 0;
    CHECK(sg_engine_create_hybrid(nc, loc, &cfg, &e) == SG_OK &&
              sg_add_param(e, "w", 100, 0, &id0) == SG_OK && sg_finalize(e) == SG_OK &&
              sg_step(e, NULL) == SG_OK,
          "NCCL shard, host replica, %s: runs (%s)", off ? "offloaded" : "staged",
          sg_last_error());
    sg_engine_destroy(e);
    e = NULL;
  }
  sg_comm_destroy(nc);
  sg_comm_destroy(loc);
}

static void run_errors(void) {
  run_argument_errors();
  if (g_dev.cuda) {
    if (g_dev.shard_nccl || g_dev.rep_nccl) run_cuda_staged(); /* NCCL of one rank */
    tcase tc = {"extra micro-batch", SG_SHARD_GRAD_OP, SG_F32, 1, 0, 1, 0.0f, SG_F32, 0, 0, 1, 0, 0};
    run_bodies(&tc, K_HYBRID, 2, 2, extra_mb_body, NULL);
    return; /* the layout errors and the killed rank: the CPU run's (the same replica stage) */
  }
  run_layout_errors();
  tcase tc = {"extra micro-batch", SG_SHARD_GRAD_OP, SG_F32, 1, 0, 1, 0.0f, SG_F32, 0, 0, 1, 0, 0};
  run_bodies(&tc, K_HYBRID, 2, 2, extra_mb_body, NULL);
  run_kill();
}

/* ---------------------------------------------------------------------------------------- */
/* checkpoints                                                                               */

static int count_files(const char *dir, const char *suffix) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "ls '%s' | grep -c '%s$' 2>/dev/null", dir, suffix);
  FILE *f = popen(cmd, "r");
  int n = -1;
  if (f && fscanf(f, "%d", &n) != 1) n = -1;
  if (f) pclose(f);
  return n;
}

/* A run of 5 steps on `from` saved after 2 steps; every `to` layout loads it and runs the last
 * 3 steps on the same data: bitwise the same parameters, master, moments and norms. */
static void run_ckpt_from(int from_kind, int fn, int fl) {
  static const int to[][3] = {{K_SINGLE, 1, 1}, {K_FLAT, 1, 3}, {K_HYBRID, 2, 3}, {K_HYBRID, 2, 2}};
  char dir[] = "/tmp/sg_hybrid_ckpt_XXXXXX";
  if (!CHECK(mkdtemp(dir) != NULL, "temp dir")) return;
  tcase t5 = {"ckpt", SG_SHARD_GRAD_OP, SG_BF16, 2, 0, 1, 1.0f, SG_F32, 0, 0, 5, 0, 0};
  tcase t3 = t5;
  t3.steps = 3;
  run_arg proto;
  memset(&proto, 0, sizeof proto);
  proto.tc = &t5;
  proto.vw = 4;
  proto.avg = 0;
  proto.save_dir = dir;
  proto.save_after = 2;
  result a[MAXW];
  memset(a, 0, sizeof a);
  run_layout(&proto, from_kind, fn, fl, a);
  const int files = count_files(dir, "[.]shard");
  CHECK(files == fl, "checkpoint of %s %dx%d: one copy, %d rank files (got %d)",
        from_kind == K_HYBRID ? "hybrid" : "flat", fn, fl, fl, files);
  for (int t = 0; t < 4; t++) {
    run_arg lp = proto;
    lp.tc = &t3;
    lp.save_dir = NULL;
    lp.load_dir = dir;
    lp.step0 = 2;
    result b[MAXW];
    memset(b, 0, sizeof b);
    const int kind = to[t][0], n = to[t][1], l = to[t][2];
    run_layout(&lp, kind, n, l, b);
    for (int r = 0; r < (kind == K_SINGLE ? 1 : n * l); r++) {
      char what[160];
      snprintf(what, sizeof what, "saved by %s %dx%d, loaded by %s %dx%d rank %d, 3 steps",
               from_kind == K_HYBRID ? "hybrid" : "flat", fn, fl,
               kind == K_HYBRID ? "hybrid" : kind == K_FLAT ? "flat" : "one rank", n, l, r);
      compare_steps(what, &b[r], &a[0], 3, 2);
      free_result(&b[r]);
    }
  }
  for (int r = 0; r < fn * fl; r++) free_result(&a[r]);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  CHECK(system(cmd) == 0, "cleanup");
}

static void run_ckpt(void) {
  run_ckpt_from(K_HYBRID, 2, 2);
  run_ckpt_from(K_FLAT, 1, 4);
}

/* ---------------------------------------------------------------------------------------- */
/* MPI: one rank per process, 2 x 2                                                          */

static void run_mpi_case(const tcase *tc, sg_comm *world, int rank) {
  result hy, fl, one;
  memset(&hy, 0, sizeof hy);
  memset(&fl, 0, sizeof fl);
  memset(&one, 0, sizeof one);
  run_arg a = {.tc = tc, .kind = K_HYBRID, .n = 2, .l = 2, .vw = 4, .avg = 1, .world = world,
               .rank = rank, .res = &hy, .zeros = 1};
  device_fields(&a, &g_dev, K_HYBRID, NULL); /* --cuda local local: MPI on the (mock) GPU */
  run_thread(&a);
  a.cuda = a.offload = 0;
  CHECK(hy.ok, "%s: hybrid 2x2 ran (%s)", tc->name, a.err);
  a.kind = K_FLAT;
  a.res = &fl;
  run_thread(&a);
  CHECK(fl.ok, "%s: flat W=4 ran (%s)", tc->name, a.err);
  sg_comm *solo = NULL;
  if (CHECK(sg_comm_create_local(1, &solo) == SG_OK, "local comm of 1")) {
    run_arg s1 = {.tc = tc, .kind = K_SINGLE, .n = 1, .l = 1, .vw = 4, .avg = 1, .world = solo,
                  .rank = 0, .res = &one, .zeros = 1};
    run_thread(&s1);
    CHECK(one.ok, "%s: one rank ran (%s)", tc->name, s1.err);
    sg_comm_destroy(solo);
  }
  char what[160];
  snprintf(what, sizeof what, "mpi %s 2x2 vs flat W=4", tc->name);
  compare_bitwise(what, &hy, &fl, tc->steps);
  snprintf(what, sizeof what, "mpi %s 2x2 vs one rank", tc->name);
  compare_bitwise(what, &hy, &one, tc->steps);
  free_result(&hy);
  free_result(&fl);
  free_result(&one);
}

static int run_mpi(void) {
  sg_comm *world = NULL;
  if (!CHECK(sg_comm_create_mpi(NULL, &world) == SG_OK, "MPI communicator")) return 1;
  const int rank = sg_comm_rank(world), w = sg_comm_size(world);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[rank %d]", rank);
  if (CHECK(w == 4, "run under mpirun -np 4 (got %d ranks)", w)) {
    for (int c = 0; c < NCASES; c++) {
      const int before = sg_test_failures();
      run_mpi_case(&k_cases[c], world, rank);
      if (rank == 0)
        printf("%s  mpi 2x2: %s\n", sg_test_failures() == before ? "ok  " : "FAIL",
               k_cases[c].name);
    }
    for (int declare = 0; declare < 2; declare++) {
      tcase tc = {"traffic", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f, SG_F32, 0, 0, 2, 0, 0};
      result res;
      memset(&res, 0, sizeof res);
      body_arg b = {{.tc = &tc, .kind = K_HYBRID, .n = 2, .l = 2, .vw = 4, .avg = 1,
                     .world = world, .rank = rank, .res = &res},
                    stats_body, &declare};
      device_fields(&b.a, &g_dev, K_HYBRID, NULL);
      body_thread(&b);
    }
  }
  sg_comm_destroy(world);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "test_hybrid (mpi rank %d): ", rank);
  return sg_test_summary(prefix);
}

/* ---------------------------------------------------------------------------------------- */

static int comm_kind(const char *s, int *nccl) {
  *nccl = s && !strcmp(s, "nccl");
  return s && (*nccl || !strcmp(s, "local"));
}

int main(int argc, char **argv) {
  int mpi = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) g_quick = 1;
    if (!strcmp(argv[i], "--mpi")) mpi = 1;
    if (!strcmp(argv[i], "--offload")) g_dev.offload = 1;
    if (!strcmp(argv[i], "--smoke")) g_smoke = g_quick = 1;
    if (!strcmp(argv[i], "--cuda")) {
      g_dev.cuda = 1;
      if (i + 2 >= argc || !comm_kind(argv[i + 1], &g_dev.shard_nccl) ||
          !comm_kind(argv[i + 2], &g_dev.rep_nccl)) {
        fprintf(stderr, "usage: test_hybrid --cuda local|nccl local|nccl [--offload]\n");
        return 2;
      }
      i += 2;
    }
  }
  if (getenv("SG_TEST_QUICK")) g_quick = 1;
  if (mpi && (g_dev.shard_nccl || g_dev.rep_nccl)) {
    fprintf(stderr, "test_hybrid --mpi --cuda: MPI communicators only (local local)\n");
    return 2;
  }
  if (mpi) return run_mpi();
  if (g_dev.cuda && (!sg_has_backend("cuda") || ((g_dev.shard_nccl || g_dev.rep_nccl) &&
                                                 !sg_has_backend("nccl")))) {
    printf("test_hybrid --cuda: built without CUDA or NCCL\n");
    return 77;
  }
  if (g_dev.cuda)
    printf("hybrid engines on cuda: shard %s, replica %s%s; references on the cpu\n",
           g_dev.shard_nccl ? "nccl" : "threads", g_dev.rep_nccl ? "nccl" : "threads",
           g_dev.offload ? ", offloaded" : "");
  run_matrix();
  if (g_smoke) { /* the worker threads' interleavings: a step with traffic across replicas */
    int declare = 1;
    tcase tc = {"traffic", SG_SHARD_GRAD_OP, SG_F32, 3, 0, 1, 0.0f, SG_F32, 0, 0, 2, 0, 0};
    run_bodies(&tc, K_HYBRID, 2, 2, stats_body, &declare);
    return sg_test_summary("test_hybrid --smoke: ");
  }
  check_bf16_wire(2, 2);
  if (!g_quick || !g_dev.cuda) check_bf16_wire(3, 2);
  run_stats();
  run_memory();
  run_errors();
  run_ckpt();
  return sg_test_summary("test_hybrid: ");
}
