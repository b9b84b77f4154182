/* The replica codecs' scheme (cfg.replica_codec, docs/slow-links.md): the per-step sum of each
 * bucket's slice across the N replicas of a hybrid engine, sent as blockwise-scaled codes with
 * error feedback, in two stages so that every replica ends with the same bits:
 *
 *   1. x = slice + r1 (this rank's residual), split into N chunks of whole blocks; chunk k
 *      encoded, r1 = x - decoded (what the codes missed, added back next step); the codes of
 *      chunk k go to replica k (all-to-all).
 *   2. replica k decodes the N codes of its chunk and sums them in replica order (fp32), adds
 *      its own residual r2 and encodes that (r2 = what this second code missed); the codes go
 *      to every replica (all-gather), and every replica, k included, decodes every chunk.
 *
 * Each rank sends 2 (N-1)/N of its slice's code bytes: at 8 bits 0.254x what the exact fp32
 * all-reduce sends. The codes themselves (the device's code_encode/code_decode: the loops of
 * kernels/cpu/sg_cpu_codec.c or the CUDA kernels, element math in kernels/sg_elem.h; bits from
 * the codec tables, sg_replica_int8.c, sg_replica_int4.c) run on the comm queue. This file
 * owns e->rep.codec: made by prepare in sg_finalize, freed by release, its residuals in the
 * layout's replica buffer (sg__replica_codec_bytes, counted in sg_memory's comm_bytes) and in
 * checkpoints (every replica's: sg__replica_codec_save, sg__replica_codec_restore). */
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_code_bytes: the codes' layout */
#include "../../../kernels/sg_elem.h"           /* SG_ELEM_CODE_BLOCK */
#include "sg_replica_policy.h"

#define BLOCK ((size_t)SG_ELEM_CODE_BLOCK)

typedef struct sg__codec {
  int bits;
  int ck_state;   /* its residuals' checkpoint state (SG__REP_RESID, SG__REP_OUTER_RESID) */
  float *r1;      /* this rank's slices' residuals, shard offsets (plan shard_numel) */
  float *r2;      /* the residual of this rank's chunk of each bucket, at r2_off[b] */
  size_t *r2_off; /* [nbuckets + 1] */
  char *send, *recv; /* N chunk regions each, of the largest bucket's chunk bytes */
} sg__codec;

static size_t nblocks(size_t n) { return (n + BLOCK - 1) / BLOCK; }

/* Chunk k of n values over N replicas: whole blocks, near-equal, the first ones longer. */
static void chunk_of(size_t n, int N, int k, size_t *off, size_t *len) {
  const size_t nb = nblocks(n), base = nb / (size_t)N, rem = nb % (size_t)N, kk = (size_t)k;
  const size_t b0 = kk * base + (kk < rem ? kk : rem), nbk = base + (kk < rem ? 1u : 0u);
  *off = b0 * BLOCK < n ? b0 * BLOCK : n;
  *len = (b0 + nbk) * BLOCK < n ? (b0 + nbk) * BLOCK - *off : n - *off;
}

/* Values in the longest chunk of a slice of n (whole blocks); its code bytes per replica. */
static size_t max_chunk(size_t n, int N) { return (nblocks(n) + (size_t)N - 1) / (size_t)N * BLOCK; }

static size_t region_bytes(size_t n, int N, int bits) {
  return sg__cpu_code_bytes(max_chunk(n, N), bits);
}

size_t sg__replica_codec_region(size_t n, int N, int bits) { return region_bytes(n, N, bits); }

/* r1, r2 and the two exchange buffers, in bytes, for a plan over N replicas. */
size_t sg__replica_codec_bytes(const sg__plan *p, int N, int bits) {
  size_t r2 = 0, region = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const size_t n = sg__plan_slice_numel(p, b);
    r2 += max_chunk(n, N);
    if (region_bytes(n, N, bits) > region) region = region_bytes(n, N, bits);
  }
  return 4u * (p->shard_numel + r2) + 2u * (size_t)N * region;
}

/* ---- the two stages ------------------------------------------------------------------------ */

