/* The CUDA device's comm job queue (cuda.c's header comment: "Comm jobs", "Jobs and
 * communicators", "Waits"): submitting jobs on either lane, their tickets, and every polling
 * host wait with its deadline. */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c11 */

#include "sg_cuda_internal.h"

/* ---- polling waits ------------------------------------------------------------------------ */

/* Spin briefly (collectives of small buckets finish in microseconds), then sleep with a growing
 * pause up to SG__CUDA_NAP_MAX_NS: a wait sits between GPU phases (the norm, then the update), so a
 * nap of a millisecond would leave the GPU idle that long; 50 us still frees the core. */
#define SG__CUDA_NAP_MAX_NS 50000L
void sg__cuda_backoff(unsigned iter) {
  if (iter < 64) return;
  long ns = 1000L << (iter < 70 ? iter - 64 : 6);
  struct timespec ts = {0, ns > SG__CUDA_NAP_MAX_NS ? SG__CUDA_NAP_MAX_NS : ns};
  nanosleep(&ts, NULL);
}

/* Waits for ev (or, when ev is NULL, for all of stream s) until deadline_ms. Comm failures seen
 * through the hooks and timeouts are recorded: the comm queue's state is unknown afterwards. */
sg_status sg__cuda_wait(sg__cuda_dev *d, cudaEvent_t ev, cudaStream_t s, int64_t deadline_ms,
                        const char *fn) {
  /* The device's own waits (copies, sumsq, host-driven jobs) end at the attached communicator's
   * timeout: the GPU work they wait for may sit behind a collective that never completes. */
  if (deadline_ms == INT64_MAX) {
    pthread_mutex_lock(&d->mu);
    const int timeout_ms = d->attached ? d->att[0].timeout_ms : 0;
    pthread_mutex_unlock(&d->mu);
    deadline_ms = sg__deadline(timeout_ms);
  }
  for (unsigned iter = 0;; iter++) {
    cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
    if (e == cudaSuccess) return SG_OK;
    /* NotReady is not a failure, but the runtime keeps it as the thread's last error, which the
     * next launcher's cudaGetLastError would report: clear it. */
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    if (e != cudaErrorNotReady)
      return sg__cuda_record_failure(
          d, sg__cuda_err(e, fn, ev ? "cudaEventQuery" : "cudaStreamQuery", __FILE__, __LINE__));
    sg__comm_attach h[SG__CUDA_MAX_ATT];
    const int hooked = sg__cuda_hooks_get(d, h);
    for (int i = 0; i < hooked; i++) {
      sg_status st = h[i].poll ? h[i].poll(h[i].arg) : SG_OK;
      if (st != SG_OK) return sg__cuda_record_failure(d, sg__err_prefix(st, fn));
    }
    if (deadline_ms != INT64_MAX && sg__now_ms() > deadline_ms) {
      return sg__cuda_record_failure( /* which aborts the attached communicators */
          d, sg__err_at(SG_ERR_TIMEOUT, __FILE__, __LINE__,
                        "%s: deadline passed while waiting for the GPU (rank %d, device %d)", fn,
                        d->base.rank, d->ordinal));
    }
    sg__cuda_backoff(iter);
  }
}

/* Host-driven jobs (see the top of the file): their comm-queue work completes before the call
 * that issued it returns. */
sg_status sg__cuda_after(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (q != SG_Q_COMM || !sg__cuda_in_host_job(d)) return SG_OK;
  return sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn);
}

/* Before SG_Q_COMM work issued outside a job: every queued job finishes first (the order a
 * stream would give). */
static sg_status sg__cuda_enter_queue(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (q != SG_Q_COMM) return SG_OK;
  return sg__jobq_wait_all(&d->q, INT64_MAX, fn);
}

/* The checks of every op that issues work to queue q: a device, a known queue, and (see
 * sg__cuda_enter_queue) the queued jobs finished first. */
sg_status sg__cuda_queue_op(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  SG_TRY(sg__cuda_check_queue(q, fn));
  return sg__cuda_enter_queue(d, q, fn);
}

/* ---- queues ----------------------------------------------------------------------------- */

static cudaEvent_t sg__cuda_ticket_event(sg__cuda_dev *d, uint64_t ticket) {
  return d->ring[ticket & (SG__CUDA_RING - 1)];
}

/* Queue hook, submitting thread, queue lock held: job t's bookkeeping, and for a host-driven
 * job its input (the compute stream now) on its ring event. */
