/* The comm job queue of the devices (sg_jobq.h). */
#define _POSIX_C_SOURCE 200809L /* pthread_condattr_setclock, CLOCK_MONOTONIC */

#include "sg_jobq.h"

#include <errno.h>     /* ETIMEDOUT, EAGAIN */
#include <stdatomic.h> /* the test hook's counter */
#include <stdio.h>     /* snprintf */
#include <stdlib.h>    /* malloc, free */
#include <string.h>    /* memcpy, strlen, strerror_r */
#include <time.h>   /* struct timespec */

/* The queue whose job the calling thread is running (worker or inline); NULL outside jobs. */
static _Thread_local const sg__jobq *sg__jobq_cur;

int sg__jobq_init(sg__jobq *q, const sg__jobq_ops *ops, void *ctx, int threaded) {
  memset(q, 0, sizeof *q);
  q->ops = ops;
  q->ctx = ctx;
  q->threaded = threaded != 0;
  q->failed = SG_OK;
  pthread_condattr_t attr;
  int rc = pthread_condattr_init(&attr);
  if (rc != 0) return rc;
  int step = 0;
  if ((rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)) == 0 &&
      (rc = pthread_mutex_init(&q->mu, NULL)) == 0 && ++step &&
      (rc = pthread_cond_init(&q->job_cv, NULL)) == 0 && ++step &&
      (rc = pthread_cond_init(&q->done_cv, &attr)) == 0)
    ++step;
  pthread_condattr_destroy(&attr);
  if (rc == 0) return 0;
  if (step >= 2) pthread_cond_destroy(&q->job_cv);
  if (step >= 1) pthread_mutex_destroy(&q->mu);
  return rc;
}

/* Keeps the first failure; lock held. */
static void fail_locked(sg__jobq *q, sg_status st, const char *text) {
  if (q->failed != SG_OK || st == SG_OK) return;
  q->failed = st;
  size_t n = text ? strlen(text) : 0;
  if (n >= sizeof q->fail_text) n = sizeof q->fail_text - 1;
  if (n) memcpy(q->fail_text, text, n);
  q->fail_text[n] = '\0';
}

sg_status sg__jobq_fail(sg__jobq *q, sg_status st, const char *text) {
  pthread_mutex_lock(&q->mu);
  fail_locked(q, st, text ? text : sg_last_error());
  pthread_mutex_unlock(&q->mu);
  return st;
}

static sg_status failed_locked(const sg__jobq *q) {
  if (q->failed == SG_OK) return SG_OK;
  return sg__err(q->failed, "%s", q->fail_text);
}

sg_status sg__jobq_failed(sg__jobq *q) {
  pthread_mutex_lock(&q->mu);
  const sg_status st = failed_locked(q);
  pthread_mutex_unlock(&q->mu);
  return st;
}

/* Runs one job on this thread. The failure's text is read here: sg_last_error() is
 * thread-local. */
static sg_status run_one(sg__jobq *q, sg__jobq_fn fn, void *arg, uint64_t ticket, char *text) {
  const sg__jobq *outer = sg__jobq_cur;
  sg__jobq_cur = q;
  const sg_status st = q->ops && q->ops->run ? q->ops->run(q->ctx, fn, arg, ticket) : fn(arg);
  sg__jobq_cur = outer;
  text[0] = '\0';
  if (st != SG_OK) {
    const char *e = sg_last_error();
    size_t n = e ? strlen(e) : 0;
    if (n >= SG__JOBQ_TEXT) n = SG__JOBQ_TEXT - 1;
    if (n) memcpy(text, e, n);
    text[n] = '\0';
  }
  return st;
}

/* Marks job t done (tickets complete in order); lock held. */
static void complete_locked(sg__jobq *q, uint64_t t, sg_status st, const char *text) {
  if (st != SG_OK) fail_locked(q, st, text);
  if (t > q->completed) q->completed = t;
  pthread_cond_broadcast(&q->done_cv);
}

static void *worker_main(void *p) {
  sg__jobq *q = (sg__jobq *)p;
  char *text = malloc(SG__JOBQ_TEXT);
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head && !q->stopping) pthread_cond_wait(&q->job_cv, &q->mu);
    sg__jobq_item *j = q->head;
    if (!j) break; /* stopping and drained */
    q->head = j->next;
    if (!q->head) q->tail = NULL;
    const int skip = q->failed != SG_OK || !text;
    pthread_mutex_unlock(&q->mu);
    sg_status st = skip ? SG_OK : run_one(q, j->fn, j->arg, j->ticket, text);
    if (j->drop) j->drop(j->arg);
    pthread_mutex_lock(&q->mu);
    if (!text) fail_locked(q, SG_ERR_OUT_OF_MEMORY, "comm worker: no memory for its error text");
    complete_locked(q, j->ticket, st, text);
    free(j);
  }
  pthread_mutex_unlock(&q->mu);
  free(text);
  return NULL;
}

