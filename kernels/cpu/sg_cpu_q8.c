/* AdamW over 8-bit blockwise state (cfg.optim_state_dtype SG_Q8, kernels/sg_elem.h): per block,
 * m and v decoded, the AdamW element of sg_elem.h, and m and v coded again, in one pass over
 * the block's memory (its new fp32 moments wait in a tile of 2 KiB, in L1, while the block's
 * maxima are found). The reference that the CUDA kernel (kernels/cuda) matches bit for bit.
 * Blocks are independent: any thread count, any schedule, the same bits. */
#include <stddef.h>
#include <stdint.h>
#include <string.h> /* memcpy: fp32 blocks */

#include "../sg_adamw_args.h" /* AdamW's states and element constants */
#include "../sg_elem.h"       /* the element math and the 8-bit codes */
#include "sg_cpu_kernels.h"   /* sg__cpu_adamw_q8, sg__cpu_threads */

_Static_assert(SG__Q8_BLOCK == SG_ELEM_Q8_BLOCK, "one block size for the kernels and the layout");

/* As in sg_cpu_kernels.c: OpenMP only outside TSan (it does not see libgomp's
 * synchronisation), the hot loop compiled per ISA where the loader can pick (not in sanitizer
 * builds, whose runtimes are not ready when an ifunc resolver runs). */
#if defined(__SANITIZE_THREAD__)
#define SG_Q8_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SG_Q8_TSAN 1
#endif
#endif
#if defined(_OPENMP) && !defined(SG_Q8_TSAN)
#define SG_Q8_OMP 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__gnu_linux__) && \
    !defined(SG_Q8_TSAN) && !defined(__SANITIZE_ADDRESS__)
#define SG_Q8_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SG_Q8_HOT
#endif
#if defined(__GNUC__)
#define SG_Q8_INLINE static inline __attribute__((always_inline))
#else
#define SG_Q8_INLINE static inline
#endif
#define SG_Q8_PAR_MIN ((size_t)65536) /* elements: below, one thread (a region costs microseconds) */

enum { M = SG__ADAMW_M, V = SG__ADAMW_V, B = SG__Q8_BLOCK };

typedef struct q8_ctx {
  sg_elem_adamw_k k;
  float grad_scale;
  uint64_t seed, step, q8_key;
} q8_ctx;

/* The working value p rounded into the parameter buffer (stochastically for bf16 with sr). */
SG_Q8_INLINE void store_param(void *param, int pdt, int sr, size_t i, float p, const q8_ctx *c,
                              uint64_t idx) {
  if (pdt == 1 && sr)
    ((uint16_t *)param)[i] = sg_elem_f32_to_bf16_sr(p, sg_elem_hash64(c->seed, c->step, idx));
  else
    sg_elem_store(param, pdt, i, p);
}

/* The bf16 working copy (round to nearest even) of a block's master values, which are in L1:
 * the rounding of every value, and sg_elem_f32_to_bf16's NaN select replaced by one test for
 * the whole block (the maximum of the bits), the block done again by sg_elem_f32_to_bf16
 * where it holds a NaN. The same bits in 11 vector operations per 32 elements instead of 22:
 * GCC narrows, widens and narrows again around the select, shuffles on the one port that has
 * them. */
SG_Q8_INLINE void bf16_block(uint16_t *restrict d, const float *restrict x, size_t n) {
  uint32_t hi = 0;
  for (size_t i = 0; i < n; i++) {
    const uint32_t u = sg_elem_f2u(x[i]), a = u & 0x7fffffffu;
    d[i] = (uint16_t)sg_elem_bf16_round_bits(u);
    hi = a > hi ? a : hi;
  }
  if (hi > 0x7f800000u)
    for (size_t i = 0; i < n; i++) d[i] = sg_elem_f32_to_bf16(x[i]);
}

/* The working copy of a block: by the CPU's conversion where it gives bf16_block's bits (a
 * block without subnormals, on a CPU that has AVX512-BF16), by bf16_block otherwise. */
SG_Q8_INLINE void cast_block(uint16_t *restrict d, const float *restrict x, size_t n) {
  if (!sg__cpu_bf16_block_hw(d, x, n)) bf16_block(d, x, n);
}

/* The random bits of a block's codes (sg_elem_q8_rnd), for the element counters x + i of a
 * block whose first counter's low 32 bits x are a multiple of 256 (every block the planner
 * cuts: sg_state_q8.c) and the key's low half k (the counter's high half folded in). Then
 * x + i = x | i, the first round's shift, (x ^ k) >> 16, is the same for the whole block, and
 * its product is ((K & ~255) + ((K ^ i) & 255)) * MUL1 with K = x ^ k ^ ((x ^ k) >> 16): a
 * constant plus tab[i] = (i ^ (K & 255)) * MUL1, a table that only the low byte of K
 * selects, the same for the 256 blocks of every 65536 counters. The bits stay
 * sg_elem_mix32's: base + tab[i] is its first round, sg_elem_mix32_tail the rest. */
