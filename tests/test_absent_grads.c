/* Parameters without a gradient in a step (issue 30 item 3.3): a parameter for which no rank
 * called sg_grad_ptr, sg_grad_add or sg_grad_ready in any micro-batch of the step is skipped, as
 * torch.optim.AdamW skips a parameter whose .grad is None: its working value, master, m and v
 * stay bit for bit, and its own step count (the bias correction's t) does not advance. A step
 * in which no parameter got a gradient changes nothing, not even the step count.
 *
 * W = 1, 2, 3 ranks as threads; SHARD_GRAD_OP (f32, bf16), SHARD_OPT and NO_SHARD; against a
 * host reference of AdamW (kernels/sg_elem.h's element function) with one step count per
 * parameter. Gradients are multiples of 1/8 summed (grad_average = 0): exact, so the results
 * must equal the reference bit for bit. The schedule: p1 frozen for two steps, p2 unused in the
 * first step and another, p3 given a gradient by one rank only (never skipped), p4 unused once,
 * and a last sg_step with no gradient at all. After step 3 the engine is saved and the rest runs
 * on a fresh engine of another world size loaded from it (the per-parameter step counts travel
 * in the checkpoint). Then: a checkpoint whose manifest has no step counts (as before) loads with
 * every count at the saved step. Two cases again over the caller's transport (a mailbox between
 * threads; CPU only). SG_TEST_DEVICE=cuda: the mock CUDA device. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/sg_elem.h"
#include "ckpt/sg_ckpt.h"              /* manifest encode/parse: a manifest without step counts */
#include "engine/sg_engine_internal.h" /* e->dev: uploads into device gradient slots */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_grad.h" /* sg_test_put_grad */
#include "sg_test_ranks.h" /* sg_test_run_threads_xport: ranks over the caller's transport */

#define NP 5
#define CALLS 6 /* sg_step calls; the last has no gradient at all */
#define SAVE_AFTER 3
#define MAXW 3
#define MAXN 2049
static const size_t k_numel[NP] = {1, 63, 700, 65, 2049};

static sg_device g_device = SG_DEVICE_CPU;
static char g_dir[256];

typedef struct {
  int world, world2; /* before and after the checkpoint */
  sg_strategy strategy;
  sg_dtype dtype;
} tcase;

/* Does rank r (of w) give parameter p a gradient in sg_step call t (1-based)? */
static int has_grad(int t, int p, int r, int w) {
  if (t == CALLS) return 0; /* a step without backward */
  switch (p) {
  case 1: return t != 2 && t != 3;
  case 2: return t != 1 && t != 5;
  case 3: return r == t % w; /* one rank only: never skipped */
  case 4: return t != 4;
  default: return 1;
  }
}

static int world_at(const tcase *tc, int t) { return t <= SAVE_AFTER ? tc->world : tc->world2; }

static int any_grad(const tcase *tc, int t, int p) {
  for (int r = 0; r < world_at(tc, t); r++)
    if (has_grad(t, p, r, world_at(tc, t))) return 1;
  return 0;
}

static float grad_val(int rank, int t, int p, size_t i) {
  const size_t k = i * 7 + (size_t)p * 13 + (size_t)t * 5 + (size_t)rank * 11;
  return (float)((int)(k % 5) - 2) * 0.125f;
}
static float init_val(int p, size_t i) { return (float)((int)((i * 5 + (size_t)p * 3) % 13) - 6) / 32.0f; }

static sg_config make_config(const tcase *tc) {
  sg_config c;
  sg_config_init(&c, sizeof c);
  c.strategy = tc->strategy;
  c.device = g_device;
  c.param_dtype = tc->dtype;
  c.bucket_bytes = 512u * (tc->dtype == SG_F32 ? 4u : 2u); /* several buckets */
  c.staging_buckets = 8; /* buckets wait for their absent parameters until the step */
  c.grad_average = 0;
  c.lr = 1e-2f;
  c.weight_decay = 0.1f;
  c.beta1 = 0.8f;
  c.beta2 = 0.95f;
  c.eps = 1e-6f;
  return c;
}

