/* 8-bit optimizer state (cfg.optim_state_dtype SG_Q8, DESIGN.md section 10): every strategy
 * with the optimizer's state arrays in 8-bit blocks (policy/sg_state_q8.c). The slots,
 * ownership, reductions and gathers are those of the strategy; its shape adds the blocks. */
#include "../policy/sg_policy.h"

extern const sg__strategy_ops sg__strategy_no_shard;
extern const sg__strategy_ops sg__strategy_shard_opt;
extern const sg__strategy_ops sg__strategy_shard_grad_op;

/* The base strategy's ops under the q8 variant's names (a table cannot copy another's). */
#define SG__Q8_WRAP(v, base)                                                                      \
  static void v##_shape(const sg__plan *p, const sg_config *c, sg__layout_shape *o) {             \
    base.shape(p, c, o);                                                                          \
    sg__state_q8_shape(p, c, base.owned, o);                                                      \
  }                                                                                               \
  static void v##_owned(const sg__plan *p, int r, int b, sg__owned *o) { base.owned(p, r, b, o); } \
  static sg_status v##_reduce(sg_engine *e, int b, char *w, int f) { return base.reduce(e, b, w, f); }

SG__Q8_WRAP(no_shard, sg__strategy_no_shard)
SG__Q8_WRAP(shard_opt, sg__strategy_shard_opt)
SG__Q8_WRAP(grad_op, sg__strategy_shard_grad_op)

const sg__strategy_ops sg__strategy_no_shard_q8 = {
    .name = "NO_SHARD+q8", .reduce_label = "all-reduce", .shape = no_shard_shape,
    .owned = no_shard_owned, .reduce = no_shard_reduce, .slots = &sg__slots_full,
    .shard = &sg__shard_replicated, .place = &sg__state_q8,
};

const sg__strategy_ops sg__strategy_shard_opt_q8 = {
    .name = "SHARD_OPT+q8", .reduce_label = "reduce-scatter", .shape = shard_opt_shape,
    .owned = shard_opt_owned, .reduce = shard_opt_reduce, .slots = &sg__slots_full,
    .shard = &sg__shard_sharded, .place = &sg__state_q8,
};

const sg__strategy_ops sg__strategy_shard_grad_op_q8 = {
    .name = "SHARD_GRAD_OP+q8", .reduce_label = "reduce-scatter", .shape = grad_op_shape,
    .owned = grad_op_owned, .reduce = grad_op_reduce, .slots = &sg__slots_staging,
    .shard = &sg__shard_sharded, .place = &sg__state_q8,
};
