/* Internal device interface (DESIGN.md sections 1 and 4): memory, copies, kernels and the two
 * queues. The engine reaches hardware only through this vtable; cpu.c and cuda.c implement it.
 *
 * Queues. Kernels and copies take a queue: SG_Q_COMPUTE (the caller's stream on CUDA; inline on
 * the calling thread on CPU) or SG_Q_COMM (an internal stream on CUDA; on CPU the comm worker
 * thread, where comm jobs run). Work on SG_Q_COMM issued from inside a comm job is ordered after
 * the job's own earlier work.
 *
 * Comm jobs. comm_submit runs fn(arg) on the comm queue after all work already issued to the
 * compute queue (CUDA: an event recorded on the compute stream, waited by the comm stream; CPU:
 * the caller's work is already done when it submits). Jobs run one at a time in submit order.
 * A failing job records its status and text; every later comm_wait returns it (the engine is
 * then broken). Both devices run jobs through one queue (sg_jobq.h).
 *
 * Communicators. A communicator channel bound to the device (sg__comm_bind) attaches to it
 * first (comm_attach): it says how its collectives work and gets what it needs to enqueue them
 * (the native comm stream). Host-driven collectives (local, MPI: they work on the host, and
 * their SG_Q_COMM copies and kernels complete before each call returns) run on the device's
 * worker thread when the communicator allows calls from another thread, inline in comm_submit
 * otherwise; stream-ordered ones (NCCL) only enqueue work on the comm stream, run inline, and
 * take part in the device's host waits (poll, abort at a passed deadline). Without an
 * attachment jobs are host-driven on the worker. */
#ifndef SG_DEVICE_H
#define SG_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "../../kernels/sg_kernel_args.h" /* sg__update_args, sg__seg */
#include "../core/sg_core.h"               /* sg_status */
#include "../optim/sg_optimizer.h"         /* sg__optim_desc: the update kernels */

typedef enum { SG_Q_COMPUTE = 0, SG_Q_COMM = 1 } sg__queue;
typedef enum { SG_COPY_H2D = 0, SG_COPY_D2H = 1, SG_COPY_D2D = 2 } sg__copy_kind;

typedef struct sg__device sg__device;
typedef sg_status (*sg__job_fn)(void *arg);

/* What a communicator tells the device at bind time (see "Communicators" above). */
typedef struct sg__comm_attach {
  int stream_ordered; /* 1: jobs only enqueue work on the native comm stream (NCCL) */
  int threaded;       /* host-driven: jobs may run on the device's worker thread */
  /* stream-ordered: called by the device's host waits on every poll round (SG_OK, or the
   * communicator's failure with its text, then recorded as a failed job), and once when a
   * wait passes its deadline, before SG_ERR_TIMEOUT is returned (abort the collectives) */
  sg_status (*poll)(void *arg);
  void (*abort)(void *arg);
  void *arg;
  /* the engine's timeout_ms (<= 0: none): the device's own host waits (copies, sumsq,
   * host-driven jobs' GPU work) end there with SG_ERR_TIMEOUT instead of hanging behind a
   * collective that never completes */
  int timeout_ms;
} sg__comm_attach;

/* What the device gives the communicator. No CUDA types: streams travel as void *. */
typedef struct sg__comm_native {
  void *stream; /* CUDA: the cudaStream_t of SG_Q_COMM; NULL on CPU */
  int ordinal;  /* CUDA: the device's GPU; -1 on CPU */
} sg__comm_native;

