/* sg_bench_host_step: the host side of an offloaded optimizer step (src/offload/sg_host_step.c)
 * for one rank's shard of N parameters, beside the STREAM triad and torch.optim.AdamW on CPU
 * tensors of the same size, all measured in the same run and interleaved rep by rep.
 *
 * The shard: bf16 working parameters in device memory; fp32 master, m, v and the gradient
 * accumulator in pinned host memory (device host_alloc); the reduced fp32 gradient of the last
 * micro-batch in device memory. Per rep:
 *   arrive  the gradient D2H into the empty accumulator (one copy, no host pass)
 *   norm    sumsq and non-finite count over the accumulator in the CUDA kernel's order
 *   update  the chunked pipeline: AdamW on the host into pinned chunk buffers, each chunk's
 *           bf16 values copied H2D on the comm queue while the next chunk updates; drained
 * "step" is norm + update (what sg_step does on the host); "whole" adds arrive (which runs
 * during the backward pass in training). On the CPU device "device memory" is host memory and
 * the copies are memcpy on its comm thread, so they load this machine's memory (and cores) as
 * a GPU's DMA engine would load its host's memory, and more: they also compete for the cores.
 *
 * Bytes counted per parameter (host memory traffic):
 *   arrive 8 (read 4, write 4; --device cuda: the DMA's write, 4); norm 4; AdamW 30 (grad 4,
 *   master r/w 8, m r/w 8, v r/w 8, bf16 write 2); copy-out 4 (read 2, write 2; cuda: 2)
 *   step = 38, whole = 46 (cuda: 36 and 40)
 *   triad a[i] = b[i] + s*c[i] on doubles: 24 (as STREAM counts it)
 *   torch AdamW on f32 params: 28 (no norm, no copies, no master: torch's best case)
 *   kernel: sg__cpu_adamw alone on f32 params, the same work as torch's rows: 28
 * Ratios: whole GB/s over triad GB/s (goal >= 0.8), and torch ms over whole ms (goal >= 1.5
 * against fused), and torch fused ms over kernel ms. Each is the median of the per-rep ratios; times are medians.
 *
 * Before timing, one untimed step is checked against sg_elem_adamw on a sample of elements, and
 * the norm against sg__cpu_sumsq_gpu run once more on one thread.
 *
 *   sg_bench_host_step [--size 16] [--reps 9] [--warmup 2] [--chunk 2] [--python PATH]
 *                      [--device cpu|cuda]
 *   (size and chunk in Mi parameters; --python: an interpreter with torch, default python3;
 *   "--python none" skips torch; --device cuda: the shard's device buffers on GPU 0, pinned host
 *   memory from cudaMallocHost and real DMA copies, in a CUDA build) */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, fdopen, getloadavg needs _DEFAULT_SOURCE */
#define _DEFAULT_SOURCE
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/sg_cpu_kernels.h"     /* sg__cpu_sumsq_gpu, sg__cpu_threads */
#include "device/sg_device.h"       /* the CPU device */
#include "offload/sg_host_step.h"   /* the pipelines under test */
#include "sg_elem.h"                /* sg_elem_adamw: the reference of the untimed check */

#ifndef SG_BENCH_SOURCE_DIR
#define SG_BENCH_SOURCE_DIR "bench"
#endif
#define SEG_MAX ((size_t)4 << 20)
#define MAXREPS 64

