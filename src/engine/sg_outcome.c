/* The step's outcome decided on the device (DESIGN.md section 4, "The step on the device"):
 * where the device has a step kernel and the state is its own, sg_step hands the clip/unscale
 * factor and the skip decision to the update through device memory instead of waiting on the host
 * for the norm. The host's counters that the decision changes (the step count, the dynamic
 * loss scale) are brought up to date later, by sg__outcome_settle: at the next sg_step, or
 * when the caller asks for a value that depends on them. The public readers of those counters
 * are here, so that none of them reports a value before the outcome it depends on. */
#include <string.h>

#include "sg_engine_internal.h"

/* The step's outcome in device memory: after the step's 2 doubles of norm partials in the
 * small piece (256 bytes, 16-byte aligned). */
#define SG__OUTCOME_OFF 64

sg_status sg__outcome_init(sg_engine *e) {
  sg__outcome *o = &e->out;
  memset(o, 0, sizeof *o);
  /* Optional device op; offloaded state is updated by the host, which needs the factor. */
  if (!e->dev->ops->step_outcome || e->strat->place->host) return SG_OK;
  void *h = NULL;
  SG_TRY(e->dev->ops->host_alloc(e->dev, sizeof(sg_elem_step_out), &h));
  memset(h, 0, sizeof(sg_elem_step_out));
  o->host = h;
  return SG_OK;
}

void sg__outcome_free(sg_engine *e) {
  if (e->out.host) e->dev->ops->host_free(e->dev, e->out.host);
  e->out.host = NULL;
  e->out.pending = 0;
}

int sg__outcome_on_device(const sg_engine *e) { return e->out.host != NULL; }

const sg_elem_step_out *sg__outcome_dev(const sg_engine *e) {
  return (const sg_elem_step_out *)(e->small + SG__OUTCOME_OFF);
}

sg_status sg__outcome_decide(sg_engine *e, const sg_elem_step_in *in) {
  sg__device *d = e->dev;
  const uint64_t seq = e->out.seq + 1;
  SG_TRY(d->ops->step_outcome(d, SG_Q_COMPUTE, (const double *)e->small, in,
                              e->small + SG__OUTCOME_OFF, e->out.host, seq));
  e->out.seq = seq;
  return SG_OK;
}

void sg__outcome_defer(sg_engine *e) { e->out.pending = 1; }

/* The record of step `seq`: as the device's kernel wrote it into pinned memory when it landed
 * (no wait), else copied from device memory (a host wait, in queue order after the kernel). */
static sg_status read_record(sg_engine *e, sg_elem_step_out *r) {
  sg_elem_step_out *h = e->out.host;
  if (__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE) != e->out.seq) {
    SG_TRY(sg__engine_broken(e, e->dev->ops->copy(e->dev, SG_Q_COMPUTE, h, sg__outcome_dev(e),
                                                  sizeof *h, SG_COPY_D2H)));
    if (h->seq != e->out.seq)
      return sg__err(SG_ERR_INTERNAL, "the step's outcome: record of step %llu, expected %llu",
                     (unsigned long long)h->seq, (unsigned long long)e->out.seq);
  }
  *r = *h;
  return SG_OK;
}

sg_status sg__outcome_settle(sg_engine *e, sg_elem_step_out *out) {
  if (!e->out.pending) return SG_OK;
  sg_elem_step_out r;
  SG_TRY(read_record(e, &r));
  e->out.pending = 0;
  /* sg_step counted the step before the device decided: a skipped one does not count. */
  if (r.skip) {
    sg__optim_undo_begin(e);
    SG_LOG(SG_LOG_INFO, e->rank, "step skipped: non-finite gradients");
  }
  sg__scale_update(e, r.overflow);
  if (e->out.last_pending) { /* the step's info (sg_last_step_info) */
    e->out.last.step = e->opt.step;
    e->out.last.grad_norm = r.norm;
    e->out.last.clip_coef = r.clip;
    e->out.last.skipped = r.skip;
    e->out.last_pending = 0;
  }
  if (out) *out = r;
  return SG_OK;
}

void sg__outcome_keep(sg_engine *e, const sg_step_info *info, int pending) {
  e->out.last = *info;
  e->out.last_valid = 1;
  e->out.last_pending = pending;
}

sg_status sg_last_step_info(sg_engine *e, sg_step_info *info) {
  SG_ENGINE_GUARD(e, "sg_last_step_info");
  static const char fn[] = "sg_last_step_info";
  SG_TRY(sg__engine_check_out(e, info, "info", fn));
  if (info->struct_size != sizeof(sg_step_info))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: info->struct_size %zu, expected %zu", fn,
                   info->struct_size, sizeof(sg_step_info));
  if (!e->out.last_valid)
    return sg__err(SG_ERR_INVALID_STATE, "%s: no sg_step has completed yet", fn);
  /* a step the device decided and the host has not read yet: its outcome first */
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), fn));
  const size_t size = info->struct_size;
  *info = e->out.last;
  info->struct_size = size;
  return SG_OK;
}

sg_status sg_get_param_step(sg_engine *e, int id, uint64_t *step) {
  SG_ENGINE_GUARD(e, "sg_get_param_step");
  static const char *fn = "sg_get_param_step";
  SG_TRY(sg__engine_check_param(e, id, step, "step", fn));
  /* a step the device decided and the host has not read yet: its count first */
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), fn));
  *step = sg__optim_param_step(e, id);
  return SG_OK;
}

sg_status sg_get_step(sg_engine *e, uint64_t *step) {
  SG_ENGINE_GUARD(e, "sg_get_step");
  SG_TRY(sg__engine_check_out(e, step, "step", "sg_get_step"));
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), "sg_get_step"));
  *step = e->opt.step;
  return SG_OK;
}

sg_status sg_get_loss_scale(sg_engine *e, float *scale) {
  SG_ENGINE_GUARD(e, "sg_get_loss_scale");
  SG_TRY(sg__engine_check_out(e, scale, "scale", "sg_get_loss_scale"));
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), "sg_get_loss_scale"));
  *scale = e->sc.loss_scale;
  return SG_OK;
}
