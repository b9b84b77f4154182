/* The CPU AdamW loop (sg__cpu_adamw over sg_elem_adamw) against torch.optim.AdamW.
 *
 * tests/data/adamw_*.bin hold torch's trajectories (scripts/gen_adamw_ref.py): initial params,
 * the gradient and clip coefficient of every step, and after every step torch's param,
 * exp_avg and exp_avg_sq. The step arguments are built as the engine builds them (host double
 * math for the decay factor and the bias corrections, rounded once to float).
 *
 * Tolerances. exp_avg and exp_avg_sq do not depend on the params, and their ops are plain
 * fp32 multiply/add in both libraries: they must be equal to the bit for the whole run. The
 * params go through a sqrt, and torch's vectorized CPU sqrt (MKL VML in the pip build) is not
 * correctly rounded for about 0.6% of inputs while ours is IEEE: a param step may differ by an
 * ulp or two (one ulp in sqrt moves the update by about one ulp of the update, plus the
 * final rounding). We measure in ulps of max(|p before|, |p after|), the scale of the step's
 * operands (|update| <= |p before| + |p after|), so a cancelling update is not mistaken for a
 * large error: at most 3 per step replayed from torch's state, 16 over the whole run. Measured
 * with torch 2.15 (ATEN_CPU_CAPABILITY=default, see the script): exp_avg/exp_avg_sq bit-equal;
 * params bit-equal in three cases, and in "magnitudes" 1 element of 2400 differs per step (1
 * ulp) and 23 over the whole run (8 ulp, relative 1.6e-6).
 *
 * Also checked: bf16/f16 working params equal the RNE rounding of the fp32 master (torch's
 * mixed precision keeps the fp32 master, so only fp32 trajectories are stored), NO_DECAY
 * segments (with a nonzero weight decay in the args) reproduce torch's wd = 0 run, a vector
 * split into several segments with padding gives the same bits as one segment, and padding is
 * never written. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/sg_cpu_kernels.h" /* sg__cpu_adamw */
#include "sg_elem.h"            /* sg_elem_f32_to_bf16/f16 */

#ifndef SG_TEST_DATA_DIR
#define SG_TEST_DATA_DIR "tests/data"
#endif

#include "sg_test_check.h"

/* ---- reference file ------------------------------------------------------------------------ */

typedef struct ref_case {
  char name[32];
  uint32_t numel, steps, flags;
  float lr, beta1, beta2, eps, wd, max_norm;
  float *p0, *coef;
  float *grad, *p, *m, *v; /* [steps][numel] each */
} ref_case;

#define HEADER_BYTES 80

static uint32_t rd_u32(const unsigned char *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static float rd_f32(const unsigned char *b) {
  uint32_t u = rd_u32(b);
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static void rd_arr(float *dst, const unsigned char *b, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = rd_f32(b + 4 * i);
}

static unsigned char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  unsigned char *buf = NULL;
  if (fseek(f, 0, SEEK_END) == 0) {
    long n = ftell(f);
    if (n > 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n)) != NULL &&
        fread(buf, 1, (size_t)n, f) != (size_t)n) {
      free(buf);
      buf = NULL;
    }
    *len = n > 0 ? (size_t)n : 0;
  }
  fclose(f);
  return buf;
}