typedef struct options {
  size_t n, chunk;
  int reps, warmup, cuda;
  const char *python;
} options;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what) {
  fprintf(stderr, "sg_bench_host_step: %s: %s\n", what, sg_last_error());
  exit(1);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(const double *t, int n) {
  double s[MAXREPS];
  memcpy(s, t, sizeof *t * (size_t)n);
  qsort(s, (size_t)n, sizeof *s, cmp_double);
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

static void fill(float *x, size_t n, float base, float scale) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(sg__cpu_threads())
#endif
  for (size_t i = 0; i < n; i++) x[i] = base + scale * (float)((i * 2654435761u) % 1000u) / 1000.0f;
}

/* ---- STREAM triad ---------------------------------------------------------------------------- */

typedef struct triad_bufs { double *a, *b, *c; size_t n; } triad_bufs;

static void triad_init(triad_bufs *t, size_t n) {
  t->n = n;
  t->a = malloc(8 * n), t->b = malloc(8 * n), t->c = malloc(8 * n);
  if (!t->a || !t->b || !t->c) exit(1);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(sg__cpu_threads())
#endif
  for (size_t i = 0; i < n; i++) t->a[i] = 0.0, t->b[i] = 1.0, t->c[i] = 2.0;
}

static double triad_once(triad_bufs *t) {
  double *restrict a = t->a;
  const double *restrict b = t->b, *restrict c = t->c;
  const size_t n = t->n;
  double t0 = now_s();
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(sg__cpu_threads())
#endif
  for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
  return now_s() - t0;
}

/* ---- the offloaded shard --------------------------------------------------------------------- */

typedef struct shard {
  sg__device *dev;
  size_t n;
  uint16_t *dparam;   /* device: bf16 working params */
  float *dgrad;       /* device: reduced fp32 gradient */
  float *hgrad;       /* its host copy, for the check */
  float *master, *m, *v, *acc; /* pinned host */
  sg__seg *segs;
  int nsegs;
  sg__host_pipe pipe;
} shard;

static void *host(shard *s, size_t bytes) {
  void *p = NULL;
  if (s->dev->ops->host_alloc(s->dev, bytes, &p) != SG_OK) die("host_alloc");
  return p;
}

static void shard_init(shard *s, size_t n, size_t chunk, int cuda) {
  memset(s, 0, sizeof *s);
#ifdef SG_HAVE_CUDA
  if (cuda && sg__device_cuda_create(0, 0, &s->dev) != SG_OK) die("CUDA device");
#else
  if (cuda) {
    fprintf(stderr, "sg_bench_host_step: built without CUDA\n");
    exit(2);
  }
#endif
  if (!cuda && sg__device_cpu_create(0, 1, &s->dev) != SG_OK) die("device");
  s->n = n;
  void *p = NULL;
  if (s->dev->ops->alloc(s->dev, 2 * n, &p) != SG_OK) die("alloc");
  s->dparam = p;
  if (s->dev->ops->alloc(s->dev, 4 * n, &p) != SG_OK) die("alloc");
  s->dgrad = p;
  s->master = host(s, 4 * n), s->m = host(s, 4 * n), s->v = host(s, 4 * n), s->acc = host(s, 4 * n);
  fill(s->master, n, -0.5f, 1.0f), fill(s->m, n, -0.01f, 0.02f), fill(s->v, n, 1e-6f, 1e-4f);
  s->hgrad = malloc(4 * n);
  uint16_t *hp = malloc(2 * n);
  if (!s->hgrad || !hp) exit(1);
  fill(s->hgrad, n, -1.0f, 2.0f), fill(s->acc, n, 0.0f, 0.0f);
  sg__cpu_cast(hp, 1, s->master, 0, n);
  if (s->dev->ops->copy(s->dev, SG_Q_COMPUTE, s->dgrad, s->hgrad, 4 * n, SG_COPY_H2D) != SG_OK ||
      s->dev->ops->copy(s->dev, SG_Q_COMPUTE, s->dparam, hp, 2 * n, SG_COPY_H2D) != SG_OK)
    die("upload");
  free(hp);
  s->nsegs = (int)((n + SEG_MAX - 1) / SEG_MAX);
  s->segs = calloc((size_t)s->nsegs, sizeof *s->segs);
  for (int k = 0; k < s->nsegs; k++) {
    size_t off = (size_t)k * SEG_MAX;
    s->segs[k] = (sg__seg){off, off, n - off < SEG_MAX ? n - off : SEG_MAX, !(k & 1), off, 0};
  }
  if (sg__host_pipe_init(&s->pipe, s->dev, chunk, 2, 4) != SG_OK) die("pipe");
}

static void shard_free(shard *s) {
  sg__host_pipe_free(&s->pipe, INT64_MAX);
  s->dev->ops->free(s->dev, s->dparam), s->dev->ops->free(s->dev, s->dgrad);
  s->dev->ops->host_free(s->dev, s->master), s->dev->ops->host_free(s->dev, s->m);
  s->dev->ops->host_free(s->dev, s->v), s->dev->ops->host_free(s->dev, s->acc);
  s->dev->ops->destroy(s->dev);
  free(s->segs), free(s->hgrad);
}

static sg__adamw_args args_of(const shard *s, uint64_t t, float grad_scale) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = 1, a.master = s->master, a.state[SG__ADAMW_M] = s->m, a.state[SG__ADAMW_V] = s->v;
  a.grad = s->acc, a.grad_dtype = 0, a.segs = s->segs, a.nsegs = s->nsegs;
  a.grad_scale = grad_scale;
  sg__adamw_scalars(&a, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
  return a;
}

typedef struct times { double arrive, norm, update; } times;

/* One step as sg_step would run it on the host; returns the norm. */
static double step_once(shard *s, uint64_t t, times *tm) {
  double t0 = now_s();
  if (sg__host_pipe_arrive(&s->pipe, s->acc, 0, s->dgrad, 0, s->n, 1, INT64_MAX) != SG_OK)
    die("arrive");
  double t1 = now_s(), ss = 0, nf = 0;
  sg__cpu_sumsq_gpu(s->acc, 0, s->n, &ss, &nf);
  const double norm = sqrt(ss);
  const float scale = nf > 0 ? 0.0f : (float)fmin(1.0, 1.0 / (norm + 1e-6)); /* clip to 1 */
  double t2 = now_s();
  sg__adamw_args a = args_of(s, t, scale);
  uint64_t last = 0;
  if (sg__host_pipe_update(&s->pipe, sg__optim_find("adamw"), &a, s->dparam, INT64_MAX, &last) != SG_OK) die("update");
  if (sg__host_pipe_drain(&s->pipe, INT64_MAX) != SG_OK) die("drain");
  double t3 = now_s();
  if (tm) *tm = (times){t1 - t0, t2 - t1, t3 - t2};
  return norm;
}

/* The AdamW kernel alone on f32 params, what torch's rows do: 28 B per parameter. Runs on the
 * shard's own arrays (the master as the f32 params), after the check. */
static double kernel_once(shard *s, uint64_t t) {
  sg__adamw_args a = args_of(s, t, 0.5f);
  a.param = s->master, a.param_dtype = 0, a.master = NULL;
  double t0 = now_s();
  sg__cpu_adamw(&a);
  return now_s() - t0;
}

/* One untimed step; every 4099th element recomputed with the element function. */
static int check_step(shard *s) {
  const size_t stride = 4099, ns = s->n / stride + 1;
  float *p0 = malloc(4 * ns), *m0 = malloc(4 * ns), *v0 = malloc(4 * ns);
  for (size_t j = 0; j < ns && j * stride < s->n; j++)
    p0[j] = s->master[j * stride], m0[j] = s->m[j * stride], v0[j] = s->v[j * stride];
  double ss1 = 0, nf1 = 0;
  sg__cpu_sumsq_gpu(s->hgrad, 0, s->n, &ss1, &nf1);
  const double norm = step_once(s, 1, NULL);
  int ok = norm == sqrt(ss1) && nf1 == 0;
  const float scale = (float)fmin(1.0, 1.0 / (norm + 1e-6));
  sg__adamw_args a = args_of(s, 1, scale);
  uint16_t *hp = malloc(2 * s->n);
  if (!hp || s->dev->ops->copy(s->dev, SG_Q_COMPUTE, hp, s->dparam, 2 * s->n, SG_COPY_D2H) != SG_OK)
    die("download");
  for (size_t j = 0; j < ns && j * stride < s->n; j++) {
    size_t i = j * stride;
    const sg__seg *sg = &s->segs[i / SEG_MAX];
    sg_elem_adamw_k k = sg_elem_adamw_consts(sg->decay ? a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] : 1.0f, a.scalar[SG__ADAMW_ONE_MINUS_BETA1],
                                             a.scalar[SG__ADAMW_BETA2], a.scalar[SG__ADAMW_ONE_MINUS_BETA2], a.group_scalar[0][SG__ADAMW_STEP_SIZE], a.scalar[SG__ADAMW_BC2_SQRT],
                                             a.scalar[SG__ADAMW_EPS]);
    float m = m0[j], v = v0[j];
    float p = sg_elem_adamw(p0[j], s->hgrad[i] * scale, &m, &v, k);
    ok &= s->master[i] == p && s->m[i] == m && s->v[i] == v && hp[i] == sg_elem_f32_to_bf16(p);
  }
  free(p0), free(m0), free(v0), free(hp);
  return ok;
}

