/* Misuse matrix for the public API (DESIGN.md section 7: "every argument is checked before
 * anything changes").
 *
 * Every public function is called with NULL pointers, bad ids (-1, n, INT_MAX, INT_MIN), invalid
 * dtypes, wrong struct_size, bad config fields and in the wrong order. Each call must return the
 * documented status with a non-empty sg_last_error() that names the function, and must leave the
 * engine usable: every rank drives a "test" engine that receives the misuse and a "reference"
 * engine (on a second communicator group) that receives the same valid calls without it; after
 * every optimizer step the working parameters of the two must be equal bit for bit, and at the
 * end so must the master weights and both AdamW moments.
 *
 * Worlds 1 and 2 (ranks are threads on sg_comm_create_local; each rank's engines are driven by
 * their own thread because collectives rendezvous). Also:
 *  - the allocation-failure hook (sg__device_fail_alloc_after): sg_finalize fails with
 *    SG_ERR_OUT_OF_MEMORY at each allocation point until it succeeds, and the engine then
 *    trains exactly like one that never failed (W=1); the same for sg_set_sync(e, 0),
 *    sg_get_optim_state and a gradient slot that needs an extra staging buffer;
 *  - misuse that breaks a communicator (mismatched collectives, one rank skipping a
 *    collective): every rank gets an error instead of a hang, and later calls keep failing. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/sg_core.h"     /* sg__err_clear */
#include "cpu/sg_cpu_kernels.h" /* sg__cpu_cast */
#include "device/sg_device.h" /* sg__device_fail_alloc_after */
#include "shardgrad.h"

/* ---------------------------------------------------------------------------------------- */
/* checks                                                                                    */

#define SG_TEST_DEFAULT_TAG "[main]"
#include "sg_test_check.h"

/* The call must return `want`, and sg_last_error() must be non-empty and contain `fn`. */
static int expect_(sg_status got, sg_status want, const char *fn, const char *call, int line) {
  const char *msg = sg_last_error();
  const int ok = got == want && msg && msg[0] && strstr(msg, fn);
  if (ok) return sg_test_check_(1, __FILE__, line, "EXPECT", "%s -> %s", call, sg_status_string(want));
  return sg_test_check_(0, __FILE__, line, "EXPECT", "%s -> %s (want %s; error text must name %s)", call,
                        sg_status_string(got), sg_status_string(want), fn);
}
#define EXPECT(want, fn, call) (sg__err_clear(), expect_((call), (want), (fn), #call, __LINE__))
#define EXPECT_OK(call) CHECK((call) == SG_OK, "%s -> SG_OK", #call)

/* ---------------------------------------------------------------------------------------- */
/* the model: a few parameters of awkward sizes, several buckets                             */

#define NP 6
static char g_long_name[256]; /* 255 bytes: the longest valid name */
static const size_t k_numel[NP] = {300, 17, 130, 1, 64, 513};
static const uint32_t k_flags[NP] = {0, SG_PARAM_NO_DECAY, 0, SG_PARAM_NO_DECAY, 0, 0};
static const char *param_name(int i) {
  static const char *n[NP] = {"layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias",
                              NULL, "head.weight"};
  return i == 4 ? g_long_name : n[i];
}
#define MAXN 513

/* Small multiples of 2^-6: sums over ranks and micro-batches are exact in f32 and bf16. */
static float grad_value(int step, int mb, int rank, int id, size_t i) {
  const size_t k = (i * 7 + (size_t)id * 13 + (size_t)step * 5 + (size_t)mb * 3 + (size_t)rank * 11);
  return (float)((int)(k % 17) - 8) / 64.0f;
}
static float init_value(int id, size_t i) { return (float)((int)((i * 5 + (size_t)id * 3) % 13) - 6) / 32.0f; }

typedef struct run_cfg {
  int world;
  sg_dtype dtype;
  sg_strategy strategy;
  const char *label;
} run_cfg;

static void base_config(sg_config *c, const run_cfg *rc) {
  sg_config_init(c, sizeof *c);
  c->strategy = rc->strategy;
  c->param_dtype = c->grad_dtype = c->reduce_dtype = rc->dtype;
  c->bucket_bytes = 1024;
  c->lr = 0.01f;
  c->weight_decay = 0.1f;
  c->timeout_ms = 20000; /* backstop: a bug fails the test instead of hanging it */
}

/* ---------------------------------------------------------------------------------------- */
/* part 1: functions without an engine                                                       */

static void bad_config(sg_comm *comm, void (*mutate)(sg_config *), sg_status want,
                       const char *field, const char *label) {
  sg_config c;
  sg_config_init(&c, sizeof c);
  c.timeout_ms = 20000;
  mutate(&c);
  sg_engine *e = (sg_engine *)&c; /* must be overwritten with NULL */
  sg__err_clear();
  sg_status st = sg_engine_create(comm, &c, &e);
  const char *msg = sg_last_error();
  CHECK(st == want && e == NULL && strstr(msg, "sg_engine_create") && strstr(msg, field),
        "sg_engine_create with %s -> %s, *out NULL, error names '%s' (got %s: \"%s\")", label,
        sg_status_string(want), field, sg_status_string(st), msg);
  if (st == SG_OK) sg_engine_destroy(e);
  const size_t numels[2] = {100, 7};
  sg_memory_stats ms;
  ms.struct_size = sizeof ms;
  sg__err_clear();
  st = sg_estimate_memory(&c, numels, 2, 2, &ms);
  msg = sg_last_error();
  CHECK(st == want && strstr(msg, "sg_estimate_memory"),
        "sg_estimate_memory with %s -> %s (got %s: \"%s\")", label, sg_status_string(want),
        sg_status_string(st), msg);
}

