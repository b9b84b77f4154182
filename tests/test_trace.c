/* Tracing (sg_trace_*): what the events say must follow from how the engine orders its work,
 * whatever the timing:
 *  - counts: one GRAD_READY per parameter and micro-batch, one REDUCE per bucket and synced
 *    micro-batch with bucket ids 0..nb-1 in order, one STEP per step, one GATHER per bucket and
 *    step (ids nb-1..0) when the parameters are sharded over W > 1 ranks, one WAIT per step at
 *    its end, or with overlap_param_gather one per bucket where the next forward pass calls
 *    sg_param_wait, every sg_trace_mark;
 *  - causality: a bucket's REDUCE starts after the GRAD_READY that completed it (the reduction is
 *    launched by it), a STEP starts after every REDUCE of its step ended, a GATHER starts after
 *    its STEP started and after the GATHER before it ended, the last one after the STEP ended, a
 *    WAIT ends after the GATHER it waited for, and a mark made after sg_param_wait comes after
 *    every GATHER before it; spans end after they start; the step field counts the steps before;
 *  - bounded: past max_events events are dropped and counted; cap < count copies cap;
 *  - the Chrome trace file holds every event and is well formed; SG_TRACE writes one per rank;
 *  - misuse returns the documented statuses.
 * Runs ranks as threads with the local communicator. SG_TEST_DEVICE=cuda runs the engines on
 * the CUDA device (the gradients are never written, so no copies are needed): with the mock
 * CUDA runtime in CI, on a GPU in tests/gpu/run.sh. How much of the reductions the backward
 * pass hid is timing, not checked here: the examples' --trace summary prints it. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"

#define NPARAM 16
#define NUMEL 30000
#define MAXEV 4096

static sg_device g_device = SG_DEVICE_CPU;
static char g_dir[256];

typedef struct {
  sg_comm *comm;
  sg_strategy strategy;
  int mb, steps, nosync_first, overlap;
  double spin_us; /* simulated backward work before each gradient */
  sg_trace_event *ev;
  size_t nev;
  char err[512];
  int ok;
} rank_arg;

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static void spin(double us) {
  const double t0 = now_us();
  volatile double x = 0;
  while (now_us() - t0 < us) x += 1.0;
}

static sg_status make_engine(sg_comm *comm, sg_strategy strategy, int overlap, sg_engine **out) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = strategy;
  cfg.device = g_device;
  cfg.cuda_device = 0;
  cfg.bucket_bytes = 256u * 1024u;
  cfg.timeout_ms = 60000;
  cfg.overlap_param_gather = overlap;
  if ((st = sg_engine_create(comm, &cfg, out))) return st;
  for (int p = 0; p < NPARAM && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d.weight", p);
    int id;
    st = sg_add_param(*out, name, NUMEL, 0, &id);
  }
  return st ? st : sg_finalize(*out);
}

/* The next forward pass with overlap_param_gather: waits for each parameter in registration
 * order, then a "forward" mark. */
static sg_status forward_waits(sg_engine *e, const rank_arg *a) {
  sg_status st = SG_OK;
  for (int p = 0; p < NPARAM && !st; p++) {
    st = sg_param_wait(e, p);
    if (!st) spin(a->spin_us);
  }
  return st ? st : sg_trace_mark(e, "forward");
}

/* One step: micro-batches of gradients in backward order, each opened by a "backward" mark. */
static sg_status train(sg_engine *e, const rank_arg *a) {
  sg_status st = SG_OK;
  for (int s = 0; s < a->steps && !st; s++) {
    if (a->overlap && s > 0 && (st = forward_waits(e, a))) break;
    for (int k = 0; k < a->mb && !st; k++) {
      if (a->nosync_first && (st = sg_set_sync(e, k == a->mb - 1))) break;
      if ((st = sg_trace_mark(e, "backward"))) break;
      for (int p = NPARAM - 1; p >= 0 && !st; p--) {
        spin(a->spin_us);
        st = sg_grad_ready(e, p);
      }
    }
    if (!st) st = sg_step(e, NULL);
  }
  return st;
}

