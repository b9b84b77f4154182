/* Micro-batches: gradient slots, readiness, bucket launches in plan order, the reduction jobs
 * that run on the comm queue, and local accumulation for sg_set_sync(e, 0). */
#include <stdlib.h>
#include <string.h>

#include "sg_engine_internal.h"

typedef struct {
  sg_engine *e;
  int bucket;
  int first;  /* the bucket's first reduction since the accumulator was emptied */
  char *slot; /* the bucket's gradients, grad dtype, bucket numel elements */
  size_t idle; /* bytes of the slot to give back once zeroed (slot_idle); 0: keep it */
  int64_t trace; /* trace record, -1 none */
} sg__reduce_job;

static size_t gsize(const sg_engine *e) { return sg__dtype_size(e->cfg.grad_dtype); }

/* 64-bit words of one rank's presence bits. */
static size_t nwords(const sg_engine *e) { return ((size_t)e->reg.nparams + 63) / 64; }

sg_status sg__grads_init(sg_engine *e) {
  sg__grads *g = &e->g;
  const int nb = e->plan->nbuckets;
  g->slots = (char *)e->ar.base[SG_MEM_GRADS] + e->lay.slots_off;
  g->accum = e->strat->place->array(e, SG__STATE_ACCUM);
  g->ready = calloc((size_t)e->reg.nparams, 1);
  g->pending = calloc((size_t)nb, sizeof *g->pending);
  g->nosync_dirty = calloc((size_t)nb, 1);
  g->empty = malloc((size_t)nb);
  g->present = calloc((size_t)e->reg.nparams, 1);
  g->agreed = calloc((size_t)e->reg.nparams, 1);
  g->bits = calloc(nwords(e) * (size_t)e->world, sizeof *g->bits);
  g->small_flag = -1;
  g->sync = 1;
  g->user_scale = 1.0;
  if (!g->ready || !g->pending || !g->nosync_dirty || !g->empty || !g->present || !g->agreed ||
      !g->bits) {
    sg__grads_free(e);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  }
  memset(g->empty, 1, (size_t)nb);
  sg_status hs = e->dev->ops->host_alloc(e->dev, 4 * sizeof(double), (void **)&g->norm_host);
  if (hs != SG_OK) {
    g->norm_host = NULL;
    sg__grads_free(e);
    return hs;
  }
  sg_status st = e->strat->slots->init(e, &g->slot_state);
  if (st != SG_OK) sg__grads_free(e);
  return st;
}

void sg__grads_free(sg_engine *e) {
  sg__grads *g = &e->g;
  e->strat->slots->free(e, g->slot_state);
  g->slot_state = NULL;
  if (g->nosync) sg__arenas_extra_free(&e->ar, g->nosync, e->plan->total_numel * 4);
  g->nosync = NULL;
  if (g->norm_host) e->dev->ops->host_free(e->dev, g->norm_host);
  g->norm_host = NULL;
  free(g->ready);
  free(g->pending);
  free(g->nosync_dirty);
  free(g->empty);
  free(g->present);
  free(g->agreed);
  free(g->bits);
  g->present = g->agreed = NULL;
  g->bits = NULL;
  g->empty = NULL;
  g->ready = NULL;
  g->pending = NULL;
  g->nosync_dirty = NULL;
}

void sg__grads_reset_microbatch(sg_engine *e) {
  memset(e->g.ready, 0, (size_t)e->reg.nparams);
  for (int b = 0; b < e->plan->nbuckets; b++) e->g.pending[b] = e->plan->buckets[b].param_count;
  e->g.next_launch = 0;
  e->g.touched = 0;
}

void sg__grads_norm_keep(sg_engine *e, const double ss[3]) {
  e->g.norm_ss[0] = ss[0];
  e->g.norm_ss[1] = ss[1];
  e->g.norm_ss[2] = ss[2];
  e->g.norm_valid = 1;
}

void sg__grads_norm_drop(sg_engine *e) { e->g.norm_valid = 0; }

void sg__grads_scale_by(sg_engine *e, double factor) { e->g.user_scale *= factor; }

sg_status sg__grads_clear_accum(sg_engine *e) {
  e->g.norm_valid = 0;
  e->g.user_scale = 1.0;
  memset(e->g.empty, 1, (size_t)e->plan->nbuckets);
  memset(e->g.present, 0, (size_t)e->reg.nparams);
  sg__replicas_reset(e);
  return e->strat->place->clear(e);
}

