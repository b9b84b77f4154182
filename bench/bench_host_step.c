/* sg_bench_host_step: the host side of an offloaded optimizer step for one rank's shard of N
 * parameters, through the engine's own code (src/offload/sg_offload.c: what the offloading
 * strategy calls), beside the STREAM triad and torch.optim.AdamW on CPU tensors of the same
 * size, all measured in the same run and interleaved rep by rep.
 *
 * The shard: bf16 working parameters in device memory; fp32 master, m, v and the gradient
 * accumulator in pinned host memory (device host_alloc), buckets of --bucket parameters; each
 * bucket's reduced gradient (--reduce f32 or bf16) in device memory. Per rep:
 *   arrive  every bucket's slice, last bucket first, as the engine's reduction jobs bring it:
 *           f32 straight D2H into the empty accumulator (no host pass); bf16 D2H into one of two
 *           landing buffers, folded (cast to fp32, the norm's partials in the same pass) when
 *           the buffer is taken again
 *   norm    the folds still pending, the partials no fold gave (f32: every chunk; bf16: the
 *           chunks across two buckets), combined in the CUDA sumsq kernel's order
 *   update  bucket by bucket, the chunked pipeline: AdamW on the host straight into pinned
 *           chunk buffers, each chunk's bf16 values copied H2D on the comm queue while the next
 *           chunk updates; drained
 * "whole" = arrive + norm + update, the definition of issue 12's goal (copies included; arrive
 * runs during the backward pass in training). On the CPU device "device memory" is host memory
 * and the copies are memcpy on its comm thread, so they load this machine's memory (and cores)
 * as a GPU's DMA engine would load its host's memory, and more: they also take CPU time. The
 * offloaded state keeps the CUDA device's norm order here too (gpu_order). --fold-norm 0: the
 * folds compute no partials and the norm reads the whole accumulator in a pass of its own (the
 * step before 2066bcc; in the CPU device's order, which costs the same), to compare; "ab": each
 * rep also runs that step, and the arrive + norm times are compared rep by rep.
 *
 * Host memory bytes per parameter (read + written; count_bytes):
 *   f32:  arrive 8 (memcpy 4 + 4; --device cuda: the DMA's write, 4); norm 4
 *   bf16: arrive + norm 10 (memcpy 2 + 2, cuda 2; the fold reads 2, writes 4)
 *   update 34: AdamW 30 (grad 4, master, m, v r/w 24, bf16 write 2), copy-out 4 (cuda: 2)
 *   whole 46 (f32) or 44 (bf16); cuda 40 and 40
 *   CPU passes when a GPU's DMA does the copies: 34 (f32: norm 4 + AdamW 30), 36 (bf16: fold 6)
 *   triad a[i] = b[i] + s*c[i] on doubles: 24 (as STREAM counts it)
 *   torch AdamW on f32 params: 28 (no norm, no copies, no master: torch's best case)
 *   kernel rows: sg__cpu_adamw alone, f32 params (torch's work, 28) and bf16 + master (30)
 * Ratios, each the median of the per-rep ratios (times are medians):
 *   whole GB/s / triad GB/s (goal >= 0.8); torch fused ms / whole ms (goal >= 1.5);
 *   "at best": torch fused ms over the whole step's bytes at the f32 kernel's bandwidth of the
 *   same rep (what fewer passes can reach, no more); "host passes": torch fused ms over the
 *   CPU's own passes on a GPU (norm, bf16: the arrival's folds, and the bf16 AdamW kernel with
 *   no copies); torch fused ms / f32 kernel ms (the same work).
 *
 * Before timing, one untimed step is checked against sg_elem_adamw on a sample of elements, and
 * the norm against sg__cpu_sumsq_gpu over the gradient's values.
 *
 * --q8 1: a second shard of the same size with 8-bit optimizer state (cfg.optim_state_dtype
 * SG_Q8 with offload: what sg_state_host_q8.c runs, the optimizer's 8-bit loop in the same
 * pipeline), its step run after the fp32 shard's in every rep; printed: its update (22.06 B per
 * parameter: m and v one byte each way instead of four, and their scales) and whole step, and
 * the medians of their per-rep ratios to the fp32 shard's. Its check: a step bit for bit that of
 * sg__cpu_adamw_q8 over copies of the state in one call (master, codes, scales, bf16 values).
 *
 *   sg_bench_host_step [--size 16] [--bucket 4] [--reps 9] [--warmup 2] [--chunk 2]
 *                      [--reduce f32|bf16] [--fold-norm 1|0|ab] [--python PATH|none]
 *                      [--device cpu|cuda] [--q8 0|1]
 *   (size, bucket and chunk in Mi parameters; --python: an interpreter with torch, default
 *   python3; "none" skips torch; --device cuda: the shard's device buffers on GPU 0, pinned host
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

#include "bench_util.h"             /* bench_now_s */
#include "cpu/sg_cpu_kernels.h"     /* sg__cpu_sumsq_gpu, sg__cpu_threads */
#include "device/sg_device.h"       /* the CPU device */
#include "offload/sg_offload.h"     /* the offloaded state and its pipelines, under test */
#include "sg_elem.h"                /* sg_elem_adamw: the reference of the untimed check */

