/* The strategy table (sg__strategy_select): one ops table per sg_strategy value, each in its
 * own file. A new strategy adds its enum value, its file and its row here. */
#include "../policy/sg_policy.h"

extern const sg__strategy_ops sg__strategy_no_shard;
extern const sg__strategy_ops sg__strategy_shard_opt;
extern const sg__strategy_ops sg__strategy_shard_grad_op;
extern const sg__strategy_ops sg__strategy_shard_opt_offload;      /* sg_offload_ops.c */
extern const sg__strategy_ops sg__strategy_shard_grad_op_offload;
extern const sg__strategy_ops sg__strategy_no_shard_q8; /* sg_q8_ops.c */
extern const sg__strategy_ops sg__strategy_shard_opt_q8;
extern const sg__strategy_ops sg__strategy_shard_grad_op_q8;
extern const sg__strategy_ops sg__strategy_shard_opt_offload_q8; /* sg_offload_q8_ops.c */
extern const sg__strategy_ops sg__strategy_shard_grad_op_offload_q8;

/* [strategy][offload]: offload on the CUDA device only (on the CPU the state is host memory
 * already); NO_SHARD has no offloading variant (sg_engine_create refuses it). */
static const sg__strategy_ops *const offload_table[] = {
    [SG_SHARD_OPT] = &sg__strategy_shard_opt_offload,
    [SG_SHARD_GRAD_OP] = &sg__strategy_shard_grad_op_offload,
};
#define SG__NOFFLOAD (sizeof offload_table / sizeof offload_table[0])
/* [strategy]: offloaded with the state in 8-bit blocks (cfg.optim_state_dtype SG_Q8); the same
 * strategies as offload_table. */
static const sg__strategy_ops *const offload_q8_table[SG__NOFFLOAD] = {
    [SG_SHARD_OPT] = &sg__strategy_shard_opt_offload_q8,
    [SG_SHARD_GRAD_OP] = &sg__strategy_shard_grad_op_offload_q8,
};

/* [strategy]: the optimizer's state in 8-bit blocks (cfg.optim_state_dtype SG_Q8) on the
 * device. */
static const sg__strategy_ops *const q8_table[] = {
    [SG_NO_SHARD] = &sg__strategy_no_shard_q8,
    [SG_SHARD_OPT] = &sg__strategy_shard_opt_q8,
    [SG_SHARD_GRAD_OP] = &sg__strategy_shard_grad_op_q8,
};

static const sg__strategy_ops *const table[] = {
    [SG_NO_SHARD] = &sg__strategy_no_shard,
    [SG_SHARD_OPT] = &sg__strategy_shard_opt,
    [SG_SHARD_GRAD_OP] = &sg__strategy_shard_grad_op,
};
#define SG__NSTRATEGIES (sizeof table / sizeof table[0])

int sg__strategy_known(uint32_t s) { return s < SG__NSTRATEGIES && table[s] != NULL; }

int sg__strategy_offloads(const sg_config *cfg) {
  const uint32_t s = (uint32_t)cfg->strategy;
  return cfg->offload_optimizer && cfg->device == SG_DEVICE_CUDA && s < SG__NOFFLOAD &&
         offload_table[s] != NULL;
}

const sg__strategy_ops *sg__strategy_select(const sg_config *cfg) {
  const sg_strategy s = cfg->strategy;
  if (sg__strategy_offloads(cfg))
    return cfg->optim_state_dtype == SG_Q8 ? offload_q8_table[s] : offload_table[s];
  if (cfg->optim_state_dtype == SG_Q8 && sg__strategy_known((uint32_t)s)) return q8_table[s];
  /* sg__config_check has rejected every other value */
  return sg__strategy_known((uint32_t)s) ? table[s] : table[SG_SHARD_GRAD_OP];
}
