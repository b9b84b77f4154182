/* Strategies (DESIGN.md sections 1 and 4): what a rank keeps of the gradients and optimizer
 * state, and how a bucket is reduced and the parameters refreshed. One ops table per strategy,
 * one file each under src/engine/strategy/, picked once at sg_engine_create from the table in
 * strategy/sg_strategy.c (sg__strategy_select); the engine calls through e->strat and never
 * looks at cfg.strategy again.
 *
 * Coordinates: "flat" is the full working-parameter buffer of the plan (every rank has all of
 * it); "state" indexes the fp32 optimizer state arrays, the master and the accumulator, which
 * hold either everything (replicated, state index = flat index) or this rank's shard (the
 * concatenation of its slices, DESIGN.md section 2). */
#ifndef SG_STRATEGY_H
#define SG_STRATEGY_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h"     /* sg_status, sg_config */
#include "../memory/sg_memory.h" /* sg__layout_shape */
#include "../plan/sg_plan.h"     /* sg__plan */

typedef struct sg_engine sg_engine;

/* The run of bucket b whose optimizer state this rank holds: flat elements [flat0, flat0 + n),
 * at state index state0 onwards. */
typedef struct sg__owned {
  size_t flat0, n, state0;
} sg__owned;

typedef struct sg__strategy_ops {
  const char *name;         /* "SHARD_GRAD_OP": trace metadata, logs */
  const char *reduce_label; /* trace label of a bucket's reduction ("reduce-scatter") */

  /* Memory: the sizes it keeps, from the plan and config alone, so that sg_memory and
   * sg_estimate_memory agree. Fills every field but nstates (the optimizer's). */
  void (*shape)(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out);
  /* Ownership of bucket b on `rank`: a pure function of the plan. Every flat element of a
   * bucket is owned by at least this rank or gathered from the one that owns it. */
  void (*owned)(const sg__plan *p, int rank, int b, sg__owned *out);

  /* Gradient slots. init at sg_finalize (after the arenas), free at destroy (NULL is fine):
   * the strategy's own slot bookkeeping, in *state. */
  sg_status (*slots_init)(sg_engine *e, void **state);
  void (*slots_free)(sg_engine *e, void *state);
  /* Bucket b's slot for this micro-batch (its element bucket.start), zeroed and ready for the
   * compute queue to write: waits, on the compute queue, for the job that last zeroed it. */
  sg_status (*slot)(sg_engine *e, void *state, int b, char **base, const char *fn);
  /* Bucket b is done with its slot until the next micro-batch: comm job `ticket` zeroes it
   * (0: no new job; it was zeroed on the compute queue). */
  void (*release)(sg_engine *e, void *state, int b, uint64_t ticket);

  /* On the comm queue: sums bucket b over the ranks from `wire` (reduce_dtype, the whole
   * bucket, may be used as scratch) and adds this rank's owned part into the accumulator. */
  sg_status (*reduce)(sg_engine *e, int b, char *wire);
  /* The step's norm partials (sum of squares, non-finite count) summed over the ranks that
   * share the gradient. NULL: every rank already holds all of it (replicated accumulator). */
  sg_status (*sum_norm)(sg_engine *e, double ss[2]);
  /* On the comm queue, after bucket b's update: the other ranks' parts of its working
   * parameters. NULL: every rank updated all of them. */
  sg_status (*gather)(sg_engine *e, int b);
  /* Bucket b of an fp32 state array in full into tmp (device memory, bucket numel floats),
   * through the comm queue (collective). NULL: the state is replicated. */
  sg_status (*gather_state)(sg_engine *e, int b, const float *state, float *tmp);
} sg__strategy_ops;

/* The ops of cfg->strategy (validated by sg__config_check). */
const sg__strategy_ops *sg__strategy_select(sg_strategy s);
/* 1 when s names a strategy of the table (a checkpoint's manifest). */
int sg__strategy_known(uint32_t s);

/* State index of flat element `flat` of bucket b, which `rank` owns. */
static inline size_t sg__strategy_state_index(const sg__strategy_ops *st, const sg__plan *p,
                                              int rank, int b, size_t flat) {
  sg__owned o;
  st->owned(p, rank, b, &o);
  return o.state0 + (flat - o.flat0);
}

#endif /* SG_STRATEGY_H */
