/* Element math (kernels/sg_elem.h) and the CPU loops (kernels/cpu):
 *  - bf16/f16 -> f32 -> back for all 65536 patterns of each;
 *  - f32 -> bf16/f16 round-to-nearest-even against reference roundings written here in double
 *    arithmetic (and against gcc's _Float16 where the compiler has it), over every f16/bf16
 *    neighbourhood and millions of random f32 values;
 *  - stochastic rounding: deterministic, one of the two neighbours, unbiased on average;
 *  - the CPU loops against naive loops over the same element functions, for every dtype and
 *    sizes around the vector widths and the threading threshold, bitwise equal for any number
 *    of OpenMP threads; the fused reduce-and-fold against the two passes it replaces;
 *  - the CPU device (src/device/cpu.c): aligned allocation and the failure hook, the comm
 *    queue's FIFO order, deadlines, failure propagation and skipping, inline mode, ordering of
 *    SG_Q_COMM work, and destroy with jobs pending; zero_release zeroes exactly its range and
 *    gives its whole pages back (mincore). */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#define _DEFAULT_SOURCE         /* mincore */

#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>   /* sysconf */

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/sg_cpu_kernels.h" /* sg__cpu_* */
#include "device/sg_device.h"   /* the CPU device: memory, comm queue */
#include "sg_elem.h"            /* element math */

#include "sg_test_check.h"
#include "sg_test_mem.h" /* sg_test_resident_pages */

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint64_t rnd64(void) { /* xorshift64* */
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 0x2545f4914f6cdd1dull;
}
static uint32_t rnd32(void) { return (uint32_t)(rnd64() >> 32); }
static float rndf(float lo, float hi) { return lo + (hi - lo) * (float)(rnd32() >> 8) / 16777216.0f; }

static uint32_t fbits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
static float bitsf(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* ---- references ---------------------------------------------------------------------------- */

/* Nearest bf16 to a finite x, ties to even, by comparing distances in double (exact here). The
 * neighbour above the largest finite bf16 is infinity, which rounding treats as 2^128. */
static uint16_t ref_f32_to_bf16(float x) {
  uint32_t u = fbits(x);
  uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
  double dx = fabs((double)x), dlo = fabs((double)bitsf(lo));
  double dhi = (hi & 0x7fffffffu) == 0x7f800000u ? ldexp(1.0, 128) : fabs((double)bitsf(hi));
  if (dx - dlo < dhi - dx) return (uint16_t)(lo >> 16);
  if (dx - dlo > dhi - dx) return (uint16_t)(hi >> 16);
  return (uint16_t)(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

/* Nearest f16 to a finite x: scale |x| to units of the f16 spacing at its binade (exact), round
 * to an integer with nearbyint (round-half-even in the default mode) and encode. */
static uint16_t ref_f32_to_f16(float x) {
  uint16_t sign = (fbits(x) >> 16) & 0x8000u;
  double a = fabs((double)x);
  if (a < ldexp(1.0, -14)) return (uint16_t)(sign | (uint16_t)nearbyint(a * ldexp(1.0, 24)));
  int e;
  frexp(a, &e);
  int E = e - 1; /* a in [2^E, 2^(E+1)) */
  double r = nearbyint(ldexp(a, 10 - E));
  if (r == 2048.0) {
    E++;
    r = 1024.0;
  }
  if (E + 15 >= 31) return (uint16_t)(sign | 0x7c00u);
  return (uint16_t)(sign | ((unsigned)(E + 15) << 10) | (unsigned)(r - 1024.0));
}

/* Value of an f16 pattern from its definition (for finite patterns). */
static double ref_f16_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v = e == 0 ? ldexp((double)m, -24) : ldexp(1024.0 + m, e - 25);
  return (h & 0x8000u) ? -v : v;
}

#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
static uint16_t gcc_f32_to_f16(float x) {
  _Float16 h = (_Float16)x;
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
#endif

/* A converted NaN: still NaN, quiet, same sign. */
static int nan16_ok(uint16_t h, uint16_t quiet_bit, uint16_t exp_mask, int sign) {
  return (h & exp_mask) == exp_mask && (h & ~exp_mask & 0x7fffu) != 0 && (h & quiet_bit) &&
         ((h >> 15) & 1) == sign;
}

/* ---- 16-bit -> f32 -> 16-bit, all patterns ------------------------------------------------- */

static void test_bf16_all(void) {
  int bad_val = 0, bad_trip = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = sg_elem_bf16_to_f32((uint16_t)h);
    uint16_t back = sg_elem_f32_to_bf16(f);
    int is_nan = (h & 0x7fffu) > 0x7f80u;
    if (is_nan) {
      bad_val += !(isnan(f) && (fbits(f) & 0x00400000u) && (fbits(f) >> 31) == (h >> 15));
      bad_trip += back != (h | 0x40u);
    } else {
      bad_val += fbits(f) != h << 16;
      bad_trip += back != h;
    }
  }
  CHECK(bad_val == 0, "bf16 -> f32 exact for all 65536 patterns, NaN quiet with sign (%d bad)", bad_val);
  CHECK(bad_trip == 0, "bf16 -> f32 -> bf16 round trip exact (NaN: quieted) (%d bad)", bad_trip);
}

static void test_f16_all(void) {
  int bad_val = 0, bad_trip = 0, bad_gcc = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = sg_elem_f16_to_f32((uint16_t)h);
    uint16_t back = sg_elem_f32_to_f16(f);
    int is_nan = (h & 0x7fffu) > 0x7c00u, is_inf = (h & 0x7fffu) == 0x7c00u;
    if (is_nan) {
      bad_val += !(isnan(f) && (fbits(f) & 0x00400000u) && (fbits(f) >> 31) == (h >> 15));
      bad_trip += back != (h | 0x200u);
    } else {
      double want = is_inf ? ((h & 0x8000u) ? -INFINITY : INFINITY) : ref_f16_value((uint16_t)h);
      bad_val += (double)f != want || !!signbit(f) != !!signbit(want);
      bad_trip += back != h;
    }
#ifdef HAVE_FLOAT16
    if (!is_nan) {
      _Float16 hv;
      uint16_t hh = (uint16_t)h;
      memcpy(&hv, &hh, 2);
      bad_gcc += fbits((float)hv) != fbits(f);
    }
#endif
  }
  CHECK(bad_val == 0, "f16 -> f32 exact for all 65536 patterns incl. subnormals, NaN quiet (%d bad)", bad_val);
  CHECK(bad_trip == 0, "f16 -> f32 -> f16 round trip exact (NaN: quieted) (%d bad)", bad_trip);
#ifdef HAVE_FLOAT16
  CHECK(bad_gcc == 0, "f16 -> f32 equals gcc's _Float16 conversion (%d bad)", bad_gcc);
#endif
}

/* ---- f32 -> 16-bit rounding ---------------------------------------------------------------- */

typedef struct round_stats {
  long n, bad_bf16, bad_f16, bad_gcc;
} round_stats;

static void check_one(float x, round_stats *s) {
  s->n++;
  if (isnan(x)) {
    int sign = (int)(fbits(x) >> 31);
    s->bad_bf16 += !nan16_ok(sg_elem_f32_to_bf16(x), 0x40u, 0x7f80u, sign);
    s->bad_f16 += !nan16_ok(sg_elem_f32_to_f16(x), 0x200u, 0x7c00u, sign);
    return;
  }
  if (isinf(x)) {
    s->bad_bf16 += sg_elem_f32_to_bf16(x) != (fbits(x) >> 16);
    s->bad_f16 += sg_elem_f32_to_f16(x) != ((fbits(x) >> 16 & 0x8000u) | 0x7c00u);
    return;
  }
  s->bad_bf16 += sg_elem_f32_to_bf16(x) != ref_f32_to_bf16(x);
  s->bad_f16 += sg_elem_f32_to_f16(x) != ref_f32_to_f16(x);
#ifdef HAVE_FLOAT16
  s->bad_gcc += sg_elem_f32_to_f16(x) != gcc_f32_to_f16(x);
#endif
}

/* Around every bf16 and f16 value: the value itself, its f32 neighbours, the exact midpoint to
 * the next value and the f32 numbers on either side of that midpoint. */
static void boundary_values(round_stats *s) {
  static const uint32_t lows[] = {0, 1, 2, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff};
  for (uint32_t h = 0; h < 65536; h++) {
    for (size_t j = 0; j < sizeof lows / sizeof lows[0]; j++) check_one(bitsf((h << 16) | lows[j]), s);
    if ((h & 0x7fffu) >= 0x7c00u) continue; /* f16 inf/NaN */
    float f = sg_elem_f16_to_f32((uint16_t)h);
    float next = sg_elem_f16_to_f32((uint16_t)(h + 1));
    if ((h & 0x7fffu) == 0x7bffu) next = (h & 0x8000u) ? -65536.0f : 65536.0f; /* virtual next */
    float mid = (float)(((double)f + (double)next) / 2); /* exact: at most 12 significant bits */
    uint32_t b[] = {fbits(f), fbits(f) + 1, fbits(f) - 1, fbits(mid), fbits(mid) + 1, fbits(mid) - 1};
    for (size_t j = 0; j < 6; j++) check_one(bitsf(b[j]), s);
  }
}

static void test_rounding(void) {
  round_stats s = {0, 0, 0, 0};
  boundary_values(&s);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f,
                            65520.0f, -65520.0f, 3.3895314e38f, 3.4028235e38f, 1.0e-45f,
                            5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f, 6.1035156e-5f};
  for (size_t j = 0; j < sizeof specials / sizeof specials[0]; j++) check_one(specials[j], &s);
  check_one(bitsf(0x7f800001u), &s); /* signalling NaNs */
  check_one(bitsf(0xff800001u), &s);
  for (long i = 0; i < 2000000; i++) check_one(bitsf(rnd32()), &s); /* any pattern */
  for (long i = 0; i < 2000000; i++) { /* the f16 range, where both formats round */
    uint32_t e = 98u + (uint32_t)(rnd32() % 48u);
    check_one(bitsf((rnd32() & 0x807fffffu) | (e << 23)), &s);
  }
  CHECK(s.bad_bf16 == 0, "f32 -> bf16 RNE equals the double reference on %ld values (%ld bad)", s.n, s.bad_bf16);
  CHECK(s.bad_f16 == 0, "f32 -> f16 RNE equals the double reference on %ld values (%ld bad)", s.n, s.bad_f16);
#ifdef HAVE_FLOAT16
  CHECK(s.bad_gcc == 0, "f32 -> f16 equals gcc's _Float16 conversion on %ld values (%ld bad)", s.n, s.bad_gcc);
#endif
  CHECK(sg_elem_f32_to_bf16(3.4028235e38f) == 0x7f80u && sg_elem_f32_to_f16(65520.0f) == 0x7c00u &&
            sg_elem_f32_to_f16(65519.99f) == 0x7bffu && sg_elem_f32_to_f16(-1e6f) == 0xfc00u,
        "overflow: values past the half-way point become inf, below stay at the maximum");
}

