/* The shard planner (DESIGN.md section 2). A pure function of its inputs: every rank computes
 * the same tables from the same registration list, so no layout ever crosses the wire. */
#include <stdint.h> /* SIZE_MAX, uint64_t */
#include <stdlib.h> /* malloc, calloc, realloc, free */
#include <string.h> /* strlen */

#include "sg_plan.h" /* sg__plan, sg__plan_build */

/* a + b into *out; 0 on size_t overflow. */
static int sg__add_ok(size_t a, size_t b, size_t *out) {
  if (a > SIZE_MAX - b) return 0;
  *out = a + b;
  return 1;
}

/* x rounded up to a multiple of m (m > 0); 0 on overflow. */
static int sg__align_ok(size_t x, size_t m, size_t *out) {
  size_t r = x % m;
  return r ? sg__add_ok(x, m - r, out) : (*out = x, 1);
}

static uint64_t sg__hash_u64(uint64_t h, uint64_t v) { return sg__hash_bytes(h, &v, sizeof v); }

/* name (length first, so "ab"+"c" and "a"+"bc" differ; NULL differs from ""), numel, flags */
static uint64_t sg__hash_param(uint64_t h, const sg__plan_input *in) {
  uint64_t len = in->name ? (uint64_t)strlen(in->name) : UINT64_MAX;
  h = sg__hash_u64(h, len);
  if (in->name) h = sg__hash_bytes(h, in->name, (size_t)len);
  h = sg__hash_u64(h, (uint64_t)in->numel);
  return sg__hash_u64(h, (uint64_t)in->flags);
}

static sg_status sg__plan_check_args(const sg__plan_input *params, int nparams, int world,
                                     size_t elem_bytes, size_t bucket_bytes, sg__plan **out) {
  const char *fn = "sg__plan_build";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  if (!params) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: params is NULL", fn);
  if (nparams < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: nparams must be >= 1 (got %d)", fn, nparams);
  if (world < 1 || world > 4096)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world must be in 1..4096 (got %d)", fn, world);
  if (elem_bytes != 2 && elem_bytes != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: elem_bytes must be 2 or 4 (got %zu)", fn,
                   elem_bytes);
  if (bucket_bytes / elem_bytes < SG_PLAN_ALIGN)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: bucket_bytes must hold >= %d elements of %zu bytes (got %zu bytes)", fn,
                   SG_PLAN_ALIGN, elem_bytes, bucket_bytes);
  for (int i = 0; i < nparams; i++)
    if (params[i].numel < 1)
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: numel must be >= 1 (param %d '%s')", fn, i,
                     params[i].name ? params[i].name : "");
  return SG_OK;
}

static sg_status sg__plan_alloc(sg__plan *p, int nparams, int world) {
  size_t n = (size_t)nparams;
  p->params = calloc(n, sizeof *p->params);
  p->order = calloc(n, sizeof *p->order);
  p->buckets = calloc(n, sizeof *p->buckets); /* at most one bucket per param; shrunk later */
  p->param_hash = calloc(n, sizeof *p->param_hash);
  /* n*world+1 cannot overflow size_t on 64-bit (int * 4096); calloc checks the byte count. */
  p->frag_index = calloc(n * (size_t)world + 1, sizeof *p->frag_index);
  if (!p->params || !p->order || !p->buckets || !p->param_hash || !p->frag_index)
    return sg__err(SG_ERR_OUT_OF_MEMORY,
                   "sg__plan_build: cannot allocate the plan tables (%d params, world %d)", nparams,
                   world);
  return SG_OK;
}

static sg_status sg__plan_too_big(const sg__plan_input *in, int id) {
  return sg__err(SG_ERR_INVALID_ARGUMENT,
                 "sg__plan_build: the flat buffer would exceed the address space "
                 "(param %d '%s', numel %zu)",
                 id, in->name ? in->name : "", in->numel);
}

