/* The host side of optimizer offload (src/offload/sg_host_step.c) and the CPU kernels it uses,
 * on the CPU device and, in the mock build (SG_HAVE_CUDA, tests/cudamock), on the CUDA device:
 *   - sg__cpu_sumsq_gpu against a plain scalar transcription of the CUDA kernel's order, and in
 *     the mock build against the device's own sumsq (the emulated CUDA kernel), bit for bit;
 *     its halves (chunk partials, combine) and the fold that yields the partials, against it;
 *   - every CPU kernel the host step runs gives the same bits for 1, 2 and 3 threads;
 *   - sg__cpu_threads follows omp_set_num_threads and the affinity mask;
 *   - the update pipeline (chunks, gaps, segments across chunk edges, groups, stochastic
 *     rounding, f32/bf16/f16 params) against sg__cpu_adamw on a host copy;
 *   - argument errors and failed allocations. */
#define _GNU_SOURCE /* sched_getaffinity */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/sg_cpu_kernels.h"
#include "cuda/sg_cuda_kernels.h" /* SG__CUDA_SUMSQ_CHUNK */
#include "device/sg_device.h"
#include "offload/sg_host_step.h"
#include "sg_elem.h"
#include "sg_test_check.h"

/* The optimizer under test: its state arrays and CPU update. */
#define ADAMW sg__optim_find("adamw")


static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* in [-1, 1) */
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static void fill_dtype(void *x, int dtype, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) sg_elem_store(x, dtype, i, frand() * scale);
}

static size_t esize(int dtype) { return dtype == 0 ? 4u : 2u; }

static void set_threads(int t) {
#ifdef _OPENMP
  omp_set_num_threads(t);
#else
  (void)t;
#endif
}

/* ---- sumsq in the CUDA order ----------------------------------------------------------------- */

/* The CUDA kernel, transcribed thread by thread (kernels/cuda/sg_cuda_kernels.cu). */
static void tree(double *s, int T) {
  for (int w = T / 2; w > 0; w >>= 1)
    for (int t = 0; t < w; t++) s[t] = s[t] + s[t + w];
}

static void ref_sumsq_gpu(const void *x, int dtype, size_t n, double *ss, double *nf) {
  const size_t C = SG__CUDA_SUMSQ_CHUNK, nq = (n + C - 1) / C;
  double *ps = calloc(nq + 1, sizeof *ps), *pc = calloc(nq + 1, sizeof *pc);
  for (size_t q = 0; q < nq; q++) {
    double s[256], c[256];
    const size_t lo = q * C, hi = n - lo < C ? n : lo + C;
    for (int t = 0; t < 256; t++) {
      double acc = 0.0, bad = 0.0;
      for (size_t i = lo + (size_t)t; i < hi; i += 256) {
        const float f = sg_elem_load(x, dtype, i);
        acc = acc + (double)f * (double)f;
        bad = bad + (sg_elem_isfinite(f) ? 0.0 : 1.0);
      }
      s[t] = acc, c[t] = bad;
    }
    tree(s, 256), tree(c, 256);
    ps[q] = s[0], pc[q] = c[0];
  }
  double s[1024], c[1024];
  for (int t = 0; t < 1024; t++) {
    double acc = 0.0, bad = 0.0;
    for (size_t q = (size_t)t; q < nq; q += 1024) acc = acc + ps[q], bad = bad + pc[q];
    s[t] = acc, c[t] = bad;
  }
  tree(s, 1024), tree(c, 1024);
  *ss = s[0], *nf = c[0];
  free(ps), free(pc);
}

static int same_double(double a, double b) {
  return (isnan(a) && isnan(b)) || memcmp(&a, &b, sizeof a) == 0;
}

