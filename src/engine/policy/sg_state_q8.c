/* 8-bit optimizer state (cfg.optim_state_dtype SG_Q8, DESIGN.md section 10): the device
 * placement (accumulator and master in the arenas, the device's kernels) with the optimizer's
 * state arrays in blocks of SG__Q8_BLOCK state elements, one byte per element and an fp32
 * scale per block (kernels/sg_elem.h), made in the OPTIM arena by the layout. Blocks begin at
 * every tensor's first element and never straddle two tensors or two ranks: the planner aligns
 * parameter starts and slices to them (`align`), so an element's state has the same bits at
 * any world size. Tensors below cfg.optim_state_min_numel elements keep fp32 blocks (a pool,
 * mapped per block). The update is the optimizer's q8 variant (sg__optim_desc.q8) over this
 * placement's own segments: the engine's, cut at every block boundary. With optimizer
 * offload (sg_state_host_q8.c) the same arrays are pinned host memory this file allocates
 * (sg__state_q8_make_host) and the CPU updates them; every reader below goes through the
 * device's copies, which take pinned host memory on either side. */
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_q8_decode, sg__cpu_q8_encode */
#include "../../../kernels/sg_elem.h"             /* sg_elem_q8_key */
#include "sg_policy.h"

enum { B = SG__Q8_BLOCK };

/* What the placement keeps besides the arenas (e->q8): its segments, made at the first update
 * (the engine's segments exist only after init), and the arrays in the arenas. */
typedef struct sg__q8 {
  sg__seg *segs; /* the engine's segments cut at block boundaries */
  int nsegs;
  int *first; /* [engine nsegs + 1]: engine segment s is segs[first[s] .. first[s + 1]) */
  uint8_t *code[SG__OPTIM_MAX_STATES];
  float *scale[SG__OPTIM_MAX_STATES];
  float *pool[SG__OPTIM_MAX_STATES];
  uint32_t *map; /* device memory: per block SG__Q8_CODED or its fp32 block in the pool */
  int host;      /* the arrays above are pinned host memory of this file (the host placement) */
  size_t host_bytes; /* host: the pinned bytes held */
} sg__q8;

/* ---- the small-tensor rule, by tensor numel ------------------------------------------------ */

/* The fp32 blocks `rank` holds: the blocks of its owned runs of tensors below the threshold,
 * numbered in state order into map[] (NULL: only counted). */
static size_t f32_blocks(const sg__plan *p, const sg_config *cfg,
                         void (*owned)(const sg__plan *, int, int, sg__owned *), int rank,
                         uint32_t *map) {
  size_t nf = 0;
  for (int b = 0; b < p->nbuckets; b++) {
    const sg__bucket *bk = &p->buckets[b];
    sg__owned o;
    owned(p, rank, b, &o);
    for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
      const sg__plan_param *pp = &p->params[p->order[k]];
      if (pp->numel >= (size_t)cfg->optim_state_min_numel) continue;
      const size_t a = pp->offset > o.flat0 ? pp->offset : o.flat0;
      const size_t z0 = pp->offset + pp->numel, z1 = o.flat0 + o.n, z = z0 < z1 ? z0 : z1;
      if (a >= z) continue;
      const size_t s0 = o.state0 + (a - o.flat0), s1 = o.state0 + (z - o.flat0);
      for (size_t j = s0 / B; j < (s1 + B - 1) / B; j++, nf++)
        if (map) map[j] = (uint32_t)nf;
    }
  }
  return nf;
}

void sg__state_q8_shape(const sg__plan *p, const sg_config *cfg,
                        void (*owned)(const sg__plan *, int, int, sg__owned *),
                        sg__layout_shape *out) {
  size_t most = 1; /* never an empty pool: the update's fp32 arrays are never NULL */
  for (int r = 0; r < p->world; r++) {
    const size_t n = f32_blocks(p, cfg, owned, r, NULL);
    if (n > most) most = n;
  }
  out->q8_blocks = (out->opt_numel + B - 1) / B;
  out->q8_f32_blocks = most;
}

/* ---- lifecycle ----------------------------------------------------------------------------- */

