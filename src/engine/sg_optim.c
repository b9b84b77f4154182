/* The optimizer's state (engine side): hyperparameters per group, the step counter, the fp32
 * state arrays and the update segments of this rank; their init, restore (sg_load) and the
 * public accessors. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_engine_internal.h"

/* ---------------------------------------------------------------------------------------- */
/* lifecycle                                                                                 */

void sg__optim_init(sg_engine *e) {
  sg__optim *o = &e->opt;
  const sg_config *c = &e->cfg;
  o->od = sg__optim_default();
  for (int g = 0; g < SG_MAX_GROUPS; g++) {
    o->lr[g] = c->lr; /* a group never set takes the config's values */
    o->wd[g] = c->weight_decay;
  }
  o->beta1 = c->beta1;
  o->beta2 = c->beta2;
  o->eps = c->eps;
  o->max_grad_norm = c->max_grad_norm;
  o->ngroups = 1;
}

/* s continues last: one segment. With stochastic rounding each parameter keeps its own
 * counter base. */
static int merges(const sg_engine *e, const sg__seg *last, const sg__seg *s) {
  return last->decay == s->decay && last->group == s->group &&
         last->shard_off + last->len == s->shard_off && last->flat_off + last->len == s->flat_off &&
         (!e->cfg.stochastic_rounding || last->sr_index + last->len == s->sr_index);
}

/* The part of parameter id this rank owns in the owned run `ow` of its bucket: 0 when none. */
static int param_run(const sg_engine *e, const sg__owned *ow, int id, sg__seg *s) {
  const sg__plan *p = e->plan;
  const size_t s0 = ow->flat0, s1 = ow->flat0 + ow->n;
  const size_t a = p->params[id].offset, z = a + p->params[id].numel;
  const size_t x0 = a > s0 ? a : s0, x1 = z < s1 ? z : s1;
  if (x0 >= x1) return 0;
  *s = (sg__seg){ow->state0 + (x0 - s0), x0, x1 - x0, !(p->params[id].flags & SG_PARAM_NO_DECAY),
                 ((uint64_t)id << 40) + (x0 - a), e->reg.group[id]};
  return 1;
}

/* Adjacent runs merge into one segment, but never across buckets: the step updates and gathers
 * bucket by bucket. */
static sg_status push_seg(sg_engine *e, int *cap, int first_of_bucket, sg__seg s) {
  sg__optim *o = &e->opt;
  if (o->nsegs > first_of_bucket && merges(e, &o->segs[o->nsegs - 1], &s)) {
    o->segs[o->nsegs - 1].len += s.len;
    return SG_OK;
  }
  if (o->nsegs == *cap) {
    int nc = *cap ? *cap * 2 : 64;
    sg__seg *n = realloc(o->segs, (size_t)nc * sizeof *n);
    if (!n) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
    o->segs = n;
    *cap = nc;
  }
  o->segs[o->nsegs++] = s;
  return SG_OK;
}

/* The owned, non-padding runs of bucket b. */
static sg_status bucket_segments(sg_engine *e, int b, int *cap) {
  const sg__plan *p = e->plan;
  const sg__bucket *bk = &p->buckets[b];
  sg__owned ow;
  e->strat->owned(p, e->rank, b, &ow);
  const int first = e->opt.nsegs;
  for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
    sg__seg s;
    if (param_run(e, &ow, p->order[k], &s)) SG_TRY(push_seg(e, cap, first, s));
  }
  return SG_OK;
}

static sg_status build_segments(sg_engine *e) {
  sg__optim *o = &e->opt;
  const int nb = e->plan->nbuckets;
  int cap = 0;
  o->nsegs = 0;
  o->bucket_seg = calloc((size_t)nb + 1, sizeof *o->bucket_seg);
  if (!o->bucket_seg) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  for (int b = 0; b < nb; b++) {
    o->bucket_seg[b] = o->nsegs;
    SG_TRY(bucket_segments(e, b, &cap));
  }
  o->bucket_seg[nb] = o->nsegs;
  return SG_OK;
}

/* The per-parameter step counts (all equal the engine's at first) and the segments of one
 * class of a bucket, at most one per parameter. */
static sg_status alloc_classes(sg_engine *e) {
  sg__optim *o = &e->opt;
  int most = 1;
  for (int b = 0; b < e->plan->nbuckets; b++)
    if (e->plan->buckets[b].param_count > most) most = e->plan->buckets[b].param_count;
  o->lag = calloc((size_t)e->reg.nparams, sizeof *o->lag);
  o->cls = malloc((size_t)most * sizeof *o->cls);
  o->nlag = 0;
  if (!o->lag || !o->cls) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  return SG_OK;
}