/* ---- host reference: one step count per parameter ----------------------------------------- */

typedef struct {
  float *p[NP], *m[NP], *v[NP];
  uint64_t t[NP];
} state;

static void ref_step(const tcase *tc, const sg_config *c, state *s, int call) {
  for (int p = 0; p < NP; p++) {
    if (!any_grad(tc, call, p)) continue; /* torch: .grad is None, the parameter is skipped */
    const uint64_t t = ++s->t[p];
    const double bc1 = 1.0 - pow((double)c->beta1, (double)t);
    const double bc2 = 1.0 - pow((double)c->beta2, (double)t);
    const sg_elem_adamw_k k = sg_elem_adamw_consts(
        (float)(1.0 - (double)c->lr * (double)c->weight_decay), (float)(1.0 - (double)c->beta1),
        c->beta2, (float)(1.0 - (double)c->beta2), (float)((double)c->lr / bc1), (float)sqrt(bc2),
        c->eps);
    const int w = world_at(tc, call);
    for (size_t i = 0; i < k_numel[p]; i++) {
      float gs = 0.0f;
      for (int r = 0; r < w; r++)
        if (has_grad(call, p, r, w)) gs += grad_val(r, call, p, i);
      s->p[p][i] = sg_elem_adamw(s->p[p][i], gs, &s->m[p][i], &s->v[p][i], k);
    }
  }
}

static void ref_init(state *s) {
  for (int p = 0; p < NP; p++) {
    s->p[p] = calloc(k_numel[p], sizeof(float));
    s->m[p] = calloc(k_numel[p], sizeof(float));
    s->v[p] = calloc(k_numel[p], sizeof(float));
    s->t[p] = 0;
    for (size_t i = 0; i < k_numel[p]; i++) s->p[p][i] = init_val(p, i);
  }
}

static void ref_free(state *s) {
  for (int p = 0; p < NP; p++) free(s->p[p]), free(s->m[p]), free(s->v[p]);
}

/* ---- the engine ---------------------------------------------------------------------------- */

typedef struct {
  const tcase *tc;
  const state *ref; /* after SAVE_AFTER calls (phase 0) or all of them (phase 1) */
  sg_comm *comm;
  int rank, phase;
} rank_arg;

