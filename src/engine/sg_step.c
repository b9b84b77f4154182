/* The optimizer step (DESIGN.md sections 4-5): global norm and non-finite check, clipping, loss
 * scaling, fused AdamW on this rank's shard, all-gather of the working parameters. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sg_engine_internal.h"

/* ---------------------------------------------------------------------------------------- */
/* segments: the owned, non-padding runs of the shard                                        */

/* Adjacent runs merge into one segment, but never across buckets: the step updates and gathers
 * bucket by bucket. */
static sg_status push_seg(sg_engine *e, int *cap, int first_of_bucket, sg__seg s) {
  if (e->nsegs > first_of_bucket) {
    sg__seg *last = &e->segs[e->nsegs - 1];
    /* With stochastic rounding each parameter keeps its own counter base. */
    if (last->decay == s.decay && last->group == s.group &&
        last->shard_off + last->len == s.shard_off &&
        last->flat_off + last->len == s.flat_off &&
        (!e->cfg.stochastic_rounding || last->sr_index + last->len == s.sr_index)) {
      last->len += s.len;
      return SG_OK;
    }
  }
  if (e->nsegs == *cap) {
    int nc = *cap ? *cap * 2 : 64;
    sg__seg *n = realloc(e->segs, (size_t)nc * sizeof *n);
    if (!n) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
    e->segs = n;
    *cap = nc;
  }
  e->segs[e->nsegs++] = s;
  return SG_OK;
}

static sg_status bucket_segments(sg_engine *e, int b, int *cap) {
  const sg__plan *p = e->plan;
  const int sharded = e->cfg.strategy != SG_NO_SHARD;
  const sg__bucket *bk = &p->buckets[b];
  const size_t s0 = sharded ? sg__plan_slice_start(p, b, e->rank) : bk->start;
  const size_t s1 = s0 + (sharded ? sg__plan_slice_numel(p, b) : bk->numel);
  const size_t base = sharded ? bk->shard_offset : bk->start;
  const int first = e->nsegs;
  for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
    const int id = p->order[k];
    const size_t a = p->params[id].offset, z = a + p->params[id].numel;
    const size_t x0 = a > s0 ? a : s0, x1 = z < s1 ? z : s1;
    if (x0 >= x1) continue;
    sg__seg s = {base + (x0 - s0), x0, x1 - x0, !(p->params[id].flags & SG_PARAM_NO_DECAY),
                 ((uint64_t)id << 40) + (x0 - a), e->group[id]};
    SG_TRY(push_seg(e, cap, first, s));
  }
  return SG_OK;
}

sg_status sg__step_build_segments(sg_engine *e) {
  const int nb = e->plan->nbuckets;
  int cap = 0;
  e->nsegs = 0;
  free(e->bucket_seg);
  free(e->gather_ticket);
  e->bucket_seg = calloc((size_t)nb + 1, sizeof *e->bucket_seg);
  e->gather_ticket = calloc((size_t)nb, sizeof *e->gather_ticket);
  if (!e->bucket_seg || !e->gather_ticket)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  e->gather_pending = 0;
  for (int b = 0; b < nb; b++) {
    e->bucket_seg[b] = e->nsegs;
    SG_TRY(bucket_segments(e, b, &cap));
  }
  e->bucket_seg[nb] = e->nsegs;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* norm                                                                                      */

/* Sum of squares and non-finite count of the reduced (still scaled) gradient over all ranks. */
static sg_status global_sumsq(sg_engine *e, double out[2]) {
  sg__device *d = e->dev;
  SG_TRY(d->ops->sumsq(d, SG_Q_COMPUTE, e->accum, e->cfg.accum_dtype, e->lay.accum_numel, &out[0],
                       &out[1]));
  if (e->cfg.strategy == SG_NO_SHARD || e->world == 1) return SG_OK;
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, e->small, out, 2 * sizeof(double), SG_COPY_H2D));
  SG_TRY(sg__engine_allreduce(e, e->small, 2, SG__F64));
  return d->ops->copy(d, SG_Q_COMPUTE, out, e->small, 2 * sizeof(double), SG_COPY_D2H);
}

/* ---------------------------------------------------------------------------------------- */
/* loss scale                                                                                */