static sg_status sg__cuda_job_mark(void *ctx, uint64_t t, int worker) {
  static const char fn[] = "sg__device_cuda.comm_submit";
  sg__cuda_dev *d = (sg__cuda_dev *)ctx;
  (void)worker;
  const size_t slot = t & (SG__CUDA_RING - 1);
  pthread_mutex_lock(&d->mu);
  const int host = !d->stream_mode;
  cudaError_t e = host ? cudaEventRecord(d->ring[slot], d->compute) : cudaSuccess;
  if (e == cudaSuccess) {
    d->ring_tk[slot] = t;
    d->ring_host[slot] = (unsigned char)host;
    d->ring_two[slot] = (unsigned char)(!host && d->rep != NULL);
    d->ring_three[slot] = 0; /* set after the job, if the copy-out lane exists by then */
  }
  pthread_mutex_unlock(&d->mu);
  if (e != cudaSuccess) return sg__cuda_err(e, fn, "cudaEventRecord(job input)", __FILE__, __LINE__);
  return SG_OK;
}

/* A stream-ordered job: the comm stream after the compute work issued so far, the job, the
 * ticket's ring event after it (recorded even when the job failed: waits look at it). */
static sg_status sg__cuda_run_stream_job(sg__cuda_dev *d, sg__jobq_fn job, void *arg,
                                         uint64_t t, const char *fn) {
  SG__CU(cudaEventRecord(d->order_ev, d->compute), fn);
  SG__CU(cudaStreamWaitEvent(d->comm, d->order_ev, 0), fn);
  /* A replica-lane job: after everything queued on the comm stream so far (its bucket's
   * reduce-scatter), on the replica stream; the comm stream goes on without it. */
  const int lane = sg__cuda_lane_of == d && d->rep;
  cudaStream_t s = lane ? d->rep : d->comm, other = lane ? d->comm : d->rep;
  if (lane) {
    SG__CU(cudaEventRecord(d->lane_ev, d->comm), fn);
    SG__CU(cudaStreamWaitEvent(d->rep, d->lane_ev, 0), fn);
  }
  const sg_status st = job(arg);
  sg__cuda_out_of = NULL; /* the next job starts on the comm stream again */
  SG__CU(cudaEventRecord(sg__cuda_ticket_event(d, t), s), fn);
  if (d->rep) SG__CU(cudaEventRecord(d->ring2[t & (SG__CUDA_RING - 1)], other), fn);
  if (d->out) { /* the copy-out lane up to this job: waits for the ticket cover it */
    SG__CU(cudaEventRecord(d->ring3[t & (SG__CUDA_RING - 1)], d->out), fn);
    pthread_mutex_lock(&d->mu);
    d->ring_three[t & (SG__CUDA_RING - 1)] = 1;
    pthread_mutex_unlock(&d->mu);
  }
  return st;
}

/* A host-driven job: its input (the ring event), earlier comm-stream work, the job with its
 * SG_Q_COMM work waited for call by call, then the comm stream idle (its marks). */
static sg_status sg__cuda_run_host_job(sg__cuda_dev *d, sg__jobq_fn job, void *arg, uint64_t t,
                                       const char *fn) {
  SG_TRY(sg__cuda_wait(d, sg__cuda_ticket_event(d, t), NULL, INT64_MAX, fn));
  SG_TRY(sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn));
  SG_TRY(job(arg));
  return sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn);
}

/* Queue hook: runs job t on the worker or inline. */
static sg_status sg__cuda_job_run(void *ctx, sg__jobq_fn job, void *arg, uint64_t t) {
  static const char fn[] = "sg__device_cuda.comm_job";
  sg__cuda_dev *d = (sg__cuda_dev *)ctx;
  SG_TRY(sg__cuda_enter(d, fn)); /* the worker thread's first job binds it to our GPU */
  pthread_mutex_lock(&d->mu);
  const int stream = d->stream_mode;
  pthread_mutex_unlock(&d->mu);
  const sg_status st = stream ? sg__cuda_run_stream_job(d, job, arg, t, fn)
                              : sg__cuda_run_host_job(d, job, arg, t, fn);
  if (st != SG_OK) sg__cuda_abort_all(d); /* the queue records it: the engine is broken */
  return st;
}

const sg__jobq_ops sg__cuda_jobq_ops = {sg__cuda_job_mark, sg__cuda_job_run};


