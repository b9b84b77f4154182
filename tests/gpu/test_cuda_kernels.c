/* GPU only (tests/gpu/run.sh; not in ctest): every CUDA kernel against the CPU kernels on the
 * same inputs. accumulate, cast, the outer steps, the codes, reduce_sum and adamw must give the
 * same bits (the build uses -fmad=false and the shared element math of kernels/sg_elem.h); a NaN
 * counts as equal to any NaN, since the GPU's float add returns a canonical NaN where x86 keeps
 * the operand's payload.
 * sumsq must equal the CPU's within 1e-12 relative, with the same non-finite count. Results
 * must not depend on the launch shape: the launchers are also called directly with different
 * grid limits and must give the same bits.
 *
 * --quick: small sizes (for compute-sanitizer). */
#include <math.h>   /* fabs, isnan, pow, sqrt */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcpy, memcmp, strcmp */

#include <cuda_runtime.h> /* the test's own stream for direct launcher calls */

#include "cpu/sg_cpu_kernels.h"     /* sg__cpu_* references */
#include "cuda/sg_cuda_kernels.h"   /* launchers, for launch-shape checks */
#include "device/sg_device.h"      /* sg__device_cuda_create */
#include "sg_elem.h"               /* conversions, for NaN tests */
#include "../sg_test_check.h"      /* CHECK */

static int g_quick;
static sg__device *g_dev;
static cudaStream_t g_stream;

static void check(int ok, const char *fmt_what, const char *detail) {
  CHECK(ok, "%s %s", fmt_what, detail ? detail : "");
}