static void scale_update(sg_engine *e, int overflow) {
  if (!e->dynamic_scale) return;
  if (overflow) {
    float s = e->loss_scale * 0.5f;
    e->loss_scale = s > e->cfg.min_loss_scale ? s : e->cfg.min_loss_scale;
    e->clean_steps = 0;
    SG_LOG(SG_LOG_INFO, e->rank, "non-finite gradients: loss scale -> %g", e->loss_scale);
    return;
  }
  if (++e->clean_steps >= e->cfg.scale_window) {
    float s = e->loss_scale * 2.0f;
    if (isfinite(s)) e->loss_scale = s;
    e->clean_steps = 0;
  }
}

/* ---------------------------------------------------------------------------------------- */
/* update                                                                                    */

static sg__adamw_args adamw_args(const sg_engine *e, float grad_scale) {
  const sg_config *c = &e->cfg;
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param = e->params;
  a.param_dtype = c->param_dtype;
  a.master = e->master;
  a.m = e->m;
  a.v = e->v;
  a.grad = e->accum;
  a.grad_dtype = c->accum_dtype;
  a.segs = e->segs;
  a.nsegs = e->nsegs;
  a.grad_scale = grad_scale;
  sg__adamw_scalars(&a, e->lr, c->beta1, c->beta2, c->eps, e->group_wd[0], e->step);
  /* Groups 1..ngroups-1 by the same rule; one group leaves ngroups at 0 (as before groups). */
  if (e->ngroups > 1) {
    a.ngroups = e->ngroups;
    for (int g = 1; g < e->ngroups; g++)
      sg__adamw_group_scalars(&a, g, e->group_lr[g], c->beta1, e->group_wd[g]);
  }
  a.stochastic_rounding = c->stochastic_rounding && c->param_dtype == SG_BF16;
  a.seed = c->seed;
  return a;
}

/* ---------------------------------------------------------------------------------------- */
/* all-gather                                                                                */

static int gathers(const sg_engine *e) {
  return e->cfg.strategy != SG_NO_SHARD && e->world > 1;
}

typedef struct { sg_engine *e; int b; int64_t trace; } sg__gather_job;