#ifndef SG_BENCH_SOURCE_DIR
#define SG_BENCH_SOURCE_DIR "bench"
#endif
#define MAXREPS 64
#define MAXBUCKETS 4096

typedef struct options {
  size_t n, chunk, bucket;
  int reps, warmup, cuda, rdt, fold_norm;
  const char *python;
  int q8; /* --q8 1: a second shard with 8-bit optimizer state, its step beside the fp32 one */
} options;

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
  double t0 = bench_now_s();
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(sg__cpu_threads())
#endif
  for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
  return bench_now_s() - t0;
}

/* ---- the offloaded shard ------------------------------------------------------------------- */

typedef struct shard {
  sg__device *dev;
  size_t n;
  int rdt;              /* reduce dtype: 0 f32 (straight into the accumulator), 1 bf16 (lands) */
  uint16_t *dparam;     /* device: bf16 working params */
  void *dgrad;          /* device: the reduced gradient, rdt */
  float *hgrad;         /* its values as f32, for the check */
  sg__offload off;      /* master, m, v, accumulator, landing buffers, update pipeline */
  sg__seg *segs;        /* segment k is bucket k's slice */
  int nsegs;
  uint16_t *kernel_out; /* host: the bf16 kernel row's output */
  /* 8-bit state (q8 = 1), as sg_state_host_q8.c keeps it: codes and scales of m and v in host
   * memory, every block coded, the update's segments cut at the blocks (first[k]: bucket k's
   * first block, first[nsegs]: their count); the offloaded state holds no fp32 moments */
  int q8;
  uint8_t *code[2];
  float *scale[2], pool[2][SG__Q8_BLOCK];
  uint32_t *map;
  sg__seg *blocks;
  int *first;
} shard;

typedef struct arrival { sg__offload *o; int k; const void *src; int dt; } arrival;

static sg_status arrival_fn(void *arg) {
  const arrival *j = arg;
  return sg__offload_arrive_job(j->o, j->k, j->src, j->dt, 1);
}

static void q8_init(shard *s);

static void shard_init(shard *s, const options *o, int q8) {
  memset(s, 0, sizeof *s);
  s->q8 = q8;
#ifdef SG_HAVE_CUDA
  if (o->cuda && sg__device_cuda_create(0, 0, &s->dev) != SG_OK) die("CUDA device");
#else
  if (o->cuda) {
    fprintf(stderr, "sg_bench_host_step: built without CUDA\n");
    exit(2);
  }
#endif
  if (!o->cuda && sg__device_cpu_create(0, 1, &s->dev) != SG_OK) die("device");
  const size_t n = o->n, bucket = o->bucket, G = o->rdt ? 2 : 4;
  s->n = n, s->rdt = o->rdt;
  s->nsegs = (int)((n + bucket - 1) / bucket);
  s->segs = calloc((size_t)s->nsegs, sizeof *s->segs);
  size_t *off = calloc((size_t)s->nsegs, sizeof *off), *len = calloc((size_t)s->nsegs, sizeof *len);
  if (!s->segs || !off || !len) exit(1);
  for (int k = 0; k < s->nsegs; k++) {
    off[k] = (size_t)k * bucket, len[k] = n - off[k] < bucket ? n - off[k] : bucket;
    s->segs[k] = (sg__seg){off[k], off[k], len[k], !(k & 1), off[k], 0};
  }
  /* the engine's sizes: two landing buffers (staging_buckets' default), chunks as given */
  if (sg__offload_init(&s->off, s->dev, q8 ? NULL : sg__optim_find("adamw"), n, SG_BF16, SG_F32,
                       s->nsegs, off, len, o->chunk, 2, bucket * G) != SG_OK)
    die("offload state");
  /* the CUDA device's norm order, on whichever device stands in for it */
  s->off.gpu_order = o->fold_norm != 0;
  free(off), free(len);
  void *p = NULL;
  if (s->dev->ops->alloc(s->dev, 2 * n, &p) != SG_OK) die("alloc");
  s->dparam = p;
  if (s->dev->ops->alloc(s->dev, G * n, &p) != SG_OK) die("alloc");
  s->dgrad = p;
  float *master = sg__offload_state(&s->off, 0);
  fill(master, n, -0.5f, 1.0f);
  if (q8) {
    q8_init(s);
  } else {
    fill(sg__offload_state(&s->off, 1), n, -0.01f, 0.02f);
    fill(sg__offload_state(&s->off, 2), n, 1e-6f, 1e-4f);
  }
  s->hgrad = malloc(4 * n);
  void *hp = malloc(4 * n);
  if (!s->hgrad || !hp) exit(1);
  fill(s->hgrad, n, -1.0f, 2.0f);
  sg__cpu_cast(hp, s->rdt, s->hgrad, 0, n);
  sg__cpu_cast(s->hgrad, 0, hp, s->rdt, n); /* the values the device holds */
  if (s->dev->ops->copy(s->dev, SG_Q_COMPUTE, s->dgrad, hp, G * n, SG_COPY_H2D) != SG_OK) die("upload");
  sg__cpu_cast(hp, 1, master, 0, n);
  if (s->dev->ops->copy(s->dev, SG_Q_COMPUTE, s->dparam, hp, 2 * n, SG_COPY_H2D) != SG_OK)
    die("upload");
  free(hp);
  s->kernel_out = malloc(2 * n);
  if (!s->kernel_out) exit(1);
  fill((float *)s->kernel_out, n / 2, 0.0f, 0.0f);
}