static void test_sumsq_gpu(sg__device *cuda) {
  const size_t sizes[] = {0, 1, 255, 256, 257, 8191, 8192, 8193, 3 * 8192 + 17, 70001,
                          (size_t)1025 * 8192 + 5};
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
    for (int dt = 0; dt < 3; dt++)
      for (int bad = 0; bad < 3; bad++) {
        const size_t n = sizes[k];
        void *x = malloc(n * 4 + 4);
        fill_dtype(x, dt, n, bad == 2 ? 1e4f : 3.0f);
        if (bad == 1 && n > 3) sg_elem_store(x, dt, n / 3, INFINITY), sg_elem_store(x, dt, n - 1, NAN);
        double rs, rn;
        ref_sumsq_gpu(x, dt, n, &rs, &rn);
        int same = 1;
        for (int t = 1; t <= 3; t++) {
          double s = -1, c = -1;
          set_threads(t);
          sg__cpu_sumsq_gpu(x, dt, n, &s, &c);
          same &= same_double(s, rs) && c == rn;
        }
        set_threads(2);
        CHECK(same, "sumsq_gpu n=%zu dtype %d %s: the CUDA order's bits on 1, 2, 3 threads", n, dt,
              bad == 1 ? "with inf/NaN" : bad == 2 ? "large values" : "");
        if (cuda && n > 0) {
          void *dx = NULL;
          double s = -1, c = -1;
          int ok = cuda->ops->alloc(cuda, n * esize(dt), &dx) == SG_OK &&
                   cuda->ops->copy(cuda, SG_Q_COMPUTE, dx, x, n * esize(dt), SG_COPY_H2D) == SG_OK &&
                   cuda->ops->sumsq(cuda, SG_Q_COMPUTE, dx, dt, n, &s, &c) == SG_OK;
          CHECK(ok && same_double(s, rs) && c == rn,
                "sumsq_gpu n=%zu dtype %d: the CUDA device's sumsq gives the same bits", n, dt);
          cuda->ops->free(cuda, dx);
        }
        free(x);
      }
}

/* The two halves (chunk partials, combine) give sumsq_gpu's bits, and the fold that computes
 * the partials in its own pass gives the bits of sg__cpu_cast/_accumulate followed by the
 * partials of the result: every accumulator/source dtype pair, first or not, inf/NaN, and a
 * size past SG_CPU_STREAM_MIN (streamed stores). */
static void test_fold_sumsq(void) {
  const size_t sizes[] = {1, 8192, 8193, 5 * 8192 + 300, 70001, ((size_t)1 << 20) + 77};
  const int pairs[][2] = {{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}};
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++)
    for (size_t pr = 0; pr < sizeof pairs / sizeof *pairs; pr++)
      for (int first = 0; first < 2; first++) {
        const size_t n = sizes[k], nq = (n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK;
        const int adt = pairs[pr][0], sdt = pairs[pr][1];
        void *src = malloc(n * 4), *a0 = malloc(n * 4), *ref = malloc(n * 4), *got = malloc(n * 4);
        double *rss = malloc(nq * 8), *rnf = malloc(nq * 8), *gss = malloc(nq * 8),
               *gnf = malloc(nq * 8);
        fill_dtype(src, sdt, n, 2.0f);
        fill_dtype(a0, adt, n, 1.0f);
        if (n > 9000) sg_elem_store(src, sdt, 8200, NAN), sg_elem_store(src, sdt, n - 2, -INFINITY);
        sg_elem_store(src, sdt, 0, -0.0f);
        memcpy(ref, a0, n * esize(adt));
        if (first)
          sg__cpu_cast(ref, adt, src, sdt, n);
        else
          sg__cpu_accumulate(ref, adt, src, sdt, n);
        sg__cpu_sumsq_gpu_chunks(ref, adt, n, 0, nq, rss, rnf);
        double whole[2], comb[2];
        sg__cpu_sumsq_gpu(ref, adt, n, &whole[0], &whole[1]);
        sg__cpu_sumsq_gpu_combine(rss, rnf, nq, &comb[0], &comb[1]);
        int same = same_double(whole[0], comb[0]) && whole[1] == comb[1];
        for (int t = 1; t <= 3; t++) {
          set_threads(t);
          memcpy(got, a0, n * esize(adt));
          sg__cpu_fold_sumsq_gpu(got, adt, src, sdt, n, first, gss, gnf);
          same &= !memcmp(got, ref, n * esize(adt));
          for (size_t q = 0; q < nq; q++) same &= same_double(gss[q], rss[q]) && gnf[q] == rnf[q];
        }
        set_threads(2);
        CHECK(same, "fold + sumsq partials n=%zu acc %d src %d%s: the bits of the fold, then the "
              "chunks' partials, whose combination is sumsq_gpu's (1, 2, 3 threads)", n, adt, sdt,
              first ? " (first)" : "");
        free(src), free(a0), free(ref), free(got), free(rss), free(rnf), free(gss), free(gnf);
      }
}

/* ---- threads ----------------------------------------------------------------------------------- */

/* TSan builds run the kernels on one thread (libomp's synchronisation is invisible to it). */
#if defined(__SANITIZE_THREAD__)
#define LIB_SINGLE 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LIB_SINGLE 1
#endif
#endif