/* ---- helpers ------------------------------------------------------------------------------ */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static float rnd_unit(void) { return (float)((double)(rnd() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }

static size_t esize(int dt) { return dt == 3 ? 8u : dt == 0 ? 4u : 2u; }

/* Random values of dtype dt; with specials, some raw bit patterns (NaN, inf, subnormals). */
static void fill_random(void *p, int dt, size_t n, float scale, int specials) {
  for (size_t i = 0; i < n; i++) {
    int raw = specials && rnd() % 16 == 0;
    if (dt == 3) {
      ((double *)p)[i] = (double)rnd_unit() * scale;
    } else if (dt == 0) {
      uint32_t u = (uint32_t)rnd();
      float f = rnd_unit() * scale;
      if (raw) memcpy(&f, &u, 4);
      ((float *)p)[i] = f;
    } else {
      uint16_t h = (uint16_t)rnd();
      if (!raw)
        h = dt == 1 ? sg_elem_f32_to_bf16(rnd_unit() * scale)
                    : sg_elem_f32_to_f16(rnd_unit() * scale);
      ((uint16_t *)p)[i] = h;
    }
  }
}

static int is_nan(const void *p, int dt, size_t i) {
  if (dt == 3) return isnan(((const double *)p)[i]);
  return !sg_elem_isfinite(sg_elem_load(p, dt, i)) &&
         sg_elem_load(p, dt, i) != sg_elem_load(p, dt, i);
}

/* Bitwise equal, except that any NaN equals any NaN. Returns the first differing index or n. */
static size_t first_diff(const void *a, const void *b, int dt, size_t n) {
  const size_t es = esize(dt);
  for (size_t i = 0; i < n; i++) {
    if (memcmp((const char *)a + i * es, (const char *)b + i * es, es) == 0) continue;
    if (is_nan(a, dt, i) && is_nan(b, dt, i)) continue;
    return i;
  }
  return n;
}

static void *dev_alloc(size_t bytes) {
  void *p = NULL;
  if (g_dev->ops->alloc(g_dev, bytes, &p) != SG_OK) {
    printf("FATAL alloc %zu: %s\n", bytes, sg_last_error());
    exit(2);
  }
  return p;
}

static void h2d(void *d, const void *h, size_t b) {
  if (g_dev->ops->copy(g_dev, SG_Q_COMPUTE, d, h, b, SG_COPY_H2D) != SG_OK) {
    printf("FATAL h2d: %s\n", sg_last_error());
    exit(2);
  }
}

static void d2h(void *h, const void *d, size_t b) {
  if (g_dev->ops->copy(g_dev, SG_Q_COMPUTE, h, d, b, SG_COPY_D2H) != SG_OK) {
    printf("FATAL d2h: %s\n", sg_last_error());
    exit(2);
  }
}

static void compare(const void *cpu, const void *gpu, int dt, size_t n, const char *what) {
  char detail[160];
  size_t i = first_diff(cpu, gpu, dt, n);
  if (i == n) {
    snprintf(detail, sizeof detail, "(n %zu, dtype %d)", n, dt);
  } else {
    unsigned long long a = 0, b = 0;
    memcpy(&a, (const char *)cpu + i * esize(dt), esize(dt));
    memcpy(&b, (const char *)gpu + i * esize(dt), esize(dt));
    snprintf(detail, sizeof detail, "(n %zu, dtype %d): first difference at %zu: cpu %llx gpu %llx",
             n, dt, i, a, b);
  }
  check(i == n, what, detail);
}

static const size_t k_sizes[] = {1, 3, 4, 5, 63, 1000, 4097, 100003, (1u << 20) + 7};
static size_t nsizes(void) { return g_quick ? 6 : sizeof k_sizes / sizeof k_sizes[0]; }

/* ---- accumulate / cast ----------------------------------------------------------------------- */

/* off: element offset of both arrays from an aligned base, to cover the unaligned paths. */
static void test_accumulate_one(int adt, int sdt, size_t n, size_t off) {
  const size_t ab = (n + off) * esize(adt), sb = (n + off) * esize(sdt);
  void *ha = malloc(ab), *hs = malloc(sb), *got = malloc(ab);
  fill_random(ha, adt, n + off, 8.0f, 1);
  fill_random(hs, sdt, n + off, 8.0f, 1);
  char *da = dev_alloc(ab), *ds = dev_alloc(sb);
  h2d(da, ha, ab);
  h2d(ds, hs, sb);
  sg_status st = g_dev->ops->accumulate(g_dev, SG_Q_COMPUTE, da + off * esize(adt), adt,
                                        ds + off * esize(sdt), sdt, n);
  sg__cpu_accumulate((char *)ha + off * esize(adt), adt, (char *)hs + off * esize(sdt), sdt, n);
  d2h(got, da, ab);
  char what[96];
  snprintf(what, sizeof what, "accumulate acc %d src %d off %zu", adt, sdt, off);
  check(st == SG_OK, what, "launch");
  compare(ha, got, adt, n + off, what);
  g_dev->ops->free(g_dev, da);
  g_dev->ops->free(g_dev, ds);
  free(ha), free(hs), free(got);
}

static void test_cast_one(int ddt, int sdt, size_t n, size_t off) {
  const size_t db = (n + off) * esize(ddt), sb = (n + off) * esize(sdt);
  void *hd = calloc(1, db), *hs = malloc(sb), *got = malloc(db);
  fill_random(hs, sdt, n + off, 70000.0f, 1); /* beyond f16's range too */
  char *dd = dev_alloc(db), *ds = dev_alloc(sb);
  h2d(dd, hd, db);
  h2d(ds, hs, sb);
  sg_status st = g_dev->ops->cast(g_dev, SG_Q_COMPUTE, dd + off * esize(ddt), ddt,
                                  ds + off * esize(sdt), sdt, n);
  sg__cpu_cast((char *)hd + off * esize(ddt), ddt, (char *)hs + off * esize(sdt), sdt, n);
  d2h(got, dd, db);
  char what[96];
  snprintf(what, sizeof what, "cast dst %d src %d off %zu", ddt, sdt, off);
  check(st == SG_OK, what, "launch");
  /* a same-dtype cast is a copy: every bit, NaN payloads included */
  if (ddt == sdt)
    check(memcmp(hd, got, db) == 0, what, "bit-exact copy");
  else
    compare(hd, got, ddt, n + off, what);
  g_dev->ops->free(g_dev, dd);
  g_dev->ops->free(g_dev, ds);
  free(hd), free(hs), free(got);
}

static void test_elementwise(void) {
  for (size_t k = 0; k < nsizes(); k++)
    for (size_t off = 0; off < 2; off++) {
      for (int adt = 0; adt < 3; adt++)
        for (int sdt = 0; sdt < 3; sdt++) test_accumulate_one(adt, sdt, k_sizes[k], off);
      for (int ddt = 0; ddt < 3; ddt++)
        for (int sdt = 0; sdt < 3; sdt++) test_cast_one(ddt, sdt, k_sizes[k], off);
    }
}

/* ---- outer steps (DiLoCo) ------------------------------------------------------------------ */

/* The device's outer_delta and outer_step against the CPU loops, bitwise (specials included). */
static void test_outer_one(size_t n, size_t off) {
  const size_t b = (n + off) * 4u;
  float *po = malloc(b), *th = malloc(b), *m = malloc(b), *ds = malloc(b), *d = calloc(1, b);
  float *got = malloc(b);
  fill_random(po, 0, n + off, 2.0f, 1);
  fill_random(th, 0, n + off, 2.0f, 1);
  fill_random(m, 0, n + off, 0.5f, 0);
  fill_random(ds, 0, n + off, 3.0f, 1);
  float *dpo = dev_alloc(b), *dth = dev_alloc(b), *dm = dev_alloc(b), *dds = dev_alloc(b),
        *dd = dev_alloc(b);
  h2d(dpo, po, b), h2d(dth, th, b), h2d(dm, m, b), h2d(dds, ds, b), h2d(dd, d, b);
  char what[96];
  snprintf(what, sizeof what, "outer_delta off %zu", off);
  sg_status st = g_dev->ops->outer_delta(g_dev, SG_Q_COMPUTE, dd + off, dpo + off, dth + off, n);
  sg__cpu_outer_delta(d + off, po + off, th + off, n);
  check(st == SG_OK, what, "launch");
  d2h(got, dd, b);
  compare(d, got, 0, n + off, what);
  snprintf(what, sizeof what, "outer_step off %zu", off);
  st = g_dev->ops->outer_step(g_dev, SG_Q_COMPUTE, dpo + off, dm + off, dth + off, dds + off, n, 3,
                              0.7f, 0.9f);
  sg__cpu_outer_step(po + off, m + off, th + off, ds + off, n, 3, 0.7f, 0.9f);
  check(st == SG_OK, what, "launch");
  float *const host[3] = {po, m, th}, *const dev[3] = {dpo, dm, dth};
  for (int k = 0; k < 3; k++) {
    d2h(got, dev[k], b);
    compare(host[k], got, 0, n + off, what);
    g_dev->ops->free(g_dev, dev[k]);
  }
  g_dev->ops->free(g_dev, dds);
  g_dev->ops->free(g_dev, dd);
  free(po), free(th), free(m), free(ds), free(d), free(got);
}

static void test_outer(void) {
  for (size_t k = 0; k < nsizes(); k++)
    for (size_t off = 0; off < 2; off++) test_outer_one(k_sizes[k], off);
}

/* ---- blockwise codes (the replica codecs) ----------------------------------------------- */

/* The device's code_encode (bytes and residuals) and code_decode (plain and added) against the
 * CPU loops, bitwise, specials included (a NaN or inf block: NaN scale, zero residuals). */
static void test_codes_one(size_t n, int bits) {
  const size_t fb = n * 4u, cb = sg__cpu_code_bytes(n, bits);
  float *src = malloc(fb), *r = malloc(fb), *got = malloc(fb), *dst = malloc(fb);
  unsigned char *codes = malloc(cb), *gc = malloc(cb);
  fill_random(src, 0, n, 5.0f, 1);
  fill_random(r, 0, n, 0.01f, 0);
  fill_random(dst, 0, n, 1.0f, 0);
  float *dsrc = dev_alloc(fb), *dr = dev_alloc(fb), *dd = dev_alloc(fb);
  unsigned char *dc = dev_alloc(cb);
  h2d(dsrc, src, fb), h2d(dr, r, fb), h2d(dd, dst, fb);
  char what[96];
  snprintf(what, sizeof what, "code_encode bits %d", bits);
  sg_status st = g_dev->ops->code_encode(g_dev, SG_Q_COMPUTE, dc, dsrc, dr, n, bits);
  sg__cpu_code_encode(codes, src, r, n, bits);
  check(st == SG_OK, what, "launch");
  d2h(gc, dc, cb);
  check(memcmp(codes, gc, cb) == 0, what, "the same bytes");
  d2h(got, dr, fb);
  compare(r, got, 0, n, what);
  for (int add = 0; add < 2; add++) {
    snprintf(what, sizeof what, "code_decode bits %d add %d", bits, add);
    st = g_dev->ops->code_decode(g_dev, SG_Q_COMPUTE, dd, dc, n, bits, add);
    sg__cpu_code_decode(dst, codes, n, bits, add);
    check(st == SG_OK, what, "launch");
    d2h(got, dd, fb);
    compare(dst, got, 0, n, what);
  }
  g_dev->ops->free(g_dev, dsrc), g_dev->ops->free(g_dev, dr), g_dev->ops->free(g_dev, dd);
  g_dev->ops->free(g_dev, dc);
  free(src), free(r), free(got), free(dst), free(codes), free(gc);
}

static void test_codes(void) {
  for (size_t k = 0; k < nsizes(); k++)
    for (int bits = 8; bits >= 4; bits -= 4) test_codes_one(k_sizes[k], bits);
}

/* ---- reduce_sum --------------------------------------------------------------------------- */

static void test_reduce_one(int dt, int nsrc, size_t n, int in_place) {
  const size_t b = n * esize(dt);
  void **hs = malloc((size_t)nsrc * sizeof *hs);
  void **ds = malloc((size_t)nsrc * sizeof *ds);
  for (int k = 0; k < nsrc; k++) {
    hs[k] = malloc(b);
    fill_random(hs[k], dt, n, 4.0f, dt != 3);
    ds[k] = dev_alloc(b);
    h2d(ds[k], hs[k], b);
  }
  void *hd = malloc(b), *got = malloc(b);
  void *dd = in_place ? ds[0] : dev_alloc(b);
  sg__cpu_reduce_sum(hd, (const void *const *)hs, nsrc, dt, n);
  sg_status st =
      g_dev->ops->reduce_sum(g_dev, SG_Q_COMPUTE, dd, (const void *const *)ds, nsrc, dt, n);
  d2h(got, dd, b);
  char what[96];
  snprintf(what, sizeof what, "reduce_sum dtype %d nsrc %d%s", dt, nsrc,
           in_place ? " in place" : "");
  check(st == SG_OK, what, "launch");
  compare(hd, got, dt, n, what);
  for (int k = 0; k < nsrc; k++) {
    g_dev->ops->free(g_dev, ds[k]);
    free(hs[k]);
  }
  if (!in_place) g_dev->ops->free(g_dev, dd);
  free(hs), free(ds), free(hd), free(got);
}

static void test_reduce_sum(void) {
  static const int nsrcs[] = {1, 2, 3, 8, 40};
  for (int dt = 0; dt < 4; dt++)
    for (size_t i = 0; i < sizeof nsrcs / sizeof nsrcs[0]; i++) {
      size_t n = g_quick ? 1001 : (nsrcs[i] > 8 ? 100003 : (1u << 20) + 3);
      test_reduce_one(dt, nsrcs[i], n, 0);
      test_reduce_one(dt, nsrcs[i], n, 1);
    }
  char what[64];
  snprintf(what, sizeof what, "reduce_sum nsrc %d rejected", SG__CUDA_MAX_SRCS + 1);
  const void *one[1] = {NULL};
  check(g_dev->ops->reduce_sum(g_dev, SG_Q_COMPUTE, (void *)one, one, SG__CUDA_MAX_SRCS + 1, 0,
                               4) == SG_ERR_INVALID_ARGUMENT,
        what, NULL);
}

/* ---- sumsq -------------------------------------------------------------------------------- */

static int close_rel(double a, double b, double tol) {
  if (a == b) return 1;
  if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
  return fabs(a - b) <= tol * fabs(a);
}

/* The launcher on the test's stream with a given grid limit. */
static void sumsq_direct(const void *dx, int dt, size_t n, int max_blocks, double out[2]) {
  void *scratch = NULL;
  cudaMalloc(&scratch, sg__cuda_sumsq_scratch_bytes(n));
  sg__cuda_launch L = {(void *)g_stream, max_blocks};
  int rc = sg__cuda_sumsq(L, dx, dt, n, scratch, (double *)scratch);
  cudaMemcpyAsync(out, scratch, 2 * sizeof(double), cudaMemcpyDeviceToHost, g_stream);
  cudaStreamSynchronize(g_stream);
  cudaFree(scratch);
  if (rc != 0) out[0] = out[1] = -1.0;
}

static void test_sumsq_one(int dt, size_t n, int specials) {
  const size_t b = n * esize(dt);
  void *hx = malloc(b);
  fill_random(hx, dt, n, 3.0f, 0);
  if (specials) /* a few infinities and NaNs */
    for (size_t i = 0; i < n; i += n / 3 + 1) {
      float v = (i / (n / 3 + 1)) % 2 ? INFINITY : NAN;
      if (dt == 0)
        ((float *)hx)[i] = v;
      else
        ((uint16_t *)hx)[i] = dt == 1 ? sg_elem_f32_to_bf16(v) : sg_elem_f32_to_f16(v);
    }
  void *dx = dev_alloc(b);
  h2d(dx, hx, b);
  double cs = 0, cn = 0, gs = -1, gn = -1;
  sg__cpu_sumsq(hx, dt, n, &cs, &cn);
  sg_status st = g_dev->ops->sumsq(g_dev, SG_Q_COMPUTE, dx, dt, n, &gs, &gn);
  char what[96], detail[128];
  snprintf(what, sizeof what, "sumsq dtype %d n %zu%s", dt, n, specials ? " with inf/NaN" : "");
  snprintf(detail, sizeof detail, "cpu %.17g/%g gpu %.17g/%g", cs, cn, gs, gn);
  check(st == SG_OK && close_rel(cs, gs, 1e-12) && cn == gn, what, detail);
  /* the same bits from the device op, and for any grid limit */
  double again[2] = {0, 0}, r1[2], r7[2], rbig[2];
  g_dev->ops->sumsq(g_dev, SG_Q_COMM, dx, dt, n, &again[0], &again[1]);
  sumsq_direct(dx, dt, n, 1, r1);
  sumsq_direct(dx, dt, n, 7, r7);
  sumsq_direct(dx, dt, n, 4096, rbig);
  int same = memcmp(&again[0], &gs, 8) == 0 && memcmp(&r1[0], &gs, 8) == 0 &&
             memcmp(&r7[0], &gs, 8) == 0 && memcmp(&rbig[0], &gs, 8) == 0 && r1[1] == gn &&
             r7[1] == gn && rbig[1] == gn;
  check(same, what, "same bits on both queues and for grid limits 1, 7, 4096");
  g_dev->ops->free(g_dev, dx);
  free(hx);
}

static void test_sumsq(void) {
  for (int dt = 0; dt < 3; dt++)
    for (size_t k = 0; k < nsizes(); k++) test_sumsq_one(dt, k_sizes[k], 0);
  for (int dt = 0; dt < 3; dt++) test_sumsq_one(dt, g_quick ? 5000 : 300001, 1);
  double s = -1, c = -1;
  check(g_dev->ops->sumsq(g_dev, SG_Q_COMPUTE, NULL, 0, 0, &s, &c) == SG_OK && s == 0.0 && c == 0.0,
        "sumsq n 0", NULL);
}

/* ---- fill (launcher only) -----------------------------------------------------------------------
 */

static void test_fill(void) {
  for (int dt = 0; dt < 4; dt++) {
    const size_t n = 1003, b = n * esize(dt);
    void *d = dev_alloc(b), *h = malloc(b), *want = malloc(b);
    sg__cuda_launch L = {(void *)g_stream, 3};
    int rc = sg__cuda_fill(L, d, dt, n, 1.25);
    cudaStreamSynchronize(g_stream);
    d2h(h, d, b);
    for (size_t i = 0; i < n; i++) {
      if (dt == 3)
        ((double *)want)[i] = 1.25;
      else
        sg_elem_store(want, dt, i, 1.25f);
    }
    char what[48];
    snprintf(what, sizeof what, "fill dtype %d", dt);
    check(rc == 0 && memcmp(h, want, b) == 0, what, NULL);
    g_dev->ops->free(g_dev, d);
    free(h), free(want);
  }
}

/* ---- adamw -------------------------------------------------------------------------------- */

typedef struct adamw_case {
  int pdt, gdt, master, sr;
} adamw_case;

/* Segments with gaps (padding that must stay untouched), odd offsets and lengths. */
static int make_segments(sg__seg *segs, int max, size_t *shard_n, size_t *flat_n) {
  static const size_t lens[] = {1, 2, 3, 4, 5, 63, 64, 65, 1000, 4099, 77777, 300000};
  const size_t nl = g_quick ? 10 : sizeof lens / sizeof lens[0];
  size_t so = 0, fo = 3;
  int n = 0;
  for (int rep = 0; rep < 2; rep++)
    for (size_t i = 0; i < nl && n < max; i++, n++) {
      segs[n].shard_off = so;
      segs[n].flat_off = fo;
      segs[n].len = lens[(i * 5 + (size_t)rep) % nl];
      segs[n].decay = (int)((i + (size_t)rep) % 3 != 0);
      segs[n].sr_index = ((uint64_t)n << 40) + (uint64_t)(rep * 17);
      so += segs[n].len + (size_t)(rnd() % 3);
      fo += segs[n].len + (size_t)(rnd() % 5);
    }
  *shard_n = so + 4;
  *flat_n = fo + 4;
  return n;
}

static sg__adamw_args adamw_consts(uint64_t step) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  const double lr = 1e-3, wd = 0.01, b1 = 0.9, b2 = 0.999;
  a.grad_scale = 0.5f;
  a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - lr * wd);
  a.scalar[SG__ADAMW_BETA1] = (float)b1;
  a.scalar[SG__ADAMW_ONE_MINUS_BETA1] = (float)(1.0 - b1);
  a.scalar[SG__ADAMW_BETA2] = (float)b2;
  a.scalar[SG__ADAMW_ONE_MINUS_BETA2] = (float)(1.0 - b2);
  a.group_scalar[0][SG__ADAMW_STEP_SIZE] = (float)(lr / (1.0 - pow(b1, (double)step)));
  a.scalar[SG__ADAMW_BC2_SQRT] = (float)sqrt(1.0 - pow(b2, (double)step));
  a.scalar[SG__ADAMW_EPS] = 1e-8f;
  a.seed = 1234;
  a.step = step;
  return a;
}

