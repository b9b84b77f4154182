/* sg_bench_q8: the AdamW step over 8-bit blockwise state (sg__cpu_adamw_q8,
 * cfg.optim_state_dtype SG_Q8) against the fp32-state step (sg__cpu_adamw) and a STREAM triad,
 * all three in the same process with the same OpenMP threads, rep by rep alternated so that they
 * see the same background load.
 *
 * Bytes each step must move per parameter (read + written; a store's read-for-ownership not
 * counted, as STREAM does not count it):
 *   fp32 state, f32 params:  grad 4 + param 8 + m 8 + v 8                       = 28
 *   8-bit state, f32 params: grad 4 + param 8 + m 2 + v 2 + scales 16/256         = 16.06
 *   fp32 state, bf16 params: grad 4 + master 8 + m 8 + v 8 + bf16 param write 2  = 30
 *   8-bit state, bf16:       grad 4 + master 8 + m 2 + v 2 + 2 + scales 16/256  = 18.06
 *   triad a[i] = b[i] + s*c[i] on doubles: 24 per element
 * Printed per size and params dtype: each step's median time, the bandwidth its bytes give,
 * that bandwidth over the triad's (medians of the per-rep ratios), and the 8-bit step's time over
 * the fp32 step's.
 *
 *   sg_bench_q8 [--sizes 4,16] [--reps 10] [--warmup 2] [--cpu-time] [--in-cache K]
 * (sizes in Mi parameters)
 * --cpu-time: each step timed in the process's CPU time instead of wall time. With
 * OMP_NUM_THREADS=1 that is the step's own time even on a host whose cores other jobs share
 * (wall time counts the slices the scheduler gave them); with more threads it adds theirs up.
 * --in-cache K: instead of the table, K Ki parameters (32: in L2) stepped back to back, each rep
 * a run of fp32 steps and a run of 8-bit steps: the arithmetic's time per parameter without
 * the memory's, which other jobs on the host move by more than a kernel change does. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, posix_memalign */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_util.h"         /* clock, allocation, medians, the triad */
#include "cpu/sg_cpu_kernels.h" /* sg__cpu_adamw, sg__cpu_adamw_q8 */
#include "sg_adamw_args.h"      /* sg__adamw_scalars */

#define SEG_MAX ((size_t)4 << 20) /* fp32 state: parameters of at most 4 Mi elements */
#define BLK SG__Q8_BLOCK

static const char PROG[] = "sg_bench_q8"; /* in the messages of bench_xalloc */

static void fill_bytes(uint8_t *x, size_t n) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
  for (size_t i = 0; i < n; i++) x[i] = (uint8_t)((i * 2654435761u) >> 13);
}

/* ---- the two steps --------------------------------------------------------------------------- */

typedef struct state {
  size_t n;
  int bf16;
  void *param;
  float *master, *grad, *m, *v;             /* fp32 state */
  uint8_t *cm, *cv;                         /* 8-bit state */
  float *sm, *sv, pool[2][BLK];
  uint32_t *map;
  sg__seg *segs, *blocks;
  int nsegs, nblocks;
} state;

static void segs_init(state *s) {
  s->nsegs = (int)((s->n + SEG_MAX - 1) / SEG_MAX);
  s->segs = bench_xalloc(PROG, sizeof(sg__seg) * (size_t)s->nsegs);
  for (int k = 0; k < s->nsegs; k++) {
    const size_t off = (size_t)k * SEG_MAX;
    s->segs[k] = (sg__seg){off, off, s->n - off < SEG_MAX ? s->n - off : SEG_MAX, !(k & 1), off, 0};
  }
  /* 8-bit state: the same parameters cut into blocks, as sg_state_q8.c cuts them */
  s->nblocks = (int)((s->n + BLK - 1) / BLK);
  s->blocks = bench_xalloc(PROG, sizeof(sg__seg) * (size_t)s->nblocks);
  s->map = bench_xalloc(PROG, sizeof(uint32_t) * (size_t)s->nblocks);
  for (int j = 0; j < s->nblocks; j++) {
    const size_t off = (size_t)j * BLK;
    s->blocks[j] = (sg__seg){off, off, s->n - off < BLK ? s->n - off : BLK,
                             !((off / SEG_MAX) & 1), off, 0};
    s->map[j] = SG__Q8_CODED;
  }
}

