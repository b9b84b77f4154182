/* Sharded optimizer state (SHARD_OPT, SHARD_GRAD_OP and their offloading variants): this rank
 * owns slice `rank` of every bucket (DESIGN.md section 2); a bucket is reduce-scattered, the
 * norm's partials all-reduced, the updated slices all-gathered, and a full view of a state
 * array is a gather. */
#include "sg_policy.h"

void sg__sharded_owned(const sg__plan *p, int rank, int b, sg__owned *out) {
  out->flat0 = sg__plan_slice_start(p, b, rank);
  out->n = sg__plan_slice_numel(p, b);
  out->state0 = p->buckets[b].shard_offset;
}

size_t sg__sharded_max_wire(const sg__plan *p) { return sg__plan_max_slice_numel(p); }

sg_status sg__sharded_reduce_scatter(sg_engine *e, int b, char *wire, const char **mine) {
  const int rdt = e->cfg.reduce_dtype;
  const size_t slice = sg__plan_slice_numel(e->plan, b);
  SG_TRY(e->comm->ops->reduce_scatter(e->comm, wire, slice, rdt, sg__deadline(e->cfg.timeout_ms)));
  *mine = wire + (size_t)e->rank * slice * sg__dtype_size(rdt);
  return SG_OK;
}

/* On a CPU engine whose channel offers it, the channel folds its sums into the accumulator
 * (reduce_scatter_fold): the bits of reduce-scatter + sg__accum_into without the pass
 * that writes the reduced slice and the one that reads it back (DESIGN.md section 6).
 * SG_COMM_FOLD=0 turns it off (read once). */
static int fold_in_comm(const sg_engine *e) {
  return e->dev->kind == SG_DEVICE_CPU && e->comm->ops->reduce_scatter_fold &&
         sg__env_value(SG_ENV_COMM_FOLD, 1);
}

/* A step's first micro-batch on a channel that reduces out of place (NCCL: device memory), with
 * the accumulator in the wire's dtype: the slice goes straight into the accumulator, the bits
 * of reduce-scatter and the first micro-batch's copy without the copy (issue 28: one device
 * operation less per bucket). */
static int reduce_into_accum(const sg_engine *e, int first) {
  return first && e->comm->ops->reduce_scatter_to && e->cfg.reduce_dtype == e->cfg.accum_dtype;
}

sg_status sg__sharded_reduce(sg_engine *e, int b, char *wire, int first) {
  if (reduce_into_accum(e, first))
    return e->comm->ops->reduce_scatter_to(e->comm, wire, sg__accum_of(e, b),
                                           sg__plan_slice_numel(e->plan, b), e->cfg.reduce_dtype,
                                           sg__deadline(e->cfg.timeout_ms));
  if (fold_in_comm(e)) {
    const sg__fold f = {sg__accum_of(e, b), e->cfg.accum_dtype, first};
    return e->comm->ops->reduce_scatter_fold(e->comm, wire, sg__plan_slice_numel(e->plan, b),
                                             e->cfg.reduce_dtype, &f,
                                             sg__deadline(e->cfg.timeout_ms));
  }
  const char *mine = NULL;
  SG_TRY(sg__sharded_reduce_scatter(e, b, wire, &mine));
  return sg__accum_into(e, e->plan->buckets[b].shard_offset, mine,
                              sg__plan_slice_numel(e->plan, b), first);
}

static sg_status sharded_sum_norm(sg_engine *e, double *dev_ss) {
  return e->comm->ops->all_reduce(e->comm, dev_ss, 3, SG__F64, sg__deadline(e->cfg.timeout_ms));
}

static sg_status sharded_gather(sg_engine *e, int b) {
  const sg__plan *p = e->plan;
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  return e->comm->ops->all_gather(e->comm, e->params + p->buckets[b].start * P,
                                  sg__plan_slice_numel(p, b) * P,
                                  sg__deadline(e->cfg.timeout_ms));
}

static sg_status sharded_gather_state(sg_engine *e, int b, const float *state, float *tmp) {
  const sg__plan *p = e->plan;
  const size_t slice = sg__plan_slice_numel(p, b);
  sg__device *d = e->dev;
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, tmp + (size_t)e->rank * slice,
                      state + p->buckets[b].shard_offset, slice * 4, SG_COPY_D2D));
  SG_TRY(d->ops->sync(d, sg__engine_host_deadline(e)));
  return sg__engine_allgather(e, tmp, slice * 4);
}

/* The values of parameter id: its bucket gathered into a temporary, its piece copied out. */
static sg_status sharded_param_state(sg_engine *e, int id, const float *state, float *dst) {
  const sg__plan_param *pp = &e->plan->params[id];
  const sg__bucket *b = &e->plan->buckets[pp->bucket];
  float *tmp = NULL;
  SG_TRY(e->dev->ops->alloc(e->dev, b->numel * 4, (void **)&tmp));
  sg_status st = sharded_gather_state(e, pp->bucket, state, tmp);
  if (st == SG_OK)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dst, tmp + (pp->offset - b->start),
                           pp->numel * 4, SG_COPY_D2H);
  e->dev->ops->free(e->dev, tmp);
  return st;
}

const sg__shard_ops sg__shard_sharded = {
    .name = "sharded", .sharded = 1, .sum_norm = sharded_sum_norm, .gather = sharded_gather,
    .gather_state = sharded_gather_state, .param_state = sharded_param_state,
};
