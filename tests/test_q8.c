/* 8-bit optimizer state (cfg.optim_state_dtype SG_Q8, issue 27):
 *  - the codes of kernels/sg_elem.h: every code decodes and codes back to itself, decoding is
 *    monotonic, stochastic rounding is unbiased;
 *  - the CPU kernel bit for bit against an independent implementation of the same blockwise
 *    algorithm written here (code search in the decoded table, rounding decided in double);
 *  - engines: state and parameters bit for bit the same at W = 1, 2, 3, 4 (threads; under
 *    mpirun --mpi: W = np against one rank) for every strategy, f32 and bf16 parameters,
 *    clipping and parameter groups, and a hybrid engine (2 nodes x 2 ranks); tensors below
 *    optim_state_min_numel (by their numel, also when a rank's part of a larger tensor is
 *    smaller) bitwise the fp32 engine's, the others coded and close to it; sg_memory =
 *    sg_estimate_memory and the bytes it saves;
 *  - checkpoints: saved at one W, loaded at another, the same bits as an uninterrupted run;
 *    loads across state formats or thresholds refused (SG_ERR_MISMATCH, naming the option);
 *    with sg_load_options.convert_optim_state an fp32-state checkpoint coded on load (the
 *    reference's codes of its m and v, the same at W = 1, 2, 3) and an 8-bit one decoded (the
 *    values sg_get_optim_state gave before the save), training going on bit for bit across W;
 *  - bad configs refused at sg_engine_create with a message naming the field.
 * SG_TEST_DEVICE=cuda (test_q8_cudamock): a subset on the mock CUDA device, and 8-bit state
 * with offload_optimizer (the state and its update on the host) bit for bit the CPU device's
 * 8-bit engine at W = 1, 2 (bf16 with clipping and groups; f32; f16 loss scaling with a
 * NaN-skipped step), checkpoints across W and between the two, a hybrid engine (2 x 2), its
 * host bytes (sg_memory = sg_estimate_memory). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* getpid */

#include "sg_test_check.h"
#include "sg_test_ranks.h"
#include "../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_adamw_q8 */
#include "../kernels/sg_elem.h"

enum { NP = 7, STEPS = 6, MAXW = 4 };
static const size_t numels[NP] = {5000, 300, 6144, 4096, 4095, 70001, 1000};

/* ---- the codes ----------------------------------------------------------------------------- */

/* lowbias32 (the codes' random bits), written out here apart from sg_elem_mix32. */
static uint32_t ref_mix32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x7feb352du;
  x = (x ^ (x >> 15)) * 0x846ca68bu;
  return x ^ (x >> 16);
}

static float ref_decode(int code, int mb) { /* the value by its definition */
  const int e = code >> mb, f = code & ((1 << mb) - 1);
  return e == 0 ? (float)ldexp((double)f, -15 - mb) : (float)ldexp(1.0 + f / (double)(1 << mb), e - 16);
}

static void test_codes(void) {
  for (int kind = 0; kind < 2; kind++) {
    const int mb = kind ? SG_ELEM_Q8_V_BITS : SG_ELEM_Q8_M_BITS, ncode = 1 << (4 + mb);
    int back = 1, mono = 1;
    for (int c = 0; c < ncode; c++) {
      const float x = sg_elem_q8_decode((uint32_t)c, mb);
      for (uint32_t r = 0; r < 4; r++)
        back &= sg_elem_q8_encode(x, r * 0x5555u, mb) == (uint32_t)c;
      if (c > 0) mono &= x > sg_elem_q8_decode((uint32_t)c - 1, mb);
    }
    CHECK(back, "kind %d: every code decodes and codes back to itself, any random bits", kind);
    int defined = 1; /* the format: each code's value by its definition (ref_decode) */
    for (int c = 0; c < ncode; c++) defined &= sg_elem_q8_decode((uint32_t)c, mb) == ref_decode(c, mb);
    CHECK(defined, "kind %d: every code decodes to the value its definition gives", kind);
    CHECK(mono, "kind %d: decoded values increase with the code", kind);
    CHECK(sg_elem_q8_decode((uint32_t)ncode - 1, mb) == sg_elem_q8_top(mb),
          "kind %d: the largest code is top", kind);
    /* stochastic rounding: the mean of the decoded values is the value */
    const float xs[3] = {0.3f, 0.0123f, 1.7e-6f};
    for (int t = 0; t < 3; t++) {
      double sum = 0;
      const int n = 20000;
      for (int i = 0; i < n; i++)
        sum += sg_elem_q8_decode(sg_elem_q8_encode(xs[t], sg_elem_hash64(7, 1, (uint64_t)i) & 0xffffu, mb), mb);
      const double lo = sg_elem_q8_decode(sg_elem_q8_encode(xs[t], 0, mb), mb);
      const double step = sg_elem_q8_decode(sg_elem_q8_encode(xs[t], 0, mb) + 1, mb) - lo;
      CHECK(fabs(sum / n - xs[t]) < 0.03 * step, "kind %d: mean of x=%g coded stochastically is "
            "%g (step %g)", kind, xs[t], sum / n, step);
    }
  }
  CHECK(sg_elem_q8_encode(NAN, 0, 4) == 255 && sg_elem_q8_encode(INFINITY, 0, 3) == 127,
        "non-finite values take the largest code");
  /* the CPU loop's decode of m for codes with e >= 1: decode_m's bits wherever the unit
   * scales exactly (sg_elem_q8_unit17_exact), results subnormal or near the largest float too */
  const float units[] = {0.0f, 0x1p-100f, 0x1.8p-100f, 1.3e-30f, 1e-20f, 0.37f, 1.0f, 5.5e3f,
                         1e30f, 3.4e38f, 0x1.fffffep127f};
  int fast = 1, exact = 1;
  for (size_t u = 0; u < sizeof units / sizeof *units; u++) {
    exact &= sg_elem_q8_unit17_exact(units[u]);
    for (int c = 0; c < 256; c++) {
      if ((c & SG_ELEM_Q8_M_EXP) == 0) continue; /* e = 0: the other path */
      const float want = sg_elem_q8_decode_m((uint8_t)c, units[u]);
      const float got = sg_elem_q8_value_m_normal((int8_t)c, units[u] * 0x1p-17f);
      fast &= sg_elem_f2u(got) == sg_elem_f2u(want);
    }
  }
  CHECK(exact && !sg_elem_q8_unit17_exact(0x1.fffffep-101f) && !sg_elem_q8_unit17_exact(1e-35f),
        "the exact units are 0 and those >= 2^-100");
  CHECK(fast, "m's three-operation decode gives decode_m's bits for every code with e >= 1");
}

/* ---- an independent implementation of one block's update ----------------------------------- */


/* The code of x in [0, top]: the neighbours found in the table, rounded up with probability
 * frac by the 16 random bits rnd (the dropped bits of the fraction against the random ones,
 * placed under their top). */
static int ref_encode(float x, uint32_t rnd, int mb) {
  const int ncode = 1 << (4 + mb);
  if (!(x <= ref_decode(ncode - 1, mb))) return ncode - 1;
  int lo = 0;
  while (lo + 1 < ncode && ref_decode(lo + 1, mb) <= x) lo++;
  if (lo == ncode - 1 || ref_decode(lo, mb) == x) return lo;
  const double frac = ((double)x - ref_decode(lo, mb)) / ((double)ref_decode(lo + 1, mb) - ref_decode(lo, mb));
  if (x < ldexp(1.0, -15)) { /* a fraction in 2^-16 units, truncated */
    const double t = floor(frac * 65536.0);
    return lo + ((double)rnd + t >= 65536.0);
  }
  const int drop = 23 - mb;
  const double t = frac * ldexp(1.0, drop); /* exact: the step is uniform in a binade */
  return lo + ((double)rnd * ldexp(1.0, drop - 16) + t >= ldexp(1.0, drop));
}

