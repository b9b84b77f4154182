/* What the policy files (src/engine/policy/, the tables of sg_strategy.h) share among
 * themselves and with the strategy files that point at them. Policies call the engine's base
 * services and the accumulator's helpers, never the files that call through them. */
#ifndef SG_POLICY_H
#define SG_POLICY_H

#include "../sg_engine_internal.h" /* engine, device, comm, plan */

/* Per-bucket tickets of the job that last zeroed each bucket's slot (both slot policies). */
typedef struct sg__slot_tickets {
  uint64_t *bucket; /* [nbuckets] */
} sg__slot_tickets;

/* sg_shard_sharded.c: this rank owns slice `rank` of every bucket (DESIGN.md section 2). */
void sg__sharded_owned(const sg__plan *p, int rank, int b, sg__owned *out);
/* the largest slice: the per-rank piece of a reduce-scatter or all-gather */
size_t sg__sharded_max_wire(const sg__plan *p);
/* Bucket b reduce-scattered in `wire` (reduce_dtype); *mine: this rank's reduced slice in it. */
sg_status sg__sharded_reduce_scatter(sg_engine *e, int b, char *wire, const char **mine);
/* The strategy's reduce of a sharded state in the device accumulator. */
sg_status sg__sharded_reduce(sg_engine *e, int b, char *wire, int first);

/* sg_state_host.c: the host memory the offloading strategies keep (their shape), and their
 * reduce (the reduce-scatter, its slice delivered to the host). */
void sg__state_host_shape(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out);
sg_status sg__state_host_reduce(sg_engine *e, int b, char *wire, int first);
/* Its state (e->off) with optimizer od's fp32 arrays (od NULL: master and accumulator only,
 * `others` pinned bytes of the layout's host_bytes kept by the caller: sg_state_host_q8.c). */
sg_status sg__state_host_make(sg_engine *e, const sg__optim_desc *od, size_t others);
/* The host update of a->segs with od's loop over a's state arrays (a->state, a->q8_*). */
sg_status sg__state_host_update_with(sg_engine *e, const sg__optim_desc *od,
                                     const sg__update_args *a);

/* sg_state_q8.c: the 8-bit state's blocks (the q8 strategies' shape; `owned` the strategy's). */
void sg__state_q8_shape(const sg__plan *p, const sg_config *cfg,
                        void (*owned)(const sg__plan *, int, int, sg__owned *),
                        sg__layout_shape *out);
/* Its arrays in pinned host memory instead of the OPTIM arena (the host placement,
 * sg_state_host_q8.c): made (e->q8; *bytes: the pinned bytes held, the layout's count) and
 * freed; the update's arguments over them (a->segs cut at blocks, the 8-bit arrays). */
sg_status sg__state_q8_make_host(sg_engine *e, size_t *bytes);
void sg__state_q8_free(sg_engine *e);
sg_status sg__state_q8_args(sg_engine *e, const sg__update_args *a, sg__update_args *out);

#endif /* SG_POLICY_H */