static void test_threads(void) {
  cpu_set_t old;
  CPU_ZERO(&old);
  const int have_mask = sched_getaffinity(0, sizeof old, &old) == 0;
  const int t0 = sg__cpu_threads();
#if defined(LIB_SINGLE)
  (void)have_mask;
  CHECK(t0 == 1, "TSan build: the kernels run on 1 thread");
#elif defined(_OPENMP)
  CHECK(t0 >= 1 && t0 <= omp_get_max_threads() && (!have_mask || t0 <= CPU_COUNT(&old)),
        "sg__cpu_threads %d: at most OpenMP's %d and the mask's %d CPUs", t0, omp_get_max_threads(),
        have_mask ? CPU_COUNT(&old) : -1);
  omp_set_num_threads(1);
  CHECK(sg__cpu_threads() == 1, "omp_set_num_threads(1): 1 thread");
  omp_set_num_threads(64);
  if (have_mask) {
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
      if (CPU_ISSET(c, &old)) {
        CPU_SET(c, &one);
        break;
      }
    if (sched_setaffinity(0, sizeof one, &one) == 0) {
      CHECK(sg__cpu_threads() == 1, "64 OpenMP threads, a mask of one CPU: 1 thread");
      sched_setaffinity(0, sizeof old, &old);
    }
    CHECK(sg__cpu_threads() == (CPU_COUNT(&old) < 64 ? CPU_COUNT(&old) : 64),
          "64 OpenMP threads: capped by the mask's %d CPUs", CPU_COUNT(&old));
  }
  omp_set_num_threads(2);
#else
  (void)have_mask;
  CHECK(t0 == 1, "without OpenMP: 1 thread");
#endif
}

/* The kernels the host step runs: the same bits on 1, 2 and 3 threads. */
static void test_thread_independence(void) {
  const size_t n = 300007;
  float *g = malloc(4 * n), *acc0 = malloc(4 * n);
  fill_dtype(g, 0, n, 1.0f), fill_dtype(acc0, 0, n, 1.0f);
  uint16_t *h = malloc(2 * n);
  sg__cpu_cast(h, 1, g, 0, n);
  sg__seg segs[40];
  size_t pos = 0;
  for (int s = 0; s < 40; s++) { /* gaps of 0..63 elements between the segments */
    size_t len = s == 39 ? 0 : 1000 + (size_t)s * 13 * 97 % 9000;
    segs[s] = (sg__seg){pos, pos, len, s % 3 != 0, (uint64_t)s << 40, s % 4};
    pos += len + (size_t)(s * 7 % 64);
  }
  segs[39].len = n - segs[39].flat_off; /* fill to n */
  float *ref[3] = {0};
  uint16_t *refp = NULL;
  int same = 1;
  for (int t = 1; t <= 3; t++) {
    set_threads(t);
    float *master = malloc(4 * n), *m = calloc(n, 4), *v = calloc(n, 4), *acc = malloc(4 * n);
    uint16_t *p = malloc(2 * n);
    memcpy(master, g, 4 * n), memcpy(acc, acc0, 4 * n);
    memcpy(p, h, 2 * n);
    sg__cpu_accumulate(acc, 0, h, 1, n);
    sg__adamw_args a;
    memset(&a, 0, sizeof a);
    a.param = p, a.param_dtype = 1, a.master = master, a.state[SG__ADAMW_M] = m, a.state[SG__ADAMW_V] = v, a.grad = acc;
    a.segs = segs, a.nsegs = 40, a.grad_scale = 0.5f, a.ngroups = 4, a.stochastic_rounding = 1;
    a.seed = 7;
    sg__adamw_scalars(&a, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 3);
    for (int gi = 1; gi < 4; gi++) sg__adamw_group_scalars(&a, gi, 1e-2f * (float)gi, 0.9f, 0.05f);
    sg__cpu_adamw(&a);
    if (t == 1) {
      ref[0] = master, ref[1] = m, ref[2] = v, refp = p;
      free(acc);
      continue;
    }
    same &= !memcmp(master, ref[0], 4 * n) && !memcmp(m, ref[1], 4 * n) && !memcmp(v, ref[2], 4 * n) &&
            !memcmp(p, refp, 2 * n);
    free(master), free(m), free(v), free(acc), free(p);
  }
  set_threads(2);
  CHECK(same, "accumulate + AdamW (4 groups, SR, gaps): the same bits on 1, 2 and 3 threads");
  free(ref[0]), free(ref[1]), free(ref[2]), free(refp), free(g), free(acc0), free(h);
}

/* ---- the update pipeline ----------------------------------------------------------------------- */

typedef struct upd_case {
  int param_dtype, sr, ngroups;
  size_t chunk;
} upd_case;

