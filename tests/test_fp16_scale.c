/* Dynamic loss scaling and non-finite gradients (DESIGN.md section 5) at W = 2 and 3 ranks
 * (threads on sg_comm_create_local, one engine per rank per group).
 *
 * An inf, -inf, NaN or overflowing (finite in f32, inf once scaled into f16) gradient is put on
 * ONE rank in one micro-batch at chosen steps. Then on every rank:
 *  - sg_step reports skipped = 1, the step counter does not advance, and the working params,
 *    master weights and both AdamW moments are unchanged bit for bit;
 *  - with f16 dynamic scaling the loss scale halves (from init_loss_scale 65536), never goes
 *    below min_loss_scale, and doubles after scale_window (3) clean steps;
 *    sg_get_loss_scale and sg_step_info.loss_scale (the scale the step's gradients carried)
 *    follow a model of that rule;
 *  - the clean steps are bitwise equal to a reference engine group that never saw the bad
 *    micro-batches and uses a static loss scale: the gradients are small multiples of 2^-12,
 *    so scaling by any power of two is exact and the unscaled updates are identical.
 * bf16 and f32 (and f16 with a static scale) with skip_nonfinite = 1 skip the same way without
 * any scale change. f16 with dynamic scaling skips even with skip_nonfinite = 0.
 * f32 with skip_nonfinite = 0 does NOT skip a NaN gradient: the step counts, grad_norm is NaN,
 * the element whose reduced gradient is NaN becomes NaN (param, m and v) on every rank, and
 * every other element is updated exactly as in a run where that gradient was finite (no
 * clipping: a non-finite norm would otherwise change every element's clip coefficient).
 *
 * SG_TEST_DEVICE=cuda (or --device cuda): the engines under test on SG_DEVICE_CUDA (GPU 0),
 * the reference engines on SG_DEVICE_CPU, so "equal to the reference" also means "the CUDA
 * engine equals the CPU engine bitwise". Gradients are cast in host memory and uploaded through
 * the engine's device vtable (no CUDA header here). The sg_grad_add part runs on CPU only (its
 * source is host memory there, device memory on CUDA). */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/sg_cpu_kernels.h" /* sg__cpu_cast: gradients into f16/bf16 slots */
#include "engine/sg_engine_internal.h" /* e->dev: uploads into device gradient slots */
#include "shardgrad.h"

#define SG_TEST_DEFAULT_TAG "[main]"
#include "sg_test_check.h"

/* ---------------------------------------------------------------------------------------- */
/* model and gradients                                                                       */

#define NP 5
#define MAXN 200
#define NMB 2 /* micro-batches per step */
static const size_t k_numel[NP] = {200, 33, 64, 1, 150};
static const uint32_t k_flags[NP] = {0, SG_PARAM_NO_DECAY, 0, SG_PARAM_NO_DECAY, 0};
static const char *k_names[NP] = {"enc.w", "enc.b", "mid.w", "mid.scale", "dec.w"};

/* True (unscaled) gradient: small multiples of 2^-12, exact at any power-of-two scale. */
static float grad_value(int iter, int mb, int rank, int id, size_t i) {
  const size_t k = i * 5 + (size_t)id * 11 + (size_t)iter * 3 + (size_t)mb * 7 + (size_t)rank * 13;
  return (float)((int)(k % 9) - 4) / 4096.0f;
}
static float init_value(int id, size_t i) {
  return (float)((int)((i * 3 + (size_t)id * 5) % 11) - 5) / 16.0f;
}

enum { INJ_NONE = 0, INJ_INF, INJ_NEG_INF, INJ_NAN, INJ_OVERFLOW };
static const char *inj_name(int k) {
  static const char *n[] = {"none", "inf", "-inf", "NaN", "overflow (16 x scale > f16 max)"};
  return n[k];
}

typedef struct inj {
  int iter, rank, mb, kind;
} inj;

typedef struct scenario {
  const char *label;
  sg_dtype dtype;
  float loss_scale;   /* config: 0 dynamic for f16 */
  int skip_nonfinite; /* config */
  float ref_scale;    /* the reference group's static loss scale (0: same config as test) */
  int dynamic;        /* expected */
  const inj *injs;
  int ninj;
  int iters;
} scenario;

#define WINDOW 3
#define INIT_SCALE 65536.0f
#define MIN_SCALE 8192.0f

/* ---------------------------------------------------------------------------------------- */
/* one rank                                                                                  */

typedef struct rank_ctx {
  const scenario *sc;
  int rank, world;
  sg_comm *ct, *cr;
  sg_engine *et, *er;
} rank_ctx;

