/* The offloaded optimizer state (src/offload/sg_offload.c) against the device path it replaces,
 * bit for bit, on the CPU device and (mock build) on the mock CUDA device: a shard of three
 * buckets with layout gaps, gradients reduced into device memory micro-batch by micro-batch,
 * then the norm, clipping, the skip decision and AdamW. The device path is what sg_step does
 * without offload: accumulate into a device accumulator, the device's sumsq over all of it,
 * the device's fused AdamW per bucket, zero. The offloaded path: the arrival (a comm job per
 * bucket, D2H straight into the host accumulator or into a landing buffer that is folded),
 * the host norm, the host update pipeline writing the device's working parameters. Cases:
 * f32/bf16/f16 params, f32/bf16 accumulators, reduce dtypes f32/bf16, 1 and 3 micro-batches,
 * clipping, a step with a non-finite gradient (skipped), 3 steps each; memory and errors. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/sg_cpu_kernels.h"
#include "device/sg_device.h"
#include "offload/sg_offload.h"
#include "sg_elem.h"
#include "sg_test_check.h"

/* The optimizer under test: its state arrays and CPU update. */
#define ADAMW sg__optim_find("adamw")

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (float)((rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}
static size_t es(int dt) { return dt == 0 ? 4u : 2u; }

enum { NB = 3, MAXSEG = 16 };

typedef struct layout {
  size_t numel, off[NB], len[NB];
  sg__seg segs[MAXSEG];
  int bseg[NB + 1];
} layout;

/* W = 1: flat and shard coordinates agree. Bucket k: a few parameters with gaps between them,
 * scale times the base sizes (scale 9: slices that hold whole chunks of the norm's partition,
 * whose partials the fold computes, besides the chunks across two slices). */
static void make_layout(layout *l, size_t scale) {
  const size_t lens[NB][3] = {{1000, 37, 2100}, {64, 5000, 1}, {3333, 700, 128}};
  size_t pos = 0;
  int ns = 0;
  for (int k = 0; k < NB; k++) {
    l->off[k] = pos;
    l->bseg[k] = ns;
    for (int j = 0; j < 3; j++) {
      l->segs[ns] = (sg__seg){pos, pos, lens[k][j] * scale, j != 1, ((uint64_t)(ns + 1) << 40), 0};
      ns++;
      pos += (lens[k][j] * scale + 63) / 64 * 64; /* parameters start at multiples of 64 */
    }
    l->len[k] = pos - l->off[k];
  }
  l->bseg[NB] = ns;
  l->numel = pos;
}

typedef struct tcase {
  int pdt, adt, rdt, mb, clip, nonfinite_step; /* nonfinite_step: 0 none, else the step */
  size_t scale;                                /* of the layout's sizes */
} tcase;

typedef struct refstate { void *params, *master, *m, *v, *accum; } refstate;

static void *dalloc(sg__device *d, size_t bytes) {
  void *p = NULL;
  if (d->ops->alloc(d, bytes, &p) != SG_OK) return NULL;
  d->ops->zero(d, SG_Q_COMPUTE, p, bytes);
  return p;
}

static int h2d(sg__device *d, void *dst, const void *src, size_t bytes) {
  return d->ops->copy(d, SG_Q_COMPUTE, dst, src, bytes, SG_COPY_H2D) == SG_OK;
}
static int d2h(sg__device *d, void *dst, const void *src, size_t bytes) {
  return d->ops->copy(d, SG_Q_COMPUTE, dst, src, bytes, SG_COPY_D2H) == SG_OK;
}

typedef struct arrive_job { sg__offload *o; int k; const void *src; int dt; } arrive_job;
static sg_status arrive_fn(void *arg) {
  arrive_job *j = arg;
  return sg__offload_arrive_job(j->o, j->k, j->src, j->dt, 1);
}

static sg__adamw_args args_for(const tcase *c, const layout *l, int k, uint64_t t, float scale) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = c->pdt, a.grad_dtype = c->adt;
  a.segs = l->segs + l->bseg[k], a.nsegs = l->bseg[k + 1] - l->bseg[k];
  a.grad_scale = scale;
  a.stochastic_rounding = c->pdt == 1, a.seed = 3;
  sg__adamw_scalars(&a, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, t);
  return a;
}

