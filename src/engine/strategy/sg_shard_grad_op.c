/* SG_SHARD_GRAD_OP (ZeRO-2): gradients of a bucket are written into one of a few staging
 * buffers, reduce-scattered from there into the fp32 shard accumulator, and the staging buffer
 * is recycled; the optimizer state and accumulator are kept for this rank's slices only, and
 * the updated slices are gathered after the step. */
#include "../policy/sg_policy.h"

static size_t align_up(size_t x) { return (x + SG_MEM_ALIGN - 1) / SG_MEM_ALIGN * SG_MEM_ALIGN; }

static void shape(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  out->opt_numel = p->shard_numel;
  out->nstaging = cfg->staging_buckets < p->nbuckets ? cfg->staging_buckets : p->nbuckets;
  out->staging_numel = p->max_bucket_numel;
  out->slots_bytes = sg__mem_mul_sat(
      align_up(sg__mem_mul_sat(out->staging_numel, sg__dtype_size(cfg->grad_dtype))),
      (size_t)out->nstaging);
  out->max_wire = sg__sharded_max_wire(p);
}

const sg__strategy_ops sg__strategy_shard_grad_op = {
    .name = "SHARD_GRAD_OP", .reduce_label = "reduce-scatter", .shape = shape,
    .owned = sg__sharded_owned, .reduce = sg__sharded_reduce, .slots = &sg__slots_staging,
    .shard = &sg__shard_sharded, .place = &sg__state_device,
};