/* Returns 0 when the file is missing or its header or size is wrong. */
static int load_case(const char *name, ref_case *c) {
  char path[512];
  size_t len = 0;
  snprintf(path, sizeof path, "%s/adamw_%s.bin", SG_TEST_DATA_DIR, name);
  unsigned char *b = slurp(path, &len);
  memset(c, 0, sizeof *c);
  snprintf(c->name, sizeof c->name, "%s", name);
  if (!b || len < HEADER_BYTES || memcmp(b, "SGREF001", 8) != 0 || rd_u32(b + 8) != 1) {
    free(b);
    return 0;
  }
  c->numel = rd_u32(b + 12), c->steps = rd_u32(b + 16), c->flags = rd_u32(b + 20);
  c->lr = rd_f32(b + 24), c->beta1 = rd_f32(b + 28), c->beta2 = rd_f32(b + 32);
  c->eps = rd_f32(b + 36), c->wd = rd_f32(b + 40), c->max_norm = rd_f32(b + 44);
  size_t n = c->numel, s = c->steps;
  if (n == 0 || s == 0 || n > 1000000 || s > 10000 || len != HEADER_BYTES + 4 * (n + s + 4 * n * s)) {
    free(b);
    return 0;
  }
  c->p0 = malloc(4 * n), c->coef = malloc(4 * s);
  c->grad = malloc(4 * n * s), c->p = malloc(4 * n * s), c->m = malloc(4 * n * s), c->v = malloc(4 * n * s);
  const unsigned char *q = b + HEADER_BYTES;
  rd_arr(c->p0, q, n), q += 4 * n;
  rd_arr(c->coef, q, s), q += 4 * s;
  for (size_t t = 0; t < s; t++) {
    rd_arr(c->grad + t * n, q, n), q += 4 * n;
    rd_arr(c->p + t * n, q, n), q += 4 * n;
    rd_arr(c->m + t * n, q, n), q += 4 * n;
    rd_arr(c->v + t * n, q, n), q += 4 * n;
  }
  free(b);
  return 1;
}

static void free_case(ref_case *c) {
  free(c->p0), free(c->coef), free(c->grad), free(c->p), free(c->m), free(c->v);
}

/* ---- the step arguments, as the engine computes them --------------------------------------- */

static sg__adamw_args step_args(const ref_case *c, uint64_t t, float wd) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  double bc1 = 1.0 - pow((double)c->beta1, (double)t), bc2 = 1.0 - pow((double)c->beta2, (double)t);
  a.grad_dtype = 0;
  a.grad_scale = c->coef[t - 1]; /* W = 1, loss scale 1: the clip coefficient alone */
  a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - (double)c->lr * (double)wd);
  a.scalar[SG__ADAMW_BETA1] = c->beta1, a.scalar[SG__ADAMW_ONE_MINUS_BETA1] = (float)(1.0 - (double)c->beta1);
  a.scalar[SG__ADAMW_BETA2] = c->beta2, a.scalar[SG__ADAMW_ONE_MINUS_BETA2] = (float)(1.0 - (double)c->beta2);
  a.group_scalar[0][SG__ADAMW_STEP_SIZE] = (float)((double)c->lr / bc1);
  a.scalar[SG__ADAMW_BC2_SQRT] = (float)sqrt(bc2);
  a.scalar[SG__ADAMW_EPS] = c->eps;
  a.step = t;
  return a;
}

/* ---- error measures ------------------------------------------------------------------------ */

static uint32_t fbits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

/* ulp of a float magnitude (the spacing at |x|; the smallest subnormal below 2^-126) */
static double ulp_of(float x) {
  x = fabsf(x);
  if (x < 1.1754944e-38f) return ldexp(1.0, -149);
  int e;
  frexp(x, &e);
  return ldexp(1.0, e - 24);
}

typedef struct errs {
  double p_ulp;     /* in ulps of max(|p before|, |p after|) */
  double p_rel;     /* |ours - torch| / |torch| */
  long mv_mismatch; /* exp_avg / exp_avg_sq elements not bit-equal */
  long p_mismatch;  /* param elements not bit-equal */
  long p_total;
} errs;

static void measure(errs *e, const float *p_before, const float *p, const float *m, const float *v,
                    const float *tp, const float *tm, const float *tv, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float scale = fabsf(p_before[i]) > fabsf(tp[i]) ? p_before[i] : tp[i];
    double d = fabs((double)p[i] - (double)tp[i]);
    double u = d / ulp_of(scale), r = tp[i] != 0.0f ? d / fabs((double)tp[i]) : d;
    if (u > e->p_ulp) e->p_ulp = u;
    if (r > e->p_rel) e->p_rel = r;
    e->p_mismatch += fbits(p[i]) != fbits(tp[i]);
    e->p_total++;
    e->mv_mismatch += fbits(m[i]) != fbits(tm[i]);
    e->mv_mismatch += fbits(v[i]) != fbits(tv[i]);
  }
}

