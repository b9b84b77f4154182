/* Optimizer offload (issue 12, DESIGN.md section 4): the shard's fp32 master, moments and
 * accumulator in pinned host memory (src/offload/sg_offload.c owns them, in e->off), the
 * reduced slices copied D2H (the copy-out lane) and folded on the host, the CPU updating the
 * state bucket by bucket, each bucket's new working values copied H2D before its gather. */
#include <stdlib.h>

#include "../../offload/sg_offload.h"
#include "sg_policy.h"

/* The pipeline's sizes, from the plan and config alone (the layout's host_bytes uses them). */
static size_t pipe_chunk(const sg__plan *p) {
  const size_t w = sg__sharded_max_wire(p);
  return w < SG__HOST_PIPE_CHUNK ? w : SG__HOST_PIPE_CHUNK;
}
static int nland(const sg__plan *p, const sg_config *cfg) {
  const int s = cfg->staging_buckets < p->nbuckets ? cfg->staging_buckets : p->nbuckets;
  return s > 1 ? s : 1;
}
static size_t land_bytes(const sg__plan *p, const sg_config *cfg) {
  return sg__sharded_max_wire(p) * sg__dtype_size(cfg->reduce_dtype);
}

/* The host memory it keeps (the offloading strategies' shape). */
void sg__state_host_shape(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out) {
  out->host_state = 1;
  out->host_extra = sg__offload_host_bytes(sg__optim_default(), 0, cfg->param_dtype,
                                           cfg->accum_dtype, pipe_chunk(p), nland(p, cfg),
                                           land_bytes(p, cfg));
}

/* ---- the state's lifecycle ----------------------------------------------------------------- */

static sg_status make_state(sg_engine *e, const sg__optim_desc *od, sg__offload *o) {
  const sg__plan *p = e->plan;
  const sg_config *c = &e->cfg;
  size_t *off = calloc((size_t)p->nbuckets, sizeof *off);
  size_t *len = calloc((size_t)p->nbuckets, sizeof *len);
  sg_status st = off && len ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  for (int b = 0; st == SG_OK && b < p->nbuckets; b++) {
    sg__owned ow;
    e->strat->owned(p, e->rank, b, &ow);
    off[b] = ow.state0;
    len[b] = ow.n;
  }
  if (st == SG_OK)
    st = sg__offload_init(o, e->dev, od, e->lay.opt_numel, c->param_dtype,
                          c->accum_dtype, p->nbuckets, off, len, pipe_chunk(p), nland(p, c),
                          land_bytes(p, c));
  free(off);
  free(len);
  return st;
}

sg_status sg__state_host_make(sg_engine *e, const sg__optim_desc *od, size_t others) {
  sg__offload *o = calloc(1, sizeof *o);
  if (!o) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  sg_status st = make_state(e, od, o);
  /* sg_memory reports the layout's count: it must be what was allocated (a hybrid engine's
   * host wire buffer is sg_replica.c's, a coded state's arrays their placement's) */
  const size_t mine = e->lay.host_bytes - e->lay.replica_host_bytes - others;
  if (st == SG_OK && o->host_bytes != mine) {
    st = sg__err(SG_ERR_INTERNAL, "offload: %zu pinned bytes allocated, %zu in the layout",
                 o->host_bytes, mine);
    sg__offload_free(o, INT64_MAX);
  }
  if (st != SG_OK) {
    free(o);
    return st;
  }
  e->off = o;
  return SG_OK;
}

static sg_status state_init(sg_engine *e) { return sg__state_host_make(e, e->opt.od, 0); }

static void state_free(sg_engine *e) {
  if (!e->off) return;
  sg__offload_free(e->off, sg__engine_host_deadline(e));
  free(e->off);
  e->off = NULL;
}

static void *array(sg_engine *e, int which) {
  return which == SG__STATE_ACCUM ? e->off->accum : (void *)sg__offload_state(e->off, which);
}

/* ---- arrival ------------------------------------------------------------------------------- */

static sg_status prepare(sg_engine *e, int b) {
  return sg__offload_arrive_plan(e->off, b, e->cfg.reduce_dtype, sg__engine_host_deadline(e));
}

static void submitted(sg_engine *e, int b, uint64_t ticket) {
  sg__offload_arrive_submitted(e->off, b, ticket);
}

