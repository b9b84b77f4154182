/* Pieces that several strategies share: see sg_strategy_common.h. */
#include <stdatomic.h>
#include <stdlib.h>

#include "sg_strategy_common.h"

static size_t gsize(const sg_engine *e) { return sg__dtype_size(e->cfg.grad_dtype); }

/* ---------------------------------------------------------------------------------------- */
/* a full gradient buffer                                                                    */

sg_status sg__slots_full_init(sg_engine *e, void **state) {
  sg__slot_tickets *t = calloc(1, sizeof *t);
  if (t) t->bucket = calloc((size_t)e->plan->nbuckets, sizeof *t->bucket);
  if (!t || !t->bucket) {
    free(t);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  }
  *state = t;
  return SG_OK;
}

void sg__slots_full_free(sg_engine *e, void *state) {
  sg__slot_tickets *t = state;
  if (!t) return;
  free(t->bucket);
  free(t);
}

sg_status sg__slots_full_slot(sg_engine *e, void *state, int b, char **base, const char *fn) {
  const sg__slot_tickets *t = state;
  /* The bucket's previous reduction must have zeroed the region before it is written again. */
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, t->bucket[b],
                                                sg__deadline(e->cfg.timeout_ms));
  if (st != SG_OK) return sg__engine_broken(e, st);
  *base = e->g.slots + e->plan->buckets[b].start * gsize(e);
  return SG_OK;
}

void sg__slots_full_release(sg_engine *e, void *state, int b, uint64_t ticket) {
  sg__slot_tickets *t = state;
  if (ticket) t->bucket[b] = ticket;
}

/* Bucket b's region is its own: written once per micro-batch, next by the next backward pass. */
size_t sg__slots_full_idle_bytes(const sg_engine *e, const void *state, int b) {
  return e->plan->buckets[b].numel * gsize(e);
}

/* ---------------------------------------------------------------------------------------- */
/* sharded optimizer state                                                                   */

void sg__sharded_owned(const sg__plan *p, int rank, int b, sg__owned *out) {
  out->flat0 = sg__plan_slice_start(p, b, rank);
  out->n = sg__plan_slice_numel(p, b);
  out->state0 = p->buckets[b].shard_offset;
}

size_t sg__sharded_max_wire(const sg__plan *p) {
  size_t m = 0;
  for (int b = 0; b < p->nbuckets; b++)
    if (sg__plan_slice_numel(p, b) > m) m = sg__plan_slice_numel(p, b);
  return m;
}

sg_status sg__sharded_reduce_scatter(sg_engine *e, int b, char *wire, const char **mine) {
  const int rdt = e->cfg.reduce_dtype;
  const size_t slice = sg__plan_slice_numel(e->plan, b);
  SG_TRY(e->comm->ops->reduce_scatter(e->comm, wire, slice, rdt, sg__deadline(e->cfg.timeout_ms)));
  *mine = wire + (size_t)e->rank * slice * sg__dtype_size(rdt);
  return SG_OK;
}

/* On a CPU engine whose channel offers it, the channel folds its sums into the accumulator
 * (reduce_scatter_fold): the bits of reduce-scatter + sg__grads_into_accum without the pass
 * that writes the reduced slice and the one that reads it back (DESIGN.md section 6).
 * SG_COMM_FOLD=0 turns it off (read once). */
static int fold_in_comm(const sg_engine *e) {
  static _Atomic int want = -1;
  return e->dev->kind == SG_DEVICE_CPU && e->comm->ops->reduce_scatter_fold &&
         sg__env_on(&want, "SG_COMM_FOLD");
}

sg_status sg__sharded_reduce(sg_engine *e, int b, char *wire, int first) {
  if (fold_in_comm(e)) {
    const sg__fold f = {sg__grads_accum_of(e, b), e->cfg.accum_dtype, first};
    return e->comm->ops->reduce_scatter_fold(e->comm, wire, sg__plan_slice_numel(e->plan, b),
                                             e->cfg.reduce_dtype, &f,
                                             sg__deadline(e->cfg.timeout_ms));
  }
  const char *mine = NULL;
  SG_TRY(sg__sharded_reduce_scatter(e, b, wire, &mine));
  return sg__grads_into_accum(e, e->plan->buckets[b].shard_offset, mine,
                              sg__plan_slice_numel(e->plan, b), first);
}

sg_status sg__sharded_sum_norm(sg_engine *e, double *dev_ss) {
  return e->comm->ops->all_reduce(e->comm, dev_ss, 2, SG__F64, sg__deadline(e->cfg.timeout_ms));
}

sg_status sg__sharded_gather(sg_engine *e, int b) {
  const sg__plan *p = e->plan;
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  return e->comm->ops->all_gather(e->comm, e->params + p->buckets[b].start * P,
                                  sg__plan_slice_numel(p, b) * P,
                                  sg__deadline(e->cfg.timeout_ms));
}

sg_status sg__sharded_gather_state(sg_engine *e, int b, const float *state, float *tmp) {
  const sg__plan *p = e->plan;
  const size_t slice = sg__plan_slice_numel(p, b);
  sg__device *d = e->dev;
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, tmp + (size_t)e->rank * slice,
                      state + p->buckets[b].shard_offset, slice * 4, SG_COPY_D2D));
  SG_TRY(d->ops->sync(d, sg__engine_host_deadline(e)));
  return sg__engine_allgather(e, tmp, slice * 4);
}
