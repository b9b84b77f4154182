/* The replica codecs' two-stage scheme written out on its own, for the tests' references
 * (test_replica_codec, test_replica_outer): blockwise codes of BLK (256) values with one scale
 * each, a residual per rank and stage. Independent of the library's code. */
#ifndef SG_TEST_CODEC_REF_H
#define SG_TEST_CODEC_REF_H

#include <math.h>
#include <stdlib.h>

#define BLK 256
#ifndef MAXW
#define MAXW 8
#endif

/* The codes of x[0..m) (one block) decoded, and what they missed added to r (error feedback). */
static inline void ref_block(const float *x, float *out, float *r, size_t m, float qmax) {
  float amax = 0;
  int bad = 0;
  for (size_t i = 0; i < m; i++) {
    if (!isfinite(x[i])) bad = 1;
    if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
  }
  const float s = amax / qmax;
  for (size_t i = 0; i < m; i++) {
    float q = s > 0 ? rintf(x[i] / s) : 0.0f;
    if (q > qmax) q = qmax;
    if (q < -qmax) q = -qmax;
    const int code = (int)q; /* what goes on the wire: an integer (no -0) */
    out[i] = bad ? NAN : (float)code * s;
    r[i] = bad ? 0.0f : x[i] - out[i];
  }
}

/* x + r encoded and decoded block by block into out; r becomes the new residual. */
static inline void ref_code(const float *x, float *r, float *out, size_t n, float qmax) {
  float t[BLK];
  for (size_t o = 0; o < n; o += BLK) {
    const size_t m = n - o < BLK ? n - o : BLK;
    for (size_t i = 0; i < m; i++) t[i] = x[o + i] + r[o + i];
    ref_block(t, out + o, r + o, m, qmax);
  }
}

/* Replica k's chunk of a slice of n values: whole blocks, the first (nblocks % N) one longer. */
static inline void ref_chunk(size_t n, int N, int k, size_t *off, size_t *len) {
  const size_t nb = (n + BLK - 1) / BLK;
  size_t b0 = 0;
  for (int j = 0; j < k; j++) b0 += nb / (size_t)N + ((size_t)j < nb % (size_t)N);
  const size_t nbk = nb / (size_t)N + ((size_t)k < nb % (size_t)N);
  *off = b0 * BLK < n ? b0 * BLK : n;
  const size_t end = (b0 + nbk) * BLK < n ? (b0 + nbk) * BLK : n;
  *len = end - *off;
}

/* One bucket slice across N replicas: in[i] is replica i's slice (n values), out the sum every
 * replica must hold. r1[i] and r2[i] point at this slice's residuals of replica i. */
static inline void ref_reduce(float *const *in, float *const *r1, float *const *r2, int N, size_t n,
                       float qmax, float *out) {
  float *dec[MAXW];
  for (int i = 0; i < N; i++) {
    dec[i] = malloc(n * sizeof(float));
    ref_code(in[i], r1[i], dec[i], n, qmax);
  }
  for (int k = 0; k < N; k++) {
    size_t off, len;
    ref_chunk(n, N, k, &off, &len);
    float *sum = malloc((len ? len : 1) * sizeof(float));
    for (size_t e = 0; e < len; e++) {
      float s = dec[0][off + e];
      for (int i = 1; i < N; i++) s += dec[i][off + e];
      sum[e] = s;
    }
    ref_code(sum, r2[k], out + off, len, qmax);
    free(sum);
  }
  for (int i = 0; i < N; i++) free(dec[i]);
}

#endif /* SG_TEST_CODEC_REF_H */
