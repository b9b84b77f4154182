/* The offloaded optimizer state of one shard (sg_offload.h). */
#include "sg_offload.h"

#include <stdlib.h> /* calloc, free */
#include <string.h> /* memset, strerror */

#include "../../kernels/cpu/sg_cpu_kernels.h"   /* sumsq, accumulate, cast, fold + partials */
#include "../../kernels/sg_kernel_args.h"       /* SG__SUMSQ_CHUNK: the partials' chunks */

static size_t esz(int dtype) { return sg__dtype_size((sg_dtype)dtype); }

static sg_status pinned(sg__offload *o, size_t bytes, void **out) {
  SG_TRY(o->dev->ops->host_alloc(o->dev, bytes, out));
  memset(*out, 0, bytes);
  o->host_bytes += bytes;
  return SG_OK;
}

static sg_status check_init(sg__device *d, size_t numel, int param_dtype, int accum_dtype,
                            int nbuckets, const size_t *off, const size_t *len) {
  static const char fn[] = "sg__offload_init";
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  if (!sg__dtype_valid(param_dtype) || (accum_dtype != SG_F32 && accum_dtype != SG_BF16))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype (param %d, accum %d)", fn, param_dtype,
                   accum_dtype);
  if (numel == 0 || numel > SIZE_MAX / 8 || nbuckets < 1 || !off || !len)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad shard (numel %zu, %d buckets)", fn, numel,
                   nbuckets);
  for (int k = 0; k < nbuckets; k++)
    if (off[k] > numel || len[k] > numel - off[k])
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bucket %d's slice [%zu, +%zu) is outside the "
                     "shard of %zu", fn, k, off[k], len[k], numel);
  return SG_OK;
}

static sg_status alloc_landing(sg__offload *o, int nland, size_t land_bytes) {
  o->land = calloc((size_t)nland, sizeof *o->land);
  o->land_owner = calloc((size_t)nland, sizeof *o->land_owner);
  o->lrec = calloc((size_t)nland, sizeof *o->lrec);
  if (!o->land || !o->land_owner || !o->lrec)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__offload_init: out of host memory");
  /* the fold worker: its thread starts with the first landed arrival */
  const int rc = sg__jobq_init(&o->fq, NULL, NULL, 1);
  if (rc != 0)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__offload_init: fold queue (%s)", strerror(rc));
  o->fq_ready = 1;
  o->nland = nland;
  o->land_bytes = land_bytes;
  for (int j = 0; j < nland; j++) {
    o->land_owner[j] = -1;
    SG_TRY(pinned(o, land_bytes, &o->land[j]));
  }
  return SG_OK;
}

sg_status sg__offload_init(sg__offload *o, sg__device *d, const sg__optim_desc *od, size_t numel,
                           int param_dtype, int accum_dtype, int nbuckets, const size_t *off,
                           const size_t *len, size_t chunk, int nland, size_t land_bytes) {
  if (!o) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_init: NULL state");
  memset(o, 0, sizeof *o);
  SG_TRY(check_init(d, numel, param_dtype, accum_dtype, nbuckets, off, len));
  size_t maxlen = 0;
  for (int k = 0; k < nbuckets; k++) maxlen = len[k] > maxlen ? len[k] : maxlen;
  if (nland < 1 || land_bytes < maxlen * 2)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_init: %d landing buffers of %zu bytes "
                   "(at least 1 of %zu)", nland, land_bytes, maxlen * 2);
  o->dev = d;
  o->od = od;
  o->numel = numel;
  o->param_dtype = param_dtype;
  o->accum_dtype = accum_dtype;
  o->nbuckets = nbuckets;
  o->b = calloc(nbuckets > 0 ? (size_t)nbuckets : 1, sizeof *o->b);
  if (!o->b) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__offload_init: out of host memory");
  for (int k = 0; k < nbuckets; k++) o->b[k].off = off[k], o->b[k].len = len[k], o->b[k].land = -1;
  o->gpu_order = d->kind == SG_DEVICE_CUDA;
  o->nq = (numel + SG__SUMSQ_CHUNK - 1) / SG__SUMSQ_CHUNK;
  o->part_ss = calloc(o->nq, sizeof *o->part_ss);
  o->part_nf = calloc(o->nq, sizeof *o->part_nf);
  o->part_ok = calloc(o->nq, 1);
  if (!o->part_ss || !o->part_nf || !o->part_ok) {
    sg__offload_free(o, INT64_MAX);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__offload_init: out of host memory");
  }
  void *p = NULL;
  sg_status st = pinned(o, numel * esz(accum_dtype), &o->accum);
  for (int k = 0; od && k < od->nstates && st == SG_OK; k++)
    st = pinned(o, numel * 4, &p), o->state[k] = p;
  if (st == SG_OK && param_dtype != SG_F32) st = pinned(o, numel * 4, &p), o->master = p;
  if (st == SG_OK) st = alloc_landing(o, nland, land_bytes);
  if (st == SG_OK) st = sg__host_pipe_init(&o->pipe, d, chunk, esz(param_dtype));
  if (st == SG_OK) o->host_bytes += o->pipe.host_bytes;
  if (st != SG_OK) sg__offload_free(o, INT64_MAX);
  return st;
}