/* On the comm queue: the partials summed over the ranks in place, then copied to pinned host
 * memory, so that the comm_wait for this job is the only host wait. */
static sg_status norm_job_fn(void *arg) {
  sg_engine *e = arg;
  double *dev = (double *)e->small;
  SG_TRY(e->strat->shard->sum_norm(e, dev));
  return e->dev->ops->copy(e->dev, SG_Q_COMM, e->g.norm_host, dev, 3 * sizeof(double),
                           SG_COPY_D2H);
}

/* A replicated state has no norm all-reduce: the absent count alone, summed (NO_SHARD). */
static sg_status absent_job_fn(void *arg) {
  sg_engine *e = arg;
  double *dev = (double *)e->small + 2;
  SG_TRY(e->comm->ops->all_reduce(e->comm, dev, 1, SG__F64, sg__deadline(e->cfg.timeout_ms)));
  return e->dev->ops->copy(e->dev, SG_Q_COMM, e->g.norm_host + 2, dev, sizeof(double),
                           SG_COPY_D2H);
}

/* Presence is tracked where every rank that sums the gradient takes part in the agreement: not
 * across the replicas of a hybrid engine, which update every parameter as before. */
static int tracked(const sg_engine *e) { return sg__replicas_world(e) == e->world; }

int sg__grads_locally_absent(const sg_engine *e) {
  return tracked(e) && memchr(e->g.present, 0, (size_t)e->reg.nparams) != NULL;
}

/* This rank's absent flag into the small piece's third double, where the norm's all-reduce
 * sums it with the partials; copied only when the piece holds another value (after a step in
 * which no rank missed a parameter it holds 0 already: no copy in the common case). */
static sg_status put_absent(sg_engine *e) {
  const double f = sg__grads_locally_absent(e) ? 1.0 : 0.0;
  if (e->g.small_flag == f) return SG_OK;
  e->g.norm_host[3] = f;
  SG_TRY(e->dev->ops->copy(e->dev, SG_Q_COMPUTE, (double *)e->small + 2, e->g.norm_host + 3,
                           sizeof(double), SG_COPY_H2D));
  e->g.small_flag = f;
  return SG_OK;
}

/* The caller made the compute queue wait for every reduction. Across ranks the partials go
 * into device memory (e->small) and never through the host before they are final. out[2]: the
 * ranks that missed some parameter's gradient. */
sg_status sg__grads_sumsq(sg_engine *e, double out[3]) {
  const sg__state_ops *so = e->strat->place;
  if (e->world == 1 || (!e->strat->shard->sharded && !tracked(e))) {
    out[2] = sg__grads_locally_absent(e);
    return so->sumsq(e, out);
  }
  SG_TRY(put_absent(e));
  if (!e->strat->shard->sharded) {
    SG_TRY(so->sumsq(e, out));
    SG_TRY(sg__engine_run_comm(e, absent_job_fn, e));
  } else {
    SG_TRY(so->partials(e, (double *)e->small));
    SG_TRY(sg__engine_run_comm(e, norm_job_fn, e));
    out[0] = e->g.norm_host[0];
    out[1] = e->g.norm_host[1];
  }
  out[2] = e->g.small_flag = e->g.norm_host[2]; /* summed in place */
  return SG_OK;
}

/* Some rank missed a parameter: every rank's bits, gathered, ORed. */
static sg_status exchange_presence(sg_engine *e) {
  const size_t nw = nwords(e), np = (size_t)e->reg.nparams;
  uint64_t *mine = e->g.bits + (size_t)e->rank * nw;
  memset(mine, 0, nw * sizeof *mine);
  for (size_t i = 0; i < np; i++)
    if (e->g.present[i]) mine[i / 64] |= (uint64_t)1 << (i % 64);
  SG_TRY(sg__engine_broken(e, sg__engine_allgather_host(e, e->g.bits, nw * sizeof *mine)));
  memset(e->g.agreed, 0, np);
  for (int r = 0; r < e->world; r++)
    for (size_t i = 0; i < np; i++)
      e->g.agreed[i] |= (uint8_t)((e->g.bits[(size_t)r * nw + i / 64] >> (i % 64)) & 1);
  return SG_OK;
}