static sg_status write_grad(sg_engine *e, const tcase *tc, int rank, int t, int p, float *buf) {
  for (size_t i = 0; i < k_numel[p]; i++) buf[i] = grad_val(rank, t, p, i);
  return sg_test_put_grad(e, p, tc->dtype, buf, k_numel[p]);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static sg_engine *make_engine(const tcase *tc, sg_comm *comm) {
  sg_config c = make_config(tc);
  sg_engine *e = NULL;
  if (!CHECK(sg_engine_create(comm, &c, &e) == SG_OK, "engine created")) return NULL;
  int ok = 1;
  for (int p = 0; p < NP; p++) {
    char name[32];
    int id = -1;
    snprintf(name, sizeof name, "p%d", p);
    ok &= sg_add_param(e, name, k_numel[p], 0, &id) == SG_OK && id == p;
  }
  if (!CHECK(ok && sg_finalize(e) == SG_OK, "registered and finalized: %s", sg_last_error())) {
    sg_engine_destroy(e);
    return NULL;
  }
  return e;
}

static void compare(sg_engine *e, const tcase *tc, const state *ref, float *buf, float *want) {
  int pok = 1, mok = 1, sok = 1;
  for (int p = 0; p < NP; p++) {
    const size_t n = k_numel[p];
    for (size_t i = 0; i < n; i++)
      want[i] = tc->dtype == SG_F32 ? ref->p[p][i] : sg_elem_bf16_to_f32(sg_elem_f32_to_bf16(ref->p[p][i]));
    pok &= sg_get_param(e, p, buf, SG_F32) == SG_OK && same_bits(buf, want, n);
    mok &= sg_get_master(e, p, buf) == SG_OK && same_bits(buf, ref->p[p], n);
    sok &= sg_get_optim_state(e, p, 0, buf) == SG_OK && same_bits(buf, ref->m[p], n);
    sok &= sg_get_optim_state(e, p, 1, buf) == SG_OK && same_bits(buf, ref->v[p], n);
  }
  int tok = 1;
  for (int p = 0; p < NP; p++) {
    uint64_t t = 0;
    tok &= sg_get_param_step(e, p, &t) == SG_OK && t == ref->t[p];
  }
  CHECK(tok, "sg_get_param_step: every parameter's own step count");
  CHECK(pok, "working params equal the reference (own step counts) bitwise");
  CHECK(mok, "master weights equal the reference bitwise");
  CHECK(sok, "m and v equal the reference bitwise");
}

static void *rank_main(void *arg) {
  rank_arg *ra = arg;
  const tcase *tc = ra->tc;
  const int w = ra->phase ? tc->world2 : tc->world;
  snprintf(sg_test_tag, sizeof sg_test_tag, "W%d->%d %s %s phase %d r%d", tc->world, tc->world2,
           tc->strategy == SG_NO_SHARD ? "NO_SHARD" : tc->strategy == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP",
           tc->dtype == SG_F32 ? "f32" : "bf16", ra->phase, ra->rank);
  float *buf = malloc(MAXN * sizeof(float)), *want = malloc(MAXN * sizeof(float));
  sg_engine *e = make_engine(tc, ra->comm);
  if (!e) goto done;
  int ok = 1;
  if (ra->phase == 0) {
    for (int p = 0; p < NP; p++) {
      for (size_t i = 0; i < k_numel[p]; i++) buf[i] = init_val(p, i);
      ok &= sg_set_param(e, p, buf, SG_F32) == SG_OK;
    }
  } else {
    ok &= sg_load(e, g_dir) == SG_OK;
  }
  if (!CHECK(ok, "initial values (phase %d): %s", ra->phase, sg_last_error())) goto done;
  uint64_t steps = 0;
  for (int t = 1; t <= CALLS; t++) {
    if (t <= SAVE_AFTER && ra->phase == 1) continue;
    if (t > SAVE_AFTER && ra->phase == 0) break;
    ok = 1;
    for (int p = NP - 1; p >= 0; p--)
      if (has_grad(t, p, ra->rank, w)) ok &= write_grad(e, tc, ra->rank, t, p, buf) == SG_OK;
    sg_step_info info;
    info.struct_size = sizeof info;
    ok &= sg_step(e, &info) == SG_OK && !info.skipped;
    int any = 0;
    for (int p = 0; p < NP; p++) any |= any_grad(tc, t, p);
    steps = (uint64_t)(t == CALLS ? t - 1 : t);
    CHECK(ok && info.step == steps, "step call %d: %s (step %llu, want %llu%s)", t, sg_last_error(),
          (unsigned long long)info.step, (unsigned long long)steps, any ? "" : ": no gradient, no step");
  }
  uint64_t got = 0;
  CHECK(sg_get_step(e, &got) == SG_OK && got == steps, "sg_get_step %llu", (unsigned long long)got);
  compare(e, tc, ra->ref, buf, want);
  if (ra->phase == 0) CHECK(sg_save(e, g_dir) == SG_OK, "sg_save: %s", sg_last_error());
done:
  sg_engine_destroy(e);
  free(buf);
  free(want);
  return NULL;
}

static int g_xport; /* run_phase over the caller's transport instead of the local backend */

typedef struct {
  const tcase *tc;
  const state *ref;
  int phase;
} xport_arg;

static void xport_rank(sg_comm *c, void *arg) {
  const xport_arg *x = arg;
  rank_arg ra = {x->tc, x->ref, c, sg_comm_rank(c), x->phase};
  rank_main(&ra);
}

static void run_phase(const tcase *tc, const state *ref, int phase) {
  const int w = phase ? tc->world2 : tc->world;
  if (g_xport) {
    xport_arg x = {tc, ref, phase};
    CHECK(sg_test_run_threads_xport(w, xport_rank, &x) == SG_OK, "xport W=%d", w);
    return;
  }
  sg_comm *comms[MAXW] = {0};
  if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "local comm W=%d", w)) return;
  pthread_t th[MAXW];
  rank_arg ra[MAXW];
  for (int r = 0; r < w; r++) {
    ra[r] = (rank_arg){tc, ref, comms[r], r, phase};
    pthread_create(&th[r], NULL, rank_main, &ra[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
}

static void run_case(const tcase *tc) {
  sg_config c = make_config(tc);
  state ref;
  ref_init(&ref);
  for (int t = 1; t <= SAVE_AFTER; t++) ref_step(tc, &c, &ref, t);
  run_phase(tc, &ref, 0);
  for (int t = SAVE_AFTER + 1; t <= CALLS; t++) ref_step(tc, &c, &ref, t);
  run_phase(tc, &ref, 1);
  ref_free(&ref);
}

/* ---- a manifest without per-parameter step counts ------------------------------------------ */

/* Rewrites dir/manifest without its step counts, as a library before them wrote it. */
static int manifest_drop_steps(void) {
  char path[300];
  snprintf(path, sizeof path, "%s/manifest", g_dir);
  uint8_t *buf = NULL, *out = NULL;
  size_t len = 0, olen = 0;
  sg__ck_manifest m;
  memset(&m, 0, sizeof m);
  int ok = sg__ck_read_file(path, 1u << 24, &buf, &len) == SG_OK &&
           sg__ck_manifest_parse(buf, len, path, &m) == SG_OK && m.param_steps != NULL;
  if (ok) { /* a count above the step is refused as damage */
    uint8_t *bad = NULL;
    size_t blen = 0;
    const uint64_t keep = m.param_steps[0];
    m.param_steps[0] = m.step + 1;
    sg__ck_manifest mb;
    ok = sg__ck_manifest_encode(&m, &bad, &blen) == SG_OK &&
         sg__ck_manifest_parse(bad, blen, "test", &mb) == SG_ERR_CORRUPT &&
         strstr(sg_last_error(), "above the step");
    CHECK(ok, "a step count above the step: SG_ERR_CORRUPT (%s)", sg_last_error());
    m.param_steps[0] = keep;
    free(bad);
  }
  if (ok) {
    free(m.param_steps);
    m.param_steps = NULL;
    m.version = 0; /* the version a save without step counts writes */
    ok = sg__ck_manifest_encode(&m, &out, &olen) == SG_OK && olen < len;
  }
  if (ok) {
    FILE *f = fopen(path, "wb");
    ok = f && fwrite(out, 1, olen, f) == olen;
    if (f) ok &= fclose(f) == 0;
  }
  sg__ck_manifest_free(&m);
  free(buf);
  free(out);
  return ok;
}

/* Loads the manifest without step counts: every parameter's count is then the saved step (3),
 * so a step of p1 (saved at its own count 1) uses t = 4 like the others. */
static void *old_rank(void *arg) {
  rank_arg *ra = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "old manifest r%d", ra->rank);
  float *buf = malloc(MAXN * sizeof(float)), *want = malloc(MAXN * sizeof(float));
  sg_engine *e = make_engine(ra->tc, ra->comm);
  if (e && CHECK(sg_load(e, g_dir) == SG_OK, "sg_load: %s", sg_last_error())) {
    int ok = 1;
    for (int p = NP - 1; p >= 0; p--) ok &= write_grad(e, ra->tc, ra->rank, 4, p, buf) == SG_OK;
    sg_step_info info;
    info.struct_size = sizeof info;
    CHECK(ok && sg_step(e, &info) == SG_OK && info.step == 4, "step 4: %s", sg_last_error());
    compare(e, ra->tc, ra->ref, buf, want);
  }
  sg_engine_destroy(e);
  free(buf);
  free(want);
  return NULL;
}

static void check_old_manifest(void) {
  tcase tc = {2, 2, SG_SHARD_GRAD_OP, SG_F32};
  sg_config c = make_config(&tc);
  state ref;
  ref_init(&ref);
  for (int t = 1; t <= SAVE_AFTER; t++) ref_step(&tc, &c, &ref, t);
  run_phase(&tc, &ref, 0);
  if (CHECK(manifest_drop_steps(), "manifest rewritten without step counts")) {
    for (int p = 0; p < NP; p++) ref.t[p] = SAVE_AFTER;
    /* step 4 with every parameter's gradient: the counts of a manifest without them */
    sg_config c2 = c;
    for (int p = 0; p < NP; p++) {
      const uint64_t t = ++ref.t[p];
      const double bc1 = 1.0 - pow((double)c2.beta1, (double)t);
      const double bc2 = 1.0 - pow((double)c2.beta2, (double)t);
      const sg_elem_adamw_k k = sg_elem_adamw_consts(
          (float)(1.0 - (double)c2.lr * (double)c2.weight_decay), (float)(1.0 - (double)c2.beta1),
          c2.beta2, (float)(1.0 - (double)c2.beta2), (float)((double)c2.lr / bc1), (float)sqrt(bc2),
          c2.eps);
      for (size_t i = 0; i < k_numel[p]; i++) {
        const float gs = grad_val(0, 4, p, i) + grad_val(1, 4, p, i);
        ref.p[p][i] = sg_elem_adamw(ref.p[p][i], gs, &ref.m[p][i], &ref.v[p][i], k);
      }
    }
    sg_comm *comms[2] = {0};
    if (CHECK(sg_comm_create_local(2, comms) == SG_OK, "local comm W=2")) {
      pthread_t th[2];
      rank_arg ra[2];
      for (int r = 0; r < 2; r++) {
        ra[r] = (rank_arg){&tc, &ref, comms[r], r, 1};
        pthread_create(&th[r], NULL, old_rank, &ra[r]);
      }
      for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
      for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
    }
  }
  ref_free(&ref);
}

/* ---- 8-bit state: refused on every rank, nothing changed; offload (the mock CUDA device)
 * loading a checkpoint whose counts differ --------------------------------------------------- */

static void *q8_rank(void *arg) {
  rank_arg *ra = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "8-bit state r%d", ra->rank);
  tcase tc = *ra->tc;
  float *buf = malloc(MAXN * sizeof(float)), *before = malloc(MAXN * sizeof(float));
  sg_config c = make_config(&tc);
  c.optim_state_dtype = SG_Q8;
  sg_engine *e = NULL;
  int ok = sg_engine_create(ra->comm, &c, &e) == SG_OK, id = -1;
  for (int p = 0; ok && p < NP; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    ok &= sg_add_param(e, name, k_numel[p], 0, &id) == SG_OK;
  }
  if (!CHECK(ok && sg_finalize(e) == SG_OK, "8-bit engine: %s", sg_last_error())) goto done;
  ok = sg_get_param(e, 1, before, SG_F32) == SG_OK;
  for (int p = NP - 1; p >= 0; p--)
    if (p != 1) ok &= write_grad(e, &tc, ra->rank, 1, p, buf) == SG_OK;
  const sg_status st = sg_step(e, NULL);
  uint64_t steps = 9;
  CHECK(ok && st == SG_ERR_UNSUPPORTED && strstr(sg_last_error(), "'p1'") &&
            sg_get_step(e, &steps) == SG_OK && steps == 0,
        "a step without p1's gradient: SG_ERR_UNSUPPORTED naming it, no step (%s: %s)",
        sg_status_string(st), sg_last_error());
  ok = sg_grad_zero(e) == SG_OK;
  for (int p = NP - 1; p >= 0; p--) ok &= write_grad(e, &tc, ra->rank, 1, p, buf) == SG_OK;
  CHECK(ok && sg_step(e, NULL) == SG_OK && sg_get_step(e, &steps) == SG_OK && steps == 1 &&
            sg_get_param(e, 1, buf, SG_F32) == SG_OK && !same_bits(buf, before, k_numel[1]),
        "then sg_grad_zero and every gradient: the step is taken (%s)", sg_last_error());
  if (g_device == SG_DEVICE_CUDA) { /* offload loads fp32 state (8-bit state does not) */
    sg_engine_destroy(e);
    e = NULL;
    c.optim_state_dtype = SG_F32;
    c.offload_optimizer = 1;
    ok = sg_engine_create(ra->comm, &c, &e) == SG_OK;
    for (int p = 0; ok && p < NP; p++) {
      char name[32];
      snprintf(name, sizeof name, "p%d", p);
      ok &= sg_add_param(e, name, k_numel[p], 0, &id) == SG_OK;
    }
    ok = ok && sg_finalize(e) == SG_OK;
    /* a checkpoint with unequal counts (p1, p2 behind): every parameter takes the step here */
    ok = ok && sg_load(e, g_dir) == SG_OK && sg_get_step(e, &steps) == SG_OK && steps == SAVE_AFTER;
    for (int p = 0; ok && p < NP; p++) {
      uint64_t t = 0;
      ok &= sg_get_param_step(e, p, &t) == SG_OK && t == SAVE_AFTER;
    }
    for (int p = NP - 1; ok && p >= 0; p--) ok &= write_grad(e, &tc, ra->rank, 4, p, buf) == SG_OK;
    CHECK(ok && sg_step(e, NULL) == SG_OK, "offload: a checkpoint with per-parameter counts loads "
          "(every count at the step, a warning) and steps: %s", sg_last_error());
  }
done:
  sg_engine_destroy(e);
  free(buf);
  free(before);
  return NULL;
}