typedef struct q8_rnd_tab {
  _Alignas(64) uint32_t tab[B]; /* whole cache lines: the loop's vector loads never split */
  uint32_t low;                  /* K & 255 of the table; 256: none yet */
} q8_rnd_tab;

static uint32_t rnd_base(q8_rnd_tab *t, uint32_t x, uint32_t k) {
  uint32_t kk = x ^ k;
  kk ^= kk >> 16;
  if (t->low != (kk & 255u)) {
    t->low = kk & 255u;
    for (uint32_t i = 0; i < B; i++) t->tab[i] = (i ^ t->low) * SG_ELEM_MIX32_MUL1;
  }
  return (kk & ~255u) * SG_ELEM_MIX32_MUL1;
}

/* Any other first counter (the tests' blocks): the first round of every element into tab. */
static void rnd_any(uint32_t *restrict tab, uint32_t x, uint32_t k, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    uint32_t y = (x + i) ^ k;
    tab[i] = (y ^ (y >> 16)) * SG_ELEM_MIX32_MUL1;
  }
}

/* The codes of a block's new moments into qm, qv (32-bit lanes), the random bits of element
 * i sg_elem_mix32_tail(b + t[i]), split between the two codes. all_normal constant: the loop
 * without the subnormal path where no value needs it. */
SG_Q8_INLINE void code_tile(const float *restrict tm, const float *restrict ts, float rm,
                            float rv, const uint32_t *restrict t, uint32_t b, uint32_t n,
                            uint32_t *restrict qm, uint32_t *restrict qv, const int all_normal) {
  for (uint32_t i = 0; i < n; i++) {
    const uint32_t r = sg_elem_mix32_tail(b + t[i]);
    qm[i] = sg_elem_q8_code_m(tm[i], rm, sg_elem_q8_rnd_m(r), all_normal);
    qv[i] = sg_elem_q8_code_v(ts[i], rv, sg_elem_q8_rnd_v(r), all_normal);
  }
}

/* The exact maxima and minima of the bits (sg_elem_q8_max_bits, NaN as 0) of a tile that
 * holds a NaN or a negative square root: the update loop's plain ones see these as large. */
static void tile_bits(const float *t, size_t n, uint32_t *hi, uint32_t *lo) {
  uint32_t h = 0, l = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    const uint32_t x = sg_elem_q8_max_bits(t[i]);
    h = x > h ? x : h;
    l = x < l ? x : l;
  }
  *hi = h, *lo = l;
}

/* 1 when every code of a block's m and v has an exponent e >= 1 (SG_ELEM_Q8_M_EXP): then they
 * decode without the subnormal path. A minimum over bytes: a few operations per 64 codes. */
SG_Q8_INLINE int codes_normal(const uint8_t *restrict cm, const uint8_t *restrict cv, size_t n) {
  uint8_t lm = 0xff, lv = 0xff;
  for (size_t i = 0; i < n; i++) {
    const uint8_t em = cm[i] & SG_ELEM_Q8_M_EXP, ev = cv[i] & SG_ELEM_Q8_V_EXP;
    lm = em < lm ? em : lm;
    lv = ev < lv ? ev : lv;
  }
  return lm != 0 && lv != 0;
}

/* The update loop of a coded block: the new moments into the tiles tm (m) and ts (sqrt(v)),
 * the maxima and minima of their bits into *bm, *bv, *lm, *lv. codes_normal (a constant): the
 * decode without its subnormal path (m's in sg_elem_q8_value_m_normal's three operations), for
 * a block where codes_normal holds and m's unit scales exactly. */