sg_status sg__grads_presence(sg_engine *e, const double ss[3], const uint8_t **present,
                             int *count) {
  *present = NULL;
  *count = e->reg.nparams;
  /* A rank that missed none gave every parameter a gradient: all are present. Only when every
   * rank missed some (ss[2] counts them) can a parameter lack one everywhere. Ranks that missed
   * none may have taken sg_step's device path, which never reads the count and would not join
   * an exchange: this rule keeps them out of it. */
  if (!(ss[2] >= (double)e->world)) return SG_OK;
  if (e->world == 1)
    memcpy(e->g.agreed, e->g.present, (size_t)e->reg.nparams);
  else
    SG_TRY(exchange_presence(e));
  int n = 0;
  for (int i = 0; i < e->reg.nparams; i++) n += e->g.agreed[i];
  *present = e->g.agreed;
  *count = n;
  return SG_OK;
}

/* On the comm queue: the partials summed over the ranks in place (device memory). */
static sg_status norm_sum_job_fn(void *arg) {
  sg_engine *e = arg;
  return e->strat->shard->sum_norm(e, (double *)e->small);
}

/* As sg__grads_sumsq, into device memory (e->small) with the compute queue ordered after the
 * sum over the ranks (a stream wait, not a host wait): the step's outcome is decided there. */
sg_status sg__grads_sumsq_dev(sg_engine *e) {
  SG_TRY(e->strat->place->partials(e, (double *)e->small));
  if (e->world == 1 || (!e->strat->shard->sharded && !tracked(e))) return SG_OK;
  /* the absent flag (0 here: this path is for ranks that missed none) in the collective that
   * sg__grads_sumsq's ranks run too */
  SG_TRY(put_absent(e));
  uint64_t t = 0;
  SG_TRY(sg__engine_broken(e, sg__engine_submit(e, e->strat->shard->sharded ? norm_sum_job_fn
                                                                            : absent_job_fn,
                                                NULL, e, &t)));
  return sg__engine_broken(e, e->dev->ops->compute_wait_comm(e->dev, t,
                                                             sg__engine_host_deadline(e)));
}