static void *rank_main(void *p) {
  rank_arg *a = p;
  sg_engine *e = NULL;
  size_t n = 0;
  uint64_t dropped = 0;
  sg_status st = make_engine(a->comm, a->strategy, a->overlap, &e);
  if (!st) st = sg_trace_start(e, MAXEV);
  if (!st) st = train(e, a);
  if (!st) st = sg_trace_stop(e);
  if (!st) st = sg_trace_events(e, a->ev, MAXEV, &n, &dropped);
  if (!st && dropped) st = SG_ERR_INTERNAL;
  if (!st && g_dir[0]) {
    char path[512];
    snprintf(path, sizeof path, "%s/run-%%r.json", g_dir);
    st = sg_trace_write(e, path);
  }
  a->nev = n;
  a->ok = st == SG_OK;
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  return NULL;
}

/* ---------------------------------------------------------------------------------------- */

static int count_kind(const sg_trace_event *ev, size_t n, int kind) {
  int c = 0;
  for (size_t i = 0; i < n; i++) c += ev[i].kind == kind;
  return c;
}

/* REDUCE ids of each synced micro-batch run 0..nb-1; returns nb (-1 when they do not). */
static int check_bucket_order(const sg_trace_event *ev, size_t n) {
  int nb = -1, next = 0;
  for (size_t i = 0; i < n; i++) {
    if (ev[i].kind != SG_TRACE_REDUCE) continue;
    if (ev[i].id == 0 && next > 0) {
      if (nb >= 0 && nb != next) return -1;
      nb = next;
      next = 0;
    }
    if (ev[i].id != next++) return -1;
  }
  if (nb >= 0 && nb != next) return -1;
  return nb < 0 ? next : nb;
}

/* GATHER ids of each step run nb-1..0; returns the number of steps with gathers (-1: wrong). */
static int check_gather_order(const sg_trace_event *ev, size_t n, int nb) {
  int next = -1, steps = 0;
  for (size_t i = 0; i < n; i++) {
    if (ev[i].kind != SG_TRACE_GATHER) continue;
    if (next < 0) {
      next = nb - 1;
      steps++;
    }
    if (ev[i].id != next--) return -1;
  }
  return next < 0 ? steps : -1;
}

static void check_causality(const char *tag, const sg_trace_event *ev, size_t n) {
  double last_ready = -1, last_reduce_end = -1, step_start = -1, step_end = -1, gather_end = -1;
  double gather_end_of[64];
  for (int b = 0; b < 64; b++) gather_end_of[b] = -1;
  int bad_ready = 0, bad_step = 0, bad_gather = 0, bad_span = 0, bad_origin = 0, bad_wait = 0;
  for (size_t i = 0; i < n; i++) {
    const sg_trace_event *x = &ev[i];
    bad_span += x->end_us < x->start_us;
    bad_origin += x->start_us < 0;
    switch (x->kind) {
      case SG_TRACE_GRAD_READY: last_ready = x->start_us; break;
      case SG_TRACE_REDUCE:
        bad_ready += x->start_us < last_ready;
        if (x->end_us > last_reduce_end) last_reduce_end = x->end_us;
        break;
      case SG_TRACE_STEP:
        bad_step += x->start_us < last_reduce_end;
        step_start = x->start_us;
        step_end = x->end_us;
        break;
      case SG_TRACE_GATHER:
        bad_gather += x->start_us < step_start || x->start_us < gather_end ||
                      (x->id == 0 && x->start_us < step_end) || x->id < 0 || x->id >= 64;
        gather_end = x->end_us;
        if (x->id >= 0 && x->id < 64) gather_end_of[x->id] = x->end_us;
        break;
      case SG_TRACE_WAIT:
        bad_wait += x->id < 0 || x->id >= 64 || x->end_us < gather_end_of[x->id];
        break;
      case SG_TRACE_MARK:
        bad_wait += !strcmp(x->label, "forward") && x->start_us < gather_end;
        break;
    }
  }
  CHECK(bad_span == 0, "%s: %d spans end before they start", tag, bad_span);
  CHECK(bad_origin == 0, "%s: %d events before sg_trace_start", tag, bad_origin);
  CHECK(bad_ready == 0, "%s: %d reductions start before the gradient that launched them", tag,
        bad_ready);
  CHECK(bad_step == 0, "%s: %d steps start before their reductions ended", tag, bad_step);
  CHECK(bad_gather == 0, "%s: %d all-gathers start before their step, or before the one before "
        "them ended", tag, bad_gather);
  CHECK(bad_wait == 0, "%s: %d waits (or marks after sg_param_wait) end before their all-gather",
        tag, bad_wait);
}