/* ---- stochastic rounding and the hash ------------------------------------------------------ */

static void test_stochastic(void) {
  int bad_det = 0, bad_nb = 0;
  for (int i = 0; i < 100000; i++) {
    float x = bitsf(rnd32());
    if (!sg_elem_isfinite(x)) {
      bad_nb += sg_elem_f32_to_bf16_sr(x, rnd32()) != sg_elem_f32_to_bf16(x);
      continue;
    }
    uint32_t r = sg_elem_hash64(7, 3, (uint64_t)i);
    uint16_t a = sg_elem_f32_to_bf16_sr(x, r);
    bad_det += a != sg_elem_f32_to_bf16_sr(x, sg_elem_hash64(7, 3, (uint64_t)i));
    uint16_t lo = (uint16_t)(fbits(x) >> 16);
    bad_nb += a != lo && a != (uint16_t)(lo + 1);
  }
  CHECK(bad_det == 0, "stochastic rounding is a pure function of (x, seed, step, index)");
  CHECK(bad_nb == 0, "stochastic rounding gives one of the two bf16 neighbours (inf/NaN: RNE)");
  /* unbiased: for fractions f of the bf16 spacing, P(up) = f within 5 sigma over 200000 draws */
  const double fracs[] = {0.0, 1.0 / 65536, 0.1, 0.25, 0.5, 0.75, 0.999};
  int worst_ok = 1;
  double worst = 0;
  for (size_t j = 0; j < sizeof fracs / sizeof fracs[0]; j++) {
    const float base = 1.5f; /* bf16 0x3fc0; spacing 2^-7 */
    float x = (float)(base + fracs[j] * ldexp(1.0, -7));
    double fr = (double)(fbits(x) & 0xffffu) / 65536.0; /* the fraction actually stored */
    const int N = 200000;
    long up = 0;
    for (int i = 0; i < N; i++) up += sg_elem_f32_to_bf16_sr(x, sg_elem_hash64(42, (uint64_t)j, (uint64_t)i)) != 0x3fc0u;
    double sigma = sqrt(fr * (1 - fr) / N) + 1e-12, z = fabs((double)up / N - fr) / sigma;
    if (fr == 0.0) z = up == 0 ? 0 : 1e9;
    if (z > worst) worst = z;
    worst_ok &= z < 5.0;
  }
  CHECK(worst_ok, "stochastic rounding unbiased: P(round up) = fraction (worst %.2f sigma)", worst);
  /* the hash: the top bit is set about half the time, and seed/step/index all matter */
  long ones = 0;
  int diff = 1;
  for (int i = 0; i < 100000; i++) {
    uint32_t h = sg_elem_hash64(1, 1, (uint64_t)i);
    ones += h >> 31;
    diff &= h != sg_elem_hash64(2, 1, (uint64_t)i) || h != sg_elem_hash64(1, 2, (uint64_t)i);
  }
  CHECK(ones > 49000 && ones < 51000 && diff, "hash bits balanced (%ld/100000) and keyed by seed and step", ones);
}