/* torch.optim.AdamW's element, operation by operation (DESIGN.md section 5). */
static float ref_adamw(float p, float g, float *m, float *v, float decay, float w, float b2,
                       float omb2, float step, float bc2s, float eps) {
  p = p * decay;
  const float d = g - *m;
  *m = w < 0.5f ? *m + w * d : g - d * (1.0f - w);
  *v = *v * b2;
  *v = *v + (omb2 * g) * g;
  const float denom = sqrtf(*v) / bc2s + eps;
  return p + (-step * *m) / denom;
}

/* The 8-bit state's element (sg_elem_adamw_q8): v's bias correction moved into the step and
 * eps, (-step * bc2s) * m / (sqrt(v) + eps * bc2s), each product rounded to fp32. */
static float ref_adamw_q8(float p, float g, float *m, float *v, float decay, float w, float b2,
                          float omb2, float step, float bc2s, float eps) {
  p = p * decay;
  const float d = g - *m;
  *m = w < 0.5f ? *m + w * d : g - d * (1.0f - w);
  *v = *v * b2;
  *v = *v + (omb2 * g) * g;
  const float num = (-step * bc2s) * *m, den = sqrtf(*v) + eps * bc2s;
  return p + num / den;
}

typedef struct ref_block {
  uint8_t cm[256], cv[256];
  float sm, sv;
} ref_block;

static void ref_step(ref_block *b, float *p, const float *g, size_t n, uint64_t sr0, uint64_t seed,
                     uint64_t t, double lr, double wd) {
  const double b1 = 0.9, b2 = 0.999, bc1 = 1 - pow(b1, (double)t), bc2 = 1 - pow(b2, (double)t);
  const float tm = 0.9375f, tv = 0.96875f;
  float um = b->sm > 0 ? b->sm / tm : 0.0f, uv = b->sv > 0 ? b->sv / tv : 0.0f;
  float nm[256], ns[256], am = 0, av = 0;
  for (size_t i = 0; i < n; i++) {
    float m = ref_decode(b->cm[i] & 0x7f, 3) * um, s = ref_decode(b->cv[i], 4) * uv;
    if (b->cm[i] & 0x80) m = -m;
    float v = s * s;
    p[i] = ref_adamw_q8(p[i], g[i], &m, &v, (float)(1 - lr * wd), (float)(1 - b1), (float)b2,
                     (float)(1 - b2), (float)(lr / bc1), (float)sqrt(bc2), 1e-8f);
    nm[i] = m;
    ns[i] = sqrtf(v);
    if (fabsf(m) > am) am = fabsf(m);
    if (ns[i] > av) av = ns[i];
  }
  const float rm = am > 0 ? tm / am : 0.0f, rv = av > 0 ? tv / av : 0.0f;
  for (size_t i = 0; i < n; i++) {
    /* the random bits: lowbias32 of the folded index and the low half of the step's key (a
     * splitmix64 mix of the salted seed and the step): its low 16 bits for m, high 16 for v */
    const uint64_t key = sg_elem_mix64((seed ^ 0x51ed2701a3c5b9e7ull) + 0x9e3779b97f4a7c15ull * (t + 1));
    const uint64_t ix = sr0 + i;
    const uint32_t x = (uint32_t)ix ^ ((uint32_t)(ix >> 32) * 0x9e3779b9u);
    const uint32_t r = ref_mix32(x ^ (uint32_t)key);
    b->cm[i] = (uint8_t)((nm[i] < 0 || (nm[i] == 0 && signbit(nm[i])) ? 0x80 : 0) |
                         ref_encode(fabsf(nm[i]) * rm, r & 0xffffu, 3));
    b->cv[i] = (uint8_t)ref_encode(ns[i] * rv, r >> 16, 4);
  }
  b->sm = am;
  b->sv = av;
}

