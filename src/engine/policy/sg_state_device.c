/* The optimizer state and the accumulator in the device arenas, updated by the device's
 * kernels on the compute queue: what every engine keeps unless it offloads (sg_state_host.c). */
#include "sg_policy.h"

static size_t asize(const sg_engine *e) { return sg__dtype_size(e->cfg.accum_dtype); }

/* The arenas are the layout's: nothing to make or free. */
static sg_status device_init(sg_engine *e) {
  (void)e;
  return SG_OK;
}

static void device_free(sg_engine *e) { (void)e; }

static void *device_array(sg_engine *e, int which) {
  const sg__layout *l = &e->lay;
  if (which == SG__STATE_ACCUM) return (char *)e->ar.base[SG_MEM_GRADS] + l->accum_off;
  if (which == 0)
    return l->master_off == SIZE_MAX ? NULL : (char *)e->ar.base[SG_MEM_MASTER] + l->master_off;
  return (char *)e->ar.base[SG_MEM_OPTIM] + l->state_off[which - 1];
}

/* A reduction writes the device accumulator on the comm queue itself. */
static sg_status device_prepare(sg_engine *e, int b) {
  (void)e, (void)b;
  return SG_OK;
}

static void device_submitted(sg_engine *e, int b, uint64_t ticket) { (void)e, (void)b, (void)ticket; }

/* The device reads the reductions in stream order: the compute queue waits, not the host. */
static sg_status device_wait_reductions(sg_engine *e, int64_t deadline_ms) {
  return e->dev->ops->compute_wait_comm(e->dev, e->last_ticket, deadline_ms);
}

/* Whatever is queued after the reductions on the comm queue sees them landed. */
static sg_status device_settle(sg_engine *e) {
  (void)e;
  return SG_OK;
}

static sg_status device_partials(sg_engine *e, double *dev) {
  sg__device *d = e->dev;
  SG_TRY(sg__accum_zero_empty(e));
  return d->ops->sumsq_to(d, SG_Q_COMPUTE, e->g.accum, e->cfg.accum_dtype, e->lay.accum_numel,
                          dev);
}

/* The partials in device memory (e->small), then read through pinned host memory. */
static sg_status device_sumsq(sg_engine *e, double out[2]) {
  sg__device *d = e->dev;
  double *dev = (double *)e->small;
  SG_TRY(device_partials(e, dev));
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, e->g.norm_host, dev, 2 * sizeof(double), SG_COPY_D2H));
  out[0] = e->g.norm_host[0];
  out[1] = e->g.norm_host[1];
  return SG_OK;
}

static sg_status device_update(sg_engine *e, const sg__update_args *a) {
  return e->dev->ops->update(e->dev, SG_Q_COMPUTE, e->opt.od, a);
}

/* Empty, it is never read before the next reduction writes it (the first one is a copy): its
 * pages go back to the system between steps where the device can (not a zeroing pass where it
 * cannot). */
static sg_status device_clear(sg_engine *e) {
  sg__device *d = e->dev;
  if (!d->ops->zero_release) return SG_OK;
  return d->ops->zero_release(d, SG_Q_COMPUTE, e->g.accum, e->lay.accum_numel * asize(e));
}

static sg_status device_master_from_working(sg_engine *e) {
  const sg__optim *o = &e->opt;
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  for (int s = 0; s < o->nsegs; s++) {
    const sg__seg *g = &o->segs[s];
    SG_TRY(e->dev->ops->cast(e->dev, SG_Q_COMPUTE, o->master + g->shard_off, SG_F32,
                             e->params + g->flat_off * P, e->cfg.param_dtype, g->len));
  }
  return SG_OK;
}

/* The fp32 array itself. */
static sg_status device_read_state(sg_engine *e, int k, int id,
                               sg_status (*fn)(sg_engine *e, const float *view, void *ctx),
                               void *ctx) {
  (void)id;
  return fn(e, e->opt.state[k], ctx);
}

/* fp32 arrays are checkpointed as they are (src/ckpt): no records. */
static sg_status device_records(sg_engine *e, int k, uint8_t *rec, int mode) {
  (void)e, (void)k, (void)rec, (void)mode;
  return sg__err(SG_ERR_INTERNAL, "the fp32 optimizer state has no 8-bit records");
}

const sg__state_ops sg__state_device = {
    .name = "device", .host = 0, .init = device_init, .free = device_free,
    .array = device_array, .prepare = device_prepare, .submitted = device_submitted,
    .wait_reductions = device_wait_reductions, .settle = device_settle, .sumsq = device_sumsq,
    .partials = device_partials, .update = device_update, .clear = device_clear,
    .master_from_working = device_master_from_working, .read_state = device_read_state,
    .records = device_records,
    .coded = 0, .align = SG_PLAN_ALIGN, .skips = 1,
};