SG_Q8_INLINE void update_tile(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                              const sg_elem_adamw_k k, const float um, const float uv,
                              float *restrict tm, float *restrict ts, uint32_t *bm_,
                              uint32_t *bv_, uint32_t *lm_, uint32_t *lv_, const int pdt,
                              const int gdt, const int has_master, const int sr,
                              const int cast_after, const int codes_normal) {
  const size_t so = s->shard_off, fo = s->flat_off, n = s->len;
  const uint8_t *restrict cm = a->q8_code[M] + so;
  const uint8_t *restrict cv = a->q8_code[V] + so;
  float *restrict mst = a->master;
  uint32_t bm = *bm_, bv = *bv_, lm = *lm_, lv = *lv_;
  const float um17 = um * 0x1p-17f; /* exact where codes_normal is 1 */
  for (size_t i = 0; i < n; i++) {
    const float g = sg_elem_load(a->grad, gdt, so + i) * c->grad_scale;
    float p = has_master ? mst[so + i] : sg_elem_load(a->param, pdt, fo + i);
    float m = codes_normal ? sg_elem_q8_value_m_normal((int8_t)cm[i], um17)
                           : sg_elem_q8_value_m(cm[i], um, 0);
    float v = sg_elem_q8_value_v(cv[i], uv, codes_normal);
    p = sg_elem_adamw_q8(p, g, &m, &v, &ts[i], k);
    if (has_master) mst[so + i] = p;
    if (!cast_after) store_param(a->param, pdt, sr, fo + i, p, c, s->sr_index + i);
    tm[i] = m;
    /* |m|'s bits and sqrt(v)'s (>= +0 unless NaN): a NaN, or a sign, makes a maximum above
     * infinity's bits, and the tile's exact ones are found again below */
    const uint32_t xm = sg_elem_f2u(tm[i]) & 0x7fffffffu, xv = sg_elem_f2u(ts[i]);
    bm = xm > bm ? xm : bm;
    bv = xv > bv ? xv : bv;
    lm = xm < lm ? xm : lm;
    lv = xv < lv ? xv : lv;
  }
  *bm_ = bm, *bv_ = bv, *lm_ = lm, *lv_ = lv;
}

/* One coded block: segment s (inside block j, from its start). cast_after (with a master and
 * bf16 parameters): the update loop stores the master only, bf16_block the working copy after
 * it. Inlined with constant dtypes,
 * so that every dtype test folds away, and with lerp 1 (1 - beta1 < 0.5, as for every usual
 * beta1) the lerp's other form left out. Two loops, each vectorizable: the update (the new
 * moments into the tile and the maxima and minima of their bits), the codes (in 32-bit lanes,
 * then stored as bytes: a loop that narrows as it computes packs and unpacks 16-bit halves,
 * which cost more than the arithmetic they carry). Profiled (docs/optim-state-8bit.md, Speed):
 * bound by the vector ALU ports, so every operation per element that gives the same bits
 * another way was taken out (the hash's first round from a table, the NaN test of the maxima
 * moved out of the loop). */
SG_Q8_INLINE void coded_block(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                              q8_rnd_tab *rt, const int pdt, const int gdt, const int has_master,
                              const int sr, const int lerp, const int cast_after) {
  const size_t so = s->shard_off, fo = s->flat_off, n = s->len, j = so / B;
  uint8_t *restrict cm = a->q8_code[M] + so;
  uint8_t *restrict cv = a->q8_code[V] + so;
  float *restrict mst = a->master;
  const float um = sg_elem_q8_unit(a->q8_scale[M][j], SG_ELEM_Q8_M_BITS);
  const float uv = sg_elem_q8_unit(a->q8_scale[V][j], SG_ELEM_Q8_V_BITS);
  sg_elem_adamw_k k = c->k;
  if (lerp) k.lerp_small = 0xffffffffu; /* a constant: the select folds away */
  float tm[B], ts[B];
  uint32_t bm = 0, bv = 0, lm = 0xffffffffu, lv = 0xffffffffu; /* maxima, minima of the bits */
  if (codes_normal(cm, cv, n) && sg_elem_q8_unit17_exact(um)) /* the usual block */
    update_tile(a, s, c, k, um, uv, tm, ts, &bm, &bv, &lm, &lv, pdt, gdt, has_master, sr,
                cast_after, 1);
  else
    update_tile(a, s, c, k, um, uv, tm, ts, &bm, &bv, &lm, &lv, pdt, gdt, has_master, sr,
                cast_after, 0);
  if (cast_after) cast_block((uint16_t *)a->param + fo, mst + so, n);
  if (bm > 0x7f800000u) tile_bits(tm, n, &bm, &lm);
  if (bv > 0x7f800000u) tile_bits(ts, n, &bv, &lv);
  const float am = sg_elem_u2f(bm), av = sg_elem_u2f(bv);
  const float rm = sg_elem_q8_ratio(am, SG_ELEM_Q8_M_BITS);
  const float rv = sg_elem_q8_ratio(av, SG_ELEM_Q8_V_BITS);
  /* sg_elem_q8_rnd(key, sr_index + i) in 32-bit lanes: a block starts at a multiple of 256
   * of its tensor's counter, so the counter's high half is the same for the whole block and
   * its low half does not wrap (rnd_base); other first counters (rnd_any) are not split */
  const uint64_t idx = s->sr_index;
  const uint32_t lo = (uint32_t)idx, hi = (uint32_t)(idx >> 32) * 0x9e3779b9u;
  const uint32_t key = hi ^ (uint32_t)c->q8_key;
  uint32_t any[B], base = 0;
  const uint32_t *t = any;
  if ((lo & 255u) == 0) { /* every block of the planner's */
    base = rnd_base(rt, lo, key);
    t = rt->tab;
  } else {
    rnd_any(any, lo, key, (uint32_t)n);
  }
  uint32_t qm[B], qv[B];
  if (sg_elem_q8_all_normal(sg_elem_u2f(lm), rm) && sg_elem_q8_all_normal(sg_elem_u2f(lv), rv))
    code_tile(tm, ts, rm, rv, t, base, (uint32_t)n, qm, qv, 1); /* the usual block */
  else
    code_tile(tm, ts, rm, rv, t, base, (uint32_t)n, qm, qv, 0);
  for (size_t i = 0; i < n; i++) {
    cm[i] = (uint8_t)qm[i];
    cv[i] = (uint8_t)qv[i];
  }
  a->q8_scale[M][j] = am;
  a->q8_scale[V][j] = av;
}

