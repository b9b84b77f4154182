/* The replica stage of a hybrid engine (sg_engine_create_hybrid, DESIGN.md section 4): the
 * engine is a ZeRO-2 (or ZeRO-1) engine over its shard communicator, and this file adds what its
 * replicas on the other nodes need: once per optimizer step, each bucket's slice of the shard
 * accumulator is all-reduced over the replica communicator, right behind that bucket's
 * reduction in the declared last micro-batch (sg_set_microbatches) or at the step. The engine
 * calls these functions at fixed points whatever its layout; a flat engine has one replica and
 * they do nothing. */
#include <stdio.h> /* snprintf */
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_cast: an offloaded accumulator's wire */
#include "sg_engine_internal.h"

static int hybrid(const sg_engine *e) { return e->rep.comm != NULL; }

/* rep.claimed[b]: its all-reduce across replicas is queued; it waits for the step (offload);
 * staged: summed on the host and copied back. */
enum { CLAIM_QUEUED = 1, CLAIM_AT_STEP = 2, CLAIM_BACK = 3 };

static int staged(const sg_engine *e) { return e->rep.host_dev != NULL; }

static size_t max_slice(const sg__plan *p) {
  size_t m = 0;
  for (int b = 0; b < p->nbuckets; b++)
    if (sg__plan_slice_numel(p, b) > m) m = sg__plan_slice_numel(p, b);
  return m;
}

/* Where the accumulator's slice goes on the wire: itself when its dtype is the wire's. */
static int wire_dtype(const sg_engine *e) { return e->cfg.replica_reduce_dtype; }
static int needs_wire(const sg_config *cfg) { return cfg->replica_reduce_dtype != cfg->accum_dtype; }

/* ---------------------------------------------------------------------------------------- */
/* lifecycle                                                                                 */

/* Where the replica channel's collectives run (DESIGN.md section 1, "Hybrid engines"): bound
 * without a device (host buffers, or an NCCL channel on device memory completing within the
 * call), attached to the engine's device beside the shard channel, the same way (both
 * stream-ordered: NCCL beside NCCL on the comm stream; both host-driven: a host communicator
 * sums the device buffers as the shard channel does), or staged: a host communicator beside an
 * NCCL shard runs on a host queue of its own (a CPU device, rep.host_dev), on slices copied
 * down on the comm stream. *dev: the device to bind to (NULL: none). */
static sg_status replica_device(sg_engine *e, const sg_comm *replica, sg__device **dev) {
  *dev = NULL;
  /* the CPU device's memory and an offloaded accumulator are host memory */
  if (e->dev->kind == SG_DEVICE_CPU || e->strat->state) return SG_OK;
  const int shard_stream = e->comm->stream_ordered, rep_stream = replica->stream_ordered;
  if (shard_stream && !rep_stream) {
    SG_TRY(sg__device_cpu_create(e->rank, replica->threaded, &e->rep.host_dev));
    *dev = e->rep.host_dev;
    return SG_OK;
  }
  /* host-driven jobs: an NCCL channel without a device completes device-memory collectives
   * within the call, as they need */
  if (!shard_stream && rep_stream) return SG_OK;
  *dev = e->dev;
  return SG_OK;
}

static void host_dev_free(sg_engine *e) {
  if (!e->rep.host_dev) return;
  e->rep.host_dev->ops->destroy(e->rep.host_dev); /* joins its worker */
  e->rep.host_dev = NULL;
}

/* Staged: the host queue's jobs so far finished (their failure, if any). */
static sg_status host_wait(sg_engine *e) {
  if (!staged(e) || !e->rep.host_last) return SG_OK;
  sg__device *h = e->rep.host_dev;
  return h->ops->comm_wait(h, e->rep.host_last, sg__engine_host_deadline(e));
}

