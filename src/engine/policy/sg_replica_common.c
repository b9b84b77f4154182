/* What every replica transport but flat shares (sg_replica_policy.h): the stage's buffers, the
 * agreement at sg_finalize, the claims of the last micro-batch and the step, the host-side
 * collectives over the replica channel, and the all-reduce job on the engine's comm queue. */
#include <stdio.h> /* snprintf */
#include <stdlib.h>
#include <string.h>

#include "sg_replica_policy.h"

/* What the ranks of both communicators must agree on about the wire: its dtype, the codec and
 * the outer steps' period, in one word. */
/* What the replicas (and a node's ranks) must agree on beyond the plan: the wire dtype, the
 * codec, H, streaming and the outer optimizer's lr and momentum (replicas that took different
 * outer steps would hold different parameters, silently). */
static uint64_t wire_dtype(const sg_engine *e) {
  const double outer[2] = {e->cfg.outer_lr, e->cfg.outer_momentum};
  const uint64_t w = (uint64_t)e->cfg.replica_reduce_dtype | (uint64_t)e->cfg.replica_codec << 4 |
                     (uint64_t)(unsigned)e->cfg.outer_every << 8 |
                     (uint64_t)(unsigned)e->cfg.outer_streaming << 40;
  return e->cfg.outer_every > 0 ? sg__hash_bytes(w, outer, sizeof outer) : w;
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

sg_status sg__replica_init(sg_engine *e) {
  e->rep.claimed = calloc((size_t)e->plan->nbuckets, 1);
  if (!e->rep.claimed) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  e->rep.host_wire = e->lay.replica_host_bytes > 0;
  /* the buffer first: a mode's prepare lays its state out in it */
  if (e->rep.host_wire) {
    SG_TRY(e->dev->ops->host_alloc(e->dev, e->lay.replica_host_bytes, (void **)&e->rep.wire));
  } else if (e->lay.replica_off != SIZE_MAX) {
    e->rep.wire = (char *)e->ar.base[SG_MEM_COMM] + e->lay.replica_off;
  }
  SG_TRY(e->rep.ops->prepare(e));
  /* Collectives of both channels run one at a time on the comm queue: one scratch serves both
   * (device memory: a channel without a device never uses it on device buffers). */
  if (e->rep.ops->share_scratch)
    sg__comm_set_scratch(e->rep.comm, e->comm->scratch, e->comm->scratch_bytes);
  e->rep.mb = 0; /* claimed is all zero: a new step */
  e->rep.nclaimed = 0;
  return SG_OK;
}

void sg__replica_free(sg_engine *e) {
  sg__comm_set_scratch(e->rep.comm, NULL, 0);
  free(e->rep.claimed);
  e->rep.claimed = NULL;
  if (e->rep.host_wire && e->rep.wire) e->dev->ops->host_free(e->dev, e->rep.wire);
  e->rep.wire = NULL;
  e->rep.host_wire = 0;
  if (e->rep.stage) e->dev->ops->host_free(e->dev, e->rep.stage);
  e->rep.stage = NULL;
}

/* The channel's queue drains first (staged: its jobs use the channel and the stage; each has a
 * deadline), then the channel is unbound and what select made released. */
void sg__replica_detach(sg_engine *e) {
  (void)e->rep.ops->drain(e);
  sg__comm_unbind(e->rep.comm);
  e->rep.comm = NULL;
  e->rep.ops->release(e);
}

/* ---------------------------------------------------------------------------------------- */
/* agreement (sg_finalize)                                                                   */

/* Round A, over the shard: every rank of it in the same replica position and wire dtype. */
enum { RA_N, RA_RANK, RA_WIRE, RA_WORDS };
/* Round B, over the replicas: every node's verdict, size, index and plan. */
enum { RB_STATUS, RB_L, RB_SHARD_RANK, RB_HASH, RB_WIRE, RB_WORDS };

static sg_status round_a(sg_engine *e) {
  uint64_t *all = calloc((size_t)e->world * RA_WORDS, sizeof *all);
  if (!all) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  uint64_t *mine = all + (size_t)e->rank * RA_WORDS;
  mine[RA_N] = (uint64_t)e->rep.n;
  mine[RA_RANK] = (uint64_t)e->rep.rank;
  mine[RA_WIRE] = wire_dtype(e);
  sg_status st = sg__engine_allgather_host(e, all, RA_WORDS * sizeof *all);
  for (int r = 0; st == SG_OK && r < e->world; r++) {
    const uint64_t *o = all + (size_t)r * RA_WORDS;
    if (o[RA_N] != mine[RA_N] || o[RA_RANK] != mine[RA_RANK])
      st = sg__err(SG_ERR_MISMATCH, "the shard communicator joins ranks of different replica "
                   "positions: rank %d of it is replica %d of %d, this rank (%d) replica %d of %d "
                   "(every node needs the same number of ranks, and the replica communicator the "
                   "ranks with the same index on every node)", r, (int)o[RA_RANK], (int)o[RA_N],
                   e->rank, e->rep.rank, e->rep.n);
    else if (o[RA_WIRE] != mine[RA_WIRE])
      st = sg__err(SG_ERR_MISMATCH, "config fields replica_reduce_dtype, replica_codec, "
                   "outer_every, outer_streaming, outer_lr or outer_momentum differ between shard "
                   "ranks %d and %d",
                   r, e->rank);
  }
  free(all);
  return st;
}

/* A host-side collective over the replica channel (finalize's round B, checkpoint votes,
 * sg_broadcast_params). */
typedef struct {
  sg_engine *e;
  int bcast; /* 0: all-gather of `bytes` per replica; 1: broadcast of `bytes` from root */
  void *buf;
  size_t bytes;
  int root;
} rep_coll;

static sg_status rep_coll_fn(void *arg) {
  rep_coll *j = arg;
  sg_comm *c = j->e->rep.comm;
  const int64_t dl = sg__deadline(j->e->cfg.timeout_ms);
  return j->bcast ? c->ops->broadcast(c, j->buf, j->bytes, j->root, dl)
                  : c->ops->all_gather(c, j->buf, j->bytes, dl);
}

/* Runs j on a buffer of `total` bytes (device memory when on_dev) through a temporary where the
 * channel needs the other kind of memory (rep.mem, chosen with the transport). */
static sg_status rep_coll_run(sg_engine *e, rep_coll *j, int on_dev, size_t total) {
  sg__device *d = e->dev;
  const int to_dev = !on_dev && e->rep.mem == SG__REP_MEM_DEVICE;
  const int to_host = on_dev && e->rep.mem == SG__REP_MEM_HOST;
  if (!to_dev && !to_host) return e->rep.ops->run(e, rep_coll_fn, j);
  void *orig = j->buf, *tmp = NULL;
  SG_TRY(to_dev ? d->ops->alloc(d, total, &tmp) : d->ops->host_alloc(d, total, &tmp));
  sg_status st = d->ops->copy(d, SG_Q_COMPUTE, tmp, orig, total,
                              to_dev ? SG_COPY_H2D : SG_COPY_D2H);
  j->buf = tmp;
  if (st == SG_OK) st = e->rep.ops->run(e, rep_coll_fn, j);
  if (st == SG_OK)
    st = d->ops->copy(d, SG_Q_COMPUTE, orig, tmp, total, to_dev ? SG_COPY_D2H : SG_COPY_H2D);
  j->buf = orig;
  if (to_dev)
    d->ops->free(d, tmp);
  else
    d->ops->host_free(d, tmp);
  return st;
}

sg_status sg__replica_allgather_host(sg_engine *e, void *host, size_t bytes) {
  rep_coll j = {e, 0, host, bytes, 0};
  return rep_coll_run(e, &j, 0, bytes * (size_t)e->rep.n);
}

static sg_status check_round_b(sg_engine *e, const uint64_t *all, const uint64_t *mine) {
  for (int r = 0; r < e->rep.n; r++) {
    const uint64_t *o = all + (size_t)r * RB_WORDS;
    if (r == e->rep.rank) continue;
    if (o[RB_STATUS] != SG_OK)
      return sg__err(SG_ERR_MISMATCH, "replica %d (another node) failed to finalize (%s)", r,
                     sg_status_string((sg_status)o[RB_STATUS]));
    if (o[RB_L] != mine[RB_L])
      return sg__err(SG_ERR_MISMATCH, "the nodes differ in size: this rank's shard communicator "
                     "has %d ranks, replica %d's has %d (every node needs the same count)",
                     e->world, r, (int)o[RB_L]);
    if (o[RB_SHARD_RANK] != mine[RB_SHARD_RANK])
      return sg__err(SG_ERR_MISMATCH, "the replica communicator does not match the shard "
                     "communicators: this rank is rank %d of its shard, its replica %d is rank %d "
                     "of its own (join the ranks with the same index on every node)", e->rank, r,
                     (int)o[RB_SHARD_RANK]);
    if (o[RB_WIRE] != mine[RB_WIRE])
      return sg__err(SG_ERR_MISMATCH, "config fields replica_reduce_dtype, replica_codec, "
                     "outer_every, outer_streaming, outer_lr or outer_momentum differ between "
                     "replica %d and this rank's (replica %d)", r, e->rep.rank);
    if (o[RB_HASH] != mine[RB_HASH])
      return sg__err(SG_ERR_MISMATCH, "replica %d registered different parameters or a "
                     "different config (its plan differs from replica %d's)", r, e->rep.rank);
  }
  return SG_OK;
}

/* Round B over the replicas spreads every node's verdict after round A, which every rank of
 * that node shares: after it every rank knows every failure. */
sg_status sg__replica_agree(sg_engine *e, sg_status st) {
  char msg[512] = "";
  if (st == SG_OK) st = round_a(e);
  if (st != SG_OK) snprintf(msg, sizeof msg, "%s", sg_last_error());
  uint64_t *all = calloc((size_t)e->rep.n * RB_WORDS, sizeof *all);
  if (!all) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  uint64_t *mine = all + (size_t)e->rep.rank * RB_WORDS;
  mine[RB_STATUS] = (uint64_t)st;
  mine[RB_L] = (uint64_t)e->world;
  mine[RB_SHARD_RANK] = (uint64_t)e->rank;
  mine[RB_HASH] = e->plan ? e->plan->hash : 0;
  mine[RB_WIRE] = wire_dtype(e);
  sg_status gst = sg__replica_allgather_host(e, all, RB_WORDS * sizeof *all);
  if (gst == SG_OK && st != SG_OK) gst = sg__err(st, "%s", msg);
  if (gst == SG_OK) gst = check_round_b(e, all, mine);
  free(all);
  return gst;
}

/* ---- micro-batches and the all-reduce across replicas ----------------------------------------- */

sg_status sg__replica_open(sg_engine *e, const char *fn) {
  if (e->rep.nclaimed == 0) return SG_OK;
  return sg__err(SG_ERR_INVALID_STATE, "%s: this step's gradients are already being summed "
                 "across replicas (after micro-batch %d of %d, sg_set_microbatches, or "
                 "sg_grad_norm); call sg_step first", fn, e->rep.mb,
                 e->rep.microbatches);
}

typedef struct {
  sg_engine *e;
  int bucket;
  int64_t trace;
  sg_status (*reduce)(sg_engine *e, int b);
} replica_job;

/* Bucket b's slice of the accumulator summed over the replicas, in place. Through the wire
 * buffer when the wire dtype differs: every replica rounds its own slice to it, the sum is in
 * fp32 in replica order (sg_comm.h) rounded once, and every replica casts back the same bits. */
sg_status sg__replica_reduce_device(sg_engine *e, int b) {
  sg_comm *c = e->rep.comm;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = e->cfg.replica_reduce_dtype;
  const size_t n = sg__plan_slice_numel(e->plan, b);
  char *acc = sg__accum_of(e, b);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  if (!e->rep.wire) return c->ops->all_reduce(c, acc, n, adt, dl);
  SG_TRY(d->ops->cast(d, SG_Q_COMM, e->rep.wire, wdt, acc, adt, n));
  SG_TRY(c->ops->all_reduce(c, e->rep.wire, n, wdt, dl));
  return d->ops->cast(d, SG_Q_COMM, acc, adt, e->rep.wire, wdt, n);
}

static sg_status replica_job_fn(void *arg) {
  const replica_job j = *(replica_job *)arg; /* the queue frees arg */
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = j.reduce(j.e, j.bucket);
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

sg_status sg__replica_submit(sg_engine *e, int b, sg_status (*reduce)(sg_engine *e, int b)) {
  replica_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  *j = (replica_job){e, b, sg__trace_new(e, SG_TRACE_REDUCE, b, "all-reduce across replicas"),
                     reduce};
  e->rep.claimed[b] = SG__CLAIM_QUEUED;
  uint64_t t = 0;
  return sg__engine_broken(e, sg__engine_submit_replica(e, replica_job_fn, free, j, &t));
}

/* Bucket b's sum across replicas begins (the transport's claim). */
static sg_status claim(sg_engine *e, int b) {
  e->rep.nclaimed++;
  return e->rep.ops->claim(e, b);
}

sg_status sg__replica_after_reduce(sg_engine *e, int b) {
  if (e->rep.claimed[b]) return SG_OK;
  if (e->rep.microbatches == 0 || e->rep.mb < e->rep.microbatches) return SG_OK;
  return claim(e, b);
}

sg_status sg__replica_rest(sg_engine *e) {
  /* A bucket not reduced this step (no gradients at all) counts as zeros on every replica alike
   * (reductions are collective) and is zeroed before the norm: nothing to sum. */
  for (int b = 0; b < e->plan->nbuckets; b++)
    if (!e->rep.claimed[b] && !e->g.empty[b]) SG_TRY(claim(e, b));
  return e->rep.ops->finish(e);
}

/* ---- parameters ------------------------------------------------------------------------------ */

sg_status sg__replica_broadcast_dev(sg_engine *e, void *dev_buf, size_t bytes, int root) {
  rep_coll j = {e, 1, dev_buf, bytes, root};
  return rep_coll_run(e, &j, 1, bytes);
}

sg_status sg__replica_broadcast_host(sg_engine *e, void *host_buf, size_t bytes, int root) {
  rep_coll j = {e, 1, host_buf, bytes, root};
  return rep_coll_run(e, &j, 0, bytes);
}

/* The working parameters (device memory) from replica `root`. */
sg_status sg__replica_broadcast_params(sg_engine *e, int root) {
  const size_t bytes = e->plan->total_numel * sg__dtype_size(e->cfg.param_dtype);
  return sg__replica_broadcast_dev(e, e->params, bytes, root);
}

/* ---- pieces of several transports ----------------------------------------------------------- */

sg_status sg__replica_run_comm(sg_engine *e, sg__job_fn fn, void *arg) {
  return sg__engine_run_replica(e, fn, arg);
}

sg_status sg__replica_claim_at_step(sg_engine *e, int b) {
  e->rep.claimed[b] = SG__CLAIM_AT_STEP;
  return SG_OK;
}

sg__queue sg__replica_elem_queue(const sg_engine *e) { return (sg__queue)e->rep.elem_q; }

char *sg__replica_buf(const sg_engine *e) {
  return e->rep.host_wire ? e->rep.wire : (char *)e->ar.base[SG_MEM_COMM] + e->lay.replica_off;
}

sg__device *sg__replica_sum_dev(const sg_engine *e) { return e->rep.sum_dev; }

sg_status sg__replica_no_drain(sg_engine *e) {
  (void)e;
  return SG_OK;
}

sg_status sg__replica_no_prepare(sg_engine *e) {
  (void)e;
  return SG_OK;
}

void sg__replica_no_release(sg_engine *e) { (void)e; }

sg_status sg__replica_no_finish(sg_engine *e) {
  (void)e;
  return SG_OK;
}

int sg__replica_all_replicas(const sg_engine *e) { return e->rep.n; }

int sg__replica_never_due(sg_engine *e) {
  (void)e;
  return 0;
}

void sg__replica_no_ck_describe(const sg_engine *e, sg__rep_ck *ck) { (void)e, (void)ck; }

sg_status sg__replica_no_ck_save(sg_engine *e, sg__rep_ck *ck) {
  (void)e, (void)ck;
  return SG_OK;
}

void sg__replica_no_restore(sg_engine *e, const sg__rep_ck *ck) { (void)e, (void)ck; }
