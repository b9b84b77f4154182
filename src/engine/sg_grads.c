/* Micro-batches: gradient slots, readiness, bucket launches in plan order, the reduction jobs
 * that run on the comm queue, and local accumulation for sg_set_sync(e, 0). */
#include <stdlib.h>
#include <string.h>

#include "sg_engine_internal.h"

typedef struct {
  sg_engine *e;
  int bucket;
  char *slot; /* the bucket's gradients, grad dtype, bucket numel elements */
  int64_t trace; /* trace record, -1 none */
} sg__reduce_job;

static size_t gsize(const sg_engine *e) { return sg__dtype_size(e->cfg.grad_dtype); }
static size_t asize(const sg_engine *e) { return sg__dtype_size(e->cfg.accum_dtype); }

sg_status sg__grads_init(sg_engine *e) {
  const int nb = e->plan->nbuckets, ns = e->lay.nstaging;
  e->ready = calloc((size_t)e->nparams, 1);
  e->pending = calloc((size_t)nb, sizeof *e->pending);
  e->bucket_staging = calloc((size_t)nb, sizeof *e->bucket_staging);
  e->bucket_ticket = calloc((size_t)nb, sizeof *e->bucket_ticket);
  e->nosync_dirty = calloc((size_t)nb, 1);
  e->staging_owner = calloc((size_t)(ns ? ns : 1), sizeof *e->staging_owner);
  e->staging_ticket = calloc((size_t)(ns ? ns : 1), sizeof *e->staging_ticket);
  e->staging_ptr = calloc((size_t)(ns ? ns : 1), sizeof *e->staging_ptr);
  if (!e->ready || !e->pending || !e->bucket_staging || !e->bucket_ticket || !e->nosync_dirty ||
      !e->staging_owner || !e->staging_ticket || !e->staging_ptr) {
    sg__grads_free(e);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  }
  e->nstaging = ns;
  for (int k = 0; k < ns; k++) {
    e->staging_owner[k] = -1;
    e->staging_ptr[k] = e->slots + (size_t)k * e->staging_stride;
  }
  for (int b = 0; b < nb; b++) e->bucket_staging[b] = -1;
  return SG_OK;
}

void sg__grads_free(sg_engine *e) {
  if (e->dev) {
    for (int k = e->lay.nstaging; k < e->nstaging; k++) e->dev->ops->free(e->dev, e->staging_ptr[k]);
    if (e->nosync) e->dev->ops->free(e->dev, e->nosync);
  }
  e->nosync = NULL;
  free(e->ready);
  free(e->pending);
  free(e->bucket_staging);
  free(e->bucket_ticket);
  free(e->nosync_dirty);
  free(e->staging_owner);
  free(e->staging_ticket);
  free(e->staging_ptr);
  e->ready = NULL;
  e->pending = NULL;
  e->bucket_staging = NULL;
  e->bucket_ticket = NULL;
  e->nosync_dirty = NULL;
  e->staging_owner = NULL;
  e->staging_ticket = NULL;
  e->staging_ptr = NULL;
  e->nstaging = 0;
  e->ar.extra_grads = 0;
}