static sg_status make_map(sg_engine *e, sg__q8 *q) {
  const sg__layout *l = &e->lay;
  uint32_t *map = malloc(l->q8_blocks * sizeof *map);
  if (!map) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  for (size_t j = 0; j < l->q8_blocks; j++) map[j] = SG__Q8_CODED;
  const size_t nf = f32_blocks(e->plan, &e->cfg, e->strat->owned, e->rank, map);
  sg_status st = SG_OK;
  if (nf > l->q8_f32_blocks)
    st = sg__err(SG_ERR_INTERNAL, "sg_finalize: %zu fp32 state blocks, %zu laid out", nf,
                 l->q8_f32_blocks);
  if (st == SG_OK)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, q->map, map, l->q8_blocks * sizeof *map,
                           SG_COPY_H2D);
  free(map);
  return st;
}

static sg_status check_layout(const sg_engine *e) {
  const sg__layout *l = &e->lay;
  if (!e->opt.od->q8)
    return sg__err(SG_ERR_UNSUPPORTED, "sg_finalize: optimizer %s has no 8-bit state "
                   "(cfg->optim_state_dtype SG_Q8)", e->opt.od->name);
  if (!l->q8_blocks || l->opt_numel % B)
    return sg__err(SG_ERR_INTERNAL, "sg_finalize: the layout has no 8-bit state blocks");
  return SG_OK;
}

static sg_status q8_init(sg_engine *e) {
  const sg__layout *l = &e->lay;
  SG_TRY(check_layout(e));
  sg__q8 *q = calloc(1, sizeof *q);
  if (!q) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  char *optim = e->ar.base[SG_MEM_OPTIM];
  for (int k = 0; k < l->nstates; k++) {
    q->code[k] = (uint8_t *)(optim + l->q8_code_off[k]);
    q->scale[k] = (float *)(optim + l->q8_scale_off[k]);
    q->pool[k] = (float *)(optim + l->state_off[k]);
  }
  q->map = (uint32_t *)(optim + l->q8_map_off);
  const sg_status st = make_map(e, q);
  if (st != SG_OK) {
    free(q);
    return st;
  }
  e->q8 = q;
  return SG_OK;
}

/* ---- the host placement's arrays ------------------------------------------------------------ */

static sg_status pin(sg_engine *e, sg__q8 *q, size_t bytes, void **out) {
  SG_TRY(e->dev->ops->host_alloc(e->dev, bytes, out));
  memset(*out, 0, bytes);
  q->host_bytes += bytes;
  return SG_OK;
}

static void unpin(sg_engine *e, sg__q8 *q) {
  for (int k = 0; k < SG__OPTIM_MAX_STATES; k++) {
    if (q->code[k]) e->dev->ops->host_free(e->dev, q->code[k]);
    if (q->scale[k]) e->dev->ops->host_free(e->dev, q->scale[k]);
    if (q->pool[k]) e->dev->ops->host_free(e->dev, q->pool[k]);
  }
  if (q->map) e->dev->ops->host_free(e->dev, q->map);
}

/* The arrays the layout counts in host_bytes (sg_layout.c, host_arrays): per state its codes,
 * scales and fp32 blocks, then the map. */
sg_status sg__state_q8_make_host(sg_engine *e, size_t *bytes) {
  const sg__layout *l = &e->lay;
  *bytes = 0;
  SG_TRY(check_layout(e));
  sg__q8 *q = calloc(1, sizeof *q);
  if (!q) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  q->host = 1;
  sg_status st = SG_OK;
  for (int k = 0; k < l->nstates && st == SG_OK; k++) {
    st = pin(e, q, l->opt_numel, (void **)&q->code[k]);
    if (st == SG_OK) st = pin(e, q, l->q8_blocks * sizeof(float), (void **)&q->scale[k]);
    if (st == SG_OK)
      st = pin(e, q, l->q8_f32_blocks * B * sizeof(float), (void **)&q->pool[k]);
  }
  if (st == SG_OK) st = pin(e, q, l->q8_blocks * sizeof(uint32_t), (void **)&q->map);
  if (st == SG_OK) st = make_map(e, q);
  if (st != SG_OK) {
    unpin(e, q);
    free(q);
    return st;
  }
  e->q8 = q;
  *bytes = q->host_bytes;
  return SG_OK;
}

void sg__state_q8_free(sg_engine *e) {
  if (!e->q8) return;
  if (e->q8->host) unpin(e, e->q8);
  free(e->q8->segs);
  free(e->q8->first);
  free(e->q8);
  e->q8 = NULL;
}

/* The master and the accumulator are the device placement's; the state arrays are not fp32
 * arrays of the shard (read_state decodes them). */
static void *q8_array(sg_engine *e, int which) {
  return which == 0 || which == SG__STATE_ACCUM ? sg__state_device.array(e, which) : NULL;
}

/* ---- the device placement's for the accumulator and the norm ------------------------------- */

