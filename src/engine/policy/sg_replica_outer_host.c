/* Outer steps with an offloaded optimizer (cfg.outer_every with cfg.offload_optimizer on the
 * CUDA device, docs/slow-links.md): the outer steps of sg_replica_outer.c taken on the host,
 * where the offloaded master lives. The outer state (po, m, the pseudo-gradient, with int8
 * codes the codec's residuals and buffers) is in the replica buffer, pinned host memory; its
 * element work (outer_delta, outer_step, casts, codes) runs on the CPU device select made for
 * it (rep.elem_dev), each sum through the replica channel bound without a device (host
 * memory): the CPU engine's ops on the same values, so its bits. Per bucket, from sg_step's
 * thread once the step's gathers landed:
 *
 *   delta   d = po - theta on the host, theta this rank's fp32 run of the parameters there
 *           (this file's place, sg__outer_place): the host master (bf16/f16 parameters), or
 *           for f32 ones (the GPU's working values are the master, the host keeps no copy)
 *           the run copied D2H into the work buffer;
 *   sum     a job on the replica channel's queue (f32 or bf16 wire, or the int8 codes);
 *   apply   the Nesterov step (theta = po), then the run's new working values (cast to the
 *           parameter dtype in the work buffer) copied H2D on the compute queue, which the
 *           node's gathers (comm jobs) wait for.
 *
 * The copies run on sg_step's thread, outside jobs (a host-driven comm worker must not use the
 * compute queue). Streaming (sg_replica_outer_stream.c) takes the same place, delta and apply.
 * The rest (the period, the first step's outer state, checkpoints) is sg_replica_outer.c's:
 * its copies go through the engine's device, which copies pinned host memory by its pointers. */
#include "sg_replica_policy.h"

/* The host's place (sg__outer_place): the run's fp32 parameters on the host, the master, or
 * for f32 parameters the GPU's copied into the work buffer (compute-queue copies are done when
 * the call returns); the new working values up to the GPU: theta itself (f32), or cast from the
 * master into the work buffer. */
static sg_status host_theta(sg_engine *e, const sg__owned *o, float **theta) {
  if (e->opt.master) {
    *theta = e->opt.master + o->state0;
    return SG_OK;
  }
  *theta = sg__replica_outer_work(e);
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, *theta, (const float *)e->params + o->flat0,
                           o->n * sizeof(float), SG_COPY_D2H);
}

static sg_status host_working(sg_engine *e, const sg__owned *o, const float *theta) {
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  void *w = sg__replica_outer_work(e);
  if (e->opt.master) {
    sg__device *h = e->rep.elem_dev;
    SG_TRY(h->ops->cast(h, SG_Q_COMPUTE, w, e->cfg.param_dtype, theta, SG_F32, o->n));
  }
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, e->params + o->flat0 * P, w, o->n * P,
                           SG_COPY_H2D);
}

static const sg__outer_place host_place = {host_theta, host_working};

int sg__replica_outer_on_host(const sg_engine *e) { return e->rep.outer.place == &host_place; }

sg_status sg__replica_outer_host_prepare(sg_engine *e) {
  SG_TRY(sg__replica_outer_prepare(e));
  e->rep.outer.place = &host_place;
  return SG_OK;
}

sg_status sg__replica_outer_host_prepare_int8(sg_engine *e) {
  SG_TRY(sg__replica_outer_int8_prepare(e));
  e->rep.outer.place = &host_place;
  return SG_OK;
}

/* The sum of bucket b's pseudo-gradient run, a job on the replica channel's queue. */
typedef struct {
  sg_engine *e;
  int b;
  size_t n;
  sg__outer_sum_fn sum;
} sum_job;

static sg_status sum_job_fn(void *arg) {
  const sum_job *j = arg;
  return j->sum(j->e, j->b, sg__replica_outer_dbuf(j->e), j->n);
}

static sg_status sync_with(sg_engine *e, sg__outer_sum_fn sum) {
  float *d = sg__replica_outer_dbuf(e);
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sum_job j = {e, b, 0, sum};
    SG_TRY(sg__replica_outer_delta(e, b, d, &j.n));
    SG_TRY(sg__replica_run_comm(e, sum_job_fn, &j));
    SG_TRY(sg__replica_outer_apply(e, b, d));
  }
  return sg__replica_outer_gather(e, 0, 1);
}

static sg_status sync_wire(sg_engine *e) { return sync_with(e, sg__replica_outer_wire_sum); }

static sg_status sync_int8(sg_engine *e) { return sync_with(e, sg__replica_outer_int8_sum); }

/* The channel takes host memory: the shard channel's scratch (device memory) is not shared. */
#define OUTER_HOST                                                                                \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .claim = sg__replica_outer_claim,                     \
  .finish = sg__replica_outer_finish, .run = sg__replica_run_comm,                               \
  .drain = sg__replica_no_drain, .grad_replicas = sg__replica_outer_grad_replicas,               \
  .sync_due = sg__replica_outer_due

const sg__replica_ops sg__replica_outer_host = {
    .name = "offloaded, outer steps", OUTER_HOST, .prepare = sg__replica_outer_host_prepare,
    .release = sg__replica_staged_release, .sync = sync_wire,
    .ck_describe = sg__replica_outer_describe, .ck_save = sg__replica_outer_save,
    .restore = sg__replica_outer_restore,
};

const sg__replica_ops sg__replica_outer_host_int8 = {
    .name = "offloaded, outer steps, int8 codes", OUTER_HOST,
    .prepare = sg__replica_outer_host_prepare_int8,
    .release = sg__replica_codec_release_queue, .sync = sync_int8,
    .ck_describe = sg__replica_outer_int8_describe, .ck_save = sg__replica_outer_int8_save,
    .restore = sg__replica_outer_int8_restore,
};