static int same_state(sg__device *d, const tcase *c, const layout *l, const refstate *r,
                      sg__offload *o, void *dparams) {
  const size_t n = l->numel, P = es(c->pdt);
  char *a = malloc(n * 4), *b = malloc(n * 4);
  int ok = d2h(d, a, r->params, n * P) && d2h(d, b, dparams, n * P) && !memcmp(a, b, n * P);
  const char *what[3] = {"master", "m", "v"};
  void *dev[3] = {r->master, r->m, r->v};
  for (int w = 0; w < 3 && ok; w++) {
    if (!dev[w]) continue;
    ok = d2h(d, a, dev[w], n * 4) && !memcmp(a, sg__offload_state(o, w), n * 4);
    if (!ok) printf("  differs: %s\n", what[w]);
  }
  free(a), free(b);
  return ok;
}

static void run_case(sg__device *d, const char *dn, tcase c) {
  layout l;
  make_layout(&l, c.scale);
  const size_t n = l.numel, P = es(c.pdt);
  refstate r = {dalloc(d, n * P), c.pdt ? dalloc(d, n * 4) : NULL, dalloc(d, n * 4),
                dalloc(d, n * 4), dalloc(d, n * es(c.adt))};
  void *dparams = dalloc(d, n * P), *dg = dalloc(d, n * 4);
  sg__offload o;
  char tag[160];
  snprintf(tag, sizeof tag, "%s param %d accum %d reduce %d, %d micro-batch(es)%s%s, %zu elements",
           dn, c.pdt, c.adt, c.rdt, c.mb, c.clip ? ", clipped" : "",
           c.nonfinite_step ? ", a non-finite step" : "", l.numel);
  size_t maxlen = 0;
  for (int k = 0; k < NB; k++) maxlen = l.len[k] > maxlen ? l.len[k] : maxlen;
  /* one landing buffer: every landed arrival but the last is folded when the next one takes it */
  const size_t lb = maxlen * es(c.rdt);
  if (!CHECK(sg__offload_init(&o, d, ADAMW, n, c.pdt, c.adt, NB, l.off, l.len, 1500, 1, lb) == SG_OK,
             "%s: init", tag))
    return;
  CHECK(o.host_bytes == sg__offload_host_bytes(ADAMW, n, c.pdt, c.adt, 1500, 1, lb) &&
            o.host_bytes == n * (es(c.adt) + 8 + (c.pdt ? 4 : 0)) + 3 * 1500 * P + lb,
        "%s: host bytes %zu = (A + 8 + master) x numel + the pipe's ring + landing", tag,
        o.host_bytes);
  /* the same starting point on both sides */
  float *h = malloc(n * 4);
  void *hp = malloc(n * 4), *hg = malloc(n * 4);
  for (size_t i = 0; i < n; i++) h[i] = frand();
  for (int k = 0; k < NB; k++) /* gaps hold zeros */
    for (int s = l.bseg[k]; s + 1 < l.bseg[k + 1]; s++)
      for (size_t i = l.segs[s].flat_off + l.segs[s].len; i < l.segs[s + 1].flat_off; i++) h[i] = 0;
  sg__cpu_cast(hp, c.pdt, h, 0, n);
  int ok = h2d(d, r.params, hp, n * P) && h2d(d, dparams, hp, n * P);
  if (c.pdt) ok = ok && h2d(d, r.master, h, n * 4), memcpy(sg__offload_state(&o, 0), h, n * 4);
  int skipped = 0, all_same_norm = 1;
  for (uint64_t t = 1, step = 1; step <= 3 && ok; step++) {
    for (int mb = 0; mb < c.mb && ok; mb++)
      for (int k = NB - 1; k >= 0 && ok; k--) { /* backward order */
        float *g = malloc(l.len[k] * 4);
        for (size_t i = 0; i < l.len[k]; i++) g[i] = frand() * (k + 1);
        if ((int)step == c.nonfinite_step && mb == 0 && k == 1) g[c.scale > 1 ? l.len[k] / 2 : 7] = INFINITY;
        g[3] = -0.0f; /* the direct arrival keeps -0 where the device's 0 + x gives +0 */
        sg__cpu_cast(hg, c.rdt, g, 0, l.len[k]);
        free(g);
        ok = h2d(d, dg, hg, l.len[k] * es(c.rdt));
        ok = ok && d->ops->accumulate(d, SG_Q_COMPUTE, (char *)r.accum + l.off[k] * es(c.adt), c.adt,
                                      dg, c.rdt, l.len[k]) == SG_OK;
        arrive_job j = {&o, k, dg, c.rdt};
        uint64_t tk = 0;
        ok = ok && sg__offload_arrive_plan(&o, k, c.rdt, INT64_MAX) == SG_OK &&
             d->ops->comm_submit(d, arrive_fn, NULL, &j, &tk) == SG_OK;
        sg__offload_arrive_submitted(&o, k, tk);
        ok = ok && d->ops->comm_wait(d, tk, INT64_MAX) == SG_OK; /* dg and j are reused */
      }
    double rs[2], os[2];
    ok = ok && d->ops->sumsq(d, SG_Q_COMPUTE, r.accum, c.adt, n, &rs[0], &rs[1]) == SG_OK &&
         sg__offload_fold_all(&o, INT64_MAX) == SG_OK && sg__offload_norm(&o, os) == SG_OK;
    all_same_norm &= ok && (rs[0] == os[0] || (isnan(rs[0]) && isnan(os[0]))) && rs[1] == os[1];
    const double norm = sqrt(rs[0]);
    const int skip = rs[1] > 0 || !isfinite(norm);
    const double clip = c.clip && isfinite(norm) ? fmin(1.0, 0.5 / (norm + 1e-6)) : 1.0;
    skipped += skip;
    for (int k = NB - 1; k >= 0 && ok && !skip; k--) {
      sg__adamw_args a = args_for(&c, &l, k, t, (float)(clip / c.mb));
      sg__adamw_args ra = a;
      ra.param = r.params, ra.master = r.master, ra.state[SG__ADAMW_M] = r.m, ra.state[SG__ADAMW_V] = r.v, ra.grad = r.accum;
      uint64_t last = 0;
      ok = d->ops->update(d, SG_Q_COMPUTE, sg__optim_find("adamw"), &ra) == SG_OK &&
           sg__offload_update(&o, &a, dparams, INT64_MAX, &last) == SG_OK && last > 0;
    }
    t += !skip;
    ok = ok && d->ops->zero(d, SG_Q_COMPUTE, r.accum, n * es(c.adt)) == SG_OK &&
         sg__host_pipe_drain(&o.pipe, INT64_MAX) == SG_OK && d->ops->sync(d, INT64_MAX) == SG_OK;
    ok = ok && sg__offload_clear(&o, INT64_MAX) == SG_OK;
    if (!CHECK(ok && same_state(d, &c, &l, &r, &o, dparams),
               "%s: step %d: working values, master, m, v bitwise those of the device path", tag,
               (int)step))
      ok = 0;
  }
  CHECK(all_same_norm, "%s: every step's sum of squares and non-finite count are the device's", tag);
  if (c.nonfinite_step) CHECK(skipped == 1, "%s: exactly the non-finite step was skipped", tag);
  sg__offload_free(&o, INT64_MAX);
  void *bufs[] = {r.params, r.master, r.m, r.v, r.accum, dparams, dg};
  for (int i = 0; i < 7; i++) if (bufs[i]) d->ops->free(d, bufs[i]);
  free(h), free(hp), free(hg);
}

