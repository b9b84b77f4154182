/* The offloaded optimizer state of one rank's shard (issue 12): fp32 master (none for f32
 * params: the working values are the master), the optimizer's state arrays and the gradient
 * accumulator in pinned host memory. This file creates, frees and restores it; a strategy that offloads calls
 * it at four points, and nothing else in the engine needs to know where the state lives:
 *
 *   arrival   a bucket's reduction job, once its slice is reduced in device memory:
 *             sg__offload_arrive_plan on the caller's thread before the job is submitted, then
 *             sg__offload_arrive_job inside the job (comm queue), sg__offload_arrive_submitted
 *             with its ticket. The slice goes D2H straight into the accumulator when the
 *             bucket's accumulator is empty and the dtypes agree (the usual single micro-batch
 *             of fp32 or bf16-accumulated gradients: no host pass at all, and it works for
 *             stream-ordered jobs, NCCL's), or else into a landing buffer of a small pinned
 *             pool, which a fold job adds on the fold worker (issue 28, defect 7): that job
 *             waits for the copy, not the caller, so sg_grad_ready neither waits for a D2H
 *             copy nor folds; the caller waits only when every landing buffer still holds an
 *             arrival that is not folded yet (the worker is that far behind).
 *   step      sg__offload_fold_all; sg__offload_norm (sum of squares and non-finite count in
 *             the order of the device's own sumsq, so every decision matches the device path
 *             bit for bit; the partials of chunks a fold already computed are not recomputed); sg__offload_update per bucket (the host update pipeline: each chunk
 *             copied H2D into the working parameters while the next one updates, then the
 *             caller queues the bucket's all-gather); sg__offload_clear (every bucket's
 *             accumulator is empty again: the next arrival overwrites it, no zeroing pass).
 *   access    sg__offload_state: host pointers for checkpoints and sg_get/set_master (host
 *             memcpy where the device path copies D2H/H2D).
 *   memory    host_bytes: every pinned byte held.
 *
 * Threads. While arrivals are pending the accumulator and the norm's partials belong to the
 * fold worker (fq: one job per landed arrival, in arrival order, so the sums of a bucket's
 * micro-batches are added in the same order as before); the caller's thread touches them only
 * after sg__offload_fold_all (or clear, or free) waited for every fold. The landing buffers'
 * ownership (land_owner, lrec) is the caller's: a buffer is free again once its fold job
 * completed. A bucket's plan (mode, land) is written by the caller and read by the arrival's
 * job, which may run on the device's comm worker (host-driven communicators): `job_pending`
 * says the job has not read it yet, and only then does the next plan of the bucket wait. */
#ifndef SG_OFFLOAD_H
#define SG_OFFLOAD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "../device/sg_jobq.h" /* the fold worker's queue */
#include "sg_host_step.h"       /* sg__host_pipe */

typedef enum {
  SG__ARRIVE_DIRECT = 0, /* D2H into the accumulator slice */
  SG__ARRIVE_LAND = 1    /* D2H into a landing buffer; fold adds (or casts) it */
} sg__arrive_mode;

typedef struct sg__offload_bucket {
  size_t off, len;  /* the bucket's slice of the shard (elements) */
  int filled;       /* the accumulator slice holds a gradient since the last step */
  sg__arrive_mode mode; /* of the latest arrival (read by its job) */
  uint64_t ticket;  /* the latest arrival's job; 0 once known complete */
  int land;         /* landing buffer of the latest arrival's plan, -1 none */
  int land_dtype;
  int land_first;   /* the landed slice is the bucket's first since the step: cast, not add */
  atomic_int job_pending; /* 1: the latest arrival's job has not read the plan yet */
} sg__offload_bucket;

/* One landed arrival, from its plan until its fold job (on the fold worker) added it. */
typedef struct sg__offload_landing {
  struct sg__offload *o;
  size_t off, len;     /* the bucket's slice */
  int dtype, first;    /* the slice's dtype; 1: a cast (the bucket's first since the step) */
  uint64_t ticket;     /* the reduction job whose D2H fills the buffer */
  uint64_t fold;       /* the fold job in o->fq; 0: none queued */
  int64_t deadline_ms; /* of the fold's wait for the copy */
  int j;               /* the landing buffer */
} sg__offload_landing;

typedef struct sg__offload {
  sg__device *dev;
  size_t numel;            /* shard elements, padding included */
  int param_dtype, accum_dtype;
  const sg__optim_desc *od; /* the optimizer: its state arrays and CPU update */
  float *master;           /* pinned; NULL for f32 params */
  float *state[SG__OPTIM_MAX_STATES]; /* pinned: od->nstates arrays */
  void *accum;             /* pinned, accum_dtype */
  int nbuckets;
  sg__offload_bucket *b;
  int nland;               /* landing buffers, land_bytes each */
  size_t land_bytes;
  void **land;             /* [nland] pinned */
  int *land_owner;         /* [nland]: bucket whose arrival it holds, -1 free */
  sg__offload_landing *lrec; /* [nland]: that arrival */
  sg__jobq fq;             /* the fold worker: folds of landed arrivals, in arrival order */
  int fq_ready;
  sg__host_pipe pipe;
  size_t host_bytes;       /* every pinned byte held (state, landing buffers, pipe) */
  /* The norm's partials, one pair per chunk of the CUDA sumsq's partition of the shard
   * (SG__CUDA_SUMSQ_CHUNK): a fold computes those of the chunks inside its slice in the same
   * pass (part_ok[q] = 1), the step computes only the rest (chunks across two slices, slices
   * that arrived straight into the accumulator or not at all) and combines them in the
   * kernel's order. gpu_order: 1 on the CUDA device; elsewhere the device's sumsq order is
   * another one and the step sums the whole accumulator (the bench sets it to 1 to time the
   * CUDA device's host side on the CPU device). */
  int gpu_order;
  size_t nq;
  double *part_ss, *part_nf;
  unsigned char *part_ok;
} sg__offload;