static uint64_t g_rng = 88172645463325252ull;
static float rnd_unit(void) {
  g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

/* Three blocks (full, full, a tensor's partial last one) and one fp32 block, 5 steps, the
 * kernel against the reference. The blocks' first counters from sr0: any (1000), or
 * multiples of 256 as the planner cuts them (the kernel's random bits from a table that
 * changes with the counters' third byte: the blocks here straddle a multiple of 65536). */
static void test_kernel_reference(uint64_t sr0) {
  enum { NB = 3, N = NB * 256 };
  const size_t lens[NB] = {256, 256, 77};
  float p[N + 256], pr[N], g[N + 256], pool_m[256] = {0}, pool_v[256] = {0};
  uint8_t cm[N] = {0}, cv[N] = {0};
  float sm[NB + 1] = {0}, sv[NB + 1] = {0};
  const uint32_t map[NB + 1] = {SG__Q8_CODED, SG__Q8_CODED, SG__Q8_CODED, 0};
  ref_block rb[NB];
  memset(rb, 0, sizeof rb);
  for (int i = 0; i < N + 256; i++) p[i] = rnd_unit();
  memcpy(pr, p, sizeof pr);
  sg__seg segs[NB];
  for (int b = 0; b < NB; b++)
    segs[b] = (sg__seg){(size_t)b * 256, (size_t)b * 256, lens[b], 1, sr0 + (uint64_t)b * 256, 0};
  int same = 1;
  for (uint64_t t = 1; t <= 5; t++) {
    /* blocks 0 and 2: values down to far below 2^-15 of the block's maximum (the codes'
     * subnormal range); block 1: every moment within a factor 5 of the others, each
     * gradient of one sign (the kernel's loop without the subnormal path) */
    for (int i = 0; i < N + 256; i++) g[i] = rnd_unit() * (i % 3 == 0 ? 1e-4f : 0.05f);
    for (int i = 256; i < 512; i++) g[i] = (i % 2 ? 1.0f : -1.0f) * (0.02f + 0.03f * fabsf(g[i]));
    sg__update_args a;
    memset(&a, 0, sizeof a);
    a.param = p;
    a.param_dtype = SG_F32;
    a.grad = g;
    a.grad_dtype = SG_F32;
    a.segs = segs;
    a.nsegs = NB;
    a.grad_scale = 1.0f;
    a.seed = 3;
    sg__adamw_scalars(&a, 1e-3, 0.9, 0.999, 1e-8, 0.01, t);
    a.state[0] = pool_m, a.state[1] = pool_v;
    a.q8_code[0] = cm, a.q8_code[1] = cv;
    a.q8_scale[0] = sm, a.q8_scale[1] = sv;
    a.q8_f32 = map;
    sg__cpu_adamw_q8(&a);
    for (int b = 0; b < NB; b++) {
      ref_step(&rb[b], pr + b * 256, g + b * 256, lens[b], sr0 + (uint64_t)b * 256, 3, t, 1e-3,
               0.01);
      same &= memcmp(rb[b].cm, cm + b * 256, lens[b]) == 0 && memcmp(rb[b].cv, cv + b * 256, lens[b]) == 0;
      same &= rb[b].sm == sm[b] && rb[b].sv == sv[b];
      same &= memcmp(pr + b * 256, p + b * 256, lens[b] * sizeof(float)) == 0;
    }
  }
  CHECK(same, "the CPU kernel's codes, scales and parameters are the reference's, bit for bit "
        "(first counter %llu)", (unsigned long long)sr0);
  int untouched = 1;
  for (size_t i = 256 * 2 + 77; i < 256 * 3; i++) untouched &= cm[i] == 0 && cv[i] == 0;
  CHECK(untouched, "the codes past a tensor's end are never written");
  /* the fp32 block through its map entry */
  sg__seg s = {(size_t)NB * 256, (size_t)NB * 256, 100, 1, 0, 0};
  static float p2[N + 256], pf[100];
  float pool2_m[256] = {0}, pool2_v[256] = {0}, m32[100] = {0}, v32[100] = {0};
  for (int i = 0; i < 100; i++) p2[N + i] = pf[i] = rnd_unit();
  sg__update_args a;
  memset(&a, 0, sizeof a);
  a.param = p2; /* indexed by flat_off */
  a.param_dtype = SG_F32;
  a.grad = g; /* indexed by shard_off */
  a.grad_dtype = SG_F32;
  a.segs = &s;
  a.nsegs = 1;
  a.grad_scale = 1.0f;
  sg__adamw_scalars(&a, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  a.state[0] = pool2_m, a.state[1] = pool2_v;
  a.q8_code[0] = cm, a.q8_code[1] = cv, a.q8_scale[0] = sm, a.q8_scale[1] = sv, a.q8_f32 = map;
  sg__cpu_adamw_q8(&a);
  int f32 = 1;
  for (int i = 0; i < 100; i++) {
    const float q = ref_adamw(pf[i], g[N + i], &m32[i], &v32[i], (float)(1 - 1e-3 * 0.01),
                              (float)(1 - 0.9), 0.999f, (float)(1 - 0.999),
                              (float)(1e-3 / (1 - pow(0.9, 1.0))), (float)sqrt(1 - pow(0.999, 1.0)),
                              1e-8f);
    f32 &= q == p2[N + i] && m32[i] == pool2_m[i] && v32[i] == pool2_v[i];
  }
  CHECK(f32, "a block mapped to fp32 is the plain AdamW element on the pool");
}

/* bf16 rounding to nearest even by its definition: the nearer of the two bf16 neighbours (in
 * double, exact), the even one on a tie; a NaN quiet with its sign and top payload. */
static uint16_t ref_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if (isnan(x)) return (uint16_t)((u >> 16) | 0x40u);
  if (isinf(x)) return (uint16_t)(u >> 16);
  const uint32_t lo = u & 0xffff0000u, e = (u >> 23) & 0xffu;
  float fa;
  memcpy(&fa, &lo, 4);
  const double a = fa, b = a + copysign(ldexp(1.0, (int)(e ? e : 1) - 127 - 7), x);
  const double da = fabs((double)x - a), db = fabs(b - (double)x);
  const uint32_t k = lo >> 16;
  return (uint16_t)(da < db ? k : db < da ? k + 1 : k + (k & 1));
}

/* bf16 parameters with an fp32 master (the kernel's working copy in a loop of its own after
 * each block's update; by the CPU's conversion instruction where it has one, blocks with a
 * subnormal and partial blocks excepted): the master's bits are those of the same step on f32 parameters, the
 * bf16 copy is the master rounded to nearest even, a block that holds a NaN included, and
 * nothing past a tensor's end is written. Step 1 with lr 0 keeps the master's initial values
 * (ties, subnormals, infinities, NaNs with payloads), steps 2 and 3 move them. */
static void test_kernel_bf16(void) {
  enum { NB = 3, N = NB * 256 };
  const size_t lens[NB] = {256, 256, 77};
  static float pf[N], mst[N], g[N];
  static uint16_t pb[N];
  static uint8_t cm[2][N], cv[2][N];
  float sm[2][NB] = {{0}}, sv[2][NB] = {{0}}, pool_m[256] = {0}, pool_v[256] = {0};
  const uint32_t map[NB] = {SG__Q8_CODED, SG__Q8_CODED, SG__Q8_CODED};
  memset(cm, 0, sizeof cm), memset(cv, 0, sizeof cv);
  for (int i = 0; i < N; i++) {
    float x = rnd_unit();
    if (i % 5 == 1) x = ldexpf(1.0f + (float)(i % 7 + 1) * 0x1p-8f + 0x1p-9f, i % 20 - 10); /* ties */
    if (i % 11 == 2 && i / 256 != 1) /* subnormals; block 1 has none (the CPU's conversion) */
      x = (i % 2 ? -1.0f : 1.0f) * 0x1p-140f * (float)(i % 97 + 1);
    mst[i] = pf[i] = x;
  }
  const uint32_t specials[] = {0x7fc00001u, 0xff812345u, 0x7f80ffffu, 0x7f800000u, 0xff800000u,
                               0x7f7fffffu, 0x7f7f8000u};
  for (int k = 0; k < 7; k++) memcpy(&mst[256 + 40 * k + 3], &specials[k], 4); /* block 1 */
  memcpy(&mst[2 * 256 + 5], &specials[3], 4);                             /* an inf: no NaN */
  memcpy(pf, mst, sizeof pf);
  for (int i = 0; i < N; i++) pb[i] = 0xabcd;
  sg__seg segs[NB];
  for (int b = 0; b < NB; b++)
    segs[b] = (sg__seg){(size_t)b * 256, (size_t)b * 256, lens[b], 1, (uint64_t)b * 256, 0};
  int same = 1, rounded = 1;
  for (uint64_t t = 1; t <= 3; t++) {
    for (int i = 0; i < N; i++) g[i] = rnd_unit() * 0.05f;
    for (int bf = 0; bf < 2; bf++) {
      sg__update_args a;
      memset(&a, 0, sizeof a);
      a.param = bf ? (void *)pb : (void *)pf;
      a.param_dtype = bf ? SG_BF16 : SG_F32;
      a.master = bf ? mst : NULL;
      a.grad = g, a.grad_dtype = SG_F32, a.grad_scale = 1.0f;
      a.segs = segs, a.nsegs = NB, a.seed = 3;
      sg__adamw_scalars(&a, t == 1 ? 0.0 : 1e-3, 0.9, 0.999, 1e-8, 0.0, t);
      a.state[0] = pool_m, a.state[1] = pool_v;
      a.q8_code[0] = cm[bf], a.q8_code[1] = cv[bf], a.q8_scale[0] = sm[bf], a.q8_scale[1] = sv[bf];
      a.q8_f32 = map;
      sg__cpu_adamw_q8(&a);
    }
    same &= memcmp(pf, mst, sizeof pf) == 0 && memcmp(cm[0], cm[1], N) == 0 &&
            memcmp(cv[0], cv[1], N) == 0 && memcmp(sm[0], sm[1], sizeof sm[0]) == 0 &&
            memcmp(sv[0], sv[1], sizeof sv[0]) == 0;
    for (int b = 0; b < NB; b++)
      for (size_t i = 0; i < lens[b]; i++) rounded &= pb[b * 256 + i] == ref_bf16(mst[b * 256 + i]);
  }
  CHECK(same, "bf16 parameters with a master: the master, codes and scales are those of f32 "
        "parameters, bit for bit");
  CHECK(rounded, "the bf16 parameters are the master rounded to nearest even (NaN, infinity, "
        "ties and subnormals included)");
  int untouched = 1;
  for (size_t i = 2 * 256 + 77; i < N; i++) untouched &= pb[i] == 0xabcd;
  CHECK(untouched, "the bf16 parameters past a tensor's end are never written");
}

/* One step with lr 0 (the master kept) of bf16 parameters with a master x[0..n), n a multiple
 * of 256, each block of 256 a segment: the bf16 parameters into pb. */
static void bf16_step(float *x, uint16_t *pb, size_t n) {
  const size_t nb = n / 256;
  float *g = malloc(n * sizeof *g), *sm = calloc(nb, sizeof *sm), *sv = calloc(nb, sizeof *sv);
  uint8_t *cm = calloc(n, 1), *cv = calloc(n, 1);
  uint32_t *map = malloc(nb * sizeof *map);
  sg__seg *segs = malloc(nb * sizeof *segs);
  float pool[2][256] = {{0}};
  if (!g || !sm || !sv || !cm || !cv || !map || !segs) abort();
  for (size_t i = 0; i < n; i++) g[i] = rnd_unit() * 0.05f;
  for (size_t b = 0; b < nb; b++) {
    map[b] = SG__Q8_CODED;
    segs[b] = (sg__seg){b * 256, b * 256, 256, 1, b * 256, 0};
  }
  sg__update_args a;
  memset(&a, 0, sizeof a);
  a.param = pb, a.param_dtype = SG_BF16, a.master = x;
  a.grad = g, a.grad_dtype = SG_F32, a.grad_scale = 1.0f;
  a.segs = segs, a.nsegs = (int)nb, a.seed = 3;
  sg__adamw_scalars(&a, 0.0, 0.9, 0.999, 1e-8, 0.0, 1);
  a.state[0] = pool[0], a.state[1] = pool[1];
  a.q8_code[0] = cm, a.q8_code[1] = cv, a.q8_scale[0] = sm, a.q8_scale[1] = sv, a.q8_f32 = map;
  sg__cpu_adamw_q8(&a);
  free(g), free(sm), free(sv), free(cm), free(cv), free(map), free(segs);
}

/* The bf16 working copy against the definition for every bf16 pattern (each high half with
 * low halves 0, 0x7fff, 0x8000 (ties), 0x8001, 0xffff and one other), NaNs, infinities and
 * subnormals included, and for 256 blocks of normal values with one subnormal each, at lane b
 * of block b, of those the CPU's conversion rounds otherwise (to zero): the blocks the
 * conversion does are the ones it gets right, the others are found, wherever their subnormal
 * is (a lane the kernel's test missed comes out as zero). */
static void test_kernel_bf16_patterns(void) {
  enum { NLOW = 6, NA = 65536 * NLOW, NB = 256 * 256, N = NA + NB };
  static const uint32_t lows[NLOW] = {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1234u};
  static const uint32_t subs[4] = {0x007fffffu, 0x80010000u, 0x00018000u, 0x80400000u};
  float *x = malloc(N * sizeof *x);
  uint16_t *pb = malloc(N * sizeof *pb);
  if (!x || !pb) abort();
  for (uint32_t h = 0; h < 65536; h++)
    for (int l = 0; l < NLOW; l++) {
      const uint32_t u = h << 16 | lows[l];
      memcpy(&x[h * NLOW + (uint32_t)l], &u, 4);
    }
  for (int b = 0; b < 256; b++)
    for (int i = 0; i < 256; i++) {
      float v = rnd_unit() * ldexpf(1.0f, i % 60 - 30);
      if (i == b) memcpy(&v, &subs[b % 4], 4);
      x[NA + b * 256 + i] = v;
    }
  bf16_step(x, pb, N);
  size_t bad = 0, first = N;
  for (size_t i = 0; i < N; i++)
    if (pb[i] != ref_bf16(x[i])) bad++, first = first < i ? first : i;
  CHECK(bad == 0, "the bf16 parameters are the master rounded to nearest even for every bf16 "
        "pattern and a block's lone subnormal at every lane (%zu wrong, the first at %zu)", bad,
        first);
  free(x), free(pb);
}

/* ---- engines ------------------------------------------------------------------------------- */

typedef struct variant {
  const char *name;
  sg_strategy strategy;
  sg_dtype pdt;
  int groups_clip; /* param 5 in group 1, NO_DECAY on param 4, max_grad_norm */
  sg_dtype state;
  int min_numel;
  int hybrid; /* ranks per node of a hybrid engine (sharded within, replicated across); 0 flat */
  int inf_step; /* > 0: rank 0's gradient has an infinity at this step (skipped everywhere) */
  int offload;  /* cfg.offload_optimizer (on the CUDA device: the state in host memory) */
  int cpu;      /* on SG_DEVICE_CPU whatever SG_TEST_DEVICE says (the offload's reference) */
  int nan;      /* inf_step's value is a NaN */
} variant;

typedef struct result {
  float *p[NP], *m[NP], *v[NP];
  sg_memory_stats mem, est;
  uint64_t step; /* the engine's step count at the end */
  sg_status st;
  char err[256];
} result;

/* Steps [s0, s1) after loading `load` (NULL: from the initial values), then `save` (NULL:
 * none); the parameters and states into out where keep. */
typedef struct phase {
  int s0, s1;
  const char *load, *save;
  int convert; /* sg_load_options.convert_optim_state */
} phase;

typedef struct run_arg {
  const variant *v;
  int world;
  result *out;
  phase ph;
} run_arg;

/* Exactly summable: small integers times 2^-8, rank 0 taking the remainder of the split. */
static float grad_of(int p, size_t i, int step, int rank, int world) {
  const int k = (int)((i * 7 + (size_t)p * 13 + (size_t)step * 5) % 41) - 20;
  const int part = k / world;
  return (float)(rank == 0 ? k - (world - 1) * part : part) * 0.00390625f;
}

/* SG_TEST_DEVICE=cuda: the engines on SG_DEVICE_CUDA (the mock runtime in test_q8_cudamock,
 * its kernels emulated on the host). */
static sg_device g_device = SG_DEVICE_CPU;
static int g_maxw = MAXW; /* the largest world of the matrices */

static void config_of(const variant *v, sg_config *c) {
  sg_config_init(c, sizeof *c);
  c->device = v->cpu ? SG_DEVICE_CPU : g_device;
  c->cuda_device = 0;
  c->offload_optimizer = v->offload;
  c->strategy = v->strategy;
  c->param_dtype = v->pdt;
  c->grad_dtype = SG_F32;
  c->grad_average = 0;
  c->bucket_bytes = 64 << 10; /* several buckets, tensors across slices */
  c->optim_state_dtype = v->state;
  c->optim_state_min_numel = v->min_numel;
  c->seed = 11;
  c->timeout_ms = 60000;
  if (v->groups_clip) c->max_grad_norm = 0.5f;
}

static sg_status train_phase(sg_comm *comm, const variant *v, result *out, int keep,
                             phase ph);

#ifdef SG_HAVE_MPI
static sg_status train(sg_comm *comm, const variant *v, result *out, int keep) {
  return train_phase(comm, v, out, keep, (phase){0, STEPS, NULL, NULL, 0});
}
#endif

static sg_status train_phase(sg_comm *comm, const variant *v, result *out, int keep,
                             phase ph) {
  sg_config cfg;
  config_of(v, &cfg);
  const int rank = sg_comm_rank(comm), world = sg_comm_size(comm);
  sg_engine *e = NULL;
  int id[NP];
  sg_comm *shard = NULL, *replica = NULL;
  sg_status st = SG_OK;
  if (v->hybrid) {
    st = sg_comm_split_nodes(comm, v->hybrid, &shard, &replica);
    if (st == SG_OK) st = sg_engine_create_hybrid(shard, replica, &cfg, &e);
    cfg.shard_ranks = v->hybrid; /* for the estimate */
  } else {
    st = sg_engine_create(comm, &cfg, &e);
  }
  for (int p = 0; p < NP && st == SG_OK; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, numels[p], v->groups_clip && p == 4 ? SG_PARAM_NO_DECAY : 0, &id[p]);
  }
  if (st == SG_OK && v->groups_clip) st = sg_set_param_group(e, id[5], 1);
  if (st == SG_OK) st = sg_finalize(e);
  if (st == SG_OK && v->groups_clip) st = sg_set_group(e, 1, 3e-3f, 0.0f);
  float *buf = malloc(70001 * sizeof *buf), *gb[NP];
  for (int p = 0; p < NP; p++) gb[p] = malloc(numels[p] * sizeof(float));
  for (int p = 0; p < NP && st == SG_OK; p++) {
    for (size_t i = 0; i < numels[p]; i++) buf[i] = (float)((i * 31 + (size_t)p) % 97) / 97.0f - 0.5f;
    st = sg_set_param(e, id[p], buf, SG_F32);
  }
  if (st == SG_OK && ph.load && !ph.convert) st = sg_load(e, ph.load);
  if (st == SG_OK && ph.load && ph.convert) {
    sg_load_options lo;
    st = sg_load_options_init(&lo, sizeof lo);
    lo.convert_optim_state = 1;
    if (st == SG_OK) st = sg_load_ex(e, ph.load, &lo);
  }
  for (int s = ph.s0; s < ph.s1 && st == SG_OK; s++) {
    /* a buffer per parameter: on a GPU (the mock's lazy streams too) sg_grad_add reads its
     * source on the caller's stream, after it returns; the step waits for every read */
    for (int p = NP - 1; p >= 0 && st == SG_OK; p--) { /* backward order */
      for (size_t i = 0; i < numels[p]; i++) gb[p][i] = grad_of(p, i, s, rank, world);
      if (v->inf_step > 0 && v->inf_step == s && rank == 0 && p == 5)
        gb[p][7] = v->nan ? NAN : INFINITY;
      st = sg_grad_add(e, id[p], gb[p], SG_F32);
    }
    if (st == SG_OK) st = sg_step(e, NULL);
  }
  for (int p = 0; p < NP; p++) free(gb[p]);
  if (st == SG_OK && ph.save) st = sg_save(e, ph.save);
  if (st == SG_OK && keep) st = sg_get_step(e, &out->step);
  for (int p = 0; p < NP && st == SG_OK; p++) {
    float *dst[3] = {keep ? out->p[p] : buf, keep ? out->m[p] : buf, keep ? out->v[p] : buf};
    st = sg_get_param(e, id[p], dst[0], SG_F32);
    if (st == SG_OK) st = sg_get_optim_state(e, id[p], 0, dst[1]);
    if (st == SG_OK) st = sg_get_optim_state(e, id[p], 1, dst[2]);
  }
  if (st == SG_OK && keep) {
    out->mem.struct_size = out->est.struct_size = sizeof(sg_memory_stats);
    st = sg_memory(e, &out->mem);
    if (st == SG_OK) st = sg_estimate_memory(&cfg, numels, NP, world, &out->est);
  }
  if (st != SG_OK && keep) snprintf(out->err, sizeof out->err, "%s", sg_last_error());
  free(buf);
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  return st;
}