static void check_steps(const char *tag, const sg_trace_event *ev, size_t n) {
  uint64_t s = 0;
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    bad += ev[i].step != s;
    if (ev[i].kind == SG_TRACE_STEP) s++;
  }
  CHECK(bad == 0, "%s: %d events carry the wrong step number", tag, bad);
}

static char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = malloc((size_t)n + 1);
  if (b && fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
  if (b) b[n] = '\0';
  fclose(f);
  *len = (size_t)n;
  return b;
}

static int count_str(const char *s, const char *needle) {
  int c = 0;
  for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) c++;
  return c;
}

/* The file holds one entry per event (spans "X", instants "i") and is closed properly. */
static void check_json(const char *tag, const char *path, const sg_trace_event *ev, size_t n) {
  size_t len = 0;
  char *s = slurp(path, &len);
  if (!CHECK(s && len > 0, "%s: trace file %s readable", tag, path)) {
    free(s);
    return;
  }
  int spans = 0;
  for (size_t i = 0; i < n; i++)
    spans += ev[i].kind != SG_TRACE_GRAD_READY && ev[i].kind != SG_TRACE_MARK;
  CHECK(count_str(s, "\"ph\":\"X\"") == spans, "%s: %d span entries in %s, expected %d", tag,
        count_str(s, "\"ph\":\"X\""), path, spans);
  CHECK(count_str(s, "\"ph\":\"i\"") == (int)n - spans, "%s: %d instants in %s, expected %d",
        tag, count_str(s, "\"ph\":\"i\""), path, (int)n - spans);
  CHECK(s[0] == '{' && strstr(s, "\"traceEvents\":[") && len >= 4 && !strcmp(s + len - 4, "\n]}\n"),
        "%s: %s is a JSON object with traceEvents", tag, path);
  free(s);
}

/* ---------------------------------------------------------------------------------------- */

