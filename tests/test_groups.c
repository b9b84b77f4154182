/* Parameter groups (sg_set_param_group, sg_set_group, sg_get_group): per-group lr and weight
 * decay against a host reference of AdamW built from kernels/sg_elem.h's element function.
 *
 * W = 1, 2, 3 ranks as threads, SHARD_GRAD_OP and NO_SHARD, f32 and bf16 params. Gradients are
 * small multiples of 1/8 and summed (grad_average = 0), so the reduced gradient is exact and the
 * working params, master weights and moments must equal the reference bit for bit. Groups 0, 1,
 * 2 and 5 (a gap: groups 3 and 4 have no parameters), NO_DECAY parameters in several groups,
 * small buckets (segments of one bucket in several groups), lr and weight decay changed between
 * steps (sg_set_group, and sg_set_lr for group 0). Then: a group never set has the config's
 * values; different groups for one parameter on two ranks fail sg_finalize with
 * SG_ERR_MISMATCH on both, naming the parameter.
 * Checkpoints: sg_save records every group's lr and weight decay and sg_load restores them; a
 * manifest of version 1 (before groups) gives every group the saved lr.
 * SG_TEST_DEVICE=cuda: the engines under test run on SG_DEVICE_CUDA (the mock CUDA runtime in
 * test_groups_cudamock); gradients are uploaded into the sg_grad_ptr slots through the engine's
 * device vtable. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/sg_elem.h"
#include "ckpt/sg_ckpt.h"              /* manifest encode/parse: a version 1 manifest */
#include "engine/sg_engine_internal.h" /* e->dev: uploads into device gradient slots */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_grad.h" /* sg_test_put_grad */

#define NP 8
#define STEPS 4
#define MAXW 3
static const size_t k_numel[NP] = {1, 63, 64, 65, 700, 1000, 33, 2049};
static const uint32_t k_flags[NP] = {0, SG_PARAM_NO_DECAY, 0, 0, SG_PARAM_NO_DECAY, 0, 0, 0};
static const int k_group[NP] = {1, 0, 2, 5, 1, 0, 5, 2};
#define NG 6 /* groups 0..5 */

/* lr and weight decay of group g at step t (1-based); group 0 starts at the config's. */
static float group_lr(int g, int t) { return g == 0 && t == 1 ? 1e-3f : 1e-3f * (float)(g + 1) / (float)t; }
static float group_wd(int g, int t) {
  if (g == 0) return t <= 2 ? 0.01f : 0.05f; /* t > 2: changed through sg_set_group(0) */
  return g == 2 ? 0.0f : 0.1f * (float)g + 0.01f * (float)t;
}

static sg_device g_device = SG_DEVICE_CPU;

typedef struct {
  int world;
  sg_strategy strategy;
  sg_dtype dtype;
} tcase;

static float grad_val(int rank, int step, int p, size_t i) {
  const size_t k = i * 7 + (size_t)p * 13 + (size_t)step * 5 + (size_t)rank * 11;
  return (float)((int)(k % 5) - 2) * 0.125f;
}
static float init_val(int p, size_t i) { return (float)((int)((i * 5 + (size_t)p * 3) % 13) - 6) / 32.0f; }

static sg_config make_config(const tcase *tc) {
  sg_config c;
  sg_config_init(&c, sizeof c);
  c.strategy = tc->strategy;
  c.device = g_device;
  c.param_dtype = tc->dtype;
  c.bucket_bytes = 512u * (tc->dtype == SG_F32 ? 4u : 2u); /* 512 elements: many buckets */
  c.grad_average = 0;
  c.lr = 1e-3f;
  c.weight_decay = 0.01f;
  c.beta1 = 0.8f;
  c.beta2 = 0.95f;
  c.eps = 1e-6f;
  return c;
}

/* ---- host reference ----------------------------------------------------------------------- */

typedef struct {
  float *p[NP], *m[NP], *v[NP]; /* p: fp32 master (the param itself for f32) */
} state;

