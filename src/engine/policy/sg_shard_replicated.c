/* Replicated optimizer state (NO_SHARD): every rank holds and updates all of it, so the
 * accumulator is already the sum over the ranks, nothing is gathered after a step, and a full
 * view of a state array is a copy. */
#include "sg_policy.h"

static sg_status replicated_sum_norm(sg_engine *e, double *dev_ss) {
  (void)e, (void)dev_ss;
  return SG_OK;
}

static sg_status replicated_gather(sg_engine *e, int b) {
  (void)e, (void)b;
  return SG_OK;
}

/* The state is indexed by flat offset: bucket b is the run at its start. */
static sg_status replicated_gather_state(sg_engine *e, int b, const float *state, float *tmp) {
  const sg__bucket *bk = &e->plan->buckets[b];
  sg__device *d = e->dev;
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, tmp, state + bk->start, bk->numel * 4, SG_COPY_D2D));
  return d->ops->sync(d, sg__engine_host_deadline(e));
}

static sg_status replicated_param_state(sg_engine *e, int id, const float *state, float *dst) {
  const sg__plan_param *pp = &e->plan->params[id];
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dst, state + pp->offset, pp->numel * 4,
                           SG_COPY_D2H);
}

const sg__shard_ops sg__shard_replicated = {
    .name = "replicated", .sharded = 0, .sum_norm = replicated_sum_norm,
    .gather = replicated_gather, .gather_state = replicated_gather_state,
    .param_state = replicated_param_state,
};