/* ---- CPU loops vs naive loops -------------------------------------------------------------- */

static const size_t g_sizes[] = {0, 1, 63, 64, 65, 1000, 100003};
#define NSIZES (sizeof g_sizes / sizeof g_sizes[0])
static const int g_threads[] = {1, 2, 3, 7};
#define NTHREADS (sizeof g_threads / sizeof g_threads[0])
static const char *dname(int d) { return d == 0 ? "f32" : d == 1 ? "bf16" : d == 2 ? "f16" : "f64"; }
static size_t esize(int d) { return d == 3 ? 8 : d == 0 ? 4 : 2; }

static void set_threads(int t) {
#ifdef _OPENMP
  omp_set_num_threads(t);
#else
  (void)t;
#endif
}

/* Random values in dtype d: mostly moderate, some tiny, huge, zero, inf and NaN when asked. */
static void *rand_buf(int d, size_t n, int specials) {
  void *p = malloc(n * esize(d) + 8);
  for (size_t i = 0; i < n; i++) {
    float x = rndf(-4.0f, 4.0f);
    uint32_t r = rnd32() % 100;
    if (r == 0) x *= 1e-6f;
    if (r == 1) x *= 1e4f;
    if (r == 2) x = 0.0f;
    if (specials && r == 3) x = (rnd32() & 1) ? INFINITY : NAN;
    if (d == 3)
      ((double *)p)[i] = (double)x + ldexp((double)x, -30);
    else
      sg_elem_store(p, d, i, x);
  }
  return p;
}

static void *dup_buf(const void *p, size_t bytes) {
  void *q = malloc(bytes + 8);
  memcpy(q, p, bytes);
  return q;
}

/* Same bits, except that any two NaNs match: which NaN payload survives x + y when both are
 * NaN depends on the operand order the compiler picked, and the library promises no payload. */
static int same_values(const void *x, const void *y, int d, size_t n) {
  if (memcmp(x, y, n * esize(d)) == 0) return 1;
  for (size_t i = 0; i < n; i++) {
    if (d == 3) {
      double a = ((const double *)x)[i], b = ((const double *)y)[i];
      if (!(isnan(a) && isnan(b)) && memcmp(&a, &b, 8) != 0) return 0;
    } else {
      float a = sg_elem_load(x, d, i), b = sg_elem_load(y, d, i);
      if (!(isnan(a) && isnan(b)) && fbits(a) != fbits(b)) return 0;
    }
  }
  return 1;
}

/* Runs fn for each thread count and checks all give the reference's values. */
typedef void (*kernel_run)(void *out, const void *in, size_t n, int a, int b);

static int same_for_threads(kernel_run fn, const void *init, int out_dtype, const void *in,
                            size_t n, int a, int b, const void *want) {
  int ok = 1;
  for (size_t t = 0; t < NTHREADS; t++) {
    set_threads(g_threads[t]);
    void *out = dup_buf(init, n * esize(out_dtype));
    fn(out, in, n, a, b);
    ok &= same_values(out, want, out_dtype, n);
    free(out);
  }
  set_threads(2);
  return ok;
}

static void run_cast(void *out, const void *in, size_t n, int dd, int sd) { sg__cpu_cast(out, dd, in, sd, n); }
static void run_accum(void *out, const void *in, size_t n, int ad, int sd) { sg__cpu_accumulate(out, ad, in, sd, n); }
static void run_radd(void *out, const void *in, size_t n, int d, int unused) { sg__cpu_reduce_add(out, in, d, n); }

static void test_cast(void) {
  int ok = 1;
  for (size_t s = 0; s < NSIZES; s++)
    for (int sd = 0; sd < 3; sd++)
      for (int dd = 0; dd < 3; dd++) {
        size_t n = g_sizes[s];
        void *src = rand_buf(sd, n, 1), *zero = calloc(n * esize(dd) + 8, 1), *want = calloc(n * esize(dd) + 8, 1);
        for (size_t i = 0; i < n; i++) sg_elem_store(want, dd, i, sg_elem_load(src, sd, i));
        ok &= same_for_threads(run_cast, zero, dd, src, n, dd, sd, want);
        free(src), free(zero), free(want);
      }
  CHECK(ok, "cast: all 9 dtype pairs x sizes 0..100003 equal the naive loop, any thread count");
}

static void test_accumulate(void) {
  int ok = 1;
  for (size_t s = 0; s < NSIZES; s++)
    for (int ad = 0; ad < 3; ad++)
      for (int sd = 0; sd < 3; sd++) {
        size_t n = g_sizes[s];
        void *acc = rand_buf(ad, n, 0), *src = rand_buf(sd, n, 1), *want = dup_buf(acc, n * esize(ad));
        for (size_t i = 0; i < n; i++)
          sg_elem_store(want, ad, i, sg_elem_accumulate(sg_elem_load(want, ad, i), sg_elem_load(src, sd, i)));
        ok &= same_for_threads(run_accum, acc, ad, src, n, ad, sd, want);
        free(acc), free(src), free(want);
      }
  CHECK(ok, "accumulate: acc x src in f32/bf16/f16 x sizes equal the naive loop, any thread count");
}

static double load_any(const void *p, int d, size_t i) {
  return d == 3 ? ((const double *)p)[i] : (double)sg_elem_load(p, d, i);
}