static void ref_run(const tcase *tc, const sg_config *c, state *s) {
  for (int p = 0; p < NP; p++) {
    s->p[p] = calloc(k_numel[p], sizeof(float));
    s->m[p] = calloc(k_numel[p], sizeof(float));
    s->v[p] = calloc(k_numel[p], sizeof(float));
    for (size_t i = 0; i < k_numel[p]; i++) s->p[p][i] = init_val(p, i);
  }
  for (int t = 1; t <= STEPS; t++) {
    /* DESIGN.md section 5: the per-step scalars in double on the host */
    const double bc1 = 1.0 - pow((double)c->beta1, (double)t);
    const double bc2 = 1.0 - pow((double)c->beta2, (double)t);
    for (int p = 0; p < NP; p++) {
      const int g = k_group[p];
      const float lr = group_lr(g, t), wd = group_wd(g, t);
      const float df = (k_flags[p] & SG_PARAM_NO_DECAY) ? 1.0f : (float)(1.0 - (double)lr * (double)wd);
      const sg_elem_adamw_k k =
          sg_elem_adamw_consts(df, (float)(1.0 - (double)c->beta1), c->beta2, (float)(1.0 - (double)c->beta2),
                               (float)((double)lr / bc1), (float)sqrt(bc2), c->eps);
      for (size_t i = 0; i < k_numel[p]; i++) {
        float gs = 0.0f;
        for (int r = 0; r < tc->world; r++) gs += grad_val(r, t, p, i);
        s->p[p][i] = sg_elem_adamw(s->p[p][i], gs, &s->m[p][i], &s->v[p][i], k);
      }
    }
  }
}

static void state_free(state *s) {
  for (int p = 0; p < NP; p++) {
    free(s->p[p]);
    free(s->m[p]);
    free(s->v[p]);
  }
}

/* ---- engine at W ranks -------------------------------------------------------------------- */

typedef struct {
  const tcase *tc;
  const state *ref;
  sg_comm *comm;
  int rank;
} rank_arg;

/* This rank's gradient of parameter p at step t, in the grad dtype, into its slot. */
static sg_status write_grad(sg_engine *e, const tcase *tc, int rank, int t, int p, float *buf) {
  for (size_t i = 0; i < k_numel[p]; i++) buf[i] = grad_val(rank, t, p, i);
  return sg_test_put_grad(e, p, tc->dtype, buf, k_numel[p]);
}