static void rank_main(sg_comm *c, void *arg) {
  run_arg *a = arg;
  const int keep = sg_comm_rank(c) == 0;
  const phase ph = a->ph.s1 ? a->ph : (phase){0, STEPS, NULL, NULL, 0};
  const sg_status st = train_phase(c, a->v, a->out, keep, ph);
  if (keep) a->out->st = st;
}

static void result_alloc(result *r) {
  memset(r, 0, sizeof *r);
  for (int p = 0; p < NP; p++) {
    r->p[p] = calloc(numels[p], sizeof(float));
    r->m[p] = calloc(numels[p], sizeof(float));
    r->v[p] = calloc(numels[p], sizeof(float));
  }
}

static void result_free(result *r) {
  for (int p = 0; p < NP; p++) free(r->p[p]), free(r->m[p]), free(r->v[p]);
}

static void run_phase(const variant *v, int world, result *out, phase ph) {
  result_alloc(out);
  run_arg a = {v, world, out, ph};
  out->st = SG_ERR_INTERNAL;
  CHECK(sg_test_run_threads(world, rank_main, &a) == SG_OK, "%s W=%d: threads", v->name, world);
  CHECK(out->st == SG_OK, "%s W=%d: trained (%s)", v->name, world, out->err);
}

static void run_world(const variant *v, int world, result *out) {
  run_phase(v, world, out, (phase){0, 0, NULL, NULL, 0});
}