/* In-place all-gather of one bucket's working parameters. */
static sg_status gather_job_fn(void *arg) {
  const sg__gather_job j = *(sg__gather_job *)arg;
  free(arg);
  const sg__plan *p = j.e->plan;
  const size_t P = sg__dtype_size(j.e->cfg.param_dtype);
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = j.e->comm->ops->all_gather(j.e->comm, j.e->params + p->buckets[j.b].start * P,
                                            sg__plan_slice_numel(p, j.b) * P,
                                            sg__deadline(j.e->cfg.timeout_ms));
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

/* Queued after everything issued to the compute queue so far: the bucket's AdamW. */
static sg_status submit_gather(sg_engine *e, int b) {
  sg__gather_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_step: out of host memory");
  *j = (sg__gather_job){e, b, sg__trace_new(e, SG_TRACE_GATHER, b, NULL)};
  uint64_t t = 0;
  sg_status st = e->dev->ops->comm_submit(e->dev, gather_job_fn, j, &t);
  if (st != SG_OK) {
    if (t == 0) free(j);
    return st;
  }
  e->last_ticket = e->gather_last = e->gather_ticket[b] = t;
  e->gather_pending = 1;
  return SG_OK;
}

/* The caller's queue waits for the gather job `ticket` (and every job before it). */
static sg_status wait_gathers(sg_engine *e, uint64_t ticket, int b) {
  if (!e->gather_pending || ticket <= e->gather_waited) return SG_OK;
  const int64_t trace = sg__trace_new(e, SG_TRACE_WAIT, b, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, ticket, sg__engine_host_deadline(e));
  if (st != SG_OK) return sg__engine_broken(e, st);
  sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
  e->gather_waited = ticket;
  if (ticket >= e->gather_last) e->gather_pending = 0;
  return SG_OK;
}

sg_status sg__step_settle(sg_engine *e) {
  return wait_gathers(e, e->gather_last, 0); /* bucket 0 is gathered last */
}

sg_status sg_param_wait(sg_engine *e, int id) {
  SG_ENGINE_GUARD(e, "sg_param_wait");
  static const char *fn = "sg_param_wait";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (id == -1) return sg__err_prefix(sg__step_settle(e), fn);
  SG_TRY(sg__engine_check_id(e, id, fn));
  const int b = e->plan->params[id].bucket;
  return sg__err_prefix(wait_gathers(e, e->gather_ticket[b], b), fn);
}

/* ---------------------------------------------------------------------------------------- */
/* update                                                                                    */

/* AdamW on segments [s0, s1) of the shard. */
static sg_status adamw_range(sg_engine *e, const sg__adamw_args *all, int s0, int s1) {
  sg__adamw_args a = *all;
  a.segs = e->segs + s0;
  a.nsegs = s1 - s0;
  return e->dev->ops->adamw(e->dev, SG_Q_COMPUTE, &a);
}

/* Bucket by bucket, last bucket first (the first layers of the next forward pass): each
 * bucket's gather runs on the comm queue while the next bucket's AdamW runs. */
static sg_status update_and_gather(sg_engine *e, const sg__adamw_args *a, int64_t trace) {
  if (!gathers(e)) {
    SG_TRY(adamw_range(e, a, 0, e->nsegs));
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
    return SG_OK;
  }
  for (int b = e->plan->nbuckets - 1; b >= 0; b--) {
    sg_status st = adamw_range(e, a, e->bucket_seg[b], e->bucket_seg[b + 1]);
    const int untouched = st != SG_OK && b == e->plan->nbuckets - 1;
    if (st == SG_OK) {
      if (b == 0) sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
      st = submit_gather(e, b);
    }
    if (st != SG_OK && !untouched) {
      /* Some buckets are updated (and gathered), others not: the replicas now differ. */
      e->state = SG_ES_BROKEN;
      SG_LOG(SG_LOG_WARN, e->rank, "engine broken in sg_step at bucket %d: %s", b,
             sg_last_error());
    }
    SG_TRY(st);
  }
  /* Without overlap the caller's next kernels (which read the parameters) wait here. */
  return e->cfg.overlap_param_gather ? SG_OK : sg__step_settle(e);
}

static void fill_info(const sg_engine *e, sg_step_info *info, const sg_step_info *v) {
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

static sg_status apply(sg_engine *e, float grad_scale, int64_t trace) {
  e->step++;
  sg__adamw_args a = adamw_args(e, grad_scale);
  sg_status st = update_and_gather(e, &a, trace);
  /* A failed first AdamW leaves everything as it was; later failures break the engine. */
  if (st != SG_OK && e->state != SG_ES_BROKEN) e->step--;
  return st;
}

sg_status sg_step(sg_engine *e, sg_step_info *info) {
  SG_ENGINE_GUARD(e, "sg_step");
  static const char *fn = "sg_step";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(check_info(info));
  SG_TRY(sg__step_settle(e));
  SG_TRY(sg__grads_flush(e, fn));
  SG_TRY(sg__engine_broken(e, e->dev->ops->comm_wait(e->dev, e->last_ticket,
                                                     sg__engine_host_deadline(e))));
  const int64_t trace = sg__trace_new(e, SG_TRACE_STEP, -1, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  double ss[2] = {0, 0};
  SG_TRY(global_sumsq(e, ss));
  const double avg = e->cfg.grad_average ? 1.0 / e->world : 1.0;
  const double inv_scale = 1.0 / (double)e->loss_scale;
  const double norm = sqrt(ss[0]) * avg * inv_scale;
  const int overflow = ss[1] > 0 || !isfinite(norm);
  const int skip = overflow && (e->cfg.skip_nonfinite || e->dynamic_scale);
  double clip = 1.0;
  if (e->cfg.max_grad_norm > 0 && isfinite(norm))
    clip = fmin(1.0, (double)e->cfg.max_grad_norm / (norm + 1e-6));
  sg_step_info v = {sizeof v, e->step, (float)norm, (float)clip, e->loss_scale, skip};
  sg_status st = SG_OK;
  if (skip)
    sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
  else
    st = apply(e, (float)(avg * inv_scale * clip), trace);
  if (st == SG_OK)
    st = e->dev->ops->zero(e->dev, SG_Q_COMPUTE, e->accum, e->lay.accum_numel * sg__dtype_size(e->cfg.accum_dtype));
  if (st != SG_OK) return st;
  v.step = e->step;
  scale_update(e, overflow);
  if (skip) SG_LOG(SG_LOG_INFO, e->rank, "step skipped: non-finite gradients");
  fill_info(e, info, &v);
  return SG_OK;
}