static void test_reduce(void) {
  int ok_sum = 1, ok_alias = 1, ok_add = 1;
  for (size_t s = 0; s < NSIZES; s++)
    for (int d = 0; d < 4; d++)
      for (int nsrc = 1; nsrc <= 4; nsrc++) {
        size_t n = g_sizes[s], bytes = n * esize(d);
        void *src[4], *want = calloc(bytes + 8, 1);
        for (int k = 0; k < nsrc; k++) src[k] = rand_buf(d, n, 1);
        for (size_t i = 0; i < n; i++) { /* fp32 (or double) sums in source order */
          if (d == 3) {
            double acc = load_any(src[0], 3, i);
            for (int k = 1; k < nsrc; k++) acc = acc + load_any(src[k], 3, i);
            ((double *)want)[i] = acc;
          } else {
            float acc = sg_elem_load(src[0], d, i);
            for (int k = 1; k < nsrc; k++) acc = sg_elem_accumulate(acc, sg_elem_load(src[k], d, i));
            sg_elem_store(want, d, i, acc);
          }
        }
        for (size_t t = 0; t < NTHREADS; t++) {
          set_threads(g_threads[t]);
          void *dst = calloc(bytes + 8, 1);
          sg__cpu_reduce_sum(dst, (const void *const *)src, nsrc, d, n);
          ok_sum &= same_values(dst, want, d, n);
          free(dst);
          /* dst aliasing the last source */
          void *copy[4];
          for (int k = 0; k < nsrc; k++) copy[k] = dup_buf(src[k], bytes);
          sg__cpu_reduce_sum(copy[nsrc - 1], (const void *const *)copy, nsrc, d, n);
          ok_alias &= same_values(copy[nsrc - 1], want, d, n);
          for (int k = 0; k < nsrc; k++) free(copy[k]);
        }
        if (nsrc == 2) {
          ok_add &= same_for_threads(run_radd, src[0], d, src[1], n, d, 0, want);
        }
        set_threads(2);
        for (int k = 0; k < nsrc; k++) free(src[k]);
        free(want);
      }
  CHECK(ok_sum, "reduce_sum: f32/bf16/f16/f64, 1-4 sources, sums in source order, any thread count");
  CHECK(ok_alias, "reduce_sum: dst may be one of the sources");
  CHECK(ok_add, "reduce_add: dst + src rounded once, all dtypes");
}

/* One element of a fold by the element functions: the sum over the sources in order, rounded to
 * sd, then copied into (first) or added to the accumulator's value. */
static float fold_ref(const void *const *src, const int *dts, int nsrc, int sd, const void *acc,
                      int ad, int first, size_t i) {
  float t = sg_elem_load(src[0], dts[0], i);
  for (int k = 1; k < nsrc; k++) t = sg_elem_accumulate(t, sg_elem_load(src[k], dts[k], i));
  uint16_t h[2];
  if (sd != 0) {
    sg_elem_store(h, sd, 0, t);
    t = sg_elem_load(h, sd, 0);
  }
  return first ? t : sg_elem_accumulate(sg_elem_load(acc, ad, i), t);
}

/* One fold case: n elements of nsrc sources in sd (the first an fp32 partial when mixed) into an
 * ad accumulator; against the element functions for every thread count, and (not mixed)
 * against reduce_sum into a buffer followed by cast or accumulate. */
static int fold_case(size_t n, int ad, int sd, int nsrc, int mixed, int first) {
  void *src[4];
  int dts[4];
  for (int k = 0; k < nsrc; k++) {
    dts[k] = mixed && k == 0 ? 0 : sd;
    src[k] = rand_buf(dts[k], n, 1);
  }
  void *acc0 = rand_buf(ad, n, 1), *want = malloc(n * esize(ad) + 8);
  for (size_t i = 0; i < n; i++)
    sg_elem_store(want, ad, i, fold_ref((const void *const *)src, dts, nsrc, sd, acc0, ad, first, i));
  int ok = 1;
  for (size_t t = 0; t < NTHREADS; t++) {
    set_threads(g_threads[t]);
    void *acc = dup_buf(acc0, n * esize(ad));
    sg__cpu_reduce_fold(acc, ad, (const void *const *)src, mixed ? dts : NULL, nsrc, sd, n, first);
    ok &= same_values(acc, want, ad, n);
    free(acc);
  }
  set_threads(2);
  if (!mixed) {
    void *sum = malloc(n * esize(sd) + 8), *acc = dup_buf(acc0, n * esize(ad));
    sg__cpu_reduce_sum(sum, (const void *const *)src, nsrc, sd, n);
    if (first)
      sg__cpu_cast(acc, ad, sum, sd, n);
    else
      sg__cpu_accumulate(acc, ad, sum, sd, n);
    ok &= same_values(acc, want, ad, n);
    free(sum);
    free(acc);
  }
  for (int k = 0; k < nsrc; k++) free(src[k]);
  free(acc0);
  free(want);
  return ok;
}

static void test_reduce_fold(void) {
  int ok = 1, ok_mixed = 1;
  for (size_t s = 0; s < NSIZES; s++)
    for (int ad = 0; ad <= 1; ad++)
      for (int sd = 0; sd <= 2; sd++)
        for (int nsrc = 1; nsrc <= 4; nsrc++)
          for (int first = 0; first <= 1; first++) {
            ok &= fold_case(g_sizes[s], ad, sd, nsrc, 0, first);
            if (nsrc >= 2) ok_mixed &= fold_case(g_sizes[s], ad, sd, nsrc, 1, first);
          }
  CHECK(ok, "reduce_fold: f32/bf16 accumulator, f32/bf16/f16 sums of 1-4 sources, first or not: "
            "the bits of reduce_sum then cast/accumulate, any thread count");
  CHECK(ok_mixed, "reduce_fold: an fp32 partial first, then sources in the sum's dtype");
}

static void test_sumsq(void) {
  const size_t sizes[] = {0, 1, 63, 64, 65, 1000, 100003, 16384 * 300 + 5};
  int ok_det = 1, ok_val = 1, ok_nf = 1;
  double worst_rel = 0;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
    for (int d = 0; d < 3; d++) {
      size_t n = sizes[s];
      void *x = rand_buf(d, n, 0);
      size_t nbad = n > 100 ? 5 : n > 0 ? 1 : 0;
      for (size_t j = 0; j < nbad; j++) /* a few inf/NaN at distinct known places */
        sg_elem_store(x, d, (j * 7919 + (j == 1 ? 0 : n / 3)) % n, j & 1 ? -INFINITY : NAN);
      void *clean = rand_buf(d, n, 0);
      long double want = 0; /* a wider sum as the reference */
      for (size_t i = 0; i < n; i++) want += (long double)sg_elem_load(clean, d, i) * sg_elem_load(clean, d, i);
      double ss0 = 0, nf0 = 0, cs0 = 0, cn0 = 0;
      for (size_t t = 0; t < NTHREADS; t++) {
        set_threads(g_threads[t]);
        double ss, nf, cs, cn;
        sg__cpu_sumsq(x, d, n, &ss, &nf);
        sg__cpu_sumsq(clean, d, n, &cs, &cn);
        if (t == 0) ss0 = ss, nf0 = nf, cs0 = cs, cn0 = cn;
        ok_det &= memcmp(&cs, &cs0, 8) == 0 && memcmp(&cn, &cn0, 8) == 0 && nf == nf0 &&
                  (isnan(ss) == isnan(ss0));
      }
      ok_nf &= nf0 == (double)nbad && cn0 == 0.0 && (nbad == 0 || !isfinite(ss0));
      double rel = want > 0 ? (double)(fabsl((long double)cs0 - want) / want) : fabs(cs0);
      if (rel > worst_rel) worst_rel = rel;
      ok_val &= rel <= 1e-13;
      free(x), free(clean);
    }
  set_threads(2);
  CHECK(ok_det, "sumsq: same bits for 1, 2, 3, 7 threads (sizes up to 4.9M, 300 blocks)");
  CHECK(ok_val, "sumsq: equals a long double sum within 1e-13 relative (worst %.2e)", worst_rel);
  CHECK(ok_nf, "sumsq: counts inf/NaN exactly in the same pass");
}