/* The latest ticket of any arrival still counted as pending. */
static uint64_t last_arrival(const sg__offload *o) {
  uint64_t last = 0;
  for (int k = 0; o->b && k < o->nbuckets; k++)
    if (o->b[k].ticket > last) last = o->b[k].ticket;
  return last;
}

void sg__offload_free(sg__offload *o, int64_t deadline_ms) {
  if (!o || !o->dev) return;
  sg__device *d = o->dev;
  const uint64_t last = last_arrival(o);
  /* a copy still running after the deadline keeps its buffer (a leak, not a use after free);
   * so does the state the pipe's copies read */
  const int landed = last == 0 || d->ops->comm_wait(d, last, deadline_ms) == SG_OK;
  /* the folds still queued run first (each wait bounded by its deadline, or failing at once
   * on a recorded failure): they write the accumulator */
  if (o->fq_ready) sg__jobq_destroy(&o->fq);
  for (int j = 0; o->land && j < o->nland && landed; j++)
    if (o->land[j]) d->ops->host_free(d, o->land[j]);
  sg__host_pipe_free(&o->pipe, deadline_ms);
  if (landed) {
    if (o->accum) d->ops->host_free(d, o->accum);
    if (o->master) d->ops->host_free(d, o->master);
    for (int k = 0; k < SG__OPTIM_MAX_STATES; k++)
      if (o->state[k]) d->ops->host_free(d, o->state[k]);
  }
  free(o->b);
  free(o->part_ss);
  free(o->part_nf);
  free(o->part_ok);
  free(o->land);
  free(o->land_owner);
  free(o->lrec);
  memset(o, 0, sizeof *o);
}

/* ---- arrival ------------------------------------------------------------------------------- */

static sg_status check_bucket(const sg__offload *o, int k, const char *fn) {
  if (!o || !o->dev) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: no offloaded state", fn);
  if (k < 0 || k >= o->nbuckets)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bucket %d of %d", fn, k, o->nbuckets);
  return SG_OK;
}

/* The partials of the chunks that [lo, hi) touches no longer hold. */
static void stale(sg__offload *o, size_t lo, size_t hi) {
  const size_t C = SG__SUMSQ_CHUNK;
  if (lo < hi) memset(o->part_ok + lo / C, 0, (hi + C - 1) / C - lo / C);
}

/* accum[lo, hi) of landed arrival l from its slice src: 0 + x as the device path's zeroed
 * accumulator gives, a cast where the slice is the bucket's first since the step. */
static void fold_plain(sg__offload *o, const sg__offload_landing *l, const void *src, size_t lo,
                       size_t hi) {
  if (lo >= hi) return;
  void *acc = (char *)o->accum + lo * esz(o->accum_dtype);
  const void *s = (const char *)src + (lo - l->off) * esz(l->dtype);
  if (l->first)
    sg__cpu_cast(acc, o->accum_dtype, s, l->dtype, hi - lo);
  else
    sg__cpu_accumulate(acc, o->accum_dtype, s, l->dtype, hi - lo);
  stale(o, lo, hi);
}

/* The fold of a landed slice; the chunks wholly inside the slice (the shard's last, shorter one
 * included) get their norm partials in the same pass. */
static void fold_slice(sg__offload *o, const sg__offload_landing *l, const void *src) {
  const size_t C = SG__SUMSQ_CHUNK, lo = l->off, hi = l->off + l->len;
  size_t a = o->gpu_order ? (lo + C - 1) / C * C : hi, z = hi == o->numel ? hi : hi / C * C;
  if (a > hi) a = hi;
  if (z < a) z = a;
  fold_plain(o, l, src, lo, a);
  if (a < z) {
    sg__cpu_fold_sumsq_gpu((char *)o->accum + a * esz(o->accum_dtype), o->accum_dtype,
                           (const char *)src + (a - lo) * esz(l->dtype), l->dtype, z - a,
                           l->first, o->part_ss + a / C, o->part_nf + a / C);
    memset(o->part_ok + a / C, 1, (z + C - 1) / C - a / C);
  }
  fold_plain(o, l, src, z, hi);
}