/* `first` is the device accumulator's: the host fold keeps its own (sg_offload.c). The slice
 * goes out on the device's copy-out lane (issue 28, defect 2) where it lies in the bucket's own
 * staging slot (reduce dtype = gradient dtype: the slot's next holder waits for the ticket);
 * in the shared reduce buffer the next job's cast rewrites it on the comm queue, so there the
 * copy stays on the comm queue, in order. */
sg_status sg__state_host_reduce(sg_engine *e, int b, char *wire, int first) {
  (void)first;
  const char *mine = NULL;
  SG_TRY(sg__sharded_reduce_scatter(e, b, wire, &mine));
  const int own_slot = e->cfg.reduce_dtype == e->cfg.grad_dtype;
  return sg__offload_arrive_job(e->off, b, mine, e->cfg.reduce_dtype, own_slot);
}

/* ---- the step ------------------------------------------------------------------------------ */

static sg_status sumsq(sg_engine *e, double out[2]) {
  SG_TRY(sg__offload_fold_all(e->off, sg__engine_host_deadline(e)));
  return sg__offload_norm(e->off, out);
}

sg_status sg__state_host_update_with(sg_engine *e, const sg__optim_desc *od,
                                     const sg__update_args *a) {
  uint64_t last = 0;
  SG_TRY(sg__offload_update_with(e->off, od, a, e->params, sg__engine_host_deadline(e), &last));
  /* No gather follows (one rank): the caller's queue waits for the copies themselves. */
  if (last == 0 || sg__gathers_needed(e)) return SG_OK;
  return e->dev->ops->compute_wait_comm(e->dev, last, sg__engine_host_deadline(e));
}

static sg_status update(sg_engine *e, const sg__update_args *a) {
  sg__update_args h = *a;
  for (int k = 0; k < e->opt.od->nstates; k++) h.state[k] = sg__offload_state(e->off, 1 + k);
  return sg__state_host_update_with(e, e->opt.od, &h);
}

/* Every arrival landed and folded: the host accumulator holds this rank's sums, which the
 * hybrid engine's replica stage now rewrites (the norm partials of the folds no longer hold). */
static sg_status settle(sg_engine *e) {
  const int64_t dl = sg__engine_host_deadline(e);
  if (e->last_ticket) SG_TRY(e->dev->ops->comm_wait(e->dev, e->last_ticket, dl));
  SG_TRY(sg__offload_fold_all(e->off, dl));
  sg__offload_accum_rewritten(e->off);
  return SG_OK;
}

static sg_status clear(sg_engine *e) {
  return sg__offload_clear(e->off, sg__engine_host_deadline(e));
}

static sg_status master_from_working(sg_engine *e) {
  return sg__offload_master_from(e->off, e->params, e->opt.segs, e->opt.nsegs,
                                 sg__engine_host_deadline(e));
}

/* The reductions are read on the host: a host wait for them. */
static sg_status wait_reductions(sg_engine *e, int64_t deadline_ms) {
  return e->dev->ops->comm_wait(e->dev, e->last_ticket, deadline_ms);
}

/* The host's sum, put where the device's partials would be. */
static sg_status partials(sg_engine *e, double *dev) {
  SG_TRY(sumsq(e, e->g.norm_host));
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dev, e->g.norm_host, 2 * sizeof(double),
                           SG_COPY_H2D);
}

/* The fp32 array itself. */
static sg_status host_read_state(sg_engine *e, int k, int id,
                               sg_status (*fn)(sg_engine *e, const float *view, void *ctx),
                               void *ctx) {
  (void)id;
  return fn(e, e->opt.state[k], ctx);
}

/* fp32 arrays are checkpointed as they are (src/ckpt): no records. */
static sg_status host_records(sg_engine *e, int k, uint8_t *rec, int mode) {
  (void)e, (void)k, (void)rec, (void)mode;
  return sg__err(SG_ERR_INTERNAL, "the fp32 optimizer state has no 8-bit records");
}

const sg__state_ops sg__state_host = {
    .name = "host", .host = 1, .init = state_init, .free = state_free, .array = array,
    .prepare = prepare, .submitted = submitted, .wait_reductions = wait_reductions,
    .settle = settle, .sumsq = sumsq, .partials = partials, .update = update, .clear = clear,
    .master_from_working = master_from_working, .read_state = host_read_state,
    .records = host_records, .coded = 0, .skips = 0, /* the host pipeline: not tried */
    .align = SG_PLAN_ALIGN,
};