sg_status sg__optim_bind(sg_engine *e) {
  sg__optim *o = &e->opt;
  const sg__layout *l = &e->lay;
  const sg__state_ops *so = e->strat->place;
  o->master = so->array(e, 0);
  if (l->nstates != o->od->nstates)
    return sg__err(SG_ERR_INTERNAL, "sg_finalize: %d state arrays laid out, %s keeps %d",
                   l->nstates, o->od->name, o->od->nstates);
  o->nstates = l->nstates;
  for (int k = 0; k < l->nstates; k++)
    o->state[k] = so->array(e, 1 + k);
  o->ngroups = 1;
  for (int i = 0; i < e->reg.nparams; i++)
    if (e->reg.group[i] + 1 > o->ngroups) o->ngroups = e->reg.group[i] + 1;
  SG_TRY(alloc_classes(e));
  return build_segments(e);
}

void sg__optim_free(sg_engine *e) {
  sg__optim *o = &e->opt;
  free(o->segs);
  free(o->bucket_seg);
  free(o->lag);
  free(o->cls);
  o->lag = NULL;
  o->cls = NULL;
  o->nlag = 0;
  o->segs = NULL;
  o->bucket_seg = NULL;
  o->nsegs = 0;
  o->master = NULL;
  for (int k = 0; k < SG__OPTIM_MAX_STATES; k++) o->state[k] = NULL;
  o->nstates = 0;
}

void sg__optim_restore(sg_engine *e, uint64_t step, float lr0, uint32_t ngroups,
                       const float *group_lr, const float *group_wd) {
  sg__optim *o = &e->opt;
  o->step = step;
  if (o->lag) memset(o->lag, 0, (size_t)e->reg.nparams * sizeof *o->lag);
  o->nlag = 0;
  for (int g = 0; g < SG_MAX_GROUPS; g++) o->lr[g] = lr0;
  for (uint32_t g = 0; g < ngroups && g < SG_MAX_GROUPS; g++) {
    if (g > 0) o->lr[g] = group_lr[g]; /* group 0's lr is the saved lr */
    o->wd[g] = group_wd[g];
  }
}

void sg__optim_restore_param_step(sg_engine *e, int id, uint64_t step) {
  sg__optim *o = &e->opt;
  const uint64_t lag = step < o->step ? o->step - step : 0;
  o->nlag += (lag > 0) - (o->lag[id] > 0);
  o->lag[id] = lag;
}

uint64_t sg__optim_param_step(const sg_engine *e, int id) { return e->opt.step - e->opt.lag[id]; }

int sg__optim_steps_differ(const sg_engine *e) { return e->opt.nlag > 0; }

/* ---------------------------------------------------------------------------------------- */
/* the update                                                                                */

/* Group g's hyperparameters as the optimizer's scalars read them. */
static sg_hparams group_hparams(const sg__optim *o, int g) {
  return (sg_hparams){sizeof(sg_hparams), o->lr[g], o->wd[g], o->beta1, o->beta2, o->eps,
                      o->max_grad_norm};
}

/* The scalars of step t: the engine's step, or one class's own step count. */
static sg__update_args update_args(const sg_engine *e, float grad_scale, uint64_t t) {
  const sg_config *c = &e->cfg;
  const sg__optim *o = &e->opt;
  sg__update_args a;
  memset(&a, 0, sizeof a);
  a.param = e->params;
  a.param_dtype = c->param_dtype;
  a.master = o->master;
  for (int k = 0; k < o->nstates; k++) a.state[k] = o->state[k];
  a.grad = e->g.accum;
  a.grad_dtype = c->accum_dtype;
  a.segs = o->segs;
  a.nsegs = o->nsegs;
  a.grad_scale = grad_scale;
  a.step = t;
  /* one group leaves ngroups at 0 (every segment is group 0's, as before groups) */
  a.ngroups = o->ngroups > 1 ? o->ngroups : 0;
  sg_hparams hp[SG_MAX_GROUPS];
  for (int g = 0; g < (o->ngroups > 1 ? o->ngroups : 1); g++) hp[g] = group_hparams(o, g);
  o->od->scalars(&a, hp);
  a.stochastic_rounding = c->stochastic_rounding && c->param_dtype == SG_BF16;
  a.seed = c->seed;
  return a;
}

/* A skipped parameter falls one more step behind the engine's count (torch keeps a step count
 * per parameter and advances only those with a gradient). */
static void lag_absent(sg__optim *o, const uint8_t *present, int n, int by) {
  for (int i = 0; i < n; i++) {
    if (present[i]) continue;
    const int was = o->lag[i] > 0;
    o->lag[i] = by > 0 ? o->lag[i] + 1 : o->lag[i] - 1;
    o->nlag += (o->lag[i] > 0) - was;
  }
}

