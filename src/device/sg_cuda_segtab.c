/* The CUDA device's update (cuda.c's header comment, "Threads"): the segment tables the
 * update kernels read, cached on the device by content, and the update op over them. */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c11 */

#include "sg_cuda_internal.h"

/* ---- segment tables ------------------------------------------------------------------------
 *
 * The engine calls update once per bucket, each time with a sub-array of one stable segment
 * array, so that the all-gather of a bucket overlaps the update of the next one. Each distinct
 * table is uploaded once (pinned staging, an asynchronous copy on the calling stream) and kept,
 * so a steady state of per-bucket calls neither uploads nor waits on the host. A table used on
 * another stream than the one it was uploaded on makes that stream wait for its upload once.
 * use_ev[q] marks the last upload or kernel on queue q: eviction (past SG__CUDA_TAB_MAX tables
 * or SG__CUDA_TAB_MAX_BYTES) waits for both on the host, destroy makes the comm stream wait for
 * both before the stream-ordered frees. */

/* Key hash over every field (sr_index included: it changes the stochastic rounding bits; group
 * too: it picks the lr and weight decay). */
static uint64_t sg__cuda_mix(uint64_t h, uint64_t x) {
  h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

static uint64_t sg__cuda_segs_hash(const sg__seg *segs, int n) {
  uint64_t h = (uint64_t)n;
  for (int i = 0; i < n; i++) {
    h = sg__cuda_mix(h, segs[i].shard_off);
    h = sg__cuda_mix(h, segs[i].flat_off);
    h = sg__cuda_mix(h, segs[i].len);
    h = sg__cuda_mix(h, (uint64_t)segs[i].decay);
    h = sg__cuda_mix(h, segs[i].sr_index);
    h = sg__cuda_mix(h, (uint64_t)(uint32_t)segs[i].group);
  }
  return h;
}

/* Field by field: sg__seg has padding that memcmp would read. */
static int sg__cuda_segs_equal(const sg__seg *a, const sg__seg *b, int n) {
  for (int i = 0; i < n; i++)
    if (a[i].shard_off != b[i].shard_off || a[i].flat_off != b[i].flat_off ||
        a[i].len != b[i].len || a[i].decay != b[i].decay || a[i].sr_index != b[i].sr_index ||
        a[i].group != b[i].group)
      return 0;
  return 1;
}

static int sg__cuda_tab_matches(const sg__cuda_segtab *t, uint64_t h, const sg__seg *segs, int n) {
  return t->hash == h && t->nsegs == n && sg__cuda_segs_equal(t->segs, segs, n);
}

/* The cached table of segs, or -1. Calls come bucket after bucket in a fixed order: the entry
 * after the last hit is tried first, then all of them. */
static int sg__cuda_tab_find(const sg__cuda_dev *d, uint64_t h, const sg__seg *segs, int n) {
  if (d->tab_next < d->ntabs && sg__cuda_tab_matches(&d->tabs[d->tab_next], h, segs, n))
    return d->tab_next;
  for (int i = 0; i < d->ntabs; i++)
    if (sg__cuda_tab_matches(&d->tabs[i], h, segs, n)) return i;
  return -1;
}

/* Frees every table and staging chunk. Device tables go in stream order on s: the caller made s
 * wait for their last users (or waited on the host). */
void sg__cuda_tabs_release(sg__cuda_dev *d, cudaStream_t s) {
  for (int i = 0; i < d->ntabs; i++) {
    sg__cuda_segtab *t = &d->tabs[i];
    if (t->dev && s) (void)cudaFreeAsync(t->dev, s);
    if (t->ready) (void)cudaEventDestroy(t->ready);
    free(t->segs);
  }
  d->ntabs = 0;
  d->tab_next = 0;
  d->tab_bytes = 0;
  /* cudaFreeHost waits for the device: a staging slice whose upload is still queued is safe. */
  while (d->stage) {
    sg__cuda_stage *c = d->stage;
    d->stage = c->next;
    if (c->base) (void)cudaFreeHost(c->base);
    free(c);
  }
}

/* Drops the whole cache when one more table of `bytes` would pass a bound. Rare: a host wait
 * for every upload and kernel that may still read a table. */
static sg_status sg__cuda_tabs_make_room(sg__cuda_dev *d, cudaStream_t s, size_t bytes,
                                         const char *fn) {
  if (d->ntabs < SG__CUDA_TAB_MAX && d->tab_bytes + bytes <= SG__CUDA_TAB_MAX_BYTES) return SG_OK;
  SG_LOG(SG_LOG_INFO, d->base.rank,
         "cuda device %d: dropping %d cached segment tables (%zu bytes, %llu uploads so far)",
         d->ordinal, d->ntabs, d->tab_bytes, (unsigned long long)d->tab_uploads);
  for (int q = 0; q < 2; q++) SG_TRY(sg__cuda_wait(d, d->use_ev[q], NULL, INT64_MAX, fn));
  sg__cuda_tabs_release(d, s);
  return SG_OK;
}

/* A pinned slice of `bytes` (16-byte aligned) for an upload. */
static sg_status sg__cuda_stage_take(sg__cuda_dev *d, size_t bytes, void **out, const char *fn) {
  bytes = (bytes + 15u) & ~(size_t)15u;
  sg__cuda_stage *c = d->stage;
  if (!c || c->cap - c->used < bytes) {
    c = (sg__cuda_stage *)calloc(1, sizeof *c);
    if (!c) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: staging chunk", fn);
    c->cap = bytes > SG__CUDA_STAGE_CHUNK ? bytes : SG__CUDA_STAGE_CHUNK;
    cudaError_t e = cudaMallocHost((void **)&c->base, c->cap);
    if (e != cudaSuccess) {
      free(c);
      return sg__cuda_err(e, fn, "cudaMallocHost(segment staging)", __FILE__, __LINE__);
    }
    c->next = d->stage;
    d->stage = c;
  }
  *out = c->base + c->used;
  c->used += bytes;
  return SG_OK;
}

/* Uploads entry t's table on s through a pinned slice. */
static sg_status sg__cuda_tab_upload(sg__cuda_dev *d, cudaStream_t s, sg__cuda_segtab *t,
                                     const char *fn) {
  void *stage = NULL;
  SG_TRY(sg__cuda_stage_take(d, t->bytes, &stage, fn));
  SG__CU(cudaEventCreateWithFlags(&t->ready, cudaEventDisableTiming), fn);
  SG__CU(cudaMallocAsync(&t->dev, t->bytes, s), fn);
  sg__cuda_seg_table_build(stage, t->segs, t->nsegs, &t->work);
  SG__CU(cudaMemcpyAsync(t->dev, stage, t->bytes, cudaMemcpyHostToDevice, s), fn);
  SG__CU(cudaEventRecord(t->ready, s), fn);
  t->synced[0] = s;
  return SG_OK;
}

/* A new cache entry for segs, uploaded on s; its index in *idx. A failed upload leaves no
 * entry behind (a half-built one would be found again and skip the update). */
static sg_status sg__cuda_tab_add(sg__cuda_dev *d, cudaStream_t s, uint64_t h, const sg__seg *segs,
                                  int n, int *idx, const char *fn) {
  const size_t bytes = sg__cuda_seg_table_bytes(n);
  SG_TRY(sg__cuda_tabs_make_room(d, s, bytes, fn));
  if (d->ntabs == d->tabs_cap) {
    int cap = d->tabs_cap ? 2 * d->tabs_cap : 16;
    sg__cuda_segtab *grown = (sg__cuda_segtab *)realloc(d->tabs, (size_t)cap * sizeof *grown);
    if (!grown) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: segment table cache (%d)", fn, cap);
    d->tabs = grown;
    d->tabs_cap = cap;
  }
  sg__cuda_segtab *t = &d->tabs[d->ntabs];
  memset(t, 0, sizeof *t);
  t->segs = (sg__seg *)malloc((size_t)n * sizeof *segs);
  if (!t->segs) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: segment cache (%d segments)", fn, n);
  memcpy(t->segs, segs, (size_t)n * sizeof *segs);
  t->hash = h;
  t->nsegs = n;
  t->bytes = bytes;
  sg_status st = sg__cuda_tab_upload(d, s, t, fn);
  if (st != SG_OK) {
    if (t->dev) (void)cudaFreeAsync(t->dev, s);
    if (t->ready) (void)cudaEventDestroy(t->ready);
    free(t->segs);
    memset(t, 0, sizeof *t);
    return st;
  }
  d->tab_bytes += bytes;
  d->tab_uploads++;
  *idx = d->ntabs++;
  return SG_OK;
}

/* The device table for segs, usable on s (uploaded now, or s made to wait for its upload). */
static sg_status sg__cuda_tab_get(sg__cuda_dev *d, cudaStream_t s, const sg__seg *segs, int n,
                                  sg__cuda_segtab **out, const char *fn) {
  const uint64_t h = sg__cuda_segs_hash(segs, n);
  int i = sg__cuda_tab_find(d, h, segs, n);
  if (i < 0) SG_TRY(sg__cuda_tab_add(d, s, h, segs, n, &i, fn));
  sg__cuda_segtab *t = &d->tabs[i];
  if (t->synced[0] != s && t->synced[1] != s) {
    SG__CU(cudaStreamWaitEvent(s, t->ready, 0), fn);
    t->synced[1] = s; /* one slot for the other queue (or the caller's latest stream) */
  }
  d->tab_next = i + 1 < d->ntabs ? i + 1 : 0;
  *out = t;
  return SG_OK;
}

static sg_status sg__cuda_update_check(const sg__optim_desc *od, const sg__update_args *a,
                                       const char *fn) {
  if (!od) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", fn);
  if (!od->cuda_update)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: optimizer %s has no CUDA kernel", fn, od->name);
  if (!a) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL args", fn);
  if (!sg__cuda_dtype_ok(a->param_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad param_dtype (%d)", fn, a->param_dtype);
  if (!sg__cuda_dtype_ok(a->grad_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad grad_dtype (%d)", fn, a->grad_dtype);
  if (a->nsegs < 0 || (a->nsegs > 0 && !a->segs))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad segments (%d)", fn, a->nsegs);
  int bad = a->nsegs > 0 && (!a->param || !a->grad);
  for (int k = 0; a->nsegs > 0 && k < od->nstates; k++) bad |= !a->state[k];
  if (bad) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  if (a->param_dtype != SG_F32 && a->nsegs > 0 && !a->master)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s params need a master copy", fn,
                   sg__dtype_name((sg_dtype)a->param_dtype));
  if (!sg__update_groups_ok(a))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad parameter groups (ngroups %d)", fn,
                   a->ngroups);
  return SG_OK;
}

sg_status sg__cudev_update(sg__device *dev, sg__queue q, const sg__optim_desc *od,
                           const sg__update_args *a) {
  static const char fn[] = "sg__device_cuda.update";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  SG_TRY(sg__cuda_update_check(od, a, fn));
  if (a->nsegs == 0) return SG_OK;
  SG_TRY(sg__cuda_enter(d, fn));
  cudaStream_t s = sg__cuda_stream(d, q);
  sg__cuda_segtab *t = NULL;
  pthread_mutex_lock(&d->tab_mu); /* the cache is shared by both queues' threads */
  sg_status st = sg__cuda_tab_get(d, s, a->segs, a->nsegs, &t, fn);
  if (st == SG_OK && t->work > 0) {
    int rc = od->cuda_update(sg__cuda_launch_on(d, q), a, t->dev, t->work);
    if (rc != 0) st = sg__cuda_err((cudaError_t)rc, fn, od->name, __FILE__, __LINE__);
  }
  /* Even after a failure: an upload may have been queued, and eviction and destroy wait here. */
  cudaError_t e = cudaEventRecord(d->use_ev[q], s);
  pthread_mutex_unlock(&d->tab_mu);
  if (e != cudaSuccess) return sg__cuda_err(e, fn, "cudaEventRecord(use_ev)", __FILE__, __LINE__);
  SG_TRY(st);
  return sg__cuda_after(d, q, fn);
}