#define MUT(name, body) static void name(sg_config *c) { body; }
MUT(m_strategy, c->strategy = (sg_strategy)3)
MUT(m_strategy_neg, c->strategy = (sg_strategy)-1)
MUT(m_device, c->device = (sg_device)2)
MUT(m_cuda_device, c->cuda_device = -2)
MUT(m_param_dtype, c->param_dtype = (sg_dtype)7)
MUT(m_grad_dtype, c->grad_dtype = (sg_dtype)7)
MUT(m_reduce_dtype, c->reduce_dtype = (sg_dtype)7)
MUT(m_accum_f16, c->accum_dtype = SG_F16)
MUT(m_accum_7, c->accum_dtype = (sg_dtype)7)
MUT(m_bucket_0, c->bucket_bytes = 0)
MUT(m_bucket_small, c->bucket_bytes = 63 * 4)
MUT(m_staging_0, c->staging_buckets = 0)
MUT(m_staging_65, c->staging_buckets = 65)
MUT(m_window_0, c->scale_window = 0)
MUT(m_lr_neg, c->lr = -1.0f)
MUT(m_lr_nan, c->lr = NAN)
MUT(m_lr_inf, c->lr = INFINITY)
MUT(m_beta1_1, c->beta1 = 1.0f)
MUT(m_beta1_neg, c->beta1 = -0.1f)
MUT(m_beta2_1, c->beta2 = 1.0f)
MUT(m_eps_0, c->eps = 0.0f)
MUT(m_eps_neg, c->eps = -1e-8f)
MUT(m_wd_neg, c->weight_decay = -0.01f)
MUT(m_clip_neg, c->max_grad_norm = -1.0f)
MUT(m_clip_nan, c->max_grad_norm = NAN)
MUT(m_avg_2, c->grad_average = 2)
MUT(m_skip_2, c->skip_nonfinite = 2)
MUT(m_sr_neg, c->stochastic_rounding = -1)
MUT(m_overlap_2, c->overlap_param_gather = 2)
MUT(m_scale_neg, c->loss_scale = -1.0f)
MUT(m_init_scale_0, c->init_loss_scale = 0.0f)
MUT(m_min_scale_0, c->min_loss_scale = 0.0f)
MUT(m_min_gt_init, { c->param_dtype = c->grad_dtype = c->reduce_dtype = SG_F16;
                     c->min_loss_scale = 1e6f; })
MUT(m_size_0, c->struct_size = 0)
MUT(m_size_small, c->struct_size = sizeof(sg_config) - 1)
MUT(m_size_big, c->struct_size = sizeof(sg_config) + 8)
MUT(m_reduce_ne_grad, c->reduce_dtype = SG_BF16)
MUT(m_cuda, c->device = SG_DEVICE_CUDA)

static void part_global(void) {
  printf("== functions without an engine ==\n");
  CHECK(sg_status_string((sg_status)999) != NULL && sg_status_string((sg_status)-1) != NULL,
        "sg_status_string of unknown values is not NULL");
  CHECK(sg_has_backend(NULL) == 0 && sg_has_backend("bogus") == 0 && sg_has_backend("local") == 1,
        "sg_has_backend(NULL/\"bogus\") == 0, (\"local\") == 1");
  CHECK(sg_comm_rank(NULL) == -1 && sg_comm_size(NULL) == -1, "sg_comm_rank/size(NULL) == -1");
  sg_comm_destroy(NULL);
  sg_engine_destroy(NULL);
  CHECK(1, "sg_comm_destroy(NULL) and sg_engine_destroy(NULL) return");

  sg_config c;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_config_init", sg_config_init(NULL, sizeof c));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_config_init", sg_config_init(&c, 0));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_config_init", sg_config_init(&c, sizeof c - 1));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_config_init", sg_config_init(&c, sizeof c + 8));

  sg_comm *comms[2] = {(sg_comm *)&c, (sg_comm *)&c};
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local", sg_comm_create_local(1, NULL));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local", sg_comm_create_local(0, comms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local", sg_comm_create_local(-1, comms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local", sg_comm_create_local(4097, comms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local", sg_comm_create_local(INT_MIN, comms));
#ifndef SG_HAVE_MPI
  sg_comm *mc = (sg_comm *)&c;
  EXPECT(SG_ERR_UNSUPPORTED, "sg_comm_create_mpi", sg_comm_create_mpi(NULL, &mc));
  CHECK(mc == NULL, "sg_comm_create_mpi without MPI sets *out = NULL");
#endif

  sg_comm *comm = NULL;
  EXPECT_OK(sg_comm_create_local(1, &comm));
  sg_config_init(&c, sizeof c);
  sg_engine *e = (sg_engine *)&c;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_engine_create", sg_engine_create(comm, &c, NULL));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_engine_create", sg_engine_create(NULL, &c, &e));
  CHECK(e == NULL, "sg_engine_create(NULL comm) sets *out = NULL");
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_engine_create", sg_engine_create(comm, NULL, &e));

  static const struct {
    void (*f)(sg_config *);
    sg_status want;
    const char *field, *label;
  } bad[] = {
      {m_strategy, SG_ERR_INVALID_ARGUMENT, "strategy", "strategy 3"},
      {m_strategy_neg, SG_ERR_INVALID_ARGUMENT, "strategy", "strategy -1"},
      {m_device, SG_ERR_INVALID_ARGUMENT, "device", "device 2"},
      {m_cuda_device, SG_ERR_INVALID_ARGUMENT, "cuda_device", "cuda_device -2"},
      {m_param_dtype, SG_ERR_INVALID_ARGUMENT, "param_dtype", "param_dtype 7"},
      {m_grad_dtype, SG_ERR_INVALID_ARGUMENT, "grad_dtype", "grad_dtype 7"},
      {m_reduce_dtype, SG_ERR_INVALID_ARGUMENT, "reduce_dtype", "reduce_dtype 7"},
      {m_accum_f16, SG_ERR_INVALID_ARGUMENT, "accum_dtype", "accum_dtype SG_F16"},
      {m_accum_7, SG_ERR_INVALID_ARGUMENT, "accum_dtype", "accum_dtype 7"},
      {m_bucket_0, SG_ERR_INVALID_ARGUMENT, "bucket_bytes", "bucket_bytes 0"},
      {m_bucket_small, SG_ERR_INVALID_ARGUMENT, "bucket_bytes", "bucket_bytes 252 (f32)"},
      {m_staging_0, SG_ERR_INVALID_ARGUMENT, "staging_buckets", "staging_buckets 0"},
      {m_staging_65, SG_ERR_INVALID_ARGUMENT, "staging_buckets", "staging_buckets 65"},
      {m_window_0, SG_ERR_INVALID_ARGUMENT, "scale_window", "scale_window 0"},
      {m_lr_neg, SG_ERR_INVALID_ARGUMENT, "lr", "lr -1"},
      {m_lr_nan, SG_ERR_INVALID_ARGUMENT, "lr", "lr NaN"},
      {m_lr_inf, SG_ERR_INVALID_ARGUMENT, "lr", "lr inf"},
      {m_beta1_1, SG_ERR_INVALID_ARGUMENT, "beta1", "beta1 1"},
      {m_beta1_neg, SG_ERR_INVALID_ARGUMENT, "beta1", "beta1 -0.1"},
      {m_beta2_1, SG_ERR_INVALID_ARGUMENT, "beta2", "beta2 1"},
      {m_eps_0, SG_ERR_INVALID_ARGUMENT, "eps", "eps 0"},
      {m_eps_neg, SG_ERR_INVALID_ARGUMENT, "eps", "eps -1e-8"},
      {m_wd_neg, SG_ERR_INVALID_ARGUMENT, "weight_decay", "weight_decay -0.01"},
      {m_clip_neg, SG_ERR_INVALID_ARGUMENT, "max_grad_norm", "max_grad_norm -1"},
      {m_clip_nan, SG_ERR_INVALID_ARGUMENT, "max_grad_norm", "max_grad_norm NaN"},
      {m_avg_2, SG_ERR_INVALID_ARGUMENT, "grad_average", "grad_average 2"},
      {m_skip_2, SG_ERR_INVALID_ARGUMENT, "skip_nonfinite", "skip_nonfinite 2"},
      {m_sr_neg, SG_ERR_INVALID_ARGUMENT, "stochastic_rounding", "stochastic_rounding -1"},
      {m_overlap_2, SG_ERR_INVALID_ARGUMENT, "overlap_param_gather", "overlap_param_gather 2"},
      {m_scale_neg, SG_ERR_INVALID_ARGUMENT, "loss_scale", "loss_scale -1"},
      {m_init_scale_0, SG_ERR_INVALID_ARGUMENT, "init_loss_scale", "init_loss_scale 0"},
      {m_min_scale_0, SG_ERR_INVALID_ARGUMENT, "min_loss_scale", "min_loss_scale 0"},
      {m_min_gt_init, SG_ERR_INVALID_ARGUMENT, "min_loss_scale", "f16, min_loss_scale > init"},
      {m_size_0, SG_ERR_INVALID_ARGUMENT, "struct_size", "struct_size 0"},
      {m_size_small, SG_ERR_INVALID_ARGUMENT, "struct_size", "struct_size sizeof-1"},
      {m_size_big, SG_ERR_INVALID_ARGUMENT, "struct_size", "struct_size sizeof+8"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    bad_config(comm, bad[i].f, bad[i].want, bad[i].field, bad[i].label);
  /* A reduce_dtype other than grad_dtype is valid (bf16 on the wire for f32 gradients). */
  {
    sg_config u;
    sg_config_init(&u, sizeof u);
    m_reduce_ne_grad(&u);
    sg_engine *x = NULL;
    EXPECT_OK(sg_engine_create(comm, &u, &x));
    CHECK(x != NULL, "reduce_dtype != grad_dtype creates an engine");
    sg_engine_destroy(x);
    x = NULL;
    /* Valid values, combinations not supported: SG_ERR_UNSUPPORTED, not INVALID_ARGUMENT. */
    if (!sg_has_backend("cuda")) {
      sg_config_init(&u, sizeof u);
      m_cuda(&u);
      EXPECT(SG_ERR_UNSUPPORTED, "sg_engine_create", sg_engine_create(comm, &u, &x));
      CHECK(x == NULL, "SG_DEVICE_CUDA without CUDA leaves *out NULL");
    }
  }

  /* sg_estimate_memory's own arguments */
  sg_config_init(&c, sizeof c);
  const size_t numels[3] = {100, 0, 7};
  sg_memory_stats ms;
  ms.struct_size = sizeof ms;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 1, 2, NULL));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(NULL, numels, 1, 2, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, NULL, 1, 2, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 0, 2, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, -1, 2, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 1, 0, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 1, 4097, &ms));
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 3, 2, &ms));
  ms.struct_size = 0;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 1, 2, &ms));
  ms.struct_size = sizeof ms + 8;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_estimate_memory", sg_estimate_memory(&c, numels, 1, 2, &ms));
  ms.struct_size = sizeof ms;
  EXPECT_OK(sg_estimate_memory(&c, numels, 1, 2, &ms));

  /* After all those failures the communicator is still free for an engine. */
  EXPECT_OK(sg_engine_create(comm, &c, &e));
  sg_engine_destroy(e);
  sg_comm_destroy(comm);
}