void sg__grads_reset_microbatch(sg_engine *e) {
  memset(e->ready, 0, (size_t)e->nparams);
  for (int b = 0; b < e->plan->nbuckets; b++) e->pending[b] = e->plan->buckets[b].param_count;
  e->next_launch = 0;
  e->touched = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* the reduction job (comm queue)                                                            */

/* The bucket on the wire: the slot itself, or with a reduce_dtype other than grad_dtype, the
 * slot cast into the comm arena's reduce buffer. One buffer serves every bucket because
 * reduction jobs never overlap: the CPU device runs comm jobs one at a time on its worker, and
 * CUDA issues them in submit order on its one comm stream, so a job's cast is ordered after the
 * previous job's collective and accumulate have read the buffer. */
static sg_status wire_of(sg_engine *e, const sg__reduce_job *j, size_t numel, char **wire) {
  const int gdt = e->cfg.grad_dtype, rdt = e->cfg.reduce_dtype;
  *wire = j->slot;
  if (rdt == gdt) return SG_OK;
  *wire = (char *)e->ar.base[SG_MEM_COMM] + e->lay.reduce_off;
  return e->dev->ops->cast(e->dev, SG_Q_COMM, *wire, rdt, j->slot, gdt, numel);
}

/* Sums the bucket over ranks in reduce_dtype (all-reduce, or reduce-scatter of this rank's
 * slice) and adds the result into the accumulator, from the wire buffer in reduce_dtype. */
static sg_status reduce_bucket(const sg__reduce_job *jp) {
  const sg__reduce_job j = *jp;
  sg_engine *e = j.e;
  sg_comm *c = e->comm;
  sg__device *d = e->dev;
  const sg__bucket *b = &e->plan->buckets[j.bucket];
  const int rdt = e->cfg.reduce_dtype, adt = e->cfg.accum_dtype;
  const size_t rsize = sg__dtype_size(rdt);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  char *wire = NULL;
  SG_TRY(wire_of(e, &j, b->numel, &wire));
  if (e->cfg.strategy == SG_NO_SHARD) {
    SG_TRY(c->ops->all_reduce(c, wire, b->numel, rdt, dl));
    SG_TRY(d->ops->accumulate(d, SG_Q_COMM, e->accum + b->start * asize(e), adt, wire, rdt,
                              b->numel));
  } else {
    const size_t slice = sg__plan_slice_numel(e->plan, j.bucket);
    SG_TRY(c->ops->reduce_scatter(c, wire, slice, rdt, dl));
    SG_TRY(d->ops->accumulate(d, SG_Q_COMM, e->accum + b->shard_offset * asize(e), adt,
                              wire + (size_t)e->rank * slice * rsize, rdt, slice));
  }
  /* The slot is handed out again for the next micro-batch and must read as zeros. */
  return d->ops->zero(d, SG_Q_COMM, j.slot, b->numel * gsize(e));
}

static sg_status reduce_job_fn(void *arg) {
  sg__reduce_job j = *(sg__reduce_job *)arg;
  free(arg);
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = reduce_bucket(&j);
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* slots                                                                                     */

/* An extra staging buffer, for gradients that arrive so far out of order that every staging
 * buffer is held by a bucket that cannot be reduced yet: memory instead of a deadlock. */
static sg_status add_staging(sg_engine *e, int *k_out) {
  const size_t bytes = e->staging_stride;
  int n = e->nstaging + 1;
  int *own = realloc(e->staging_owner, (size_t)n * sizeof *own);
  if (own) e->staging_owner = own;
  uint64_t *tk = realloc(e->staging_ticket, (size_t)n * sizeof *tk);
  if (tk) e->staging_ticket = tk;
  char **pp = realloc(e->staging_ptr, (size_t)n * sizeof *pp);
  if (pp) e->staging_ptr = pp;
  if (!own || !tk || !pp) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  void *buf = NULL;
  SG_TRY(e->dev->ops->alloc(e->dev, bytes, &buf));
  sg_status st = e->dev->ops->zero(e->dev, SG_Q_COMPUTE, buf, bytes);
  if (st != SG_OK) {
    e->dev->ops->free(e->dev, buf);
    return st;
  }
  e->staging_ptr[e->nstaging] = buf;
  e->staging_owner[e->nstaging] = -1;
  e->staging_ticket[e->nstaging] = 0;
  *k_out = e->nstaging++;
  e->ar.extra_grads += bytes;
  sg__arenas_note(&e->ar);
  SG_LOG(SG_LOG_WARN, e->rank, "all %d staging buckets are held by buckets that cannot be "
         "reduced yet (bucket %d, earlier in backward order, is incomplete): allocated one more "
         "(%zu bytes). Produce gradients in reverse registration order or raise staging_buckets.",
         e->nstaging - 1, e->next_launch, bytes);
  return SG_OK;
}

static sg_status acquire_staging(sg_engine *e, int b, const char *fn) {
  int best = -1;
  for (int k = 0; k < e->nstaging; k++)
    if (e->staging_owner[k] < 0 && (best < 0 || e->staging_ticket[k] < e->staging_ticket[best]))
      best = k;
  if (best < 0) {
    sg_status st = add_staging(e, &best);
    if (st != SG_OK) return sg__err_prefix(st, fn);
  }
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, e->staging_ticket[best],
                                                sg__deadline(e->cfg.timeout_ms));
  if (st != SG_OK) return sg__engine_broken(e, st);
  e->staging_owner[best] = b;
  e->bucket_staging[b] = best;
  return SG_OK;
}

/* Start of bucket b's gradient slot (element bucket.start), ready for writing. */
static sg_status bucket_slot(sg_engine *e, int b, char **base, const char *fn) {
  if (e->cfg.strategy == SG_SHARD_GRAD_OP) {
    if (e->bucket_staging[b] < 0) SG_TRY(acquire_staging(e, b, fn));
    *base = e->staging_ptr[e->bucket_staging[b]];
    return SG_OK;
  }
  /* The bucket's previous reduction must have zeroed the region before it is written again. */
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, e->bucket_ticket[b],
                                                sg__deadline(e->cfg.timeout_ms));
  if (st != SG_OK) return sg__engine_broken(e, st);
  *base = e->slots + e->plan->buckets[b].start * gsize(e);
  return SG_OK;
}