/* ---- AdamW loop vs the element function ---------------------------------------------------- */

typedef struct adamw_case {
  int pdt, gdt, master, sr;
} adamw_case;

static void adamw_naive(const sg__adamw_args *a, const void *grad0) {
  sg_elem_adamw_k k = sg_elem_adamw_consts(a->group_scalar[0][SG__ADAMW_DECAY_FACTOR], a->scalar[SG__ADAMW_ONE_MINUS_BETA1], a->scalar[SG__ADAMW_BETA2],
                                           a->scalar[SG__ADAMW_ONE_MINUS_BETA2], a->group_scalar[0][SG__ADAMW_STEP_SIZE], a->scalar[SG__ADAMW_BC2_SQRT], a->scalar[SG__ADAMW_EPS]);
  for (int s = 0; s < a->nsegs; s++) {
    const sg__seg *sg = &a->segs[s];
    sg_elem_adamw_k ks = k;
    if (!sg->decay) ks.decay_factor = 1.0f;
    for (size_t i = 0; i < sg->len; i++) {
      size_t so = sg->shard_off + i, fo = sg->flat_off + i;
      float g = sg_elem_load(grad0, a->grad_dtype, so) * a->grad_scale;
      float p = a->master ? a->master[so] : sg_elem_load(a->param, a->param_dtype, fo);
      p = sg_elem_adamw(p, g, &a->state[SG__ADAMW_M][so], &a->state[SG__ADAMW_V][so], ks);
      if (a->master) a->master[so] = p;
      if (a->stochastic_rounding && a->param_dtype == 1)
        ((uint16_t *)a->param)[fo] = sg_elem_f32_to_bf16_sr(p, sg_elem_hash64(a->seed, a->step, sg->sr_index + i));
      else
        sg_elem_store(a->param, a->param_dtype, fo, p);
    }
  }
}

/* Segments with gaps (padding) between them in both the shard and the flat buffer. */
static int make_segs(sg__seg *segs, size_t total, size_t *shard_n, size_t *flat_n) {
  int ns = 0;
  size_t so = 3, fo = 64, left = total;
  while (left > 0 && ns < 16) {
    size_t len = ns == 15 ? left : 1 + rnd64() % (left < 40000 ? left : 40000);
    if (len > left) len = left;
    segs[ns].shard_off = so;
    segs[ns].flat_off = fo;
    segs[ns].len = len;
    segs[ns].decay = (int)(rnd32() & 1);
    segs[ns].sr_index = ((uint64_t)ns << 40) + 17;
    so += len + (rnd32() % 3) * 64;
    fo += len + 64 + rnd32() % 5;
    left -= len;
    ns++;
  }
  *shard_n = so + 64;
  *flat_n = fo + 64;
  return ns;
}

static int adamw_case_ok(adamw_case c, size_t total) {
  sg__seg segs[16];
  size_t sn, fn;
  int ns = make_segs(segs, total, &sn, &fn);
  void *param = rand_buf(c.pdt, fn, 0), *grad = rand_buf(c.gdt, sn, 0);
  float *master = c.master ? (float *)rand_buf(0, sn, 0) : NULL;
  float *m = (float *)rand_buf(0, sn, 0), *v = (float *)rand_buf(0, sn, 0);
  for (size_t i = 0; i < sn; i++) v[i] = fabsf(v[i]);
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = c.pdt;
  a.grad_dtype = c.gdt;
  a.segs = segs;
  a.nsegs = ns;
  a.grad_scale = 0.5f;
  a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] = 0.999f;
  a.scalar[SG__ADAMW_BETA1] = 0.9f, a.scalar[SG__ADAMW_ONE_MINUS_BETA1] = (float)(1 - (double)0.9f);
  a.scalar[SG__ADAMW_BETA2] = 0.999f, a.scalar[SG__ADAMW_ONE_MINUS_BETA2] = (float)(1 - (double)0.999f);
  a.group_scalar[0][SG__ADAMW_STEP_SIZE] = 1e-3f, a.scalar[SG__ADAMW_BC2_SQRT] = 0.05f, a.scalar[SG__ADAMW_EPS] = 1e-8f;
  a.stochastic_rounding = c.sr, a.seed = 99, a.step = 5;
  /* reference on copies */
  sg__adamw_args r = a;
  r.param = dup_buf(param, fn * esize(c.pdt));
  r.master = master ? (float *)dup_buf(master, sn * 4) : NULL;
  r.state[SG__ADAMW_M] = (float *)dup_buf(m, sn * 4), r.state[SG__ADAMW_V] = (float *)dup_buf(v, sn * 4);
  r.grad = grad;
  adamw_naive(&r, grad);
  int ok = 1;
  for (size_t t = 0; t < NTHREADS; t++) {
    set_threads(g_threads[t]);
    a.param = dup_buf(param, fn * esize(c.pdt));
    a.master = master ? (float *)dup_buf(master, sn * 4) : NULL;
    a.state[SG__ADAMW_M] = (float *)dup_buf(m, sn * 4), a.state[SG__ADAMW_V] = (float *)dup_buf(v, sn * 4);
    a.grad = grad;
    sg__cpu_adamw(&a);
    /* whole buffers compared: padding and gaps must be untouched in both */
    ok &= memcmp(a.param, r.param, fn * esize(c.pdt)) == 0;
    ok &= memcmp(a.state[SG__ADAMW_M], r.state[SG__ADAMW_M], sn * 4) == 0 && memcmp(a.state[SG__ADAMW_V], r.state[SG__ADAMW_V], sn * 4) == 0;
    if (master) ok &= memcmp(a.master, r.master, sn * 4) == 0;
    free(a.param), free(a.master), free(a.state[SG__ADAMW_M]), free(a.state[SG__ADAMW_V]);
  }
  set_threads(2);
  free(r.param), free(r.master), free(r.state[SG__ADAMW_M]), free(r.state[SG__ADAMW_V]);
  free(param), free(grad), free(master), free(m), free(v);
  return ok;
}

