/* bf16 by the hardware's conversion (AVX512-BF16, VCVTNE2PS2BF16) where the CPU has it, for the
 * 8-bit AdamW loop's working copy (sg_cpu_q8.c): the same bits as sg_elem_f32_to_bf16 or
 * nothing. A file of its own: with this function in sg_cpu_q8.c GCC allocated q8_block's
 * registers differently (its source unchanged), and that loop's speed moves with its spills. */
#include <stddef.h>
#include <stdint.h>

#include "sg_cpu_kernels.h" /* sg__cpu_bf16_block_hw */

/* GCC 11+ on x86-64: the intrinsics, and one function compiled for that ISA alone while the
 * library is not; chosen at run time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h> /* _mm512_cvtne2ps_pbh and the mask tests */

/* VCVTNE2PS2BF16 rounds to nearest even as sg_elem_f32_to_bf16 does, NaN (quiet, sign and top
 * payload), infinity and zero included: every one of the 2^32 - 2^24 other inputs checked
 * against it (docs/optim-state-8bit.md, Speed). But it ignores MXCSR and makes a subnormal
 * input a zero of its sign, where the software rounds it. So the values' subnormals (exponent
 * field 0, mantissa not) are looked for as they convert: 0 where there was one. */
__attribute__((target("avx512f,avx512bf16"))) static int convert(uint16_t *restrict d,
                                                                 const float *restrict x,
                                                                 size_t n) {
  const __m512i expo = _mm512_set1_epi32(0x7f800000), mant = _mm512_set1_epi32(0x007fffff);
  __mmask16 sub = 0;
  for (size_t i = 0; i < n; i += 32) {
    const __m512i lo = _mm512_loadu_si512(x + i), hi = _mm512_loadu_si512(x + i + 16);
    sub |= _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(lo, expo), lo, mant);
    sub |= _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(hi, expo), hi, mant);
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(lo));
    _mm512_storeu_si512(d + i, (__m512i)h);
  }
  return sub == 0;
}

static int g_have_hw = -1; /* decided once; a benign race writes the same value */

int sg__cpu_bf16_block_hw(uint16_t *d, const float *x, size_t n) {
  int hw = __atomic_load_n(&g_have_hw, __ATOMIC_RELAXED);
  if (hw < 0) {
    __builtin_cpu_init(); /* libgcc's checks include the OS saving AVX-512's registers */
    hw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
    __atomic_store_n(&g_have_hw, hw, __ATOMIC_RELAXED);
  }
  return hw && n % 32 == 0 && convert(d, x, n);
}
#else
int sg__cpu_bf16_block_hw(uint16_t *d, const float *x, size_t n) {
  (void)d, (void)x, (void)n;
  return 0;
}
#endif
