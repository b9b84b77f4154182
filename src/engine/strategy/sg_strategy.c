/* The strategy table (sg__strategy_select): one ops table per sg_strategy value, each in its
 * own file. A new strategy adds its enum value, its file and its row here. */
#include "sg_strategy_common.h"

extern const sg__strategy_ops sg__strategy_no_shard;
extern const sg__strategy_ops sg__strategy_shard_opt;
extern const sg__strategy_ops sg__strategy_shard_grad_op;

static const sg__strategy_ops *const table[] = {
    [SG_NO_SHARD] = &sg__strategy_no_shard,
    [SG_SHARD_OPT] = &sg__strategy_shard_opt,
    [SG_SHARD_GRAD_OP] = &sg__strategy_shard_grad_op,
};
#define SG__NSTRATEGIES (sizeof table / sizeof table[0])

int sg__strategy_known(uint32_t s) { return s < SG__NSTRATEGIES && table[s] != NULL; }

const sg__strategy_ops *sg__strategy_select(sg_strategy s) {
  /* sg__config_check has rejected every other value */
  return sg__strategy_known((uint32_t)s) ? table[s] : table[SG_SHARD_GRAD_OP];
}