typedef struct adamw_bufs {
  void *param;
  float *master, *m, *v;
  void *grad;
} adamw_bufs;

static void adamw_host_init(adamw_bufs *h, const adamw_case *c, size_t sn, size_t fn) {
  h->param = malloc(fn * esize(c->pdt));
  h->master = c->master ? malloc(sn * 4) : NULL;
  h->m = malloc(sn * 4);
  h->v = malloc(sn * 4);
  h->grad = malloc(sn * esize(c->gdt));
  fill_random(h->param, c->pdt, fn, 1.0f, 0);
  if (h->master) fill_random(h->master, 0, sn, 1.0f, 0);
  fill_random(h->m, 0, sn, 0.01f, 0);
  for (size_t i = 0; i < sn; i++) h->v[i] = fabsf(rnd_unit()) * 1e-4f;
  fill_random(h->grad, c->gdt, sn, 0.1f, 0);
}

static void adamw_to_dev(adamw_bufs *d, const adamw_bufs *h, const adamw_case *c, size_t sn,
                         size_t fn) {
  d->param = dev_alloc(fn * esize(c->pdt));
  d->master = h->master ? dev_alloc(sn * 4) : NULL;
  d->m = dev_alloc(sn * 4);
  d->v = dev_alloc(sn * 4);
  d->grad = dev_alloc(sn * esize(c->gdt));
  h2d(d->param, h->param, fn * esize(c->pdt));
  if (h->master) h2d(d->master, h->master, sn * 4);
  h2d(d->m, h->m, sn * 4);
  h2d(d->v, h->v, sn * 4);
  h2d(d->grad, h->grad, sn * esize(c->gdt));
}

