/* The optimizer step (DESIGN.md sections 4-5): global norm and non-finite check, clipping, loss
 * scaling, the update of this rank's part bucket by bucket, and the gathers after it. */
#include <math.h>
#include <string.h>

#include "sg_engine_internal.h"

/* Bucket by bucket, last bucket first (the first layers of the next forward pass): each
 * bucket's gather runs on the comm queue while the next bucket's update runs. */
static sg_status update_and_gather(sg_engine *e, float grad_scale, int64_t trace) {
  if (!sg__gathers_needed(e)) {
    SG_TRY(sg__optim_update_all(e, grad_scale));
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
    return SG_OK;
  }
  for (int b = e->plan->nbuckets - 1; b >= 0; b--) {
    sg_status st = sg__optim_update_bucket(e, b, grad_scale);
    const int untouched = st != SG_OK && b == e->plan->nbuckets - 1;
    if (st == SG_OK) {
      if (b == 0) sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
      st = sg__gathers_submit(e, b);
    }
    /* Some buckets are updated (and gathered), others not: the replicas now differ. */
    if (st != SG_OK && !untouched) return sg__engine_break(e, st, "in sg_step (buckets half updated)");
    SG_TRY(st);
  }
  /* Without overlap the caller's next kernels (which read the parameters) wait here. */
  return e->cfg.overlap_param_gather ? SG_OK : sg__step_settle(e);
}

static void fill_info(sg_step_info *info, const sg_step_info *v) {
  if (!info) return;
  sg_step_info s = *v;
  s.struct_size = info->struct_size;
  memcpy(info, &s, info->struct_size);
}

static sg_status check_info(const sg_step_info *info) {
  if (info && info->struct_size != sizeof(sg_step_info))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_step: info->struct_size %zu, expected %zu",
                   info->struct_size, sizeof(sg_step_info));
  return SG_OK;
}

static sg_status apply(sg_engine *e, float grad_scale, int64_t trace, const uint8_t *present) {
  sg__optim_begin(e, present);
  sg_status st = update_and_gather(e, grad_scale, trace);
  /* A failed first update leaves everything as it was; later failures break the engine. */
  if (st != SG_OK && e->state != SG_ES_BROKEN) sg__optim_undo_begin(e);
  return st;
}

/* Every reduction of the step submitted, the compute queue ordered after them (a stream wait on
 * CUDA, not a host wait), then the global sum of squares (once per step: a sg_grad_norm before
 * sg_step computed it already unless gradients came after). */
static sg_status step_sumsq(sg_engine *e, const char *fn, double ss[3]) {
  SG_TRY(sg__step_settle(e));
  SG_TRY(sg__grads_flush(e, fn));
  SG_TRY(sg__replicas_rest(e)); /* the buckets not summed across replicas yet */
  /* the way the state reads them: a stream wait on the device, a host wait for offload */
  SG_TRY(sg__engine_broken(e, e->strat->place->wait_reductions(e, sg__engine_host_deadline(e))));
  if (!e->g.norm_valid) {
    double s[3] = {0, 0, 0};
    SG_TRY(sg__grads_sumsq(e, s));
    sg__grads_norm_keep(e, s);
  }
  ss[0] = e->g.norm_ss[0];
  ss[1] = e->g.norm_ss[1];
  ss[2] = e->g.norm_ss[2];
  return SG_OK;
}

static double global_norm(const sg_engine *e, const double ss[2]) {
  const double avg = e->cfg.grad_average ? 1.0 / sg__replicas_grad_world(e) : 1.0;
  return sqrt(ss[0]) * avg * (1.0 / (double)e->sc.loss_scale) * fabs(e->g.user_scale);
}

sg_status sg_grad_norm(sg_engine *e, float *norm) {
  SG_ENGINE_GUARD(e, "sg_grad_norm");
  static const char *fn = "sg_grad_norm";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!norm) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: norm is NULL", fn);
  double ss[3];
  SG_TRY(sg__err_prefix(step_sumsq(e, fn, ss), fn));
  *norm = ss[1] > 0 ? NAN : (float)global_norm(e, ss);
  return SG_OK;
}