static sg_status param_slot(sg_engine *e, int id, char **ptr, const char *fn) {
  const sg__plan_param *pp = &e->plan->params[id];
  char *base = NULL;
  SG_TRY(bucket_slot(e, pp->bucket, &base, fn));
  *ptr = base + (pp->offset - e->plan->buckets[pp->bucket].start) * gsize(e);
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* launching                                                                                 */

static void release_slot(sg_engine *e, int b, uint64_t ticket) {
  e->bucket_ticket[b] = ticket;
  int k = e->bucket_staging[b];
  if (k >= 0) {
    e->staging_owner[k] = -1;
    e->staging_ticket[k] = ticket;
    e->bucket_staging[b] = -1;
  }
}

/* sync off: the bucket's gradients go into the local fp32 buffer; no communication. */
static sg_status fold_local(sg_engine *e, int b, char *slot) {
  const sg__bucket *bk = &e->plan->buckets[b];
  sg__device *d = e->dev;
  SG_TRY(d->ops->accumulate(d, SG_Q_COMPUTE, e->nosync + bk->start, SG_F32, slot,
                            e->cfg.grad_dtype, bk->numel));
  SG_TRY(d->ops->zero(d, SG_Q_COMPUTE, slot, bk->numel * gsize(e)));
  e->nosync_dirty[b] = 1;
  release_slot(e, b, e->bucket_ticket[b]);
  return SG_OK;
}

/* sync on after local accumulation: the slot gets the local sum plus this micro-batch. */
static sg_status unfold_local(sg_engine *e, int b, char *slot) {
  const sg__bucket *bk = &e->plan->buckets[b];
  sg__device *d = e->dev;
  float *acc = e->nosync + bk->start;
  SG_TRY(d->ops->accumulate(d, SG_Q_COMPUTE, acc, SG_F32, slot, e->cfg.grad_dtype, bk->numel));
  SG_TRY(d->ops->cast(d, SG_Q_COMPUTE, slot, e->cfg.grad_dtype, acc, SG_F32, bk->numel));
  SG_TRY(d->ops->zero(d, SG_Q_COMPUTE, acc, bk->numel * 4));
  e->nosync_dirty[b] = 0;
  return SG_OK;
}

static sg_status submit_reduce(sg_engine *e, int b, char *slot) {
  sg__reduce_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  *j = (sg__reduce_job){e, b, slot, sg__trace_new(e, SG_TRACE_REDUCE, b, NULL)};
  uint64_t t = 0;
  sg_status st = e->dev->ops->comm_submit(e->dev, reduce_job_fn, j, &t);
  if (st != SG_OK) {
    if (t == 0) free(j); /* not queued: still ours */
    return sg__engine_broken(e, st);
  }
  if (t > e->last_ticket) e->last_ticket = t;
  release_slot(e, b, t);
  return SG_OK;
}

static sg_status launch(sg_engine *e, int b, int sync) {
  char *slot = NULL;
  SG_TRY(bucket_slot(e, b, &slot, "sg_grad_ready"));
  if (!sync) return fold_local(e, b, slot);
  if (e->nosync_dirty[b]) SG_TRY(unfold_local(e, b, slot));
  return submit_reduce(e, b, slot);
}

/* Launches buckets in plan order while they are complete: collectives then match on every rank
 * whatever order each rank's backward produced them in. */
static sg_status launch_ready(sg_engine *e) {
  const int nb = e->plan->nbuckets;
  while (e->next_launch < nb && e->pending[e->next_launch] == 0) {
    SG_TRY(launch(e, e->next_launch, e->sync));
    e->next_launch++;
  }
  if (e->next_launch == nb) sg__grads_reset_microbatch(e);
  return SG_OK;
}

static sg_status mark_ready(sg_engine *e, int id) {
  sg__trace_instant(e, SG_TRACE_GRAD_READY, id, NULL);
  e->ready[id] = 1;
  e->touched = 1;
  e->pending[e->plan->params[id].bucket]--;
  return launch_ready(e);
}

/* ---------------------------------------------------------------------------------------- */
/* public                                                                                    */

static sg_status check_not_ready(sg_engine *e, int id, const char *fn) {
  if (e->ready[id])
    return sg__err(SG_ERR_INVALID_STATE, "%s: gradient of '%s' (id %d) is already marked ready "
                   "in this micro-batch", fn, e->names[id], id);
  return SG_OK;
}

sg_status sg_grad_ptr(sg_engine *e, int id, void **ptr) {
  SG_ENGINE_GUARD(e, "sg_grad_ptr");
  static const char *fn = "sg_grad_ptr";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(sg__engine_check_id(e, id, fn));
  if (!ptr) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: ptr is NULL", fn);
  SG_TRY(check_not_ready(e, id, fn));
  char *p = NULL;
  SG_TRY(param_slot(e, id, &p, fn));
  e->touched = 1;
  *ptr = p;
  return SG_OK;
}

sg_status sg_grad_ready(sg_engine *e, int id) {
  SG_ENGINE_GUARD(e, "sg_grad_ready");
  static const char *fn = "sg_grad_ready";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(sg__engine_check_id(e, id, fn));
  SG_TRY(check_not_ready(e, id, fn));
  char *p = NULL;
  SG_TRY(param_slot(e, id, &p, fn)); /* a parameter never written counts as zeros */
  return mark_ready(e, id);
}

sg_status sg_grad_add(sg_engine *e, int id, const void *src, sg_dtype src_dtype) {
  SG_ENGINE_GUARD(e, "sg_grad_add");
  static const char *fn = "sg_grad_add";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(sg__engine_check_id(e, id, fn));
  if (!src) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: src is NULL", fn);
  if (!sg__dtype_valid(src_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: src_dtype %d is not a valid sg_dtype", fn,
                   (int)src_dtype);
  SG_TRY(check_not_ready(e, id, fn));
  char *p = NULL;
  SG_TRY(param_slot(e, id, &p, fn));
  SG_TRY(e->dev->ops->accumulate(e->dev, SG_Q_COMPUTE, p, e->cfg.grad_dtype, src, src_dtype,
                                 e->numels[id]));
  return mark_ready(e, id);
}

/* Completes the micro-batch: parameters without a gradient count as zeros. Buckets are taken
 * in plan order so that each one can get a staging buffer freed by the one before. */
static sg_status complete_microbatch(sg_engine *e, const char *fn) {
  const sg__plan *p = e->plan;
  while (e->touched) {
    const int b = e->next_launch;
    const sg__bucket *bk = &p->buckets[b];
    char *slot = NULL;
    SG_TRY(bucket_slot(e, b, &slot, fn));
    for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
      const int id = p->order[k];
      if (!e->ready[id]) {
        e->ready[id] = 1;
        e->pending[b]--;
      }
    }
    SG_TRY(launch_ready(e));
  }
  return SG_OK;
}

sg_status sg_backward_end(sg_engine *e) {
  SG_ENGINE_GUARD(e, "sg_backward_end");
  static const char *fn = "sg_backward_end";
  SG_TRY(sg__engine_check(e, fn, 1));
  return complete_microbatch(e, fn);
}

static sg_status alloc_nosync(sg_engine *e) {
  const size_t bytes = e->plan->total_numel * 4;
  void *p = NULL;
  SG_TRY(e->dev->ops->alloc(e->dev, bytes, &p));
  sg_status st = e->dev->ops->zero(e->dev, SG_Q_COMPUTE, p, bytes);
  if (st != SG_OK) {
    e->dev->ops->free(e->dev, p);
    return st;
  }
  e->nosync = p;
  e->ar.extra_grads += bytes;
  sg__arenas_note(&e->ar);
  return SG_OK;
}

sg_status sg_set_sync(sg_engine *e, int enabled) {
  SG_ENGINE_GUARD(e, "sg_set_sync");
  static const char *fn = "sg_set_sync";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (enabled != 0 && enabled != 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: enabled must be 0 or 1 (got %d)", fn, enabled);
  if (e->touched)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a micro-batch is in progress; call it between "
                   "micro-batches (after sg_backward_end)", fn);
  if (!enabled && !e->nosync) {
    sg_status st = alloc_nosync(e);
    if (st != SG_OK) return sg__err_prefix(st, fn);
  }
  e->sync = enabled;
  return SG_OK;
}

sg_status sg__grads_flush(sg_engine *e, const char *fn) {
  SG_TRY(complete_microbatch(e, fn));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (!e->nosync_dirty[b]) continue;
    char *slot = NULL;
    SG_TRY(bucket_slot(e, b, &slot, fn));
    SG_TRY(unfold_local(e, b, slot));
    SG_TRY(submit_reduce(e, b, slot));
  }
  return SG_OK;
}

