/* SG_NO_SHARD (DDP): every rank keeps every gradient and all optimizer state; a bucket is
 * all-reduced into the full accumulator, and every rank updates every parameter. */
#include "../policy/sg_policy.h"

static void shape(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  out->opt_numel = p->total_numel;
  out->slots_bytes = sg__mem_mul_sat(p->total_numel, sg__dtype_size(cfg->grad_dtype));
  out->nstaging = 0;
  out->staging_numel = 0;
  /* the ring all-reduce's per-rank piece */
  out->max_wire = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const size_t s = (p->buckets[b].numel + (size_t)p->world - 1) / (size_t)p->world;
    if (s > out->max_wire) out->max_wire = s;
  }
}

static void owned(const sg__plan *p, int rank, int b, sg__owned *out) {
  out->flat0 = p->buckets[b].start;
  out->n = p->buckets[b].numel;
  out->state0 = p->buckets[b].start;
}

static sg_status reduce(sg_engine *e, int b, char *wire, int first) {
  const sg__bucket *bk = &e->plan->buckets[b];
  const int rdt = e->cfg.reduce_dtype;
  SG_TRY(e->comm->ops->all_reduce(e->comm, wire, bk->numel, rdt, sg__deadline(e->cfg.timeout_ms)));
  return sg__accum_into(e, bk->start, wire, bk->numel, first);
}

const sg__strategy_ops sg__strategy_no_shard = {
    .name = "NO_SHARD", .reduce_label = "all-reduce", .shape = shape, .owned = owned,
    .reduce = reduce, .slots = &sg__slots_full, .shard = &sg__shard_replicated,
    .place = &sg__state_device,
};
