/* Streaming outer steps (cfg.outer_every = H with cfg.outer_streaming = 1, docs/slow-links.md):
 * the outer steps of sg_replica_outer.c spread over the period and overlapped with the inner
 * steps. The buckets fall into H groups, bucket b into group b mod H. The rule, per group:
 *
 *   end of step n (the k-th of its period, group g = k - 1): d = po - theta of this rank's runs
 *     of group g's buckets; their sum across the replicas begins on the replica channel's own
 *     host queue (f32 or bf16 wire, or the int8 codes of sg_replica_outer_int8.c), and sg_step
 *     returns. Step n + 1's forward and backward run meanwhile on the parameters as they are.
 *   step n + 1, once its gradients are reduced (finish: in sg_step, or sg_grad_norm), before its
 *     update: the sum is waited for, the Nesterov step of group g's po and m taken, theta = po
 *     for group g (the same bits on every replica), gathered in the node; then step n + 1's
 *     update applies its gradient, computed on the parameters before the merge, on top. So the
 *     replica's progress during the sum's flight is kept (through that gradient), and the outer
 *     update lands one inner step late (tau = 1).
 *
 * The sum runs beside the node's reductions (its own queue and thread, its own comm scratch), so
 * the link is busy while the next step computes. The pseudo-gradient buffer holds the largest
 * group's runs (sg_replica_outer.c sizes it), as a group's sum is in flight across a step.
 * sg_save merges the sum in flight first (as the next step would: the checkpoint has nothing in
 * flight, and the forward pass after a save sees that group's merged parameters one step
 * early); sg_load drops it (the loaded state replaces what it would merge). The checkpoint
 * sections are the non-streaming variant's (the position in the period says which group is
 * next). The state here: whether a sum is in flight (its ticket: rep.host_last), and of which
 * group, after the outer state (and the codec's) in the layout's replica buffer. With an
 * offloaded optimizer (CUDA; the _host tables) the buffer is pinned host memory, delta and apply
 * take the host's place (sg_replica_outer_host.c: the host master, the working values H2D) and
 * the host queue's CPU device does the element work. */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memset */

#include "sg_replica_policy.h"

typedef struct {
  int pending; /* a group's sum is queued on the host queue and not merged yet */
  int group;   /* that group */
} stream_state;

/* The runs of a hybrid engine's buckets are their slices (a sharded strategy). */
static size_t run_numel(const sg_engine *e, int b) {
  sg__owned o;
  e->strat->owned(e->plan, e->rank, b, &o);
  return o.n;
}

/* fp32 partials of a bf16/f16 all-reduce over three or more replicas (sg_coll.c): this
 * channel's own scratch, as its collectives run beside the shard channel's. */
static size_t scratch_bytes(const sg__plan *p, const sg_config *cfg, int n) {
  if (cfg->replica_codec != SG_CODEC_NONE || cfg->replica_reduce_dtype == SG_F32 || n < 3) return 0;
  return 4u * (sg__plan_max_slice_numel(p) / (size_t)n + 1u);
}

/* This file's part begins after the outer state (and the codec's), 64-byte aligned. */
static size_t own_off(const sg__plan *p, const sg_config *cfg, int n) {
  const size_t base = cfg->replica_codec != SG_CODEC_NONE ? sg__replica_outer_int8_bytes(p, cfg, n)
                                                          : sg__replica_outer_bytes(p, cfg);
  return (base + 63u) / 64u * 64u;
}

size_t sg__replica_outer_stream_bytes(const sg__plan *p, const sg_config *cfg, int n) {
  return own_off(p, cfg, n) + 64u + scratch_bytes(p, cfg, n);
}

static stream_state *state_of(const sg_engine *e) {
  return (stream_state *)(sg__replica_buf(e) + own_off(e->plan, &e->cfg, e->rep.n));
}

static sg_status prepare_own(sg_engine *e) {
  stream_state *s = state_of(e);
  memset(s, 0, sizeof *s);
  const size_t sb = scratch_bytes(e->plan, &e->cfg, e->rep.n);
  if (sb) sg__comm_set_scratch(e->rep.comm, (char *)s + 64, sb);
  return SG_OK;
}

static sg_status prepare(sg_engine *e) {
  SG_TRY(sg__replica_outer_prepare(e));
  return prepare_own(e);
}

static sg_status prepare_int8(sg_engine *e) {
  SG_TRY(sg__replica_outer_int8_prepare(e));
  return prepare_own(e);
}

static void release_int8(sg_engine *e) {
  sg__replica_codec_release(e);
  sg__replica_staged_release(e);
}

/* An offloaded optimizer (CUDA): the outer state and its place on the host
 * (sg_replica_outer_host.c); the host queue is the element work's CPU device too. */
static sg_status prepare_host(sg_engine *e) {
  SG_TRY(sg__replica_outer_host_prepare(e));
  return prepare_own(e);
}

static sg_status prepare_host_int8(sg_engine *e) {
  SG_TRY(sg__replica_outer_host_prepare_int8(e));
  return prepare_own(e);
}

/* ---- the sum in flight ---------------------------------------------------------------------- */

typedef struct {
  sg_engine *e;
  int group;
  sg__outer_sum_fn sum;
} sum_job;

/* Host queue: the group's runs, packed in the pseudo-gradient buffer, summed across replicas.
 * It touches that buffer, the wire or the codec's buffers and the replica channel only. */