void sg__optim_begin(sg_engine *e, const uint8_t *present) {
  sg__optim *o = &e->opt;
  o->step++;
  o->present = present;
  if (present) lag_absent(o, present, e->reg.nparams, 1);
}

void sg__optim_undo_begin(sg_engine *e) {
  sg__optim *o = &e->opt;
  o->step--;
  if (o->present) lag_absent(o, o->present, e->reg.nparams, -1);
  o->present = NULL;
}

static sg_status update_range(sg_engine *e, float grad_scale, const sg_elem_step_out *outcome,
                              int s0, int s1) {
  sg__update_args a = update_args(e, grad_scale, e->opt.step);
  a.outcome = outcome;
  a.segs = e->opt.segs ? e->opt.segs + s0 : NULL; /* no segments: a shard with no elements */
  a.nsegs = s1 - s0;
  return e->strat->place->update(e, &a);
}

static int updated(const sg__optim *o, int id) { return !o->present || o->present[id]; }

/* The owned runs of bucket b's updated parameters whose own step count is t, merged. */
static int class_segments(sg_engine *e, int b, uint64_t t) {
  const sg__plan *p = e->plan;
  const sg__bucket *bk = &p->buckets[b];
  sg__optim *o = &e->opt;
  sg__owned ow;
  e->strat->owned(p, e->rank, b, &ow);
  int n = 0;
  for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
    const int id = p->order[k];
    sg__seg s;
    if (!updated(o, id) || sg__optim_param_step(e, id) != t || !param_run(e, &ow, id, &s)) continue;
    if (n > 0 && merges(e, &o->cls[n - 1], &s))
      o->cls[n - 1].len += s.len;
    else
      o->cls[n++] = s;
  }
  return n;
}

/* The smallest own step count above `after` of bucket b's updated parameters; 0: none. */
static uint64_t next_class(const sg_engine *e, int b, uint64_t after) {
  const sg__bucket *bk = &e->plan->buckets[b];
  uint64_t best = 0;
  for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
    const int id = e->plan->order[k];
    const uint64_t t = sg__optim_param_step(e, id);
    if (updated(&e->opt, id) && t > after && (best == 0 || t < best)) best = t;
  }
  return best;
}

/* Some parameter is skipped or behind: bucket b once per class of equal step counts, each with
 * its own scalars (no kernel change: a class is a subset of the bucket's segments). */
static sg_status update_classes(sg_engine *e, int b, float grad_scale,
                                const sg_elem_step_out *outcome) {
  for (uint64_t t = next_class(e, b, 0); t != 0; t = next_class(e, b, t)) {
    const int n = class_segments(e, b, t);
    if (n == 0) continue;
    sg__update_args a = update_args(e, grad_scale, t);
    a.outcome = outcome;
    a.segs = e->opt.cls;
    a.nsegs = n;
    SG_TRY(e->strat->place->update(e, &a));
  }
  return SG_OK;
}

static int uniform(const sg__optim *o) { return !o->present && o->nlag == 0; }

sg_status sg__optim_update_bucket(sg_engine *e, int b, float grad_scale,
                                  const sg_elem_step_out *outcome) {
  if (!uniform(&e->opt)) return update_classes(e, b, grad_scale, outcome);
  return update_range(e, grad_scale, outcome, e->opt.bucket_seg[b], e->opt.bucket_seg[b + 1]);
}

sg_status sg__optim_update_all(sg_engine *e, float grad_scale, const sg_elem_step_out *outcome) {
  if (uniform(&e->opt)) return update_range(e, grad_scale, outcome, 0, e->opt.nsegs);
  for (int b = 0; b < e->plan->nbuckets; b++) SG_TRY(update_classes(e, b, grad_scale, outcome));
  return SG_OK;
}

sg_status sg__optim_check_state(const sg_engine *e, int which, const char *fn) {
  const sg__optim_desc *od = e->opt.od;
  if (which >= 0 && which < od->nstates) return SG_OK;
  char names[128] = "";
  for (int k = 0, n = 0; k < od->nstates && n < (int)sizeof names; k++)
    n += snprintf(names + n, sizeof names - (size_t)n, "%s%d (%s)", k ? ", " : "", k,
                  od->state_name[k]);
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: which must be %s, got %d", fn, names, which);
}

sg_status sg__optim_master_from_working(sg_engine *e) {
  const sg__optim *o = &e->opt;
  if (!o->master) return SG_OK;
  return e->strat->place->master_from_working(e);
}

/* ---------------------------------------------------------------------------------------- */
/* public: learning rate, groups, state                                                      */

