/* Outer steps (cfg.outer_every = H, DiLoCo; docs/slow-links.md): the replicas of a hybrid
 * engine train apart, each on its node's gradient with only the in-node ZeRO-2 traffic (no sum
 * across replicas at the step), and after every H-th sg_step agree once:
 *
 *   d = po - theta            the pseudo-gradient of this rank's shard: the fp32 master at the
 *                             last outer step (po) minus now
 *   d = sum over replicas / N all-reduced (replica_reduce_dtype on the wire, fp32 sums in
 *                             replica order), divided by N in fp32
 *   m = mu m + d, po -= lr (d + mu m), theta = po    Nesterov momentum SGD
 *
 * and the node gathers the new parameters (here, on the comm queue). Every replica computes
 * the same po from the same sum, so all hold the same bits after it. po and m are taken (po =
 * the parameters, m = 0) at the first step after sg_finalize, or after an sg_load of a
 * checkpoint without them; checkpoints hold po, m and the position in the period (outer_save,
 * outer_restore). The inner optimizer's state is not touched. This file owns the outer state:
 * po, m and the wire of one owned run in the layout's replica buffer (sg__replica_outer_bytes,
 * counted in sg_memory's comm_bytes; device memory on a CUDA device), the position in the
 * period in e->rep.outer on the host. Its element work goes through the device (outer_delta,
 * outer_step, cast: kernels/sg_elem.h's math on either device), so the CPU and CUDA devices
 * take bit-identical outer steps; each bucket's delta, sum and step are one job on the replica
 * channel's queue. The streaming variant (sg_replica_outer_stream.c) takes the same steps one
 * group of buckets at a time, its sum overlapped with the next step: it uses the
 * pieces below (sg__replica_outer_stream_due, _group, _delta, _apply, _gather, _dbuf) and a
 * pseudo-gradient buffer that holds a whole group's runs. */
#include <string.h> /* memset */

#include "sg_replica_policy.h"

/* The state in the layout's replica buffer: po and m (shard_numel each), then the largest
 * owned run in fp32 and, for a bf16 wire, in bf16. Addresses only: on a CUDA device they are
 * device memory, which only the device's ops touch. */
typedef struct {
  float *po, *m, *d;
  void *wire; /* NULL: the fp32 run goes on the wire itself */
  float *work; /* an offloaded optimizer's: one run's working values (NULL: none) */
} outer_bufs;

/* A bf16 wire: the run in bf16 (a codec puts its codes on the wire instead). */
static int has_wire(const sg_config *cfg) {
  return cfg->replica_reduce_dtype != SG_F32 && cfg->replica_codec == SG_CODEC_NONE;
}

/* Streaming: the runs of the largest group of buckets (b mod H), together. */
static size_t max_group(const sg__plan *p, int H) {
  size_t most = 0;
  for (int g = 0; g < H && g < p->nbuckets; g++) {
    size_t n = 0;
    for (int b = g; b < p->nbuckets; b += H) n += sg__plan_slice_numel(p, b);
    if (n > most) most = n;
  }
  return most;
}

/* The pseudo-gradient buffer d: one run, or with streaming the runs of the largest group (its
 * sum is in flight while the next step runs). */
static size_t d_numel(const sg__plan *p, const sg_config *cfg) {
  return cfg->outer_streaming ? max_group(p, cfg->outer_every) : sg__plan_max_slice_numel(p);
}

/* With an offloaded optimizer (sg_replica_outer_host.c) a run's working values on the host,
 * fp32 (the parameters themselves) or cast to the parameter dtype, on their way to the GPU. */
static size_t work_numel(const sg__plan *p, const sg_config *cfg) {
  return sg__strategy_offloads(cfg) ? sg__plan_max_slice_numel(p) : 0;
}

static size_t wire_bytes(const sg__plan *p, const sg_config *cfg) {
  return has_wire(cfg) ? 2u * sg__plan_max_slice_numel(p) : 0;
}

size_t sg__replica_outer_bytes(const sg__plan *p, const sg_config *cfg) {
  return 4u * (2u * p->shard_numel + d_numel(p, cfg) + work_numel(p, cfg)) + wire_bytes(p, cfg);
}

