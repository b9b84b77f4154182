/* Two threads calling into one engine at once (issue 14, item 12) are detected every time:
 * while thread A is inside sg_step on rank 0's engine (held there: rank 1 has not joined the
 * step's collectives yet), a thread B calls every public engine function on that engine and
 * gets SG_ERR_INVALID_STATE naming sg_step, and nothing changes; then rank 1 steps, A's step
 * completes, and both engines go on to the same state as a run without the intruder (bitwise).
 * Nested calls on one thread (sg_import calling sg_set_param, sg_get_master calling
 * sg_get_param) still work. sg_engine_destroy from B while A is inside leaves the engine alone.
 * Runs under TSan in CI: B touches nothing but the guard. */
#define _POSIX_C_SOURCE 200809L /* nanosleep, mkdtemp */

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sg_test_check.h"

#define NPAR 3
static const size_t k_sizes[NPAR] = {1000, 70, 3000};

static sg_engine *make(sg_comm *c, int *ids) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 60000;
  cfg.bucket_bytes = 4096;
  sg_engine *e = NULL;
  if (sg_engine_create(c, &cfg, &e) != SG_OK) return NULL;
  for (int p = 0; p < NPAR; p++) {
    char name[16];
    snprintf(name, sizeof name, "w%d", p);
    if (sg_add_param(e, name, k_sizes[p], 0, &ids[p]) != SG_OK) return NULL;
  }
  if (sg_finalize(e) != SG_OK) return NULL;
  return e;
}

static sg_status grads(sg_engine *e, const int *ids, int step) {
  for (int p = NPAR - 1; p >= 0; p--) {
    void *g = NULL;
    sg_status st = sg_grad_ptr(e, ids[p], &g);
    if (st) return st;
    for (size_t i = 0; i < k_sizes[p]; i++) ((float *)g)[i] = (float)((int)((i + step) % 5) - 2) / 8;
    if ((st = sg_grad_ready(e, ids[p]))) return st;
  }
  return SG_OK;
}

typedef struct {
  sg_comm *comm[2];
  sg_engine *e[2];
  int ids[2][NPAR];
  _Atomic int a_inside_step; /* A is about to call sg_step (its backward pass is done) */
  _Atomic int b_done;        /* the intruder has finished: rank 1 may step */
  sg_status a_st, r1_st;
  int refused, calls, unexpected, a_retries;
  char first_msg[512], tmpdir[256];
} shared;

static void *rank1(void *p) {
  shared *s = p;
  s->r1_st = grads(s->e[1], s->ids[1], 1);
  while (!atomic_load(&s->b_done)) nanosleep(&(struct timespec){0, 1000000}, NULL);
  if (!s->r1_st) s->r1_st = sg_step(s->e[1], NULL);
  return NULL;
}

static void *thread_a(void *p) {
  shared *s = p;
  s->a_st = grads(s->e[0], s->ids[0], 1);
  atomic_store(&s->a_inside_step, 1);
  /* B's polling call may be inside when A arrives: A is then refused and tries again, as a
   * program sharing an engine between threads (with its own lock) never needs to */
  while (!s->a_st && (s->a_st = sg_step(s->e[0], NULL)) == SG_ERR_INVALID_STATE &&
         strstr(sg_last_error(), "another thread")) {
    s->a_st = SG_OK;
    s->a_retries++;
  }
  return NULL;
}

/* One call of every public engine function on e; counts refusals. */
static void intrude(shared *s, sg_engine *e) {
  const int *ids = s->ids[0];
  float buf[4096];
  void *ptr = NULL;
  float f = 0;
  uint64_t u = 0;
  sg_memory_stats ms = {.struct_size = sizeof ms};
  sg_trace_event ev[4];
  size_t cnt = 0, dropped = 0;
  int id = -1;
  char path[400];
  snprintf(path, sizeof path, "%s/intruder", s->tmpdir);
  const sg_status st[] = {
      sg_add_param(e, "x", 4, 0, &id),
      sg_finalize(e),
      sg_param_ptr(e, ids[0], &ptr),
      sg_param_wait(e, -1),
      sg_set_param(e, ids[0], buf, SG_F32),
      sg_get_param(e, ids[0], buf, SG_F32),
      sg_broadcast_params(e, 0),
      sg_get_master(e, ids[0], buf),
      sg_get_optim_state(e, ids[0], 0, buf),
      sg_grad_ptr(e, ids[0], &ptr),
      sg_grad_ready(e, ids[0]),
      sg_grad_add(e, ids[0], buf, SG_F32),
      sg_backward_end(e),
      sg_set_sync(e, 1),
      sg_grad_zero(e),
      sg_step(e, NULL),
      sg_set_lr(e, 0.5f),
      sg_get_lr(e, &f),
      sg_get_loss_scale(e, &f),
      sg_set_stream(e, NULL),
      sg_set_param_group(e, ids[0], 1),
      sg_set_group(e, 1, 0.1f, 0.0f),
      sg_get_group(e, 0, &f, &f),
      sg_memory(e, &ms),
      sg_save(e, path),
      sg_load(e, path),
      sg_export(e, path),
      sg_import(e, path),
      sg_get_step(e, &u),
      sg_get_param_step(e, ids[0], &u),
      sg_trace_start(e, 16),
      sg_trace_stop(e),
      sg_trace_mark(e, "x"),
      sg_trace_events(e, ev, 4, &cnt, &dropped),
      sg_trace_write(e, path),
  };
  const int n = (int)(sizeof st / sizeof st[0]);
  for (int k = 0; k < n; k++) {
    if (st[k] == SG_ERR_INVALID_STATE) s->refused++;
    else s->unexpected++;
  }
  s->calls = n;
}