/* ---------------------------------------------------------------------------------------- */
/* part 2: one rank's test and reference engines                                             */

typedef struct rank_ctx {
  const run_cfg *rc;
  int rank, world;
  sg_comm *ct, *cr;   /* communicators of the test and the reference group */
  sg_engine *et, *er; /* test engine (gets the misuse) and reference */
  int step;           /* optimizer steps taken */
  pthread_barrier_t *bar;
} rank_ctx;

/* Valid calls, identical on both engines. */
static int register_params(rank_ctx *x, sg_engine *e) {
  for (int i = 0; i < NP; i++) {
    int id = -1;
    if (sg_add_param(e, param_name(i), k_numel[i], k_flags[i], &id) != SG_OK || id != i) return 0;
  }
  return 1;
}

static int set_params(sg_engine *e) {
  float buf[MAXN];
  for (int id = 0; id < NP; id++) {
    for (size_t i = 0; i < k_numel[id]; i++) buf[i] = init_value(id, i);
    if (sg_set_param(e, id, buf, SG_F32) != SG_OK) return 0;
  }
  return 1;
}

/* One parameter's gradient for micro-batch mb, through sg_grad_add (odd ids) or by writing the
 * slot of sg_grad_ptr and sg_grad_ready (even ids). */
static sg_status give_grad(rank_ctx *x, sg_engine *e, int mb, int id) {
  float g[MAXN];
  for (size_t i = 0; i < k_numel[id]; i++) g[i] = grad_value(x->step, mb, x->rank, id, i);
  if (id % 2) return sg_grad_add(e, id, g, SG_F32);
  void *slot = NULL;
  sg_status st = sg_grad_ptr(e, id, &slot);
  if (st != SG_OK) return st;
  /* CPU device: the slot is host memory in grad_dtype */
  sg__cpu_cast(slot, x->rc->dtype, g, SG_F32, k_numel[id]);
  return sg_grad_ready(e, id);
}

static void compare_params(rank_ctx *x, const char *when) {
  float a[MAXN], b[MAXN];
  int same = 1, ok = 1;
  for (int id = 0; id < NP && ok; id++) {
    ok = sg_get_param(x->et, id, a, SG_F32) == SG_OK && sg_get_param(x->er, id, b, SG_F32) == SG_OK;
    same = same && ok && memcmp(a, b, k_numel[id] * sizeof(float)) == 0;
  }
  CHECK(ok && same, "working params equal the reference bitwise %s (step %d)", when, x->step);
}