static void adamw_set(sg__adamw_args *a, const adamw_bufs *b, const adamw_case *c,
                      const sg__seg *segs, int nsegs) {
  a->param = b->param;
  a->param_dtype = c->pdt;
  a->master = b->master;
  a->state[SG__ADAMW_M] = b->m;
  a->state[SG__ADAMW_V] = b->v;
  a->grad = b->grad;
  a->grad_dtype = c->gdt;
  a->segs = segs;
  a->nsegs = nsegs;
  a->stochastic_rounding = c->sr;
}

static void adamw_compare(const adamw_bufs *h, const adamw_bufs *d, const adamw_case *c, size_t sn,
                          size_t fn, const char *what) {
  void *gp = malloc(fn * esize(c->pdt));
  float *gf = malloc(sn * 4);
  char w[160];
  d2h(gp, d->param, fn * esize(c->pdt));
  snprintf(w, sizeof w, "%s param", what);
  compare(h->param, gp, c->pdt, fn, w);
  if (h->master) {
    d2h(gf, d->master, sn * 4);
    snprintf(w, sizeof w, "%s master", what);
    compare(h->master, gf, 0, sn, w);
  }
  d2h(gf, d->m, sn * 4);
  snprintf(w, sizeof w, "%s m", what);
  compare(h->m, gf, 0, sn, w);
  d2h(gf, d->v, sn * 4);
  snprintf(w, sizeof w, "%s v", what);
  compare(h->v, gf, 0, sn, w);
  free(gp);
  free(gf);
}