/* Stage 2's codes of chunk k, decoded into the slice by every replica. */
static sg_status decode_all(sg__device *d, sg__queue q, const sg__codec *k, float *acc, size_t n, int N,
                            size_t region) {
  for (int r = 0; r < N; r++) {
    size_t off, len;
    chunk_of(n, N, r, &off, &len);
    SG_TRY(d->ops->code_decode(d, q, acc + off, k->send + (size_t)r * region, len,
                               k->bits, 0));
  }
  return SG_OK;
}

/* The owner's sum of its chunk: every replica's codes decoded in replica order (fp32 adds),
 * into the slice, then encoded with its own residual into its slot of the send buffer. */
static sg_status owner_sum(sg__device *d, sg__queue q, const sg__codec *k, float *acc, float *r2, size_t n,
                           int N, int me, size_t region) {
  size_t off, len;
  chunk_of(n, N, me, &off, &len);
  for (int r = 0; r < N; r++)
    SG_TRY(d->ops->code_decode(d, q, acc + off, k->recv + (size_t)r * region, len,
                               k->bits, r > 0));
  return d->ops->code_encode(d, q, k->send + (size_t)me * region, acc + off, r2, len,
                             k->bits);
}

/* Bucket b's exchange buffers: N regions of `region` code bytes each. */
void sg__replica_codec_bufs(const sg_engine *e, int b, char **send, char **recv, size_t *region) {
  const sg__codec *k = e->rep.codec;
  *send = k->send;
  *recv = k->recv;
  *region = region_bytes(sg__plan_slice_numel(e->plan, b), e->rep.n, k->bits);
}

/* Stage 1's codes: chunk k of acc + r1 into send region k, r1 what they missed. */
sg_status sg__replica_codec_encode(sg_engine *e, int b, float *acc) {
  sg__codec *k = e->rep.codec;
  sg__device *d = sg__replica_sum_dev(e);
  const sg__queue q = sg__replica_elem_queue(e);
  const int N = e->rep.n;
  const size_t n = sg__plan_slice_numel(e->plan, b), region = region_bytes(n, N, k->bits);
  float *r1 = k->r1 + e->plan->buckets[b].shard_offset;
  for (int r = 0; r < N; r++) {
    size_t off, len;
    chunk_of(n, N, r, &off, &len);
    SG_TRY(d->ops->code_encode(d, q, k->send + (size_t)r * region, acc + off, r1 + off,
                               len, k->bits));
  }
  return SG_OK;
}

/* Once recv holds every replica's codes of this replica's chunk: its sum, encoded into its own
 * region of send. */
sg_status sg__replica_codec_owner(sg_engine *e, int b, float *acc) {
  sg__codec *k = e->rep.codec;
  const size_t n = sg__plan_slice_numel(e->plan, b), region = region_bytes(n, e->rep.n, k->bits);
  return owner_sum(sg__replica_sum_dev(e), sg__replica_elem_queue(e), k, acc,
                   k->r2 + k->r2_off[b], n, e->rep.n, e->rep.rank, region);
}

/* Once send holds every owner's codes: every chunk decoded into acc. */
sg_status sg__replica_codec_decode(sg_engine *e, int b, float *acc) {
  sg__codec *k = e->rep.codec;
  const size_t n = sg__plan_slice_numel(e->plan, b), region = region_bytes(n, e->rep.n, k->bits);
  return decode_all(sg__replica_sum_dev(e), sg__replica_elem_queue(e), k, acc, n, e->rep.n, region);
}

/* In the replica work's queue (sg__replica_elem_queue); the codes through the device of the
 * sums' element work (sg__replica_sum_dev), the exchanges through the replica channel. */
sg_status sg__replica_codec_sum(sg_engine *e, int b, float *acc) {
  sg_comm *c = e->rep.comm;
  char *send, *recv;
  size_t region;
  sg__replica_codec_bufs(e, b, &send, &recv, &region);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  SG_TRY(sg__replica_codec_encode(e, b, acc));
  SG_TRY(c->ops->all_to_all(c, send, recv, region, dl));
  SG_TRY(sg__replica_codec_owner(e, b, acc));
  SG_TRY(c->ops->all_gather(c, send, region, dl));
  return sg__replica_codec_decode(e, b, acc);
}