static void run_case(int w, sg_strategy strategy, int mb, int nosync_first, int overlap,
                     double spin_us) {
  char tag[96];
  snprintf(tag, sizeof tag, "W=%d %s mb=%d%s%s", w,
           strategy == SG_NO_SHARD ? "NO_SHARD" : strategy == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP",
           mb, nosync_first ? " no_sync" : "", overlap ? " overlap" : "");
  const int steps = 3;
  sg_comm *comms[4];
  if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "%s: comm", tag)) return;
  rank_arg a[4];
  pthread_t th[4];
  for (int r = 0; r < w; r++) {
    a[r] = (rank_arg){comms[r], strategy, mb, steps, nosync_first, overlap, spin_us, NULL, 0, "", 0};
    a[r].ev = calloc(MAXEV, sizeof *a[r].ev);
    pthread_create(&th[r], NULL, rank_main, &a[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) {
    char rt[128];
    snprintf(rt, sizeof rt, "%s rank %d", tag, r);
    if (CHECK(a[r].ok, "%s: run: %s", rt, a[r].err)) {
      const sg_trace_event *ev = a[r].ev;
      const size_t n = a[r].nev;
      const int synced = nosync_first ? 1 : mb;
      const int nb = check_bucket_order(ev, n);
      CHECK(nb >= 2, "%s: reductions in bucket order 0..nb-1 per micro-batch (nb %d)", rt, nb);
      CHECK(count_kind(ev, n, SG_TRACE_REDUCE) == nb * synced * steps, "%s: %d reductions, "
            "expected %d", rt, count_kind(ev, n, SG_TRACE_REDUCE), nb * synced * steps);
      CHECK(count_kind(ev, n, SG_TRACE_GRAD_READY) == NPARAM * mb * steps, "%s: %d GRAD_READY",
            rt, count_kind(ev, n, SG_TRACE_GRAD_READY));
      CHECK(count_kind(ev, n, SG_TRACE_MARK) == mb * steps + (overlap ? steps - 1 : 0),
            "%s: marks", rt);
      CHECK(count_kind(ev, n, SG_TRACE_STEP) == steps, "%s: steps", rt);
      const int gsteps = (strategy != SG_NO_SHARD && w > 1) ? steps : 0;
      CHECK(count_kind(ev, n, SG_TRACE_GATHER) == nb * gsteps, "%s: %d all-gathers, expected %d",
            rt, count_kind(ev, n, SG_TRACE_GATHER), nb * gsteps);
      CHECK(check_gather_order(ev, n, nb) == gsteps, "%s: all-gathers in bucket order nb-1..0 "
            "per step", rt);
      const int waits = !gsteps ? 0 : overlap ? nb * (steps - 1) : steps;
      CHECK(count_kind(ev, n, SG_TRACE_WAIT) == waits, "%s: %d waits for all-gathers, expected %d",
            rt, count_kind(ev, n, SG_TRACE_WAIT), waits);
      int labels = 1;
      for (size_t i = 0; i < n; i++)
        if (ev[i].kind == SG_TRACE_GRAD_READY) {
          char want[48];
          snprintf(want, sizeof want, "layer%d.weight", ev[i].id);
          labels &= strcmp(ev[i].label, want) == 0;
        } else if (ev[i].kind == SG_TRACE_MARK) {
          labels &= !strcmp(ev[i].label, "backward") || (overlap && !strcmp(ev[i].label, "forward"));
        }
      CHECK(labels, "%s: labels name the parameter / the mark", rt);
      check_causality(rt, ev, n);
      check_steps(rt, ev, n);
      if (g_dir[0]) {
        char path[512];
        snprintf(path, sizeof path, "%s/run-%d.json", g_dir, r);
        check_json(rt, path, ev, n);
        unlink(path);
      }
    }
    free(a[r].ev);
    sg_comm_destroy(comms[r]);
  }
}

/* Bounded recording, partial copies, restart, misuse. */
static void run_limits(void) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK, "limits: comm")) return;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.device = g_device;
  cfg.cuda_device = 0;
  CHECK(sg_engine_create(c, &cfg, &e) == SG_OK, "limits: engine");
  int id;
  CHECK(sg_add_param(e, "w", 1000, 0, &id) == SG_OK, "limits: add");
  CHECK(sg_trace_start(e, 0) == SG_ERR_INVALID_STATE, "sg_trace_start before sg_finalize");
  CHECK(sg_finalize(e) == SG_OK, "limits: finalize");
  size_t n = 99;
  uint64_t dropped = 99;
  sg_trace_event ev[8];
  CHECK(sg_trace_start(NULL, 0) == SG_ERR_INVALID_ARGUMENT &&
            sg_trace_stop(NULL) == SG_ERR_INVALID_ARGUMENT &&
            sg_trace_mark(NULL, "x") == SG_ERR_INVALID_ARGUMENT &&
            sg_trace_events(NULL, ev, 8, &n, NULL) == SG_ERR_INVALID_ARGUMENT &&
            sg_trace_write(NULL, "/tmp/x.json") == SG_ERR_INVALID_ARGUMENT,
        "every sg_trace_* refuses a NULL engine");
  CHECK(sg_trace_events(e, ev, 8, &n, NULL) == SG_ERR_INVALID_STATE, "events before any start");
  CHECK(sg_trace_write(e, "/tmp/x.json") == SG_ERR_INVALID_STATE, "write before any start");
  CHECK(sg_trace_stop(e) == SG_ERR_INVALID_STATE, "stop while not recording");
  CHECK(sg_trace_mark(e, "x") == SG_ERR_INVALID_STATE, "mark while not recording");
  CHECK(sg_trace_start(e, 4194305) == SG_ERR_INVALID_ARGUMENT, "max_events too large");
  CHECK(sg_trace_start(e, 5) == SG_OK, "start with room for 5: %s", sg_last_error());
  CHECK(sg_trace_start(e, 5) == SG_ERR_INVALID_STATE, "start twice");
  CHECK(sg_trace_mark(e, NULL) == SG_ERR_INVALID_ARGUMENT, "mark(NULL)");
  for (int s = 0; s < 3; s++) {
    sg_grad_ready(e, id);
    sg_step(e, NULL); /* 3 events per step: GRAD_READY, REDUCE, STEP */
  }
  CHECK(sg_trace_events(e, NULL, 0, &n, &dropped) == SG_OK && n == 5 && dropped == 4,
        "9 events into room for 5: %zu recorded, %llu dropped", n, (unsigned long long)dropped);
  CHECK(sg_trace_events(e, ev, 2, &n, NULL) == SG_OK && n == 5 &&
            ev[0].kind == SG_TRACE_GRAD_READY && ev[1].kind == SG_TRACE_REDUCE,
        "cap 2 of 5: two copied, count 5");
  CHECK(sg_trace_events(e, NULL, 2, &n, NULL) == SG_ERR_INVALID_ARGUMENT, "out NULL with cap");
  CHECK(sg_trace_events(e, ev, 2, NULL, NULL) == SG_ERR_INVALID_ARGUMENT, "count NULL");
  CHECK(sg_trace_write(e, NULL) == SG_ERR_INVALID_ARGUMENT, "write(NULL)");
  CHECK(sg_trace_write(e, "/nonexistent-dir/t.json") == SG_ERR_IO, "write to a missing dir");
  CHECK(sg_trace_stop(e) == SG_OK, "stop");
  CHECK(sg_trace_events(e, ev, 8, &n, NULL) == SG_OK && n == 5, "events stay after stop");
  sg_grad_ready(e, id);
  sg_step(e, NULL);
  CHECK(sg_trace_events(e, ev, 8, &n, NULL) == SG_OK && n == 5, "nothing recorded after stop");
  CHECK(sg_trace_start(e, 8) == SG_OK && sg_trace_events(e, ev, 8, &n, &dropped) == SG_OK &&
            n == 0 && dropped == 0, "restart clears");
  CHECK(sg_trace_mark(e, "a label longer than the forty-seven bytes an event label holds") ==
            SG_OK && sg_trace_events(e, ev, 8, &n, NULL) == SG_OK && n == 1 &&
            strlen(ev[0].label) == 47 && ev[0].kind == SG_TRACE_MARK && ev[0].id == -1,
        "long labels are truncated");
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