static void shard_free(shard *s) {
  sg__offload_free(&s->off, INT64_MAX);
  s->dev->ops->free(s->dev, s->dparam), s->dev->ops->free(s->dev, s->dgrad);
  s->dev->ops->destroy(s->dev);
  free(s->segs), free(s->hgrad), free(s->kernel_out);
  free(s->code[0]), free(s->code[1]), free(s->scale[0]), free(s->scale[1]);
  free(s->map), free(s->blocks), free(s->first);
}

/* The 8-bit state of a fresh engine (zero codes and scales: m = v = 0) and the blocks: bucket
 * k's slice cut into segments of SG__Q8_BLOCK from its start, its decay flag, counters at the
 * blocks' starts (every slice starts at a multiple of the block: parse checks the sizes). */
static void q8_init(shard *s) {
  const size_t nb = (s->n + SG__Q8_BLOCK - 1) / SG__Q8_BLOCK;
  for (int k = 0; k < 2; k++) {
    s->code[k] = calloc(s->n, 1), s->scale[k] = calloc(nb, sizeof(float));
    if (!s->code[k] || !s->scale[k]) exit(1);
  }
  s->map = malloc(nb * sizeof *s->map), s->blocks = malloc(nb * sizeof *s->blocks);
  s->first = malloc(((size_t)s->nsegs + 1) * sizeof *s->first);
  if (!s->map || !s->blocks || !s->first) exit(1);
  size_t j = 0;
  for (int k = 0; k < s->nsegs; k++) {
    s->first[k] = (int)j;
    const sg__seg *b = &s->segs[k];
    for (size_t o = 0; o < b->len; o += SG__Q8_BLOCK, j++) {
      const size_t len = b->len - o < SG__Q8_BLOCK ? b->len - o : SG__Q8_BLOCK;
      s->blocks[j] = (sg__seg){b->shard_off + o, b->flat_off + o, len, b->decay, b->sr_index + o, 0};
      s->map[j] = SG__Q8_CODED;
    }
  }
  s->first[s->nsegs] = (int)j;
}

/* a (bucket k's segment and the step's scalars) with the 8-bit state: bucket k's blocks. */
static sg__update_args q8_args(shard *s, const sg__update_args *a, int k) {
  sg__update_args b = *a;
  b.segs = s->blocks + s->first[k], b.nsegs = s->first[k + 1] - s->first[k];
  for (int i = 0; i < 2; i++)
    b.state[i] = s->pool[i], b.q8_code[i] = s->code[i], b.q8_scale[i] = s->scale[i];
  b.q8_f32 = s->map;
  return b;
}

static sg__adamw_args args_of(const shard *s, int k, uint64_t t, float grad_scale) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = SG_BF16, a.grad_dtype = SG_F32, a.segs = s->segs + k, a.nsegs = 1;
  a.grad_scale = grad_scale;
  sg__adamw_scalars(&a, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
  return a;
}

