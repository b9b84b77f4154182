/* sg_bench_adamw: the fused AdamW step of one rank (sg__cpu_adamw) over N parameters, beside a
 * STREAM triad measured in the same process with the same OpenMP threads.
 *
 * The step is memory bound, so its figure of merit is the bandwidth it reaches: bytes the step
 * must move per element divided by the time.
 *   f32 params (the param is the master):   grad 4 + param r/w 8 + m r/w 8 + v r/w 8  = 28 B
 *   bf16 params (fp32 master):               grad 4 + master r/w 8 + m 8 + v 8 + bf16 param
 *                                            write 2                                   = 30 B
 *   STREAM triad a[i] = b[i] + s*c[i] on doubles: 3 x 8                                = 24 B
 *                                            (as STREAM counts it: the write-allocate read of
 *                                            a[] is not counted)
 * The ratio adamw GB/s / triad GB/s says how close the step is to what this machine's memory
 * gives a simple streaming loop. Goal: >= 0.8 at 16M parameters and up.
 *
 * Before timing, one untimed step is checked against sg_elem_adamw on a sample of elements.
 * Triad and AdamW alternate rep by rep after the warm-up, so both see the same background load;
 * the ratio reported is the median of the per-rep ratios.
 *
 *   sg_bench_adamw [--sizes 1,4,16,64] [--reps 10] [--warmup 2]   (sizes in Mi parameters)
 *
 * --lean-report: instead, the whole one-rank f32 step of the engine (SG_SHARD_GRAD_OP, CPU
 * device, local communicator of one rank, 32 MiB buckets, parameters of 4 Mi elements) timed
 * from the caller: every sg_grad_ready of a micro-batch plus the sg_step after it. The caller
 * writes its gradients into the sg_grad_ptr slots before the clock starts (enough staging
 * buffers that no slot waits for another bucket). The step's figure of merit counts 32 bytes
 * per parameter (the update's 28 and the norm's 4), against the triad in the same run, rep by
 * rep; the goal (issue 13) is >= 0.8. What the engine actually moves per parameter: DESIGN.md
 * section 4, "The step on the device". */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, posix_memalign */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_util.h"         /* clock, allocation, medians, the triad */
#include "cpu/sg_cpu_kernels.h" /* sg__cpu_adamw */
#include "sg_elem.h"            /* sg_elem_adamw: the reference of the untimed check */
#include "shardgrad.h"          /* --lean-report: the engine */

#define SEG_MAX ((size_t)4 << 20) /* split the shard into parameters of at most 4 Mi elements */

typedef struct options {
  size_t sizes[16];
  int nsizes, reps, warmup, lean;
} options;

static int threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

static const char PROG[] = "sg_bench_adamw"; /* in the messages of bench_xalloc */

/* ---- AdamW ----------------------------------------------------------------------------------- */

typedef struct state {
  size_t n;
  int bf16;
  void *param;
  float *master, *m, *v, *grad;
  sg__seg *segs;
  int nsegs;
} state;

static void state_init(state *s, size_t n, int bf16) {
  s->n = n;
  s->bf16 = bf16;
  s->param = bench_xalloc(PROG, n * (bf16 ? 2 : 4));
  s->master = bf16 ? bench_xalloc(PROG, 4 * n) : NULL;
  s->m = bench_xalloc(PROG, 4 * n), s->v = bench_xalloc(PROG, 4 * n);
  s->grad = bench_xalloc(PROG, 4 * n);
  bench_fill(s->bf16 ? s->master : (float *)s->param, n, -0.5f, 1.0f);
  if (bf16) sg__cpu_cast(s->param, 1, s->master, 0, n);
  bench_fill(s->m, n, -0.01f, 0.02f), bench_fill(s->v, n, 1e-6f, 1e-4f);
  bench_fill(s->grad, n, -1.0f, 2.0f);
  s->nsegs = (int)((n + SEG_MAX - 1) / SEG_MAX);
  s->segs = bench_xalloc(PROG, sizeof(sg__seg) * (size_t)s->nsegs);
  for (int k = 0; k < s->nsegs; k++) {
    size_t off = (size_t)k * SEG_MAX;
    s->segs[k].shard_off = s->segs[k].flat_off = off;
    s->segs[k].len = n - off < SEG_MAX ? n - off : SEG_MAX;
    s->segs[k].decay = !(k & 1); /* alternate, as weights and biases/norms would */
    s->segs[k].sr_index = off;
  }
}