static outer_bufs bufs_of(const sg_engine *e) {
  outer_bufs k;
  k.po = (float *)sg__replica_buf(e);
  k.m = k.po + e->plan->shard_numel;
  k.d = k.m + e->plan->shard_numel;
  k.work = k.d + d_numel(e->plan, &e->cfg);
  k.wire = has_wire(&e->cfg) ? (void *)(k.work + work_numel(e->plan, &e->cfg)) : NULL;
  if (!work_numel(e->plan, &e->cfg)) k.work = NULL;
  return k;
}

/* This rank's fp32 master of bucket b's owned run: the working parameters for f32 ones. */
static float *master_of(const sg_engine *e, const sg__owned *o) {
  return e->opt.master ? e->opt.master + o->state0 : (float *)e->params + o->flat0;
}

/* The device's place: the master (or the working parameters) in its memory, the working copy
 * cast by it (in the queue of the replica element work, as the rest). */
static sg_status device_theta(sg_engine *e, const sg__owned *o, float **theta) {
  *theta = master_of(e, o);
  return SG_OK;
}

static sg_status device_working(sg_engine *e, const sg__owned *o, const float *theta) {
  if (!e->opt.master) return SG_OK;
  sg__device *dev = e->rep.elem_dev;
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  return dev->ops->cast(dev, sg__replica_elem_queue(e), e->params + o->flat0 * P,
                        e->cfg.param_dtype, theta, SG_F32, o->n);
}

static const sg__outer_place device_place = {device_theta, device_working};

sg_status sg__replica_outer_prepare(sg_engine *e) {
  memset(&e->rep.outer, 0, sizeof e->rep.outer);
  e->rep.outer.fresh = 1;
  e->rep.outer.place = &device_place;
  sg__device *d = e->rep.elem_dev;
  return d->ops->zero(d, SG_Q_COMPUTE, bufs_of(e).po, sg__replica_outer_bytes(e->plan, &e->cfg));
}

/* At the first step of a run (before its update, on the compute queue): the outer parameters
 * are the parameters, the momentum zero. The copy through the engine's device (its copy goes
 * by the pointers: the master and po may be pinned host memory, offloaded). */
sg_status sg__replica_outer_finish(sg_engine *e) {
  if (!e->rep.outer.fresh) return SG_OK;
  const outer_bufs k = bufs_of(e);
  sg__device *d = e->dev, *z = e->rep.elem_dev;
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sg__owned o;
    e->strat->owned(e->plan, e->rank, b, &o);
    SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, k.po + o.state0, master_of(e, &o), o.n * sizeof(float),
                        SG_COPY_D2D));
    SG_TRY(z->ops->zero(z, SG_Q_COMPUTE, k.m + o.state0, o.n * sizeof(float)));
  }
  e->rep.outer.fresh = 0;
  e->rep.outer.inner = 0;
  return SG_OK;
}

int sg__replica_outer_due(sg_engine *e) {
  if (++e->rep.outer.inner < e->cfg.outer_every) return 0;
  e->rep.outer.inner = 0;
  return 1;
}

/* The pseudo-gradient run summed over the replicas (inside the bucket's job, or the streaming
 * sum's job): all-reduced in fp32, or through the bf16 wire (cast by the device of the replica's
 * sums' element work in the queue of the replica work, sg__replica_sum_dev and sg__replica_elem_queue). */
sg_status sg__replica_outer_wire_sum(sg_engine *e, int b, float *d, size_t n) {
  (void)b;
  const outer_bufs k = bufs_of(e);
  sg_comm *c = e->rep.comm;
  sg__device *dev = sg__replica_sum_dev(e);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  if (!k.wire) return c->ops->all_reduce(c, d, n, SG_F32, dl);
  const int w = e->cfg.replica_reduce_dtype;
  const sg__queue q = sg__replica_elem_queue(e);
  SG_TRY(dev->ops->cast(dev, q, k.wire, w, d, SG_F32, n));
  SG_TRY(c->ops->all_reduce(c, k.wire, n, w, dl));
  return dev->ops->cast(dev, q, d, SG_F32, k.wire, w, n);
}