typedef struct times { double arrive, norm, update; } times;

/* Every bucket's reduced slice arrives, last bucket first (backward order), as the engine's
 * reduction jobs bring it: planned on this thread (which folds a landing buffer it takes),
 * copied D2H in a comm job. Returns when the last copy completed. */
static void arrive_all(shard *s) {
  arrival jobs[MAXBUCKETS];
  uint64_t last = 0;
  for (int k = s->nsegs - 1; k >= 0; k--) {
    const size_t es = s->rdt ? 2 : 4;
    jobs[k] = (arrival){&s->off, k, (const char *)s->dgrad + s->segs[k].shard_off * es, s->rdt};
    if (sg__offload_arrive_plan(&s->off, k, s->rdt, INT64_MAX) != SG_OK ||
        s->dev->ops->comm_submit(s->dev, arrival_fn, NULL, &jobs[k], &last) != SG_OK)
      die("arrive");
    sg__offload_arrive_submitted(&s->off, k, last);
  }
  if (s->dev->ops->comm_wait(s->dev, last, INT64_MAX) != SG_OK) die("arrive");
}

/* One step as sg_step runs it on the host (sg_offload_ops.c); returns the norm. */
static double step_once(shard *s, uint64_t t, times *tm) {
  double t0 = bench_now_s();
  arrive_all(s);
  double t1 = bench_now_s(), ss[2];
  if (sg__offload_fold_all(&s->off, INT64_MAX) != SG_OK || sg__offload_norm(&s->off, ss) != SG_OK)
    die("norm");
  const double norm = sqrt(ss[0]);
  const float scale = ss[1] > 0 ? 0.0f : (float)fmin(1.0, 1.0 / (norm + 1e-6)); /* clip to 1 */
  double t2 = bench_now_s();
  for (int k = s->nsegs - 1; k >= 0; k--) { /* last bucket first, as sg_step */
    sg__adamw_args a = args_of(s, k, t, scale);
    uint64_t last = 0;
    sg_status st;
    if (s->q8) { /* as sg_state_host_q8.c's update: the optimizer's 8-bit loop on the host */
      const sg__update_args b = q8_args(s, &a, k);
      st = sg__offload_update_with(&s->off, sg__optim_find("adamw")->q8, &b, s->dparam,
                                   INT64_MAX, &last);
    } else {
      st = sg__offload_update(&s->off, &a, s->dparam, INT64_MAX, &last);
    }
    if (st != SG_OK) die("update");
  }
  if (sg__host_pipe_drain(&s->off.pipe, INT64_MAX) != SG_OK) die("drain");
  double t3 = bench_now_s();
  if (sg__offload_clear(&s->off, INT64_MAX) != SG_OK) die("clear");
  if (tm) *tm = (times){t1 - t0, t2 - t1, t3 - t2};
  return norm;
}

/* The AdamW kernel alone over the shard's own arrays: on f32 params (the master as the
 * params, no master: what torch's rows do, 28 B per parameter), or on the bf16 working values
 * with the master into host memory with no copies (30 B: the update's host passes when a
 * GPU's DMA engine does the copies). After the check. */
static double kernel_once(shard *s, uint64_t t, int bf16) {
  sg__adamw_args a = args_of(s, 0, t, 0.5f);
  sg__seg all = {0, 0, s->n, 1, 0, 0};
  a.segs = &all, a.nsegs = 1;
  a.master = sg__offload_state(&s->off, 0), a.grad = s->off.accum;
  a.state[SG__ADAMW_M] = sg__offload_state(&s->off, 1), a.state[SG__ADAMW_V] = sg__offload_state(&s->off, 2);
  if (bf16)
    a.param = s->kernel_out;
  else
    a.param = a.master, a.param_dtype = SG_F32, a.master = NULL;
  double t0 = bench_now_s();
  sg__cpu_adamw(&a);
  return bench_now_s() - t0;
}

/* A step's norm is the gradient's, summed in the order of the device the shard stands for. */
static int norm_ok(const shard *s, double norm) {
  double ss = 0, nf = 0;
  if (s->off.gpu_order)
    sg__cpu_sumsq_gpu(s->hgrad, 0, s->n, &ss, &nf);
  else
    sg__cpu_sumsq(s->hgrad, 0, s->n, &ss, &nf);
  return norm == sqrt(ss) && nf == 0;
}