/* A fold job (the fold worker): the arrival's copy landed, then its slice is added. Folds run
 * one at a time in arrival order, so a bucket's micro-batches are summed in the order the
 * device path sums them. */
static sg_status fold_job(void *arg) {
  const sg__offload_landing *l = arg;
  sg__offload *o = l->o;
  SG_TRY(sg__err_prefix(o->dev->ops->comm_wait(o->dev, l->ticket, l->deadline_ms),
                        "offload fold"));
  fold_slice(o, l, o->land[l->j]);
  return SG_OK;
}

/* Landing buffer j is free: nothing planned into it, or its fold ran. */
static int land_free(sg__offload *o, int j) {
  if (o->land_owner[j] < 0) return 1;
  if (!o->lrec[j].fold || sg__jobq_done(&o->fq) < o->lrec[j].fold) return 0;
  o->land_owner[j] = -1;
  return 1;
}

/* A free landing buffer; when none is, a host wait for the fold of the one filled first (the
 * fold worker is nland arrivals behind: the only wait of an arrival on the caller's thread). */
static sg_status take_landing(sg__offload *o, int64_t deadline_ms, int *out) {
  int best = -1;
  for (int j = 0; j < o->nland; j++) {
    if (land_free(o, j)) {
      *out = j;
      return SG_OK;
    }
    if (best < 0 || o->lrec[j].fold < o->lrec[best].fold) best = j;
  }
  if (!o->lrec[best].fold) { /* its fold could not be queued: the queue says why */
    SG_TRY(sg__jobq_failed(&o->fq));
    return sg__err(SG_ERR_INTERNAL, "sg__offload_arrive_plan: landing buffer %d is held by an "
                   "arrival with no fold", best);
  }
  SG_TRY(sg__jobq_wait(&o->fq, o->lrec[best].fold, deadline_ms, "sg__offload_arrive_plan"));
  o->land_owner[best] = -1;
  *out = best;
  return SG_OK;
}