/* Closes bucket b: pads its used length to a multiple of 64*W and places it after b-1. */
static int sg__plan_close_bucket(sg__plan *p, int b, size_t used, size_t *next_start) {
  sg__bucket *bk = &p->buckets[b];
  size_t unit = p->align * (size_t)p->world;
  size_t end;
  if (!sg__align_ok(used, unit, &bk->numel) || !sg__add_ok(*next_start, bk->numel, &end)) return 0;
  bk->start = *next_start;
  bk->shard_offset = bk->start / (size_t)p->world; /* earlier buckets' slices, back to back */
  *next_start = end;
  if (bk->numel > p->max_bucket_numel) p->max_bucket_numel = bk->numel;
  return 1;
}

/* Walks params in reverse registration order, packing them into buckets. Offsets are first
 * recorded relative to the bucket, then made absolute once each bucket's start is known. */
static sg_status sg__plan_layout(sg__plan *p, const sg__plan_input *in) {
  int b = 0;
  size_t used = 0, start = 0;
  p->buckets[0].first_param = 0;
  for (int k = 0; k < p->nparams; k++) {
    int id = p->nparams - 1 - k;
    size_t off, end;
    if (!sg__align_ok(used, p->align, &off)) return sg__plan_too_big(&in[id], id);
    /* A param that would overflow a non-empty bucket starts the next one. */
    if (p->buckets[b].param_count > 0 &&
        (off >= p->bucket_elems || in[id].numel > p->bucket_elems - off)) {
      if (!sg__plan_close_bucket(p, b, used, &start)) return sg__plan_too_big(&in[id], id);
      b++;
      p->buckets[b].first_param = k;
      off = 0;
    }
    if (!sg__add_ok(off, in[id].numel, &end)) return sg__plan_too_big(&in[id], id);
    used = end;
    p->order[k] = id;
    sg__plan_param *pp = &p->params[id]; /* field by field: calloc'd padding stays zero */
    pp->offset = off;
    pp->numel = in[id].numel;
    pp->flags = in[id].flags;
    pp->bucket = b;
    pp->order = k;
    p->buckets[b].param_count++;
  }
  if (!sg__plan_close_bucket(p, b, used, &start)) return sg__plan_too_big(&in[0], 0);
  p->nbuckets = b + 1;
  p->total_numel = start;
  p->shard_numel = start / (size_t)p->world;
  /* Engines allocate fp32 copies of the flat buffer: keep total*8 bytes representable. */
  if (p->total_numel > SIZE_MAX / 8) return sg__plan_too_big(&in[0], 0);
  for (int id = 0; id < p->nparams; id++)
    p->params[id].offset += p->buckets[p->params[id].bucket].start;
  return SG_OK;
}

/* Ranks whose slice of the param's bucket intersects the param: [*r0, *r1]. */
static void sg__plan_rank_span(const sg__plan *p, int id, int *r0, int *r1) {
  const sg__plan_param *pp = &p->params[id];
  const sg__bucket *bk = &p->buckets[pp->bucket];
  size_t slice = bk->numel / (size_t)p->world, rel = pp->offset - bk->start;
  *r0 = (int)(rel / slice);
  *r1 = (int)((rel + pp->numel - 1) / slice);
}

/* A param lives in one bucket and a rank owns one contiguous slice of it, so each (param, rank)
 * pair has zero or one fragment; the CSR table still allows more for future layouts. */
static sg_status sg__plan_fragments(sg__plan *p) {
  size_t W = (size_t)p->world, total = 0;
  for (int id = 0; id < p->nparams; id++) {
    int r0, r1;
    sg__plan_rank_span(p, id, &r0, &r1);
    total += (size_t)(r1 - r0 + 1);
  }
  p->frags = calloc(total, sizeof *p->frags);
  if (!p->frags)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__plan_build: cannot allocate %zu fragments", total);
  size_t nf = 0;
  for (int id = 0; id < p->nparams; id++) {
    const sg__plan_param *pp = &p->params[id];
    const sg__bucket *bk = &p->buckets[pp->bucket];
    size_t slice = bk->numel / W, rel = pp->offset - bk->start;
    int r0, r1;
    sg__plan_rank_span(p, id, &r0, &r1);
    size_t *idx = &p->frag_index[(size_t)id * W];
    for (int r = 0; r < r0; r++) idx[r + 1] = nf;
    for (int r = r0; r <= r1; r++) {
      size_t lo = (size_t)r * slice, hi = lo + slice;
      size_t a = rel > lo ? rel : lo, e = rel + pp->numel < hi ? rel + pp->numel : hi;
      sg__fragment *fr = &p->frags[nf++];
      fr->bucket = pp->bucket;
      fr->param_offset = a - rel;
      fr->shard_offset = bk->shard_offset + (a - lo);
      fr->length = e - a;
      idx[r + 1] = nf;
    }
    for (int r = r1 + 1; r < p->world; r++) idx[r + 1] = nf;
  }
  return SG_OK;
}