sg_status sg__replicas_attach(sg_engine *e, sg_comm *replica, const char *fn) {
  /* Jobs of a threaded shard channel run on the comm worker: the replica's must be callable
   * there too (MPI without MPI_THREAD_MULTIPLE is not). */
  if (e->comm->threaded && !replica->threaded)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: the replica communicator cannot be called from the "
                   "engine's comm thread (MPI without MPI_THREAD_MULTIPLE) while the shard "
                   "communicator runs its collectives there", fn);
  sg__device *dev = NULL;
  SG_TRY(sg__err_prefix(replica_device(e, replica, &dev), fn));
  sg_comm *chan = NULL;
  const sg_status st = sg__comm_bind(replica, dev, e->cfg.timeout_ms, &chan);
  if (st != SG_OK) {
    host_dev_free(e);
    return sg__err_prefix(st, fn);
  }
  e->rep.comm = chan;
  e->rep.on_device = dev != NULL && dev == e->dev;
  e->rep.rank = replica->rank;
  e->rep.n = replica->world;
  return SG_OK;
}

sg_status sg__replicas_init(sg_engine *e) {
  if (!hybrid(e)) return SG_OK;
  e->rep.claimed = calloc((size_t)e->plan->nbuckets, 1);
  if (!e->rep.claimed) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  e->rep.host_wire = e->lay.replica_host_bytes > 0;
  if (staged(e)) /* communication staging, not counted in sg_memory (as MPI's) */
    SG_TRY(e->dev->ops->host_alloc(e->dev, e->plan->shard_numel * sg__dtype_size(wire_dtype(e)),
                                   (void **)&e->rep.stage));
  if (e->rep.host_wire) {
    SG_TRY(e->dev->ops->host_alloc(e->dev, e->lay.replica_host_bytes, (void **)&e->rep.wire));
  } else if (e->lay.replica_off != SIZE_MAX) {
    e->rep.wire = (char *)e->ar.base[SG_MEM_COMM] + e->lay.replica_off;
  }
  /* Collectives of both channels run one at a time on the comm queue: one scratch serves both
   * (device memory: a channel without a device never uses it on device buffers). */
  if (e->rep.on_device || e->dev->kind == SG_DEVICE_CPU)
    sg__comm_set_scratch(e->rep.comm, e->comm->scratch, e->comm->scratch_bytes);
  sg__replicas_reset(e);
  return SG_OK;
}

void sg__replicas_free(sg_engine *e) {
  sg__comm_set_scratch(e->rep.comm, NULL, 0);
  free(e->rep.claimed);
  e->rep.claimed = NULL;
  if (e->rep.host_wire && e->rep.wire) e->dev->ops->host_free(e->dev, e->rep.wire);
  e->rep.wire = NULL;
  e->rep.host_wire = 0;
  if (e->rep.stage) e->dev->ops->host_free(e->dev, e->rep.stage);
  e->rep.stage = NULL;
}

/* The host queue drains first (its jobs use the channel and the stage; each has a deadline). */
void sg__replicas_detach(sg_engine *e) {
  (void)host_wait(e);
  sg__comm_unbind(e->rep.comm);
  e->rep.comm = NULL;
  host_dev_free(e);
}

int sg__replicas_world(const sg_engine *e) { return e->world * (e->rep.n > 0 ? e->rep.n : 1); }

int sg__replicas_writer(const sg_engine *e) { return e->rep.rank == 0; }

