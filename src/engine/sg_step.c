/* The optimizer step (DESIGN.md sections 4-5): global norm and non-finite check, clipping, loss
 * scaling, the update of this rank's part bucket by bucket, and the gathers after it. Decided on
 * the host after a wait for the norm, or on the device where it can (sg_outcome.c): then the
 * factor and the skip reach the update through device memory and nothing waits. */
#include <math.h>
#include <string.h>

#include "sg_engine_internal.h"

/* Bucket by bucket, last bucket first (the first layers of the next forward pass): each
 * bucket's gather runs on the comm queue while the next bucket's update runs. */
static sg_status update_and_gather(sg_engine *e, float grad_scale, const sg_elem_step_out *oc,
                                   int64_t trace) {
  if (!sg__gathers_needed(e)) {
    SG_TRY(sg__optim_update_all(e, grad_scale, oc));
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
    return SG_OK;
  }
  for (int b = e->plan->nbuckets - 1; b >= 0; b--) {
    sg_status st = sg__optim_update_bucket(e, b, grad_scale, oc);
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

static sg_status apply(sg_engine *e, float grad_scale, const sg_elem_step_out *oc,
                       int64_t trace, const uint8_t *present) {
  sg__optim_begin(e, present);
  sg_status st = update_and_gather(e, grad_scale, oc, trace);
  /* A failed first update leaves everything as it was; later failures break the engine. */
  if (st != SG_OK && e->state != SG_ES_BROKEN) sg__optim_undo_begin(e);
  return st;
}

/* Every reduction of the step submitted, the compute queue ordered after them (a stream wait on
 * CUDA, not a host wait). */
static sg_status step_reductions(sg_engine *e, const char *fn) {
  SG_TRY(sg__step_settle(e));
  SG_TRY(sg__grads_flush(e, fn));
  SG_TRY(sg__replicas_rest(e)); /* the buckets not summed across replicas yet */
  /* the way the state reads them: a stream wait on the device, a host wait for offload */
  return sg__engine_broken(e, e->strat->place->wait_reductions(e, sg__engine_host_deadline(e)));
}

/* The global sum of squares on the host (once per step: a sg_grad_norm before sg_step computed
 * it already unless gradients came after). */
static sg_status norm_of(sg_engine *e, double ss[3]) {
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

static sg_status step_sumsq(sg_engine *e, const char *fn, double ss[3]) {
  SG_TRY(step_reductions(e, fn));
  return norm_of(e, ss);
}

/* What the step's decision depends on besides the sum of squares. */
static sg_elem_step_in step_in(const sg_engine *e) {
  sg_elem_step_in in;
  memset(&in, 0, sizeof in);
  in.avg = e->cfg.grad_average ? 1.0 / sg__replicas_grad_world(e) : 1.0;
  in.inv_scale = 1.0 / (double)e->sc.loss_scale;
  in.user_scale = e->g.user_scale;
  in.max_norm = e->opt.max_grad_norm;
  in.skip_enabled = e->cfg.skip_nonfinite || e->sc.dynamic;
  return in;
}

static double global_norm(const sg_engine *e, const double ss[2]) {
  const sg_elem_step_in in = step_in(e);
  return sg_elem_step_norm(ss[0], &in);
}

sg_status sg_grad_norm(sg_engine *e, float *norm) {
  SG_ENGINE_GUARD(e, "sg_grad_norm");
  static const char *fn = "sg_grad_norm";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!norm) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: norm is NULL", fn);
  double ss[3] = {0, 0, 0};
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), fn)); /* the loss scale of the last step */
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
 * parameters, and the node gathers them (the transport does, bucket by bucket). Streaming:
 * every step whose group has buckets begins their sum, which the next step merges. Other steps
 * and engines: nothing. */