static int g_cuda; /* engines under test (not the reference) on SG_DEVICE_CUDA */

static void make_config(const scenario *sc, int ref, sg_config *c) {
  sg_config_init(c, sizeof *c);
  c->strategy = SG_SHARD_GRAD_OP;
  c->device = g_cuda && !ref ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  c->cuda_device = 0;
  c->param_dtype = c->grad_dtype = c->reduce_dtype = sc->dtype;
  c->bucket_bytes = 256; /* several buckets, parameters straddling slices */
  c->lr = 0.01f;
  c->weight_decay = 0.1f;
  c->loss_scale = sc->loss_scale;
  c->skip_nonfinite = sc->skip_nonfinite;
  c->init_loss_scale = INIT_SCALE;
  c->min_loss_scale = MIN_SCALE;
  c->scale_window = WINDOW;
  c->timeout_ms = 20000;
  if (ref && sc->ref_scale > 0) c->loss_scale = sc->ref_scale;
}

static int setup_engine(rank_ctx *x, sg_comm *comm, int ref, sg_engine **out) {
  sg_config c;
  make_config(x->sc, ref, &c);
  if (sg_engine_create(comm, &c, out) != SG_OK) return 0;
  for (int i = 0; i < NP; i++) {
    int id = -1;
    if (sg_add_param(*out, k_names[i], k_numel[i], k_flags[i], &id) != SG_OK || id != i) return 0;
  }
  if (sg_finalize(*out) != SG_OK) return 0;
  float buf[MAXN];
  for (int id = 0; id < NP; id++) {
    for (size_t i = 0; i < k_numel[id]; i++) buf[i] = init_value(id, i);
    if (sg_set_param(*out, id, buf, SG_F32) != SG_OK) return 0;
  }
  return 1;
}

/* Full state of an engine: working params (raw param dtype bytes), master, m, v. Collective. */
typedef struct snapshot {
  unsigned char p[NP][MAXN * 4];
  float master[NP][MAXN], m[NP][MAXN], v[NP][MAXN];
} snapshot;

static int take(rank_ctx *x, sg_engine *e, snapshot *s) {
  const sg_dtype dt = x->sc->dtype;
  for (int id = 0; id < NP; id++) {
    if (sg_get_param(e, id, s->p[id], dt) != SG_OK || sg_get_master(e, id, s->master[id]) != SG_OK ||
        sg_get_optim_state(e, id, 0, s->m[id]) != SG_OK ||
        sg_get_optim_state(e, id, 1, s->v[id]) != SG_OK)
      return 0;
  }
  return 1;
}

/* Bitwise comparison; `skip_id/skip_el` (if >= 0) is left out. */
static int same(const rank_ctx *x, const snapshot *a, const snapshot *b, int skip_id, int skip_el) {
  const size_t ps = x->sc->dtype == SG_F32 ? 4 : 2;
  for (int id = 0; id < NP; id++) {
    for (size_t i = 0; i < k_numel[id]; i++) {
      if (id == skip_id && (int)i == skip_el) continue;
      if (memcmp(a->p[id] + i * ps, b->p[id] + i * ps, ps) ||
          memcmp(&a->master[id][i], &b->master[id][i], 4) ||
          memcmp(&a->m[id][i], &b->m[id][i], 4) || memcmp(&a->v[id][i], &b->v[id][i], 4))
        return 0;
    }
  }
  return 1;
}

static const inj *find_inj(const scenario *sc, int iter) {
  for (int k = 0; k < sc->ninj; k++)
    if (sc->injs[k].iter == iter) return &sc->injs[k];
  return NULL;
}
static int inj_param(int iter) { return iter % NP; }
static int inj_elem(int iter) { return (int)(((size_t)iter * 7) % k_numel[inj_param(iter)]); }

