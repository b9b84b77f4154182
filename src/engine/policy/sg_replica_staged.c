/* The staged replica transport (DESIGN.md section 1, "Hybrid engines"): a host replica
 * communicator beside an NCCL shard, the accumulator on the GPU. The channel is bound to a CPU
 * device of the stage's own (rep.host_dev: a host queue and its worker); per claimed bucket a
 * job on the comm stream casts the slice to the wire dtype and copies it into a pinned stage, a
 * job on the host queue waits for that copy and all-reduces the stage (overlapping the rest of
 * backward), and at the step, once the host queue drained, jobs on the comm stream copy every
 * slice back (and cast it) before the norm. */
#include <stdlib.h>

#include "sg_replica_policy.h"

sg_status sg__replica_staged_host_queue(sg_engine *e, const sg_comm *replica, sg__device **dev) {
  SG_TRY(sg__device_cpu_create(e->rank, replica->threaded, &e->rep.host_dev));
  *dev = e->rep.host_dev;
  return SG_OK;
}

void sg__replica_staged_release(sg_engine *e) {
  if (!e->rep.host_dev) return;
  /* select may have made it the element work's device or the sums' (offload, the twin) */
  if (e->rep.elem_dev == e->rep.host_dev) e->rep.elem_dev = NULL;
  if (e->rep.sum_dev == e->rep.host_dev) e->rep.sum_dev = NULL;
  e->rep.host_dev->ops->destroy(e->rep.host_dev); /* joins its worker */
  e->rep.host_dev = NULL;
}

/* The host queue's jobs so far finished (their failure, if any). */
sg_status sg__replica_staged_drain(sg_engine *e) {
  if (!e->rep.host_last) return SG_OK;
  sg__device *h = e->rep.host_dev;
  return h->ops->comm_wait(h, e->rep.host_last, sg__engine_host_deadline(e));
}

/* The stage: communication staging, not counted in sg_memory (as MPI's). */
static sg_status staged_prepare(sg_engine *e) {
  return e->dev->ops->host_alloc(e->dev, e->plan->shard_numel *
                                 sg__dtype_size(e->cfg.replica_reduce_dtype),
                                 (void **)&e->rep.stage);
}

/* A host-side collective on the host queue (after its all-reduces), waited for. */
sg_status sg__replica_staged_run(sg_engine *e, sg__job_fn fn, void *arg) {
  sg__device *h = e->rep.host_dev;
  SG_TRY(sg__engine_broken(e, h->ops->comm_submit(h, fn, NULL, arg, &e->rep.host_last)));
  return sg__engine_broken(e, sg__replica_staged_drain(e));
}

typedef struct {
  sg_engine *e;
  int bucket;
  uint64_t after; /* staged_sum: the engine's job that copied the slice down */
} staged_job;

static char *stage_of(const sg_engine *e, int b) {
  return e->rep.stage + e->plan->buckets[b].shard_offset * sg__dtype_size(e->cfg.replica_reduce_dtype);
}

/* Engine comm queue (stream-ordered, behind the bucket's reduction): the slice, in the wire
 * dtype through the wire buffer, copied into the stage. */
static sg_status staged_down_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = e->cfg.replica_reduce_dtype;
  const size_t n = sg__plan_slice_numel(e->plan, j->bucket);
  const char *src = sg__accum_of(e, j->bucket);
  if (e->rep.wire) {
    SG_TRY(d->ops->cast(d, SG_Q_COMM, e->rep.wire, wdt, src, adt, n));
    src = e->rep.wire;
  }
  return d->ops->copy(d, SG_Q_COMM, stage_of(e, j->bucket), src, n * sg__dtype_size(wdt),
                      SG_COPY_D2H);
}

/* Host queue: once the copy landed, the slice summed over the replicas in the stage. */
static sg_status staged_sum_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  SG_TRY(e->dev->ops->comm_wait(e->dev, j->after, dl));
  sg_comm *c = e->rep.comm;
  return c->ops->all_reduce(c, stage_of(e, j->bucket), sg__plan_slice_numel(e->plan, j->bucket),
                            e->cfg.replica_reduce_dtype, dl);
}

/* Engine comm queue, at the step: the summed slice back (and cast back from the wire). */
static sg_status staged_up_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = e->cfg.replica_reduce_dtype;
  const size_t n = sg__plan_slice_numel(e->plan, j->bucket);
  char *acc = sg__accum_of(e, j->bucket);
  char *dst = e->rep.wire ? e->rep.wire : acc;
  SG_TRY(d->ops->copy(d, SG_Q_COMM, dst, stage_of(e, j->bucket), n * sg__dtype_size(wdt),
                      SG_COPY_H2D));
  return e->rep.wire ? d->ops->cast(d, SG_Q_COMM, acc, adt, e->rep.wire, wdt, n) : SG_OK;
}

static sg_status staged_job_new(sg_engine *e, int b, staged_job **out) {
  *out = malloc(sizeof **out);
  if (!*out) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  **out = (staged_job){e, b, 0};
  return SG_OK;
}

static sg_status staged_claim(sg_engine *e, int b) {
  /* the stage is reused: the previous round's sums (sg_grad_zero after them) are done */
  if (e->rep.nclaimed == 1) SG_TRY(sg__engine_broken(e, sg__replica_staged_drain(e)));
  staged_job *down = NULL, *sum = NULL;
  SG_TRY(staged_job_new(e, b, &down));
  uint64_t t = 0;
  e->rep.claimed[b] = SG__CLAIM_QUEUED;
  SG_TRY(sg__engine_broken(e, sg__engine_submit(e, staged_down_fn, free, down, &t)));
  SG_TRY(staged_job_new(e, b, &sum));
  sum->after = t;
  sg__device *h = e->rep.host_dev;
  return sg__engine_broken(e, h->ops->comm_submit(h, staged_sum_fn, free, sum, &e->rep.host_last));
}

/* At the step: every staged sum done, then copied back on the engine's comm queue. */
static sg_status staged_finish(sg_engine *e) {
  SG_TRY(sg__engine_broken(e, sg__replica_staged_drain(e)));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (e->rep.claimed[b] != SG__CLAIM_QUEUED) continue;
    staged_job *up = NULL;
    SG_TRY(staged_job_new(e, b, &up));
    e->rep.claimed[b] = SG__CLAIM_BACK;
    uint64_t t = 0;
    SG_TRY(sg__engine_broken(e, sg__engine_submit(e, staged_up_fn, free, up, &t)));
  }
  return SG_OK;
}

const sg__replica_ops sg__replica_staged = {
    .name = "staged", SG__REPLICA_ENTRIES, .share_scratch = 0, .prepare = staged_prepare,
    .release = sg__replica_staged_release, .claim = staged_claim, .finish = staged_finish,
    .run = sg__replica_staged_run, .drain = sg__replica_staged_drain, SG__REPLICA_EVERY_STEP,
    SG__REPLICA_NO_CK,
};