static void test_adamw_loop(void) {
  const adamw_case cases[] = {{0, 0, 0, 0}, {0, 1, 0, 0}, {0, 2, 0, 0}, {0, 0, 1, 0}, {1, 0, 1, 0},
                              {1, 0, 1, 1}, {1, 1, 1, 0}, {1, 1, 1, 1}, {1, 2, 1, 0}, {2, 0, 1, 0},
                              {2, 1, 1, 0}, {2, 2, 1, 0}};
  const size_t totals[] = {1, 65, 1000, 150001};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int ok = 1;
    for (size_t t = 0; t < sizeof totals / sizeof totals[0]; t++) ok &= adamw_case_ok(cases[c], totals[t]);
    CHECK(ok, "adamw loop = element function: param %s grad %s%s%s, gaps untouched, any thread count",
          dname(cases[c].pdt), dname(cases[c].gdt), cases[c].master ? " +master" : "",
          cases[c].sr ? " +SR" : "");
  }
}

/* The AdamW threads' segment cursor, moved to elements in any order (libomp's default dynamic
 * schedule steals blocks, so a thread's next block may lie before its last one): always the
 * first segment holding the element, as a scan from the start finds it. Empty segments too. */
static void test_seg_seek(void) {
  sg__seg segs[40];
  size_t total = 0;
  memset(segs, 0, sizeof segs);
  for (int k = 0; k < 40; k++) total += segs[k].len = rnd32() % 4 == 0 ? 0 : 1 + rnd32() % 50000;
  int ok = 1, s = 0;
  size_t pos = 0;
  for (int q = 0; q < 3000; q++) {
    /* a random element, then a sweep down from the end */
    const size_t lo = q < 2000 ? rnd64() % (total + 10) : (total + 10) * (size_t)(2999 - q) / 1000;
    int ref = 0;
    size_t at = 0;
    while (ref < 40 && at + segs[ref].len <= lo) at += segs[ref++].len;
    sg__cpu_seg_seek(segs, 40, lo, &s, &pos);
    ok &= s == ref && pos == at;
  }
  CHECK(ok, "segment cursor: first segment holding any element, moved back or forward (%zu elements)", total);
}

/* ---- CPU device ---------------------------------------------------------------------------- */

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

typedef struct job_log {
  atomic_int next;    /* slots handed out, in run order */
  int order[200];     /* job ids in the order they ran */
  atomic_int release; /* a blocking job spins until this is set */
  atomic_int ran;
} job_log;

typedef struct job {
  job_log *log;
  int id;
  int fail;   /* return SG_ERR_COMM with a message */
  int block;  /* wait for log->release */
  int sleep;  /* ms */
  int *word;  /* written with 1 at the end */
} job;

static sg_status job_fn(void *arg) {
  job *j = (job *)arg;
  if (j->sleep) sleep_ms(j->sleep);
  while (j->block && !atomic_load(&j->log->release)) sleep_ms(1);
  int slot = atomic_fetch_add(&j->log->next, 1);
  if (slot < 200) j->log->order[slot] = j->id;
  atomic_fetch_add(&j->log->ran, 1);
  if (j->word) *j->word = 1;
  if (j->fail) return sg__err(SG_ERR_COMM, "job %d failed on purpose", j->id);
  return SG_OK;
}

static void test_device_memory(void) {
  sg__device *d = NULL;
  CHECK(sg__device_cpu_create(0, 1, &d) == SG_OK && d && d->kind == SG_DEVICE_CPU, "cpu device: create");
  if (!d) return;
  int aligned = 1;
  void *p[5] = {0};
  for (int i = 0; i < 5; i++) {
    aligned &= d->ops->alloc(d, (size_t)(i * 1000), &p[i]) == SG_OK && p[i] && ((uintptr_t)p[i] % 64) == 0;
  }
  for (int i = 0; i < 5; i++) d->ops->free(d, p[i]);
  CHECK(aligned, "cpu device: alloc gives 64-byte aligned blocks, also for 0 bytes");
  sg__device_fail_alloc_after(2);
  void *a = NULL, *b = NULL, *c = NULL, *e = NULL;
  sg_status s1 = d->ops->alloc(d, 64, &a), s2 = d->ops->host_alloc(d, 64, &b);
  sg_status s3 = d->ops->alloc(d, 64, &c);
  int msg = strstr(sg_last_error(), "injected") != NULL;
  sg_status s4 = d->ops->alloc(d, 64, &e);
  CHECK(s1 == SG_OK && s2 == SG_OK && s3 == SG_ERR_OUT_OF_MEMORY && !c && msg && s4 == SG_OK,
        "cpu device: fail_alloc_after(2): two allocations succeed, the third fails once");
  d->ops->free(d, a), d->ops->host_free(d, b), d->ops->free(d, e);
  sg__device_fail_alloc_after(-1);
  CHECK(d->ops->set_stream(d, NULL) == SG_OK && d->ops->set_stream(d, (void *)d) == SG_ERR_UNSUPPORTED &&
            d->ops->sync(d, INT64_MAX) == SG_OK,
        "cpu device: set_stream(NULL) ok, a stream is unsupported; sync ok");
  float x[4] = {1, 2, 3, 4}, y[4];
  uint16_t h[4];
  int kern = d->ops->copy(d, SG_Q_COMPUTE, y, x, sizeof x, SG_COPY_H2D) == SG_OK && y[3] == 4.0f;
  kern &= d->ops->cast(d, SG_Q_COMPUTE, h, SG_BF16, x, SG_F32, 4) == SG_OK && h[1] == 0x4000u;
  kern &= d->ops->zero(d, SG_Q_COMPUTE, y, sizeof y) == SG_OK && y[0] == 0.0f && y[3] == 0.0f;
  kern &= d->ops->cast(d, SG_Q_COMPUTE, h, 7, x, SG_F32, 4) == SG_ERR_INVALID_ARGUMENT;
  kern &= d->ops->accumulate(d, SG_Q_COMPUTE, h, 3, x, SG_F32, 4) == SG_ERR_INVALID_ARGUMENT;
  kern &= d->ops->zero(d, (sg__queue)5, y, 4) == SG_ERR_INVALID_ARGUMENT;
  double ss = 0, nf = 0;
  kern &= d->ops->sumsq(d, SG_Q_COMPUTE, x, SG_F32, 4, &ss, &nf) == SG_OK && ss == 30.0 && nf == 0.0;
  CHECK(kern, "cpu device: copy, zero, cast, sumsq through the vtable; bad dtype/queue rejected");
  d->ops->destroy(d);
}

