/* Per-element math shared by the CPU loops (kernels/cpu) and the CUDA kernels (kernels/cuda).
 * Written once so that both run the same operations in the same order (DESIGN.md section 5).
 *
 * Compiles as C11 and as CUDA C++. All math is fp32 without contraction: the library is built
 * with -ffp-contract=off and nvcc with -fmad=false, so a*b+c rounds twice everywhere.
 * Conversions to bf16/f16 are done on the bits (no hardware conversion instructions), which
 * makes them identical on every compiler and target and keeps the CPU loops vectorizable
 * (one CPU loop uses an instruction on the inputs where it gives these bits:
 * kernels/cpu/sg_cpu_bf16hw.c).
 *
 * dtype codes: 0 f32, 1 bf16, 2 f16 (the values of sg_dtype). */
#ifndef SG_ELEM_H
#define SG_ELEM_H

#include <math.h>   /* sqrtf */
#include <stddef.h> /* size_t */
#include <stdint.h> /* uint16_t, uint32_t, uint64_t */

#ifdef __CUDACC__
#define SG_HD __host__ __device__ __forceinline__
#else
#define SG_HD static inline
#endif

/* ---- bit casts ------------------------------------------------------------------------- */

/* Unions are the C11 way to reinterpret bits; device code uses the intrinsics. */
typedef union sg_elem_fbits {
  float f;
  uint32_t u;
} sg_elem_fbits;

SG_HD uint32_t sg_elem_f2u(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  sg_elem_fbits b;
  b.f = x;
  return b.u;
#endif
}

SG_HD float sg_elem_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  sg_elem_fbits b;
  b.u = u;
  return b.f;
#endif
}

/* mask ? a : b on the bits for mask all ones or zero, without a branch (both operands are
 * already computed). */
SG_HD float sg_elem_select_mask(uint32_t mask, float a, float b) {
  return sg_elem_u2f((sg_elem_f2u(a) & mask) | (sg_elem_f2u(b) & ~mask));
}

/* Not a NaN and not an infinity: the exponent field is not all ones. */
SG_HD int sg_elem_isfinite(float x) { return (sg_elem_f2u(x) & 0x7f800000u) != 0x7f800000u; }

/* ---- bf16 ------------------------------------------------------------------------------ */

/* Exact widening; a signalling NaN comes back quiet (payload otherwise kept). */
SG_HD float sg_elem_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  uint32_t quiet = ((h & 0x7fffu) > 0x7f80u) ? 0x00400000u : 0u;
  return sg_elem_u2f(u | quiet);
}

/* The rounding of sg_elem_f32_to_bf16 alone, on the bits u of an x that is not a NaN (a loop
 * that tests its values for NaN once per block: kernels/cpu/sg_cpu_q8.c). */
SG_HD uint32_t sg_elem_bf16_round_bits(uint32_t u) {
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* Round to nearest, ties to even. Adding 0x7fff plus the lowest kept bit to the 32-bit pattern
 * carries into bit 16 exactly when the dropped half is above one half, or equal to it with an
 * odd kept part; a carry out of the mantissa moves the exponent up, which also turns values
 * beyond the largest bf16 into infinity. NaN is handled apart so the carry cannot reach the
 * sign or turn it into infinity; it stays NaN, quiet, with its sign. */
SG_HD uint16_t sg_elem_f32_to_bf16(float x) {
  uint32_t u = sg_elem_f2u(x);
  uint32_t rounded = sg_elem_bf16_round_bits(u);
  uint32_t nan = (u >> 16) | 0x0040u;
  return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

/* Stochastic rounding: adding uniform random low bits before truncating rounds up with
 * probability equal to the dropped fraction, so the result is unbiased on average. Only for
 * finite x; inf and NaN take the RNE path (which keeps them as they are). */
SG_HD uint16_t sg_elem_f32_to_bf16_sr(float x, uint32_t rnd) {
  uint32_t u = sg_elem_f2u(x);
  uint32_t rounded = (u + (rnd & 0xffffu)) >> 16;
  return sg_elem_isfinite(x) ? (uint16_t)rounded : sg_elem_f32_to_bf16(x);
}

/* ---- f16 ------------------------------------------------------------------------------- */

/* Exact widening. Normal numbers: rebias the exponent by 127-15 = 112. Subnormals
 * (m * 2^-24): placing m in the low mantissa bits of 0.5f gives 0.5 + m*2^-24 exactly, and
 * subtracting 0.5f leaves m*2^-24, exact and normal in f32. Inf/NaN: all-ones exponent, a NaN
 * comes back quiet with its payload. */
SG_HD float sg_elem_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  uint32_t normal = (em << 13) + (112u << 23);
  uint32_t special = (em << 13) | 0x7f800000u | ((em > 0x7c00u) ? 0x00400000u : 0u);
  uint32_t sub = sg_elem_f2u(sg_elem_u2f(0x3f000000u | em) - 0.5f);
  uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u), is_sub = 0u - (uint32_t)(em < 0x0400u);
  uint32_t mag = (special & is_special) | (sub & is_sub) | (normal & ~(is_special | is_sub));
  return sg_elem_u2f(sign | mag);
}