static void state_free(state *s) {
  free(s->param), free(s->master), free(s->m), free(s->v), free(s->grad), free(s->segs);
}

static sg__adamw_args args_of(const state *s, uint64_t t) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param = s->param, a.param_dtype = s->bf16 ? 1 : 0, a.master = s->master;
  a.state[SG__ADAMW_M] = s->m, a.state[SG__ADAMW_V] = s->v, a.grad = s->grad, a.grad_dtype = 0;
  a.segs = s->segs, a.nsegs = s->nsegs;
  a.grad_scale = 0.5f;
  sg__adamw_scalars(&a, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
  return a;
}

/* One untimed step; every 4099th element is recomputed with the element function. */
static int check_step(state *s) {
  const size_t stride = 4099, ns = s->n / stride + 1;
  float *p0 = bench_xalloc(PROG, 4 * ns), *m0 = bench_xalloc(PROG, 4 * ns);
  float *v0 = bench_xalloc(PROG, 4 * ns);
  for (size_t j = 0; j < ns && j * stride < s->n; j++) {
    size_t i = j * stride;
    p0[j] = s->bf16 ? s->master[i] : ((float *)s->param)[i];
    m0[j] = s->m[i], v0[j] = s->v[i];
  }
  sg__adamw_args a = args_of(s, 1);
  sg__cpu_adamw(&a);
  int ok = 1;
  for (size_t j = 0; j < ns && j * stride < s->n; j++) {
    size_t i = j * stride;
    const sg__seg *sg = &s->segs[i / SEG_MAX];
    sg_elem_adamw_k k = sg_elem_adamw_consts(sg->decay ? a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] : 1.0f, a.scalar[SG__ADAMW_ONE_MINUS_BETA1],
                                             a.scalar[SG__ADAMW_BETA2], a.scalar[SG__ADAMW_ONE_MINUS_BETA2], a.group_scalar[0][SG__ADAMW_STEP_SIZE], a.scalar[SG__ADAMW_BC2_SQRT], a.scalar[SG__ADAMW_EPS]);
    float m = m0[j], v = v0[j];
    float p = sg_elem_adamw(p0[j], s->grad[i] * a.grad_scale, &m, &v, k);
    float got = s->bf16 ? s->master[i] : ((float *)s->param)[i];
    ok &= got == p && s->m[i] == m && s->v[i] == v;
    if (s->bf16) ok &= ((uint16_t *)s->param)[i] == sg_elem_f32_to_bf16(p);
  }
  free(p0), free(m0), free(v0);
  return ok;
}

static double adamw_once(state *s, uint64_t step) {
  sg__adamw_args a = args_of(s, step);
  double t0 = bench_now_s();
  sg__cpu_adamw(&a);
  return bench_now_s() - t0;
}

/* Triad and AdamW alternate, rep by rep, so that both see the same load from anything else
 * running on the machine; the ratio is the median of the per-rep ratios. */
typedef struct result {
  double adamw_s, triad_s, ratio, best_ratio;
} result;

static result measure(state *s, bench_triad *tb, const options *o) {
  double ta[64], tt[64], ratio[64], best_a, best_t;
  const double bytes = (s->bf16 ? 30.0 : 28.0) / 24.0; /* adamw bytes per triad byte */
  int reps = o->reps < 64 ? o->reps : 64;
  uint64_t step = 2;
  for (int r = 0; r < o->warmup; r++) bench_triad_once(tb), adamw_once(s, step++);
  for (int r = 0; r < reps; r++) {
    tt[r] = bench_triad_once(tb);
    ta[r] = adamw_once(s, step++);
    ratio[r] = bytes * tt[r] / ta[r];
  }
  result res;
  res.adamw_s = bench_median(ta, reps, &best_a);
  res.triad_s = bench_median(tt, reps, &best_t);
  res.ratio = bench_median(ratio, reps, NULL);
  res.best_ratio = bytes * best_t / best_a;
  return res;
}

