/* SG_SHARD_OPT (ZeRO-1): every rank keeps the full gradient buffer, but the optimizer state
 * (master, moments, accumulator) only for its slice of each bucket; a bucket is
 * reduce-scattered in place, and the updated slices are gathered after the step. */
#include "../policy/sg_policy.h"

static void shape(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  out->opt_numel = p->shard_numel;
  out->slots_bytes = sg__mem_mul_sat(p->total_numel, sg__dtype_size(cfg->grad_dtype));
  out->nstaging = 0;
  out->staging_numel = 0;
  out->max_wire = sg__sharded_max_wire(p);
}

const sg__strategy_ops sg__strategy_shard_opt = {
    .name = "SHARD_OPT", .reduce_label = "reduce-scatter", .shape = shape,
    .owned = sg__sharded_owned, .reduce = sg__sharded_reduce, .slots = &sg__slots_full,
    .shard = &sg__shard_sharded, .place = &sg__state_device,
};