/* ---- torch, in a child process driven line by line -------------------------------------------- */

typedef struct torch_child { pid_t pid; FILE *in, *out; char version[64]; int threads; } torch_child;

static int torch_start(torch_child *c, const options *o, int threads) {
  memset(c, 0, sizeof *c);
  if (!o->python || !strcmp(o->python, "none")) return 0;
  int to[2], from[2];
  if (pipe(to) || pipe(from)) return 0;
  char nbuf[32], tbuf[16];
  snprintf(nbuf, sizeof nbuf, "%zu", o->n);
  snprintf(tbuf, sizeof tbuf, "%d", threads);
  c->pid = fork();
  if (c->pid == 0) {
    dup2(to[0], 0), dup2(from[1], 1);
    close(to[0]), close(to[1]), close(from[0]), close(from[1]);
    execlp(o->python, o->python, SG_BENCH_SOURCE_DIR "/adamw_torch.py", "--serve", nbuf,
           "--threads", tbuf, (char *)NULL);
    _exit(127);
  }
  close(to[0]), close(from[1]);
  c->in = fdopen(to[1], "w"), c->out = fdopen(from[0], "r");
  char line[256];
  if (c->pid < 0 || !c->in || !c->out || !fgets(line, sizeof line, c->out) ||
      sscanf(line, "ready %63s %d", c->version, &c->threads) != 2) {
    printf("torch: not measured (%s)\n", c->pid > 0 && c->out ? "no torch in that interpreter" : "no child");
    if (c->in) fclose(c->in);
    if (c->out) fclose(c->out);
    if (c->pid > 0) waitpid(c->pid, NULL, 0);
    c->pid = 0;
    return 0;
  }
  return 1;
}