void sg__jobq_stop(sg__jobq *q) {
  pthread_mutex_lock(&q->mu);
  const int started = q->worker_started;
  q->stopping = 1;
  pthread_cond_broadcast(&q->job_cv);
  pthread_mutex_unlock(&q->mu);
  if (started) pthread_join(q->worker, NULL);
  pthread_mutex_lock(&q->mu);
  q->worker_started = 0;
  q->stopping = 0;
  q->threaded = 0;
  pthread_mutex_unlock(&q->mu);
}

void sg__jobq_destroy(sg__jobq *q) {
  sg__jobq_stop(q);
  pthread_cond_destroy(&q->done_cv);
  pthread_cond_destroy(&q->job_cv);
  pthread_mutex_destroy(&q->mu);
}

/* Absolute CLOCK_MONOTONIC time of a deadline in sg__now_ms() milliseconds. */
static struct timespec deadline_ts(int64_t deadline_ms) {
  if (deadline_ms < 0) deadline_ms = 0;
  struct timespec ts = {(time_t)(deadline_ms / 1000), (long)(deadline_ms % 1000) * 1000000L};
  return ts;
}

/* Waits (lock held) until job t completed or the deadline passed. */
static sg_status wait_locked(sg__jobq *q, uint64_t t, int64_t deadline_ms, const char *fn) {
  const struct timespec ts = deadline_ts(deadline_ms);
  while (q->completed < t) {
    if (deadline_ms == INT64_MAX) {
      pthread_cond_wait(&q->done_cv, &q->mu);
    } else if (pthread_cond_timedwait(&q->done_cv, &q->mu, &ts) == ETIMEDOUT &&
               q->completed < t) {
      return sg__err(SG_ERR_TIMEOUT,
                     "%s: comm job %llu not finished by the deadline (%llu of %llu jobs done; a "
                     "collective may be stuck on another rank)",
                     fn, (unsigned long long)t, (unsigned long long)q->completed,
                     (unsigned long long)q->submitted);
    }
  }
  return SG_OK;
}

void sg__jobq_set_threaded(sg__jobq *q, int threaded) {
  pthread_mutex_lock(&q->mu);
  if (!threaded && q->completed < q->submitted && sg__jobq_cur != q)
    (void)wait_locked(q, q->submitted, INT64_MAX, "sg__jobq_set_threaded");
  q->threaded = threaded != 0;
  q->start_failed = 0;
  pthread_mutex_unlock(&q->mu);
}

/* Test hook (sg__jobq_fail_start_after): starts left before one fails; -1: none. */
static atomic_int g_fail_start_left = -1;

void sg__jobq_fail_start_after(int n) { atomic_store(&g_fail_start_left, n < 0 ? -1 : n); }

static int create_worker(sg__jobq *q) {
  int left = atomic_load(&g_fail_start_left);
  while (left >= 0)
    if (atomic_compare_exchange_weak(&g_fail_start_left, &left, left - 1)) {
      if (left == 0) return EAGAIN;
      break;
    }
  return pthread_create(&q->worker, NULL, worker_main, q);
}

/* Starts the worker if it is not running; lock held. A thread that cannot start is the
 * process's thread or address-space limit (EAGAIN; ulimit -u, -v) or memory: out of memory,
 * not a bug. */
static sg_status start_worker_locked(sg__jobq *q, const char *fn) {
  if (q->worker_started) return SG_OK;
  const int rc = create_worker(q);
  if (rc != 0) {
    char why[128];
    if (strerror_r(rc, why, sizeof why) != 0) snprintf(why, sizeof why, "errno %d", rc);
    return sg__err_at(SG_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                      "%s: cannot start the comm worker thread: %s (the process's limit on "
                      "threads or address space, ulimit -u / -v, or memory)",
                      fn, why);
  }
  q->worker_started = 1;
  return SG_OK;
}