static int same_param(const result *a, const result *b, int p) {
  const size_t n = numels[p] * sizeof(float);
  return !memcmp(a->p[p], b->p[p], n) && !memcmp(a->m[p], b->m[p], n) && !memcmp(a->v[p], b->v[p], n);
}

/* Largest |a - b| of state arrays over the largest |b|. */
static double rel_diff(const float *a, const float *b, size_t n) {
  double d = 0, top = 0;
  for (size_t i = 0; i < n; i++) {
    if (fabs(a[i] - b[i]) > d) d = fabs(a[i] - b[i]);
    if (fabs(b[i]) > top) top = fabs(b[i]);
  }
  return top > 0 ? d / top : d;
}

static void test_worlds(const variant *v) {
  result one;
  run_world(v, 1, &one);
  const uint64_t steps = (uint64_t)(v->inf_step ? STEPS - 1 : STEPS);
  CHECK(one.step == steps, "%s: %llu steps taken (%llu)", v->name, (unsigned long long)one.step,
        (unsigned long long)steps);
  for (int w = 2; w <= g_maxw; w++) {
    result r;
    run_world(v, w, &r);
    int same = 1;
    for (int p = 0; p < NP; p++) {
      if (!same_param(&r, &one, p) && getenv("Q8_DEBUG")) {
        size_t i = 0;
        while (i < numels[p] && r.p[p][i] == one.p[p][i] && r.m[p][i] == one.m[p][i] && r.v[p][i] == one.v[p][i]) i++;
        printf("  param %d differs first at %zu: p %g/%g m %g/%g v %g/%g\n", p, i, r.p[p][i], one.p[p][i], r.m[p][i], one.m[p][i], r.v[p][i], one.v[p][i]);
      }
      same &= same_param(&r, &one, p);
    }
    CHECK(same, "%s W=%d: parameters, m and v bit for bit those of W=1", v->name, w);
    CHECK(!memcmp(&r.mem, &r.est, sizeof r.mem), "%s W=%d: sg_memory = sg_estimate_memory",
          v->name, w);
    result_free(&r);
  }
  result_free(&one);
}

/* q8 against fp32 state at W = 4: the small tensors bit for bit, the others coded and close. */
static void test_small_rule(void) {
  const variant q = {"q8", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 4096, 0, 0, 0, 0, 0};
  const variant f = {"f32", SG_SHARD_GRAD_OP, SG_F32, 0, SG_F32, 4096, 0, 0, 0, 0, 0};
  const variant all = {"q8 all", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 0, 0, 0, 0, 0, 0};
  result rq, rf, ra;
  run_world(&q, MAXW, &rq);
  run_world(&f, MAXW, &rf);
  run_world(&all, MAXW, &ra);
  for (int p = 0; p < NP; p++) {
    const int small = numels[p] < 4096;
    if (small) {
      CHECK(same_param(&rq, &rf, p), "numel %zu < 4096: fp32 state, bit for bit the fp32 engine's",
            numels[p]);
      CHECK(!same_param(&ra, &rf, p), "numel %zu, min_numel 0: coded", numels[p]);
    } else {
      const double dm = rel_diff(rq.m[p], rf.m[p], numels[p]);
      const double dv = rel_diff(rq.v[p], rf.v[p], numels[p]);
      /* stochastic rounding moves a code by up to one step per update: 2^-4 of the block's
       * maximum for m (3 mantissa bits), 2^-5 of sqrt(v)'s; a few updates' worth */
      CHECK(!same_param(&rq, &rf, p) && dm < 0.25 && dv < 0.25,
            "numel %zu (W=4: %zu or fewer per rank): coded, m within %.3f and v within %.3f of "
            "fp32 (of the largest)", numels[p], (numels[p] + 3) / 4, dm, dv);
    }
  }
  CHECK(rq.mem.optim_bytes < rf.mem.optim_bytes / 2,
        "optim bytes %zu with 8-bit state, %zu with fp32", rq.mem.optim_bytes, rf.mem.optim_bytes);
  result_free(&rq), result_free(&rf), result_free(&ra);
  /* one large tensor: the state is about 2 bytes per parameter instead of 8 */
  sg_config c;
  config_of(&q, &c);
  const size_t big[1] = {(size_t)1 << 24};
  sg_memory_stats sq, sf;
  memset(&sq, 0, sizeof sq), memset(&sf, 0, sizeof sf);
  sq.struct_size = sf.struct_size = sizeof sq;
  c.bucket_bytes = (size_t)32 << 20;
  CHECK(sg_estimate_memory(&c, big, 1, 2, &sq) == SG_OK, "estimate q8");
  c.optim_state_dtype = SG_F32;
  CHECK(sg_estimate_memory(&c, big, 1, 2, &sf) == SG_OK, "estimate f32");
  const double per_q = (double)sq.optim_bytes / (double)sq.shard_numel;
  const double per_f = (double)sf.optim_bytes / (double)sf.shard_numel;
  CHECK(per_f == 8.0 && per_q > 2.0 && per_q < 2.05, "state bytes per shard element: fp32 %.3f, "
        "8-bit %.3f (2 codes + 2 scales per 256)", per_f, per_q);
}