static void sg__plan_hash(sg__plan *p, const sg__plan_input *in, size_t elem_bytes,
                          size_t bucket_bytes, uint64_t cfg_hash) {
  uint64_t h = SG__HASH_INIT;
  h = sg__hash_u64(h, (uint64_t)p->world);
  h = sg__hash_u64(h, (uint64_t)elem_bytes);
  h = sg__hash_u64(h, (uint64_t)bucket_bytes);
  h = sg__hash_u64(h, cfg_hash);
  if (p->align != SG_PLAN_ALIGN) h = sg__hash_u64(h, (uint64_t)p->align); /* default: as before */
  h = sg__hash_u64(h, (uint64_t)p->nparams);
  for (int id = 0; id < p->nparams; id++) {
    p->param_hash[id] = sg__hash_param(SG__HASH_INIT, &in[id]);
    h = sg__hash_param(h, &in[id]);
  }
  p->hash = h;
}

sg_status sg__plan_build(const sg__plan_input *params, int nparams, int world, size_t elem_bytes,
                         size_t bucket_bytes, uint64_t cfg_hash, sg__plan **out) {
  return sg__plan_build_aligned(params, nparams, world, elem_bytes, bucket_bytes, cfg_hash,
                                SG_PLAN_ALIGN, out);
}

static int sg__plan_align_ok(size_t align) {
  if (align < SG_PLAN_ALIGN || align > ((size_t)1 << 20) || align % SG_PLAN_ALIGN) return 0;
  return ((align / SG_PLAN_ALIGN) & (align / SG_PLAN_ALIGN - 1)) == 0;
}

sg_status sg__plan_build_aligned(const sg__plan_input *params, int nparams, int world,
                                 size_t elem_bytes, size_t bucket_bytes, uint64_t cfg_hash,
                                 size_t align, sg__plan **out) {
  if (out) *out = NULL; /* a failed build never leaves a stale pointer behind */
  sg_status st = sg__plan_check_args(params, nparams, world, elem_bytes, bucket_bytes, out);
  if (st != SG_OK) return st;
  if (!sg__plan_align_ok(align))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "sg__plan_build: align must be %d times a power of two up to 2^20 (got %zu)",
                   SG_PLAN_ALIGN, align);
  sg__plan *p = calloc(1, sizeof *p);
  if (!p) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__plan_build: cannot allocate the plan");
  p->world = world;
  p->align = align;
  p->nparams = nparams;
  p->bucket_elems = bucket_bytes / elem_bytes;
  SG_TRY_GOTO(sg__plan_alloc(p, nparams, world), st, fail);
  SG_TRY_GOTO(sg__plan_layout(p, params), st, fail);
  SG_TRY_GOTO(sg__plan_fragments(p), st, fail);
  sg__plan_hash(p, params, elem_bytes, bucket_bytes, cfg_hash);
  sg__bucket *shrunk = realloc(p->buckets, (size_t)p->nbuckets * sizeof *shrunk);
  if (shrunk) p->buckets = shrunk; /* keeping the larger block is fine if realloc fails */
  *out = p;
  return SG_OK;
fail:
  sg__plan_free(p);
  return st;
}

void sg__plan_free(sg__plan *p) {
  if (!p) return;
  free(p->params);
  free(p->order);
  free(p->buckets);
  free(p->frag_index);
  free(p->frags);
  free(p->param_hash);
  free(p);
}
