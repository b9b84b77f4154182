/* bench_util.h — the clock the benchmark programs time with (the MLP benchmarks, sg_bench_step
 * and sg_bench_cluster, use examples/mlp/mlp_cli.h's, with its flag parsing). Header only;
 * define _POSIX_C_SOURCE 200809L before any include (clock_gettime). */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include <time.h>

/* Seconds on the monotonic clock. */
static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif /* BENCH_UTIL_H */
