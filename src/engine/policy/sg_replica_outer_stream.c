/* Streaming outer steps (cfg.outer_every = H with cfg.outer_streaming = 1, docs/slow-links.md):
 * the outer steps of sg_replica_outer.c spread over the period and overlapped with the inner
 * steps. The buckets fall into H groups, bucket b into group b mod H. The rule, per group:
 *
 *   end of step n (the k-th of its period, group g = k - 1): d = po - theta of this rank's runs
 *     of group g's buckets, and their sum across the replicas (f32 or bf16 wire, or the int8
 *     codes of sg_replica_outer_int8.c) queued beside the node's reductions; sg_step returns.
 *     Step n + 1's forward and backward run meanwhile on the parameters as they are.
 *   step n + 1, once its gradients are reduced (finish: in sg_step, or sg_grad_norm), before its
 *     update: the sum is waited for, the Nesterov step of group g's po and m taken, theta = po
 *     for group g (the same bits on every replica), gathered in the node; then step n + 1's
 *     update applies its gradient, computed on the parameters before the merge, on top. So the
 *     replica's progress during the sum's flight is kept (through that gradient), and the outer
 *     update lands one inner step late (tau = 1).
 *
 * Where the sum runs (sg_replica_select.c chose it) is what keeps the next step's in-node
 * reduce-scatters from queueing behind it:
 *   - a queue of its own, rep.host_dev: the CPU device's host queue, or on a CUDA device with
 *     host-driven communicators (threads, MPI) the device's twin (its own worker and streams;
 *     the replica channel is bound to it). The pseudo-gradient is a job on the engine's replica
 *     queue (after the step's update and gathers); the sum's job on rep.host_dev waits for that
 *     job's ticket, then runs the collectives (and its casts or codes on the twin);
 *   - no host_dev (CUDA, NCCL): one job on the engine's replica lane, pseudo-gradient and sum,
 *     its work on the lane's own stream; later reduce-scatters on the comm stream do not wait
 *     for it, and its ticket is what the merge waits for.
 * The Nesterov step is a job on the engine's replica queue, as without streaming, so on either
 * device it follows the compute queue's work and precedes the update.
 *
 * The sum has its own comm scratch (this file's part of the layout's replica buffer), as its
 * collectives run beside the shard channel's. The pseudo-gradient buffer holds
 * the largest group's runs (sg_replica_outer.c sizes it), as a group's sum is in flight across
 * a step. sg_save merges the sum in flight first (as the next step would: the checkpoint has
 * nothing in flight, and the forward pass after a save sees that group's merged parameters one
 * step early); sg_load drops it (the loaded state replaces what it would merge). The checkpoint
 * sections are the non-streaming variant's (the position in the period says which group is
 * next). The host state (rep.stream: whether a sum is in flight, of which group, its ticket on
 * the lane; rep.host_last on a host queue) is this file's. With an offloaded optimizer (CUDA;
 * the _host tables) the replica buffer is pinned host memory, delta and apply take the host's
 * place (sg_replica_outer_host.c: the host master, the working values H2D) and the host queue's
 * CPU device does the element work. */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memset */

#include "sg_replica_policy.h"

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

/* This file's part (the comm scratch) begins after the outer state (and the codec's), 64-byte
 * aligned. */
static size_t own_off(const sg__plan *p, const sg_config *cfg, int n) {
  const size_t base = cfg->replica_codec != SG_CODEC_NONE ? sg__replica_outer_int8_bytes(p, cfg, n)
                                                          : sg__replica_outer_bytes(p, cfg);
  return (base + 63u) / 64u * 64u;
}

size_t sg__replica_outer_stream_bytes(const sg__plan *p, const sg_config *cfg, int n) {
  return own_off(p, cfg, n) + scratch_bytes(p, cfg, n);
}

/* The comm scratch: in the replica buffer, like the sums' buffers (device memory on a CUDA
 * device, pinned host memory with an offloaded optimizer). */