/* Bucket b's outer step, one job on the replica channel's queue: d = po - theta, its sum over
 * the replicas, the Nesterov step of po and m (theta = po), and for bf16/f16 parameters the
 * working copy from the new master. */
typedef struct {
  sg_engine *e;
  int b;
  sg__outer_sum_fn sum;
} bucket_job;

static sg_status bucket_job_fn(void *arg) {
  const bucket_job *j = arg;
  float *d = bufs_of(j->e).d;
  size_t n;
  SG_TRY(sg__replica_outer_delta(j->e, j->b, d, &n));
  SG_TRY(j->sum(j->e, j->b, d, n));
  return sg__replica_outer_apply(j->e, j->b, d);
}

/* The node's gathers of the buckets first, first + stride, ... (their new parameters). */
typedef struct {
  sg_engine *e;
  int first, stride;
} gather_job;

static sg_status gather_job_fn(void *arg) {
  const gather_job *j = arg;
  for (int b = j->first; b < j->e->plan->nbuckets; b += j->stride)
    SG_TRY(j->e->strat->shard->gather(j->e, b));
  return SG_OK;
}

/* The outer step of the buckets first, first + stride, ... (all of them: 0, 1), one job each on
 * the replica channel's queue, waited for; then the node's gathers of their new parameters on
 * the engine's comm queue (the shard channel's own). */
static sg_status sync_buckets(sg_engine *e, sg__outer_sum_fn sum, int first, int stride) {
  for (int b = first; b < e->plan->nbuckets; b += stride) {
    bucket_job j = {e, b, sum};
    SG_TRY(sg__replica_run_comm(e, bucket_job_fn, &j));
  }
  return sg__replica_outer_gather(e, first, stride);
}

sg_status sg__replica_outer_sync(sg_engine *e, sg__outer_sum_fn sum) {
  return sync_buckets(e, sum, 0, 1);
}

static sg_status outer_sync(sg_engine *e) {
  return sg__replica_outer_sync(e, sg__replica_outer_wire_sum);
}

/* Streaming (sg_replica_outer_stream.c): the k-th step of a period (k = 1..H) syncs group k - 1,
 * the buckets b with b mod H = k - 1; a group without buckets (H > nbuckets) has nothing to do.
 * The position in the period (inner) is what checkpoints keep, as without streaming. */
int sg__replica_outer_stream_due(sg_engine *e) {
  e->rep.outer.group = e->rep.outer.inner++;
  if (e->rep.outer.inner >= e->cfg.outer_every) e->rep.outer.inner = 0;
  return e->rep.outer.group < e->plan->nbuckets;
}

int sg__replica_outer_group(const sg_engine *e) { return e->rep.outer.group; }

/* The pieces of a bucket's outer step (the bucket job above, and streaming, which takes them
 * apart into jobs of its own), in the queue of the replica's element work:
 * bucket b's pseudo-gradient po - theta of this rank's run into d (its values in *n), its
 * Nesterov step from the replicas' sum in d (the parameters become the new po; bf16/f16 ones:
 * the working copy from the new master), the node's gathers of the buckets first, first +
 * stride, ... on the engine's comm queue (waited for), the buffer d. */
sg_status sg__replica_outer_delta(sg_engine *e, int b, float *d, size_t *n) {
  sg__owned o;
  e->strat->owned(e->plan, e->rank, b, &o);
  *n = o.n;
  float *theta = NULL;
  SG_TRY(e->rep.outer.place->theta(e, &o, &theta));
  sg__device *dev = e->rep.elem_dev;
  return dev->ops->outer_delta(dev, sg__replica_elem_queue(e), d, bufs_of(e).po + o.state0,
                               theta, o.n);
}

sg_status sg__replica_outer_apply(sg_engine *e, int b, const float *d) {
  const outer_bufs k = bufs_of(e);
  sg__device *dev = e->rep.elem_dev;
  const float lr = (float)e->cfg.outer_lr, mu = (float)e->cfg.outer_momentum;
  sg__owned o;
  e->strat->owned(e->plan, e->rank, b, &o);
  float *theta = NULL;
  SG_TRY(e->rep.outer.place->theta(e, &o, &theta));
  SG_TRY(dev->ops->outer_step(dev, sg__replica_elem_queue(e), k.po + o.state0, k.m + o.state0,
                              theta, d, o.n, e->rep.n, lr, mu));
  return e->rep.outer.place->working(e, &o, theta);
}