static void test_update(sg__device *d, const char *dn, upd_case uc) {
  /* segments with gaps, some longer than a chunk, starting away from 0 */
  enum { NS = 9 };
  const size_t lens[NS] = {700, 64, 2500, 1, 900, 4096, 33, 1200, 5000};
  sg__seg segs[NS];
  size_t flat = 128, shard = 0;
  for (int s = 0; s < NS; s++) {
    segs[s] = (sg__seg){shard, flat, lens[s], s % 2, ((uint64_t)s << 40) + 5, s % uc.ngroups};
    shard += lens[s] + (s == 3 ? 10 : 0);
    flat += lens[s] + (size_t)(s * 29 % 64);
  }
  const size_t total = flat + 64, sn = shard, P = esize(uc.param_dtype);
  const int has_master = uc.param_dtype != 0;
  float *master = has_master ? malloc(4 * sn) : NULL, *m = malloc(4 * sn), *v = malloc(4 * sn);
  float *grad = malloc(4 * sn);
  void *host_param = malloc(total * P); /* the reference's working values */
  fill_dtype(m, 0, sn, 0.01f), fill_dtype(v, 0, sn, 0.0f), fill_dtype(grad, 0, sn, 1.0f);
  for (size_t i = 0; i < sn; i++) v[i] = v[i] * v[i];
  if (has_master) fill_dtype(master, 0, sn, 1.0f);
  fill_dtype(host_param, uc.param_dtype, total, 1.0f);
  /* f32 params: the working value is the master; bf16/f16: the device holds round(master) */
  for (int s = 0; s < NS && has_master; s++)
    for (size_t i = 0; i < segs[s].len; i++)
      sg_elem_store(host_param, uc.param_dtype, segs[s].flat_off + i, master[segs[s].shard_off + i]);
  /* the layout's padding is zero; the gaps must come back zero */
  for (size_t i = 0, s = 0; i < total; i++) {
    while (s < NS && i >= segs[s].flat_off + segs[s].len) s++;
    if (s == NS || i < segs[s].flat_off) sg_elem_store(host_param, uc.param_dtype, i, 0.0f);
  }
  /* the pipeline's state: host copies (pinned in real use; any host memory works) */
  float *hm = malloc(4 * sn), *hv = malloc(4 * sn), *hmaster = has_master ? malloc(4 * sn) : NULL;
  memcpy(hm, m, 4 * sn), memcpy(hv, v, 4 * sn);
  if (has_master) memcpy(hmaster, master, 4 * sn);
  void *dparam = NULL;
  int ok = d->ops->alloc(d, total * P, &dparam) == SG_OK &&
           d->ops->copy(d, SG_Q_COMPUTE, dparam, host_param, total * P, SG_COPY_H2D) == SG_OK;
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param = host_param, a.param_dtype = uc.param_dtype, a.master = master, a.state[SG__ADAMW_M] = m, a.state[SG__ADAMW_V] = v;
  a.grad = grad, a.segs = segs, a.nsegs = NS, a.grad_scale = 0.25f;
  a.stochastic_rounding = uc.sr, a.seed = 99, a.ngroups = uc.ngroups;
  sg__adamw_scalars(&a, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 4);
  for (int g = 1; g < uc.ngroups; g++) sg__adamw_group_scalars(&a, g, 2e-2f * (float)g, 0.9f, 0.0f);
  sg__adamw_args b = a;
  b.state[SG__ADAMW_M] = hm, b.state[SG__ADAMW_V] = hv, b.master = hmaster;
  sg__cpu_adamw(&a); /* the reference */
  sg__host_pipe p;
  uint64_t last = 0;
  ok = ok && sg__host_pipe_init(&p, d, uc.chunk, P) == SG_OK;
  ok = ok && sg__host_pipe_update(&p, ADAMW, &b, dparam, INT64_MAX, &last) == SG_OK && last > 0 &&
       sg__host_pipe_drain(&p, INT64_MAX) == SG_OK;
  void *back = malloc(total * P);
  ok = ok && d->ops->copy(d, SG_Q_COMPUTE, back, dparam, total * P, SG_COPY_D2H) == SG_OK;
  CHECK(ok, "%s update P=%zu chunk %zu: runs", dn, P, uc.chunk);
  int same = ok && !memcmp(back, host_param, total * P) && !memcmp(hm, m, 4 * sn) &&
             !memcmp(hv, v, 4 * sn);
  if (has_master) same = same && !memcmp(hmaster, master, 4 * sn);
  CHECK(same, "%s update dtype %d%s, %d group(s), chunk %zu: working values (gaps zero), %s, "
        "m, v equal sg__cpu_adamw's", dn, uc.param_dtype, uc.sr ? " SR" : "", uc.ngroups, uc.chunk, has_master ? "master" : "f32 values read back from the device");
  sg__host_pipe_free(&p, INT64_MAX);
  d->ops->free(d, dparam);
  free(back), free(master), free(m), free(v), free(grad), free(host_param), free(hm), free(hv);
  free(hmaster);
}