static sg_status prepare_own(sg_engine *e) {
  memset(&e->rep.stream, 0, sizeof e->rep.stream);
  char *own = sg__replica_buf(e) + own_off(e->plan, &e->cfg, e->rep.n);
  const size_t sb = scratch_bytes(e->plan, &e->cfg, e->rep.n);
  if (sb) sg__comm_set_scratch(e->rep.comm, own, sb);
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
  uint64_t after; /* a host_dev job: the engine's job that wrote the pseudo-gradient */
} sum_job;

/* The group's pseudo-gradient: its runs packed in the pseudo-gradient buffer (engine's device,
 * the replica queue's element work). */
static sg_status delta_fn(void *arg) {
  const sum_job *j = arg;
  float *d = sg__replica_outer_dbuf(j->e);
  for (int b = j->group; b < j->e->plan->nbuckets; b += j->e->cfg.outer_every) {
    size_t n;
    SG_TRY(sg__replica_outer_delta(j->e, b, d, &n));
    d += n;
  }
  return SG_OK;
}

/* The group's runs summed across replicas. It touches the pseudo-gradient buffer, the wire or
 * the codec's buffers and the replica channel only. */
static sg_status sum_fn(const sum_job *j) {
  sg_engine *e = j->e;
  float *d = sg__replica_outer_dbuf(e);
  for (int b = j->group; b < e->plan->nbuckets; b += e->cfg.outer_every) {
    const size_t n = run_numel(e, b);
    SG_TRY(j->sum(e, b, d, n));
    d += n;
  }
  return SG_OK;
}

/* rep.host_dev's queue: once the pseudo-gradient is written, the sum. */
static sg_status queued_sum_fn(void *arg) {
  const sum_job *j = arg;
  sg_engine *e = j->e;
  if (j->after) SG_TRY(e->dev->ops->comm_wait(e->dev, j->after, sg__engine_host_deadline(e)));
  return sum_fn(j);
}

/* The engine's replica lane: both in one job. */
static sg_status lane_sum_fn(void *arg) {
  SG_TRY(delta_fn(arg));
  return sum_fn(arg);
}

static sg_status new_job(sg_engine *e, sg__outer_sum_fn sum, sum_job **out) {
  *out = malloc(sizeof **out);
  if (!*out) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  **out = (sum_job){e, e->rep.stream.group, sum, 0};
  return SG_OK;
}

/* The group's sum queued where select put it (see the top). */
static sg_status queue_sum(sg_engine *e, sg__outer_sum_fn sum) {
  sum_job *dj = NULL, *sj = NULL;
  if (!e->rep.host_dev) {
    SG_TRY(new_job(e, sum, &sj));
    return sg__engine_submit_replica(e, lane_sum_fn, free, sj, &e->rep.stream.ticket);
  }
  SG_TRY(new_job(e, sum, &dj));
  uint64_t t = 0;
  if (sg__replica_outer_on_host(e)) { /* offloaded: from this thread, written when it returns */
    const sg_status st = delta_fn(dj);
    free(dj);
    SG_TRY(st);
  } else {
    SG_TRY(sg__engine_submit_replica(e, delta_fn, free, dj, &t));
  }
  SG_TRY(new_job(e, sum, &sj));
  sj->after = t;
  sg__device *h = e->rep.host_dev;
  return h->ops->comm_submit(h, queued_sum_fn, free, sj, &e->rep.host_last);
}

/* The sum in flight, if any, done (its failure, if any). */
static sg_status wait_sum(sg_engine *e) {
  if (e->rep.host_dev) return sg__replica_staged_drain(e);
  if (!e->rep.stream.ticket) return SG_OK;
  return e->dev->ops->comm_wait(e->dev, e->rep.stream.ticket, sg__engine_host_deadline(e));
}

/* The Nesterov step of the group's buckets from their summed runs (a job on the engine's
 * replica queue, as the non-streaming bucket job's). */
static sg_status apply_fn(void *arg) {
  const sum_job *j = arg;
  const float *d = sg__replica_outer_dbuf(j->e);
  for (int b = j->group; b < j->e->plan->nbuckets; b += j->e->cfg.outer_every) {
    SG_TRY(sg__replica_outer_apply(j->e, b, d));
    d += run_numel(j->e, b);
  }
  return SG_OK;
}

/* The sum in flight, if any, waited for and merged: the outer step of its group's buckets (their
 * parameters become the new po) and the node's gathers of them. */