typedef struct sg__device_ops {
  const char *name;
  /* memory: device memory for the arenas; never managed memory */
  sg_status (*alloc)(sg__device *d, size_t bytes, void **out);
  void (*free)(sg__device *d, void *p);
  /* pinned (page-locked) host memory for staging; plain malloc on CPU */
  sg_status (*host_alloc)(sg__device *d, size_t bytes, void **out);
  void (*host_free)(sg__device *d, void *p);
  /* copies and fills, ordered on queue q. H2D/D2H from SG_Q_COMPUTE complete before return. */
  sg_status (*copy)(sg__device *d, sg__queue q, void *dst, const void *src, size_t bytes,
                    sg__copy_kind kind);
  sg_status (*zero)(sg__device *d, sg__queue q, void *dst, size_t bytes);
  /* kernels (element math from kernels/sg_elem.h) */
  /* optimizer od's fused update of a->segs (od->nstates state arrays in a->state); a device
   * that has no kernel of od says SG_ERR_UNSUPPORTED */
  sg_status (*update)(sg__device *d, sg__queue q, const sg__optim_desc *od,
                      const sg__update_args *a);
  /* acc[i] += src[i] (acc_dtype SG_F32 or SG_BF16; src any dtype), fp32 math */
  sg_status (*accumulate)(sg__device *d, sg__queue q, void *acc, int acc_dtype, const void *src,
                          int src_dtype, size_t n);
  /* dst[i] = convert(src[i]); dtypes any of sg_dtype; dst and src do not overlap */
  sg_status (*cast)(sg__device *d, sg__queue q, void *dst, int dst_dtype, const void *src,
                    int src_dtype, size_t n);
  /* *sumsq = sum of x[i]^2 (in double), *nonfinite = count of inf/NaN; x in dtype (F32/BF16).
   * Deterministic for a given n (fixed partition, fixed combine order). Completes before
   * return (host reads the result). */
  sg_status (*sumsq)(sg__device *d, sg__queue q, const void *x, int dtype, size_t n,
                     double *sumsq, double *nonfinite);
  /* The same two values (same partition and order) into dev2[0..1], device memory, in queue
   * order: nothing waits (the step's norm, summed over the ranks on the device and read once). */
  sg_status (*sumsq_to)(sg__device *d, sg__queue q, const void *x, int dtype, size_t n,
                        double *dev2);
  /* dst[i] = round(sum over k in 0..nsrc-1 of srcs[k][i]) in dtype, fp32 sums in k order.
   * dst may be one of srcs. Used by the local communicator. */
  sg_status (*reduce_sum)(sg__device *d, sg__queue q, void *dst, const void *const *srcs,
                          int nsrc, int dtype, size_t n);
  /* queues. drop(arg), when not NULL, is called exactly once: after the job ran, instead of
   * running it when an earlier failure skips it, or when the submit fails; the argument is the
   * queue's from the call on. */
  sg_status (*comm_submit)(sg__device *d, sg__job_fn fn, void (*drop)(void *arg), void *arg,
                           uint64_t *ticket);
  /* Host waits until job `ticket` (and all before it) finished, or the deadline passes
   * (SG_ERR_TIMEOUT). Returns the first failure of any job. */
  sg_status (*comm_wait)(sg__device *d, uint64_t ticket, int64_t deadline_ms);
  /* Compute queue waits (CUDA: stream wait on an event) for job `ticket`; CPU: host wait. */
  sg_status (*compute_wait_comm)(sg__device *d, uint64_t ticket, int64_t deadline_ms);
  /* CPU: one attachment at a time (SG_ERR_INVALID_STATE for a second; SG_ERR_UNSUPPORTED for
   * a stream-ordered one). CUDA: up to two that run their jobs the same way (both
   * stream-ordered, polled by every wait; or both host-driven), the second being a hybrid
   * engine's replica channel (SG_ERR_INVALID_STATE otherwise). Pending jobs finish first.
   * Detach takes off the latest attachment (channels unbind in reverse bind order); after the
   * last, jobs are host-driven on the worker again and the device calls nothing of the
   * communicator any more. */
  sg_status (*comm_attach)(sg__device *d, const sg__comm_attach *a, sg__comm_native *out);
  void (*comm_detach)(sg__device *d);
  /* All compute-queue work done (host). */
  sg_status (*sync)(sg__device *d, int64_t deadline_ms);
  /* caller's stream (CUDA); CPU: SG_ERR_UNSUPPORTED for non-NULL */
  sg_status (*set_stream)(sg__device *d, void *stream);
  /* Timing marks (tracing): a set of n marks; mark i records when queue q reaches that point
   * (SG_Q_COMM only from inside a comm job); elapsed gives the microseconds from mark `from`
   * to mark `to` once both are complete (the caller waited for both queues), and
   * SG_ERR_INVALID_STATE for a mark never recorded. CUDA: events with timing; CPU: clock. */
  sg_status (*marks_create)(sg__device *d, size_t n, void **marks);
  void (*marks_destroy)(sg__device *d, void *marks, size_t n);
  sg_status (*mark)(sg__device *d, void *marks, size_t i, sg__queue q);
  sg_status (*mark_elapsed)(sg__device *d, void *marks, size_t from, size_t to, double *us);
  void (*destroy)(sg__device *d);
  /* Optional (NULL: alloc, then zero on SG_Q_COMPUTE): memory that reads as zeros, freed with
   * free. CPU: large blocks are fresh pages, never written, so they stay off RSS until used. */
  sg_status (*alloc_zeroed)(sg__device *d, size_t bytes, void **out);
  /* Optional (NULL: zero): as zero, for memory from alloc or alloc_zeroed, and the device may
   * give the whole pages inside back to the system until they are written again (they then
   * read as zeros). CPU: madvise(MADV_DONTNEED), so staging buffers and the gradient
   * accumulator between steps cost no RSS. */
  sg_status (*zero_release)(sg__device *d, sg__queue q, void *dst, size_t bytes);
  /* Starts the thread that runs host-driven comm jobs now rather than with the first job
   * (sg__jobq_start): SG_ERR_OUT_OF_MEMORY when it cannot start, and the jobs then run inline
   * on the caller, so that the caller still reaches the collective that tells every rank.
   * SG_OK where jobs run inline anyway (stream-ordered, or not threaded). */
  sg_status (*comm_start)(sg__device *d);
  /* Optional (NULL: the engine decides the step on the host, after a host wait for the norm):
   * the step's outcome (kernels/sg_elem.h, sg_elem_step_outcome) from ss_dev (the summed sum of
   * squares and non-finite count, 2 doubles of device memory) into out_dev (device memory, which
   * the update reads through sg__update_args.outcome) and, unless NULL, host_out (pinned host
   * memory from host_alloc; seq written last, after the rest is visible to the host), in the
   * order of queue q: nothing waits. */
  sg_status (*step_outcome)(sg__device *d, sg__queue q, const double *ss_dev,
                            const struct sg_elem_step_in *in, void *out_dev, void *host_out,
                            uint64_t seq);
  /* Optional (NULL: comm_submit): comm_submit on a lane. Lane 1 is a hybrid engine's replica
   * channel: where it is stream-ordered beside the shard channel, its jobs (their collectives
   * and their SG_Q_COMM work) run on a stream of their own, after the comm queue's work
   * submitted before them, and later lane-0 jobs do not wait for them; comm_wait and
   * compute_wait_comm of a ticket cover both lanes. Lane 0 is comm_submit. A lane-1 job must
   * not touch memory that later lane-0 jobs use before a wait for its ticket. */
  sg_status (*comm_submit_lane)(sg__device *d, int lane, sg__job_fn fn, void (*drop)(void *arg),
                                void *arg, uint64_t *ticket);
  /* Optional (NULL: compute_wait_comm): the compute queue waits for job `ticket` and the jobs of
   * its lane before it only, not for the other lane's earlier jobs (a slot that a reduction job
   * zeroed need not wait for a slow replica all-reduce queued before it). */
  sg_status (*compute_wait_job)(sg__device *d, uint64_t ticket, int64_t deadline_ms);
  /* Optional (NULL: copy on SG_Q_COMM, SG_COPY_D2H): inside a comm job, a device-to-host copy
   * into pinned host memory on a lane of its own (CUDA with stream-ordered jobs: the copy-out
   * stream), after the job's SG_Q_COMM work so far; the job's later SG_Q_COMM work follows it
   * there, and later jobs do not wait for either. Every wait for the job's ticket covers them.
   * src must not be memory that a later job rewrites on the comm queue (it may run first). */
  sg_status (*copy_out)(sg__device *d, void *dst, const void *src, size_t bytes);
  /* Outer steps (DiLoCo, src/engine/policy/sg_replica_outer.c; element math sg_elem_outer_* of
   * kernels/sg_elem.h), fp32 device memory, in the order of queue q: the pseudo-gradient
   * d[i] = po[i] - theta[i]; and the step from the replicas' sum dsum of it: the mean dsum / nrep,
   * po[i] and m[i] by Nesterov momentum (lr, mu), theta[i] = the new po[i]. */
  sg_status (*outer_delta)(sg__device *d, sg__queue q, float *dst, const float *po,
                           const float *theta, size_t n);
  sg_status (*outer_step)(sg__device *d, sg__queue q, float *po, float *m, float *theta,
                          const float *dsum, size_t n, int nrep, float lr, float mu);
  /* The replica codecs' blockwise codes (src/engine/policy/sg_replica_codec.c; bits 8 or 4,
   * kernels/sg_elem.h's sg_elem_code*), device memory, in the order of queue q: n values src +
   * resid encoded into out (sg__cpu_code_bytes(n, bits) bytes), resid becoming what the codes
   * missed; and n values decoded from in into dst (add: dst + them, fp32). */
  sg_status (*code_encode)(sg__device *d, sg__queue q, void *out, const float *src, float *resid,
                           size_t n, int bits);
  sg_status (*code_decode)(sg__device *d, sg__queue q, float *dst, const void *in, size_t n,
                           int bits, int add);
  /* Optional (NULL: none): a second device on the same hardware with queues of its own (CUDA:
   * its own streams and comm worker), whose memory is this device's (pointers pass between
   * them), destroyed with its destroy. A replica channel of host-driven collectives bound to it
   * runs its jobs beside this device's comm queue, not behind it (streaming outer steps,
   * src/engine/policy/sg_replica_outer_stream.c). Nothing orders the two: a job on the twin
   * waits for this device's work through a ticket (comm_wait), and the other way round. */
  sg_status (*twin)(sg__device *d, sg__device **out);
} sg__device_ops;

