/* bench_util.h — what the benchmark programs share: the clock they time with (the MLP
 * benchmarks, sg_bench_step and sg_bench_cluster, use examples/mlp/mlp_cli.h's, with its flag
 * parsing), aligned allocation, medians, first-touch filling and the STREAM triad baseline of
 * sg_bench_adamw and sg_bench_q8. Header only; define _POSIX_C_SOURCE 200809L before any
 * include (clock_gettime, posix_memalign). */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include <stdio.h>  /* fprintf */
#include <stdlib.h> /* posix_memalign, qsort, exit, free */
#include <time.h>

/* Seconds on the monotonic clock. */
static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 64-byte aligned memory, or exit(1) with a message naming the program. */
static inline void *bench_xalloc(const char *prog, size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
    fprintf(stderr, "%s: out of memory (%zu bytes)\n", prog, bytes);
    exit(1);
  }
  return p;
}

static inline int bench_cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Sorts t; returns the median and stores the smallest value in *best (when not NULL). */
static inline double bench_median(double *t, int n, double *best) {
  qsort(t, (size_t)n, sizeof *t, bench_cmp_double);
  if (best) *best = t[0];
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* Values a training run would hold; written by the threads that later use them (first touch). */
static inline void bench_fill(float *x, size_t n, float base, float scale) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (size_t i = 0; i < n; i++) x[i] = base + scale * (float)((i * 2654435761u) % 1000u) / 1000.0f;
}

/* ---- STREAM triad a[i] = b[i] + s c[i] on doubles: 24 bytes per element ---------------------- */

typedef struct bench_triad {
  double *a, *b, *c;
  size_t n;
} bench_triad;

static inline void bench_triad_init(const char *prog, bench_triad *t, size_t n) {
  t->n = n;
  t->a = bench_xalloc(prog, 8 * n), t->b = bench_xalloc(prog, 8 * n);
  t->c = bench_xalloc(prog, 8 * n);
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (size_t i = 0; i < n; i++) t->a[i] = 0.0, t->b[i] = 1.0, t->c[i] = 2.0;
}

/* One triad pass; its seconds. */
static inline double bench_triad_once(bench_triad *t) {
  double *restrict a = t->a;
  const double *restrict b = t->b, *restrict c = t->c;
  const size_t n = t->n;
  const double t0 = bench_now_s();
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
  return bench_now_s() - t0;
}

static inline void bench_triad_free(bench_triad *t) {
  volatile double sink = t->a[t->n / 2]; /* keep the stores */
  (void)sink;
  free(t->a), free(t->b), free(t->c);
}

#endif /* BENCH_UTIL_H */