static void adamw_free(adamw_bufs *b, int dev) {
  void *p[5] = {b->param, b->master, b->m, b->v, b->grad};
  for (int i = 0; i < 5; i++)
    if (p[i]) dev ? g_dev->ops->free(g_dev, p[i]) : free(p[i]);
}

/* The launcher directly, with a small grid limit, on copies of the inputs: same bits. */
static void adamw_shape_check(const adamw_bufs *h0, const adamw_bufs *d, const adamw_case *c,
                              const sg__seg *segs, int nsegs, size_t sn, size_t fn,
                              const char *what) {
  adamw_bufs d2;
  adamw_to_dev(&d2, h0, c, sn, fn);
  sg__adamw_args a = adamw_consts(7);
  adamw_set(&a, &d2, c, segs, nsegs);
  void *htab = malloc(sg__cuda_seg_table_bytes(nsegs)), *dtab = NULL;
  uint64_t work = 0;
  sg__cuda_seg_table_build(htab, segs, nsegs, &work);
  /* The table goes up on the kernel's own stream: a plain cudaMemcpy from pageable memory runs
   * on the legacy stream and may return before its DMA lands, and g_stream (non-blocking) does
   * not wait for the legacy stream. htab stays alive until the stream is synchronized. */
  int rc = (int)cudaMalloc(&dtab, sg__cuda_seg_table_bytes(nsegs));
  if (rc == 0)
    rc = (int)cudaMemcpyAsync(dtab, htab, sg__cuda_seg_table_bytes(nsegs),
                              cudaMemcpyHostToDevice, g_stream);
  sg__cuda_launch L = {(void *)g_stream, 2};
  if (rc == 0) rc = sg__cuda_adamw(L, &a, dtab, work);
  const int sync_rc = (int)cudaStreamSynchronize(g_stream);
  char w[160];
  snprintf(w, sizeof w, "%s, grid limit 2", what);
  check(rc == 0 && sync_rc == 0, w, "launch");
  /* d holds the device-op result: compare the two device results through the host */
  adamw_bufs hd;
  hd.param = malloc(fn * esize(c->pdt));
  hd.master = d->master ? malloc(sn * 4) : NULL;
  hd.m = malloc(sn * 4);
  hd.v = malloc(sn * 4);
  hd.grad = NULL;
  d2h(hd.param, d->param, fn * esize(c->pdt));
  if (hd.master) d2h(hd.master, d->master, sn * 4);
  d2h(hd.m, d->m, sn * 4);
  d2h(hd.v, d->v, sn * 4);
  adamw_compare(&hd, &d2, c, sn, fn, w);
  adamw_free(&hd, 0);
  adamw_free(&d2, 1);
  cudaFree(dtab);
  free(htab);
}