float *sg__replica_outer_work(sg_engine *e) { return bufs_of(e).work; }

sg_status sg__replica_outer_gather(sg_engine *e, int first, int stride) {
  if (!sg__gathers_needed(e)) return SG_OK;
  gather_job g = {e, first, stride};
  return sg__engine_run_comm(e, gather_job_fn, &g);
}

float *sg__replica_outer_dbuf(sg_engine *e) { return bufs_of(e).d; }

int sg__replica_outer_grad_replicas(const sg_engine *e) {
  (void)e;
  return 1;
}

/* Nothing is summed across replicas at a step. */
sg_status sg__replica_outer_claim(sg_engine *e, int b) {
  (void)e, (void)b;
  return SG_OK;
}

/* ---- checkpoints: po and m (the same on every replica: replica 0's are written) and the
 * position in the period. A save before the first step writes what that step would take (the
 * parameters, zero momentum). ---- */

void sg__replica_outer_describe(const sg_engine *e, sg__rep_ck *ck) {
  ck->esz[SG__REP_OUTER_PARAMS] = 4;
  ck->esz[SG__REP_OUTER_MOM] = 4;
  ck->position = e->rep.outer.fresh ? 0u : (uint64_t)e->rep.outer.inner;
}

/* Device memory of this device into host memory (the records), and back. */
static sg_status to_host(sg_engine *e, void *host, const void *dev, size_t n) {
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, host, dev, n * sizeof(float), SG_COPY_D2H);
}

static sg_status to_dev(sg_engine *e, void *dev, const void *host, size_t n) {
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dev, host, n * sizeof(float), SG_COPY_H2D);
}

sg_status sg__replica_outer_save(sg_engine *e, sg__rep_ck *ck) {
  const outer_bufs k = bufs_of(e);
  float *po = ck->rec[SG__REP_OUTER_PARAMS], *m = ck->rec[SG__REP_OUTER_MOM];
  if (!po || !m) return SG_OK; /* not a writer */
  const size_t sn = e->plan->shard_numel;
  if (!e->rep.outer.fresh) {
    SG_TRY(to_host(e, po, k.po, sn));
    return to_host(e, m, k.m, sn);
  }
  memset(po, 0, sn * sizeof(float)); /* padding: as the state the first step takes */
  memset(m, 0, sn * sizeof(float));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sg__owned o;
    e->strat->owned(e->plan, e->rank, b, &o);
    SG_TRY(to_host(e, po + o.state0, master_of(e, &o), o.n));
  }
  return SG_OK;
}

/* After sg_load: the checkpoint's outer state and position (a position at or past this
 * engine's H: the next step ends the period), or, without it, a new period from the loaded
 * parameters with zero momentum. A copy that fails breaks the engine (restore returns
 * nothing; every later call then fails with the copy's error). */
void sg__replica_outer_restore(sg_engine *e, const sg__rep_ck *ck) {
  const outer_bufs k = bufs_of(e);
  const void *po = ck ? ck->rec[SG__REP_OUTER_PARAMS] : NULL;
  const void *m = ck ? ck->rec[SG__REP_OUTER_MOM] : NULL;
  e->rep.outer.fresh = !po || !m;
  if (e->rep.outer.fresh) return;
  const size_t sn = e->plan->shard_numel;
  sg_status st = to_dev(e, k.po, po, sn);
  if (st == SG_OK) st = to_dev(e, k.m, m, sn);
  if (st != SG_OK) (void)sg__engine_broken(e, st);
  const uint64_t last = (uint64_t)e->cfg.outer_every - 1u;
  e->rep.outer.inner = (int)(ck->position < last ? ck->position : last);
}

const sg__replica_ops sg__replica_outer = {
    .name = "outer steps", SG__REPLICA_ENTRIES, SG__REPLICA_OUTER_STEPS,
    .prepare = sg__replica_outer_prepare, .release = sg__replica_no_release, .sync = outer_sync,
    .ck_describe = sg__replica_outer_describe, .ck_save = sg__replica_outer_save,
    .restore = sg__replica_outer_restore,
};