/* Round to nearest, ties to even.
 * - NaN: quiet NaN with the sign and the top payload bits.
 * - |x| >= 65520 (half way between 65504, the largest f16, and 2^16): infinity (the tie
 *   goes to the even neighbour, which is the infinity since 65504's mantissa is odd).
 * - normal range (|x| >= 2^-14): rebias the exponent, then round the 13 dropped bits as in
 *   sg_elem_f32_to_bf16 (a carry into the exponent is the correct result).
 * - below: the f16 subnormal spacing is 2^-24, which is the f32 spacing just above 0.5, so
 *   |x| + 0.5f rounds |x| to that spacing by the FPU's own round-to-nearest-even, and the
 *   result's low mantissa bits are the f16 subnormal (2^-14 itself comes out as 0x400). */
SG_HD uint16_t sg_elem_f32_to_f16(float x) {
  uint32_t u = sg_elem_f2u(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t nan = 0x7e00u | ((a >> 13) & 0x1ffu);
  uint32_t rebias = a - (112u << 23);
  uint32_t normal = (rebias + 0xfffu + ((rebias >> 13) & 1u)) >> 13;
  uint32_t sub = sg_elem_f2u(sg_elem_u2f(a) + 0.5f) - 0x3f000000u;
  uint32_t big = (a > 0x7f800000u) ? nan : (a >= 0x477ff000u) ? 0x7c00u : normal;
  uint32_t is_sub = 0u - (uint32_t)(a < 0x38800000u);
  return (uint16_t)(sign | (sub & is_sub) | (big & ~is_sub));
}

/* ---- loads and stores by dtype ----------------------------------------------------------- */

SG_HD float sg_elem_load(const void *p, int dtype, size_t i) {
  if (dtype == 1) return sg_elem_bf16_to_f32(((const uint16_t *)p)[i]);
  if (dtype == 2) return sg_elem_f16_to_f32(((const uint16_t *)p)[i]);
  return ((const float *)p)[i];
}

SG_HD void sg_elem_store(void *p, int dtype, size_t i, float x) {
  if (dtype == 1)
    ((uint16_t *)p)[i] = sg_elem_f32_to_bf16(x);
  else if (dtype == 2)
    ((uint16_t *)p)[i] = sg_elem_f32_to_f16(x);
  else
    ((float *)p)[i] = x;
}

/* ---- counter-based random bits ----------------------------------------------------------- */

/* A 64-bit mixing function (the splitmix64 finalizer: xor-shift / multiply rounds with odd
 * constants); every input bit affects every output bit. */
SG_HD uint64_t sg_elem_mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

/* Random bits for element `index` (a counter that names the element independently of the
 * layout, see sg__seg.sr_index) at optimizer step `step`. A pure function
 * of its arguments, so stochastic rounding does not depend on the rank count or launch shape.
 * The key depends only on (seed, step), so loops can hoist it. */
SG_HD uint32_t sg_elem_hash64(uint64_t seed, uint64_t step, uint64_t index) {
  uint64_t key = sg_elem_mix64(seed + 0x9e3779b97f4a7c15ull * (step + 1u));
  return (uint32_t)(sg_elem_mix64(key ^ (index * 0xd1b54a32d192ed03ull)) >> 32);
}

/* ---- accumulation ------------------------------------------------------------------------ */

/* acc + src in fp32 (one rounding); the caller rounds the result to the accumulator dtype. */
SG_HD float sg_elem_accumulate(float acc, float src) { return acc + src; }

/* ---- blockwise codes (the replica codecs, src/engine/policy/sg_replica_codec.c) ----------- */

/* Elements per block; each block has one fp32 scale. */
#define SG_ELEM_CODE_BLOCK 256

/* The largest magnitude so far, m, with |v|: NaN once any value was NaN (a comparison alone
 * would skip it), inf once any was infinite. */
SG_HD float sg_elem_code_amax(float m, float v) {
  const float a = fabsf(v);
  return (a != a || a > m) ? a : m;
}

/* The scale of a block of largest magnitude amax, codes in [-qmax, qmax]: amax / qmax. A
 * non-finite block gets a NaN scale, so that all it decodes to is NaN and the step that sums
 * it is non-finite on every replica. */
SG_HD float sg_elem_code_scale(float amax, float qmax) {
  return sg_elem_isfinite(amax) ? amax / qmax : sg_elem_u2f(0x7fc00000u);
}

/* The code of v under scale s: v / s rounded to nearest even, clamped to [-qmax, qmax] (the
 * quotient of the largest value may round just past qmax); 0 under a zero or NaN scale. */
SG_HD int sg_elem_code(float v, float s, float qmax) {
  if (!(s > 0.0f)) return 0;
  float q = rintf(v / s);
  q = q > qmax ? qmax : q;
  q = q < -qmax ? -qmax : q;
  return (int)q;
}

SG_HD float sg_elem_decode(int q, float s) { return (float)q * s; }

/* What the code of x missed, kept for the next step (error feedback); dropped (0) where the
 * block is non-finite, so that one bad step does not poison every later one. */
SG_HD float sg_elem_code_residual(float x, float decoded) {
  return sg_elem_isfinite(decoded) ? x - decoded : 0.0f;
}

/* ---- outer steps (DiLoCo, src/engine/policy/sg_replica_outer.c) --------------------------- */

/* The pseudo-gradient of one element: the parameter at the last outer step minus now. */
SG_HD float sg_elem_outer_delta(float po, float theta) { return po - theta; }

/* The replicas' mean of it from their fp32 sum (nrep: the replica count as fp32). */
SG_HD float sg_elem_outer_mean(float dsum, float nrep) { return dsum / nrep; }

/* One Nesterov momentum SGD step of an outer parameter po, on the replicas' mean
 * pseudo-gradient d (the parameter at the last outer step minus now), as torch.optim.SGD with
 * nesterov=True: m = mu m + d, then po - lr (d + mu m). Returns the new po. */
SG_HD float sg_elem_outer_nesterov(float po, float d, float *m, float lr, float mu) {
  const float mi = mu * *m + d;
  *m = mi;
  return po - lr * (d + mu * mi);
}

/* ---- the step's outcome (src/engine/sg_step.c and the CUDA step kernel) ------------------ */

/* What the step decides from the global sum of squares ss0 and non-finite count ss1, in double
 * as the host always did: the host (sg_step) and the device (the step kernel, which hands the
 * factor to AdamW through device memory so that no host wait sits between them) call the same
 * function, and IEEE double sqrt, division and fmin give both the same bits. */
typedef struct sg_elem_step_in {
  double avg;        /* 1/(ranks sharing the gradient) with grad_average, else 1 */
  double inv_scale;  /* 1.0 / (double)loss_scale */
  double user_scale; /* sg_grad_scale's product */
  double max_norm;   /* clip above this norm; <= 0: no clipping */
  int skip_enabled;  /* skip_nonfinite or dynamic loss scaling */
  int pad_;
} sg_elem_step_in;

/* 32 bytes; seq last: the device writes it after the rest (sg__cuda_step_outcome). */
typedef struct sg_elem_step_out {
  float factor;     /* the gradient's factor of AdamW: avg * inv_scale * clip * user_scale */
  float norm;       /* global L2 norm of the unscaled gradient (inf/NaN if not finite) */
  float clip;       /* clip coefficient, 1 without clipping */
  int32_t overflow; /* non-finite gradients (or norm) */
  int32_t skip;     /* overflow and skip_enabled: nothing is updated */
  int32_t pad_;
  uint64_t seq;     /* which step wrote it */
} sg_elem_step_out;

SG_HD double sg_elem_step_norm(double ss0, const sg_elem_step_in *in) {
  return sqrt(ss0) * in->avg * in->inv_scale * fabs(in->user_scale);
}

SG_HD sg_elem_step_out sg_elem_step_outcome(double ss0, double ss1, const sg_elem_step_in *in) {
  const double norm = sg_elem_step_norm(ss0, in);
  const int finite = norm - norm == 0.0; /* not inf, not NaN */
  sg_elem_step_out o;
  double clip = 1.0;
  if (in->max_norm > 0 && finite) clip = fmin(1.0, in->max_norm / (norm + 1e-6));
  o.factor = (float)(in->avg * in->inv_scale * clip * in->user_scale);
  o.norm = (float)norm;
  o.clip = (float)clip;
  o.overflow = ss1 > 0 || !finite;
  o.skip = o.overflow && in->skip_enabled;
  o.pad_ = 0;
  o.seq = 0;
  return o;
}

/* ---- AdamW ------------------------------------------------------------------------------- */

/* Per-step constants of one AdamW update (see kernels/sg_kernel_args.h for how the host
 * computes them). Passed by value so that loops keep them in registers. */
typedef struct sg_elem_adamw_k {
  float decay_factor;    /* (float)(1 - lr*wd); 1.0f for no-decay parameters (exact no-op) */
  float lerp_w;          /* 1 - beta1, the lerp weight */
  float lerp_1mw;        /* 1.0f - lerp_w in fp32, used when lerp_w >= 0.5 */
  float beta2;
  float one_minus_beta2;
  float neg_step_size;   /* -(float)(lr / bc1) */
  float bc2_sqrt;        /* (float)sqrt(1 - beta2^t) */
  float eps;
  uint32_t lerp_small;   /* all ones when |lerp_w| < 0.5 (torch's lerp picks its form by this) */
} sg_elem_adamw_k;

SG_HD sg_elem_adamw_k sg_elem_adamw_consts(float decay_factor, float one_minus_beta1, float beta2,
                                           float one_minus_beta2, float step_size,
                                           float bc2_sqrt, float eps) {
  sg_elem_adamw_k k;
  k.decay_factor = decay_factor;
  k.lerp_w = one_minus_beta1;
  k.lerp_1mw = 1.0f - one_minus_beta1;
  k.beta2 = beta2;
  k.one_minus_beta2 = one_minus_beta2;
  k.neg_step_size = -step_size;
  k.bc2_sqrt = bc2_sqrt;
  k.eps = eps;
  k.lerp_small = (one_minus_beta1 < 0.5f && one_minus_beta1 > -0.5f) ? 0xffffffffu : 0u;
  return k;
}

/* One element of torch.optim.AdamW (single-tensor path), operation by operation, each op
 * rounded to fp32 as torch's CPU kernels do:
 *   param.mul_(1 - lr*wd)                  p = p * decay_factor
 *   exp_avg.lerp_(grad, 1 - beta1)         w < 0.5: m = m + w*(g - m)
 *                                          else:    m = g - (g - m)*(1 - w)
 *   exp_avg_sq.mul_(beta2)                 v = v * beta2
 *   .addcmul_(grad, grad, value=1-beta2)   v = v + ((1-beta2)*g)*g      (self + value*t1*t2)
 *   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
 *   param.addcdiv_(exp_avg, denom, value=-step_size)
 *                                          p = p + ((-step_size)*m)/denom (self + value*t1/t2)
 * Returns the new p (fp32 master value); *m and *v are updated in place. The first five lines,
 * the decay and the moments, are sg_elem_adamw_moments, which the 8-bit state's element shares. */
SG_HD float sg_elem_adamw_moments(float p, float g, float *m, float *v, sg_elem_adamw_k k) {
  float mi = *m;
  float vi = *v;
  float diff = g - mi;
  p = p * k.decay_factor;
  /* both lerp forms are computed and one is picked by a bit mask: no branch in the loop */
  mi = sg_elem_select_mask(k.lerp_small, mi + k.lerp_w * diff, g - diff * k.lerp_1mw);
  vi = vi * k.beta2;
  vi = vi + (k.one_minus_beta2 * g) * g;
  *m = mi;
  *v = vi;
  return p;
}

SG_HD float sg_elem_adamw(float p, float g, float *m, float *v, sg_elem_adamw_k k) {
  p = sg_elem_adamw_moments(p, g, m, v, k);
  const float denom = sqrtf(*v) / k.bc2_sqrt + k.eps;
  return p + (k.neg_step_size * *m) / denom;
}

/* ---- 8-bit optimizer state (SG_Q8) -------------------------------------------------------- */

/* AdamW's element over the 8-bit state's moments (kernels/cpu/sg_cpu_q8.c and the CUDA kernel;
 * tensors below optim_state_min_numel keep sg_elem_adamw). The same update with v's bias
 * correction moved from the denominator into the step's two constants,
 *   p + ((-step_size * bc2_sqrt) * m) / (sqrt(v) + eps * bc2_sqrt)
 * instead of p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps): one division per element
 * instead of two. Division and square root share the divider, a dozen cycles per 16 lanes on
 * AVX-512, which the 8-bit loop is bound by on a CPU with its other arithmetic, where the fp32
 * step waits on memory (docs/optim-state-8bit.md, Speed). Not torch's rounding, which only the
 * fp32 state promises. sqrt(v), which v's code is made of, comes back in *s. The constants
 * are products of two floats: loop-invariant, hoisted. */
SG_HD float sg_elem_adamw_q8(float p, float g, float *m, float *v, float *s, sg_elem_adamw_k k) {
  const float step = k.neg_step_size * k.bc2_sqrt, eps = k.eps * k.bc2_sqrt;
  p = sg_elem_adamw_moments(p, g, m, v, k);
  *s = sqrtf(*v);
  return p + (step * *m) / (*s + eps);
}

/* Blockwise 8-bit state: blocks of SG_ELEM_Q8_BLOCK elements aligned to the tensor's start,
 * each with one fp32 scale, the block's absolute maximum (of m; of sqrt(v)). Inside a block the
 * values, divided by the maximum, are coded as a small float with 4 exponent bits and M
 * mantissa bits: code c = e << M | f holds (1 + f / 2^M) * 2^(e - 16) for e = 1..15 and
 * f * 2^(-15 - M) for e = 0, so [0, top] with top = (2 - 2^-M) / 2 covers 2^(15 + M) steps
 * of relative precision 2^-M (a linear code would lose the small values of a block). m is
 * signed: a sign bit and M = 3. v is kept as sqrt(v), M = 4: its range is that of the
 * gradient, not of its square, and it stays non-negative. Every operation is exact or one
 * IEEE rounding, so CPU and CUDA code the same bits. */
#define SG_ELEM_Q8_BLOCK 256
#define SG_ELEM_Q8_M_BITS 3 /* mantissa bits of m's magnitude (and a sign bit) */
#define SG_ELEM_Q8_V_BITS 4 /* mantissa bits of sqrt(v) */

/* The largest coded magnitude: (2 - 2^-M) / 2. */
SG_HD float sg_elem_q8_top(int mbits) { return mbits == 4 ? 0.96875f : 0.9375f; }

/* The codes from absolute maximum amax: x * ratio lands in [0, top] (0 for an all-zero block,
 * and for a non-finite maximum, which codes every finite value as 0). */
SG_HD float sg_elem_q8_ratio(float amax, int mbits) {
  return (amax > 0.0f && sg_elem_isfinite(amax)) ? sg_elem_q8_top(mbits) / amax : 0.0f;
}

/* Back from the codes: the coded value times this is the value. */
SG_HD float sg_elem_q8_unit(float amax, int mbits) {
  return (amax > 0.0f && sg_elem_isfinite(amax)) ? amax / sg_elem_q8_top(mbits) : 0.0f;
}

/* The code of x >= 0 (x <= top up to a rounding; larger and NaN: the largest code), rounded
 * stochastically with 16 random bits rnd (below 2^16): up with probability equal to the
 * dropped fraction (to 2^-16 of a step), so a moment that changes by less than a step per
 * update (v with beta2 = 0.999 moves by 0.1%) still moves on average instead of sticking at
 * its code. Normal range: the f32 exponent rebiased (127 - 16) and the dropped 23 - M mantissa
 * bits rounded by adding the random bits under their top; below 2^-15: x scaled exactly to
 * 2^-16 units of the code's step, truncated, then the same. */
SG_HD uint32_t sg_elem_q8_code(float x, uint32_t rnd, int mbits, int all_normal) {
  const uint32_t u = sg_elem_f2u(x);
  const uint32_t drop = 23u - (uint32_t)mbits, top = (1u << (4 + mbits)) - 1u;
  const int is_sub = u < 0x38000000u; /* below 2^-15 */
  const uint32_t up = (u - (111u << 23) + (rnd << (drop - 16u))) >> drop;
  const uint32_t normal = up < top ? up : top;
  if (all_normal) return normal; /* the caller knows x >= 2^-15 (sg_elem_q8_all_normal) */
  /* 2^(15 + M + 16): x < 2^-15 becomes a fixed-point count below 2^(M + 16), exactly; only
   * such x are converted (never a NaN or a large value). Selects and a minimum, no branches:
   * it vectorizes (masked operations and a vector minimum where the ISA has them) */
  const float small = is_sub ? x : 0.0f;
  const float scaled = small * sg_elem_u2f((uint32_t)(127 + 31 + mbits) << 23);
  const uint32_t sub = ((uint32_t)(int32_t)scaled + rnd) >> 16;
  return is_sub ? sub : normal;
}

/* all_normal: a constant where it is inlined, 1 for a block of which sg_elem_q8_all_normal
 * holds (no value below 2^-15: the subnormal path is left out, the codes are the same). */
SG_HD uint32_t sg_elem_q8_encode(float x, uint32_t rnd, int mbits) {
  return sg_elem_q8_code(x, rnd, mbits, 0);
}

/* 1 when every value |x| >= xmin of a block coded under `ratio` is coded in the normal range
 * (x * ratio >= 2^-15: a product with a positive ratio keeps the order). xmin NaN: 0. */
SG_HD int sg_elem_q8_all_normal(float xmin, float ratio) {
  return xmin * ratio >= sg_elem_u2f(112u << 23);
}

/* The value of a code (before the block's unit). The code's bits e << M | f shifted into the
 * f32 mantissa's top are (e << 23) + (f << (23 - M)), so one addition rebiases the exponent
 * (e + 111) and places f; with e = 0 the code is f itself, converted and scaled exactly. */
SG_HD float sg_elem_q8_value(uint32_t c, int mbits, int all_normal) {
  const float normal = sg_elem_u2f((c << (23 - mbits)) + (111u << 23));
  if (all_normal) return normal; /* the caller knows e >= 1 (a constant where it is inlined) */
  const float sub = (float)(int32_t)c * sg_elem_u2f((uint32_t)(127 - 15 - mbits) << 23);
  return sg_elem_select_mask(0u - (uint32_t)(c < (1u << mbits)), sub, normal); /* no branch */
}

SG_HD float sg_elem_q8_decode(uint32_t c, int mbits) { return sg_elem_q8_value(c, mbits, 0); }

/* The bits of a code that are all zero exactly where its exponent e is 0 (codes 0 to 2^M - 1,
 * zero included): a block whose codes all have some of them set decodes with all_normal 1. */
#define SG_ELEM_Q8_M_EXP 0x78u /* m: the 4 exponent bits under the sign */
#define SG_ELEM_Q8_V_EXP 0xf0u

/* m: sign bit 7, magnitude in the low 7 bits. The codes come back in 32 bits (below 256): a
 * vectorized loop keeps them in 32-bit lanes until it stores them as bytes. */
SG_HD uint32_t sg_elem_q8_code_m(float m, float ratio, uint32_t rnd, int all_normal) {
  const uint32_t u = sg_elem_f2u(m);
  const float mag = sg_elem_u2f(u & 0x7fffffffu) * ratio;
  return ((u >> 24) & 0x80u) | sg_elem_q8_code(mag, rnd, SG_ELEM_Q8_M_BITS, all_normal);
}

SG_HD uint32_t sg_elem_q8_encode_m(float m, float ratio, uint32_t rnd) {
  return sg_elem_q8_code_m(m, ratio, rnd, 0);
}

SG_HD float sg_elem_q8_value_m(uint32_t c, float unit, int all_normal) {
  const float mag = sg_elem_q8_value(c & 0x7fu, SG_ELEM_Q8_M_BITS, all_normal) * unit;
  return sg_elem_u2f(sg_elem_f2u(mag) | ((c & 0x80u) << 24));
}

SG_HD float sg_elem_q8_decode_m(uint8_t c, float unit) { return sg_elem_q8_value_m(c, unit, 0); }

/* sg_elem_q8_value_m's bits for a code with exponent e >= 1, in three operations instead of five:
 * the code sign-extended (cs = (int8_t)c) and shifted puts its sign at bit 31 (and copies at
 * 27-30, overwritten), e at 23-26 and f under them; forcing bits 27-30 to 1000 makes the
 * exponent field 128 + e, so the bits are +-(1 + f / 2^M) 2^(e + 1), and unit17 = unit * 2^-17
 * brings them to the decoded value in the same single rounding (the product of the same
 * numbers). unit17 must be exact: unit 0 or unit >= 2^-100 (sg_elem_q8_unit17_exact). */
SG_HD float sg_elem_q8_value_m_normal(int32_t cs, float unit17) {
  const uint32_t x = (uint32_t)cs << (23 - SG_ELEM_Q8_M_BITS);
  return sg_elem_u2f((x & ~0x78000000u) | 0x40000000u) * unit17;
}

SG_HD int sg_elem_q8_unit17_exact(float unit) { return unit == 0.0f || unit >= 0x1p-100f; }

/* v through its square root s = sqrtf(v) >= 0. */
SG_HD uint32_t sg_elem_q8_code_v(float s, float ratio, uint32_t rnd, int all_normal) {
  return sg_elem_q8_code(s * ratio, rnd, SG_ELEM_Q8_V_BITS, all_normal);
}

SG_HD uint32_t sg_elem_q8_encode_v(float s, float ratio, uint32_t rnd) {
  return sg_elem_q8_code_v(s, ratio, rnd, 0);
}

SG_HD float sg_elem_q8_value_v(uint32_t c, float unit, int all_normal) {
  const float s = sg_elem_q8_value(c, SG_ELEM_Q8_V_BITS, all_normal) * unit;
  return s * s;
}

SG_HD float sg_elem_q8_decode_v(uint8_t c, float unit) { return sg_elem_q8_value_v(c, unit, 0); }

/* The key of the codes' random bits at `step`: a stream of its own (not the parameter's
 * stochastic rounding, which hashes the seed itself), hoisted out of the loops. */
SG_HD uint64_t sg_elem_q8_key(uint64_t seed, uint64_t step) {
  return sg_elem_mix64((seed ^ 0x51ed2701a3c5b9e7ull) + 0x9e3779b97f4a7c15ull * (step + 1u));
}

/* A 32-bit mixing function (xor-shift / multiply rounds with odd constants, "lowbias32"):
 * 32-bit multiplies, which every vector ISA has (the 64-bit ones of sg_elem_mix64 need
 * AVX-512). In two parts: its first round, (x ^ x >> 16) * SG_ELEM_MIX32_MUL1, and the rest,
 * sg_elem_mix32_tail, which a CPU loop over a block of consecutive counters runs on the
 * first round's products taken from a table (kernels/cpu/sg_cpu_q8.c). */
#define SG_ELEM_MIX32_MUL1 0x7feb352du
SG_HD uint32_t sg_elem_mix32_tail(uint32_t x) {
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

SG_HD uint32_t sg_elem_mix32(uint32_t x) {
  x ^= x >> 16;
  return sg_elem_mix32_tail(x * SG_ELEM_MIX32_MUL1);
}

/* The 32 random bits of element `index`'s codes (sg__seg.sr_index, independent of the
 * layout): both halves of the index folded with the key's low half. One hash for both codes:
 * m's code takes the low 16 bits (sg_elem_q8_rnd_m), v's the high 16 (sg_elem_q8_rnd_v). */
SG_HD uint32_t sg_elem_q8_rnd(uint64_t key, uint64_t index) {
  const uint32_t x = (uint32_t)index ^ ((uint32_t)(index >> 32) * 0x9e3779b9u);
  return sg_elem_mix32(x ^ (uint32_t)key);
}

SG_HD uint32_t sg_elem_q8_rnd_m(uint32_t r) { return r & 0xffffu; }
SG_HD uint32_t sg_elem_q8_rnd_v(uint32_t r) { return r >> 16; }

/* The bits of |x| for the block maximum, NaN as 0: for x >= 0 the order of the bits is the
 * order of the values, so an integer maximum (any order, vectorized) is the float maximum. */
SG_HD uint32_t sg_elem_q8_max_bits(float x) {
  const uint32_t a = sg_elem_f2u(x) & 0x7fffffffu;
  return a & (0u - (uint32_t)(a <= 0x7f800000u));
}

#endif /* SG_ELEM_H */
