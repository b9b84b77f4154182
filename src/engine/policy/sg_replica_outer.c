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
 * outer_restore). The inner optimizer's state is not touched. This file owns the outer state,
 * in the layout's replica buffer (po, m, the wire of one owned run: sg__replica_outer_bytes,
 * counted in sg_memory's comm_bytes). The streaming variant (sg_replica_outer_stream.c) takes the
 * same steps one group of buckets at a time, overlapped with the next step: it uses the pieces
 * below (sg__replica_outer_stream_due, _delta, _apply, _gather) and a pseudo-gradient buffer that
 * holds a whole group's runs. */
#include <string.h>

#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_outer_*, sg__cpu_cast */
#include "sg_replica_policy.h"

/* The state lives in the layout's replica buffer: po and m (shard_numel each), then the largest
 * owned run in fp32 and, for a bf16 wire, in bf16. */
typedef struct {
  float *po, *m, *d;
  void *wire; /* NULL: the fp32 run goes on the wire itself */
  int fresh;  /* po and m are to be taken from the parameters at the next step */
  int inner;  /* steps since the last outer step (streaming: since the period began) */
  int group;  /* streaming: the group of buckets the step that just ended syncs */
} outer_state;

static size_t max_run(const sg__plan *p) {
  size_t m = 0;
  for (int b = 0; b < p->nbuckets; b++)
    if (sg__plan_slice_numel(p, b) > m) m = sg__plan_slice_numel(p, b);
  return m;
}

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
  return cfg->outer_streaming ? max_group(p, cfg->outer_every) : max_run(p);
}

size_t sg__replica_outer_bytes(const sg__plan *p, const sg_config *cfg) {
  const size_t wire = has_wire(cfg) ? 2u * max_run(p) : 0;
  return 4u * (2u * p->shard_numel + d_numel(p, cfg)) + wire + sizeof(outer_state) + 64u;
}

static outer_state *state_of(const sg_engine *e) {
  return (outer_state *)((char *)e->ar.base[SG_MEM_COMM] + e->lay.replica_off);
}

/* This rank's fp32 master of bucket b's owned run: the working parameters for f32 ones. */
static float *master_of(const sg_engine *e, const sg__owned *o) {
  return e->opt.master ? e->opt.master + o->state0 : (float *)e->params + o->flat0;
}

sg_status sg__replica_outer_prepare(sg_engine *e) {
  char *base = (char *)state_of(e);
  memset(base, 0, sg__replica_outer_bytes(e->plan, &e->cfg));
  outer_state *k = (outer_state *)base;
  const size_t off = (sizeof *k + 63u) / 64u * 64u, sn = e->plan->shard_numel;
  k->po = (float *)(base + off);
  k->m = k->po + sn;
  k->d = k->m + sn;
  k->wire = has_wire(&e->cfg) ? (void *)(k->d + d_numel(e->plan, &e->cfg)) : NULL;
  k->fresh = 1;
  return SG_OK;
}

/* At the first step of a run (before its update): the outer parameters are the parameters. */
sg_status sg__replica_outer_finish(sg_engine *e) {
  outer_state *k = state_of(e);
  if (!k->fresh) return SG_OK;
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sg__owned o;
    e->strat->owned(e->plan, e->rank, b, &o);
    memcpy(k->po + o.state0, master_of(e, &o), o.n * sizeof(float));
    memset(k->m + o.state0, 0, o.n * sizeof(float));
  }
  k->fresh = 0;
  k->inner = 0;
  return SG_OK;
}

int sg__replica_outer_due(sg_engine *e) {
  outer_state *k = state_of(e);
  if (++k->inner < e->cfg.outer_every) return 0;
  k->inner = 0;
  return 1;
}

typedef struct {
  sg_engine *e;
  int b;
  size_t n;
  sg__outer_sum_fn sum;
} sum_job;

static sg_status sum_job_fn(void *arg) {
  const sum_job *j = arg;
  return j->sum(j->e, j->b, state_of(j->e)->d, j->n);
}

/* The pseudo-gradient run summed over the replicas (on the comm queue): all-reduced in fp32, or
 * through the bf16 wire. */