struct sg__device {
  const sg__device_ops *ops;
  sg_device kind;
  int rank; /* for log lines */
};

/* bytes of zeros on d (arenas, extra gradient buffers): nothing allocated on failure. */
static inline sg_status sg__device_alloc_zeroed(sg__device *d, size_t bytes, void **out) {
  if (d->ops->alloc_zeroed) return d->ops->alloc_zeroed(d, bytes, out);
  sg_status st = d->ops->alloc(d, bytes, out);
  if (st != SG_OK) return st;
  st = d->ops->zero(d, SG_Q_COMPUTE, *out, bytes);
  if (st != SG_OK) {
    d->ops->free(d, *out);
    *out = NULL;
  }
  return st;
}

/* Zeroes bytes at dst (memory of d's alloc) on queue q, returning whole pages where d can. */
static inline sg_status sg__device_zero_release(sg__device *d, sg__queue q, void *dst,
                                                size_t bytes) {
  if (d->ops->zero_release) return d->ops->zero_release(d, q, dst, bytes);
  return d->ops->zero(d, q, dst, bytes);
}

/* A comm job's copy of device memory into pinned host memory on the device's copy-out lane
 * (copy_out), or on SG_Q_COMM where it has none. */
static inline sg_status sg__device_copy_out(sg__device *d, void *dst, const void *src,
                                            size_t bytes) {
  if (d->ops->copy_out) return d->ops->copy_out(d, dst, src, bytes);
  return d->ops->copy(d, SG_Q_COMM, dst, src, bytes, SG_COPY_D2H);
}

/* cpu.c. threaded_comm = 0 runs comm jobs inline on the submitting thread (no overlap) until a
 * communicator attaches (comm_attach sets the mode from then on). */
sg_status sg__device_cpu_create(int rank, int threaded_comm, sg__device **out);
#ifdef SG_HAVE_CUDA
sg_status sg__device_cuda_create(int rank, int cuda_device, sg__device **out);
#endif

/* Test hook: the n-th next device allocation (any device) fails with SG_ERR_OUT_OF_MEMORY;
 * n < 0 disables. Counts across threads. */
void sg__device_fail_alloc_after(int n);
int sg__device_should_fail_alloc(void);

#endif /* SG_DEVICE_H */