static int same_bits(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

static void *rank_main(void *arg) {
  rank_arg *ra = arg;
  const tcase *tc = ra->tc;
  snprintf(sg_test_tag, sizeof sg_test_tag, "W%d %s %s r%d", tc->world,
           tc->strategy == SG_NO_SHARD ? "NO_SHARD" : "SHARD_GRAD_OP", tc->dtype == SG_F32 ? "f32" : "bf16",
           ra->rank);
  sg_config c = make_config(tc);
  sg_engine *e = NULL;
  float *buf = malloc(2049 * sizeof(float)), *want = malloc(2049 * sizeof(float));
  if (!CHECK(sg_engine_create(ra->comm, &c, &e) == SG_OK, "engine created")) goto done;
  int ok = 1;
  for (int p = 0; p < NP; p++) {
    char name[32];
    int id = -1;
    snprintf(name, sizeof name, "p%d", p);
    ok &= sg_add_param(e, name, k_numel[p], k_flags[p], &id) == SG_OK && id == p;
    ok &= sg_set_param_group(e, p, k_group[p]) == SG_OK;
  }
  CHECK(ok, "parameters registered with their groups");
  if (!CHECK(sg_finalize(e) == SG_OK, "sg_finalize")) goto done;
  ok = 1;
  for (int p = 0; p < NP; p++) {
    for (size_t i = 0; i < k_numel[p]; i++) buf[i] = init_val(p, i);
    ok &= sg_set_param(e, p, buf, SG_F32) == SG_OK;
  }
  CHECK(ok, "initial values set");
  for (int t = 1; t <= STEPS; t++) {
    ok = 1;
    for (int g = 1; g < NG; g++) ok &= sg_set_group(e, g, group_lr(g, t), group_wd(g, t)) == SG_OK;
    if (t == 2) ok &= sg_set_lr(e, group_lr(0, t)) == SG_OK; /* group 0 through sg_set_lr */
    if (t > 2) ok &= sg_set_group(e, 0, group_lr(0, t), group_wd(0, t)) == SG_OK;
    float lr = 0, wd = 0;
    for (int g = 0; g < NG; g++)
      ok &= sg_get_group(e, g, &lr, &wd) == SG_OK && lr == group_lr(g, t) && wd == group_wd(g, t);
    ok &= sg_get_lr(e, &lr) == SG_OK && lr == group_lr(0, t);
    CHECK(ok, "step %d: group lr and weight decay set and read back", t);
    ok = 1;
    for (int p = NP - 1; p >= 0; p--) ok &= write_grad(e, tc, ra->rank, t, p, buf) == SG_OK;
    sg_step_info info;
    info.struct_size = sizeof info;
    ok &= sg_step(e, &info) == SG_OK && info.step == (uint64_t)t && !info.skipped;
    CHECK(ok, "step %d", t);
  }
  int pok = 1, mok = 1, sok = 1;
  for (int p = 0; p < NP; p++) {
    const size_t n = k_numel[p];
    /* the working parameter: the master rounded to the param dtype */
    for (size_t i = 0; i < n; i++)
      want[i] = tc->dtype == SG_F32 ? ra->ref->p[p][i] : sg_elem_bf16_to_f32(sg_elem_f32_to_bf16(ra->ref->p[p][i]));
    pok &= sg_get_param(e, p, buf, SG_F32) == SG_OK && same_bits(buf, want, n);
    mok &= sg_get_master(e, p, buf) == SG_OK && same_bits(buf, ra->ref->p[p], n);
    sok &= sg_get_optim_state(e, p, 0, buf) == SG_OK && same_bits(buf, ra->ref->m[p], n);
    sok &= sg_get_optim_state(e, p, 1, buf) == SG_OK && same_bits(buf, ra->ref->v[p], n);
  }
  CHECK(pok, "working params equal the reference bitwise");
  CHECK(mok, "master weights equal the reference bitwise");
  CHECK(sok, "m and v equal the reference bitwise");
done:
  sg_engine_destroy(e);
  free(buf);
  free(want);
  return NULL;
}

static void run_case(const tcase *tc) {
  sg_config c = make_config(tc);
  state ref;
  ref_run(tc, &c, &ref);
  sg_comm *comms[MAXW] = {0};
  if (CHECK(sg_comm_create_local(tc->world, comms) == SG_OK, "local comm W=%d", tc->world)) {
    pthread_t th[MAXW];
    rank_arg ra[MAXW];
    for (int r = 0; r < tc->world; r++) {
      ra[r] = (rank_arg){tc, &ref, comms[r], r};
      pthread_create(&th[r], NULL, rank_main, &ra[r]);
    }
    for (int r = 0; r < tc->world; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < tc->world; r++) sg_comm_destroy(comms[r]);
  }
  state_free(&ref);
}

/* ---- defaults and disagreement ------------------------------------------------------------ */

static void check_defaults(void) {
  sg_test_tag[0] = '\0';
  sg_comm *comm = NULL;
  sg_engine *e = NULL;
  tcase tc = {1, SG_SHARD_GRAD_OP, SG_F32};
  sg_config c = make_config(&tc);
  c.lr = 0.25f;
  c.weight_decay = 0.125f;
  sg_comm_create_local(1, &comm);
  if (!CHECK(sg_engine_create(comm, &c, &e) == SG_OK, "engine created")) goto done;
  int ok = 1;
  float lr = 0, wd = 0;
  for (int g = 0; g < SG_MAX_GROUPS; g++)
    ok &= sg_get_group(e, g, &lr, &wd) == SG_OK && lr == 0.25f && wd == 0.125f;
  CHECK(ok, "every group starts with the config's lr and weight decay");
  ok = sg_set_lr(e, 0.5f) == SG_OK && sg_get_group(e, 0, &lr, &wd) == SG_OK && lr == 0.5f && wd == 0.125f;
  ok &= sg_get_group(e, 3, &lr, &wd) == SG_OK && lr == 0.25f;
  CHECK(ok, "sg_set_lr sets group 0's lr only");
  ok = sg_set_group(e, 0, 0.75f, 0.0f) == SG_OK && sg_get_lr(e, &lr) == SG_OK && lr == 0.75f;
  ok &= sg_get_group(e, 0, &lr, &wd) == SG_OK && lr == 0.75f && wd == 0.0f;
  CHECK(ok, "sg_set_group(0) is what sg_get_lr reports");
done:
  sg_engine_destroy(e);
  sg_comm_destroy(comm);
}

typedef struct {
  sg_comm *comm;
  int rank;
  sg_status st;
  char msg[512];
} mm_arg;

static void *mismatch_rank(void *arg) {
  mm_arg *a = arg;
  tcase tc = {2, SG_SHARD_GRAD_OP, SG_F32};
  sg_config c = make_config(&tc);
  sg_engine *e = NULL;
  a->st = sg_engine_create(a->comm, &c, &e);
  if (a->st != SG_OK) return NULL;
  int id;
  sg_add_param(e, "w0", 100, 0, &id);
  sg_add_param(e, "head.weight", 50, 0, &id);
  sg_add_param(e, "w2", 10, 0, &id);
  sg_set_param_group(e, 2, 3);                      /* the same on both ranks */
  sg_set_param_group(e, 1, a->rank == 0 ? 0 : 1); /* differs */
  sg_set_group(e, 3, a->rank ? 0.5f : 0.25f, 0.0f);  /* values are not checked */
  a->st = sg_finalize(e);
  snprintf(a->msg, sizeof a->msg, "%s", sg_last_error());
  sg_engine_destroy(e);
  return NULL;
}

static void check_mismatch(void) {
  sg_test_tag[0] = '\0';
  sg_comm *comms[2] = {0};
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "local comm W=2")) return;
  pthread_t th[2];
  mm_arg a[2];
  for (int r = 0; r < 2; r++) {
    memset(&a[r], 0, sizeof a[r]);
    a[r].comm = comms[r];
    a[r].rank = r;
    pthread_create(&th[r], NULL, mismatch_rank, &a[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    CHECK(a[r].st == SG_ERR_MISMATCH && strstr(a[r].msg, "head.weight") && strstr(a[r].msg, "group"),
          "rank %d: different groups for one parameter -> SG_ERR_MISMATCH naming it (%s: %s)", r,
          sg_status_string(a[r].st), a[r].msg);
  }
  for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
}

/* ---- checkpoints --------------------------------------------------------------------------- */

static char g_dir[256];
enum { CK_SAVE, CK_LOAD_V2, CK_LOAD_V1 };

static float ck_lr(int g) { return 1e-3f * (float)(g + 1); }
static float ck_wd(int g) { return 0.01f * (float)g; }

typedef struct {
  sg_comm *comm;
  int rank, phase;
} ck_arg;

static void *ck_rank(void *arg) {
  ck_arg *a = arg;
  tcase tc = {2, SG_SHARD_GRAD_OP, SG_F32};
  sg_config c = make_config(&tc);
  sg_engine *e = NULL;
  if (!CHECK(sg_engine_create(a->comm, &c, &e) == SG_OK, "ckpt: engine created")) return NULL;
  int ok = 1, id;
  for (int p = 0; p < NP; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    ok &= sg_add_param(e, name, k_numel[p], k_flags[p], &id) == SG_OK;
    ok &= sg_set_param_group(e, p, k_group[p]) == SG_OK;
  }
  ok &= sg_finalize(e) == SG_OK;
  /* save: the values to record; load: others, which the load must replace */
  for (int g = 0; g < SG_MAX_GROUPS; g++)
    ok &= sg_set_group(e, g, a->phase == CK_SAVE ? ck_lr(g) : 0.5f, a->phase == CK_SAVE ? ck_wd(g) : 0.25f) == SG_OK;
  if (a->phase == CK_SAVE) {
    CHECK(ok && sg_save(e, g_dir) == SG_OK, "ckpt: sg_save with %d groups set", SG_MAX_GROUPS);
  } else {
    ok &= sg_load(e, g_dir) == SG_OK;
    float lr = 0, wd = 0;
    int same = 1;
    for (int g = 0; g < SG_MAX_GROUPS; g++) {
      same &= sg_get_group(e, g, &lr, &wd) == SG_OK;
      if (a->phase == CK_LOAD_V2)
        same &= lr == ck_lr(g) && wd == ck_wd(g);
      else
        same &= lr == ck_lr(0) && wd == 0.25f; /* version 1: the saved lr, decays unchanged */
    }
    CHECK(ok && same, "ckpt: sg_load of a version %d manifest restores the groups (%s)",
          a->phase == CK_LOAD_V2 ? 2 : 1,
          a->phase == CK_LOAD_V2 ? "every group's lr and weight decay" : "every group gets the saved lr");
  }
  sg_engine_destroy(e);
  return NULL;
}

static void ck_phase(int phase) {
  sg_comm *comms[2] = {0};
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "local comm W=2")) return;
  pthread_t th[2];
  ck_arg a[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (ck_arg){comms[r], r, phase};
    pthread_create(&th[r], NULL, ck_rank, &a[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
}

/* Rewrites dir/manifest as version 1 (no group table), checksum and all. */
static int manifest_to_v1(void) {
  char path[300];
  snprintf(path, sizeof path, "%s/manifest", g_dir);
  uint8_t *buf = NULL, *out = NULL;
  size_t len = 0, olen = 0;
  sg__ck_manifest m;
  memset(&m, 0, sizeof m);
  int ok = sg__ck_read_file(path, 1u << 24, &buf, &len) == SG_OK &&
           sg__ck_manifest_parse(buf, len, path, &m) == SG_OK && m.version == 2 && m.ngroups == SG_MAX_GROUPS;
  if (ok) {
    m.version = 1;
    ok = sg__ck_manifest_encode(&m, &out, &olen) == SG_OK && olen == len - 4 - 8 * SG_MAX_GROUPS;
  }
  if (ok) {
    FILE *f = fopen(path, "wb");
    ok = f && fwrite(out, 1, olen, f) == olen;
    if (f) ok &= fclose(f) == 0;
  }
  sg__ck_manifest m1;
  memset(&m1, 0, sizeof m1);
  if (ok) ok = sg__ck_manifest_parse(out, olen, path, &m1) == SG_OK && m1.version == 1 && m1.ngroups == 0;
  if (ok) sg__ck_manifest_free(&m1);
  sg__ck_manifest_free(&m);
  free(buf);
  free(out);
  return ok;
}

static void check_checkpoints(void) {
  sg_test_tag[0] = '\0';
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/sg_groups_XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (!CHECK(mkdtemp(g_dir) != NULL, "temporary directory")) return;
  ck_phase(CK_SAVE);
  ck_phase(CK_LOAD_V2);
  CHECK(manifest_to_v1(), "manifest rewritten as version 1 (%zu bytes shorter, no group table)",
        (size_t)(8 * SG_MAX_GROUPS + 4));
  ck_phase(CK_LOAD_V1);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
  if (system(cmd) != 0) printf("note: could not remove %s\n", g_dir);
}

int main(void) {
  const char *dev = getenv("SG_TEST_DEVICE");
  if (dev && strcmp(dev, "cuda") == 0) g_device = SG_DEVICE_CUDA;
  printf("device: %s\n", g_device == SG_DEVICE_CUDA ? "cuda" : "cpu");
  const sg_strategy strategies[2] = {SG_SHARD_GRAD_OP, SG_NO_SHARD};
  const sg_dtype dtypes[2] = {SG_F32, SG_BF16};
  for (int w = 1; w <= MAXW; w++)
    for (int s = 0; s < 2; s++)
      for (int d = 0; d < 2; d++) {
        tcase tc = {w, strategies[s], dtypes[d]};
        const int before = sg_test_fail_;
        run_case(&tc);
        printf("%s W=%d %s %s\n", sg_test_fail_ == before ? "ok  " : "FAIL", w,
               strategies[s] == SG_NO_SHARD ? "NO_SHARD" : "SHARD_GRAD_OP", dtypes[d] == SG_F32 ? "f32" : "bf16");
      }
  check_defaults();
  check_mismatch();
  check_checkpoints();
  return sg_test_summary("");
}
