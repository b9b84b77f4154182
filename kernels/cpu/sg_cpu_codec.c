/* CPU loops of the replica codecs over the blockwise code math of kernels/sg_elem.h: a run of
 * fp32 values plus its residual encoded as blocks of SG_ELEM_CODE_BLOCK values (one fp32 scale
 * each, then the codes: int8, or two 4-bit codes per byte, low nibble first), and decoded. */
#include <string.h> /* memcpy */

#include "../sg_elem.h"      /* sg_elem_code*, SG_ELEM_CODE_BLOCK */
#include "sg_cpu_kernels.h" /* declarations */

static float qmax_of(int bits) { return bits == 4 ? 7.0f : 127.0f; }

size_t sg__cpu_code_bytes(size_t n, int bits) {
  const size_t nb = (n + SG_ELEM_CODE_BLOCK - 1) / SG_ELEM_CODE_BLOCK;
  return nb * (4u + (size_t)SG_ELEM_CODE_BLOCK * (size_t)bits / 8u);
}

static void put_code(uint8_t *codes, size_t i, int q, int bits) {
  if (bits == 8) {
    codes[i] = (uint8_t)(int8_t)q;
    return;
  }
  const uint8_t nib = (uint8_t)((unsigned)q & 0xfu);
  codes[i / 2] = (uint8_t)(i % 2 ? (codes[i / 2] & 0x0fu) | (nib << 4) : (codes[i / 2] & 0xf0u) | nib);
}

static int get_code(const uint8_t *codes, size_t i, int bits) {
  if (bits == 8) return (int)(int8_t)codes[i];
  const unsigned nib = (codes[i / 2] >> (i % 2 ? 4 : 0)) & 0xfu;
  return nib >= 8u ? (int)nib - 16 : (int)nib; /* 4-bit two's complement */
}

/* One block of m values: x = src + resid, its scale, its codes, resid = what they missed. */
static void encode_block(uint8_t *codes, float *scale, const float *src, float *resid, size_t m,
                         int bits) {
  const float qmax = qmax_of(bits);
  float x[SG_ELEM_CODE_BLOCK], amax = 0.0f;
  for (size_t i = 0; i < m; i++) {
    x[i] = src[i] + resid[i];
    amax = sg_elem_code_amax(amax, x[i]);
  }
  const float s = sg_elem_code_scale(amax, qmax);
  memset(codes, 0, (size_t)SG_ELEM_CODE_BLOCK * (size_t)bits / 8u); /* the tail of a short block */
  for (size_t i = 0; i < m; i++) {
    const int q = sg_elem_code(x[i], s, qmax);
    put_code(codes, i, q, bits);
    resid[i] = sg_elem_code_residual(x[i], sg_elem_decode(q, s));
  }
  memcpy(scale, &s, sizeof s);
}

void sg__cpu_code_encode(void *out, const float *src, float *resid, size_t n, int bits) {
  const size_t nb = (n + SG_ELEM_CODE_BLOCK - 1) / SG_ELEM_CODE_BLOCK;
  const size_t cb = (size_t)SG_ELEM_CODE_BLOCK * (size_t)bits / 8u;
  uint8_t *scales = out, *codes = (uint8_t *)out + 4u * nb;
  for (size_t k = 0; k < nb; k++) {
    const size_t o = k * SG_ELEM_CODE_BLOCK, m = n - o < SG_ELEM_CODE_BLOCK ? n - o : SG_ELEM_CODE_BLOCK;
    float s;
    encode_block(codes + k * cb, &s, src + o, resid + o, m, bits);
    memcpy(scales + 4u * k, &s, sizeof s);
  }
}

void sg__cpu_code_decode(float *dst, const void *in, size_t n, int bits, int add) {
  const size_t nb = (n + SG_ELEM_CODE_BLOCK - 1) / SG_ELEM_CODE_BLOCK;
  const size_t cb = (size_t)SG_ELEM_CODE_BLOCK * (size_t)bits / 8u;
  const uint8_t *scales = in, *codes = (const uint8_t *)in + 4u * nb;
  for (size_t k = 0; k < nb; k++) {
    const size_t o = k * SG_ELEM_CODE_BLOCK, m = n - o < SG_ELEM_CODE_BLOCK ? n - o : SG_ELEM_CODE_BLOCK;
    float s;
    memcpy(&s, scales + 4u * k, sizeof s);
    const uint8_t *c = codes + k * cb;
    for (size_t i = 0; i < m; i++) {
      const float d = sg_elem_decode(get_code(c, i, bits), s);
      dst[o + i] = add ? sg_elem_accumulate(dst[o + i], d) : d;
    }
  }
}