static int says(const char *s) { return strstr(sg_last_error(), s) != NULL; }

static void test_errors(sg__device *d, const char *dn) {
  sg__offload o;
  size_t off[2] = {0, 100}, len[2] = {100, 50};
  CHECK(sg__offload_init(&o, d, ADAMW, 120, 1, 0, 2, off, len, 0, 1, 400) == SG_ERR_INVALID_ARGUMENT &&
            says("outside the shard"), "%s init: a slice outside the shard refused", dn);
  CHECK(sg__offload_init(&o, d, ADAMW, 150, 1, 2, 2, off, len, 0, 1, 400) == SG_ERR_INVALID_ARGUMENT &&
            says("bad dtype"), "%s init: an f16 accumulator refused", dn);
  sg__device_fail_alloc_after(2);
  CHECK(sg__offload_init(&o, d, ADAMW, 150, 1, 0, 2, off, len, 0, 1, 400) == SG_ERR_OUT_OF_MEMORY && o.dev == NULL,
        "%s init: a failed pinned allocation frees the rest", dn);
  sg__device_fail_alloc_after(-1);
  sg__offload_free(&o, INT64_MAX);
  sg__offload_free(NULL, INT64_MAX);
  CHECK(sg__offload_init(&o, d, ADAMW, 150, 1, 0, 2, off, len, 0, 1, 150) == SG_ERR_INVALID_ARGUMENT &&
            says("landing buffers"), "%s init: landing buffers smaller than a slice refused", dn);
  CHECK(sg__offload_init(&o, d, ADAMW, 150, 1, 0, 2, off, len, 0, 0, 400) == SG_ERR_INVALID_ARGUMENT &&
            says("landing buffers"), "%s init: no landing buffer refused", dn);
  if (!CHECK(sg__offload_init(&o, d, ADAMW, 150, 1, 0, 2, off, len, 1024, 2, 200) == SG_OK, "%s init",
             dn))
    return;
  CHECK(o.host_bytes == sg__offload_host_bytes(ADAMW, 150, 1, 0, 1024, 2, 200) &&
            o.host_bytes == 150 * 16 + 3 * 1024 * 2 + 2 * 200,
        "%s init: host bytes %zu exact", dn, o.host_bytes);
  CHECK(sg__offload_arrive_plan(&o, 2, 0, INT64_MAX) == SG_ERR_INVALID_ARGUMENT &&
            says("bucket 2 of 2"), "%s arrive: bucket out of range", dn);
  CHECK(sg__offload_arrive_plan(&o, 0, 1, INT64_MAX) == SG_OK && o.b[0].mode == SG__ARRIVE_LAND &&
            o.b[0].land >= 0, "%s arrive: a bf16 slice into an f32 accumulator lands first", dn);
  CHECK(sg__offload_arrive_job(&o, 0, NULL, 0, 0) == SG_ERR_INVALID_STATE && says("not planned"),
        "%s arrive: a job with another dtype than planned refused", dn);
  sg__offload_arrive_submitted(&o, 0, 0); /* never queued: the landing buffer is free again */
  CHECK(o.b[0].land < 0 && o.land_owner[0] < 0 && o.land_owner[1] < 0,
        "%s arrive: an arrival never queued gives its landing buffer back", dn);
  CHECK(sg__offload_arrive_plan(&o, 0, 0, INT64_MAX) == SG_ERR_INTERNAL && says("does not fit"),
        "%s arrive: a second f32 slice over the bf16-sized landing buffers refused", dn);

  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = 0;
  CHECK(sg__offload_update(&o, &a, NULL, INT64_MAX, NULL) == SG_ERR_INVALID_ARGUMENT &&
            says("not the state's"), "%s update: other dtypes than the state's refused", dn);
  sg__offload_free(&o, INT64_MAX);
}

