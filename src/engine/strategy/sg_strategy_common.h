/* Pieces that several strategies share (src/engine/strategy/ only): gradient slots in one full
 * buffer (NO_SHARD, SHARD_OPT), and what a sharded optimizer state needs (SHARD_OPT,
 * SHARD_GRAD_OP): ownership of one slice per bucket, reduce-scatter, the norm's all-reduce,
 * the gathers. */
#ifndef SG_STRATEGY_COMMON_H
#define SG_STRATEGY_COMMON_H

#include "../sg_engine_internal.h" /* engine, device, comm, plan */

/* full gradient buffer: bucket b's slot is its region of the buffer */
sg_status sg__slots_full_init(sg_engine *e, void **state);
void sg__slots_full_free(sg_engine *e, void *state);
sg_status sg__slots_full_slot(sg_engine *e, void *state, int b, char **base, const char *fn);
void sg__slots_full_release(sg_engine *e, void *state, int b, uint64_t ticket);
size_t sg__slots_full_idle_bytes(const sg_engine *e, const void *state, int b);

/* a pool of staging buffers (SHARD_GRAD_OP, sg_shard_grad_op.c): bucket b's slot is a
 * buffer of the pool while its gradients are written and reduced */
sg_status sg__staging_init(sg_engine *e, void **state);
void sg__staging_free(sg_engine *e, void *state);
sg_status sg__staging_slot(sg_engine *e, void *state, int b, char **base, const char *fn);
void sg__staging_release(sg_engine *e, void *state, int b, uint64_t ticket);
size_t sg__staging_idle_bytes(const sg_engine *e, const void *state, int b);

/* sharded state: this rank owns slice `rank` of every bucket (DESIGN.md section 2) */
void sg__sharded_owned(const sg__plan *p, int rank, int b, sg__owned *out);
/* the largest slice: the per-rank piece of a reduce-scatter or all-gather */
size_t sg__sharded_max_wire(const sg__plan *p);
/* Bucket b reduce-scattered in `wire` (reduce_dtype); *mine: this rank's reduced slice in it. */
sg_status sg__sharded_reduce_scatter(sg_engine *e, int b, char *wire, const char **mine);
sg_status sg__sharded_reduce(sg_engine *e, int b, char *wire, int first);
sg_status sg__sharded_sum_norm(sg_engine *e, double *dev_ss);
sg_status sg__sharded_gather(sg_engine *e, int b);
sg_status sg__sharded_gather_state(sg_engine *e, int b, const float *state, float *tmp);

/* Table entries of the shared pieces (designated initializers of sg__strategy_ops). */
#define SG__STAGING_OPS                                                                           \
  .slots_init = sg__staging_init, .slots_free = sg__staging_free, .slot = sg__staging_slot,      \
  .release = sg__staging_release, .slot_idle_bytes = sg__staging_idle_bytes
#define SG__SLOTS_FULL_OPS                                                                        \
  .slots_init = sg__slots_full_init, .slots_free = sg__slots_full_free,                          \
  .slot = sg__slots_full_slot, .release = sg__slots_full_release,                               \
  .slot_idle_bytes = sg__slots_full_idle_bytes
#define SG__SHARDED_OPS                                                                           \
  .owned = sg__sharded_owned, .reduce = sg__sharded_reduce, .sum_norm = sg__sharded_sum_norm,    \
  .gather = sg__sharded_gather, .gather_state = sg__sharded_gather_state

/* Per-bucket tickets of the job that last zeroed each bucket's slot, for strategies' slots. */
typedef struct sg__slot_tickets {
  uint64_t *bucket; /* [nbuckets] */
} sg__slot_tickets;

#endif /* SG_STRATEGY_COMMON_H */