/* ---- --lean-report: the engine's whole step ------------------------------------------------- */

typedef struct lean {
  sg_comm *comm;
  sg_engine *e;
  int nparams;
  size_t n;
} lean;

static int lean_fail(const char *what, sg_status st) {
  fprintf(stderr, "sg_bench_adamw --lean-report: %s: %s: %s\n", what, sg_status_string(st),
          sg_last_error());
  return 0;
}

static int lean_init(lean *l, size_t n) {
  memset(l, 0, sizeof *l);
  l->n = n;
  l->nparams = (int)((n + SEG_MAX - 1) / SEG_MAX);
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (!st) st = sg_comm_create_local(1, &l->comm);
  if (st) return lean_fail("setup", st);
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.staging_buckets = l->nparams; /* a slot per bucket: sg_grad_ptr never waits */
  if ((st = sg_engine_create(l->comm, &cfg, &l->e))) return lean_fail("sg_engine_create", st);
  for (int p = 0; p < l->nparams && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "w%d", p);
    const size_t len = n - (size_t)p * SEG_MAX < SEG_MAX ? n - (size_t)p * SEG_MAX : SEG_MAX;
    int id = 0;
    st = sg_add_param(l->e, name, len, p % 2 ? SG_PARAM_NO_DECAY : 0, &id);
  }
  if (!st) st = sg_finalize(l->e);
  for (int p = 0; p < l->nparams && !st; p++) {
    float *w = NULL;
    st = sg_param_ptr(l->e, p, (void **)&w);
    const size_t len = n - (size_t)p * SEG_MAX < SEG_MAX ? n - (size_t)p * SEG_MAX : SEG_MAX;
    if (!st) bench_fill(w, len, -0.5f, 1.0f);
  }
  return st ? lean_fail("parameters", st) : 1;
}

static void lean_free(lean *l) {
  sg_engine_destroy(l->e);
  sg_comm_destroy(l->comm);
}

/* One micro-batch and its step; the seconds from the first sg_grad_ready to sg_step's return,
 * without the caller's gradient writes (done first, in backward order). */
static double lean_once(lean *l, int *ok) {
  sg_status st = SG_OK;
  for (int p = l->nparams - 1; p >= 0 && !st; p--) {
    float *g = NULL;
    st = sg_grad_ptr(l->e, p, (void **)&g);
    const size_t len = l->n - (size_t)p * SEG_MAX < SEG_MAX ? l->n - (size_t)p * SEG_MAX : SEG_MAX;
    if (!st) bench_fill(g, len, -1e-3f, 2e-3f);
  }
  const double t0 = bench_now_s();
  for (int p = l->nparams - 1; p >= 0 && !st; p--) st = sg_grad_ready(l->e, p);
  sg_step_info info = {sizeof info, 0, 0, 0, 0, 0};
  if (!st) st = sg_step(l->e, &info);
  const double t = bench_now_s() - t0;
  if (st || info.skipped || !(info.grad_norm > 0)) *ok = st ? lean_fail("step", st) : 0;
  return t;
}