static sg_status q8_prepare(sg_engine *e, int b) { return sg__state_device.prepare(e, b); }
static void q8_submitted(sg_engine *e, int b, uint64_t t) { sg__state_device.submitted(e, b, t); }
static sg_status q8_wait_reductions(sg_engine *e, int64_t deadline_ms) {
  return sg__state_device.wait_reductions(e, deadline_ms);
}
static sg_status q8_settle(sg_engine *e) { return sg__state_device.settle(e); }
static sg_status q8_sumsq(sg_engine *e, double out[2]) { return sg__state_device.sumsq(e, out); }
static sg_status q8_partials(sg_engine *e, double *dev) {
  return sg__state_device.partials(e, dev);
}
static sg_status q8_clear(sg_engine *e) { return sg__state_device.clear(e); }
static sg_status q8_master_from_working(sg_engine *e) {
  return sg__state_device.master_from_working(e);
}

/* ---- the update ---------------------------------------------------------------------------- */

static sg_status push(sg__q8 *q, int *cap, sg__seg s) {
  if (q->nsegs == *cap) {
    const int nc = *cap ? *cap * 2 : 256;
    sg__seg *n = realloc(q->segs, (size_t)nc * sizeof *n);
    if (!n) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_step: out of host memory");
    q->segs = n;
    *cap = nc;
  }
  q->segs[q->nsegs++] = s;
  return SG_OK;
}

/* The parameter holding flat element `flat` (by the plan's offsets; ids sorted by offset). */
static int param_at(const sg__plan *p, const int *by_off, size_t flat) {
  int lo = 0, hi = p->nparams - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p->params[by_off[mid]].offset <= flat)
      lo = mid;
    else
      hi = mid - 1;
  }
  return by_off[lo];
}

/* Engine segment g cut at every block boundary of the state; every piece must begin a block
 * (the planner's alignment), or the layout is not the one the codes assume. Each piece lies in
 * one tensor and takes that tensor's element counter (sg__seg.sr_index), which also draws the
 * codes' random bits: the engine's merged segments count from their first tensor, which
 * depends on the layout. */
static sg_status cut(const sg__plan *p, const int *by_off, sg__q8 *q, int *cap, const sg__seg *g) {
  for (size_t at = 0; at < g->len;) {
    const size_t so = g->shard_off + at, end = (so / B + 1) * B;
    const size_t n = g->len - at < end - so ? g->len - at : end - so;
    if (so % B)
      return sg__err(SG_ERR_INTERNAL, "sg_step: a segment at state index %zu is not aligned to "
                     "the 8-bit state's blocks", so);
    sg__seg s = *g;
    s.shard_off = so;
    s.flat_off = g->flat_off + at;
    const int id = param_at(p, by_off, s.flat_off);
    s.sr_index = ((uint64_t)id << 40) + (s.flat_off - p->params[id].offset);
    s.len = n;
    SG_TRY(push(q, cap, s));
    at += n;
  }
  return SG_OK;
}

/* Plan order is reverse registration order and offsets grow along it. */
static int *ids_by_offset(const sg__plan *p) {
  int *ids = malloc((size_t)p->nparams * sizeof *ids);
  for (int k = 0; ids && k < p->nparams; k++) ids[k] = p->order[k];
  return ids;
}

static sg_status make_segs(sg_engine *e, sg__q8 *q) {
  const sg__optim *o = &e->opt;
  int *by_off = ids_by_offset(e->plan);
  q->first = malloc(((size_t)o->nsegs + 1) * sizeof *q->first);
  sg_status st = by_off && q->first ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "sg_step: out of host memory");
  int cap = 0;
  for (int s = 0; st == SG_OK && s < o->nsegs; s++) {
    q->first[s] = q->nsegs;
    st = cut(e->plan, by_off, q, &cap, &o->segs[s]);
  }
  free(by_off);
  if (st != SG_OK) {
    free(q->first);
    free(q->segs);
    q->first = NULL, q->segs = NULL, q->nsegs = 0;
    return st;
  }
  q->first[o->nsegs] = q->nsegs;
  return SG_OK;
}