/* ---- runs ---------------------------------------------------------------------------------- */

/* One segment, fp32 params (no master). replay = 1 starts every step from torch's state. */
static errs run_f32(const ref_case *c, int replay) {
  size_t n = c->numel;
  float *p = malloc(4 * n), *m = calloc(n, 4), *v = calloc(n, 4), *before = malloc(4 * n);
  memcpy(p, c->p0, 4 * n);
  errs e = {0, 0, 0, 0, 0};
  sg__seg seg = {0, 0, n, 1, 0, 0};
  for (uint32_t t = 1; t <= c->steps; t++) {
    if (replay && t > 1) {
      memcpy(p, c->p + (t - 2) * n, 4 * n);
      memcpy(m, c->m + (t - 2) * n, 4 * n);
      memcpy(v, c->v + (t - 2) * n, 4 * n);
    }
    memcpy(before, p, 4 * n);
    sg__adamw_args a = step_args(c, t, c->wd);
    a.param = p, a.param_dtype = 0, a.state[SG__ADAMW_M] = m, a.state[SG__ADAMW_V] = v, a.grad = c->grad + (t - 1) * n;
    a.segs = &seg, a.nsegs = 1;
    sg__cpu_adamw(&a);
    measure(&e, before, p, m, v, c->p + (t - 1) * n, c->m + (t - 1) * n, c->v + (t - 1) * n, n);
  }
  free(p), free(m), free(v), free(before);
  return e;
}

/* The same run through several segments with gaps; flat and shard offsets differ, padding holds
 * a sentinel. decay_of(k) picks each segment's flag; wd is the weight decay of the args.
 * Returns the fp32 trajectory of the params in traj[steps][numel]. */
#define PAD 16
#define SENTINEL 0x7fc0dead /* a NaN no step ever writes */