/* zero_release: zeros from byte `off` for `len` bytes of a written block, every other byte
 * kept, and the whole pages inside off RSS until written again (when len is large). */
static void test_device_zero_release(void) {
  sg__device *d = NULL;
  if (sg__device_cpu_create(0, 1, &d) != SG_OK) {
    CHECK(0, "cpu device: create");
    return;
  }
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = (size_t)4 << 20;
  unsigned char *blk = NULL;
  CHECK(d->ops->alloc(d, bytes, (void **)&blk) == SG_OK && blk, "zero_release: 4 MiB block");
  if (!blk) {
    d->ops->destroy(d);
    return;
  }
  const size_t cases[][2] = {{100, 300000}, {0, bytes}, {8 * page, 16 * page}, {5, 1000},
                             {page - 1, 64 << 10}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const size_t off = cases[c][0], len = cases[c][1];
    memset(blk, 0xA5, bytes);
    sg_status st = d->ops->zero_release(d, SG_Q_COMPUTE, blk + off, len);
    size_t bad = 0;
    for (size_t i = 0; i < bytes; i++) bad += blk[i] != ((i >= off && i < off + len) ? 0 : 0xA5);
    CHECK(st == SG_OK && bad == 0, "zero_release(%zu, %zu): zeros inside, 0xA5 outside (%zu bytes "
          "wrong)", off, len, bad);
  }
  /* page-aligned block (the mapping's data starts one header into its first page) */
  unsigned char *first = (unsigned char *)(((uintptr_t)blk + page - 1) / page * page);
  const size_t span = 512 * page;
  memset(blk, 1, bytes);
  long before = sg_test_resident_pages(first, span, page);
  sg_status st = d->ops->zero_release(d, SG_Q_COMPUTE, first, span);
  long after = sg_test_resident_pages(first, span, page);
  first[3 * page] = 7; /* written again: resident again, the rest still zero */
  long again = sg_test_resident_pages(first, span, page);
  CHECK(st == SG_OK && before == 512 && after == 0 && again == 1 && first[0] == 0 &&
            first[span - 1] == 0 && first[span] == 1,
        "zero_release: 512 written pages resident, none after, one once written (%ld, %ld, %ld)",
        before, after, again);
  memset(blk, 1, bytes);
  st = d->ops->zero_release(d, SG_Q_COMPUTE, first, 8 * page);
  CHECK(st == SG_OK && sg_test_resident_pages(first, 8 * page, page) == 8 && first[0] == 0,
        "zero_release: a range below 64 KiB is written with zeros (stays resident)");
  CHECK(d->ops->zero_release(NULL, SG_Q_COMPUTE, blk, 4) == SG_ERR_INVALID_ARGUMENT &&
            d->ops->zero_release(d, SG_Q_COMPUTE, NULL, 4) == SG_ERR_INVALID_ARGUMENT &&
            d->ops->zero_release(d, (sg__queue)5, blk, 4) == SG_ERR_INVALID_ARGUMENT &&
            d->ops->zero_release(d, SG_Q_COMM, blk, 0) == SG_OK,
        "zero_release: NULL device, NULL dst, bad queue refused; 0 bytes on SG_Q_COMM ok");
  d->ops->free(d, blk);
  d->ops->destroy(d);
}

/* Whether the system gives transparent huge pages to regions marked MADV_HUGEPAGE: its
 * setting is "always" or "madvise" (not "never", and not absent). */
static int thp_for_madvise(void) {
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  char buf[128] = "";
  if (!f) return 0;
  const int ok = fgets(buf, sizeof buf, f) != NULL;
  fclose(f);
  return ok && (strstr(buf, "[always]") || strstr(buf, "[madvise]"));
}

/* zero_release marks the 2 MiB-aligned interior of a released range of 16 MiB or more for huge
 * pages: one write there brings back the whole 2 MiB (one fault instead of 512), and pages
 * outside the interior, or of smaller ranges, still come back one by one. Skipped where the system has no transparent huge pages or
 * SG_CPU_HUGEPAGES=0 turns the hint off. */
static void test_device_zero_release_huge(void) {
  const char *e = getenv("SG_CPU_HUGEPAGES");
  if (!thp_for_madvise() || (e && e[0] == '0')) {
    printf("skip zero_release huge pages: no transparent huge pages for madvise, or "
           "SG_CPU_HUGEPAGES=0\n");
    return;
  }
  sg__device *d = NULL;
  if (sg__device_cpu_create(0, 1, &d) != SG_OK) {
    CHECK(0, "cpu device: create");
    return;
  }
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), huge = (size_t)2 << 20, bytes = 10 * huge;
  unsigned char *blk = NULL;
  if (d->ops->alloc(d, bytes, (void **)&blk) != SG_OK || !blk) {
    CHECK(0, "zero_release huge: 20 MiB block");
    d->ops->destroy(d);
    return;
  }
  memset(blk, 3, bytes);
  unsigned char *h = (unsigned char *)(((uintptr_t)blk + huge - 1) / huge * huge); /* interior */
  unsigned char *p0 = (unsigned char *)(((uintptr_t)blk + page - 1) / page * page);
  sg_status st = d->ops->zero_release(d, SG_Q_COMPUTE, blk, bytes);
  const long none = sg_test_resident_pages(h, huge, page);
  h[5] = 1;
  const long whole = sg_test_resident_pages(h, huge, page);
  const int edge = p0 < h; /* a page before the interior (the block is rarely 2 MiB-aligned) */
  if (edge) p0[1] = 1;
  const long one = edge ? sg_test_resident_pages(p0, page * 2 <= (size_t)(h - p0) ? 2 * page : page, page) : 1;
  CHECK(st == SG_OK && none == 0 && whole == 512 && one == 1 && h[0] == 0 && h[5] == 1,
        "zero_release: the 2 MiB-aligned interior refills as one huge page (%ld -> %ld pages "
        "after one write), a page outside it alone (%ld)",
        none, whole, one);
  /* a range under 16 MiB (of a block never marked: the mark stays with the memory) is not
   * marked: its pages come back one by one */
  unsigned char *b2 = NULL;
  if (d->ops->alloc(d, bytes, (void **)&b2) == SG_OK && b2) {
    memset(b2, 3, bytes);
    unsigned char *h2 = (unsigned char *)(((uintptr_t)b2 + huge - 1) / huge * huge);
    st = d->ops->zero_release(d, SG_Q_COMPUTE, h2, 8 * huge - 1);
    h2[huge + 5] = 1;
    const long small = sg_test_resident_pages(h2 + huge, huge, page);
    CHECK(st == SG_OK && small == 1,
          "zero_release: a range under 16 MiB refills page by page (%ld)", small);
    d->ops->free(d, b2);
  } else {
    CHECK(0, "zero_release huge: a second 20 MiB block");
  }
  d->ops->free(d, blk);
  d->ops->destroy(d);
}