/* Collective on both groups, same order on every rank. */
static void compare_state(rank_ctx *x) {
  float a[MAXN], b[MAXN];
  int same = 1, ok = 1;
  for (int id = 0; id < NP && ok; id++) {
    ok = sg_get_master(x->et, id, a) == SG_OK && sg_get_master(x->er, id, b) == SG_OK;
    same = same && ok && memcmp(a, b, k_numel[id] * 4) == 0;
    for (int w = 0; w < 2 && ok; w++) {
      ok = sg_get_optim_state(x->et, id, w, a) == SG_OK &&
           sg_get_optim_state(x->er, id, w, b) == SG_OK;
      same = same && ok && memcmp(a, b, k_numel[id] * 4) == 0;
    }
  }
  CHECK(ok && same, "master weights, m and v equal the reference bitwise");
}

static void do_step(rank_ctx *x) {
  sg_step_info it, ir;
  it.struct_size = ir.struct_size = sizeof it;
  const sg_status st = sg_step(x->et, &it), sr = sg_step(x->er, &ir);
  x->step++;
  CHECK(st == SG_OK && sr == SG_OK && it.step == ir.step && it.step == (uint64_t)x->step &&
            memcmp(&it.grad_norm, &ir.grad_norm, 4) == 0 && it.skipped == 0 && ir.skipped == 0,
        "sg_step on both engines: step %llu, same grad norm", (unsigned long long)it.step);
  compare_params(x, "after sg_step");
}

/* ---- misuse groups ---------------------------------------------------------------------- */

/* Before sg_finalize: everything that needs a finalized engine is SG_ERR_INVALID_STATE. */
static void misuse_before_finalize(rank_ctx *x) {
  sg_engine *e = x->et;
  void *p = NULL;
  float buf[8] = {0};
  sg_memory_stats ms;
  ms.struct_size = sizeof ms;
  sg_step_info info;
  info.struct_size = sizeof info;
  const sg_status S = SG_ERR_INVALID_STATE;
  EXPECT(S, "sg_param_ptr", sg_param_ptr(e, 0, &p));
  EXPECT(S, "sg_param_wait", sg_param_wait(e, 0));
  EXPECT(S, "sg_param_wait", sg_param_wait(e, -1));
  EXPECT(S, "sg_set_param", sg_set_param(e, 0, buf, SG_F32));
  EXPECT(S, "sg_get_param", sg_get_param(e, 0, buf, SG_F32));
  EXPECT(S, "sg_get_master", sg_get_master(e, 0, buf));
  EXPECT(S, "sg_get_optim_state", sg_get_optim_state(e, 0, 0, buf));
  EXPECT(S, "sg_grad_ptr", sg_grad_ptr(e, 0, &p));
  EXPECT(S, "sg_grad_ready", sg_grad_ready(e, 0));
  EXPECT(S, "sg_grad_add", sg_grad_add(e, 0, buf, SG_F32));
  EXPECT(S, "sg_backward_end", sg_backward_end(e));
  EXPECT(S, "sg_set_sync", sg_set_sync(e, 0));
  EXPECT(S, "sg_step", sg_step(e, &info));
  EXPECT(S, "sg_step", sg_step(e, NULL));
  EXPECT(S, "sg_broadcast_params", sg_broadcast_params(e, 0));
  EXPECT(S, "sg_memory", sg_memory(e, &ms));
  /* Collective, made by every rank of the test group: no parameters is a state error on every
   * rank (not a mismatch), and the engine can still register parameters afterwards. */
  EXPECT(S, "sg_finalize", sg_finalize(e));
}