static int run_segments(const ref_case *c, int pdt, float wd, int (*decay_of)(int), float *traj,
                        int *rounding_ok) {
  size_t n = c->numel;
  const size_t cuts[] = {0, 1, 17, 64, 65, n};
  const int nseg = 5;
  size_t flat_n = n + PAD * (nseg + 1), shard_n = n + 2 * PAD * (nseg + 1);
  uint32_t *flat = malloc(4 * flat_n), *shard_m = malloc(4 * shard_n), *shard_v = malloc(4 * shard_n);
  uint32_t *master = malloc(4 * shard_n), *grad = malloc(4 * shard_n);
  for (size_t i = 0; i < flat_n; i++) flat[i] = SENTINEL;
  for (size_t i = 0; i < shard_n; i++) shard_m[i] = shard_v[i] = master[i] = grad[i] = SENTINEL;
  sg__seg segs[5];
  for (int k = 0; k < nseg; k++) {
    segs[k].len = cuts[k + 1] - cuts[k];
    segs[k].flat_off = cuts[k] + PAD * (size_t)(k + 1);
    segs[k].shard_off = cuts[k] + 2 * PAD * (size_t)(k + 1);
    segs[k].decay = decay_of(k);
    segs[k].sr_index = cuts[k];
  }
  /* initial state: params in the working buffer (fp32) or the master (bf16/f16) */
  for (int k = 0; k < nseg; k++)
    for (size_t i = 0; i < segs[k].len; i++) {
      float p0 = c->p0[cuts[k] + i], zero = 0.0f;
      memcpy(&shard_m[segs[k].shard_off + i], &zero, 4);
      memcpy(&shard_v[segs[k].shard_off + i], &zero, 4);
      if (pdt == 0)
        memcpy(&flat[segs[k].flat_off + i], &p0, 4);
      else
        memcpy(&master[segs[k].shard_off + i], &p0, 4);
    }
  uint32_t *flat0 = malloc(4 * flat_n); /* the working buffer before any step */
  memcpy(flat0, flat, 4 * flat_n);
  *rounding_ok = 1;
  for (uint32_t t = 1; t <= c->steps; t++) {
    for (int k = 0; k < nseg; k++)
      memcpy(&grad[segs[k].shard_off], c->grad + (t - 1) * n + cuts[k], 4 * segs[k].len);
    sg__adamw_args a = step_args(c, t, wd);
    a.param = flat, a.param_dtype = pdt, a.master = pdt ? (float *)master : NULL;
    a.state[SG__ADAMW_M] = (float *)shard_m, a.state[SG__ADAMW_V] = (float *)shard_v, a.grad = grad;
    a.segs = segs, a.nsegs = nseg;
    sg__cpu_adamw(&a);
    for (int k = 0; k < nseg; k++)
      for (size_t i = 0; i < segs[k].len; i++) {
        float x;
        if (pdt == 0) {
          memcpy(&x, &flat[segs[k].flat_off + i], 4);
        } else {
          memcpy(&x, &master[segs[k].shard_off + i], 4);
          uint16_t h = ((uint16_t *)flat)[segs[k].flat_off + i];
          *rounding_ok &= h == (pdt == 1 ? sg_elem_f32_to_bf16(x) : sg_elem_f32_to_f16(x));
        }
        traj[(t - 1) * n + cuts[k] + i] = x;
      }
  }
  /* padding: every word outside the segments still holds the sentinel */
  int pad_ok = 1;
  size_t pes = pdt == 0 ? 4 : 2;
  for (size_t i = 0; i < flat_n * 4 / pes; i++) {
    int inside = 0;
    for (int k = 0; k < nseg; k++) inside |= i >= segs[k].flat_off && i < segs[k].flat_off + segs[k].len;
    if (!inside) pad_ok &= memcmp((char *)flat + i * pes, (char *)flat0 + i * pes, pes) == 0;
  }
  free(flat0);
  for (size_t i = 0; i < shard_n; i++) {
    int inside = 0;
    for (int k = 0; k < nseg; k++) inside |= i >= segs[k].shard_off && i < segs[k].shard_off + segs[k].len;
    if (!inside) pad_ok &= shard_m[i] == SENTINEL && shard_v[i] == SENTINEL && master[i] == SENTINEL;
  }
  free(flat), free(shard_m), free(shard_v), free(master), free(grad);
  return pad_ok;
}

static int all_decay(int k) { return 1; }
static int no_decay(int k) { return 0; }
static int alt_decay(int k) { return k & 1; }

/* ---- the checks ---------------------------------------------------------------------------- */

static void check_case(const ref_case *c) {
  errs rep = run_f32(c, 1), full = run_f32(c, 0);
  printf("     %s: lr %g betas (%g, %g) eps %g wd %g%s, %u params x %u steps\n", c->name, c->lr,
         c->beta1, c->beta2, c->eps, c->wd, c->flags & 1 ? " clipped" : "", c->numel, c->steps);
  printf("     params vs torch, per step from torch's state: max %.2f ulp, rel %.2e, %ld of %ld not "
         "bit-equal; whole run: max %.2f ulp, rel %.2e, %ld of %ld not bit-equal\n",
         rep.p_ulp, rep.p_rel, rep.p_mismatch, rep.p_total, full.p_ulp, full.p_rel,
         full.p_mismatch, full.p_total);
  CHECK(rep.mv_mismatch == 0 && full.mv_mismatch == 0,
        "%s: exp_avg and exp_avg_sq bit-equal to torch at every step (%ld differ)", c->name,
        rep.mv_mismatch + full.mv_mismatch);
  CHECK(rep.p_ulp <= 3.0, "%s: params within 3 ulp of torch per step (max %.2f)", c->name, rep.p_ulp);
  CHECK(full.p_ulp <= 16.0, "%s: params within 16 ulp of torch over %u steps (max %.2f)", c->name,
        c->steps, full.p_ulp);
}

/* Several segments must give the single-segment bits; bf16/f16 params must be the rounded
 * master and follow the same fp32 trajectory. */
