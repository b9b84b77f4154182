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
 *             pool, which sg__offload_fold adds on the host later: when the buffer is needed
 *             for a later bucket, when the bucket arrives again, or at the step.
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
 * Landing buffers and the accumulator are only touched by the caller's thread except for the
 * D2H a job issues into them, and each such job's ticket is waited for before the host reads. */
#ifndef SG_OFFLOAD_H
#define SG_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "sg_host_step.h" /* sg__host_pipe */

typedef enum {
  SG__ARRIVE_DIRECT = 0, /* D2H into the accumulator slice */
  SG__ARRIVE_LAND = 1    /* D2H into a landing buffer; fold adds (or casts) it */
} sg__arrive_mode;

typedef struct sg__offload_bucket {
  size_t off, len;  /* the bucket's slice of the shard (elements) */
  int filled;       /* the accumulator slice holds a gradient since the last step */
  sg__arrive_mode mode; /* of the latest arrival (read by its job) */
  uint64_t ticket;  /* the latest arrival's job; 0 once known complete */
  int land;         /* landing buffer holding an arrival not folded yet, -1 none */
  int land_dtype;
  int land_first;   /* the landed slice is the bucket's first since the step: cast, not add */
} sg__offload_bucket;

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
  uint64_t *land_ticket;   /* [nland]: that arrival's job */
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

/* Caller's thread, before submitting bucket k's reduction job whose slice has src_dtype: waits
 * for the bucket's previous arrival, picks the mode (folding the landing buffer it takes if
 * that still holds another bucket's arrival) and records it. */
sg_status sg__offload_arrive_plan(sg__offload *o, int k, int src_dtype, int64_t deadline_ms);
/* Inside the job: D2H of the reduced slice (device memory, src_dtype) on SG_Q_COMM, as planned. */
sg_status sg__offload_arrive_job(sg__offload *o, int k, const void *dev_slice, int src_dtype);
/* Caller's thread, after submitting the job: its ticket (what fold waits for; 0: not queued,
 * the arrival is forgotten). */
void sg__offload_arrive_submitted(sg__offload *o, int k, uint64_t ticket);
/* Adds bucket k's landed slice into the accumulator (waits for its job first); nothing pending:
 * nothing. */
sg_status sg__offload_fold(sg__offload *o, int k, int64_t deadline_ms);
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