void sg__replicas_shape(const sg__plan *p, const sg_config *cfg, int n, sg__layout_shape *out) {
  out->replica_bytes = 0;
  if (n > 1 && needs_wire(cfg))
    out->replica_bytes = sg__mem_mul_sat(max_slice(p),
                                         sg__dtype_size(cfg->replica_reduce_dtype));
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
  mine[RA_WIRE] = (uint64_t)wire_dtype(e);
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
      st = sg__err(SG_ERR_MISMATCH, "config field replica_reduce_dtype differs between shard "
                   "ranks %d and %d", r, e->rank);
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

/* fn(arg) on the queue of the channel's collectives, waited for: the engine's comm queue, or
 * staged the channel's host queue (after its all-reduces). */
static sg_status run_on_channel(sg_engine *e, sg__job_fn fn, void *arg) {
  if (!staged(e)) return sg__engine_run_comm(e, fn, arg);
  sg__device *h = e->rep.host_dev;
  SG_TRY(sg__engine_broken(e, h->ops->comm_submit(h, fn, NULL, arg, &e->rep.host_last)));
  return sg__engine_broken(e, host_wait(e));
}

/* Runs j on a buffer of `total` bytes (device memory when on_dev) through a temporary where the
 * channel needs the other kind: a channel attached to a CUDA device moves device memory, a host
 * communicator bound without one (offload, staged) host memory; NCCL without a device takes
 * either. */
static sg_status rep_coll_run(sg_engine *e, rep_coll *j, int on_dev, size_t total) {
  sg__device *d = e->dev;
  const int cuda = d->kind != SG_DEVICE_CPU;
  const int to_dev = cuda && !on_dev && e->rep.on_device;
  const int to_host = cuda && on_dev && !e->rep.on_device && !e->rep.comm->stream_ordered;
  if (!to_dev && !to_host) return run_on_channel(e, rep_coll_fn, j);
  void *orig = j->buf, *tmp = NULL;
  SG_TRY(to_dev ? d->ops->alloc(d, total, &tmp) : d->ops->host_alloc(d, total, &tmp));
  sg_status st = d->ops->copy(d, SG_Q_COMPUTE, tmp, orig, total,
                              to_dev ? SG_COPY_H2D : SG_COPY_D2H);
  j->buf = tmp;
  if (st == SG_OK) st = run_on_channel(e, rep_coll_fn, j);
  if (st == SG_OK)
    st = d->ops->copy(d, SG_Q_COMPUTE, orig, tmp, total, to_dev ? SG_COPY_D2H : SG_COPY_H2D);
  j->buf = orig;
  if (to_dev)
    d->ops->free(d, tmp);
  else
    d->ops->host_free(d, tmp);
  return st;
}

sg_status sg__replicas_allgather_host(sg_engine *e, void *host, size_t bytes) {
  if (!hybrid(e)) return SG_OK;
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
      return sg__err(SG_ERR_MISMATCH, "config field replica_reduce_dtype differs between "
                     "replica %d and this rank's (replica %d)", r, e->rep.rank);
    if (o[RB_HASH] != mine[RB_HASH])
      return sg__err(SG_ERR_MISMATCH, "replica %d registered different parameters or a "
                     "different config (its plan differs from replica %d's)", r, e->rep.rank);
  }
  return SG_OK;
}

/* Round B over the replicas spreads every node's verdict after round A, which every rank of
 * that node shares: after it every rank knows every failure. */
sg_status sg__replicas_agree(sg_engine *e, sg_status st) {
  if (!hybrid(e)) return st;
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
  mine[RB_WIRE] = (uint64_t)wire_dtype(e);
  sg_status gst = sg__replicas_allgather_host(e, all, RB_WORDS * sizeof *all);
  if (gst == SG_OK && st != SG_OK) gst = sg__err(st, "%s", msg);
  if (gst == SG_OK) gst = check_round_b(e, all, mine);
  free(all);
  return gst;
}

/* ---------------------------------------------------------------------------------------- */
/* micro-batches and the all-reduce across replicas                                         */

sg_status sg_set_microbatches(sg_engine *e, int n) {
  SG_ENGINE_GUARD(e, "sg_set_microbatches");
  static const char *fn = "sg_set_microbatches";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (n < 0 || n > (1 << 20))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: n must be in 0..%d (got %d)", fn, 1 << 20, n);
  SG_TRY(sg__grads_between(e, fn));
  e->rep.microbatches = n;
  return SG_OK;
}

sg_status sg__replicas_open(sg_engine *e, const char *fn) {
  if (!hybrid(e) || e->rep.nclaimed == 0) return SG_OK;
  return sg__err(SG_ERR_INVALID_STATE, "%s: this step's gradients are already being summed "
                 "across replicas (after micro-batch %d of %d, sg_set_microbatches, or "
                 "sg_grad_norm); call sg_step first", fn, e->rep.mb,
                 e->rep.microbatches);
}

void sg__replicas_count_microbatch(sg_engine *e) { e->rep.mb++; }

void sg__replicas_reset(sg_engine *e) {
  e->rep.mb = 0;
  e->rep.nclaimed = 0;
  if (e->rep.claimed) memset(e->rep.claimed, 0, (size_t)e->plan->nbuckets);
}