static int lean_report(const options *o) {
  printf("sg_bench_adamw --lean-report: one-rank f32 step (SG_SHARD_GRAD_OP, CPU device) timed "
         "from the caller\n(sg_grad_ready of every parameter + sg_step) vs STREAM triad, %d "
         "OpenMP thread(s), median of %d after %d warm-up\n", threads(), o->reps, o->warmup);
  printf("step GB/s counts 32 bytes per parameter (AdamW 28 + norm 4); triad 24 per element; "
         "ratio = median of per-rep ratios\n\n");
  printf("%8s  %9s  %9s  %10s  %10s  %6s  %6s  %s\n", "params", "step ms", "triad ms", "step GB/s",
         "triad GB/s", "ratio", "best", "check");
  int all_ok = 1;
  for (int k = 0; k < o->nsizes; k++) {
    const size_t n = o->sizes[k];
    lean l;
    bench_triad tb;
    if (!lean_init(&l, n)) return 0;
    bench_triad_init(PROG, &tb, n);
    double ts[64], tt[64], ratio[64], best_s, best_t;
    const int reps = o->reps < 64 ? o->reps : 64;
    int ok = 1;
    for (int r = 0; r < o->warmup; r++) bench_triad_once(&tb), lean_once(&l, &ok);
    for (int r = 0; r < reps; r++) {
      tt[r] = bench_triad_once(&tb);
      ts[r] = lean_once(&l, &ok);
      ratio[r] = (32.0 / 24.0) * tt[r] / ts[r];
    }
    const double r_med = bench_median(ratio, reps, NULL);
    const double t_step = bench_median(ts, reps, &best_s);
    const double t_triad = bench_median(tt, reps, &best_t);
    printf("%7zuM  %9.2f  %9.2f  %10.2f  %10.2f  %6.2f  %6.2f  %s\n", n >> 20, t_step * 1e3,
           t_triad * 1e3, 32.0 * (double)n / t_step / 1e9, 24.0 * (double)n / t_triad / 1e9, r_med,
           (32.0 / 24.0) * best_t / best_s, ok ? "ok" : "WRONG");
    all_ok &= ok;
    bench_triad_free(&tb);
    lean_free(&l);
  }
  return all_ok;
}

/* ---- main ------------------------------------------------------------------------------------ */

static int parse(int argc, char **argv, options *o) {
  const size_t defaults[] = {1, 4, 16, 64};
  o->nsizes = 4, o->reps = 10, o->warmup = 2, o->lean = 0;
  for (int i = 0; i < 4; i++) o->sizes[i] = defaults[i] << 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
      o->reps = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
      o->warmup = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--lean-report")) {
      o->lean = 1;
    } else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
      o->nsizes = 0;
      for (char *tok = strtok(argv[++i], ","); tok && o->nsizes < 16; tok = strtok(NULL, ","))
        o->sizes[o->nsizes++] = (size_t)strtoull(tok, NULL, 10) << 20;
    } else {
      fprintf(stderr, "usage: %s [--lean-report] [--sizes 1,4,16,64] [--reps 10] [--warmup 2]  "
              "(sizes in Mi)\n", argv[0]);
      return 0;
    }
  }
  return o->reps > 0 && o->warmup >= 0 && o->nsizes > 0;
}

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, &o)) return 2;
  if (o.lean) return lean_report(&o) ? 0 : 1;
  printf("sg_bench_adamw: fused AdamW step (sg__cpu_adamw) vs STREAM triad, %d OpenMP thread(s), "
         "median of %d after %d warm-up\n", threads(), o.reps, o.warmup);
  printf("bytes per element: f32 params 28, bf16 params (fp32 master) 30, triad 24 (3 doubles)\n\n");
  printf("triad and adamw alternate rep by rep; times are medians; ratio = median of the per-rep\n"
         "ratios of adamw GB/s to triad GB/s; best = ratio of the best times\n\n");
  printf("%8s  %-5s  %9s  %10s  %10s  %6s  %6s  %s\n", "params", "param", "adamw ms", "adamw GB/s",
         "triad GB/s", "ratio", "best", "check");
  int all_ok = 1;
  for (int k = 0; k < o.nsizes; k++) {
    size_t n = o.sizes[k];
    bench_triad tb;
    bench_triad_init(PROG, &tb, n);
    for (int bf16 = 0; bf16 <= 1; bf16++) {
      state s;
      state_init(&s, n, bf16);
      int ok = check_step(&s);
      result r = measure(&s, &tb, &o);
      double gbs = (bf16 ? 30.0 : 28.0) * (double)n / r.adamw_s / 1e9;
      printf("%7zuM  %-5s  %9.2f  %10.2f  %10.2f  %6.2f  %6.2f  %s\n", n >> 20, bf16 ? "bf16" : "f32",
             r.adamw_s * 1e3, gbs, 24.0 * (double)n / r.triad_s / 1e9, r.ratio, r.best_ratio,
             ok ? "ok" : "WRONG");
      all_ok &= ok;
      state_free(&s);
    }
    bench_triad_free(&tb);
  }
  return all_ok ? 0 : 1;
}