/* One untimed step; every 4099th element recomputed with the element function. */
static int check_step(shard *s) {
  const size_t stride = 4099, ns = s->n / stride + 1;
  float *p0 = malloc(4 * ns), *m0 = malloc(4 * ns), *v0 = malloc(4 * ns);
  float *master = sg__offload_state(&s->off, 0), *mm = sg__offload_state(&s->off, 1);
  float *vv = sg__offload_state(&s->off, 2);
  for (size_t j = 0; j < ns && j * stride < s->n; j++)
    p0[j] = master[j * stride], m0[j] = mm[j * stride], v0[j] = vv[j * stride];
  const double norm = step_once(s, 1, NULL);
  int ok = norm_ok(s, norm);
  const float scale = (float)fmin(1.0, 1.0 / (norm + 1e-6));
  uint16_t *hp = malloc(2 * s->n);
  if (!hp || s->dev->ops->copy(s->dev, SG_Q_COMPUTE, hp, s->dparam, 2 * s->n, SG_COPY_D2H) != SG_OK)
    die("download");
  for (size_t j = 0; j < ns && j * stride < s->n; j++) {
    size_t i = j * stride;
    const int k = (int)(i / (s->segs[0].len));
    sg__adamw_args a = args_of(s, k, 1, scale);
    sg_elem_adamw_k kk = sg__adamw_consts(&a, 0, s->segs[k].decay);
    float m = m0[j], v = v0[j];
    float p = sg_elem_adamw(p0[j], s->hgrad[i] * scale, &m, &v, kk);
    ok &= master[i] == p && mm[i] == m && vv[i] == v && hp[i] == sg_elem_f32_to_bf16(p);
  }
  free(p0), free(m0), free(v0), free(hp);
  return ok;
}

/* The 8-bit shard: one untimed step to fill the state, then one step checked bit for bit
 * against the 8-bit CPU loop run over copies of the state as a whole (every block in one call,
 * no pipeline): master, codes, scales and the bf16 working values the pipeline copied out. */
static int check_step_q8(shard *s) {
  step_once(s, 1, NULL);
  const size_t n = s->n, nb = (size_t)s->first[s->nsegs];
  float *master = sg__offload_state(&s->off, 0);
  float *m0 = malloc(4 * n), *sc[2] = {malloc(4 * nb), malloc(4 * nb)};
  uint8_t *cd[2] = {malloc(n), malloc(n)};
  uint16_t *p16 = malloc(2 * n), *hp = malloc(2 * n);
  if (!m0 || !sc[0] || !sc[1] || !cd[0] || !cd[1] || !p16 || !hp) exit(1);
  memcpy(m0, master, 4 * n);
  for (int k = 0; k < 2; k++) memcpy(cd[k], s->code[k], n), memcpy(sc[k], s->scale[k], 4 * nb);
  const double norm = step_once(s, 2, NULL);
  int ok = norm_ok(s, norm);
  sg__adamw_args a = args_of(s, 0, 2, (float)fmin(1.0, 1.0 / (norm + 1e-6)));
  float pool[2][SG__Q8_BLOCK];
  a.segs = s->blocks, a.nsegs = (int)nb, a.master = m0, a.grad = s->hgrad, a.param = p16;
  for (int k = 0; k < 2; k++) a.state[k] = pool[k], a.q8_code[k] = cd[k], a.q8_scale[k] = sc[k];
  a.q8_f32 = s->map;
  sg__cpu_adamw_q8(&a);
  if (s->dev->ops->copy(s->dev, SG_Q_COMPUTE, hp, s->dparam, 2 * n, SG_COPY_D2H) != SG_OK)
    die("download");
  ok &= !memcmp(m0, master, 4 * n) && !memcmp(p16, hp, 2 * n);
  for (int k = 0; k < 2; k++)
    ok &= !memcmp(cd[k], s->code[k], n) && !memcmp(sc[k], s->scale[k], 4 * nb);
  free(m0), free(sc[0]), free(sc[1]), free(cd[0]), free(cd[1]), free(p16), free(hp);
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
  *o = (options){(size_t)16 << 20, (size_t)2 << 20, (size_t)4 << 20, 9, 2, 0, 0, 1, "python3", 0};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--size")) o->n = (size_t)(atof(argv[i + 1]) * (1 << 20));
    else if (!strcmp(argv[i], "--chunk")) o->chunk = (size_t)(atof(argv[i + 1]) * (1 << 20));
    else if (!strcmp(argv[i], "--bucket")) o->bucket = (size_t)(atof(argv[i + 1]) * (1 << 20));
    else if (!strcmp(argv[i], "--reps")) o->reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--warmup")) o->warmup = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--python")) o->python = argv[i + 1];
    else if (!strcmp(argv[i], "--device") && (!strcmp(argv[i + 1], "cpu") || !strcmp(argv[i + 1], "cuda")))
      o->cuda = !strcmp(argv[i + 1], "cuda");
    else if (!strcmp(argv[i], "--fold-norm") && (!strcmp(argv[i + 1], "0") || !strcmp(argv[i + 1], "1")))
      o->fold_norm = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--fold-norm") && !strcmp(argv[i + 1], "ab"))
      o->fold_norm = 2;
    else if (!strcmp(argv[i], "--reduce") && (!strcmp(argv[i + 1], "f32") || !strcmp(argv[i + 1], "bf16")))
      o->rdt = !strcmp(argv[i + 1], "bf16");
    else if (!strcmp(argv[i], "--q8") && (!strcmp(argv[i + 1], "0") || !strcmp(argv[i + 1], "1")))
      o->q8 = atoi(argv[i + 1]);
    else return 0;
  }
  /* 8-bit state: slices and chunks start at blocks, as the planner and the placement keep them */
  if (o->q8 && (o->n % SG__Q8_BLOCK || o->bucket % SG__Q8_BLOCK || o->chunk % SG__Q8_BLOCK))
    return 0;
  if (argc % 2 == 0) return 0;
  if (o->reps > MAXREPS) o->reps = MAXREPS;
  return o->n >= 1024 && o->chunk >= 1024 && o->bucket >= 1024 && o->reps > 0 && o->warmup >= 0 &&
         (o->n + o->bucket - 1) / o->bucket <= MAXBUCKETS;
}