static void state_init(state *s, size_t n, int bf16) {
  memset(s, 0, sizeof *s);
  s->n = n;
  s->bf16 = bf16;
  s->param = bench_xalloc(PROG, n * (bf16 ? 2 : 4));
  s->master = bf16 ? bench_xalloc(PROG, 4 * n) : NULL;
  s->grad = bench_xalloc(PROG, 4 * n);
  s->m = bench_xalloc(PROG, 4 * n), s->v = bench_xalloc(PROG, 4 * n);
  s->cm = bench_xalloc(PROG, n), s->cv = bench_xalloc(PROG, n);
  s->sm = bench_xalloc(PROG, 4 * (n / BLK + 1)), s->sv = bench_xalloc(PROG, 4 * (n / BLK + 1));
  bench_fill(bf16 ? s->master : (float *)s->param, n, -0.5f, 1.0f);
  if (bf16) sg__cpu_cast(s->param, 1, s->master, 0, n);
  bench_fill(s->grad, n, -1.0f, 2.0f), bench_fill(s->m, n, -0.01f, 0.02f);
  bench_fill(s->v, n, 1e-6f, 1e-4f);
  fill_bytes(s->cm, n), fill_bytes(s->cv, n);
  bench_fill(s->sm, n / BLK + 1, 0.01f, 0.01f), bench_fill(s->sv, n / BLK + 1, 0.01f, 0.01f);
  segs_init(s);
}

static void state_free(state *s) {
  free(s->param), free(s->master), free(s->grad), free(s->m), free(s->v), free(s->cm), free(s->cv);
  free(s->sm), free(s->sv), free(s->map), free(s->segs), free(s->blocks);
}

static sg__update_args args_of(state *s, uint64_t t, int q8) {
  sg__update_args a;
  memset(&a, 0, sizeof a);
  a.param = s->param, a.param_dtype = s->bf16 ? 1 : 0, a.master = s->master;
  a.grad = s->grad, a.grad_dtype = 0, a.grad_scale = 0.5f;
  sg__adamw_scalars(&a, 1e-3, 0.9, 0.999, 1e-8, 0.01, t);
  if (!q8) {
    a.state[SG__ADAMW_M] = s->m, a.state[SG__ADAMW_V] = s->v;
    a.segs = s->segs, a.nsegs = s->nsegs;
    return a;
  }
  a.state[SG__ADAMW_M] = s->pool[0], a.state[SG__ADAMW_V] = s->pool[1];
  a.q8_code[SG__ADAMW_M] = s->cm, a.q8_code[SG__ADAMW_V] = s->cv;
  a.q8_scale[SG__ADAMW_M] = s->sm, a.q8_scale[SG__ADAMW_V] = s->sv;
  a.q8_f32 = s->map;
  a.segs = s->blocks, a.nsegs = s->nblocks;
  return a;
}

static int g_cpu_time; /* --cpu-time */