sg_status sg__cudev_comm_submit(sg__device *dev, sg__job_fn job, void (*drop)(void *),
                                void *arg, uint64_t *ticket) {
  return sg__cudev_comm_submit_lane(dev, 0, job, drop, arg, ticket);
}

sg_status sg__cudev_comm_submit_lane(sg__device *dev, int lane, sg__job_fn job,
                                     void (*drop)(void *), void *arg, uint64_t *ticket) {
  static const char fn[] = "sg__device_cuda.comm_submit";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !job || !ticket) {
    if (drop) drop(arg);
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  }
  *ticket = 0;
  const sg_status st = sg__cuda_enter(d, fn);
  if (st != SG_OK) {
    if (drop) drop(arg);
    return st;
  }
  /* host-driven jobs run on the worker, all on the comm stream: the lane is stream-ordered */
  const struct sg__cuda_dev *was = sg__cuda_lane_of;
  sg__cuda_lane_of = lane == 1 ? d : NULL;
  const sg_status sub = sg__jobq_submit(&d->q, job, drop, arg, ticket);
  sg__cuda_lane_of = was;
  return sub;
}

/* The replica lane's stream and events (kept until destroy: a detach and a new attach reuse
 * them). */
static sg_status sg__cuda_lane_open(sg__cuda_dev *d, const char *fn) {
  if (d->rep) return SG_OK;
  int least = 0, greatest = 0;
  SG__CU(cudaDeviceGetStreamPriorityRange(&least, &greatest), fn);
  cudaEvent_t *ring2 = (cudaEvent_t *)calloc(SG__CUDA_RING, sizeof *ring2);
  if (!ring2) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: replica lane events", fn);
  cudaError_t e = cudaEventCreateWithFlags(&d->lane_ev, cudaEventDisableTiming);
  for (int i = 0; i < SG__CUDA_RING && e == cudaSuccess; i++)
    e = cudaEventCreateWithFlags(&ring2[i], cudaEventDisableTiming);
  cudaStream_t s = NULL;
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest);
  if (e != cudaSuccess) {
    for (int i = 0; i < SG__CUDA_RING; i++)
      if (ring2[i]) (void)cudaEventDestroy(ring2[i]);
    free(ring2);
    return sg__cuda_err(e, fn, "replica lane (stream, events)", __FILE__, __LINE__);
  }
  d->ring2 = ring2;
  pthread_mutex_lock(&d->mu);
  d->rep = s; /* read by the waits under mu (ring_two) */
  pthread_mutex_unlock(&d->mu);
  return SG_OK;
}

/* The copy-out lane's stream and events (kept until destroy). */
static sg_status sg__cuda_out_open(sg__cuda_dev *d, const char *fn) {
  if (d->out) return SG_OK;
  cudaEvent_t *ring3 = (cudaEvent_t *)calloc(SG__CUDA_RING, sizeof *ring3);
  if (!ring3) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: copy-out lane events", fn);
  cudaError_t e = d->out_ev ? cudaSuccess
                            : cudaEventCreateWithFlags(&d->out_ev, cudaEventDisableTiming);
  for (int i = 0; i < SG__CUDA_RING && e == cudaSuccess; i++)
    e = cudaEventCreateWithFlags(&ring3[i], cudaEventDisableTiming);
  cudaStream_t s = NULL;
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    for (int i = 0; i < SG__CUDA_RING; i++)
      if (ring3[i]) (void)cudaEventDestroy(ring3[i]);
    free(ring3);
    return sg__cuda_err(e, fn, "copy-out lane (stream, events)", __FILE__, __LINE__);
  }
  pthread_mutex_lock(&d->mu);
  d->ring3 = ring3;
  d->out = s; /* read by the waits under mu (ring_three) */
  pthread_mutex_unlock(&d->mu);
  return SG_OK;
}

/* Inside a stream-ordered job of the shard lane: the copy on the copy-out lane, after the comm
 * stream's work so far, and the job's later SG_Q_COMM work after it there (sg__cuda_stream).
 * Elsewhere (a host-driven job, whose copies complete within it anyway; the replica lane;
 * outside a job) the comm queue's copy. */