/* A hybrid engine, 2 nodes x 2 ranks (and 1 x ... as 4 x 1): the bits of one rank. */
static void test_hybrid(void) {
  const variant f = {"grad_op bf16 clip groups",
      SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 0, 0};
  const variant h = {"hybrid 2x2", SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 2, 0, 0, 0, 0};
  result one, r;
  run_world(&f, 1, &one);
  run_world(&h, 4, &r);
  int same = 1;
  for (int p = 0; p < NP; p++) same &= same_param(&r, &one, p);
  CHECK(same, "hybrid 2 nodes x 2 ranks: parameters, m and v bit for bit those of one rank");
  CHECK(!memcmp(&r.mem, &r.est, sizeof r.mem), "hybrid: sg_memory = sg_estimate_memory");
  result_free(&one), result_free(&r);
}

/* ---- checkpoints --------------------------------------------------------------------------- */

static void rm_dir(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) printf("could not remove %s\n", dir);
}

/* Saved at W = a after 3 steps, loaded at W = b, 3 more: the bits of 6 steps at W = 1; the
 * state right after the load is the saved one. */
static void test_ckpt_worlds(const variant *v, const char *dir) {
  result one;
  run_world(v, 1, &one);
  const int pairs[][2] = {{2, 1}, {1, 2}, {2, 3}, {4, 1}};
  const size_t npairs = g_maxw < MAXW ? 2 : sizeof pairs / sizeof pairs[0];
  for (size_t k = 0; k < npairs; k++) {
    const int a = pairs[k][0], b = pairs[k][1];
    rm_dir(dir);
    result saved, loaded, resumed;
    run_phase(v, a, &saved, (phase){0, 3, NULL, dir, 0});
    run_phase(v, b, &loaded, (phase){3, 3, dir, NULL, 0});
    run_phase(v, b, &resumed, (phase){3, STEPS, dir, NULL, 0});
    int same_load = 1, same_end = 1;
    for (int p = 0; p < NP; p++) {
      same_load &= same_param(&saved, &loaded, p);
      same_end &= same_param(&resumed, &one, p);
    }
    CHECK(same_load, "%s: saved at W=%d, loaded at W=%d: parameters, m and v as saved", v->name,
          a, b);
    CHECK(same_end, "%s: saved at W=%d after 3 steps, 3 more at W=%d: the bits of W=1", v->name,
          a, b);
    result_free(&saved), result_free(&loaded), result_free(&resumed);
  }
  result_free(&one);
  rm_dir(dir);
}

typedef struct load_arg {
  const variant *v;
  const char *dir;
  sg_status st;
  char err[256];
} load_arg;

static void load_main(sg_comm *c, void *arg) {
  load_arg *a = arg;
  result r;
  result_alloc(&r);
  const sg_status st = train_phase(c, a->v, &r, 1, (phase){3, 3, a->dir, NULL, 0});
  if (sg_comm_rank(c) == 0) a->st = st, snprintf(a->err, sizeof a->err, "%s", r.err);
  result_free(&r);
}

/* Loads across the state formats and thresholds are refused with a message that says why. */
static void test_ckpt_mismatch(const char *dir) {
  const variant f = {"f32", SG_SHARD_GRAD_OP, SG_F32, 0, SG_F32, 4096, 0, 0, 0, 0, 0};
  const variant q = {"q8", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 4096, 0, 0, 0, 0, 0};
  const variant q0 = {"q8 min 0", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 0, 0, 0, 0, 0, 0};
  const struct {
    const variant *save, *load;
    const char *word;
  } cases[] = {{&f, &q, "fp32 optimizer state"}, {&q, &f, "8-bit optimizer state"},
               {&q, &q0, "optim_state_min_numel"}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    rm_dir(dir);
    result saved;
    run_phase(cases[k].save, 2, &saved, (phase){0, 3, NULL, dir, 0});
    result_free(&saved);
    load_arg a = {cases[k].load, dir, SG_OK, ""};
    sg_test_run_threads(2, load_main, &a);
    CHECK(a.st == SG_ERR_MISMATCH && strstr(a.err, cases[k].word) &&
              (k == 2 || strstr(a.err, "convert_optim_state")),
          "saved %s, loaded into %s: %s (%s)", cases[k].save->name, cases[k].load->name,
          sg_status_string(a.st), a.err);
  }
  rm_dir(dir);
}

/* The codes of one block of state k (0: m, 1: v) of fp32 values x[0..n) by the reference
 * (ref_encode), with the random bits of step t's key and the counters sr0 + i, decoded back as
 * sg_get_optim_state decodes them. */
static void ref_convert(const float *x, size_t n, int k, uint64_t sr0, uint64_t seed, uint64_t t,
                        float *out) {
  const float top = k ? 0.96875f : 0.9375f;
  const int mb = k ? 4 : 3;
  float y[256], amax = 0;
  for (size_t i = 0; i < n; i++) {
    y[i] = k ? sqrtf(x[i]) : x[i];
    if (fabsf(y[i]) > amax) amax = fabsf(y[i]);
  }
  const float r = amax > 0 ? top / amax : 0.0f, unit = amax > 0 ? amax / top : 0.0f;
  const uint64_t key = sg_elem_mix64((seed ^ 0x51ed2701a3c5b9e7ull) + 0x9e3779b97f4a7c15ull * (t + 1));
  for (size_t i = 0; i < n; i++) {
    const uint64_t ix = sr0 + i;
    const uint32_t h = (uint32_t)ix ^ ((uint32_t)(ix >> 32) * 0x9e3779b9u);
    const uint32_t hr = ref_mix32(h ^ (uint32_t)key), rnd = k ? hr >> 16 : hr & 0xffffu;
    const float d = ref_decode(ref_encode(fabsf(y[i]) * r, rnd, mb), mb) * unit;
    out[i] = k ? d * d : (signbit(y[i]) ? -d : d);
  }
}

static int same_floats(const float *a, const float *b, size_t n) {
  return !memcmp(a, b, n * sizeof *a);
}