sg_status sg__replica_codec_reduce(sg_engine *e, int b) {
  return sg__replica_codec_sum(e, b, (float *)sg__accum_of(e, b));
}

/* Both codecs' claim: the bucket's exchange queued behind its reduction. */
sg_status sg__replica_codec_claim(sg_engine *e, int b) {
  return sg__replica_submit(e, b, sg__replica_codec_reduce);
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

sg_status sg__replica_codec_prepare(sg_engine *e, int bits, size_t off, int ck_state) {
  const sg__plan *p = e->plan;
  const int N = e->rep.n;
  sg__codec *k = calloc(1, sizeof *k);
  size_t *r2_off = calloc((size_t)p->nbuckets + 1, sizeof *r2_off);
  if (!k || !r2_off) {
    free(k);
    free(r2_off);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  size_t region = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const size_t n = sg__plan_slice_numel(p, b);
    r2_off[b + 1] = r2_off[b] + max_chunk(n, N);
    if (region_bytes(n, N, bits) > region) region = region_bytes(n, N, bits);
  }
  char *base = sg__replica_buf(e) + off;
  sg__device *d = e->rep.elem_dev;
  /* no error carried yet */
  const sg_status st = d->ops->zero(d, SG_Q_COMPUTE, base,
                                         sg__replica_codec_bytes(p, N, bits));
  if (st != SG_OK) {
    free(k);
    free(r2_off);
    return st;
  }
  k->bits = bits;
  k->ck_state = ck_state;
  k->r1 = (float *)base;
  k->r2 = k->r1 + p->shard_numel;
  k->r2_off = r2_off;
  k->send = (char *)(k->r2 + r2_off[p->nbuckets]);
  k->recv = k->send + (size_t)N * region;
  e->rep.codec = k;
  return SG_OK;
}

/* ---- checkpoints --------------------------------------------------------------------------- */

/* A checkpoint holds every replica's residuals, one record per element (state coordinates):
 * r2, the residual of the replica whose chunk holds the element, then r1 of replicas 0..N-1.
 * Replica 0 writes; it receives the others' residuals by one broadcast from each. */
static size_t resid_words(const sg_engine *e, const sg__codec *k) {
  return e->plan->shard_numel + k->r2_off[e->plan->nbuckets];
}

void sg__replica_codec_describe(const sg_engine *e, sg__rep_ck *ck) {
  ck->esz[e->rep.codec->ck_state] = 4u * ((uint32_t)e->rep.n + 1u);
}

/* Replica j's residuals (vals: its r1, then its r2 regions) into the records. */
static void scatter_records(const sg_engine *e, const sg__codec *k, const float *vals, int j,
                            float *rec) {
  const sg__plan *p = e->plan;
  const size_t w = (size_t)e->rep.n + 1u, sn = p->shard_numel;
  for (size_t i = 0; i < sn; i++) rec[i * w + 1u + (size_t)j] = vals[i];
  for (int b = 0; b < p->nbuckets; b++) {
    size_t off, len;
    chunk_of(sg__plan_slice_numel(p, b), e->rep.n, j, &off, &len);
    const size_t so = p->buckets[b].shard_offset + off;
    for (size_t t = 0; t < len; t++) rec[(so + t) * w] = vals[sn + k->r2_off[b] + t];
  }
}

/* The residuals are in the element work's memory: the engine's device's (or its twin's, the
 * same GPU), or the host's (an offloaded optimizer's CPU device). Either broadcast runs where
 * the transport runs its channel's host-side collectives (ops->run: a twin device calls its
 * channel on its own queue only). */
static sg_status bcast_resid(sg_engine *e, void *buf, size_t bytes, int root) {
  if (e->rep.elem_dev->kind != e->dev->kind) return sg__replica_broadcast_host(e, buf, bytes, root);
  return sg__replica_broadcast_dev(e, buf, bytes, root);
}

/* Replica j's residuals broadcast from its buffer into tmp (memory of the element work's
 * device, through the other kind where the channel takes that), then read into host for the
 * records. */
static sg_status save_from(sg_engine *e, const sg__codec *k, int j, void *dev_tmp, float *host,
                           size_t bytes, float *rec) {
  void *buf = j == e->rep.rank ? (void *)k->r1 : dev_tmp;
  SG_TRY(bcast_resid(e, buf, bytes, j));
  if (!rec) return SG_OK;
  sg__device *d = e->rep.elem_dev;
  SG_TRY(d->ops->copy(d, SG_Q_COMPUTE, host, buf, bytes, SG_COPY_D2H));
  scatter_records(e, k, host, j, rec);
  return SG_OK;
}

sg_status sg__replica_codec_save(sg_engine *e, sg__rep_ck *ck) {
  const sg__codec *k = e->rep.codec;
  sg__device *d = e->rep.elem_dev;
  const size_t bytes = resid_words(e, k) * sizeof(float);
  float *host = malloc(bytes);
  void *dev_tmp = NULL;
  if (!host) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (%zu bytes)", bytes);
  sg_status st = d->ops->alloc(d, bytes, &dev_tmp);
  for (int j = 0; j < e->rep.n && st == SG_OK; j++)
    st = save_from(e, k, j, dev_tmp, host, bytes, ck->rec[k->ck_state]);
  if (dev_tmp) d->ops->free(d, dev_tmp);
  free(host);
  return st;
}

/* Saved at N_s replicas, loaded at N: replica r takes the sum of the saved r1 of the replicas
 * j with j mod N == r (ascending j; N_s == N: its own, bit for bit; none: 0), and each
 * element's r2 goes to the replica whose chunk holds it now. The sum over replicas of what the
 * codes still owe is kept at any node count (up to the rounding of those sums). */
static void gather_records(const sg_engine *e, const sg__codec *k, const float *rec, size_t ns,
                           float *r1, float *r2) {
  const sg__plan *p = e->plan;
  const size_t w = ns + 1u, N = (size_t)e->rep.n, me = (size_t)e->rep.rank;
  for (size_t i = 0; i < p->shard_numel; i++) {
    float r = 0.0f;
    for (size_t j = me; j < ns; j += N) r = j == me ? rec[i * w + 1u + j] : r + rec[i * w + 1u + j];
    r1[i] = r;
  }
  for (int b = 0; b < p->nbuckets; b++) {
    size_t off, len;
    chunk_of(sg__plan_slice_numel(p, b), e->rep.n, e->rep.rank, &off, &len);
    const size_t so = p->buckets[b].shard_offset + off;
    for (size_t t = 0; t < len; t++) r2[k->r2_off[b] + t] = rec[(so + t) * w];
  }
}

/* After sg_load: the checkpoint's residuals, or (a checkpoint without them) none carried: a
 * resumed run then loses at most one step's rounding, once. Made on the host, then copied to
 * the device; a failure (of the host allocation or the copy) breaks the engine (restore returns
 * nothing; every later call fails with it). */
void sg__replica_codec_restore(sg_engine *e, const sg__rep_ck *ck) {
  sg__codec *k = e->rep.codec;
  if (!k) return;
  const size_t words = resid_words(e, k);
  float *host = calloc(words, sizeof(float));
  if (!host) {
    (void)sg__engine_broken(e, sg__err(SG_ERR_OUT_OF_MEMORY, "sg_load: out of host memory"));
    return;
  }
  const int w = k->ck_state;
  if (ck && ck->rec[w] && ck->esz[w] >= 8u)
    gather_records(e, k, ck->rec[w], ck->esz[w] / 4u - 1u, host, host + e->plan->shard_numel);
  sg__device *d = e->rep.elem_dev;
  const sg_status st = d->ops->copy(d, SG_Q_COMPUTE, k->r1, host, words * sizeof(float),
                                    SG_COPY_H2D);
  if (st != SG_OK) (void)sg__engine_broken(e, st);
  free(host);
}

void sg__replica_codec_release(sg_engine *e) {
  if (!e->rep.codec) return;
  free(e->rep.codec->r2_off);
  free(e->rep.codec);
  e->rep.codec = NULL;
}

void sg__replica_codec_release_queue(sg_engine *e) {
  sg__replica_codec_release(e);
  sg__replica_staged_release(e);
}