sg_status sg_grad_scale(sg_engine *e, double factor) {
  SG_ENGINE_GUARD(e, "sg_grad_scale");
  static const char *fn = "sg_grad_scale";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!isfinite(factor))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: factor must be finite (got %g)", fn, factor);
  /* A product that overflows or underflows to 0 from nonzero factors would be silently wrong. */
  const double next = e->g.user_scale * factor;
  if (!isfinite(next) || (next == 0 && factor != 0 && e->g.user_scale != 0))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: the step's gradient scale %g times %g is out of "
                   "double range", fn, e->g.user_scale, factor);
  sg__grads_scale_by(e, factor);
  return SG_OK;
}

/* The end of an outer period of a hybrid engine with outer steps (every step counts, skipped or
 * not, so that the replicas stay in step): the step's gathers landed, the replicas agree on the
 * parameters, and the node gathers them. Every other step, and other engines: nothing. */
static sg_status outer_sync(sg_engine *e) {
  if (!sg__replicas_sync_due(e)) return SG_OK;
  SG_TRY(sg__step_settle(e));
  SG_TRY(sg__engine_broken(e, sg__replicas_sync(e)));
  return sg__gathers_all(e);
}

/* A state placement whose update cannot skip parameters (declared) refuses a step that would
 * have to: on every rank alike, since the presence is agreed. Nothing has changed yet. */
static sg_status check_skips(const sg_engine *e, const uint8_t *present, int npresent,
                             const char *fn) {
  /* (sg_load gives every parameter the step there: no counts differ) */
  if (e->strat->place->skips || !present || npresent == 0)
    return SG_OK; /* no gradient at all: nothing is updated, nothing to skip */
  int id = 0; /* the first skipped parameter */
  while (id < e->reg.nparams - 1 && present[id]) id++;
  return sg__err(SG_ERR_UNSUPPORTED, "%s: no rank gave parameter '%s' a gradient in this step, "
                 "and this optimizer state ('%s': offload or 8-bit) cannot skip a parameter "
                 "(docs/limits.md): give every parameter a gradient in every step (sg_grad_ready "
                 "marks zeros), or sg_grad_zero to drop this step's gradients", fn,
                 e->reg.names[id], e->strat->place->name);
}

sg_status sg_step(sg_engine *e, sg_step_info *info) {
  SG_ENGINE_GUARD(e, "sg_step");
  static const char *fn = "sg_step";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(check_info(info));
  double ss[3] = {0, 0, 0};
  SG_TRY(step_sumsq(e, fn, ss));
  /* Parameters no rank gave a gradient are skipped (torch's .grad None); none: no step. */
  const uint8_t *present = NULL;
  int npresent = 0;
  SG_TRY(sg__err_prefix(sg__grads_presence(e, ss, &present, &npresent), fn));
  SG_TRY(check_skips(e, present, npresent, fn));
  const int idle = npresent == 0;
  sg__grads_norm_drop(e); /* the next step computes its own */
  const int64_t trace = sg__trace_new(e, SG_TRACE_STEP, -1, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  const double avg = e->cfg.grad_average ? 1.0 / sg__replicas_grad_world(e) : 1.0;
  const double inv_scale = 1.0 / (double)e->sc.loss_scale;
  const double norm = global_norm(e, ss);
  const int overflow = ss[1] > 0 || !isfinite(norm);
  const int skip = overflow && (e->cfg.skip_nonfinite || e->sc.dynamic);
  double clip = 1.0;
  if (e->opt.max_grad_norm > 0 && isfinite(norm))
    clip = fmin(1.0, e->opt.max_grad_norm / (norm + 1e-6));
  sg_step_info v = {sizeof v, e->opt.step, (float)norm, (float)clip, e->sc.loss_scale, skip};
  sg_status st = SG_OK;
  if (skip || idle)
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
  else
    st = apply(e, (float)(avg * inv_scale * clip * e->g.user_scale), trace, present);
  if (st == SG_OK) st = sg__grads_clear_accum(e);
  if (st == SG_OK) st = outer_sync(e);
  if (st != SG_OK) return st;
  v.step = e->opt.step;
  if (!idle) sg__scale_update(e, overflow);
  if (skip) SG_LOG(SG_LOG_INFO, e->rank, "step skipped: non-finite gradients");
  if (idle) SG_LOG(SG_LOG_INFO, e->rank, "no parameter got a gradient: nothing updated");
  fill_info(info, &v);
  return SG_OK;
}