static void test_adamw_case(const adamw_case *c) {
  sg__seg segs[32];
  size_t sn = 0, fn = 0;
  const int nsegs = make_segments(segs, 32, &sn, &fn);
  adamw_bufs h, h0, d;
  adamw_host_init(&h, c, sn, fn);
  adamw_host_init(&h0, c, sn, fn); /* the same inputs again, kept for the shape check */
  memcpy(h0.param, h.param, fn * esize(c->pdt));
  if (h.master) memcpy(h0.master, h.master, sn * 4);
  memcpy(h0.m, h.m, sn * 4);
  memcpy(h0.v, h.v, sn * 4);
  memcpy(h0.grad, h.grad, sn * esize(c->gdt));
  adamw_to_dev(&d, &h, c, sn, fn);
  sg__adamw_args a = adamw_consts(7);
  adamw_set(&a, &h, c, segs, nsegs);
  sg__cpu_adamw(&a);
  adamw_set(&a, &d, c, segs, nsegs);
  sg_status st = g_dev->ops->update(g_dev, SG_Q_COMPUTE, sg__optim_find("adamw"), &a);
  char what[96];
  snprintf(what, sizeof what, "adamw param %d grad %d master %d sr %d", c->pdt, c->gdt, c->master,
           c->sr);
  check(st == SG_OK, what, "launch");
  adamw_compare(&h, &d, c, sn, fn, what);
  adamw_shape_check(&h0, &d, c, segs, nsegs, sn, fn, what);
  /* a second step through the device op reuses the cached segment table */
  a = adamw_consts(8);
  adamw_set(&a, &h, c, segs, nsegs);
  sg__cpu_adamw(&a);
  adamw_set(&a, &d, c, segs, nsegs);
  st = g_dev->ops->update(g_dev, SG_Q_COMPUTE, sg__optim_find("adamw"), &a);
  snprintf(what, sizeof what, "adamw step 2 param %d grad %d master %d sr %d", c->pdt, c->gdt,
           c->master, c->sr);
  check(st == SG_OK, what, "launch");
  adamw_compare(&h, &d, c, sn, fn, what);
  adamw_free(&h, 0);
  adamw_free(&h0, 0);
  adamw_free(&d, 1);
}

