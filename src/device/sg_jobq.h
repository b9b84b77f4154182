/* The comm job queue shared by the CPU and CUDA devices (DESIGN.md section 4): jobs run one at
 * a time in submit (FIFO) order, on a worker thread of the queue (threaded) or inline in
 * sg__jobq_submit; tickets 1, 2, 3... name them; the first failure is kept with its text, the
 * jobs after it are skipped (their tickets still complete) and every later wait returns it;
 * every host wait has a deadline.
 *
 * A device customises two steps (sg__jobq_ops): `mark`, called on the submitting thread with
 * the queue lock held once the ticket is known and before a worker can see the job (CUDA
 * records the job's input event there), and `run`, which wraps the job on the thread that runs
 * it (CUDA waits for that event, runs the job, waits for the comm stream). NULL ops: run the
 * job as it is.
 *
 * Ownership. A job's `drop(arg)` (when not NULL) is called exactly once for every submitted job:
 * after it ran, instead of running it when it is skipped, and when the submit itself fails. */
#ifndef SG_JOBQ_H
#define SG_JOBQ_H

#include <pthread.h> /* pthread_t, mutex, condition variables */
#include <stdint.h>  /* uint64_t */

#include "../core/sg_core.h" /* sg_status */

#define SG__JOBQ_TEXT 1024

typedef sg_status (*sg__jobq_fn)(void *arg);

typedef struct sg__jobq_ops {
  /* Submitting thread, queue lock held: job `ticket` is about to be queued (worker = 1) or run
   * inline (worker = 0). A failure aborts the submit. */
  sg_status (*mark)(void *ctx, uint64_t ticket, int worker);
  /* Runs fn(arg) for job `ticket` with whatever the device must do around it. */
  sg_status (*run)(void *ctx, sg__jobq_fn fn, void *arg, uint64_t ticket);
} sg__jobq_ops;

typedef struct sg__jobq_item {
  sg__jobq_fn fn;
  void (*drop)(void *arg);
  void *arg;
  uint64_t ticket;
  struct sg__jobq_item *next;
} sg__jobq_item;

typedef struct sg__jobq {
  pthread_mutex_t mu;
  pthread_cond_t job_cv;  /* worker: a job arrived or stop was asked */
  pthread_cond_t done_cv; /* waiters: a job completed (CLOCK_MONOTONIC, like the deadlines) */
  const sg__jobq_ops *ops;
  void *ctx;
  const char *name; /* error prefix, e.g. "comm_wait" callers' device name */
  int threaded;     /* 1: jobs go to the worker (started by the first one) */
  pthread_t worker;
  int worker_started, stopping;
  int start_failed; /* sg__jobq_start could not start the worker: inline until it can */
  sg__jobq_item *head, *tail;
  uint64_t submitted, completed; /* job t is done when completed >= t */
  sg_status failed;              /* first failure; SG_OK while healthy */
  char fail_text[SG__JOBQ_TEXT];
} sg__jobq;

/* 0 or an errno value. threaded: the initial mode (sg__jobq_set_threaded changes it). */
int sg__jobq_init(sg__jobq *q, const sg__jobq_ops *ops, void *ctx, int threaded);
/* Starts a threaded queue's worker now (it otherwise starts with the first job), so that a
 * thread that cannot start is found before any collective: SG_ERR_OUT_OF_MEMORY with the
 * reason, and the queue runs its jobs inline until a later call succeeds, so the caller can
 * still take part in the collective that tells the other ranks. SG_OK for an inline queue. */
sg_status sg__jobq_start(sg__jobq *q, const char *fn);
/* Test hook: the n-th next worker start (any queue) fails as EAGAIN would; n < 0 disables. */
void sg__jobq_fail_start_after(int n);
/* Runs (or skips, after a failure) every queued job, joins the worker, frees the queue's
 * resources. A running job is bounded by its own deadline, so this ends. */
void sg__jobq_destroy(sg__jobq *q);
/* Runs or skips the queued jobs and joins the worker; later submits run inline. */
void sg__jobq_stop(sg__jobq *q);

/* Worker (1) or inline (0) from the next submit on; queued jobs finish first. */
void sg__jobq_set_threaded(sg__jobq *q, int threaded);

/* Queues fn (threaded) or runs it now. A recorded failure is returned without running fn (no
 * ticket: *ticket = 0). Inline: the job's own failure is returned (its ticket is issued). */
sg_status sg__jobq_submit(sg__jobq *q, sg__jobq_fn fn, void (*drop)(void *), void *arg,
                          uint64_t *ticket);
/* Host wait until job `ticket` and all before it completed (SG_ERR_TIMEOUT at the deadline,
 * not recorded: the job may still finish), then the recorded failure if any. `fn` prefixes
 * the messages. SG_ERR_INVALID_STATE from inside a worker job; SG_ERR_INVALID_ARGUMENT for a
 * ticket never issued. */
sg_status sg__jobq_wait(sg__jobq *q, uint64_t ticket, int64_t deadline_ms, const char *fn);
/* The same for every job submitted so far (no-op inside a job of this queue). */
sg_status sg__jobq_wait_all(sg__jobq *q, int64_t deadline_ms, const char *fn);

/* Keeps the first failure (st with `text`, or the calling thread's last error when NULL);
 * returns st. */
sg_status sg__jobq_fail(sg__jobq *q, sg_status st, const char *text);
/* The recorded failure with its text in the calling thread's error, or SG_OK. */
sg_status sg__jobq_failed(sg__jobq *q);

/* The calling thread is running a job of q (on the worker or inline). */
int sg__jobq_in_job(const sg__jobq *q);
/* Tickets issued so far and completed so far. */
uint64_t sg__jobq_last(sg__jobq *q);
uint64_t sg__jobq_done(sg__jobq *q);

#endif /* SG_JOBQ_H */