static sg_status outer_sync(sg_engine *e) {
  if (!sg__replicas_sync_due(e)) return SG_OK;
  SG_TRY(sg__step_settle(e));
  return sg__engine_broken(e, sg__replicas_sync(e));
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

/* Decided on the host: the norm read (a host wait), which parameters some rank gave a gradient
 * (DESIGN.md section 4, "Parameters without a gradient"), then the update with its factor, or
 * nothing when the step is skipped or no parameter got a gradient. */
static sg_status step_on_host(sg_engine *e, sg_step_info *info, const char *fn) {
  double ss[3] = {0, 0, 0};
  SG_TRY(norm_of(e, ss));
  const uint8_t *present = NULL;
  int npresent = 0;
  SG_TRY(sg__err_prefix(sg__grads_presence(e, ss, &present, &npresent), fn));
  SG_TRY(check_skips(e, present, npresent, fn));
  const int idle = npresent == 0;
  sg__grads_norm_drop(e); /* the next step computes its own */
  const int64_t trace = sg__trace_new(e, SG_TRACE_STEP, -1, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  const sg_elem_step_in in = step_in(e);
  const sg_elem_step_out o = sg_elem_step_outcome(ss[0], ss[1], &in);
  sg_step_info v = {sizeof v, e->opt.step, o.norm, o.clip, e->sc.loss_scale, o.skip};
  sg_status st = SG_OK;
  if (o.skip || idle)
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
  else
    st = apply(e, o.factor, NULL, trace, present);
  if (st == SG_OK) st = sg__grads_clear_accum(e);
  if (st == SG_OK) st = outer_sync(e);
  if (st != SG_OK) return st;
  v.step = e->opt.step;
  if (!idle) sg__scale_update(e, o.overflow);
  if (o.skip) SG_LOG(SG_LOG_INFO, e->rank, "step skipped: non-finite gradients");
  if (idle) SG_LOG(SG_LOG_INFO, e->rank, "no parameter got a gradient: nothing updated");
  sg__outcome_keep(e, &v, 0);
  fill_info(info, &v);
  return SG_OK;
}

/* Decided on the device: the summed partials, the step kernel and the updates reading its
 * record are queued in that order, with no host wait. The step is counted now and uncounted
 * when the host learns that it was skipped, which is also when the dynamic loss scale moves
 * (sg__outcome_settle: the next sg_step, or a reader of either; here, when info is asked for:
 * the step's one host wait, after everything is queued). Only for a rank that gave every
 * parameter a gradient: then every parameter is present, whatever the other ranks gave. */
static sg_status step_on_device(sg_engine *e, sg_step_info *info) {
  SG_TRY(sg__grads_sumsq_dev(e));
  sg__grads_norm_drop(e);
  const int64_t trace = sg__trace_new(e, SG_TRACE_STEP, -1, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  const sg_elem_step_in in = step_in(e);
  const float scale = e->sc.loss_scale;
  SG_TRY(sg__outcome_decide(e, &in));
  sg_status st = apply(e, 1.0f, sg__outcome_dev(e), trace, NULL);
  if (st == SG_OK) st = sg__grads_clear_accum(e);
  if (st == SG_OK) st = outer_sync(e);
  if (st != SG_OK) return st;
  sg__outcome_defer(e);
  /* the rest of its info comes with the outcome (sg__outcome_settle) */
  const sg_step_info partial = {sizeof partial, e->opt.step, 0.0f, 1.0f, scale, 0};
  sg__outcome_keep(e, &partial, 1);
  if (!info) return SG_OK;
  SG_TRY(sg__outcome_settle(e, NULL));
  fill_info(info, &e->out.last);
  return SG_OK;
}

sg_status sg_step(sg_engine *e, sg_step_info *info) {
  SG_ENGINE_GUARD(e, "sg_step");
  static const char *fn = "sg_step";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(check_info(info));
  /* the previous step's outcome, if the device decided it: this step's count and scale */
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), fn));
  SG_TRY(step_reductions(e, fn));
  /* a norm already read by sg_grad_norm, or a parameter this rank gave no gradient: the host
   * decides (both paths run the same collectives, so ranks may differ in which they take) */
  if (sg__outcome_on_device(e) && !e->g.norm_valid && !sg__grads_locally_absent(e))
    return step_on_device(e, info);
  return step_on_host(e, info, fn);
}