typedef struct {
  sg_engine *e;
  int bucket;
  int64_t trace;
} replica_job;

/* Bucket b's slice of the accumulator summed over the replicas, in place. Through the wire
 * buffer when the wire dtype differs: every replica rounds its own slice to it, the sum is in
 * fp32 in replica order (sg_comm.h) rounded once, and every replica casts back the same bits
 * (the host's casts for an offloaded accumulator: the same element math). */
static sg_status replica_reduce(sg_engine *e, int b) {
  sg_comm *c = e->rep.comm;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = wire_dtype(e);
  const size_t n = sg__plan_slice_numel(e->plan, b);
  char *acc = sg__grads_accum_of(e, b);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  if (!e->rep.wire) return c->ops->all_reduce(c, acc, n, adt, dl);
  if (e->rep.host_wire) {
    sg__cpu_cast(e->rep.wire, wdt, acc, adt, n);
    SG_TRY(c->ops->all_reduce(c, e->rep.wire, n, wdt, dl));
    sg__cpu_cast(acc, adt, e->rep.wire, wdt, n);
    return SG_OK;
  }
  SG_TRY(d->ops->cast(d, SG_Q_COMM, e->rep.wire, wdt, acc, adt, n));
  SG_TRY(c->ops->all_reduce(c, e->rep.wire, n, wdt, dl));
  return d->ops->cast(d, SG_Q_COMM, acc, adt, e->rep.wire, wdt, n);
}

static sg_status replica_job_fn(void *arg) {
  const replica_job j = *(replica_job *)arg; /* the queue frees arg */
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = replica_reduce(j.e, j.bucket);
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

static sg_status submit(sg_engine *e, int b) {
  replica_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  *j = (replica_job){e, b, sg__trace_new(e, SG_TRACE_REDUCE, b, "all-reduce across replicas")};
  e->rep.claimed[b] = CLAIM_QUEUED;
  uint64_t t = 0;
  return sg__engine_broken(e, sg__engine_submit(e, replica_job_fn, free, j, &t));
}

/* ---- staged: slices down to pinned host memory, summed on the channel's host queue -------- */

typedef struct {
  sg_engine *e;
  int bucket;
  uint64_t after; /* staged_sum: the engine's job that copied the slice down */
} staged_job;

static char *stage_of(const sg_engine *e, int b) {
  return e->rep.stage + e->plan->buckets[b].shard_offset * sg__dtype_size(wire_dtype(e));
}

/* Engine comm queue (stream-ordered, behind the bucket's reduction): the slice, in the wire
 * dtype through the wire buffer, copied into the stage. */
static sg_status staged_down_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = wire_dtype(e);
  const size_t n = sg__plan_slice_numel(e->plan, j->bucket);
  const char *src = sg__grads_accum_of(e, j->bucket);
  if (e->rep.wire) {
    SG_TRY(d->ops->cast(d, SG_Q_COMM, e->rep.wire, wdt, src, adt, n));
    src = e->rep.wire;
  }
  return d->ops->copy(d, SG_Q_COMM, stage_of(e, j->bucket), src, n * sg__dtype_size(wdt),
                      SG_COPY_D2H);
}

/* Host queue: once the copy landed, the slice summed over the replicas in the stage. */
static sg_status staged_sum_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  SG_TRY(e->dev->ops->comm_wait(e->dev, j->after, dl));
  sg_comm *c = e->rep.comm;
  return c->ops->all_reduce(c, stage_of(e, j->bucket), sg__plan_slice_numel(e->plan, j->bucket),
                            wire_dtype(e), dl);
}

/* Engine comm queue, at the step: the summed slice back (and cast back from the wire). */
static sg_status staged_up_fn(void *arg) {
  const staged_job *j = arg;
  sg_engine *e = j->e;
  sg__device *d = e->dev;
  const int adt = e->cfg.accum_dtype, wdt = wire_dtype(e);
  const size_t n = sg__plan_slice_numel(e->plan, j->bucket);
  char *acc = sg__grads_accum_of(e, j->bucket);
  char *dst = e->rep.wire ? e->rep.wire : acc;
  SG_TRY(d->ops->copy(d, SG_Q_COMM, dst, stage_of(e, j->bucket), n * sg__dtype_size(wdt),
                      SG_COPY_H2D));
  return e->rep.wire ? d->ops->cast(d, SG_Q_COMM, acc, adt, e->rep.wire, wdt, n) : SG_OK;
}