static void check_layouts(const ref_case *c) {
  size_t n = c->numel, total = n * c->steps;
  float *one = malloc(4 * total), *seg = malloc(4 * total);
  int rounding_ok;
  /* the single-segment trajectory, recomputed without replay */
  {
    float *p = malloc(4 * n), *m = calloc(n, 4), *v = calloc(n, 4);
    memcpy(p, c->p0, 4 * n);
    sg__seg s1 = {0, 0, n, 1, 0, 0};
    for (uint32_t t = 1; t <= c->steps; t++) {
      sg__adamw_args a = step_args(c, t, c->wd);
      a.param = p, a.state[SG__ADAMW_M] = m, a.state[SG__ADAMW_V] = v, a.grad = c->grad + (t - 1) * n, a.segs = &s1, a.nsegs = 1;
      sg__cpu_adamw(&a);
      memcpy(one + (t - 1) * n, p, 4 * n);
    }
    free(p), free(m), free(v);
  }
  int pad = run_segments(c, 0, c->wd, all_decay, seg, &rounding_ok);
  CHECK(pad && memcmp(one, seg, 4 * total) == 0,
        "%s: 5 segments with padding = one segment, bit for bit; padding untouched", c->name);
  for (int pdt = 1; pdt <= 2; pdt++) {
    pad = run_segments(c, pdt, c->wd, all_decay, seg, &rounding_ok);
    CHECK(pad && rounding_ok && memcmp(one, seg, 4 * total) == 0,
          "%s: %s params = RNE(fp32 master) at every step, master = fp32 run; padding untouched",
          c->name, pdt == 1 ? "bf16" : "f16");
  }
  free(one), free(seg);
}

/* With wd = 0.1 in the args, decay = 0 segments must follow torch's wd = 0 run exactly as the
 * plain run does, and decay = 1 segments must not. */
static void check_no_decay(const ref_case *c) {
  size_t n = c->numel, total = n * c->steps;
  float *plain = malloc(4 * total), *nd = malloc(4 * total), *alt = malloc(4 * total);
  int r;
  int pad = run_segments(c, 0, c->wd, all_decay, plain, &r); /* wd of the file: 0 */
  pad &= run_segments(c, 0, 0.1f, no_decay, nd, &r);
  pad &= run_segments(c, 0, 0.1f, alt_decay, alt, &r);
  CHECK(pad && memcmp(plain, nd, 4 * total) == 0,
        "%s: NO_DECAY segments with wd 0.1 in the args = torch's wd 0 run, bit for bit", c->name);
  /* segments 1 and 3 (elements [1,17) and [64,65)) decay; 0, 2, 4 do not */
  int odd_differ = 0, even_same = 1;
  for (size_t t = 0; t < c->steps; t++)
    for (size_t i = 0; i < n; i++) {
      int decays = (i >= 1 && i < 17) || i == 64;
      float a = alt[t * n + i], b = plain[t * n + i];
      if (decays)
        odd_differ |= fbits(a) != fbits(b);
      else
        even_same &= fbits(a) == fbits(b);
    }
  CHECK(pad && odd_differ && even_same,
        "%s: mixed segments: only the decay segments change under wd 0.1", c->name);
  free(plain), free(nd), free(alt);
}

int main(void) {
  const char *names[] = {"decay", "nodecay", "clip", "magnitudes"};
  for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
    ref_case c;
    int ok = load_case(names[k], &c);
    CHECK(ok, "load %s/adamw_%s.bin (magic, version, size)", SG_TEST_DATA_DIR, names[k]);
    if (!ok) continue;
    check_case(&c);
    check_layouts(&c);
    if (c.wd == 0.0f) check_no_decay(&c);
    if (c.flags & 1) {
      float lo = 1.0f;
      for (uint32_t t = 0; t < c.steps; t++) lo = c.coef[t] < lo ? c.coef[t] : lo;
      CHECK(lo < 1.0f, "%s: the clipping case really clips (min coef %.4f)", c.name, lo);
    }
    free_case(&c);
  }
  return sg_test_summary("");
}