sg_status sg__jobq_start(sg__jobq *q, const char *fn) {
  pthread_mutex_lock(&q->mu);
  if (q->start_failed) q->threaded = 1; /* the mode asked for before the last failure */
  sg_status st = q->threaded ? start_worker_locked(q, fn) : SG_OK;
  q->start_failed = st != SG_OK;
  /* nothing can be queued on a worker that never started: inline from here on is safe */
  if (st != SG_OK) q->threaded = 0;
  pthread_mutex_unlock(&q->mu);
  return st;
}

static sg_status submit_inline(sg__jobq *q, sg__jobq_fn fn, void (*drop)(void *), void *arg,
                               uint64_t *ticket) {
  const uint64_t t = q->submitted + 1;
  sg_status st = q->ops && q->ops->mark ? q->ops->mark(q->ctx, t, 0) : SG_OK;
  if (st == SG_OK) q->submitted = t;
  pthread_mutex_unlock(&q->mu);
  if (st != SG_OK) {
    if (drop) drop(arg);
    return st;
  }
  *ticket = t;
  char text[SG__JOBQ_TEXT];
  st = run_one(q, fn, arg, t, text);
  if (drop) drop(arg);
  pthread_mutex_lock(&q->mu);
  complete_locked(q, t, st, text);
  st = st == SG_OK ? SG_OK : failed_locked(q);
  pthread_mutex_unlock(&q->mu);
  return st;
}

static sg_status submit_worker(sg__jobq *q, sg__jobq_item *j, uint64_t *ticket) {
  const uint64_t t = q->submitted + 1;
  sg_status st = start_worker_locked(q, "comm_submit");
  if (st == SG_OK && q->ops && q->ops->mark) st = q->ops->mark(q->ctx, t, 1);
  if (st == SG_OK) {
    j->ticket = q->submitted = t;
    if (q->tail)
      q->tail->next = j;
    else
      q->head = j;
    q->tail = j;
    *ticket = t;
    pthread_cond_signal(&q->job_cv);
  }
  pthread_mutex_unlock(&q->mu);
  if (st != SG_OK) {
    if (j->drop) j->drop(j->arg);
    free(j);
  }
  return st;
}

sg_status sg__jobq_submit(sg__jobq *q, sg__jobq_fn fn, void (*drop)(void *), void *arg,
                          uint64_t *ticket) {
  *ticket = 0;
  sg__jobq_item *j = NULL;
  pthread_mutex_lock(&q->mu);
  sg_status st = failed_locked(q);
  if (st == SG_OK && q->threaded && !(j = calloc(1, sizeof *j)))
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "comm_submit: no memory for a job");
  if (st != SG_OK) {
    pthread_mutex_unlock(&q->mu);
    if (drop) drop(arg);
    return st;
  }
  if (!j) return submit_inline(q, fn, drop, arg, ticket);
  j->fn = fn;
  j->drop = drop;
  j->arg = arg;
  return submit_worker(q, j, ticket);
}

sg_status sg__jobq_wait(sg__jobq *q, uint64_t ticket, int64_t deadline_ms, const char *fn) {
  pthread_mutex_lock(&q->mu);
  sg_status st = SG_OK;
  if (ticket > q->submitted)
    st = sg__err(SG_ERR_INVALID_ARGUMENT, "%s: ticket %llu was never issued (last %llu)", fn,
                 (unsigned long long)ticket, (unsigned long long)q->submitted);
  else if (q->completed < ticket && sg__jobq_cur == q)
    st = sg__err(SG_ERR_INVALID_STATE, "%s: called from inside a comm job (deadlock)", fn);
  if (st == SG_OK) st = wait_locked(q, ticket, deadline_ms, fn);
  if (st == SG_OK) st = failed_locked(q);
  pthread_mutex_unlock(&q->mu);
  return st;
}

sg_status sg__jobq_wait_all(sg__jobq *q, int64_t deadline_ms, const char *fn) {
  if (sg__jobq_cur == q) return SG_OK; /* inside a job: the earlier ones are done */
  pthread_mutex_lock(&q->mu);
  const sg_status st = wait_locked(q, q->submitted, deadline_ms, fn);
  pthread_mutex_unlock(&q->mu);
  return st;
}

int sg__jobq_in_job(const sg__jobq *q) { return sg__jobq_cur == q; }

uint64_t sg__jobq_last(sg__jobq *q) {
  pthread_mutex_lock(&q->mu);
  const uint64_t t = q->submitted;
  pthread_mutex_unlock(&q->mu);
  return t;
}

uint64_t sg__jobq_done(sg__jobq *q) {
  pthread_mutex_lock(&q->mu);
  const uint64_t t = q->completed;
  pthread_mutex_unlock(&q->mu);
  return t;
}