/* SG_TRACE=dir/env-%r.json: tracing from sg_finalize on, one file per rank at destroy. */
static void run_env(void) {
  char pattern[512];
  snprintf(pattern, sizeof pattern, "%s/env-%%r.json", g_dir);
  setenv("SG_TRACE", pattern, 1);
  sg_comm *comms[2];
  if (!CHECK(sg_comm_create_local(2, comms) == SG_OK, "env: comm")) return;
  rank_arg a[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    a[r] = (rank_arg){comms[r], SG_SHARD_GRAD_OP, 1, 2, 0, 0, 0, NULL, 0, "", 0};
    pthread_create(&th[r], NULL, rank_main, &a[r]);
  }
  /* rank_main starts its own trace: with SG_TRACE set one is already running */
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  unsetenv("SG_TRACE");
  for (int r = 0; r < 2; r++) {
    CHECK(!a[r].ok && strstr(a[r].err, "already recording"),
          "SG_TRACE: recording from sg_finalize (sg_trace_start says so: %s)", a[r].err);
    char path[512];
    snprintf(path, sizeof path, "%s/env-%d.json", g_dir, r);
    size_t len = 0;
    char *s = slurp(path, &len);
    CHECK(s && strstr(s, "\"traceEvents\":[") && count_str(s, "\"otherData\"") == 1 &&
              len >= 4 && !strcmp(s + len - 4, "\n]}\n"),
          "SG_TRACE wrote %s at sg_engine_destroy", path);
    free(s);
    unlink(path);
    sg_comm_destroy(comms[r]);
  }
}

int main(int argc, char **argv) {
  const char *dev = getenv("SG_TEST_DEVICE");
  if (dev && !strcmp(dev, "cuda")) g_device = SG_DEVICE_CUDA;
  snprintf(g_dir, sizeof g_dir, "%s/sg_trace_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(g_dir)) g_dir[0] = '\0';
  CHECK(g_dir[0] != '\0', "temporary directory");
  const double spin = g_device == SG_DEVICE_CPU ? 100.0 : 0.0;
  run_case(1, SG_SHARD_GRAD_OP, 1, 0, 0, spin);
  run_case(2, SG_SHARD_GRAD_OP, 2, 0, 0, spin);
  run_case(2, SG_NO_SHARD, 1, 0, 0, spin);
  run_case(3, SG_SHARD_OPT, 3, 1, 0, spin);
  run_case(4, SG_SHARD_GRAD_OP, 1, 0, 0, spin);
  run_case(2, SG_SHARD_GRAD_OP, 2, 0, 1, spin);
  run_case(3, SG_SHARD_OPT, 1, 0, 1, spin);
  run_case(2, SG_NO_SHARD, 1, 0, 1, spin);
  run_case(1, SG_SHARD_GRAD_OP, 1, 0, 1, spin);
  run_limits();
  if (g_dir[0]) {
    run_env();
    rmdir(g_dir);
  }
  return sg_test_summary("");
}