sg_status sg__cudev_copy_out(sg__device *dev, void *dst, const void *src, size_t bytes) {
  static const char fn[] = "sg__device_cuda.copy_out";
  sg__cuda_dev *d = sg__cuda(dev);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  pthread_mutex_lock(&d->mu);
  const int stream = d->stream_mode;
  pthread_mutex_unlock(&d->mu);
  if (stream && sg__jobq_in_job(&d->q) && sg__cuda_lane_of != d && sg__cuda_out_of != d) {
    SG__CUDA_SCOPE(d);
    SG_TRY(sg__cuda_enter(d, fn));
    SG_TRY(sg__cuda_out_open(d, fn));
    SG__CU(cudaEventRecord(d->out_ev, d->comm), fn);
    SG__CU(cudaStreamWaitEvent(d->out, d->out_ev, 0), fn);
    sg__cuda_out_of = d;
  }
  return dev->ops->copy(dev, SG_Q_COMM, dst, src, bytes, SG_COPY_D2H);
}

/* Pending jobs finish before the mode changes. A second attachment (a hybrid engine's replica
 * channel beside its shard channel) must run its jobs the same way as the first: both
 * stream-ordered (their collectives share the comm stream, every wait polls both), or both
 * host-driven (the first one's threading stays). */
sg_status sg__cudev_comm_attach(sg__device *dev, const sg__comm_attach *a,
                                sg__comm_native *out) {
  static const char fn[] = "sg__device_cuda.comm_attach";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !a || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__jobq_wait_all(&d->q, INT64_MAX, fn));
  pthread_mutex_lock(&d->mu);
  const int n = d->attached, stream = a->stream_ordered != 0;
  const int fits = n == 0 || (n < SG__CUDA_MAX_ATT && stream == d->stream_mode);
  if (fits) {
    d->att[n] = *a;
    d->attached = n + 1;
    d->stream_mode = stream;
  }
  pthread_mutex_unlock(&d->mu);
  if (!fits && n >= SG__CUDA_MAX_ATT)
    return sg__err(SG_ERR_INVALID_STATE, "%s: %d communicators are already attached", fn, n);
  if (!fits)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a %s communicator is attached; a %s one cannot "
                   "share its comm queue", fn, stream ? "host-driven" : "stream-ordered",
                   stream ? "stream-ordered" : "host-driven");
  /* stream-ordered jobs only enqueue: inline, on the caller's thread */
  if (n == 0) sg__jobq_set_threaded(&d->q, !a->stream_ordered && a->threaded);
  out->stream = (void *)d->comm;
  if (n == 1 && stream) {
    const sg_status st = sg__cuda_lane_open(d, fn);
    if (st != SG_OK) {
      pthread_mutex_lock(&d->mu);
      memset(&d->att[1], 0, sizeof d->att[1]);
      d->attached = 1;
      pthread_mutex_unlock(&d->mu);
      return st;
    }
    out->stream = (void *)d->rep;
  }
  out->ordinal = d->ordinal;
  return SG_OK;
}

/* Detaches the latest attachment (channels unbind in the reverse order of their binds). */
/* The replica lane stays; jobs submitted on it after the detach run on the comm stream. */
void sg__cudev_comm_detach(sg__device *dev) {
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return;
  (void)sg__jobq_wait_all(&d->q, INT64_MAX, "sg__device_cuda.comm_detach");
  pthread_mutex_lock(&d->mu);
  const int left = d->attached > 0 ? d->attached - 1 : 0;
  memset(&d->att[left], 0, sizeof d->att[left]);
  d->attached = left;
  if (left == 0) d->stream_mode = 0;
  pthread_mutex_unlock(&d->mu);
  if (left == 0) sg__jobq_set_threaded(&d->q, 1);
}

sg_status sg__cudev_comm_start(sg__device *dev) {
  sg__cuda_dev *d = sg__cuda(dev);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__device_cuda.comm_start: NULL device");
  return sg__jobq_start(&d->q, "sg__device_cuda.comm_start");
}

/* Common checks of comm_wait and compute_wait_comm. *done: nothing left to wait for; else
 * *wait_for is the ticket to wait for (the one now in the ticket's ring slot: a later one waits
 * longer, since jobs complete in ticket order) and *host says whether it is host-driven. */