static void check_q8_refused(void) {
  tcase tc = {2, 2, SG_SHARD_GRAD_OP, SG_F32};
  sg_comm *comms[2] = {0};
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "local comm W=2")) return;
  pthread_t th[2];
  rank_arg ra[2];
  for (int r = 0; r < 2; r++) {
    ra[r] = (rank_arg){&tc, NULL, comms[r], r, 0};
    pthread_create(&th[r], NULL, q8_rank, &ra[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
}

int main(void) {
  const char *dev = getenv("SG_TEST_DEVICE");
  if (dev && strcmp(dev, "cuda") == 0) g_device = SG_DEVICE_CUDA;
  printf("device: %s\n", g_device == SG_DEVICE_CUDA ? "cuda" : "cpu");
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/sg_absent_XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (!CHECK(mkdtemp(g_dir) != NULL, "temporary directory")) return sg_test_summary("");
  for (int w = 1; w <= MAXW; w++) {
    const int w2 = w % MAXW + 1; /* 1 -> 2, 2 -> 3, 3 -> 1 */
    const tcase cases[4] = {{w, w2, SG_SHARD_GRAD_OP, SG_F32},
                            {w, w2, SG_SHARD_GRAD_OP, SG_BF16},
                            {w, w2, SG_SHARD_OPT, SG_F32},
                            {w, w2, SG_NO_SHARD, SG_F32}};
    for (int k = 0; k < 4; k++) run_case(&cases[k]);
  }
  check_q8_refused(); /* loads the last case's checkpoint (W=3, counts differ) */
  check_old_manifest();
  g_xport = g_device == SG_DEVICE_CPU; /* the caller's transport (host memory only) */
  const tcase xc[2] = {{2, 3, SG_SHARD_GRAD_OP, SG_F32}, {3, 2, SG_NO_SHARD, SG_F32}};
  for (int k = 0; g_xport && k < 2; k++) run_case(&xc[k]);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
  if (system(cmd) != 0) printf("note: could not remove %s\n", g_dir);
  return sg_test_summary("");
}