sg_status sg__grads_clear(sg_engine *e) {
  SG_TRY(sg__grads_clear_accum(e));
  if (e->g.nosync)
    SG_TRY(sg__device_zero_release(e->dev, SG_Q_COMPUTE, e->g.nosync, e->plan->total_numel * 4));
  memset(e->g.nosync_dirty, 0, (size_t)e->plan->nbuckets);
  return SG_OK;
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

/* What of bucket b's slot, about to be released, gives its pages back once zeroed: nothing
 * when a later bucket of this micro-batch is handed it (the strategy's slot_idle_bytes), since
 * its pages would be faulted in again at once. Otherwise its next use is behind a forward
 * pass, whose activations can then have the pages (DESIGN.md section 3). */
static size_t slot_idle(sg_engine *e, int b) {
  return e->strat->slots->idle_bytes(e, e->g.slot_state, b);
}

/* Bucket b's slot zeroed on queue q for its next holder. A device that cannot give pages back
 * zeroes the bucket's part only: the rest of an idle slot is zero already. */
static sg_status zero_slot(sg_engine *e, sg__queue q, char *slot, int b, size_t idle) {
  sg__device *d = e->dev;
  if (idle && d->ops->zero_release) return d->ops->zero_release(d, q, slot, idle);
  return d->ops->zero(d, q, slot, e->plan->buckets[b].numel * gsize(e));
}

/* The bucket summed over the ranks into the accumulator (the strategy's reduce), from the wire
 * buffer in reduce_dtype. */
static sg_status reduce_bucket(const sg__reduce_job *jp) {
  const sg__reduce_job j = *jp;
  sg_engine *e = j.e;
  char *wire = NULL;
  SG_TRY(wire_of(e, &j, e->plan->buckets[j.bucket].numel, &wire));
  SG_TRY(e->strat->reduce(e, j.bucket, wire, j.first));
  return zero_slot(e, SG_Q_COMM, j.slot, j.bucket, j.idle);
}

static sg_status reduce_job_fn(void *arg) {
  sg__reduce_job j = *(sg__reduce_job *)arg; /* the queue frees arg (comm_submit's drop) */
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = reduce_bucket(&j);
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* slots (the strategy's)                                                                    */

static sg_status bucket_slot(sg_engine *e, int b, char **base, const char *fn) {
  return e->strat->slots->slot(e, e->g.slot_state, b, base, fn);
}

static sg_status param_slot(sg_engine *e, int id, char **ptr, const char *fn) {
  const sg__plan_param *pp = &e->plan->params[id];
  if (!e->g.touched) SG_TRY(sg__replicas_open(e, fn));
  char *base = NULL;
  SG_TRY(bucket_slot(e, pp->bucket, &base, fn));
  *ptr = base + (pp->offset - e->plan->buckets[pp->bucket].start) * gsize(e);
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* launching                                                                                 */

static void release_slot(sg_engine *e, int b, uint64_t ticket) {
  e->strat->slots->release(e, e->g.slot_state, b, ticket);
}

/* sync off: the bucket's gradients go into the local fp32 buffer; no communication. */
static sg_status fold_local(sg_engine *e, int b, char *slot) {
  const sg__bucket *bk = &e->plan->buckets[b];
  sg__device *d = e->dev;
  SG_TRY(d->ops->accumulate(d, SG_Q_COMPUTE, e->g.nosync + bk->start, SG_F32, slot,
                            e->cfg.grad_dtype, bk->numel));
  SG_TRY(zero_slot(e, SG_Q_COMPUTE, slot, b, slot_idle(e, b)));
  e->g.nosync_dirty[b] = 1;
  release_slot(e, b, 0);
  return SG_OK;
}

/* sync on after local accumulation: the slot gets the local sum plus this micro-batch. */
static sg_status unfold_local(sg_engine *e, int b, char *slot) {
  const sg__bucket *bk = &e->plan->buckets[b];
  sg__device *d = e->dev;
  float *acc = e->g.nosync + bk->start;
  SG_TRY(d->ops->accumulate(d, SG_Q_COMPUTE, acc, SG_F32, slot, e->cfg.grad_dtype, bk->numel));
  SG_TRY(d->ops->cast(d, SG_Q_COMPUTE, slot, e->cfg.grad_dtype, acc, SG_F32, bk->numel));
  SG_TRY(sg__device_zero_release(d, SG_Q_COMPUTE, acc, bk->numel * 4));
  e->g.nosync_dirty[b] = 0;
  return SG_OK;
}

static sg_status submit_reduce(sg_engine *e, int b, char *slot) {
  sg__reduce_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  *j = (sg__reduce_job){e, b, e->g.empty[b], slot, slot_idle(e, b),
                        sg__trace_new(e, SG_TRACE_REDUCE, b, NULL)};
  const sg__state_ops *so = e->strat->place;
  sg_status st = so->prepare(e, b);
  if (st != SG_OK) {
    free(j);
    return sg__engine_broken(e, st);
  }
  uint64_t t = 0;
  st = sg__engine_submit(e, reduce_job_fn, free, j, &t);
  so->submitted(e, b, t);
  if (st != SG_OK) return sg__engine_broken(e, st);
  e->g.empty[b] = 0;
  release_slot(e, b, t);
  return sg__replicas_after_reduce(e, b);
}

static sg_status launch(sg_engine *e, int b, int sync) {
  char *slot = NULL;
  SG_TRY(bucket_slot(e, b, &slot, "sg_grad_ready"));
  if (!sync) return fold_local(e, b, slot);
  if (e->g.nosync_dirty[b]) SG_TRY(unfold_local(e, b, slot));
  return submit_reduce(e, b, slot);
}

/* Launches buckets in plan order while they are complete: collectives then match on every rank
 * whatever order each rank's backward produced them in. */
static sg_status launch_ready(sg_engine *e) {
  const int nb = e->plan->nbuckets;
  while (e->g.next_launch < nb && e->g.pending[e->g.next_launch] == 0) {
    SG_TRY(launch(e, e->g.next_launch, e->g.sync));
    e->g.next_launch++;
  }
  if (e->g.next_launch == nb) sg__grads_reset_microbatch(e);
  return SG_OK;
}

/* The first gradient of a micro-batch begins it. */
static void touch(sg_engine *e) {
  if (!e->g.touched) sg__replicas_count_microbatch(e);
  e->g.touched = 1;
}

static sg_status mark_ready(sg_engine *e, int id) {
  sg__trace_instant(e, SG_TRACE_GRAD_READY, id, NULL);
  e->g.ready[id] = 1;
  touch(e);
  e->g.norm_valid = 0; /* a sg_grad_norm before this gradient is stale */
  e->g.pending[e->plan->params[id].bucket]--;
  return launch_ready(e);
}

/* ---------------------------------------------------------------------------------------- */
/* public                                                                                    */

static sg_status check_not_ready(sg_engine *e, int id, const char *fn) {
  if (e->g.ready[id])
    return sg__err(SG_ERR_INVALID_STATE, "%s: gradient of '%s' (id %d) is already marked ready "
                   "in this micro-batch", fn, e->reg.names[id], id);
  return SG_OK;
}

sg_status sg_grad_ptr(sg_engine *e, int id, void **ptr) {
  SG_ENGINE_GUARD(e, "sg_grad_ptr");
  static const char *fn = "sg_grad_ptr";
  SG_TRY(sg__engine_check_param(e, id, ptr, "ptr", fn));
  SG_TRY(check_not_ready(e, id, fn));
  char *p = NULL;
  SG_TRY(param_slot(e, id, &p, fn));
  touch(e);
  e->g.norm_valid = 0; /* a sg_grad_norm before this gradient is stale */
  e->g.present[id] = 1;
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
  e->g.present[id] = 1; /* a gradient of zeros, named: the parameter is updated */
  return mark_ready(e, id);
}

sg_status sg_grad_add(sg_engine *e, int id, const void *src, sg_dtype src_dtype) {
  SG_ENGINE_GUARD(e, "sg_grad_add");
  static const char *fn = "sg_grad_add";
  SG_TRY(sg__engine_check_param(e, id, src, "src", fn));
  SG_TRY(sg__engine_check_dtype(src_dtype, "src_dtype", fn));
  SG_TRY(check_not_ready(e, id, fn));
  char *p = NULL;
  SG_TRY(param_slot(e, id, &p, fn));
  SG_TRY(e->dev->ops->accumulate(e->dev, SG_Q_COMPUTE, p, e->cfg.grad_dtype, src, src_dtype,
                                 e->reg.numels[id]));
  e->g.present[id] = 1;
  return mark_ready(e, id);
}

/* Completes the micro-batch: parameters without a gradient count as zeros. Buckets are taken
 * in plan order so that each one can get a staging buffer freed by the one before. */
static sg_status complete_microbatch(sg_engine *e, const char *fn) {
  const sg__plan *p = e->plan;
  while (e->g.touched) {
    const int b = e->g.next_launch;
    const sg__bucket *bk = &p->buckets[b];
    char *slot = NULL;
    SG_TRY(bucket_slot(e, b, &slot, fn));
    for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
      const int id = p->order[k];
      if (!e->g.ready[id]) {
        e->g.ready[id] = 1;
        e->g.pending[b]--;
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
  void *p = NULL;
  SG_TRY(sg__arenas_extra_alloc(&e->ar, e->plan->total_numel * 4, &p));
  e->g.nosync = p;
  return SG_OK;
}

/* SG_ERR_INVALID_STATE while a micro-batch is open: for calls that change how the next one runs
 * (sg_set_sync, sg_set_microbatches). */
static sg_status between(const sg_engine *e, const char *fn) {
  if (e->g.touched)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a micro-batch is in progress; call it between "
                   "micro-batches (after sg_backward_end)", fn);
  return SG_OK;
}

sg_status sg_set_sync(sg_engine *e, int enabled) {
  SG_ENGINE_GUARD(e, "sg_set_sync");
  static const char *fn = "sg_set_sync";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (enabled != 0 && enabled != 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: enabled must be 0 or 1 (got %d)", fn, enabled);
  SG_TRY(between(e, fn));
  if (!enabled && !e->g.nosync) {
    sg_status st = alloc_nosync(e);
    if (st != SG_OK) return sg__err_prefix(st, fn);
  }
  e->g.sync = enabled;
  return SG_OK;
}

sg_status sg__grads_flush(sg_engine *e, const char *fn) {
  SG_TRY(complete_microbatch(e, fn));
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (!e->g.nosync_dirty[b]) continue;
    char *slot = NULL;
    SG_TRY(bucket_slot(e, b, &slot, fn));
    SG_TRY(unfold_local(e, b, slot));
    SG_TRY(submit_reduce(e, b, slot));
  }
  return SG_OK;
}

sg_status sg__grads_idle(sg_engine *e, const char *fn) {
  if (e->g.touched)
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
  sg_status st = sg__grads_clear(e);
  if (st != SG_OK) return sg__engine_broken(e, sg__err_prefix(st, fn));
  return SG_OK;
}

sg_status sg_set_microbatches(sg_engine *e, int n) {
  SG_ENGINE_GUARD(e, "sg_set_microbatches");
  static const char *fn = "sg_set_microbatches";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (n < 0 || n > (1 << 20))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: n must be in 0..%d (got %d)", fn, 1 << 20, n);
  SG_TRY(between(e, fn));
  sg__replicas_set_microbatches(e, n);
  return SG_OK;
}