static sg_status sg__cuda_ticket_check(sg__cuda_dev *d, uint64_t ticket, const char *fn,
                                       int *done, uint64_t *wait_for, int *host, int *two,
                                       int *three) {
  *done = 1;
  SG_TRY(sg__cuda_failed(d));
  const uint64_t last = sg__jobq_last(&d->q);
  if (ticket > last)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: ticket %llu was never issued (last %llu)", fn,
                   (unsigned long long)ticket, (unsigned long long)last);
  const size_t slot = ticket & (SG__CUDA_RING - 1);
  pthread_mutex_lock(&d->mu);
  *wait_for = d->ring_tk[slot];
  *host = d->ring_host[slot];
  *two = d->ring_two[slot];
  *three = d->ring_three[slot];
  *done = !*host && ticket <= d->done_ticket;
  pthread_mutex_unlock(&d->mu);
  if (*host && sg__jobq_done(&d->q) >= *wait_for) *done = 1;
  return SG_OK;
}

/* comm_wait (the host waits until deadline_ms) and compute_wait_comm (stream_wait: the compute
 * stream waits; the deadline applies to whoever waits on the host later). A host-driven
 * worker job's CUDA work is complete when the job is: for it, a host wait on the queue. */
static sg_status sg__cuda_ticket_wait(sg__device *dev, uint64_t ticket, int64_t deadline_ms,
                                      int stream_wait, int own_lane, const char *fn) {
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  int done, host = 0, two = 0, three = 0;
  uint64_t w = 0;
  SG_TRY(sg__cuda_ticket_check(d, ticket, fn, &done, &w, &host, &two, &three));
  if (done) return SG_OK;
  if (host) return sg__jobq_wait(&d->q, w, deadline_ms, fn);
  SG_TRY(sg__cuda_enter(d, fn));
  /* with the replica lane: the other lane's work up to the ticket too */
  cudaEvent_t other = two && !(own_lane && w == ticket) ? d->ring2[w & (SG__CUDA_RING - 1)] : NULL;
  /* with the copy-out lane: its copies (and what their jobs queued after them) up to the ticket */
  cudaEvent_t out = three ? d->ring3[w & (SG__CUDA_RING - 1)] : NULL;
  if (stream_wait) {
    SG__CU(cudaStreamWaitEvent(d->compute, sg__cuda_ticket_event(d, w), 0), fn);
    if (other) SG__CU(cudaStreamWaitEvent(d->compute, other, 0), fn);
    if (out) SG__CU(cudaStreamWaitEvent(d->compute, out, 0), fn);
    return SG_OK;
  }
  SG_TRY(sg__cuda_wait(d, sg__cuda_ticket_event(d, w), NULL, deadline_ms, fn));
  if (other) SG_TRY(sg__cuda_wait(d, other, NULL, deadline_ms, fn));
  if (out) SG_TRY(sg__cuda_wait(d, out, NULL, deadline_ms, fn));
  pthread_mutex_lock(&d->mu);
  if (d->done_ticket < ticket) d->done_ticket = ticket;
  pthread_mutex_unlock(&d->mu);
  return SG_OK;
}

sg_status sg__cudev_comm_wait(sg__device *dev, uint64_t ticket, int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 0, 0, "sg__device_cuda.comm_wait");
}

sg_status sg__cudev_compute_wait_comm(sg__device *dev, uint64_t ticket,
                                      int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 1, 0, "sg__device_cuda.compute_wait_comm");
}

/* Job `ticket` and the jobs of its lane before it; a replica-lane job still running does not
 * hold up the compute stream here (a staging slot that a reduction zeroed). */
sg_status sg__cudev_compute_wait_job(sg__device *dev, uint64_t ticket,
                                     int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 1, 1, "sg__device_cuda.compute_wait_job");
}

sg_status sg__cudev_sync(sg__device *dev, int64_t deadline_ms) {
  static const char fn[] = "sg__device_cuda.sync";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG_TRY(sg__cuda_wait(d, NULL, d->compute, deadline_ms, fn));
  return sg__cuda_failed(d);
}

/* NULL goes back to our own stream. Work already issued to the old stream stays ahead of
 * anything issued to the new one. */
sg_status sg__cudev_set_stream(sg__device *dev, void *stream) {
  static const char fn[] = "sg__device_cuda.set_stream";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  cudaStream_t next = stream ? (cudaStream_t)stream : d->own_compute;
  if (next == d->compute) return SG_OK;
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU(cudaEventRecord(d->order_ev, d->compute), fn);
  SG__CU(cudaStreamWaitEvent(next, d->order_ev, 0), fn);
  d->compute = next;
  return SG_OK;
}