sg_status sg__state_q8_args(sg_engine *e, const sg__update_args *a, sg__update_args *out) {
  sg__q8 *q = e->q8;
  if (!q->first) SG_TRY(make_segs(e, q));
  sg__update_args b = *a;
  const int s0 = a->nsegs > 0 ? (int)(a->segs - e->opt.segs) : 0;
  b.segs = a->nsegs > 0 ? q->segs + q->first[s0] : NULL;
  b.nsegs = a->nsegs > 0 ? q->first[s0 + a->nsegs] - q->first[s0] : 0;
  for (int k = 0; k < e->lay.nstates; k++) {
    b.state[k] = q->pool[k];
    b.q8_code[k] = q->code[k];
    b.q8_scale[k] = q->scale[k];
  }
  b.q8_f32 = q->map;
  *out = b;
  return SG_OK;
}

static sg_status q8_update(sg_engine *e, const sg__update_args *a) {
  sg__update_args b;
  SG_TRY(sg__state_q8_args(e, a, &b));
  return e->dev->ops->update(e->dev, SG_Q_COMPUTE, e->opt.od->q8, &b);
}

/* ---- readers ------------------------------------------------------------------------------- */

/* Device memory of `bytes` copied into new host memory. */
static sg_status to_host(sg_engine *e, const void *dev, size_t bytes, void **out) {
  *out = malloc(bytes ? bytes : 1);
  if (!*out) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (%zu bytes)", bytes);
  sg_status st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, *out, dev, bytes, SG_COPY_D2H);
  if (st != SG_OK) {
    free(*out);
    *out = NULL;
  }
  return st;
}

/* Blocks [j0, j1) of state k decoded on the host into dst ((j1 - j0) x B floats). */
static sg_status decode_host(sg_engine *e, int k, size_t j0, size_t j1, float *dst) {
  const sg__layout *l = &e->lay;
  const sg__q8 *q = e->q8;
  const size_t nb = j1 - j0;
  void *code = NULL, *scale = NULL, *pool = NULL, *map = NULL;
  sg_status st = to_host(e, q->code[k] + j0 * B, nb * B, &code);
  if (st == SG_OK) st = to_host(e, q->scale[k] + j0, nb * sizeof(float), &scale);
  if (st == SG_OK) st = to_host(e, q->pool[k], l->q8_f32_blocks * B * sizeof(float), &pool);
  if (st == SG_OK) st = to_host(e, q->map + j0, nb * sizeof(uint32_t), &map);
  if (st == SG_OK) sg__cpu_q8_decode(dst, code, scale, pool, map, nb, k == 0);
  free(code), free(scale), free(pool), free(map);
  return st;
}

/* The blocks of this rank's part of parameter id's bucket: what its readers read. */
static void bucket_blocks(const sg_engine *e, int id, size_t *j0, size_t *j1) {
  sg__owned o;
  e->strat->owned(e->plan, e->rank, e->plan->params[id].bucket, &o);
  *j0 = o.state0 / B;
  *j1 = (o.state0 + o.n + B - 1) / B;
}

/* The reader's view of opt_numel floats: device memory, or pinned host memory for the host
 * placement (whose readers read host arrays; a view that large on its GPU would not fit). */
static sg_status view_alloc(sg_engine *e, size_t bytes, void **out) {
  if (e->q8->host) return e->dev->ops->host_alloc(e->dev, bytes, out);
  return e->dev->ops->alloc(e->dev, bytes, out);
}

static void view_free(sg_engine *e, void *p) {
  if (e->q8->host)
    e->dev->ops->host_free(e->dev, p);
  else
    e->dev->ops->free(e->dev, p);
}

static sg_status q8_read_state(sg_engine *e, int k, int id,
                               sg_status (*fn)(sg_engine *e, const float *view, void *ctx),
                               void *ctx) {
  const size_t bytes = e->lay.opt_numel * sizeof(float);
  size_t j0 = 0, j1 = e->lay.q8_blocks;
  if (id >= 0 && id < e->plan->nparams) bucket_blocks(e, id, &j0, &j1);
  const size_t part = (j1 - j0) * B * sizeof(float);
  float *host = malloc(part ? part : 1);
  void *dev = NULL;
  if (!host) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (%zu bytes)", part);
  sg_status st = decode_host(e, k, j0, j1, host);
  if (st == SG_OK) st = view_alloc(e, bytes ? bytes : 1, &dev);
  if (st == SG_OK && part)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, (float *)dev + j0 * B, host, part, SG_COPY_H2D);
  if (st == SG_OK) st = fn(e, dev, ctx);
  if (dev) view_free(e, dev);
  free(host);
  return st;
}

/* ---- checkpoint records (src/ckpt/sg_ckpt.h: class, code, scale or fp32 value) ------------ */