/* ---- errors ------------------------------------------------------------------------------------ */

static int says(const char *s) { return strstr(sg_last_error(), s) != NULL; }

static void test_errors(sg__device *d, const char *dn) {
  sg__host_pipe p;
  CHECK(sg__host_pipe_init(&p, d, 0, 3) == SG_ERR_INVALID_ARGUMENT && says("out element size"),
        "%s init: element size 3 refused", dn);
  CHECK(sg__host_pipe_init(NULL, d, 0, 2) == SG_ERR_INVALID_ARGUMENT, "%s init: NULL pipe", dn);
  sg__device_fail_alloc_after(1); /* the second pinned buffer fails */
  CHECK(sg__host_pipe_init(&p, d, 1024, 2) == SG_ERR_OUT_OF_MEMORY && p.host_bytes == 0 &&
            p.out[0] == NULL,
        "%s init: a failed allocation frees the others", dn);
  sg__device_fail_alloc_after(-1);
  sg__host_pipe_free(&p, INT64_MAX); /* zeroed: nothing */
  sg__host_pipe_free(NULL, INT64_MAX);
  if (!CHECK(sg__host_pipe_init(&p, d, 1024, 2) == SG_OK && p.host_bytes == SG__HOST_PIPE_NBUF * 1024 * 2,
             "%s init: the ring of bf16 out buffers", dn))
    return;
  float st[64] = {0};
  sg__seg segs[2] = {{0, 32, 16, 1, 0, 0}, {16, 0, 16, 1, 0, 0}};
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = 1, a.master = st, a.state[SG__ADAMW_M] = st, a.state[SG__ADAMW_V] = st, a.grad = st, a.segs = segs, a.nsegs = 2;
  void *dp = NULL;
  d->ops->alloc(d, 256, &dp);
  CHECK(sg__host_pipe_update(&p, ADAMW, &a, dp, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT &&
            says("segment 1 is not after segment 0"),
        "%s update: segments out of order refused", dn);
  a.nsegs = 1, a.master = NULL;
  CHECK(sg__host_pipe_update(&p, ADAMW, &a, dp, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT &&
            says("NULL optimizer state"), "%s update: bf16 params without master refused", dn);
  a.master = st, a.param_dtype = 0;
  CHECK(sg__host_pipe_update(&p, ADAMW, &a, dp, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT &&
            says("does not fit the pipe"), "%s update: f32 params on a bf16 pipe refused", dn);
  a.param_dtype = 1, a.ngroups = 2, segs[0].group = 3;
  CHECK(sg__host_pipe_update(&p, ADAMW, &a, dp, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT &&
            says("group"), "%s update: a segment outside ngroups refused", dn);
  segs[0].group = 0;
  CHECK(sg__host_pipe_update(&p, ADAMW, &a, NULL, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT,
        "%s update: NULL device buffer refused", dn);
  d->ops->free(d, dp);
  sg__host_pipe_free(&p, INT64_MAX);
}

static void run_device(sg__device *d, const char *dn) {
  const upd_case cases[] = {{1, 0, 1, 1000}, {1, 1, 1, 777}, {1, 0, 3, 777}, {1, 1, 3, 777}, {0, 0, 2, 1000}, {2, 0, 1, 4096},
                            {1, 0, 1, 1 << 20}, {0, 0, 1, 64}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) test_update(d, dn, cases[k]);
  test_errors(d, dn);
}

int main(void) {
  set_threads(2);
  test_threads();
  test_thread_independence();
  sg__device *cpu = NULL;
  if (CHECK(sg__device_cpu_create(0, 1, &cpu) == SG_OK, "cpu device")) {
    run_device(cpu, "cpu");
    cpu->ops->destroy(cpu);
  }
  sg__device *cuda = NULL;
#ifdef SG_HAVE_CUDA
  if (CHECK(sg__device_cuda_create(0, 0, &cuda) == SG_OK, "cuda (mock) device")) run_device(cuda, "cuda");
#endif
  test_sumsq_gpu(cuda);
  test_fold_sumsq();
  if (cuda) cuda->ops->destroy(cuda);
  return sg_test_summary("");
}
