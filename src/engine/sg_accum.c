/* The accumulator's helpers for the reductions (the strategies' reduce, the replica stage):
 * where a bucket's part lies and how a reduced slice enters it. They read the engine and the
 * device only: the files that own the accumulator (sg_grads.c) and the policies call them,
 * never the other way round. */
#include "sg_engine_internal.h"

static size_t asize(const sg_engine *e) { return sg__dtype_size(e->cfg.accum_dtype); }

char *sg__accum_of(const sg_engine *e, int b) {
  return e->g.accum + e->plan->buckets[b].shard_offset * asize(e);
}

sg_status sg__accum_into(sg_engine *e, size_t state_off, const void *src, size_t n, int first) {
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, rdt = e->cfg.reduce_dtype;
  char *acc = e->g.accum + state_off * asize(e);
  /* The first micro-batch is a copy (none when the dtypes agree on CUDA: a device copy), not
   * a zeroing pass plus an add: the same values, but for the sign of a zero sum, which it
   * keeps as reduced. */
  if (first) return d->ops->cast(d, SG_Q_COMM, acc, adt, src, rdt, n);
  return d->ops->accumulate(d, SG_Q_COMM, acc, adt, src, rdt, n);
}

/* Buckets not reduced since the accumulator was emptied count as zeros (a step or norm without
 * gradients, or with sg_set_sync(0) throughout): their parts are zeroed now. */
sg_status sg__accum_zero_empty(sg_engine *e) {
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (!e->g.empty[b]) continue;
    sg__owned ow;
    e->strat->owned(e->plan, e->rank, b, &ow);
    SG_TRY(e->dev->ops->zero(e->dev, SG_Q_COMPUTE, e->g.accum + ow.state0 * asize(e),
                             ow.n * asize(e)));
  }
  return SG_OK;
}