/* Allocates and zeroes optimizer od's state for a shard of numel elements (od NULL: the
 * master and the accumulator only, the optimizer's state kept by the caller, an 8-bit
 * placement: sg_state_host_q8.c) whose buckets' slices are [off[k], off[k] + len[k]) (disjoint, inside the shard). chunk: the update
 * pipeline's (0: default); nland landing buffers (>= 1) of land_bytes (>= every slice in any
 * arriving dtype). On failure nothing stays allocated. */
sg_status sg__offload_init(sg__offload *o, sg__device *d, const sg__optim_desc *od, size_t numel,
                           int param_dtype, int accum_dtype, int nbuckets, const size_t *off,
                           const size_t *len, size_t chunk, int nland, size_t land_bytes);
/* Waits (bounded) for copies in flight and frees everything; NULL or zeroed o: nothing. */
void sg__offload_free(sg__offload *o, int64_t deadline_ms);

/* Caller's thread, before submitting bucket k's reduction job whose slice has src_dtype: picks
 * the mode and, to land, a free landing buffer, and records them. It waits (bounded) only for
 * a job of the bucket's previous arrival that has not run yet (a host-driven comm worker a
 * micro-batch behind) or for a fold when no landing buffer is free; never for a D2H copy of its
 * own, and it folds nothing. */
sg_status sg__offload_arrive_plan(sg__offload *o, int k, int src_dtype, int64_t deadline_ms);
/* Inside the job: D2H of the reduced slice (device memory, src_dtype), as planned: on SG_Q_COMM,
 * or with own_lane on the device's copy-out lane (sg__device_copy_out: a slow copy then does not
 * hold up the next bucket's reduction), which needs a slice that no later job rewrites on the
 * comm queue before the job's ticket completes. */
sg_status sg__offload_arrive_job(sg__offload *o, int k, const void *dev_slice, int src_dtype,
                                 int own_lane);
/* Caller's thread, after submitting the job: its ticket (0: not queued, the arrival is
 * forgotten). A landed arrival's fold job is queued on the fold worker here: it waits for the
 * ticket, then adds the slice. */
void sg__offload_arrive_submitted(sg__offload *o, int k, uint64_t ticket);
/* Host wait until every fold queued so far ran: the accumulator then holds every landed
 * arrival, and the caller's thread may read it. A fold's failure (its copy's wait) is returned
 * here and at every later call. */
sg_status sg__offload_fold_all(sg__offload *o, int64_t deadline_ms);
/* The accumulator is rewritten outside the folds (a hybrid engine sums it across replicas):
 * no partial a fold computed holds any more, the norm computes them all. */
void sg__offload_accum_rewritten(sg__offload *o);

/* sg__offload_update (below) with the caller's optimizer state: a->state and a->q8_* as
 * given (host memory in shard coordinates), od's cpu_update; master and accumulator this
 * state's. */
sg_status sg__offload_update_with(sg__offload *o, const sg__optim_desc *od,
                                  const sg__update_args *a, void *dev_params,
                                  int64_t deadline_ms, uint64_t *last);

/* Sum of squares (double) and non-finite count over the whole accumulator, in the order of
 * the device's sumsq (CUDA: sg__cpu_sumsq_gpu; CPU: sg__cpu_sumsq). Slices no gradient arrived
 * in since the last step count as zeros (and are zeroed). Call after fold_all. */
sg_status sg__offload_norm(sg__offload *o, double out[2]);
/* The host update of segments a->segs[0..nsegs) (one bucket's), with a's scalars and
 * segments; master, the state arrays and grad are this state's. New working values go to
 * dev_params (the full working-parameter buffer, device memory). *last: the ticket of its last copy. */
sg_status sg__offload_update(sg__offload *o, const sg__update_args *a, void *dev_params,
                             int64_t deadline_ms, uint64_t *last);
/* After the step (taken or skipped), sg_grad_zero or a load: every bucket's accumulator is
 * empty; arrivals not folded yet are dropped (after their jobs, waited for). */
sg_status sg__offload_clear(sg__offload *o, int64_t deadline_ms);
/* The master (bf16/f16 params) from the working values of segments segs[0..nsegs) of the
 * device buffer dev_params (compute-queue copies through the pipe's buffers). */
sg_status sg__offload_master_from(sg__offload *o, const void *dev_params, const sg__seg *segs,
                                  int nsegs, int64_t deadline_ms);

/* which: 0 master (NULL for f32 params), 1 + k the optimizer's state k: host memory in shard
 * coordinates. Valid once every copy into the working parameters finished
 * (sg__host_pipe_drain). */
float *sg__offload_state(sg__offload *o, int which);
/* Pinned host bytes an offloaded shard of numel elements holds: accumulator + master (not for
 * f32 params) + od's state arrays, plus the update pipeline's ring and the landing buffers
 * (what sg__offload_init allocates with these arguments, exactly). */
size_t sg__offload_host_bytes(const sg__optim_desc *od, size_t numel, int param_dtype,
                              int accum_dtype, size_t chunk, int nland, size_t land_bytes);

#endif /* SG_OFFLOAD_H */
