/* Gradient slots in one full buffer (NO_SHARD, SHARD_OPT): bucket b's slot is its region of
 * the buffer, reused once the bucket's previous reduction zeroed it. */
#include <stdlib.h>

#include "sg_policy.h"

static size_t gsize(const sg_engine *e) { return sg__dtype_size(e->cfg.grad_dtype); }

static sg_status full_init(sg_engine *e, void **state) {
  sg__slot_tickets *t = calloc(1, sizeof *t);
  if (t) t->bucket = calloc((size_t)e->plan->nbuckets, sizeof *t->bucket);
  if (!t || !t->bucket) {
    free(t);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  }
  *state = t;
  return SG_OK;
}

static void full_free(sg_engine *e, void *state) {
  sg__slot_tickets *t = state;
  if (!t) return;
  free(t->bucket);
  free(t);
}

static sg_status full_slot(sg_engine *e, void *state, int b, char **base, const char *fn) {
  const sg__slot_tickets *t = state;
  /* The bucket's previous reduction must have zeroed the region before it is written again. */
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, t->bucket[b],
                                                sg__deadline(e->cfg.timeout_ms));
  if (st != SG_OK) return sg__engine_broken(e, st);
  *base = e->g.slots + e->plan->buckets[b].start * gsize(e);
  return SG_OK;
}

static void full_release(sg_engine *e, void *state, int b, uint64_t ticket) {
  sg__slot_tickets *t = state;
  if (ticket) t->bucket[b] = ticket;
}

/* Bucket b's region is its own: written once per micro-batch, next by the next backward pass. */
static size_t full_idle_bytes(const sg_engine *e, const void *state, int b) {
  return e->plan->buckets[b].numel * gsize(e);
}

const sg__slots_ops sg__slots_full = {
    .name = "full", .init = full_init, .free = full_free, .slot = full_slot,
    .release = full_release, .idle_bytes = full_idle_bytes,
};