/* One micro-batch of scaled gradients, in backward order, with the injection if any. */
static int micro_batch(rank_ctx *x, sg_engine *e, int iter, int mb, float scale, const inj *in) {
  float g[MAXN];
  for (int id = NP - 1; id >= 0; id--) {
    for (size_t i = 0; i < k_numel[id]; i++) g[i] = grad_value(iter, mb, x->rank, id, i) * scale;
    if (in && in->rank == x->rank && in->mb == mb && id == inj_param(iter)) {
      float *t = &g[inj_elem(iter)];
      switch (in->kind) {
        case INJ_INF: *t = INFINITY; break;
        case INJ_NEG_INF: *t = -INFINITY; break;
        case INJ_NAN: *t = NAN; break;
        case INJ_OVERFLOW: *t = 16.0f * scale; break;
      }
    }
    /* Written into the slot (in grad_dtype, uploaded: device memory on CUDA) rather than
     * through sg_grad_add, which cannot accumulate into f16 slots yet (see grad_add_f16). */
    void *slot = NULL;
    unsigned char h[MAXN * 4];
    if (sg_grad_ptr(e, id, &slot) != SG_OK) return 0;
    sg__cpu_cast(h, x->sc->dtype, g, SG_F32, k_numel[id]);
    if (e->dev->ops->copy(e->dev, SG_Q_COMPUTE, slot, h,
                          k_numel[id] * (x->sc->dtype == SG_F32 ? 4 : 2), SG_COPY_H2D) != SG_OK ||
        sg_grad_ready(e, id) != SG_OK)
      return 0;
  }
  return 1;
}

static float scale_of(sg_engine *e) {
  float s = -1;
  return sg_get_loss_scale(e, &s) == SG_OK ? s : -1;
}

