/* Which gradient slots give their pages back (DESIGN.md section 3): a slot is zeroed with the
 * device's zero_release only when its next use is behind a forward pass; a SHARD_GRAD_OP
 * staging buffer that a later bucket of the same micro-batch is handed again is zeroed with
 * plain zero and stays resident, since its pages would be faulted in again at once.
 *
 * One rank on the CPU device, 6 parameters of 256 KiB (the first bucket's 512 KiB), one bucket
 * each, 2 staging buckets. The engine's device ops table is wrapped so that every zero and
 * zero_release is logged. For each micro-batch the test sees, from sg_grad_ptr, which buffer
 * every bucket was handed, in the order they were handed out, and checks per buffer: it read
 * as zeros each time it was handed out; of its holders' zeroings the last gave the pages back
 * and (sync on: exactly; sync off: at least where plain zero was used) every earlier one was a
 * plain zero; and once the micro-batch is reduced none of the pages any holder wrote is
 * resident (mincore), the larger first bucket's included when a smaller one held it last. Cases:
 * gradients in backward order; one bucket early (it holds a buffer while the others cycle
 * through the other one); three buckets early (two more staging buffers are allocated); with
 * sg_set_sync(0), a micro-batch folded locally then one reduced; SHARD_OPT and NO_SHARD, whose
 * slots are never handed to another bucket, so every one gives its pages back. */
#define _DEFAULT_SOURCE /* mincore */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "engine/sg_engine_internal.h" /* e->dev (its ops table is wrapped), e->plan */
#include "shardgrad.h"

#include "sg_test_check.h"
#include "sg_test_mem.h" /* sg_test_resident_inside */

#define NPARAM 6
#define NUMEL ((size_t)64 << 10) /* f32: 256 KiB, so zero_release has whole pages to give */
/* registration order; backward (plan) order is its reverse, so bucket 0 is the large one */
static const size_t k_numel[NPARAM] = {NUMEL, NUMEL, NUMEL, NUMEL, NUMEL, 2 * NUMEL};
#define MAXEV 256

/* ---- the wrapped device ops -------------------------------------------------------------- */

typedef struct {
  void *dst;
  int released; /* zero_release; 0: zero */
} zev;

static const sg__device_ops *g_real;
static sg__device_ops g_wrapped;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* the comm worker zeroes too */
static zev g_ev[MAXEV];
static int g_nev;

static void log_zero(void *dst, int released) {
  pthread_mutex_lock(&g_lock);
  if (g_nev < MAXEV) g_ev[g_nev++] = (zev){dst, released};
  pthread_mutex_unlock(&g_lock);
}

static sg_status wrap_zero(sg__device *d, sg__queue q, void *dst, size_t bytes) {
  log_zero(dst, 0);
  return g_real->zero(d, q, dst, bytes);
}

static sg_status wrap_zero_release(sg__device *d, sg__queue q, void *dst, size_t bytes) {
  log_zero(dst, 1);
  return g_real->zero_release(d, q, dst, bytes);
}

static void wrap(sg_engine *e) {
  g_real = e->dev->ops;
  g_wrapped = *g_real;
  g_wrapped.zero = wrap_zero;
  g_wrapped.zero_release = wrap_zero_release;
  e->dev->ops = &g_wrapped;
}

/* ---- one micro-batch ----------------------------------------------------------------------- */

typedef struct {
  sg_engine *e;
  int ids[NPARAM];
  void *held[NPARAM]; /* the buffer each bucket was handed, in the order handed out */
  int holder[NPARAM]; /* the bucket it was handed to */
  int nheld;
} run;

/* The parameter of bucket b (plan order = backward order). */
static int param_of(const run *r, int b) {
  for (int p = 0; p < NPARAM; p++)
    if (r->e->plan->params[r->ids[p]].bucket == b) return r->ids[p];
  return -1;
}

static size_t numel_of(const run *r, int b) {
  return r->e->plan->buckets[b].numel;
}

static int all_zero(const float *g, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (g[i] != 0.0f) return 0;
  return 1;
}

/* Bucket b's slot handed out (checked to read as zeros) and written. */
static void write_bucket(run *r, int b, float v) {
  float *g = NULL;
  if (!CHECK(sg_grad_ptr(r->e, param_of(r, b), (void **)&g) == SG_OK, "sg_grad_ptr bucket %d", b))
    return;
  const size_t n = numel_of(r, b);
  CHECK(all_zero(g, n), "bucket %d is handed a buffer that reads as zeros", b);
  r->holder[r->nheld] = b;
  r->held[r->nheld++] = g;
  for (size_t i = 0; i < n; i++) g[i] = v + (float)(i % 7);
}

/* A micro-batch: the buckets of `early` written first (and marked ready), then every other
 * bucket in backward order, each marked ready as soon as written. */