sg_status sg__offload_arrive_plan(sg__offload *o, int k, int src_dtype, int64_t deadline_ms) {
  static const char fn[] = "sg__offload_arrive_plan";
  SG_TRY(check_bucket(o, k, fn));
  if (!sg__dtype_valid(src_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype %d", fn, src_dtype);
  sg__offload_bucket *b = &o->b[k];
  /* the job of the previous arrival reads the plan: a host-driven comm worker may not have run
   * it yet (a stream-ordered job ran inline, inside its submit) */
  if (b->ticket && atomic_load(&b->job_pending))
    SG_TRY(o->dev->ops->comm_wait(o->dev, b->ticket, deadline_ms));
  b->ticket = 0;
  SG_TRY(sg__jobq_failed(&o->fq)); /* a fold failed: the accumulator is not what it should be */
  /* Direct: the bucket's first arrival since the step. No partial of a chunk it touches holds
   * (folds set only those of chunks wholly inside their own slices, and every clear drops them
   * all), so none is marked stale here, where part_ok is the fold worker's. */
  if (!b->filled && src_dtype == o->accum_dtype) {
    b->mode = SG__ARRIVE_DIRECT;
    b->land = -1;
  } else {
    if (b->len * esz(src_dtype) > o->land_bytes)
      return sg__err(SG_ERR_INTERNAL, "%s: bucket %d's slice does not fit a landing buffer", fn, k);
    int j = -1;
    SG_TRY(take_landing(o, deadline_ms, &j));
    o->land_owner[j] = k;
    o->lrec[j] = (sg__offload_landing){o, b->off, b->len, src_dtype, !b->filled, 0, 0,
                                       deadline_ms, j};
    b->land = j;
    b->land_dtype = src_dtype;
    b->land_first = !b->filled;
    b->mode = SG__ARRIVE_LAND;
  }
  b->filled = 1;
  atomic_store(&b->job_pending, 1);
  return SG_OK;
}

sg_status sg__offload_arrive_job(sg__offload *o, int k, const void *dev_slice, int src_dtype,
                                 int own_lane) {
  static const char fn[] = "sg__offload_arrive_job";
  SG_TRY(check_bucket(o, k, fn));
  sg__offload_bucket *b = &o->b[k];
  const int direct = b->mode == SG__ARRIVE_DIRECT, land = b->land, land_dtype = b->land_dtype;
  atomic_store(&b->job_pending, 0); /* the plan is read: the next one may change it */
  if (b->len == 0) return SG_OK;
  void *dst = direct ? (char *)o->accum + b->off * esz(o->accum_dtype)
                     : land >= 0 ? o->land[land] : NULL;
  if (!dst || (!direct && src_dtype != land_dtype) || (direct && src_dtype != o->accum_dtype))
    return sg__err(SG_ERR_INVALID_STATE, "%s: bucket %d's arrival was not planned for dtype %d",
                   fn, k, src_dtype);
  const size_t bytes = b->len * esz(src_dtype);
  if (own_lane) return sg__device_copy_out(o->dev, dst, dev_slice, bytes);
  return o->dev->ops->copy(o->dev, SG_Q_COMM, dst, dev_slice, bytes, SG_COPY_D2H);
}

void sg__offload_arrive_submitted(sg__offload *o, int k, uint64_t ticket) {
  if (!o || !o->dev || k < 0 || k >= o->nbuckets) return;
  sg__offload_bucket *b = &o->b[k];
  b->ticket = ticket;
  if (!ticket) atomic_store(&b->job_pending, 0); /* never queued: no job reads the plan */
  if (b->land < 0) return;
  const int j = b->land; /* the job may still read b->land (a host-driven comm worker) */
  if (!ticket) {
    o->land_owner[j] = -1; /* never queued: nothing will land */
    b->land = -1;
    return;
  }
  sg__offload_landing *l = &o->lrec[j];
  l->ticket = ticket;
  const sg_status st = sg__jobq_submit(&o->fq, fold_job, NULL, l, &l->fold);
  /* not queued (out of memory, or a fold failed before): kept, so that every later wait of
   * the queue says so; the buffer stays held */
  if (st != SG_OK && sg__jobq_failed(&o->fq) == SG_OK) (void)sg__jobq_fail(&o->fq, st, NULL);
}

sg_status sg__offload_fold_all(sg__offload *o, int64_t deadline_ms) {
  if (!o || !o->dev) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_fold_all: no state");
  return sg__jobq_wait_all(&o->fq, deadline_ms, "sg__offload_fold_all");
}

void sg__offload_accum_rewritten(sg__offload *o) {
  if (o && o->part_ok) memset(o->part_ok, 0, o->nq);
}

/* ---- step ---------------------------------------------------------------------------------- */

sg_status sg__offload_norm(sg__offload *o, double out[2]) {
  if (!o || !o->dev || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_norm: NULL");
  if (sg__jobq_done(&o->fq) < sg__jobq_last(&o->fq))
    return sg__err(SG_ERR_INVALID_STATE, "sg__offload_norm: arrivals not folded yet "
                   "(sg__offload_fold_all first)");
  SG_TRY(sg__jobq_failed(&o->fq));
  for (int k = 0; k < o->nbuckets; k++) {
    sg__offload_bucket *b = &o->b[k];
    if (!b->filled) { /* empty since the last step: zeros, as the device path's zeroed slice */
      memset((char *)o->accum + b->off * esz(o->accum_dtype), 0, b->len * esz(o->accum_dtype));
      stale(o, b->off, b->off + b->len);
      b->filled = 1;
    }
  }
  if (!o->gpu_order) {
    sg__cpu_sumsq(o->accum, o->accum_dtype, o->numel, &out[0], &out[1]);
    return SG_OK;
  }
  /* the partials no fold gave, run by run of stale chunks */
  for (size_t q = 0; q < o->nq;) {
    if (o->part_ok[q]) {
      q++;
      continue;
    }
    size_t r = q;
    while (r < o->nq && !o->part_ok[r]) r++;
    sg__cpu_sumsq_gpu_chunks(o->accum, o->accum_dtype, o->numel, q, r - q, o->part_ss + q,
                             o->part_nf + q);
    q = r;
  }
  sg__cpu_sumsq_gpu_combine(o->part_ss, o->part_nf, o->nq, &out[0], &out[1]);
  return SG_OK;
}

sg_status sg__offload_update_with(sg__offload *o, const sg__optim_desc *od,
                                  const sg__update_args *a, void *dev_params,
                                  int64_t deadline_ms, uint64_t *last) {
  if (!o || !o->dev || !od || !a)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_update: NULL");
  if (a->param_dtype != o->param_dtype || a->grad_dtype != o->accum_dtype)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_update: dtypes (param %d, grad %d) are "
                   "not the state's (%d, %d)", a->param_dtype, a->grad_dtype, o->param_dtype,
                   o->accum_dtype);
  for (int s = 0; s < a->nsegs; s++)
    if (a->segs[s].shard_off > o->numel || a->segs[s].len > o->numel - a->segs[s].shard_off)
      return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_update: segment %d is outside the "
                     "shard", s);
  sg__update_args h = *a;
  h.master = o->master, h.grad = o->accum;
  return sg__host_pipe_update(&o->pipe, od, &h, dev_params, deadline_ms, last);
}

sg_status sg__offload_update(sg__offload *o, const sg__update_args *a, void *dev_params,
                             int64_t deadline_ms, uint64_t *last) {
  if (!o || !o->dev || !a) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_update: NULL");
  if (!o->od)
    return sg__err(SG_ERR_INVALID_STATE, "sg__offload_update: the state keeps no optimizer "
                   "arrays (sg__offload_update_with)");
  sg__update_args h = *a;
  for (int k = 0; k < o->od->nstates; k++) h.state[k] = o->state[k];
  return sg__offload_update_with(o, o->od, &h, dev_params, deadline_ms, last);
}

sg_status sg__offload_clear(sg__offload *o, int64_t deadline_ms) {
  if (!o || !o->dev) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_clear: no state");
  const uint64_t last = last_arrival(o);
  if (last) SG_TRY(o->dev->ops->comm_wait(o->dev, last, deadline_ms));
  SG_TRY(sg__offload_fold_all(o, deadline_ms)); /* the folds write the accumulator */
  for (int j = 0; j < o->nland; j++) o->land_owner[j] = -1;
  for (int k = 0; k < o->nbuckets; k++) {
    sg__offload_bucket *b = &o->b[k];
    b->filled = 0, b->ticket = 0, b->land = -1;
    atomic_store(&b->job_pending, 0); /* the jobs ran (waited for above) */
  }
  memset(o->part_ok, 0, o->nq); /* a load or the caller may write the accumulator now */
  return SG_OK;
}

sg_status sg__offload_master_from(sg__offload *o, const void *dev_params, const sg__seg *segs,
                                  int nsegs, int64_t deadline_ms) {
  if (!o || !o->dev || !dev_params || (nsegs > 0 && !segs))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_master_from: NULL argument");
  if (!o->master) return SG_OK;
  SG_TRY(sg__host_pipe_drain(&o->pipe, deadline_ms)); /* its buffers are free */
  const size_t P = esz(o->param_dtype), chunk = o->pipe.chunk;
  for (int s = 0; s < nsegs; s++) {
    if (segs[s].shard_off > o->numel || segs[s].len > o->numel - segs[s].shard_off)
      return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__offload_master_from: segment %d is outside "
                     "the shard", s);
    for (size_t i = 0; i < segs[s].len; i += chunk) {
      const size_t n = segs[s].len - i < chunk ? segs[s].len - i : chunk;
      SG_TRY(o->dev->ops->copy(o->dev, SG_Q_COMPUTE, o->pipe.out[0],
                               (const char *)dev_params + (segs[s].flat_off + i) * P, n * P,
                               SG_COPY_D2H));
      sg__cpu_cast(o->master + segs[s].shard_off + i, SG_F32, o->pipe.out[0], o->param_dtype, n);
    }
  }
  return SG_OK;
}

/* ---- access and memory --------------------------------------------------------------------- */

float *sg__offload_state(sg__offload *o, int which) {
  if (!o) return NULL;
  if (which == 0) return o->master;
  return o->od && which >= 1 && which <= o->od->nstates ? o->state[which - 1] : NULL;
}

size_t sg__offload_host_bytes(const sg__optim_desc *od, size_t numel, int param_dtype,
                              int accum_dtype, size_t chunk, int nland, size_t land_bytes) {
  const size_t c = chunk ? chunk : SG__HOST_PIPE_CHUNK;
  const size_t states = od ? 4 * (size_t)od->nstates : 0;
  return numel * (esz(accum_dtype) + states + (param_dtype == SG_F32 ? 0 : 4)) +
         (size_t)nland * land_bytes + SG__HOST_PIPE_NBUF * c * esz(param_dtype);
}