static void test_adamw(void) {
  static const adamw_case cases[] = {
      {0, 0, 0, 0}, {0, 1, 0, 0}, {0, 2, 0, 0}, {0, 0, 1, 0}, {1, 0, 1, 0}, {1, 0, 1, 1},
      {1, 1, 1, 0}, {1, 1, 1, 1}, {2, 0, 1, 0}, {2, 1, 1, 0}, {2, 2, 1, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_adamw_case(&cases[i]);
  /* segments that change between calls are uploaded again */
  adamw_case c = {0, 0, 0, 0};
  sg__seg segs[32];
  size_t sn, fn;
  int n = make_segments(segs, 32, &sn, &fn);
  adamw_bufs h, d;
  adamw_host_init(&h, &c, sn, fn);
  adamw_to_dev(&d, &h, &c, sn, fn);
  sg__adamw_args a = adamw_consts(3);
  adamw_set(&a, &h, &c, segs + 1, n - 3);
  sg__cpu_adamw(&a);
  adamw_set(&a, &d, &c, segs + 1, n - 3);
  check(g_dev->ops->update(g_dev, SG_Q_COMM, sg__optim_find("adamw"), &a) == SG_OK, "adamw on comm queue, fewer segments",
        "launch");
  /* Outside a comm job, SG_Q_COMM work is only enqueued on the comm stream, and sync waits for
   * the compute stream alone: the D2H copies below (compute stream) must not start before the
   * comm stream has finished the update. */
  /* the comm stream, as a communicator gets it (attached and detached again) */
  const sg__comm_attach probe = {0, 1, NULL, NULL, NULL, 0};
  sg__comm_native native = {NULL, -1};
  check(g_dev->ops->comm_attach(g_dev, &probe, &native) == SG_OK && native.stream,
        "comm_attach gives the comm stream", NULL);
  g_dev->ops->comm_detach(g_dev);
  check(cudaStreamSynchronize((cudaStream_t)native.stream) == cudaSuccess,
        "comm stream synchronized", NULL);
  check(g_dev->ops->sync(g_dev, sg__deadline(60000)) == SG_OK, "sync", NULL);
  adamw_compare(&h, &d, &c, sn, fn, "adamw on comm queue, fewer segments");
  adamw_free(&h, 0);
  adamw_free(&d, 1);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--quick")) g_quick = 1;
  if (sg__device_cuda_create(0, -1, &g_dev) != SG_OK) {
    printf("FAIL cannot create the CUDA device: %s\n0 passed, 1 failed\n", sg_last_error());
    return 1;
  }
  cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking);
  test_elementwise();
  test_outer();
  test_codes();
  test_reduce_sum();
  test_sumsq();
  test_fill();
  test_adamw();
  check(g_dev->ops->sync(g_dev, sg__deadline(60000)) == SG_OK, "final sync", NULL);
  cudaStreamDestroy(g_stream);
  g_dev->ops->destroy(g_dev);
  return sg_test_summary("");
}