static void test_device_queue(void) {
  sg__device *d = NULL;
  if (sg__device_cpu_create(1, 1, &d) != SG_OK) {
    CHECK(0, "cpu device: create threaded");
    return;
  }
  static job_log log;
  static job jobs[200];
  memset(&log, 0, sizeof log);
  uint64_t t = 0;
  int tickets_ok = 1;
  for (int i = 0; i < 100; i++) {
    jobs[i] = (job){&log, i, 0, 0, 0, NULL};
    tickets_ok &= d->ops->comm_submit(d, job_fn, NULL, &jobs[i], &t) == SG_OK && t == (uint64_t)i + 1;
  }
  sg_status st = d->ops->comm_wait(d, 100, sg__now_ms() + 10000);
  int fifo = atomic_load(&log.ran) == 100;
  for (int i = 0; i < 100; i++) fifo &= log.order[i] == i;
  CHECK(tickets_ok && st == SG_OK && fifo, "comm queue: tickets 1..100, jobs run in FIFO order");
  CHECK(d->ops->comm_wait(d, 101, INT64_MAX) == SG_ERR_INVALID_ARGUMENT,
        "comm queue: waiting for a ticket never issued is an error");

  /* deadline */
  jobs[100] = (job){&log, 100, 0, 1, 0, NULL};
  d->ops->comm_submit(d, job_fn, NULL, &jobs[100], &t);
  int64_t t0 = sg__now_ms();
  st = d->ops->comm_wait(d, t, t0 + 60);
  int64_t waited = sg__now_ms() - t0;
  int msg = strstr(sg_last_error(), "deadline") != NULL;
  atomic_store(&log.release, 1);
  sg_status st2 = d->ops->compute_wait_comm(d, t, INT64_MAX);
  CHECK(st == SG_ERR_TIMEOUT && msg && waited >= 55 && st2 == SG_OK,
        "comm queue: a blocked job times out at the deadline (%lld ms) with a message, then completes",
        (long long)waited);

  /* ordering of SG_Q_COMM work issued from the host thread */
  int word = 0;
  float zeroed = 1.0f;
  jobs[101] = (job){&log, 101, 0, 0, 30, &word};
  d->ops->comm_submit(d, job_fn, NULL, &jobs[101], &t);
  st = d->ops->zero(d, SG_Q_COMM, &zeroed, sizeof zeroed);
  CHECK(st == SG_OK && word == 1 && zeroed == 0.0f,
        "comm queue: SG_Q_COMM work from the host runs after the pending jobs");

  /* failure: the first failing job's status and text stick; later jobs are skipped */
  int before = atomic_load(&log.ran);
  jobs[102] = (job){&log, 102, 1, 0, 0, NULL};
  jobs[103] = (job){&log, 103, 1, 0, 0, NULL};
  jobs[104] = (job){&log, 104, 0, 0, 0, NULL};
  uint64_t tf, tl;
  d->ops->comm_submit(d, job_fn, NULL, &jobs[102], &tf);
  d->ops->comm_submit(d, job_fn, NULL, &jobs[103], &tl);
  d->ops->comm_submit(d, job_fn, NULL, &jobs[104], &tl);
  sg__err_clear();
  st = d->ops->comm_wait(d, tl, sg__now_ms() + 10000);
  int text = strstr(sg_last_error(), "job 102 failed") != NULL;
  sg__err_clear();
  st2 = d->ops->comm_wait(d, tf - 1, INT64_MAX); /* an earlier ticket reports it too */
  int text2 = strstr(sg_last_error(), "job 102 failed") != NULL;
  CHECK(st == SG_ERR_COMM && text && st2 == SG_ERR_COMM && text2 && atomic_load(&log.ran) == before + 1,
        "comm queue: first failure (status and text from the worker) returned by every later wait; "
        "later jobs skipped");
  d->ops->destroy(d);
}

static void test_device_inline_and_destroy(void) {
  sg__device *d = NULL;
  static job_log log;
  static job jobs[20];
  memset(&log, 0, sizeof log);
  int ok = sg__device_cpu_create(0, 0, &d) == SG_OK;
  uint64_t t = 0;
  jobs[0] = (job){&log, 0, 0, 0, 0, NULL};
  jobs[1] = (job){&log, 1, 1, 0, 0, NULL};
  jobs[2] = (job){&log, 2, 0, 0, 0, NULL};
  ok &= d->ops->comm_submit(d, job_fn, NULL, &jobs[0], &t) == SG_OK && t == 1 && atomic_load(&log.ran) == 1;
  sg_status st = d->ops->comm_submit(d, job_fn, NULL, &jobs[1], &t);
  sg__err_clear();
  sg_status st2 = d->ops->comm_submit(d, job_fn, NULL, &jobs[2], &t);
  int text = strstr(sg_last_error(), "job 1 failed") != NULL;
  /* refused at submit (no ticket): the job is still the caller's */
  ok &= st == SG_ERR_COMM && st2 == SG_ERR_COMM && text && t == 0 && atomic_load(&log.ran) == 2;
  ok &= d->ops->comm_wait(d, 2, 0) == SG_ERR_COMM;
  d->ops->destroy(d);
  CHECK(ok, "inline comm (threaded_comm = 0): jobs run in submit, failure sticks, later jobs skipped");

  /* destroy with jobs still queued: they all run before the worker is joined */
  memset(&log, 0, sizeof log);
  ok = sg__device_cpu_create(0, 1, &d) == SG_OK;
  for (int i = 0; i < 10; i++) {
    jobs[i] = (job){&log, i, 0, 0, 3, NULL};
    ok &= d->ops->comm_submit(d, job_fn, NULL, &jobs[i], &t) == SG_OK;
  }
  d->ops->destroy(d);
  CHECK(ok && atomic_load(&log.ran) == 10, "destroy runs the pending jobs and joins the worker");
}

int main(void) {
  set_threads(2);
  test_bf16_all();
  test_f16_all();
  test_rounding();
  test_stochastic();
  test_cast();
  test_accumulate();
  test_reduce();
  test_reduce_fold();
  test_sumsq();
  test_adamw_loop();
  test_seg_seek();
  test_device_memory();
  test_device_zero_release();
  test_device_zero_release_huge();
  test_device_queue();
  test_device_inline_and_destroy();
  return sg_test_summary("");
}
