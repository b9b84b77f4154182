/* Optimizer offload (issue 12, DESIGN.md section 4): SG_SHARD_GRAD_OP and SG_SHARD_OPT with the
 * shard's fp32 master, moments and accumulator in pinned host memory (src/offload/sg_offload.c
 * owns them, in e->off). The gradient slots, the reduce-scatter, the norm's all-reduce and the
 * gathers are those of the strategy offloaded; what changes is where the reduced slice goes
 * (D2H on the comm queue, accumulated on the host) and who updates the state (the CPU, bucket
 * by bucket, each bucket's new working values copied H2D before its gather). */
#include "../policy/sg_policy.h"

extern const sg__strategy_ops sg__strategy_shard_grad_op;
extern const sg__strategy_ops sg__strategy_shard_opt;

static void shape_grad_op(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  sg__strategy_shard_grad_op.shape(p, cfg, out);
  sg__state_host_shape(p, cfg, out);
}
static void shape_opt(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  sg__strategy_shard_opt.shape(p, cfg, out);
  sg__state_host_shape(p, cfg, out);
}

#define SG__OFFLOAD_OPS                                                                           \
  .owned = sg__sharded_owned, .reduce = sg__state_host_reduce, .shard = &sg__shard_sharded,      \
  .place = &sg__state_host

const sg__strategy_ops sg__strategy_shard_grad_op_offload = {
    .name = "SHARD_GRAD_OP+offload", .reduce_label = "reduce-scatter", .shape = shape_grad_op,
    .slots = &sg__slots_staging, SG__OFFLOAD_OPS,
};

const sg__strategy_ops sg__strategy_shard_opt_offload = {
    .name = "SHARD_OPT+offload", .reduce_label = "reduce-scatter", .shape = shape_opt,
    .slots = &sg__slots_full, SG__OFFLOAD_OPS,
};