static void run_device(sg__device *d, const char *dn) {
  const tcase cases[] = {
      {0, 0, 0, 1, 0, 0, 1}, {0, 0, 0, 3, 1, 0, 1}, {1, 0, 1, 1, 0, 0, 1}, {1, 0, 1, 3, 1, 0, 1},
      {1, 0, 0, 1, 1, 0, 1}, {2, 0, 0, 3, 0, 2, 1}, {2, 0, 2, 1, 1, 0, 1}, {1, 1, 1, 3, 0, 0, 1},
      {0, 0, 0, 1, 0, 3, 1}, {1, 0, 1, 3, 1, 1, 1},
      /* slices of whole chunks: folds with the norm's partials, direct arrivals, non-finite */
      {1, 0, 1, 1, 1, 0, 9}, {1, 0, 1, 3, 0, 2, 9}, {0, 0, 0, 3, 1, 0, 9}, {1, 1, 1, 3, 1, 3, 9},
      {2, 0, 0, 1, 0, 1, 9}};
  for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) run_case(d, dn, cases[k]);
  test_errors(d, dn);
}

int main(void) {
  sg__device *cpu = NULL;
  if (CHECK(sg__device_cpu_create(0, 1, &cpu) == SG_OK, "cpu device")) {
    run_device(cpu, "cpu");
    cpu->ops->destroy(cpu);
  }
#ifdef SG_HAVE_CUDA
  sg__device *cuda = NULL;
  if (CHECK(sg__device_cuda_create(0, 0, &cuda) == SG_OK, "cuda (mock) device")) {
    run_device(cuda, "cuda");
    cuda->ops->destroy(cuda);
  }
#endif
  return sg_test_summary("");
}