sg_status sg__grads_idle(sg_engine *e, const char *fn) {
  if (e->touched)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a micro-batch is in progress; call sg_backward_end "
                   "or sg_step first", fn);
  SG_TRY(sg__err_prefix(sg__step_settle(e), fn));
  sg_status st = e->dev->ops->comm_wait(e->dev, e->last_ticket, sg__deadline(e->cfg.timeout_ms));
  return sg__engine_broken(e, st);
}

/* The reductions of the micro-batch in progress still run (the other ranks take part in them),
 * then their sums are thrown away with everything accumulated before. The reduction jobs zero
 * the slots they read, and fold_local zeroes its slot, so once the comm queue is drained every
 * gradient buffer but the accumulators is zero already. */
sg_status sg_grad_zero(sg_engine *e) {
  SG_ENGINE_GUARD(e, "sg_grad_zero");
  static const char *fn = "sg_grad_zero";
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(complete_microbatch(e, fn));
  SG_TRY(sg__engine_broken(e, e->dev->ops->comm_wait(e->dev, e->last_ticket,
                                                     sg__engine_host_deadline(e))));
  sg__device *d = e->dev;
  sg_status st = d->ops->zero(d, SG_Q_COMPUTE, e->accum, e->lay.accum_numel * asize(e));
  if (st == SG_OK && e->nosync) st = d->ops->zero(d, SG_Q_COMPUTE, e->nosync, e->plan->total_numel * 4);
  if (st != SG_OK) return sg__engine_broken(e, sg__err_prefix(st, fn));
  memset(e->nosync_dirty, 0, (size_t)e->plan->nbuckets);
  return SG_OK;
}