static double clock_s(void) {
  if (!g_cpu_time) return bench_now_s();
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double step_once(state *s, uint64_t t, int q8) {
  const sg__update_args a = args_of(s, t, q8);
  const double t0 = clock_s();
  if (q8)
    sg__cpu_adamw_q8(&a);
  else
    sg__cpu_adamw(&a);
  return clock_s() - t0;
}

/* ---- the table ------------------------------------------------------------------------------- */

typedef struct options {
  size_t sizes[16];
  int nsizes, reps, warmup;
  size_t in_cache; /* --in-cache K: Ki parameters; 0: the table */
} options;

static void run_size(size_t n, int bf16, bench_triad *tb, const options *o) {
  state s;
  state_init(&s, n, bf16);
  const double bytes_f = bf16 ? 30.0 : 28.0, bytes_q = (bf16 ? 18.0 : 16.0) + 16.0 / BLK;
  double tf[64], tq[64], tt[64], rf[64], rq[64], rs[64];
  const int reps = o->reps < 64 ? o->reps : 64;
  uint64_t t = 2;
  for (int r = 0; r < o->warmup; r++)
    bench_triad_once(tb), step_once(&s, t, 0), step_once(&s, t++, 1);
  for (int r = 0; r < reps; r++, t++) {
    tt[r] = bench_triad_once(tb);
    tf[r] = step_once(&s, t, 0);
    tq[r] = step_once(&s, t, 1);
    const double triad_bw = 24.0 * (double)tb->n / tt[r];
    rf[r] = bytes_f * (double)n / tf[r] / triad_bw;
    rq[r] = bytes_q * (double)n / tq[r] / triad_bw;
    rs[r] = tq[r] / tf[r];
  }
  const double mt = bench_median(tt, reps, NULL), mf = bench_median(tf, reps, NULL);
  const double mq = bench_median(tq, reps, NULL), mrf = bench_median(rf, reps, NULL);
  const double mrq = bench_median(rq, reps, NULL), mrs = bench_median(rs, reps, NULL);
  const char *pd = bf16 ? "bf16" : "f32";
  printf("| %zu Mi | %s | fp32 | %.2f | %.2f | %.1f | %.2f | |\n", n >> 20, pd, bytes_f, mf * 1e3,
         bytes_f * (double)n / mf / 1e9, mrf);
  printf("| %zu Mi | %s | 8-bit | %.2f | %.2f | %.1f | %.2f | %.2f |\n", n >> 20, pd, bytes_q,
         mq * 1e3, bytes_q * (double)n / mq / 1e9, mrq, mrs);
  printf("| | triad | | 24 per element | %.2f | %.1f | 1 | |\n", mt * 1e3,
         24.0 * (double)tb->n / mt / 1e9);
  volatile float sink = s.bf16 ? s.master[n / 2] : ((float *)s.param)[n / 2];
  if (!isfinite(sink)) printf("non-finite parameter after the steps\n");
  state_free(&s);
}

/* --in-cache: per rep, enough back-to-back steps of each kind for about 20 ms at 1 ns per
 * parameter; the medians in ns per parameter and of the per-rep ratios. */
static void run_in_cache(size_t n, int bf16, const options *o) {
  state s;
  state_init(&s, n, bf16);
  const int iters = (int)(20000000 / n) + 1, reps = o->reps < 64 ? o->reps : 64;
  double tf[64], tq[64], rs[64];
  uint64_t t = 2;
  for (int r = 0; r < o->warmup; r++) step_once(&s, t, 0), step_once(&s, t++, 1);
  for (int r = 0; r < reps; r++) {
    tf[r] = tq[r] = 0;
    for (int i = 0; i < iters; i++) tf[r] += step_once(&s, t + (uint64_t)i, 0);
    for (int i = 0; i < iters; i++) tq[r] += step_once(&s, t + (uint64_t)i, 1);
    t += (uint64_t)iters;
    rs[r] = tq[r] / tf[r];
  }
  const double scale = 1e9 / ((double)iters * (double)n);
  const double mf = bench_median(tf, reps, NULL) * scale, mq = bench_median(tq, reps, NULL) * scale;
  printf("| %zu Ki | %s | %.3f | %.3f | %.2f |\n", n >> 10, bf16 ? "bf16" : "f32", mf, mq,
         bench_median(rs, reps, NULL));
  state_free(&s);
}

static int parse(int argc, char **argv, options *o) {
  o->nsizes = 2, o->sizes[0] = 4, o->sizes[1] = 16, o->reps = 10, o->warmup = 2, o->in_cache = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
      o->nsizes = 0;
      for (char *p = strtok(argv[++i], ","); p && o->nsizes < 16; p = strtok(NULL, ","))
        o->sizes[o->nsizes++] = (size_t)strtoull(p, NULL, 10);
    } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
      o->reps = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
      o->warmup = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--cpu-time")) {
      g_cpu_time = 1;
    } else if (!strcmp(argv[i], "--in-cache") && i + 1 < argc) {
      o->in_cache = (size_t)strtoull(argv[++i], NULL, 10);
      if (o->in_cache == 0) return 0;
    } else {
      fprintf(stderr, "usage: sg_bench_q8 [--sizes 4,16] [--reps 10] [--warmup 2] [--cpu-time] "
              "[--in-cache K]\n");
      return 0;
    }
  }
  return o->reps >= 1 && o->nsizes >= 1;
}

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, &o)) return 2;
  int nt = 1;
#ifdef _OPENMP
  nt = omp_get_max_threads();
#endif
  if (o.in_cache) {
    printf("sg_bench_q8: %d threads, %d reps (medians), steps back to back in %s\n\n", nt, o.reps,
           g_cpu_time ? "CPU time" : "wall time");
    printf("| params | dtype | fp32 ns/param | 8-bit ns/param | 8-bit/fp32 time |\n");
    printf("|---|---|---|---|---|\n");
    for (int bf16 = 0; bf16 < 2; bf16++) run_in_cache(o.in_cache << 10, bf16, &o);
    return 0;
  }
  bench_triad tb;
  bench_triad_init(PROG, &tb, (size_t)8 << 20); /* 3 x 64 MiB: far past the caches */
  printf("sg_bench_q8: %d threads, %d reps (medians), triad over 3 x %zu MiB, %s\n\n", nt,
         o.reps, tb.n * 8 >> 20, g_cpu_time ? "steps in CPU time" : "wall time");
  printf("| params | dtype | state | bytes/param | ms/step | GB/s | of triad | 8-bit/fp32 time |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (int k = 0; k < o.nsizes; k++)
    for (int bf16 = 0; bf16 < 2; bf16++) run_size(o.sizes[k] << 20, bf16, &tb, &o);
  bench_triad_free(&tb);
  return 0;
}