static void *rank_main(void *arg) {
  rank_ctx *x = arg;
  const scenario *sc = x->sc;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[%s W=%d r%d]", sc->label, x->world, x->rank);
  sg_test_quiet = x->rank != 0;
  if (!CHECK(setup_engine(x, x->ct, 0, &x->et) && setup_engine(x, x->cr, 1, &x->er),
             "test and reference engines finalized and initialized"))
    return NULL;
  static _Thread_local snapshot before, after, ref;
  /* the model of the loss-scale rule */
  float scale = sc->dynamic ? INIT_SCALE : (sc->loss_scale > 0 ? sc->loss_scale : 1.0f);
  int clean = 0;
  uint64_t steps = 0;
  CHECK(scale_of(x->et) == scale, "initial loss scale %g (sg_get_loss_scale)", scale);
  for (int it = 0; it < sc->iters; it++) {
    const inj *in = find_inj(sc, it);
    const float s_used = scale_of(x->et);
    CHECK(s_used == scale, "step %d: sg_get_loss_scale = %g (model %g)", it, s_used, scale);
    if (in && !CHECK(take(x, x->et, &before), "step %d: snapshot before", it)) break;
    int ok = 1;
    for (int mb = 0; mb < NMB; mb++) ok = ok && micro_batch(x, x->et, it, mb, s_used, in);
    sg_step_info info;
    memset(&info, 0xff, sizeof info);
    info.struct_size = sizeof info;
    ok = ok && sg_step(x->et, &info) == SG_OK;
    if (!CHECK(ok, "step %d: gradients and sg_step accepted", it)) break;
    if (in) {
      CHECK(info.skipped == 1 && info.step == steps && !isfinite(info.grad_norm) &&
                info.loss_scale == s_used,
            "step %d: %s gradient on rank %d (micro-batch %d) -> skipped=1 on every rank, step "
            "stays %llu, grad_norm non-finite, info.loss_scale %g",
            it, inj_name(in->kind), in->rank, in->mb, (unsigned long long)steps, s_used);
      CHECK(take(x, x->et, &after) && same(x, &before, &after, -1, -1),
            "step %d: params, master, m and v unchanged bitwise", it);
      if (sc->dynamic) {
        const float want = scale * 0.5f < MIN_SCALE ? MIN_SCALE : scale * 0.5f;
        CHECK(scale_of(x->et) == want, "step %d: loss scale %g -> %g%s", it, scale, want,
              want == scale ? " (already at min_loss_scale)" : "");
        scale = want;
        clean = 0;
      } else {
        CHECK(scale_of(x->et) == scale, "step %d: loss scale unchanged (%g)", it, scale);
      }
      continue;
    }
    steps++;
    float want = scale;
    if (sc->dynamic && ++clean >= WINDOW) {
      want = scale * 2.0f;
      clean = 0;
    }
    CHECK(info.skipped == 0 && info.step == steps && isfinite(info.grad_norm) &&
              info.loss_scale == s_used && scale_of(x->et) == want,
          "step %d: clean -> step %llu, info.loss_scale %g, scale now %g%s", it,
          (unsigned long long)steps, s_used, want,
          want != scale ? " (doubled after scale_window clean steps)" : "");
    scale = want;
    /* the reference group takes the same step at its own static scale */
    const float rs = scale_of(x->er);
    sg_step_info ri;
    ri.struct_size = sizeof ri;
    ok = 1;
    for (int mb = 0; mb < NMB; mb++) ok = ok && micro_batch(x, x->er, it, mb, rs, NULL);
    ok = ok && sg_step(x->er, &ri) == SG_OK;
    CHECK(ok && ri.step == info.step && memcmp(&ri.grad_norm, &info.grad_norm, 4) == 0,
          "step %d: reference step %llu, same grad_norm %g", it, (unsigned long long)ri.step,
          info.grad_norm);
    CHECK(take(x, x->et, &after) && take(x, x->er, &ref) && same(x, &after, &ref, -1, -1),
          "step %d: params, master, m and v equal the reference bitwise", it);
  }
  sg_engine_destroy(x->et);
  sg_engine_destroy(x->er);
  return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* f32 with skip_nonfinite = 0: a NaN gradient is applied                                     */

static void *nan_rank_main(void *arg) {
  rank_ctx *x = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[%s W=%d r%d]", x->sc->label, x->world, x->rank);
  sg_test_quiet = x->rank != 0;
  if (!CHECK(setup_engine(x, x->ct, 0, &x->et) && setup_engine(x, x->cr, 1, &x->er),
             "test and reference engines finalized and initialized"))
    return NULL;
  static _Thread_local snapshot a, b;
  const int bad_rank = x->world - 1, it_bad = 1;
  const int pid = inj_param(it_bad), el = inj_elem(it_bad);
  for (int it = 0; it < 4; it++) {
    /* the reference gets the same gradients, with a finite value where the test has NaN */
    const inj nan_inj = {it, bad_rank, 0, INJ_NAN};
    const inj *in = it == it_bad ? &nan_inj : NULL;
    int ok = 1;
    for (int mb = 0; mb < NMB; mb++)
      ok = ok && micro_batch(x, x->et, it, mb, 1.0f, in) && micro_batch(x, x->er, it, mb, 1.0f, NULL);
    sg_step_info info, ri;
    info.struct_size = ri.struct_size = sizeof info;
    ok = ok && sg_step(x->et, &info) == SG_OK && sg_step(x->er, &ri) == SG_OK;
    if (!CHECK(ok, "step %d: gradients and sg_step accepted", it)) break;
    if (it == it_bad) {
      CHECK(info.skipped == 0 && info.step == (uint64_t)it + 1 && isnan(info.grad_norm) &&
                info.loss_scale == 1.0f && scale_of(x->et) == 1.0f,
            "step %d: NaN gradient on rank %d with skip_nonfinite=0 -> not skipped, step %d, "
            "grad_norm NaN, loss scale 1",
            it, bad_rank, it + 1);
    } else {
      CHECK(info.skipped == 0 && info.step == (uint64_t)it + 1 && ri.step == info.step,
            "step %d: clean step %d", it, it + 1);
    }
    CHECK(take(x, x->et, &a) && take(x, x->er, &b), "step %d: state of both engines", it);
    if (it < it_bad) {
      CHECK(same(x, &a, &b, -1, -1), "step %d: equal to the reference bitwise", it);
      continue;
    }
    float pv;
    memcpy(&pv, a.p[pid] + (size_t)el * 4, 4);
    CHECK(isnan(pv) && isnan(a.master[pid][el]) && isnan(a.m[pid][el]) && isnan(a.v[pid][el]),
          "step %d: param '%s'[%d] (the NaN gradient's element): param, master, m, v are NaN", it,
          k_names[pid], el);
    CHECK(same(x, &a, &b, pid, el),
          "step %d: every other element equals the reference (NaN gradient finite there) bitwise",
          it);
  }
  sg_engine_destroy(x->et);
  sg_engine_destroy(x->er);
  return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* sg_grad_add into f16 gradient slots (W=1): the same step as writing the slot directly      */

static void grad_add_f16(void) {
  printf("== sg_grad_add with f16 gradients, W=1 ==\n");
  snprintf(sg_test_tag, sizeof sg_test_tag, "[grad_add f16 W=1]");
  const scenario sc = {"grad_add f16", SG_F16, 1024.0f, 1, 0.0f, 0, NULL, 0, 1};
  sg_comm *ca = NULL, *cb = NULL;
  sg_comm_create_local(1, &ca);
  sg_comm_create_local(1, &cb);
  rank_ctx x = {&sc, 0, 1, ca, cb, NULL, NULL};
  if (CHECK(setup_engine(&x, ca, 0, &x.et) && setup_engine(&x, cb, 1, &x.er), "two engines")) {
    float g[MAXN];
    int ok = 1;
    for (int id = NP - 1; id >= 0 && ok; id--) {
      for (size_t i = 0; i < k_numel[id]; i++) g[i] = grad_value(0, 0, 0, id, i) * 1024.0f;
      ok = sg_grad_add(x.et, id, g, SG_F32) == SG_OK;
    }
    CHECK(ok, "sg_grad_add(f32 source) into f16 gradient slots is accepted");
    if (ok) {
      micro_batch(&x, x.er, 0, 0, 1024.0f, NULL);
      static snapshot a, b;
      CHECK(sg_step(x.et, NULL) == SG_OK && sg_step(x.er, NULL) == SG_OK && take(&x, x.et, &a) &&
                take(&x, x.er, &b) && same(&x, &a, &b, -1, -1),
            "and gives the same step as gradients written through sg_grad_ptr");
    }
  }
  sg_engine_destroy(x.et);
  sg_engine_destroy(x.er);
  sg_comm_destroy(ca);
  sg_comm_destroy(cb);
}

/* ---------------------------------------------------------------------------------------- */

static void run(const scenario *sc, int W, void *(*fn)(void *)) {
  printf("== %s, W=%d ==\n", sc->label, W);
  sg_comm *ct[3], *cr[3];
  if (!CHECK(sg_comm_create_local(W, ct) == SG_OK && sg_comm_create_local(W, cr) == SG_OK,
             "two local groups of %d", W))
    return;
  rank_ctx x[3];
  pthread_t th[3];
  for (int r = 0; r < W; r++) {
    x[r] = (rank_ctx){sc, r, W, ct[r], cr[r], NULL, NULL};
    pthread_create(&th[r], NULL, fn, &x[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    sg_comm_destroy(ct[r]);
    sg_comm_destroy(cr[r]);
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *device = getenv("SG_TEST_DEVICE");
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--device")) device = argv[i + 1];
  g_cuda = device && !strcmp(device, "cuda");
  if (device && *device && !g_cuda && strcmp(device, "cpu")) {
    printf("unknown device '%s' (cpu or cuda)\n", device);
    return 2;
  }
  if (g_cuda && !sg_has_backend("cuda")) {
    printf("built without CUDA\n");
    return 1;
  }
  printf("engines under test on %s, reference engines on cpu\n", g_cuda ? "cuda" : "cpu");
  /* scale: 65536; step 1 halves, 3 clean steps double; then four bad steps in a row reach
   * the floor 8192 and stay there; 3 clean steps double again; one more halving. */
  static const inj dyn[] = {
      {1, 1, 0, INJ_INF},      {5, 0, 1, INJ_NAN},  {6, 2, 0, INJ_OVERFLOW},
      {7, 1, 1, INJ_NEG_INF},  {8, 2, 0, INJ_NAN},  {13, 0, 1, INJ_OVERFLOW},
  };
  static const inj few[] = {{1, 1, 0, INJ_INF}, {3, 0, 1, INJ_NAN}, {4, 2, 0, INJ_NEG_INF}};
  const int ndyn = (int)(sizeof dyn / sizeof dyn[0]), nfew = (int)(sizeof few / sizeof few[0]);
  const scenario scen[] = {
      {"f16 dynamic", SG_F16, 0.0f, 1, 1024.0f, 1, dyn, ndyn, 15},
      {"f16 dynamic, skip_nonfinite=0", SG_F16, 0.0f, 0, 1024.0f, 1, few, nfew, 6},
      {"f16 static 512", SG_F16, 512.0f, 1, 0.0f, 0, few, nfew, 6},
      {"bf16 skip_nonfinite=1", SG_BF16, 0.0f, 1, 0.0f, 0, few, nfew, 6},
      {"f32 skip_nonfinite=1", SG_F32, 0.0f, 1, 0.0f, 0, few, nfew, 6},
  };
  const scenario nan_sc = {"f32 skip_nonfinite=0", SG_F32, 0.0f, 0, 0.0f, 0, NULL, 0, 4};
  for (int W = 2; W <= 3; W++) {
    for (size_t k = 0; k < sizeof scen / sizeof scen[0]; k++) {
      /* the injections name ranks up to 2: fold them into this world */
      inj local[8];
      scenario s = scen[k];
      for (int i = 0; i < s.ninj; i++) {
        local[i] = s.injs[i];
        local[i].rank %= W;
      }
      s.injs = local;
      run(&s, W, rank_main);
    }
    run(&nan_sc, W, nan_rank_main);
  }
  if (!g_cuda) grad_add_f16(); /* host source: the CPU device's contract */
  return sg_test_summary("");
}