/* fp32-state checkpoint into 8-bit engines at W = 1, 2, 3 and back. */
static void test_ckpt_convert(const char *dir) {
  const variant f = {"f32", SG_SHARD_GRAD_OP, SG_BF16, 1, SG_F32, 4096, 0, 0, 0, 0, 0};
  const variant q = {"q8", SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 0, 0};
  const int worlds[3] = {1, 2, 3};
  /* fp32 -> 8-bit: the reference's codes of the saved m and v */
  rm_dir(dir);
  result saved, conv[3], cont[3];
  run_phase(&f, 2, &saved, (phase){0, 3, NULL, dir, 0});
  for (int w = 0; w < 3; w++) {
    run_phase(&q, worlds[w], &conv[w], (phase){3, 3, dir, NULL, 1});
    run_phase(&q, worlds[w], &cont[w], (phase){3, STEPS, dir, NULL, 1});
  }
  for (int p = 0; p < NP; p++) {
    const size_t n = numels[p];
    float *wm = malloc(n * sizeof *wm), *wv = malloc(n * sizeof *wv);
    for (size_t j = 0; j < n; j += 256) {
      const size_t len = n - j < 256 ? n - j : 256;
      const uint64_t sr0 = ((uint64_t)p << 40) + j;
      if (n < 4096) { /* the small-tensor rule: the fp32 values */
        memcpy(wm + j, saved.m[p] + j, len * sizeof *wm), memcpy(wv + j, saved.v[p] + j, len * sizeof *wv);
        continue;
      }
      ref_convert(saved.m[p] + j, len, 0, sr0, 11, 3, wm + j);
      ref_convert(saved.v[p] + j, len, 1, sr0, 11, 3, wv + j);
    }
    for (int w = 0; w < 3; w++) {
      CHECK(same_floats(conv[w].m[p], wm, n) && same_floats(conv[w].v[p], wv, n) &&
                same_floats(conv[w].p[p], saved.p[p], n),
            "fp32 state (W=2) converted into 8 bits at W=%d, param %d (numel %zu): m and v the "
            "reference's codes of the saved ones, parameters as saved", worlds[w], p, n);
      CHECK(same_param(&cont[w], &cont[0], p), "converted at W=%d, 3 more steps, param %d: the "
            "bits of W=1", worlds[w], p);
    }
    CHECK(cont[0].step == STEPS && rel_diff(cont[0].p[p], saved.p[p], n) < 0.05,
          "param %d: training goes on after the conversion (%llu steps)", p,
          (unsigned long long)cont[0].step);
    free(wm), free(wv);
  }
  result_free(&saved);
  for (int w = 0; w < 3; w++) result_free(&conv[w]), result_free(&cont[w]);
  /* 8-bit -> fp32: the decoded values, as sg_get_optim_state gave them before the save */
  rm_dir(dir);
  run_phase(&q, 2, &saved, (phase){0, 3, NULL, dir, 0});
  for (int w = 0; w < 3; w++) {
    run_phase(&f, worlds[w], &conv[w], (phase){3, 3, dir, NULL, 1});
    run_phase(&f, worlds[w], &cont[w], (phase){3, STEPS, dir, NULL, 1});
  }
  for (int p = 0; p < NP; p++)
    for (int w = 0; w < 3; w++) {
      CHECK(same_param(&conv[w], &saved, p), "8-bit state (W=2) converted into fp32 at W=%d, "
            "param %d: parameters, m and v as sg_get_optim_state gave them", worlds[w], p);
      CHECK(same_param(&cont[w], &cont[0], p) && cont[w].step == STEPS,
            "decoded at W=%d, 3 more steps, param %d: the bits of W=1", worlds[w], p);
    }
  result_free(&saved);
  for (int w = 0; w < 3; w++) result_free(&conv[w]), result_free(&cont[w]);
  rm_dir(dir);
}

typedef struct opt_arg {
  sg_status st_size, st_reserved, st_init;
  char err[256];
} opt_arg;

/* Bad options: refused before the collective, with the field's name. */
static void opts_main(sg_comm *c, void *arg) {
  opt_arg *a = arg;
  sg_config cfg;
  config_of(&(variant){"opts", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 4096, 0, 0, 0, 0, 0}, &cfg);
  sg_engine *e = NULL;
  int id = 0;
  sg_status st = sg_engine_create(c, &cfg, &e);
  if (st == SG_OK) st = sg_add_param(e, "w", 5000, 0, &id);
  if (st == SG_OK) st = sg_finalize(e);
  sg_load_options o;
  a->st_init = sg_load_options_init(&o, sizeof o - 1);
  sg_load_options_init(&o, sizeof o);
  o.struct_size = 8;
  a->st_size = st == SG_OK ? sg_load_ex(e, "/nonexistent", &o) : st;
  snprintf(a->err, sizeof a->err, "%s", sg_last_error());
  sg_load_options_init(&o, sizeof o);
  o.reserved = 1;
  a->st_reserved = st == SG_OK ? sg_load_ex(e, "/nonexistent", &o) : st;
  sg_engine_destroy(e);
}

static void test_load_options(void) {
  opt_arg a;
  memset(&a, 0, sizeof a);
  sg_test_run_threads(1, opts_main, &a);
  CHECK(a.st_init == SG_ERR_INVALID_ARGUMENT, "sg_load_options_init with another size: %s",
        sg_status_string(a.st_init));
  CHECK(a.st_size == SG_ERR_INVALID_ARGUMENT && strstr(a.err, "struct_size"),
        "sg_load_ex with a struct_size not from sg_load_options_init: %s (%s)",
        sg_status_string(a.st_size), a.err);
  CHECK(a.st_reserved == SG_ERR_INVALID_ARGUMENT, "sg_load_ex with reserved != 0: %s",
        sg_status_string(a.st_reserved));
}

/* ---- bad configs --------------------------------------------------------------------------- */

static void expect_create(sg_config *cfg, sg_status want, const char *word) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK, "comm")) return;
  const sg_status st = sg_engine_create(c, cfg, &e);
  CHECK(st == want && e == NULL && strstr(sg_last_error(), word), "sg_engine_create: %s (%s)",
        sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

static void test_bad_config(void) {
  sg_config c;
  sg_config_init(&c, sizeof c);
  CHECK(c.optim_state_dtype == SG_F32 && c.optim_state_min_numel == 4096, "defaults");
  c.optim_state_dtype = (sg_dtype)7;
  expect_create(&c, SG_ERR_INVALID_ARGUMENT, "optim_state_dtype");
  c.optim_state_dtype = SG_BF16;
  expect_create(&c, SG_ERR_INVALID_ARGUMENT, "optim_state_dtype");
  c.optim_state_dtype = SG_Q8;
  c.optim_state_min_numel = -1;
  expect_create(&c, SG_ERR_INVALID_ARGUMENT, "optim_state_min_numel");
  c.optim_state_min_numel = 4096;
  c.param_dtype = SG_Q8;
  expect_create(&c, SG_ERR_INVALID_ARGUMENT, "param_dtype");
  c.param_dtype = SG_F32;
  if (g_device != SG_DEVICE_CUDA) return;
  /* with offload: a sharded strategy, as with fp32 state */
  c.device = SG_DEVICE_CUDA;
  c.offload_optimizer = 1;
  c.strategy = SG_NO_SHARD;
  expect_create(&c, SG_ERR_UNSUPPORTED, "offload_optimizer");
}

/* ---- optimizer offload (the mock CUDA device) ----------------------------------------------- */

static int same_all(const result *a, const result *b) {
  int same = 1;
  for (int p = 0; p < NP; p++) same &= same_param(a, b, p);
  return same;
}

/* 8-bit state with offload_optimizer on the CUDA device (the state and its update on the
 * host): bit for bit the CPU device's 8-bit engine of the same config at W = 1 and 2;
 * sg_memory = sg_estimate_memory, the state in host memory (none on the device); a checkpoint
 * saved with offload at W = 2 loads at W = 1 on the CPU device and the reverse, the runs going
 * on with the bits of the uninterrupted one. */
static void test_offload(const variant *on, const char *dir) {
  variant cpu = *on;
  cpu.offload = 0, cpu.cpu = 1;
  result ref;
  run_world(&cpu, 1, &ref);
  const uint64_t steps = (uint64_t)(on->inf_step ? STEPS - 1 : STEPS);
  for (int w = 1; w <= 2; w++) {
    result r;
    run_world(on, w, &r);
    CHECK(r.step == steps && same_all(&r, &ref), "%s W=%d: %llu steps, parameters, m and v bit "
          "for bit the CPU device's 8-bit engine", on->name, w, (unsigned long long)r.step);
    CHECK(!memcmp(&r.mem, &r.est, sizeof r.mem), "%s W=%d: sg_memory = sg_estimate_memory",
          on->name, w);
    CHECK(r.mem.host_bytes > 0 && r.mem.optim_bytes == 0 && r.mem.master_bytes == 0,
          "%s W=%d: the state in host memory (%zu bytes), none on the device (optim %zu, "
          "master %zu)", on->name, w, r.mem.host_bytes, r.mem.optim_bytes, r.mem.master_bytes);
    result_free(&r);
  }
  const struct {
    const variant *save, *load;
    int ws, wl;
  } pairs[] = {{on, &cpu, 2, 1}, {&cpu, on, 1, 2}, {on, on, 2, 1}};
  for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
    rm_dir(dir);
    result saved, resumed;
    run_phase(pairs[k].save, pairs[k].ws, &saved, (phase){0, 3, NULL, dir, 0});
    run_phase(pairs[k].load, pairs[k].wl, &resumed, (phase){3, STEPS, dir, NULL, 0});
    CHECK(same_all(&resumed, &ref), "%s: saved by %s at W=%d after 3 steps, 3 more by %s at "
          "W=%d: the bits of the uninterrupted run", on->name, pairs[k].save->offload ?
          "offload" : "the CPU device", pairs[k].ws, pairs[k].load->offload ? "offload" :
          "the CPU device", pairs[k].wl);
    result_free(&saved), result_free(&resumed);
  }
  rm_dir(dir);
  result_free(&ref);
}

