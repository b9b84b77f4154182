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

/* The codes of a block's new moments into qm, qv (32-bit lanes; a 32-bit counter: no 64-bit
 * lanes). all_normal constant: the loop without the subnormal path where no value needs it. */
SG_Q8_INLINE void code_tile(const float *restrict tm, const float *restrict ts, float rm,
                            float rv, uint32_t lo, uint32_t k0, uint32_t k1, uint32_t n,
                            uint32_t *restrict qm, uint32_t *restrict qv, const int all_normal) {
  for (uint32_t i = 0; i < n; i++) {
    const uint32_t x = lo + i;
    qm[i] = sg_elem_q8_code_m(tm[i], rm, sg_elem_mix32(x ^ k0), all_normal);
    qv[i] = sg_elem_q8_code_v(ts[i], rv, sg_elem_mix32(x ^ k1), all_normal);
  }
}

/* One coded block: segment s (inside block j, from its start). Inlined with constant dtypes,
 * so that every dtype test folds away. Two loops, each vectorizable: the update (the new
 * moments into the tile and the integer maxima of their bits), the codes (in 32-bit lanes,
 * then stored as bytes: a loop that narrows as it computes packs and unpacks 16-bit halves,
 * which cost more than the arithmetic they carry). Profiled (docs/optim-state-8bit.md, Speed):
 * the coding is about half of the time, bound by the vector ALU ports, its hash a fifth of
 * that; the two divisions and the square root of the AdamW element most of the rest. */
SG_Q8_INLINE void coded_block(const sg__update_args *a, const sg__seg *s, const q8_ctx *c,
                              const int pdt, const int gdt, const int has_master, const int sr) {
  const size_t so = s->shard_off, fo = s->flat_off, n = s->len, j = so / B;
  uint8_t *restrict cm = a->q8_code[M] + so;
  uint8_t *restrict cv = a->q8_code[V] + so;
  float *restrict mst = a->master;
  const float um = sg_elem_q8_unit(a->q8_scale[M][j], SG_ELEM_Q8_M_BITS);
  const float uv = sg_elem_q8_unit(a->q8_scale[V][j], SG_ELEM_Q8_V_BITS);
  float tm[B], ts[B];
  uint32_t bm = 0, bv = 0, lm = 0xffffffffu, lv = 0xffffffffu; /* maxima, minima of the bits */
  for (size_t i = 0; i < n; i++) {
    const float g = sg_elem_load(a->grad, gdt, so + i) * c->grad_scale;
    float p = has_master ? mst[so + i] : sg_elem_load(a->param, pdt, fo + i);
    float m = sg_elem_q8_decode_m(cm[i], um), v = sg_elem_q8_decode_v(cv[i], uv);
    p = sg_elem_adamw(p, g, &m, &v, c->k);
    if (has_master) mst[so + i] = p;
    store_param(a->param, pdt, sr, fo + i, p, c, s->sr_index + i);
    tm[i] = m;
    ts[i] = sqrtf(v);
    const uint32_t xm = sg_elem_q8_max_bits(tm[i]), xv = sg_elem_q8_max_bits(ts[i]);
    bm = xm > bm ? xm : bm;
    bv = xv > bv ? xv : bv;
    lm = xm < lm ? xm : lm;
    lv = xv < lv ? xv : lv;
  }
  const float am = sg_elem_u2f(bm), av = sg_elem_u2f(bv);
  const float rm = sg_elem_q8_ratio(am, SG_ELEM_Q8_M_BITS);
  const float rv = sg_elem_q8_ratio(av, SG_ELEM_Q8_V_BITS);
  /* sg_elem_q8_rnd(key, sr_index + i, k) in 32-bit lanes: a block starts at a multiple of 256
   * of its tensor's counter, so the counter's high half is the same for the whole block and
   * its low half does not wrap */
  const uint64_t idx = s->sr_index;
  const uint32_t lo = (uint32_t)idx, hi = (uint32_t)(idx >> 32) * 0x9e3779b9u;
  const uint32_t k0 = hi ^ (uint32_t)c->q8_key, k1 = hi ^ (uint32_t)(c->q8_key >> 32);
  uint32_t qm[B], qv[B];
  if (sg_elem_q8_all_normal(sg_elem_u2f(lm), rm) && sg_elem_q8_all_normal(sg_elem_u2f(lv), rv))
    code_tile(tm, ts, rm, rv, lo, k0, k1, (uint32_t)n, qm, qv, 1); /* the usual block */
  else
    code_tile(tm, ts, rm, rv, lo, k0, k1, (uint32_t)n, qm, qv, 0);
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

/* The specialised loop of a coded block for the common dtypes; the general one otherwise. */
SG_Q8_HOT static void q8_block(const sg__update_args *a, const sg__seg *s, const q8_ctx *c) {
  const size_t j = s->shard_off / B;
  if (a->q8_f32[j] != SG__Q8_CODED) {
    f32_block(a, s, c, (size_t)a->q8_f32[j] * B);
    return;
  }
  const int sr = a->stochastic_rounding && a->param_dtype == 1;
  const int key = a->param_dtype * 100 + a->grad_dtype * 10 + (a->master != NULL) * 2 + sr;
  switch (key) {
    case 0: coded_block(a, s, c, 0, 0, 0, 0); break;    /* f32 params and grads */
    case 10: coded_block(a, s, c, 0, 1, 0, 0); break;   /* f32 params, bf16 grads */
    case 102: coded_block(a, s, c, 1, 0, 1, 0); break;  /* bf16 params, fp32 master */
    case 103: coded_block(a, s, c, 1, 0, 1, 1); break;
    case 112: coded_block(a, s, c, 1, 1, 1, 0); break;
    case 202: coded_block(a, s, c, 2, 0, 1, 0); break;
    default: coded_block(a, s, c, a->param_dtype, a->grad_dtype, a->master != NULL, sr);
  }
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
#pragma omp parallel for schedule(dynamic, 64) num_threads(nt) if (nt > 1)
#endif
  for (long s = 0; s < ns; s++) {
    const sg__seg *sg = &a->segs[s];
    q8_block(a, sg, &cs[2 * sg__update_group_of(a, sg) + (sg->decay ? 0 : 1)]);
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
    const uint32_t rnd = sg_elem_q8_rnd(key, sr_index + i, is_m ? 0 : 1);
    const uint32_t q = is_m ? sg_elem_q8_encode_m(t[i], r, rnd) : sg_elem_q8_encode_v(t[i], r, rnd);
    code[i] = (uint8_t)q;
  }
  *scale = amax;
}