static void *thread_b(void *p) {
  shared *s = p;
  while (!atomic_load(&s->a_inside_step)) nanosleep(&(struct timespec){0, 1000000}, NULL);
  /* A is in sg_step or about to be: wait until a cheap call is refused (5 s at most) */
  float lr = 0;
  int seen = 0;
  for (int k = 0; k < 5000 && !seen; k++) {
    if (sg_get_lr(s->e[0], &lr) == SG_ERR_INVALID_STATE) {
      seen = 1;
      snprintf(s->first_msg, sizeof s->first_msg, "%s", sg_last_error());
    } else {
      nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
  }
  if (seen) {
    intrude(s, s->e[0]);
    sg_engine_destroy(s->e[0]); /* refused: the engine stays A's */
  }
  atomic_store(&s->b_done, 1);
  return NULL;
}

typedef struct {
  shared *s;
  int r;
  sg_status st;
} rank_arg;

/* Rank r: its engine and step 0 (finalize and step are collectives: both ranks at once). */
static void *setup_rank(void *p) {
  rank_arg *a = p;
  shared *s = a->s;
  s->e[a->r] = make(s->comm[a->r], s->ids[a->r]);
  a->st = s->e[a->r] ? grads(s->e[a->r], s->ids[a->r], 0) : SG_ERR_INTERNAL;
  if (!a->st) a->st = sg_step(s->e[a->r], NULL);
  return NULL;
}

/* Rank r: calls that nest public functions (sg_import -> sg_set_param, sg_get_master ->
 * sg_get_param for f32) on one thread. */
static void *nested_rank(void *p) {
  rank_arg *a = p;
  shared *s = a->s;
  char path[400];
  snprintf(path, sizeof path, "%s/x.safetensors", s->tmpdir);
  float buf[4096];
  a->st = sg_export(s->e[a->r], path);
  if (!a->st) a->st = sg_import(s->e[a->r], path);
  if (!a->st) a->st = sg_get_master(s->e[a->r], s->ids[a->r][0], buf);
  return NULL;
}

static void both(void *(*fn)(void *), shared *s, rank_arg a[2]) {
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (rank_arg){s, r, SG_OK};
    pthread_create(&th[r], NULL, fn, &a[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
}

/* Steps 0 and 1 of an engine pair, with or without the intruder during step 1; the working
 * parameters of both ranks after it into out[2][sum of sizes]. 1 when every call worked. */
static int run(int intruder, shared *s, float *out) {
  memset(s, 0, sizeof *s);
  const char *t = getenv("TMPDIR");
  snprintf(s->tmpdir, sizeof s->tmpdir, "%s/sg_guard_XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(s->tmpdir) || sg_comm_create_local(2, s->comm) != SG_OK) return 0;
  rank_arg a[2];
  both(setup_rank, s, a);
  int ok = a[0].st == SG_OK && a[1].st == SG_OK;
  CHECK(ok, "setup and step 0 (intruder %d): %s", intruder, sg_last_error());
  if (ok) {
    pthread_t ta, tr, tb;
    if (!intruder) atomic_store(&s->b_done, 1);
    pthread_create(&ta, NULL, thread_a, s);
    pthread_create(&tr, NULL, rank1, s);
    if (intruder) pthread_create(&tb, NULL, thread_b, s);
    pthread_join(ta, NULL);
    pthread_join(tr, NULL);
    if (intruder) pthread_join(tb, NULL);
    ok = s->a_st == SG_OK && s->r1_st == SG_OK;
    CHECK(ok, "step 1 on both ranks (intruder %d): %s / %s", intruder,
          sg_status_string(s->a_st), sg_status_string(s->r1_st));
  }
  size_t off = 0;
  for (int r = 0; r < 2 && ok; r++)
    for (int p = 0; p < NPAR; p++) {
      ok &= sg_get_param(s->e[r], s->ids[r][p], out + off, SG_F32) == SG_OK;
      off += k_sizes[p];
    }
  if (ok) {
    both(nested_rank, s, a);
    CHECK(a[0].st == SG_OK && a[1].st == SG_OK,
          "nested public calls on one thread (sg_import, sg_get_master) still work: %s",
          sg_last_error());
  }
  for (int r = 0; r < 2; r++) sg_engine_destroy(s->e[r]);
  for (int r = 0; r < 2; r++) sg_comm_destroy(s->comm[r]);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->tmpdir);
  if (system(cmd) != 0) printf("could not remove %s\n", s->tmpdir);
  return ok;
}

int main(void) {
  size_t total = 0;
  for (int p = 0; p < NPAR; p++) total += k_sizes[p];
  float *want = calloc(2 * total, sizeof *want), *got = calloc(2 * total, sizeof *got);
  shared *s = calloc(1, sizeof *s);
  const int ok_ref = run(0, s, want);
  CHECK(ok_ref, "the run without an intruder");
  const int ok = run(1, s, got);
  CHECK(s->first_msg[0] != 0, "a second thread is refused while sg_step runs on another");
  CHECK(strstr(s->first_msg, "sg_get_lr") && strstr(s->first_msg, "another thread is inside "
                                                                   "sg_step"),
        "its message names both calls: \"%s\"", s->first_msg);
  CHECK(s->calls > 30 && s->refused == s->calls && s->unexpected == 0,
        "every public engine function is refused meanwhile (%d of %d; %d other statuses)",
        s->refused, s->calls, s->unexpected);
  CHECK(ok && memcmp(got, want, 2 * total * sizeof *got) == 0,
        "the engines end bitwise where they would have without the intruder (destroy from the "
        "intruder left the engine alone)");
  free(want);
  free(got);
  free(s);
  return sg_test_summary("");
}