/* The state's arrays in host memory: codes, scales and fp32 blocks of state k, the map. */
typedef struct host_q8 {
  uint8_t *code;
  float *scale, *pool;
  uint32_t *map;
} host_q8;

static void host_free(host_q8 *h) { free(h->code), free(h->scale), free(h->pool), free(h->map); }

static size_t pool_floats(const sg__layout *l) { return l->q8_f32_blocks * B; }

static sg_status host_get(sg_engine *e, int k, host_q8 *h) {
  const sg__layout *l = &e->lay;
  const sg__q8 *q = e->q8;
  memset(h, 0, sizeof *h);
  sg_status st = to_host(e, q->code[k], l->opt_numel, (void **)&h->code);
  if (st == SG_OK) st = to_host(e, q->scale[k], l->q8_blocks * sizeof(float), (void **)&h->scale);
  if (st == SG_OK) st = to_host(e, q->pool[k], pool_floats(l) * sizeof(float), (void **)&h->pool);
  if (st == SG_OK) st = to_host(e, q->map, l->q8_blocks * sizeof(uint32_t), (void **)&h->map);
  if (st != SG_OK) host_free(h);
  return st;
}

void sg__state_rec_put(uint8_t *r, int cls, uint8_t code, float value) {
  uint32_t u;
  memcpy(&u, &value, sizeof u);
  r[0] = (uint8_t)cls;
  r[1] = code;
  for (int i = 0; i < 4; i++) r[2 + i] = (uint8_t)(u >> (8 * i));
}

float sg__state_rec_value(const uint8_t *r) {
  uint32_t u = 0;
  for (int i = 0; i < 4; i++) u |= (uint32_t)r[2 + i] << (8 * i);
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void save_records(const sg__layout *l, const host_q8 *h, uint8_t *rec) {
  for (size_t j = 0; j < l->q8_blocks; j++)
    for (size_t i = 0; i < B; i++) {
      uint8_t *r = rec + (j * B + i) * SG__STATE_RECORD;
      if (h->map[j] == SG__Q8_CODED)
        sg__state_rec_put(r, SG__REC_CODED, h->code[j * B + i], i == 0 ? h->scale[j] : 0.0f);
      else
        sg__state_rec_put(r, SG__REC_F32, 0, h->pool[(size_t)h->map[j] * B + i]);
    }
}

/* Every record present is of the class this engine's block has; a block's first one is there
 * whenever any of its records is (blocks begin tensors' runs). */
static sg_status check_records(const sg__layout *l, const uint32_t *map, const uint8_t *rec) {
  for (size_t j = 0; j < l->q8_blocks; j++) {
    const int want = map[j] == SG__Q8_CODED ? SG__REC_CODED : SG__REC_F32;
    const uint8_t first = rec[j * B * SG__STATE_RECORD];
    for (size_t i = 0; i < B; i++) {
      const uint8_t c = rec[(j * B + i) * SG__STATE_RECORD];
      if (c == SG__REC_PAD) continue;
      if (c != want)
        return sg__err(SG_ERR_MISMATCH, "the checkpoint keeps the optimizer state of state "
                       "index %zu %s, this engine %s (another cfg->optim_state_min_numel)",
                       j * B + i, c == SG__REC_CODED ? "in 8 bits" : "in fp32",
                       want == SG__REC_CODED ? "in 8 bits" : "in fp32");
      if (first != c)
        return sg__err(SG_ERR_CORRUPT, "the checkpoint's 8-bit state of block %zu has no scale", j);
    }
  }
  return SG_OK;
}

static void load_records(const sg__layout *l, const uint8_t *rec, host_q8 *h) {
  memset(h->code, 0, l->opt_numel);
  memset(h->scale, 0, l->q8_blocks * sizeof(float));
  memset(h->pool, 0, pool_floats(l) * sizeof(float));
  for (size_t j = 0; j < l->q8_blocks; j++)
    for (size_t i = 0; i < B; i++) {
      const uint8_t *r = rec + (j * B + i) * SG__STATE_RECORD;
      if (r[0] == SG__REC_PAD) continue;
      if (h->map[j] != SG__Q8_CODED) {
        h->pool[(size_t)h->map[j] * B + i] = sg__state_rec_value(r);
        continue;
      }
      h->code[j * B + i] = r[1];
      if (i == 0) h->scale[j] = sg__state_rec_value(r);
    }
}

/* The counter (sg__seg.sr_index) of every block's first element, as the update's segments
 * take it: the block's tensor and its index there; 0 for a block of padding. */
static sg_status block_counters(sg_engine *e, uint64_t *ctr) {
  const sg__plan *p = e->plan;
  int *by_off = ids_by_offset(p);
  if (!by_off) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_load: out of host memory");
  memset(ctr, 0, e->lay.q8_blocks * sizeof *ctr);
  sg_status st = SG_OK;
  for (int b = 0; b < p->nbuckets && st == SG_OK; b++) {
    sg__owned o;
    e->strat->owned(p, e->rank, b, &o);
    if (o.state0 % B) st = sg__err(SG_ERR_INTERNAL, "sg_load: bucket %d's state is not aligned "
                                   "to the 8-bit state's blocks", b);
    for (size_t at = 0; st == SG_OK && at < o.n; at += B) {
      const size_t flat = o.flat0 + at;
      const int id = param_at(p, by_off, flat);
      const sg__plan_param *pp = &p->params[id];
      if (flat >= pp->offset && flat < pp->offset + pp->numel)
        ctr[(o.state0 + at) / B] = ((uint64_t)id << 40) + (flat - pp->offset);
    }
  }
  free(by_off);
  return st;
}

/* SG__REC_CODE: records of class SG__REC_F32 (an fp32-state checkpoint's values, 0 where it
 * has none) into this state: coded blocks coded as the update codes (sg__cpu_q8_encode, with
 * the random bits of the loaded step), fp32 blocks copied. */
static sg_status code_records(sg_engine *e, int k, const uint8_t *rec, host_q8 *h) {
  const sg__layout *l = &e->lay;
  uint64_t *ctr = malloc(l->q8_blocks * sizeof *ctr);
  if (!ctr) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_load: out of host memory");
  sg_status st = block_counters(e, ctr);
  const uint64_t key = sg_elem_q8_key(e->cfg.seed, e->opt.step);
  memset(h->code, 0, l->opt_numel);
  memset(h->scale, 0, l->q8_blocks * sizeof(float));
  memset(h->pool, 0, pool_floats(l) * sizeof(float));
  for (size_t j = 0; st == SG_OK && j < l->q8_blocks; j++) {
    float x[B];
    for (size_t i = 0; i < B; i++) {
      const uint8_t *r = rec + (j * B + i) * SG__STATE_RECORD;
      x[i] = r[0] == SG__REC_F32 ? sg__state_rec_value(r) : 0.0f;
    }
    if (h->map[j] == SG__Q8_CODED)
      sg__cpu_q8_encode(x, B, k == 0, key, ctr[j], h->code + j * B, &h->scale[j]);
    else
      memcpy(h->pool + (size_t)h->map[j] * B, x, sizeof x);
  }
  free(ctr);
  return st;
}

static sg_status h2d(sg_engine *e, void *dev, const void *host, size_t bytes) {
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dev, host, bytes, SG_COPY_H2D);
}