static void misuse_registration(rank_ctx *x) {
  sg_engine *e = x->et;
  int id = 12345;
  char long_name[300];
  memset(long_name, 'n', 256);
  long_name[256] = '\0';
  const sg_status A = SG_ERR_INVALID_ARGUMENT;
  EXPECT(A, "sg_add_param", sg_add_param(NULL, "x", 1, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, NULL, 1, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "", 1, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, long_name, 1, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", 0, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", ((size_t)1 << 48) + 1, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", SIZE_MAX, 0, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", 1, 2u, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", 1, 0x80000000u, &id));
  EXPECT(A, "sg_add_param", sg_add_param(e, "x", 1, 0, NULL));
  CHECK(id == 12345, "failed sg_add_param calls leave *id untouched");
  /* interleave valid registrations with duplicates: ids stay dense */
  for (int i = 0; i < NP; i++) {
    int got = -1;
    CHECK(sg_add_param(e, param_name(i), k_numel[i], k_flags[i], &got) == SG_OK && got == i,
          "sg_add_param('%.20s%s') after failures -> id %d", param_name(i),
          strlen(param_name(i)) > 20 ? "..." : "", i);
    EXPECT(A, "sg_add_param", sg_add_param(e, param_name(i), 5, 0, &id));
  }
  /* parameter groups: ids and groups out of range; group 0 is the default */
  EXPECT(A, "sg_set_param_group", sg_set_param_group(NULL, 0, 0));
  EXPECT(A, "sg_set_param_group", sg_set_param_group(e, -1, 0));
  EXPECT(A, "sg_set_param_group", sg_set_param_group(e, NP, 0));
  EXPECT(A, "sg_set_param_group", sg_set_param_group(e, 0, -1));
  EXPECT(A, "sg_set_param_group", sg_set_param_group(e, 0, SG_MAX_GROUPS));
  EXPECT(A, "sg_set_param_group", sg_set_param_group(e, 0, INT_MAX));
  EXPECT_OK(sg_set_param_group(e, 0, 0));
}

static void misuse_after_finalize(rank_ctx *x) {
  int id = -1;
  EXPECT(SG_ERR_INVALID_STATE, "sg_finalize", sg_finalize(x->et));
  EXPECT(SG_ERR_INVALID_STATE, "sg_add_param", sg_add_param(x->et, "late", 8, 0, &id));
  EXPECT(SG_ERR_INVALID_STATE, "sg_set_param_group", sg_set_param_group(x->et, 0, 1));
  EXPECT(SG_ERR_INVALID_STATE, "sg_set_param_group", sg_set_param_group(x->et, 0, 0));
  sg_config c;
  base_config(&c, x->rc);
  /* A second engine on the communicator in use gets a channel of its own (issue 14: two
   * models on one process group); every rank creates it, as every rank will finalize it. */
  sg_engine *other = NULL;
  CHECK(sg_engine_create(x->ct, &c, &other) == SG_OK && other,
        "sg_engine_create on a communicator in use: a second engine");
  sg_engine_destroy(other);
  /* While an engine holds it, the free waits for that engine's destroy (issue 30): later
   * steps prove the engine still works; the handle is dead for anything new. */
  sg_comm_destroy(x->ct);
  CHECK(sg_engine_create(x->ct, &c, &other) == SG_ERR_INVALID_STATE,
        "sg_engine_create on a destroyed communicator (still held by an engine) is refused");
  x->ct = NULL; /* freed with x->et */
}

static const int k_bad_ids[] = {-1, NP, INT_MAX, INT_MIN};

static void misuse_bad_ids(rank_ctx *x) {
  sg_engine *e = x->et;
  void *p = NULL;
  float buf[MAXN] = {0};
  const sg_status A = SG_ERR_INVALID_ARGUMENT;
  for (size_t k = 0; k < sizeof k_bad_ids / sizeof k_bad_ids[0]; k++) {
    const int id = k_bad_ids[k];
    EXPECT(A, "sg_param_ptr", sg_param_ptr(e, id, &p));
    if (id != -1) EXPECT(A, "sg_param_wait", sg_param_wait(e, id)); /* -1: every bucket */
    EXPECT(A, "sg_set_param", sg_set_param(e, id, buf, SG_F32));
    EXPECT(A, "sg_get_param", sg_get_param(e, id, buf, SG_F32));
    EXPECT(A, "sg_get_master", sg_get_master(e, id, buf));
    EXPECT(A, "sg_get_optim_state", sg_get_optim_state(e, id, 0, buf));
    EXPECT(A, "sg_grad_ptr", sg_grad_ptr(e, id, &p));
    EXPECT(A, "sg_grad_ready", sg_grad_ready(e, id));
    EXPECT(A, "sg_grad_add", sg_grad_add(e, id, buf, SG_F32));
  }
}

static void misuse_null(rank_ctx *x) {
  sg_engine *e = x->et;
  void *p = NULL;
  float buf[MAXN] = {0}, f = 0;
  int id = 0;
  sg_memory_stats ms;
  ms.struct_size = sizeof ms;
  const sg_status A = SG_ERR_INVALID_ARGUMENT;
  EXPECT(A, "sg_param_ptr", sg_param_ptr(e, 0, NULL));
  EXPECT(A, "sg_set_param", sg_set_param(e, 0, NULL, SG_F32));
  EXPECT(A, "sg_get_param", sg_get_param(e, 0, NULL, SG_F32));
  EXPECT(A, "sg_get_master", sg_get_master(e, 0, NULL));
  EXPECT(A, "sg_get_optim_state", sg_get_optim_state(e, 0, 1, NULL));
  EXPECT(A, "sg_grad_ptr", sg_grad_ptr(e, 0, NULL));
  EXPECT(A, "sg_grad_add", sg_grad_add(e, 0, NULL, SG_F32));
  EXPECT(A, "sg_memory", sg_memory(e, NULL));
  EXPECT(A, "sg_get_loss_scale", sg_get_loss_scale(e, NULL));
  /* NULL engine */
  EXPECT(A, "sg_finalize", sg_finalize(NULL));
  EXPECT(A, "sg_add_param", sg_add_param(NULL, "y", 1, 0, &id));
  EXPECT(A, "sg_param_ptr", sg_param_ptr(NULL, 0, &p));
  EXPECT(A, "sg_param_wait", sg_param_wait(NULL, 0));
  EXPECT(A, "sg_param_wait", sg_param_wait(NULL, -1));
  EXPECT(A, "sg_set_param", sg_set_param(NULL, 0, buf, SG_F32));
  EXPECT(A, "sg_get_param", sg_get_param(NULL, 0, buf, SG_F32));
  EXPECT(A, "sg_broadcast_params", sg_broadcast_params(NULL, 0));
  EXPECT(A, "sg_get_master", sg_get_master(NULL, 0, buf));
  EXPECT(A, "sg_get_optim_state", sg_get_optim_state(NULL, 0, 0, buf));
  EXPECT(A, "sg_grad_ptr", sg_grad_ptr(NULL, 0, &p));
  EXPECT(A, "sg_grad_ready", sg_grad_ready(NULL, 0));
  EXPECT(A, "sg_grad_add", sg_grad_add(NULL, 0, buf, SG_F32));
  EXPECT(A, "sg_backward_end", sg_backward_end(NULL));
  EXPECT(A, "sg_set_sync", sg_set_sync(NULL, 1));
  EXPECT(A, "sg_step", sg_step(NULL, NULL));
  EXPECT(A, "sg_set_lr", sg_set_lr(NULL, 0.1f));
  EXPECT(A, "sg_set_group", sg_set_group(NULL, 0, 0.1f, 0.0f));
  EXPECT(A, "sg_get_group", sg_get_group(NULL, 0, &f, &f));
  EXPECT(A, "sg_get_group", sg_get_group(e, 0, NULL, &f));
  EXPECT(A, "sg_get_group", sg_get_group(e, 0, &f, NULL));
  EXPECT(A, "sg_get_loss_scale", sg_get_loss_scale(NULL, &f));
  EXPECT(A, "sg_memory", sg_memory(NULL, &ms));
}

static void misuse_values(rank_ctx *x) {
  sg_engine *e = x->et;
  float buf[MAXN] = {0};
  const sg_status A = SG_ERR_INVALID_ARGUMENT;
  EXPECT(A, "sg_set_param", sg_set_param(e, 0, buf, (sg_dtype)7));
  EXPECT(A, "sg_set_param", sg_set_param(e, 0, buf, (sg_dtype)-1));
  EXPECT(A, "sg_set_param", sg_set_param(e, 0, buf, (sg_dtype)3));
  EXPECT(A, "sg_get_param", sg_get_param(e, 0, buf, (sg_dtype)7));
  EXPECT(A, "sg_grad_add", sg_grad_add(e, 1, buf, (sg_dtype)7));
  EXPECT(A, "sg_get_optim_state", sg_get_optim_state(e, 0, 2, buf));
  EXPECT(A, "sg_get_optim_state", sg_get_optim_state(e, 0, -1, buf));
  EXPECT(A, "sg_set_sync", sg_set_sync(e, 2));
  EXPECT(A, "sg_set_sync", sg_set_sync(e, -1));
  EXPECT(A, "sg_broadcast_params", sg_broadcast_params(e, -1));
  EXPECT(A, "sg_broadcast_params", sg_broadcast_params(e, x->world));
  EXPECT(A, "sg_broadcast_params", sg_broadcast_params(e, INT_MAX));
  EXPECT(A, "sg_set_lr", sg_set_lr(e, -1.0f));
  EXPECT(A, "sg_set_lr", sg_set_lr(e, NAN));
  EXPECT(A, "sg_set_lr", sg_set_lr(e, INFINITY));
  /* parameter groups: bad group, lr or weight decay change nothing */
  float glr = 0, gwd = 0, glr2 = 0, gwd2 = 0;
  EXPECT_OK(sg_get_group(e, 0, &glr, &gwd));
  EXPECT(A, "sg_set_group", sg_set_group(e, -1, 0.1f, 0.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, SG_MAX_GROUPS, 0.1f, 0.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, 0, -1.0f, 0.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, 0, NAN, 0.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, 0, INFINITY, 0.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, 0, 0.1f, -1.0f));
  EXPECT(A, "sg_set_group", sg_set_group(e, 0, 0.1f, NAN));
  EXPECT(A, "sg_set_group", sg_set_group(e, 1, 0.1f, INFINITY));
  EXPECT(A, "sg_get_group", sg_get_group(e, -1, &glr2, &gwd2));
  EXPECT(A, "sg_get_group", sg_get_group(e, SG_MAX_GROUPS, &glr2, &gwd2));
  CHECK(sg_get_group(e, 0, &glr2, &gwd2) == SG_OK && glr2 == glr && gwd2 == gwd,
        "failed sg_set_group calls leave group 0 as it was (lr %g, weight_decay %g)", glr2, gwd2);
  sg_step_info info;
  info.struct_size = 0;
  EXPECT(A, "sg_step", sg_step(e, &info));
  info.struct_size = sizeof info + 1;
  EXPECT(A, "sg_step", sg_step(e, &info));
  info.struct_size = sizeof info - 1;
  EXPECT(A, "sg_step", sg_step(e, &info));
  sg_memory_stats ms;
  ms.struct_size = 0;
  EXPECT(A, "sg_memory", sg_memory(e, &ms));
  ms.struct_size = sizeof ms + 8;
  EXPECT(A, "sg_memory", sg_memory(e, &ms));
  float s = 0;
  CHECK(sg_get_loss_scale(e, &s) == SG_OK && s == 1.0f, "sg_get_loss_scale still 1 (got %g)", s);
}

/* In the middle of a micro-batch, after the gradient of `done` was given. */
static void misuse_mid(rank_ctx *x, int done) {
  sg_engine *e = x->et;
  void *p = NULL;
  float buf[MAXN] = {0};
  const sg_status S = SG_ERR_INVALID_STATE;
  EXPECT(S, "sg_grad_ready", sg_grad_ready(e, done));
  EXPECT(S, "sg_grad_add", sg_grad_add(e, done, buf, SG_F32));
  EXPECT(S, "sg_grad_ptr", sg_grad_ptr(e, done, &p));
  EXPECT(S, "sg_set_sync", sg_set_sync(e, 0));
  EXPECT(S, "sg_set_sync", sg_set_sync(e, 1));
  EXPECT(S, "sg_get_master", sg_get_master(e, 0, buf));
  EXPECT(S, "sg_get_optim_state", sg_get_optim_state(e, 0, 1, buf));
  EXPECT(S, "sg_broadcast_params", sg_broadcast_params(e, 0));
  sg_step_info info;
  info.struct_size = 3;
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_step", sg_step(e, &info));
  /* argument errors are still argument errors mid micro-batch */
  EXPECT(SG_ERR_INVALID_ARGUMENT, "sg_grad_ready", sg_grad_ready(e, -1));
}

/* One micro-batch on both engines; misuse after the first gradient when asked. The gradient
 * order is reverse registration order (backward order). */
static void micro_batch(rank_ctx *x, int mb, int misuse) {
  int ok = 1;
  for (int id = NP - 1; id >= 0; id--) {
    ok = ok && give_grad(x, x->et, mb, id) == SG_OK && give_grad(x, x->er, mb, id) == SG_OK;
    if (misuse && id == NP - 1) misuse_mid(x, id);
  }
  CHECK(ok, "micro-batch %d of step %d: every gradient accepted by both engines", mb, x->step);
}

static void *rank_main(void *arg) {
  rank_ctx *x = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[%s W=%d r%d]", x->rc->label, x->world, x->rank);
  sg_test_quiet = x->rank != 0;
  sg_config c;
  base_config(&c, x->rc);
  if (!CHECK(sg_engine_create(x->ct, &c, &x->et) == SG_OK &&
                 sg_engine_create(x->cr, &c, &x->er) == SG_OK,
             "create the test and the reference engine"))
    return NULL;
  misuse_before_finalize(x);
  misuse_registration(x);
  CHECK(register_params(x, x->er), "register the parameters on the reference");
  EXPECT_OK(sg_finalize(x->et));
  EXPECT_OK(sg_finalize(x->er));
  misuse_after_finalize(x);
  CHECK(set_params(x->et) && set_params(x->er), "set identical initial parameters");
  compare_params(x, "after sg_set_param");

  /* step 1: bad ids between micro-batches; step 2: NULL pointers; step 3: bad values;
   * step 4: misuse in the middle of micro-batches (on the last rank only at W>1, so that the
   * other ranks go on without it); step 5: with sg_set_sync(0) for the first micro-batch. */
  misuse_bad_ids(x);
  micro_batch(x, 0, 0);
  do_step(x);
  misuse_null(x);
  micro_batch(x, 0, 0);
  misuse_null(x);
  micro_batch(x, 1, 0);
  do_step(x);
  misuse_values(x);
  micro_batch(x, 0, 0);
  do_step(x);
  micro_batch(x, 0, x->rank == x->world - 1);
  micro_batch(x, 1, x->rank == x->world - 1);
  do_step(x);
  EXPECT_OK(sg_set_sync(x->et, 0));
  EXPECT_OK(sg_set_sync(x->er, 0));
  micro_batch(x, 0, 1);
  EXPECT_OK(sg_set_sync(x->et, 1));
  EXPECT_OK(sg_set_sync(x->er, 1));
  micro_batch(x, 1, 1);
  misuse_bad_ids(x);
  do_step(x);
  compare_state(x);
  sg_engine_destroy(x->et);
  sg_engine_destroy(x->er);
  return NULL;
}

static void part_engine(const run_cfg *rc) {
  printf("== misuse matrix: %s, W=%d ==\n", rc->label, rc->world);
  const int W = rc->world;
  sg_comm *ct[4], *cr[4];
  if (!CHECK(sg_comm_create_local(W, ct) == SG_OK && sg_comm_create_local(W, cr) == SG_OK,
             "create two local groups of %d", W))
    return;
  rank_ctx x[4];
  pthread_t th[4];
  for (int r = 0; r < W; r++) {
    x[r] = (rank_ctx){rc, r, W, ct[r], cr[r], NULL, NULL, 0, NULL};
    pthread_create(&th[r], NULL, rank_main, &x[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    sg_comm_destroy(x[r].ct); /* NULL where the rank destroyed it (misuse_after_finalize) */
    sg_comm_destroy(cr[r]);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* part 3: allocation failures (W=1)                                                         */

static void part_oom(void) {
  printf("== allocation failures (W=1, bf16 params so that a master copy exists) ==\n");
  const run_cfg rc = {1, SG_BF16, SG_SHARD_GRAD_OP, "oom"};
  snprintf(sg_test_tag, sizeof sg_test_tag, "[oom W=1]");
  sg_comm *ct = NULL, *cr = NULL;
  sg_comm_create_local(1, &ct);
  sg_comm_create_local(1, &cr);
  sg_config c;
  base_config(&c, &rc);
  c.staging_buckets = 1; /* forward-order gradients then need extra staging buffers */
  rank_ctx x = {&rc, 0, 1, ct, cr, NULL, NULL, 0, NULL};
  EXPECT_OK(sg_engine_create(ct, &c, &x.et));
  EXPECT_OK(sg_engine_create(cr, &c, &x.er));
  CHECK(register_params(&x, x.et) && register_params(&x, x.er), "register parameters");
  EXPECT_OK(sg_finalize(x.er));

  /* sg_finalize fails at allocation n = 0, 1, 2, ... until it needs no more than n. */
  int n = 0, failures = 0;
  sg_status st = SG_ERR_INTERNAL;
  for (n = 0; n < 64; n++) {
    sg__device_fail_alloc_after(n);
    sg__err_clear();
    st = sg_finalize(x.et);
    sg__device_fail_alloc_after(-1);
    if (st == SG_OK) break;
    failures++;
    const char *msg = sg_last_error();
    CHECK(st == SG_ERR_OUT_OF_MEMORY && msg[0] && strstr(msg, "sg_finalize"),
          "sg_finalize with allocation #%d failing -> SG_ERR_OUT_OF_MEMORY naming sg_finalize "
          "(got %s: \"%s\")", n, sg_status_string(st), msg);
    sg_memory_stats ms;
    ms.struct_size = sizeof ms;
    EXPECT(SG_ERR_INVALID_STATE, "sg_memory", sg_memory(x.et, &ms));
  }
  CHECK(st == SG_OK && failures >= 2,
        "sg_finalize succeeds once allocation #%d is reached (%d failing points seen)", n, failures);
  if (st != SG_OK) goto done;
  CHECK(set_params(x.et) && set_params(x.er), "set identical initial parameters");
  micro_batch(&x, 0, 0);
  do_step(&x);

  /* sg_set_sync(e, 0) allocates the no_sync buffer on first use. */
  sg__device_fail_alloc_after(0);
  sg__err_clear();
  st = sg_set_sync(x.et, 0);
  sg__device_fail_alloc_after(-1);
  CHECK(st == SG_ERR_OUT_OF_MEMORY && strstr(sg_last_error(), "sg_set_sync"),
        "sg_set_sync(e, 0) with its allocation failing -> SG_ERR_OUT_OF_MEMORY naming sg_set_sync "
        "(got %s)", sg_status_string(st));
  micro_batch(&x, 0, 0); /* still in sync mode on both */
  do_step(&x);

  /* sg_get_optim_state / sg_get_master gather through a temporary device buffer. */
  float buf[MAXN];
  sg__device_fail_alloc_after(0);
  sg__err_clear();
  st = sg_get_optim_state(x.et, 5, 1, buf);
  sg__device_fail_alloc_after(-1);
  CHECK(st == SG_ERR_OUT_OF_MEMORY && strstr(sg_last_error(), "sg_get_optim_state"),
        "sg_get_optim_state with its allocation failing -> SG_ERR_OUT_OF_MEMORY naming "
        "sg_get_optim_state (got %s: \"%s\")", sg_status_string(st), sg_last_error());
  sg__device_fail_alloc_after(0);
  sg__err_clear();
  st = sg_get_master(x.et, 5, buf);
  sg__device_fail_alloc_after(-1);
  CHECK(st == SG_ERR_OUT_OF_MEMORY && strstr(sg_last_error(), "sg_get_master"),
        "sg_get_master with its allocation failing -> SG_ERR_OUT_OF_MEMORY naming sg_get_master "
        "(got %s: \"%s\")", sg_status_string(st), sg_last_error());

  /* Gradients in registration order with one staging buffer: a slot may need an extra staging
   * buffer; when that allocation fails the call fails and can be retried. */
  int oom_seen = 0, ok = 1;
  for (int id = 0; id < NP; id++) {
    sg__device_fail_alloc_after(0);
    sg__err_clear();
    st = give_grad(&x, x.et, 0, id);
    sg__device_fail_alloc_after(-1);
    if (st == SG_ERR_OUT_OF_MEMORY) {
      oom_seen++;
      CHECK(sg_last_error()[0] != '\0' && (strstr(sg_last_error(), "sg_grad_ptr") ||
                                           strstr(sg_last_error(), "sg_grad_add")),
            "gradient of param %d with the staging allocation failing -> SG_ERR_OUT_OF_MEMORY "
            "naming the function (\"%s\")", id, sg_last_error());
      st = give_grad(&x, x.et, 0, id);
    }
    ok = ok && st == SG_OK && give_grad(&x, x.er, 0, id) == SG_OK;
  }
  CHECK(ok && oom_seen >= 1, "forward-order gradients: %d failed allocations, every retry "
        "accepted", oom_seen);
  do_step(&x);
  compare_state(&x);
done:
  sg_engine_destroy(x.et);
  sg_engine_destroy(x.er);
  sg_comm_destroy(ct);
  sg_comm_destroy(cr);
}

/* ---------------------------------------------------------------------------------------- */
/* part 4: misuse that breaks the communicator (W=2)                                         */

typedef struct broken_ctx {
  int rank;
  sg_comm *comm;
  pthread_barrier_t *bar;
  int scenario; /* 0: mismatched collectives, 1: one rank skips a collective */
} broken_ctx;

static void *broken_main(void *arg) {
  broken_ctx *b = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[broken%d W=2 r%d]", b->scenario, b->rank);
  sg_test_quiet = 0;
  const run_cfg rc = {2, SG_F32, SG_SHARD_GRAD_OP, "broken"};
  sg_config c;
  base_config(&c, &rc);
  c.timeout_ms = b->scenario == 0 ? 10000 : 300;
  sg_engine *e = NULL;
  rank_ctx x = {&rc, b->rank, 2, b->comm, NULL, NULL, NULL, 0, NULL};
  if (!CHECK(sg_engine_create(b->comm, &c, &e) == SG_OK && register_params(&x, e) &&
                 sg_finalize(e) == SG_OK,
             "engine finalized"))
    return NULL;
  float buf[MAXN];
  sg_status st;
  sg__err_clear();
  if (b->scenario == 0) {
    /* rank 0 steps (all-reduce of the norm) while rank 1 gathers m (all-gather) */
    st = b->rank == 0 ? sg_step(e, NULL) : sg_get_optim_state(e, 0, 0, buf);
    CHECK(st != SG_OK && sg_last_error()[0],
          "%s while the peer calls %s -> an error, not a hang (got %s: \"%s\")",
          b->rank == 0 ? "sg_step" : "sg_get_optim_state",
          b->rank == 0 ? "sg_get_optim_state" : "sg_step",
          sg_status_string(st), sg_last_error());
  } else {
    /* rank 0 broadcasts; rank 1 never joins (waits for rank 0 to give up) */
    if (b->rank == 0) {
      st = sg_broadcast_params(e, 0);
      CHECK(st == SG_ERR_TIMEOUT && strstr(sg_last_error(), "sg_"),
            "sg_broadcast_params that the peer never joins -> SG_ERR_TIMEOUT (got %s: \"%s\")",
            sg_status_string(st), sg_last_error());
    }
  }
  pthread_barrier_wait(b->bar);
  sg__err_clear();
  st = sg_step(e, NULL);
  CHECK(st != SG_OK && sg_last_error()[0],
        "sg_step on the broken communicator fails at once (got %s)", sg_status_string(st));
  sg__err_clear();
  st = sg_step(e, NULL);
  /* After a timeout the engine is marked broken (SG_ERR_COMM). After mismatched collectives
   * the engine keeps returning the comm queue's recorded SG_ERR_MISMATCH instead: either way
   * it must keep failing, never hang or pretend to work. */
  CHECK(st == SG_ERR_COMM || (b->scenario == 0 && st == SG_ERR_MISMATCH),
        "and keeps failing (got %s: \"%s\")", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_engine *e2 = NULL;
  EXPECT(SG_ERR_COMM, "sg_engine_create", sg_engine_create(b->comm, &c, &e2));
  CHECK(e2 == NULL, "no engine on a broken communicator");
  return NULL;
}

static void part_broken(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "[main]");
  for (int scenario = 0; scenario < 2; scenario++) {
    printf("== misuse that breaks the communicator: %s ==\n",
           scenario == 0 ? "mismatched collectives" : "a rank skips a collective");
    sg_comm *comms[2];
    if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "create a local group of 2")) return;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    broken_ctx b[2];
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
      b[r] = (broken_ctx){r, comms[r], &bar, scenario};
      pthread_create(&th[r], NULL, broken_main, &b[r]);
    }
    for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&bar);
    for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* part 5: destroying engines in the middle of a micro-batch (W=2)                            */

static void *inflight_main(void *arg) {
  rank_ctx *x = arg;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[inflight W=2 r%d]", x->rank);
  sg_test_quiet = x->rank != 0;
  sg_config c;
  base_config(&c, x->rc);
  for (int round = 0; round < 2; round++) {
    sg_engine *e = NULL;
    if (!CHECK(sg_engine_create(x->ct, &c, &e) == SG_OK && register_params(x, e) &&
                   sg_finalize(e) == SG_OK && set_params(e),
               "round %d: engine finalized", round))
      return NULL;
    x->et = e;
    int ok = 1;
    /* round 0: the first bucket's reduction is launched, then the engine goes away; round 1:
     * a full step on the same communicator shows nothing was left behind */
    const int upto = round == 0 ? NP - 2 : 0;
    for (int id = NP - 1; id >= upto; id--) ok = ok && give_grad(x, e, 0, id) == SG_OK;
    if (round == 1) ok = ok && sg_step(e, NULL) == SG_OK;
    CHECK(ok, round == 0 ? "round 0: gradients of two parameters given (reductions in flight)"
                         : "round 1: a full step on the same communicator");
    sg_engine_destroy(e);
    CHECK(1, "round %d: sg_engine_destroy returned", round);
  }
  return NULL;
}

static void part_inflight(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "[main]");
  printf("== sg_engine_destroy with reductions in flight (W=2) ==\n");
  const run_cfg rc = {2, SG_F32, SG_SHARD_GRAD_OP, "inflight"};
  sg_comm *comms[2];
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "create a local group of 2")) return;
  rank_ctx x[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    x[r] = (rank_ctx){&rc, r, 2, comms[r], NULL, NULL, NULL, 0, NULL};
    pthread_create(&th[r], NULL, inflight_main, &x[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) sg_comm_destroy(comms[r]);
}

int main(void) {
  memset(g_long_name, 'p', 255);
  g_long_name[255] = '\0';
  setvbuf(stdout, NULL, _IOLBF, 0);
  part_global();
  static const run_cfg runs[] = {
      {1, SG_F32, SG_SHARD_GRAD_OP, "f32 shard_grad_op"},
      {2, SG_F32, SG_SHARD_GRAD_OP, "f32 shard_grad_op"},
      {2, SG_BF16, SG_NO_SHARD, "bf16 no_shard"},
      {2, SG_BF16, SG_SHARD_OPT, "bf16 shard_opt"},
  };
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) part_engine(&runs[i]);
  part_oom();
  part_broken();
  part_inflight();
  return sg_test_summary("");
}