sg_status sg__replica_outer_wire_sum(sg_engine *e, int b, float *d, size_t n) {
  (void)b;
  outer_state *k = state_of(e);
  sg_comm *c = e->rep.comm;
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  if (!k->wire) return c->ops->all_reduce(c, d, n, SG_F32, dl);
  const int w = e->cfg.replica_reduce_dtype;
  sg__cpu_cast(k->wire, w, d, SG_F32, n);
  SG_TRY(c->ops->all_reduce(c, k->wire, n, w, dl));
  sg__cpu_cast(d, SG_F32, k->wire, w, n);
  return SG_OK;
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

/* The pseudo-gradient of this rank's run of bucket b into d: po - theta (n values, returned). */
size_t sg__replica_outer_delta(sg_engine *e, int b, float *d) {
  sg__owned o;
  e->strat->owned(e->plan, e->rank, b, &o);
  sg__cpu_outer_delta(d, state_of(e)->po + o.state0, master_of(e, &o), o.n);
  return o.n;
}

/* Bucket b's outer step from d, the replicas' sum of its pseudo-gradient: po and m, and the
 * parameters become po (bf16/f16 ones: the working copy cast from the new master). */
void sg__replica_outer_apply(sg_engine *e, int b, const float *d) {
  outer_state *k = state_of(e);
  const float lr = (float)e->cfg.outer_lr, mu = (float)e->cfg.outer_momentum;
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  sg__owned o;
  e->strat->owned(e->plan, e->rank, b, &o);
  float *theta = master_of(e, &o);
  sg__cpu_outer_step(k->po + o.state0, k->m + o.state0, theta, d, o.n, e->rep.n, lr, mu);
  if (e->opt.master) sg__cpu_cast(e->params + o.flat0 * P, e->cfg.param_dtype, theta, SG_F32, o.n);
}

sg_status sg__replica_outer_gather(sg_engine *e, int first, int stride) {
  if (!sg__gathers_needed(e)) return SG_OK;
  gather_job g = {e, first, stride};
  return sg__replica_run_comm(e, gather_job_fn, &g);
}

float *sg__replica_outer_dbuf(sg_engine *e) { return state_of(e)->d; }

/* The outer step of every bucket, then the node's gathers of their new parameters. */
sg_status sg__replica_outer_sync(sg_engine *e, sg__outer_sum_fn sum) {
  outer_state *k = state_of(e);
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sum_job j = {e, b, sg__replica_outer_delta(e, b, k->d), sum};
    SG_TRY(sg__replica_run_comm(e, sum_job_fn, &j));
    sg__replica_outer_apply(e, b, k->d);
  }
  return sg__replica_outer_gather(e, 0, 1);
}

static sg_status outer_sync(sg_engine *e) {
  return sg__replica_outer_sync(e, sg__replica_outer_wire_sum);
}

/* Streaming (sg_replica_outer_stream.c): the k-th step of a period (k = 1..H) syncs group k - 1,
 * the buckets b with b mod H = k - 1; a group without buckets (H > nbuckets) has nothing to do.
 * The position in the period (inner) is what checkpoints keep, as without streaming. */
int sg__replica_outer_stream_due(sg_engine *e) {
  outer_state *k = state_of(e);
  k->group = k->inner++;
  if (k->inner >= e->cfg.outer_every) k->inner = 0;
  return k->group < e->plan->nbuckets;
}

int sg__replica_outer_group(const sg_engine *e) { return state_of(e)->group; }

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
  const outer_state *k = state_of(e);
  ck->esz[SG__REP_OUTER_PARAMS] = 4;
  ck->esz[SG__REP_OUTER_MOM] = 4;
  ck->position = k->fresh ? 0u : (uint64_t)k->inner;
}

sg_status sg__replica_outer_save(sg_engine *e, sg__rep_ck *ck) {
  const outer_state *k = state_of(e);
  float *po = ck->rec[SG__REP_OUTER_PARAMS], *m = ck->rec[SG__REP_OUTER_MOM];
  if (!po || !m) return SG_OK; /* not a writer */
  const size_t sn = e->plan->shard_numel;
  memcpy(po, k->po, sn * sizeof(float));
  memcpy(m, k->m, sn * sizeof(float));
  if (!k->fresh) return SG_OK;
  memset(m, 0, sn * sizeof(float));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sg__owned o;
    e->strat->owned(e->plan, e->rank, b, &o);
    memcpy(po + o.state0, master_of(e, &o), o.n * sizeof(float));
  }
  return SG_OK;
}

/* After sg_load: the checkpoint's outer state and position (a position at or past this
 * engine's H: the next step ends the period), or, without it, a new period from the loaded
 * parameters with zero momentum. */
void sg__replica_outer_restore(sg_engine *e, const sg__rep_ck *ck) {
  outer_state *k = state_of(e);
  const void *po = ck ? ck->rec[SG__REP_OUTER_PARAMS] : NULL;
  const void *m = ck ? ck->rec[SG__REP_OUTER_MOM] : NULL;
  k->fresh = !po || !m;
  if (k->fresh) return;
  const size_t sn = e->plan->shard_numel;
  memcpy(k->po, po, sn * sizeof(float));
  memcpy(k->m, m, sn * sizeof(float));
  const uint64_t last = (uint64_t)e->cfg.outer_every - 1u;
  k->inner = (int)(ck->position < last ? ck->position : last);
}

const sg__replica_ops sg__replica_outer = {
    .name = "host, outer steps", SG__REPLICA_ENTRIES, SG__REPLICA_OUTER_STEPS,
    .prepare = sg__replica_outer_prepare, .release = sg__replica_no_release, .sync = outer_sync,
    .ck_describe = sg__replica_outer_describe, .ck_save = sg__replica_outer_save,
    .restore = sg__replica_outer_restore,
};