/* Host memory bytes per parameter of each phase (read + written), by what moves them. */
typedef struct bytes { double arrive, norm, update, whole, cpu_gpu; } bytes;

static bytes count_bytes(const options *o) {
  bytes b;
  /* arrival: f32 straight into the accumulator (the D2H writes 4; the CPU device's memcpy also
   * reads 4); bf16 into a landing buffer (D2H 2, memcpy 2 + 2) and the fold, which reads it and
   * writes the fp32 accumulator with the norm's partials in the same pass (2 + 4) */
  b.arrive = o->rdt ? (o->cuda ? 2 : 4) + 6 : o->cuda ? 4 : 8;
  /* bf16: the partials came with the fold (only chunks across buckets), unless --fold-norm 0 */
  b.norm = o->rdt && o->fold_norm ? 0 : 4;
  /* AdamW 30 (grad 4, master, m, v r/w 24, bf16 out 2), copy-out (DMA reads 2; memcpy 2 + 2) */
  b.update = 30 + (o->cuda ? 2 : 4);
  b.whole = b.arrive + b.norm + b.update;
  /* the CPU's own passes where a GPU's copy engine does the copies */
  b.cpu_gpu = (o->rdt ? 6 : 0) + b.norm + 30;
  return b;
}

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, &o)) {
    fprintf(stderr, "usage: %s [--size 16] [--bucket 4] [--reps 9] [--warmup 2] [--chunk 2] [--reduce f32|bf16] [--fold-norm 1|0|ab]\n"
                    "          [--python PATH|none] [--device cpu|cuda] [--q8 0|1]\n"
                    "  (size, bucket and chunk in Mi parameters)\n", argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  const int threads = sg__cpu_threads();
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = -1;
  const char *wp = getenv("OMP_WAIT_POLICY");
  printf("OMP_WAIT_POLICY=%s\n", wp ? wp : "(unset: libgomp spins at barriers)");
  printf("sg_bench_host_step: offloaded host step on the %s device, %.2fM params (bf16 working, "
         "fp32 state), %s gradients in buckets of %.2fM%s, chunks of %.2fM, %d thread(s), median of %d after %d warm-up, "
         "load average %.2f %.2f %.2f on %ld CPUs\n",
         o.cuda ? "CUDA" : "CPU", o.n / 1048576.0, o.rdt ? "bf16" : "f32", o.bucket / 1048576.0,
         o.fold_norm ? "" : " (--fold-norm 0: a norm pass of its own)",
         o.chunk / 1048576.0, threads, o.reps, o.warmup, load[0], load[1], load[2],
         sysconf(_SC_NPROCESSORS_ONLN));
  shard s, sq;
  shard_init(&s, &o, 0);
  if (o.q8) shard_init(&sq, &o, 1);
  triad_bufs tb;
  triad_init(&tb, o.n);
  const int ok = check_step(&s), ok_q8 = o.q8 ? check_step_q8(&sq) : 1;
  torch_child tc;
  const int have_torch = torch_start(&tc, &o, threads);
  if (have_torch) printf("torch %s, %d thread(s), f32 params, fused and foreach\n", tc.version, tc.threads);
  double ta[MAXREPS], tn[MAXREPS], tu[MAXREPS], tt[MAXREPS], tf[MAXREPS], te[MAXREPS];
  double tk[MAXREPS], tk16[MAXREPS], r_triad[MAXREPS], r_fused[MAXREPS], r_foreach[MAXREPS];
  double r_kernel[MAXREPS], r_host[MAXREPS], r_bound[MAXREPS];
  double t_old[MAXREPS], t_oldw[MAXREPS], r_ab[MAXREPS];
  double tq_u[MAXREPS], tq_w[MAXREPS], r_q8u[MAXREPS], r_q8w[MAXREPS];
  uint64_t t = 2, tq = 3;
  const bytes B = count_bytes(&o);
  for (int r = -o.warmup; r < o.reps; r++) {
    times tm;
    const double tri = triad_once(&tb);
    step_once(&s, t++, &tm);
    const double ker = kernel_once(&s, t++, 0), ker16 = kernel_once(&s, t++, 1);
    times old = {NAN, NAN, NAN};
    if (o.fold_norm == 2) { /* the same step with the norm in a pass of its own */
      s.off.gpu_order = 0;
      step_once(&s, t++, &old);
      s.off.gpu_order = 1;
    }
    times q = {NAN, NAN, NAN};
    if (o.q8) step_once(&sq, tq++, &q);
    const double fu = have_torch ? torch_step(&tc, "fused") : NAN;
    const double fe = have_torch ? torch_step(&tc, "foreach") : NAN;
    if (r < 0) continue;
    tq_u[r] = q.update, tq_w[r] = q.arrive + q.norm + q.update;
    r_q8u[r] = q.update / tm.update, r_q8w[r] = tq_w[r] / (tm.arrive + tm.norm + tm.update);
    ta[r] = tm.arrive, tn[r] = tm.norm, tu[r] = tm.update, tt[r] = tri, tf[r] = fu, te[r] = fe;
    tk[r] = ker, tk16[r] = ker16;
    t_old[r] = old.arrive + old.norm, r_ab[r] = (tm.arrive + tm.norm) / t_old[r];
    t_oldw[r] = old.arrive + old.norm + old.update;
    const double whole = tm.arrive + tm.norm + tm.update;
    r_triad[r] = (B.whole / whole) / (24.0 / tri);
    r_fused[r] = fu / whole, r_foreach[r] = fe / whole, r_kernel[r] = fu / ker;
    /* the host's passes on a GPU: the fold (bf16) or the norm, and AdamW with no copies */
    r_host[r] = fu / ((o.rdt ? tm.arrive : 0) + tm.norm + ker16);
    /* the whole step's bytes at the f32 kernel's bandwidth (same rep): the best it could do */
    r_bound[r] = fu / (ker * B.whole / 28.0);
  }
  const double n = (double)o.n, ma = median(ta, o.reps), mn = median(tn, o.reps);
  const double mu = median(tu, o.reps), mt = median(tt, o.reps);
  char lab[64];
  printf("\n%-34s %9s %9s\n", "phase (host bytes per param)", "ms", "GB/s");
  printf("%-34s %9.2f %9.2f\n", "triad (24 B)", mt * 1e3, 24 * n / mt / 1e9);
  if (o.rdt) { /* the folds fall on both sides: those of reused landing buffers, the rest */
    printf("%-34s %9.2f %9s\n", "arrive (D2H, folds)", ma * 1e3, "");
    printf("%-34s %9.2f %9s\n", "norm (last folds, partials)", mn * 1e3, "");
    snprintf(lab, sizeof lab, "arrive + norm (%.0f B)", B.arrive + B.norm);
    printf("%-34s %9.2f %9.2f\n", lab, (ma + mn) * 1e3, (B.arrive + B.norm) * n / (ma + mn) / 1e9);
  } else {
    snprintf(lab, sizeof lab, "arrive (D2H, %.0f B)", B.arrive);
    printf("%-34s %9.2f %9.2f\n", lab, ma * 1e3, B.arrive * n / ma / 1e9);
    snprintf(lab, sizeof lab, "norm (%.0f B)", B.norm);
    printf("%-34s %9.2f %9.2f\n", lab, mn * 1e3, B.norm * n / mn / 1e9);
  }
  snprintf(lab, sizeof lab, "update + copy-out (%.0f B)", B.update);
  printf("%-34s %9.2f %9.2f\n", lab, mu * 1e3, B.update * n / mu / 1e9);
  snprintf(lab, sizeof lab, "whole = arrive+norm+update (%.0f B)", B.whole);
  printf("%-34s %9.2f %9.2f\n", lab, (ma + mn + mu) * 1e3, B.whole * n / (ma + mn + mu) / 1e9);
  const double mk = median(tk, o.reps), mk16 = median(tk16, o.reps);
  printf("%-34s %9.2f %9.2f\n", "AdamW kernel, f32 (28 B)", mk * 1e3, 28 * n / mk / 1e9);
  printf("%-34s %9.2f %9.2f\n", "AdamW kernel, bf16 + master (30 B)", mk16 * 1e3, 30 * n / mk16 / 1e9);
  if (have_torch) {
    const double mf = median(tf, o.reps), me = median(te, o.reps);
    printf("%-34s %9.2f %9.2f\n", "torch fused (28 B)", mf * 1e3, 28 * n / mf / 1e9);
    printf("%-34s %9.2f %9.2f\n", "torch foreach (28 B)", me * 1e3, 28 * n / me / 1e9);
  }
  if (o.q8) { /* m and v one byte each way instead of four (and a scale of each per block) */
    const double bq = B.update - 12 + 16.0 / SG__Q8_BLOCK, mq = median(tq_u, o.reps);
    snprintf(lab, sizeof lab, "update, 8-bit state (%.2f B)", bq);
    printf("%-34s %9.2f %9.2f\n", lab, mq * 1e3, bq * n / mq / 1e9);
    printf("%-34s %9.2f\n", "whole, 8-bit state", median(tq_w, o.reps) * 1e3);
  }
  if (o.fold_norm == 2) {
    snprintf(lab, sizeof lab, "arrive + norm, own pass (%.0f B)", B.arrive + 4);
    printf("%-34s %9.2f %9.2f\n", lab, median(t_old, o.reps) * 1e3,
           (B.arrive + 4) * n / median(t_old, o.reps) / 1e9);
    printf("%-34s %9.2f\n", "whole, norm in its own pass", median(t_oldw, o.reps) * 1e3);
  }
  printf("\nratios (medians of per-rep ratios):\n");
  if (o.fold_norm == 2)
    printf("  arrive + norm: fold-norm / own pass %5.2f   (same rep; the step before 2066bcc = own pass)\n",
           median(r_ab, o.reps));
  printf("  whole GB/s / triad GB/s            %6.2f   (goal >= 0.8)\n", median(r_triad, o.reps));
  if (o.q8) {
    printf("  8-bit / fp32 state, update ms      %6.2f   (same rep)\n", median(r_q8u, o.reps));
    printf("  8-bit / fp32 state, whole ms       %6.2f   (same rep)\n", median(r_q8w, o.reps));
  }
  if (have_torch) {
    printf("  torch fused ms / whole ms          %6.2f   (issue 12's goal >= 1.5: the whole host step, copies included)\n",
           median(r_fused, o.reps));
    printf("  torch fused ms / whole ms at best  %6.2f   (the whole step's %.0f B at the f32 kernel's GB/s)\n",
           median(r_bound, o.reps), B.whole);
    printf("  torch fused ms / host passes ms    %6.2f   (a GPU's copies by DMA: the CPU's %.0f B alone, %s + AdamW bf16 kernel)\n",
           median(r_host, o.reps), B.cpu_gpu, o.rdt ? "arrive (its memcpy too: an upper bound) + norm" : "norm");
    printf("  torch foreach ms / whole ms        %6.2f\n", median(r_foreach, o.reps));
    printf("  torch fused ms / kernel ms         %6.2f   (the same work: f32 AdamW alone)\n",
           median(r_kernel, o.reps));
  }
  printf("check: %s\n", ok ? "ok" : "WRONG");
  if (o.q8) printf("check, 8-bit state: %s\n", ok_q8 ? "ok" : "WRONG");
  torch_stop(&tc);
  free(tb.a), free(tb.b), free(tb.c);
  shard_free(&s);
  if (o.q8) shard_free(&sq);
  return ok && ok_q8 ? 0 : 1;
}
