/* 8-bit optimizer state with optimizer offload (cfg.optim_state_dtype SG_Q8 and
 * offload_optimizer on the CUDA device, DESIGN.md sections 4 and 10): SG_SHARD_GRAD_OP and
 * SG_SHARD_OPT offloaded as in sg_offload_ops.c, the state in 8-bit blocks in pinned host
 * memory (policy/sg_state_host_q8.c). The slots, reductions and gathers are the offloaded
 * strategy's; its shape adds the blocks (aligned to tensors and slices by the planner). */
#include "../policy/sg_policy.h"

extern const sg__strategy_ops sg__strategy_shard_grad_op_offload;
extern const sg__strategy_ops sg__strategy_shard_opt_offload;

static void shape_grad_op(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  sg__strategy_shard_grad_op_offload.shape(p, cfg, out);
  sg__state_q8_shape(p, cfg, sg__sharded_owned, out);
}
static void shape_opt(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  sg__strategy_shard_opt_offload.shape(p, cfg, out);
  sg__state_q8_shape(p, cfg, sg__sharded_owned, out);
}

#define SG__OFFLOAD_Q8_OPS                                                                        \
  .owned = sg__sharded_owned, .reduce = sg__state_host_reduce, .shard = &sg__shard_sharded,      \
  .place = &sg__state_host_q8

const sg__strategy_ops sg__strategy_shard_grad_op_offload_q8 = {
    .name = "SHARD_GRAD_OP+offload+q8", .reduce_label = "reduce-scatter",
    .shape = shape_grad_op, .slots = &sg__slots_staging, SG__OFFLOAD_Q8_OPS,
};

const sg__strategy_ops sg__strategy_shard_opt_offload_q8 = {
    .name = "SHARD_OPT+offload+q8", .reduce_label = "reduce-scatter", .shape = shape_opt,
    .slots = &sg__slots_full, SG__OFFLOAD_Q8_OPS,
};