static sg_status staged_job_new(sg_engine *e, int b, staged_job **out) {
  *out = malloc(sizeof **out);
  if (!*out) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  **out = (staged_job){e, b, 0};
  return SG_OK;
}

static sg_status submit_staged(sg_engine *e, int b) {
  /* the stage is reused: the previous round's sums (sg_grad_zero after them) are done */
  if (e->rep.nclaimed == 1) SG_TRY(sg__engine_broken(e, host_wait(e)));
  staged_job *down = NULL, *sum = NULL;
  SG_TRY(staged_job_new(e, b, &down));
  uint64_t t = 0;
  e->rep.claimed[b] = CLAIM_QUEUED;
  SG_TRY(sg__engine_broken(e, sg__engine_submit(e, staged_down_fn, free, down, &t)));
  SG_TRY(staged_job_new(e, b, &sum));
  sum->after = t;
  sg__device *h = e->rep.host_dev;
  return sg__engine_broken(e, h->ops->comm_submit(h, staged_sum_fn, free, sum, &e->rep.host_last));
}

/* At the step: every staged sum done, then copied back on the engine's comm queue. */
static sg_status staged_back(sg_engine *e) {
  SG_TRY(sg__engine_broken(e, host_wait(e)));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (e->rep.claimed[b] != CLAIM_QUEUED) continue;
    staged_job *up = NULL;
    SG_TRY(staged_job_new(e, b, &up));
    e->rep.claimed[b] = CLAIM_BACK;
    uint64_t t = 0;
    SG_TRY(sg__engine_broken(e, sg__engine_submit(e, staged_up_fn, free, up, &t)));
  }
  return SG_OK;
}

/* Bucket b's sum across replicas begins: queued now (staged: copied down and summed on the
 * host queue), or, for an offloaded accumulator (its slices land and are folded on the host),
 * at the step once every arrival is folded. */
static sg_status claim(sg_engine *e, int b) {
  e->rep.nclaimed++;
  if (staged(e)) return submit_staged(e, b);
  if (!e->strat->state) return submit(e, b);
  e->rep.claimed[b] = CLAIM_AT_STEP;
  return SG_OK;
}

sg_status sg__replicas_after_reduce(sg_engine *e, int b) {
  if (!hybrid(e) || e->rep.claimed[b]) return SG_OK;
  if (e->rep.microbatches == 0 || e->rep.mb < e->rep.microbatches) return SG_OK;
  return claim(e, b);
}

sg_status sg__replicas_rest(sg_engine *e) {
  if (!hybrid(e)) return SG_OK;
  /* A bucket not reduced this step (no gradients at all) counts as zeros on every replica alike
   * (reductions are collective) and is zeroed before the norm: nothing to sum. */
  for (int b = 0; b < e->plan->nbuckets; b++)
    if (!e->rep.claimed[b] && !e->g.empty[b]) SG_TRY(claim(e, b));
  if (staged(e)) return staged_back(e);
  if (!e->strat->state) return SG_OK;
  int late = 0;
  for (int b = 0; b < e->plan->nbuckets; b++) late += e->rep.claimed[b] == CLAIM_AT_STEP;
  if (late) SG_TRY(sg__engine_broken(e, e->strat->state->settle(e)));
  for (int b = 0; b < e->plan->nbuckets; b++)
    if (e->rep.claimed[b] == CLAIM_AT_STEP) SG_TRY(submit(e, b));
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* parameters                                                                                */

/* The working parameters (device memory) from replica `root`. */
sg_status sg__replicas_broadcast_params(sg_engine *e, int root) {
  if (!hybrid(e)) return SG_OK;
  const size_t bytes = e->plan->total_numel * sg__dtype_size(e->cfg.param_dtype);
  rep_coll j = {e, 1, e->params, bytes, root};
  return rep_coll_run(e, &j, 1, bytes);
}