/* lr and weight_decay at run time: finite and >= 0 (NaN fails the comparison). group < 0: the
 * value is not a group's. */
static sg_status check_rate(const char *fn, const char *what, float v, int group) {
  if (v >= 0.0f && !isinf(v)) return SG_OK;
  if (group < 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s must be finite and >= 0 (got %g)", fn, what, v);
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s must be finite and >= 0 (got %g, group %d)", fn,
                 what, v, group);
}

sg_status sg_set_lr(sg_engine *e, float lr) {
  SG_ENGINE_GUARD(e, "sg_set_lr");
  static const char *fn = "sg_set_lr";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(check_rate(fn, "lr", lr, -1));
  e->opt.lr[0] = lr;
  return SG_OK;
}

sg_status sg_get_lr(sg_engine *e, float *lr) {
  SG_ENGINE_GUARD(e, "sg_get_lr");
  SG_TRY(sg__engine_check_out(e, lr, "lr", "sg_get_lr"));
  *lr = (float)e->opt.lr[0];
  return SG_OK;
}

sg_status sg_set_group(sg_engine *e, int group, float lr, float weight_decay) {
  SG_ENGINE_GUARD(e, "sg_set_group");
  static const char *fn = "sg_set_group";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(sg__engine_check_group(group, fn));
  SG_TRY(check_rate(fn, "lr", lr, group));
  SG_TRY(check_rate(fn, "weight_decay", weight_decay, group));
  e->opt.lr[group] = lr;
  e->opt.wd[group] = weight_decay;
  return SG_OK;
}

sg_status sg_get_group(sg_engine *e, int group, float *lr, float *weight_decay) {
  SG_ENGINE_GUARD(e, "sg_get_group");
  static const char *fn = "sg_get_group";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(sg__engine_check_group(group, fn));
  if (!lr) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: lr is NULL", fn);
  if (!weight_decay) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: weight_decay is NULL", fn);
  *lr = (float)e->opt.lr[group];
  *weight_decay = (float)e->opt.wd[group];
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* public: exact hyperparameters                                                             */

static sg_status check_hparams_struct(const char *fn, const void *h, size_t struct_size) {
  if (!h) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hparams is NULL", fn);
  if (struct_size != sizeof(sg_hparams))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: struct_size %zu, expected %zu", fn, struct_size,
                   sizeof(sg_hparams));
  return SG_OK;
}

static sg_status check_double(const char *fn, const char *what, double v, double lo, int strict,
                              double below, int group) {
  const int ok = isfinite(v) && (strict ? v > lo : v >= lo) && v < below;
  if (ok) return SG_OK;
  if (below < INFINITY)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s must be in [%g, %g) (got %.17g, group %d)",
                   fn, what, lo, below, v, group);
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s must be finite and %s %g (got %.17g, group %d)",
                 fn, what, strict ? ">" : ">=", lo, v, group);
}

sg_status sg_get_hparams(sg_engine *e, int group, sg_hparams *out) {
  SG_ENGINE_GUARD(e, "sg_get_hparams");
  static const char *fn = "sg_get_hparams";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(sg__engine_check_group(group, fn));
  SG_TRY(check_hparams_struct(fn, out, out ? out->struct_size : 0));
  const sg__optim *o = &e->opt;
  *out = group_hparams(o, group);
  return SG_OK;
}

sg_status sg_set_hparams(sg_engine *e, int group, const sg_hparams *h) {
  SG_ENGINE_GUARD(e, "sg_set_hparams");
  static const char *fn = "sg_set_hparams";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(sg__engine_check_group(group, fn));
  SG_TRY(check_hparams_struct(fn, h, h ? h->struct_size : 0));
  SG_TRY(check_double(fn, "lr", h->lr, 0.0, 0, INFINITY, group));
  SG_TRY(check_double(fn, "weight_decay", h->weight_decay, 0.0, 0, INFINITY, group));
  SG_TRY(check_double(fn, "beta1", h->beta1, 0.0, 0, 1.0, group));
  SG_TRY(check_double(fn, "beta2", h->beta2, 0.0, 0, 1.0, group));
  SG_TRY(check_double(fn, "eps", h->eps, 0.0, 1, INFINITY, group));
  SG_TRY(check_double(fn, "max_grad_norm", h->max_grad_norm, 0.0, 0, INFINITY, group));
  sg__optim *o = &e->opt;
  o->lr[group] = h->lr;
  o->wd[group] = h->weight_decay;
  o->beta1 = h->beta1;
  o->beta2 = h->beta2;
  o->eps = h->eps;
  o->max_grad_norm = h->max_grad_norm;
  return SG_OK;
}