/* A hybrid engine (2 nodes x 2 ranks) with offload: the accumulator summed across the nodes
 * on the host at the step, the 8-bit update as flat: the CPU device's one-rank bits. */
static void test_offload_hybrid(void) {
  const variant cpu = {"cpu grad_op bf16 clip groups",
      SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 1, 0};
  const variant h = {"offload hybrid 2x2",
      SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 2, 0, 1, 0, 0};
  result one, r;
  run_world(&cpu, 1, &one);
  run_world(&h, 4, &r);
  CHECK(same_all(&r, &one), "offload hybrid 2 nodes x 2 ranks: parameters, m and v bit for bit "
        "the CPU device's one rank");
  CHECK(!memcmp(&r.mem, &r.est, sizeof r.mem) && r.mem.host_bytes > 0,
        "offload hybrid: sg_memory = sg_estimate_memory (host %zu)", r.mem.host_bytes);
  result_free(&one), result_free(&r);
}

/* The host bytes of 8-bit state with offload: about 2.05 bytes per shard element for m and v
 * instead of 8, the accumulator and the master as with fp32 state. */
static void test_offload_estimate(void) {
  const variant q = {"q8 offload", SG_SHARD_GRAD_OP, SG_BF16, 0, SG_Q8, 4096, 0, 0, 1, 0, 0};
  sg_config c;
  config_of(&q, &c);
  c.bucket_bytes = (size_t)32 << 20;
  const size_t big[1] = {(size_t)1 << 24};
  sg_memory_stats sq, sf;
  memset(&sq, 0, sizeof sq), memset(&sf, 0, sizeof sf);
  sq.struct_size = sf.struct_size = sizeof sq;
  CHECK(sg_estimate_memory(&c, big, 1, 2, &sq) == SG_OK, "estimate q8 offload: %s",
        sg_last_error());
  c.optim_state_dtype = SG_F32;
  CHECK(sg_estimate_memory(&c, big, 1, 2, &sf) == SG_OK, "estimate f32 offload");
  const double saved = (double)(sf.host_bytes - sq.host_bytes) / (double)sq.shard_numel;
  CHECK(sq.shard_numel == sf.shard_numel && saved > 5.95 && saved < 6.0 &&
        sq.optim_bytes == 0 && sq.total_bytes == sf.total_bytes,
        "offload host bytes per shard element: %.3f fewer with 8-bit state (8 - 2.05), the "
        "device's the same (%zu, %zu)", saved, sq.total_bytes, sf.total_bytes);
}

/* ---- MPI: W = np against one rank ---------------------------------------------------------- */

#ifdef SG_HAVE_MPI
static int run_mpi(void) {
  int world = 0, rank = 0;
  sg_test_mpi_init(&world, &rank);
  const variant v = {"mpi grad_op bf16 groups",
      SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 0, 0};
  sg_comm *c = NULL;
  result r, one;
  result_alloc(&r);
  CHECK(sg_comm_create_mpi(NULL, &c) == SG_OK, "MPI communicator");
  const sg_status st = train(c, &v, &r, 1);
  CHECK(st == SG_OK, "rank %d of %d trained (%s)", rank, world, r.err);
  sg_comm_destroy(c);
  if (rank == 0) {
    run_world(&v, 1, &one);
    int same = 1;
    for (int p = 0; p < NP; p++) same &= same_param(&r, &one, p);
    CHECK(same, "W=%d under MPI: parameters, m and v bit for bit those of one rank", world);
    result_free(&one);
  }
  result_free(&r);
  sg_test_mpi_finalize();
  return sg_test_summary("");
}
#endif

int main(int argc, char **argv) {
#ifdef SG_HAVE_MPI
  if (argc > 1 && !strcmp(argv[1], "--mpi")) return run_mpi();
#endif
  (void)argc, (void)argv;
  const char *dev = getenv("SG_TEST_DEVICE");
  if (dev && !strcmp(dev, "cuda")) g_device = SG_DEVICE_CUDA;
  test_codes();
  test_kernel_reference(1000u);
  test_kernel_reference((3ull << 40) + 5 * 65536 - 256);
  test_kernel_bf16();
  test_kernel_bf16_patterns();
  test_bad_config();
  static const variant vs[] = {
      {"grad_op f32 fp32state", SG_SHARD_GRAD_OP, SG_F32, 0, SG_F32, 4096, 0, 0, 0, 0, 0},
      {"grad_op f32", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 4096, 0, 0, 0, 0, 0},
      {"grad_op bf16 clip groups", SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 0, 0},
      {"shard_opt bf16 clip groups", SG_SHARD_OPT, SG_BF16, 1, SG_Q8, 4096, 0, 0, 0, 0, 0},
      {"no_shard f32 min 0", SG_NO_SHARD, SG_F32, 0, SG_Q8, 0, 0, 0, 0, 0, 0},
      /* f16 params: dynamic loss scaling; an infinity at step 2 skips it on every rank */
      {"grad_op f16 scaled, inf at step 2",
          SG_SHARD_GRAD_OP, SG_F16, 0, SG_Q8, 4096, 0, 2, 0, 0, 0},
  };
  char dir[256];
  snprintf(dir, sizeof dir, "/tmp/sg_test_q8_%d", (int)getpid());
  if (g_device == SG_DEVICE_CUDA) {
    /* the emulated kernel runs every block's 256 threads as fibers: one case of each kind */
    g_maxw = 2;
    test_worlds(&vs[2]);
    test_ckpt_worlds(&vs[2], dir);
    static const variant off[] = {
        {"offload grad_op bf16 clip groups",
            SG_SHARD_GRAD_OP, SG_BF16, 1, SG_Q8, 4096, 0, 0, 1, 0, 0},
        /* f32 parameters: no master, the host pipeline copies the working values in */
        {"offload grad_op f32 min 0", SG_SHARD_GRAD_OP, SG_F32, 0, SG_Q8, 0, 0, 0, 1, 0, 0},
        {"offload shard_opt f16 scaled, NaN at step 2",
            SG_SHARD_OPT, SG_F16, 0, SG_Q8, 4096, 0, 2, 1, 0, 1},
    };
    for (size_t k = 0; k < sizeof off / sizeof off[0]; k++) test_offload(&off[k], dir);
    test_offload_hybrid();
    test_offload_estimate();
    return sg_test_summary("");
  }
  for (size_t k = 0; k < sizeof vs / sizeof vs[0]; k++) test_worlds(&vs[k]);
  test_small_rule();
  test_hybrid();
  test_ckpt_worlds(&vs[2], dir);
  test_ckpt_worlds(&vs[4], dir);
  test_ckpt_mismatch(dir);
  test_ckpt_convert(dir);
  test_load_options();
  return sg_test_summary("");
}