static void microbatch(run *r, const int *early, int nearly) {
  int done[NPARAM] = {0};
  r->nheld = 0;
  for (int i = 0; i < nearly; i++) {
    write_bucket(r, early[i], 1.0f);
    CHECK(sg_grad_ready(r->e, param_of(r, early[i])) == SG_OK, "early bucket %d ready", early[i]);
    done[early[i]] = 1;
  }
  for (int b = 0; b < NPARAM; b++) {
    if (done[b]) continue;
    write_bucket(r, b, 2.0f);
    CHECK(sg_grad_ready(r->e, param_of(r, b)) == SG_OK, "bucket %d ready", b);
  }
  CHECK(sg_backward_end(r->e) == SG_OK, "sg_backward_end");
  CHECK(r->e->dev->ops->comm_wait(r->e->dev, r->e->last_ticket, INT64_MAX) == SG_OK,
        "every reduction done");
}

/* The zeroings of the micro-batch logged for each buffer handed out, against its holders. */
static void check_zeroings(const run *r, int exact, const char *what) {
  int seen_all = 1;
  for (int i = 0; i < r->nheld; i++) {
    int first = 1, holders = 0, nz = 0, nr = 0, last_released = 0;
    size_t written = 0; /* bytes of the buffer its holders wrote */
    for (int j = 0; j < i; j++) first &= r->held[j] != r->held[i];
    if (!first) continue;
    for (int j = 0; j < r->nheld; j++) {
      if (r->held[j] != r->held[i]) continue;
      holders++;
      if (numel_of(r, r->holder[j]) * 4 > written) written = numel_of(r, r->holder[j]) * 4;
    }
    for (int k = 0; k < g_nev; k++) {
      if (g_ev[k].dst != r->held[i]) continue;
      nz += !g_ev[k].released;
      nr += g_ev[k].released;
      last_released = g_ev[k].released;
    }
    seen_all &= nz + nr == holders;
    CHECK(nz + nr == holders && last_released && (exact ? nz == holders - 1 : nr >= 1),
          "%s: the buffer of bucket %d, held by %d bucket(s): %d plain zero, %d zero_release, "
          "the last a release (%s)", what, r->holder[i], holders, nz, nr,
          exact ? "exactly one" : "at least one");
    const long res = sg_test_resident_inside(r->held[i], written);
    CHECK(res == 0, "%s: the buffer of bucket %d: none of the %zu bytes written resident (%ld "
          "pages)", what, r->holder[i], written, res);
  }
  CHECK(seen_all, "%s: one zeroing per holder", what);
}

/* One micro-batch with its zeroings checked, then a step unless `step` is 0. */
static void case_of(run *r, const int *early, int nearly, int exact, const char *what, int step) {
  g_nev = 0;
  microbatch(r, early, nearly);
  check_zeroings(r, exact, what);
  if (step) CHECK(sg_step(r->e, NULL) == SG_OK, "%s: sg_step", what);
}

static sg_engine *make_engine(sg_comm *c, sg_strategy strategy, int *ids) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.strategy = strategy;
  cfg.bucket_bytes = NUMEL * 4;
  cfg.staging_buckets = 2;
  sg_engine *e = NULL;
  sg_status st = sg_engine_create(c, &cfg, &e);
  for (int p = 0; p < NPARAM && st == SG_OK; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, k_numel[p], 0, &ids[p]);
  }
  if (st == SG_OK) st = sg_finalize(e);
  if (!CHECK(st == SG_OK && e->plan->nbuckets == NPARAM, "%d-bucket engine", NPARAM)) {
    sg_engine_destroy(e);
    return NULL;
  }
  wrap(e);
  return e;
}

static void staging_cases(sg_comm *c) {
  run r = {0};
  r.e = make_engine(c, SG_SHARD_GRAD_OP, r.ids);
  if (!r.e) return;
  const int one[] = {3}, three[] = {5, 4, 3};
  for (int s = 0; s < 2; s++) { /* twice: the second time every ticket is from a reduction */
    case_of(&r, NULL, 0, 1, "backward order", 1);
    case_of(&r, one, 1, 1, "bucket 3 early", 1);
  }
  case_of(&r, three, 3, 1, "buckets 5, 4, 3 early (two more staging buffers)", 1);
  case_of(&r, NULL, 0, 1, "backward order, 4 staging buffers", 1);
  CHECK(sg_set_sync(r.e, 0) == SG_OK, "sg_set_sync(0)");
  case_of(&r, NULL, 0, 0, "sync off (folded)", 0);
  CHECK(sg_set_sync(r.e, 1) == SG_OK, "sg_set_sync(1)");
  case_of(&r, one, 1, 1, "sync on after a folded micro-batch", 1);
  sg_engine_destroy(r.e);
}

/* Full gradient buffers: each bucket its own region, never handed to another one. */
static void full_cases(sg_comm *c, sg_strategy strategy, const char *name) {
  run r = {0};
  r.e = make_engine(c, strategy, r.ids);
  if (!r.e) return;
  case_of(&r, NULL, 0, 1, name, 1);
  sg_engine_destroy(r.e);
}

int main(void) {
  sg_comm *c = NULL;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK, "one-rank communicator")) return 1;
  staging_cases(c);
  full_cases(c, SG_SHARD_OPT, "SHARD_OPT");
  full_cases(c, SG_NO_SHARD, "NO_SHARD");
  sg_comm_destroy(c);
  return sg_test_summary("");
}