static sg_status sum_job_fn(void *arg) {
  const sum_job *j = arg;
  sg_engine *e = j->e;
  float *d = sg__replica_outer_dbuf(e);
  for (int b = j->group; b < e->plan->nbuckets; b += e->cfg.outer_every) {
    const size_t n = run_numel(e, b);
    SG_TRY(j->sum(e, b, d, n));
    d += n;
  }
  return SG_OK;
}

/* The sum in flight, if any, waited for and merged: the outer step of its group's buckets (their
 * parameters become the new po) and the node's gathers of them. */
static sg_status merge(sg_engine *e) {
  stream_state *s = state_of(e);
  if (!s->pending) return SG_OK;
  s->pending = 0;
  SG_TRY(sg__engine_broken(e, sg__replica_staged_drain(e)));
  const float *d = sg__replica_outer_dbuf(e);
  for (int b = s->group; b < e->plan->nbuckets; b += e->cfg.outer_every) {
    SG_TRY(sg__engine_broken(e, sg__replica_outer_apply(e, b, d)));
    d += run_numel(e, b);
  }
  return sg__engine_broken(e, sg__replica_outer_gather(e, s->group, e->cfg.outer_every));
}

/* End of a step whose group has buckets (after its gathers landed): the group's
 * pseudo-gradient, and its sum queued. */
static sg_status start(sg_engine *e, sg__outer_sum_fn sum) {
  SG_TRY(merge(e)); /* none: this step's finish merged the last one */
  stream_state *s = state_of(e);
  const int g = sg__replica_outer_group(e);
  float *d = sg__replica_outer_dbuf(e);
  for (int b = g; b < e->plan->nbuckets; b += e->cfg.outer_every) {
    size_t n;
    SG_TRY(sg__replica_outer_delta(e, b, d, &n));
    d += n;
  }
  sum_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  *j = (sum_job){e, g, sum};
  s->pending = 1;
  s->group = g;
  sg__device *h = e->rep.host_dev;
  return sg__engine_broken(e, h->ops->comm_submit(h, sum_job_fn, free, j, &e->rep.host_last));
}

static sg_status sync_wire(sg_engine *e) { return start(e, sg__replica_outer_wire_sum); }

static sg_status sync_int8(sg_engine *e) { return start(e, sg__replica_outer_int8_sum); }

/* The step's part once its gradients are reduced: the first step's outer state, then the merge
 * of the sum the last step began (before this step's update). */
static sg_status finish(sg_engine *e) {
  SG_TRY(sg__replica_outer_finish(e));
  return merge(e);
}

/* ---- checkpoints: a save merges first (nothing in flight is saved); a load drops the sum in
 * flight (waited for, so that nothing writes the codec's residuals the load restores; a failed
 * sum stays the queue's failure, which its next wait reports). ---- */

static sg_status save(sg_engine *e, sg__rep_ck *ck) {
  SG_TRY(merge(e));
  return sg__replica_outer_save(e, ck);
}

static sg_status save_int8(sg_engine *e, sg__rep_ck *ck) {
  SG_TRY(merge(e));
  return sg__replica_outer_int8_save(e, ck);
}

static void drop(sg_engine *e) {
  (void)sg__replica_staged_drain(e);
  state_of(e)->pending = 0;
}

static void restore(sg_engine *e, const sg__rep_ck *ck) {
  drop(e);
  sg__replica_outer_restore(e, ck);
}

static void restore_int8(sg_engine *e, const sg__rep_ck *ck) {
  drop(e);
  sg__replica_outer_int8_restore(e, ck);
}

/* Both tables: the host queue (made by select) runs the sums and the channel's other
 * collectives; the comm scratch is this file's own. */
#define STREAM_ENTRIES                                                                            \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .claim = sg__replica_outer_claim, .finish = finish,   \
  .run = sg__replica_staged_run, .drain = sg__replica_staged_drain,                              \
  .grad_replicas = sg__replica_outer_grad_replicas, .sync_due = sg__replica_outer_stream_due

const sg__replica_ops sg__replica_outer_stream = {
    .name = "host, streaming outer steps", STREAM_ENTRIES, .prepare = prepare,
    .release = sg__replica_staged_release, .sync = sync_wire,
    .ck_describe = sg__replica_outer_describe, .ck_save = save, .restore = restore,
};

const sg__replica_ops sg__replica_outer_stream_int8 = {
    .name = "host, streaming outer steps, int8 codes", STREAM_ENTRIES, .prepare = prepare_int8,
    .release = release_int8, .sync = sync_int8, .ck_describe = sg__replica_outer_int8_describe,
    .ck_save = save_int8, .restore = restore_int8,
};

const sg__replica_ops sg__replica_outer_stream_host = {
    .name = "offloaded, streaming outer steps", STREAM_ENTRIES, .prepare = prepare_host,
    .release = sg__replica_outer_host_release, .sync = sync_wire,
    .ck_describe = sg__replica_outer_describe, .ck_save = save, .restore = restore,
};

const sg__replica_ops sg__replica_outer_stream_host_int8 = {
    .name = "offloaded, streaming outer steps, int8 codes", STREAM_ENTRIES,
    .prepare = prepare_host_int8, .release = sg__replica_outer_host_release_int8,
    .sync = sync_int8, .ck_describe = sg__replica_outer_int8_describe, .ck_save = save_int8,
    .restore = restore_int8,
};