/* A block of a tensor below optim_state_min_numel: fp32 state, the plain AdamW element. */
static void f32_block(const sg__update_args *a, const sg__seg *s, const q8_ctx *c, size_t at) {
  const size_t so = s->shard_off, fo = s->flat_off;
  float *m = a->state[M] + at, *v = a->state[V] + at;
  const int sr = a->stochastic_rounding && a->param_dtype == 1;
  for (size_t i = 0; i < s->len; i++) {
    const float g = sg_elem_load(a->grad, a->grad_dtype, so + i) * c->grad_scale;
    float p = a->master ? a->master[so + i] : sg_elem_load(a->param, a->param_dtype, fo + i);
    p = sg_elem_adamw(p, g, &m[i], &v[i], c->k);
    if (a->master) a->master[so + i] = p;
    store_param(a->param, a->param_dtype, sr, fo + i, p, c, s->sr_index + i);
  }
}

/* The specialised loop of a coded block for the common dtypes and 1 - beta1 < 0.5; the
 * general one otherwise. */
SG_Q8_HOT static void q8_block(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                               q8_rnd_tab *rt) {
  const size_t j = s->shard_off / B;
  if (a->q8_f32[j] != SG__Q8_CODED) {
    f32_block(a, s, c, (size_t)a->q8_f32[j] * B);
    return;
  }
  const int sr = a->stochastic_rounding && a->param_dtype == 1;
  const int key = c->k.lerp_small
                      ? a->param_dtype * 100 + a->grad_dtype * 10 + (a->master != NULL) * 2 + sr
                      : -1;
  switch (key) {
    case 0: coded_block(a, s, c, rt, 0, 0, 0, 0, 1, 0); break;    /* f32 params and grads */
    case 10: coded_block(a, s, c, rt, 0, 1, 0, 0, 1, 0); break;   /* f32 params, bf16 grads */
    case 102: coded_block(a, s, c, rt, 1, 0, 1, 0, 1, 0); break;  /* coded_bf16's (see there) */
    case 103: coded_block(a, s, c, rt, 1, 0, 1, 1, 1, 0); break;
    case 112: coded_block(a, s, c, rt, 1, 1, 1, 0, 1, 0); break;
    case 202: coded_block(a, s, c, rt, 2, 0, 1, 0, 1, 0); break;
    default:
      coded_block(a, s, c, rt, a->param_dtype, a->grad_dtype, a->master != NULL, sr, 0, 0);
  }
}

/* bf16 parameters with an fp32 master, f32 gradients, no stochastic rounding, 1 - beta1 < 0.5:
 * the working copy rounded after the block's update (cast_after), in a function of its own.
 * The update loop holds more vectors than there are registers, and the allocator's spills in
 * q8_block's f32 loop move with any change to q8_block's other cases: each of the variants
 * that changed q8_block itself made the f32 step 5-8% slower at 16 Mi parameters
 * (docs/optim-state-8bit.md, Speed). So q8_block's code is as it was, its case 102 no longer
 * reached. */
SG_Q8_HOT static void coded_bf16(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                                 q8_rnd_tab *rt) {
  coded_block(a, s, c, rt, 1, 0, 1, 0, 1, 1);
}