static sg_status merge(sg_engine *e) {
  if (!e->rep.stream.pending) return SG_OK;
  e->rep.stream.pending = 0;
  SG_TRY(sg__engine_broken(e, wait_sum(e)));
  sum_job j = {e, e->rep.stream.group, NULL, 0};
  if (sg__replica_outer_on_host(e)) /* offloaded: from this thread, as the delta */
    SG_TRY(sg__engine_broken(e, apply_fn(&j)));
  else
    SG_TRY(sg__replica_run_comm(e, apply_fn, &j));
  return sg__engine_broken(e, sg__replica_outer_gather(e, j.group, e->cfg.outer_every));
}

/* End of a step whose group has buckets (after its gathers landed): the group's
 * pseudo-gradient and its sum queued. */
static sg_status start(sg_engine *e, sg__outer_sum_fn sum) {
  SG_TRY(merge(e)); /* none: this step's finish merged the last one */
  e->rep.stream.pending = 1;
  e->rep.stream.group = sg__replica_outer_group(e);
  return sg__engine_broken(e, queue_sum(e, sum));
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
  (void)wait_sum(e);
  e->rep.stream.pending = 0;
}

static void restore(sg_engine *e, const sg__rep_ck *ck) {
  drop(e);
  sg__replica_outer_restore(e, ck);
}

static void restore_int8(sg_engine *e, const sg__rep_ck *ck) {
  drop(e);
  sg__replica_outer_int8_restore(e, ck);
}

/* Host-side collectives of the channel (agreement, checkpoint votes, broadcasts): on the sums'
 * queue, after them. A twin follows none of the engine's queues: their work so far first. */
static sg_status run(sg_engine *e, sg__job_fn fn, void *arg) {
  if (!e->rep.host_dev) return sg__replica_run_comm(e, fn, arg);
  const int64_t dl = sg__engine_host_deadline(e);
  if (e->last_ticket)
    SG_TRY(sg__engine_broken(e, e->dev->ops->comm_wait(e->dev, e->last_ticket, dl)));
  SG_TRY(sg__engine_broken(e, e->dev->ops->sync(e->dev, dl)));
  return sg__replica_staged_run(e, fn, arg);
}

/* At detach: the sums' queue drained (the lane's jobs: the engine's queue drains anyway). */
static sg_status drain(sg_engine *e) {
  return e->rep.host_dev ? sg__replica_staged_drain(e) : SG_OK;
}

/* Both tables: select made rep.host_dev, if any (release destroys it); the comm scratch is this
 * file's own. */
#define STREAM_ENTRIES                                                                            \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .claim = sg__replica_outer_claim, .finish = finish,   \
  .run = run, .drain = drain, .grad_replicas = sg__replica_outer_grad_replicas,                  \
  .sync_due = sg__replica_outer_stream_due

const sg__replica_ops sg__replica_outer_stream = {
    .name = "streaming outer steps", STREAM_ENTRIES, .prepare = prepare,
    .release = sg__replica_staged_release, .sync = sync_wire,
    .ck_describe = sg__replica_outer_describe, .ck_save = save, .restore = restore,
};

const sg__replica_ops sg__replica_outer_stream_int8 = {
    .name = "streaming outer steps, int8 codes", STREAM_ENTRIES, .prepare = prepare_int8,
    .release = sg__replica_codec_release_queue, .sync = sync_int8,
    .ck_describe = sg__replica_outer_int8_describe, .ck_save = save_int8, .restore = restore_int8,
};

const sg__replica_ops sg__replica_outer_stream_host = {
    .name = "offloaded, streaming outer steps", STREAM_ENTRIES, .prepare = prepare_host,
    .release = sg__replica_staged_release, .sync = sync_wire,
    .ck_describe = sg__replica_outer_describe, .ck_save = save, .restore = restore,
};

const sg__replica_ops sg__replica_outer_stream_host_int8 = {
    .name = "offloaded, streaming outer steps, int8 codes", STREAM_ENTRIES,
    .prepare = prepare_host_int8, .release = sg__replica_codec_release_queue,
    .sync = sync_int8, .ck_describe = sg__replica_outer_int8_describe, .ck_save = save_int8,
    .restore = restore_int8,
};