static double torch_step(torch_child *c, const char *which) {
  char line[64];
  fprintf(c->in, "%s\n", which);
  fflush(c->in);
  if (!fgets(line, sizeof line, c->out)) return NAN;
  return atof(line) * 1e-3;
}

static void torch_stop(torch_child *c) {
  if (!c->pid) return;
  fprintf(c->in, "quit\n");
  fclose(c->in), fclose(c->out);
  waitpid(c->pid, NULL, 0);
}

/* ---- main ------------------------------------------------------------------------------------ */

static int parse(int argc, char **argv, options *o) {
  *o = (options){(size_t)16 << 20, (size_t)2 << 20, 9, 2, 0, "python3"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--size")) o->n = (size_t)(atof(argv[i + 1]) * (1 << 20));
    else if (!strcmp(argv[i], "--chunk")) o->chunk = (size_t)(atof(argv[i + 1]) * (1 << 20));
    else if (!strcmp(argv[i], "--reps")) o->reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--warmup")) o->warmup = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--python")) o->python = argv[i + 1];
    else if (!strcmp(argv[i], "--device")) o->cuda = !strcmp(argv[i + 1], "cuda");
    else return 0;
  }
  if (argc % 2 == 0) return 0;
  if (o->reps > MAXREPS) o->reps = MAXREPS;
  return o->n >= 1024 && o->chunk >= 1024 && o->reps > 0 && o->warmup >= 0;
}

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, &o)) {
    fprintf(stderr, "usage: %s [--size 16] [--reps 9] [--warmup 2] [--chunk 2] [--python PATH] [--device cpu|cuda]\n"
                    "  (size and chunk in Mi parameters)\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  const int threads = sg__cpu_threads();
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = -1;
  const char *wp = getenv("OMP_WAIT_POLICY");
  printf("OMP_WAIT_POLICY=%s\n", wp ? wp : "(unset: libgomp spins at barriers)");
  printf("sg_bench_host_step: offloaded host step on the %s device, %.2fM params (bf16 working, "
         "fp32 state), chunks of %.2fM, %d thread(s), median of %d after %d warm-up, load average %.1f on %ld CPUs\n",
         o.cuda ? "CUDA" : "CPU", o.n / 1048576.0, o.chunk / 1048576.0, threads, o.reps, o.warmup, load[0],
         sysconf(_SC_NPROCESSORS_ONLN));
  shard s;
  shard_init(&s, o.n, o.chunk, o.cuda);
  triad_bufs tb;
  triad_init(&tb, o.n);
  const int ok = check_step(&s);
  torch_child tc;
  const int have_torch = torch_start(&tc, &o, threads);
  if (have_torch) printf("torch %s, %d thread(s), f32 params, fused and foreach\n", tc.version, tc.threads);
  double ta[MAXREPS], tn[MAXREPS], tu[MAXREPS], tt[MAXREPS], tf[MAXREPS], te[MAXREPS];
  double r_triad[MAXREPS], r_fused[MAXREPS], r_foreach[MAXREPS], r_step_triad[MAXREPS];
  double tk[MAXREPS], r_kernel[MAXREPS];
  uint64_t t = 2;
  /* host bytes per parameter: a GPU's DMA writes the arrival (4) and reads the copy-out (2); the
   * CPU device's memcpy also reads (4) and writes (2) the "device" side, in host memory */
  const double b_arrive = o.cuda ? 4 : 8, b_out = o.cuda ? 2 : 4;
  const double b_step = 4 + 30 + b_out, b_whole = b_arrive + b_step;
  for (int r = -o.warmup; r < o.reps; r++) {
    times tm;
    const double tri = triad_once(&tb);
    step_once(&s, t++, &tm);
    const double ker = kernel_once(&s, t++);
    const double fu = have_torch ? torch_step(&tc, "fused") : NAN;
    const double fe = have_torch ? torch_step(&tc, "foreach") : NAN;
    if (r < 0) continue;
    tk[r] = ker, r_kernel[r] = fu / ker;
    ta[r] = tm.arrive, tn[r] = tm.norm, tu[r] = tm.update, tt[r] = tri, tf[r] = fu, te[r] = fe;
    const double whole = tm.arrive + tm.norm + tm.update, step = tm.norm + tm.update;
    r_triad[r] = (b_whole / whole) / (24.0 / tri);
    r_step_triad[r] = (b_step / step) / (24.0 / tri);
    r_fused[r] = fu / whole, r_foreach[r] = fe / whole;
  }
  const double n = (double)o.n, ma = median(ta, o.reps), mn = median(tn, o.reps);
  const double mu = median(tu, o.reps), mt = median(tt, o.reps);
  printf("\n%-28s %9s %9s\n", "phase", "ms", "GB/s");
  printf("%-28s %9.2f %9.2f\n", "triad (24 B/param)", mt * 1e3, 24 * n / mt / 1e9);
  char lab[64];
  snprintf(lab, sizeof lab, "arrive (D2H, %.0f B)", b_arrive);
  printf("%-28s %9.2f %9.2f\n", lab, ma * 1e3, b_arrive * n / ma / 1e9);
  printf("%-28s %9.2f %9.2f\n", "norm (4 B)", mn * 1e3, 4 * n / mn / 1e9);
  snprintf(lab, sizeof lab, "update + copy-out (%.0f B)", 30 + b_out);
  printf("%-28s %9.2f %9.2f\n", lab, mu * 1e3, (30 + b_out) * n / mu / 1e9);
  snprintf(lab, sizeof lab, "step = norm + update (%.0f B)", b_step);
  printf("%-28s %9.2f %9.2f\n", lab, (mn + mu) * 1e3, b_step * n / (mn + mu) / 1e9);
  snprintf(lab, sizeof lab, "whole = arrive + step (%.0f B)", b_whole);
  printf("%-28s %9.2f %9.2f\n", lab, (ma + mn + mu) * 1e3, b_whole * n / (ma + mn + mu) / 1e9);
  const double mk = median(tk, o.reps);
  printf("%-28s %9.2f %9.2f\n", "AdamW kernel, f32 (28 B)", mk * 1e3, 28 * n / mk / 1e9);
  if (have_torch) {
    const double mf = median(tf, o.reps), me = median(te, o.reps);
    printf("%-28s %9.2f %9.2f\n", "torch fused (28 B)", mf * 1e3, 28 * n / mf / 1e9);
    printf("%-28s %9.2f %9.2f\n", "torch foreach (28 B)", me * 1e3, 28 * n / me / 1e9);
  }
  printf("\nratios (medians of per-rep ratios):\n");
  printf("  whole GB/s / triad GB/s   %6.2f   (goal >= 0.8)\n", median(r_triad, o.reps));
  printf("  step GB/s / triad GB/s    %6.2f\n", median(r_step_triad, o.reps));
  if (have_torch) {
    printf("  torch fused ms / whole ms %6.2f   (goal >= 1.5)\n", median(r_fused, o.reps));
    printf("  torch foreach ms / whole  %6.2f\n", median(r_foreach, o.reps));
    printf("  torch fused ms / kernel   %6.2f   (the same work: f32 AdamW alone)\n",
           median(r_kernel, o.reps));
  }
  printf("check: %s\n", ok ? "ok" : "WRONG");
  torch_stop(&tc);
  free(tb.a), free(tb.b), free(tb.c);
  shard_free(&s);
  return ok ? 0 : 1;
}