static sg_status q8_records(sg_engine *e, int k, uint8_t *rec, int mode) {
  const sg__layout *l = &e->lay;
  const sg__q8 *q = e->q8;
  if (k < 0 || k >= l->nstates || !rec)
    return sg__err(SG_ERR_INTERNAL, "8-bit records of state %d", k);
  host_q8 h;
  SG_TRY(host_get(e, k, &h));
  sg_status st = SG_OK;
  if (mode == SG__REC_SAVE) {
    save_records(l, &h, rec);
  } else if (mode == SG__REC_CHECK) {
    st = check_records(l, h.map, rec);
  } else {
    if (mode == SG__REC_CODE)
      st = code_records(e, k, rec, &h);
    else
      load_records(l, rec, &h);
    if (st == SG_OK) st = h2d(e, q->code[k], h.code, l->opt_numel);
    if (st == SG_OK) st = h2d(e, q->scale[k], h.scale, l->q8_blocks * sizeof(float));
    if (st == SG_OK) st = h2d(e, q->pool[k], h.pool, pool_floats(l) * sizeof(float));
  }
  host_free(&h);
  return st;
}

const sg__state_ops sg__state_q8 = {
    .name = "device, 8-bit state", .host = 0, .coded = 1, .align = SG__Q8_BLOCK, .skips = 0,
    .init = q8_init, .free = sg__state_q8_free, .array = q8_array, .prepare = q8_prepare,
    .submitted = q8_submitted, .wait_reductions = q8_wait_reductions, .settle = q8_settle,
    .sumsq = q8_sumsq, .partials = q8_partials, .update = q8_update, .clear = q8_clear,
    .master_from_working = q8_master_from_working, .read_state = q8_read_state,
    .records = q8_records,
};