/* One segment: coded_bf16 where it applies, q8_block otherwise. */
static void q8_segment(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                       q8_rnd_tab *rt) {
  if (a->param_dtype == 1 && a->grad_dtype == 0 && a->master && !a->stochastic_rounding &&
      c->k.lerp_small && a->q8_f32[s->shard_off / B] == SG__Q8_CODED)
    coded_bf16(a, s, c, rt);
  else
    q8_block(a, s, c, rt);
}

static q8_ctx ctx_of(const sg__update_args *a, int g, int decay) {
  q8_ctx c;
  c.k = sg__adamw_consts(a, g, decay);
  c.grad_scale = a->outcome ? a->outcome->factor : a->grad_scale;
  c.seed = a->seed;
  c.step = a->step;
  c.q8_key = sg_elem_q8_key(a->seed, a->step);
  return c;
}

void sg__cpu_adamw_q8(const sg__update_args *a) {
  if (!a || !a->segs || a->nsegs <= 0 || !a->param || !a->grad || !a->q8_f32) return;
  if (!a->q8_code[M] || !a->q8_code[V] || !a->q8_scale[M] || !a->q8_scale[V]) return;
  if (!a->state[M] || !a->state[V] || !sg__update_groups_ok(a)) return;
  if (a->outcome && a->outcome->skip) return; /* the step's outcome: skipped */
  for (int s = 0; s < a->nsegs; s++) /* every segment inside one block, from its start */
    if (a->segs[s].shard_off % B != 0 || a->segs[s].len > B) return;
  const int ng = a->ngroups > 1 ? a->ngroups : 1;
  q8_ctx cs[2 * SG_MAX_GROUPS];
  for (int g = 0; g < ng; g++) {
    cs[2 * g] = ctx_of(a, g, 1);
    cs[2 * g + 1] = ctx_of(a, g, 0);
  }
  const long ns = a->nsegs;
#ifdef SG_Q8_OMP
  const int nt = (size_t)ns * B >= SG_Q8_PAR_MIN ? sg__cpu_threads() : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
#endif
  {
    q8_rnd_tab rt; /* each thread's table of the random bits' first round */
    rt.low = 256u;
#ifdef SG_Q8_OMP
#pragma omp for schedule(dynamic, 64)
#endif
    for (long s = 0; s < ns; s++) {
      const sg__seg *sg = &a->segs[s];
      q8_segment(a, sg, &cs[2 * sg__update_group_of(a, sg) + (sg->decay ? 0 : 1)], &rt);
    }
  }
}

void sg__cpu_q8_decode(float *dst, const uint8_t *code, const float *scale, const float *pool,
                       const uint32_t *map, size_t nblocks, int is_m) {
  for (size_t j = 0; j < nblocks; j++) {
    float *d = dst + j * B;
    if (map[j] != SG__Q8_CODED) {
      memcpy(d, pool + (size_t)map[j] * B, B * sizeof *d);
      continue;
    }
    const uint8_t *c = code + j * B;
    const float u = sg_elem_q8_unit(scale[j], is_m ? SG_ELEM_Q8_M_BITS : SG_ELEM_Q8_V_BITS);
    for (size_t i = 0; i < B; i++)
      d[i] = is_m ? sg_elem_q8_decode_m(c[i], u) : sg_elem_q8_decode_v(c[i], u);
  }
}

float sg__cpu_q8_value(uint8_t code, float scale, int is_m) {
  return is_m ? sg_elem_q8_decode_m(code, sg_elem_q8_unit(scale, SG_ELEM_Q8_M_BITS))
              : sg_elem_q8_decode_v(code, sg_elem_q8_unit(scale, SG_ELEM_Q8_V_BITS));
}

void sg__cpu_q8_encode(const float *x, size_t n, int is_m, uint64_t key, uint64_t sr_index,
                       uint8_t *code, float *scale) {
  float t[B];
  uint32_t bits = 0;
  for (size_t i = 0; i < n && i < B; i++) {
    t[i] = is_m ? x[i] : sqrtf(x[i]);
    const uint32_t b = sg_elem_q8_max_bits(t[i]);
    bits = b > bits ? b : bits;
  }
  const float amax = sg_elem_u2f(bits);
  const float r = sg_elem_q8_ratio(amax, is_m ? SG_ELEM_Q8_M_BITS : SG_ELEM_Q8_V_BITS);
  for (size_t i = 0; i < n && i < B; i++) {
    const uint32_t rnd = sg_elem_q8_rnd(key, sr_index + i);
    const uint32_t q = is_m ? sg_elem_q8_encode_m(t[i], r, sg_elem_q8_rnd_m(rnd))
                            : sg_elem_q8_encode_v(t[i], r, sg_elem_q8_rnd_v(rnd));
    code[i] = (uint8_t)q;
  }
  *scale = amax;
}
