/* MLP model and shardgrad glue; see mlp_model.h. */
#include "mlp_model.h"

#include <math.h>   /* tanhf, sqrt, log, cos */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* calloc, free */
#include <string.h> /* memset, memcpy */

/* ---- random numbers: a pure function of (seed, stream, index), so data and initial values do
 * not depend on the rank count or on the order in which they are drawn ---------------------- */

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static double uniform01(uint64_t seed, uint64_t stream, uint64_t i) {
  uint64_t h = mix64(mix64(seed ^ mix64(stream)) ^ i);
  return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); /* (0, 1) */
}

static float normal(uint64_t seed, uint64_t stream, uint64_t i) {
  const double u1 = uniform01(seed, stream, 2 * i), u2 = uniform01(seed, stream, 2 * i + 1);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

enum { STREAM_TEACHER = 1, STREAM_DATA = 2, STREAM_INIT = 3 };

/* ---- small vector kernels (vectorizable without reassociation flags) -------------------- */

/* Dot product with 8 independent partial sums: a fixed order, so results do not depend on the
 * compiler, and the partial sums vectorize. */
static float dot(const float *a, const float *b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) s[k] += a[i + k] * b[i + k];
  float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; i++) t += a[i] * b[i];
  return t;
}

static void axpy(float a, const float *x, float *y, int n) {
  for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* dot()'s partial sums s[k] over elements i0..i1-1 (multiples of 8). */
static void dot_part(float *s, const float *a, const float *b, int i0, int i1) {
  for (int i = i0; i < i1; i += 8)
    for (int k = 0; k < 8; k++) s[k] += a[i + k] * b[i + k];
}

static float dot_sum(const float *s) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* dot(a, b) and dot(a2, b), bit for bit, in one pass over b: 64 elements of one, then of the
 * other, so that both chains of partial sums are in flight at once. */
static void dot2(const float *a, const float *a2, const float *b, int n, float *t1, float *t2) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, u[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int m = n & ~7;
  int i = 0;
  for (; i + 64 <= m; i += 64) {
    dot_part(s, a, b, i, i + 64);
    dot_part(u, a2, b, i, i + 64);
  }
  dot_part(s, a, b, i, m);
  dot_part(u, a2, b, i, m);
  float t = dot_sum(s), v = dot_sum(u);
  for (i = m; i < n; i++) {
    t += a[i] * b[i];
    v += a2[i] * b[i];
  }
  *t1 = t;
  *t2 = v;
}

/* out[b][o] = bias[o] + sum_i in[b][i] * W[o][i], each as dot() computes it. Weight row outer,
 * batch rows inner (two at a time): W is read from memory once for the whole batch. */
static void linear(const float *in, const float *w, const float *bias, float *out, int rows,
                   int nin, int nout) {
  for (int o = 0; o < nout; o++) {
    const float *wo = w + (size_t)o * nin;
    int b = 0;
    for (; b + 2 <= rows; b += 2) {
      float t1, t2;
      dot2(in + (size_t)b * nin, in + (size_t)(b + 1) * nin, wo, nin, &t1, &t2);
      out[(size_t)b * nout + o] = bias[o] + t1;
      out[(size_t)(b + 1) * nout + o] = bias[o] + t2;
    }
    if (b < rows) out[(size_t)b * nout + o] = bias[o] + dot(in + (size_t)b * nin, wo, nin);
  }
}

/* ---- model -------------------------------------------------------------------------------- */

static int widest(const mlp_model *m) {
  int w = 0;
  for (int l = 0; l <= m->layers; l++) w = m->dims[l] > w ? m->dims[l] : w;
  return w;
}

static void make_teacher(mlp_model *m) {
  const int h = MLP_TEACHER_HIDDEN;
  const size_t n[4] = {(size_t)h * MLP_IN, (size_t)h, (size_t)MLP_OUT * h, MLP_OUT};
  const float gain[4] = {1.0f / sqrtf((float)MLP_IN), 0.1f, 1.5f / sqrtf((float)h), 0.1f};
  for (int t = 0; t < 4; t++)
    for (size_t i = 0; i < n[t]; i++)
      m->teacher[t][i] = gain[t] * normal(m->seed, STREAM_TEACHER * 16 + t, i);
}

int mlp_init(mlp_model *m, int layers, int hidden, int batch, uint64_t seed) {
  memset(m, 0, sizeof *m);
  if (layers < 1 || layers > MLP_MAX_LAYERS || hidden < 1 || batch < 1) return -1;
  m->layers = layers;
  m->batch = batch;
  m->seed = seed;
  m->nparams = 2 * layers;
  m->dims[0] = MLP_IN;
  for (int l = 1; l < layers; l++) m->dims[l] = hidden;
  m->dims[layers] = MLP_OUT;
  size_t widest_param = 0;
  for (int l = 0; l < layers; l++) {
    m->numel[2 * l] = (size_t)m->dims[l + 1] * m->dims[l];
    m->numel[2 * l + 1] = (size_t)m->dims[l + 1];
    m->total_numel += m->numel[2 * l] + m->numel[2 * l + 1];
    if (m->numel[2 * l] > widest_param) widest_param = m->numel[2 * l];
  }
  const size_t wide = (size_t)batch * widest(m);
  int ok = 1;
  for (int l = 0; l <= layers; l++)
    ok &= (m->act[l] = calloc((size_t)batch * m->dims[l], sizeof(float))) != NULL;
  ok &= (m->target = calloc((size_t)batch * MLP_OUT, sizeof(float))) != NULL;
  ok &= (m->delta = calloc(wide, sizeof(float))) != NULL;
  ok &= (m->delta_prev = calloc(wide, sizeof(float))) != NULL;
  ok &= (m->grad = calloc(widest_param, sizeof(float))) != NULL;
  ok &= (m->row = calloc((size_t)widest(m), sizeof(float))) != NULL;
  const size_t tn[4] = {(size_t)MLP_TEACHER_HIDDEN * MLP_IN, MLP_TEACHER_HIDDEN,
                        (size_t)MLP_OUT * MLP_TEACHER_HIDDEN, MLP_OUT};
  for (int t = 0; t < 4; t++) ok &= (m->teacher[t] = calloc(tn[t], sizeof(float))) != NULL;
  if (!ok) {
    mlp_free(m);
    return -1;
  }
  make_teacher(m);
  return 0;
}

void mlp_free(mlp_model *m) {
  for (int l = 0; l <= MLP_MAX_LAYERS; l++) free(m->act[l]);
  for (int t = 0; t < 4; t++) free(m->teacher[t]);
  free(m->target);
  free(m->delta);
  free(m->delta_prev);
  free(m->grad);
  free(m->row);
  memset(m, 0, sizeof *m);
}

void mlp_init_param(const mlp_model *m, int p, float *dst) {
  const int l = p / 2;
  if (p % 2 == 1) { /* bias */
    memset(dst, 0, m->numel[p] * sizeof(float));
    return;
  }
  /* LeCun-uniform: variance 1/fan_in keeps tanh layers in their useful range */
  const double bound = sqrt(3.0 / m->dims[l]);
  for (size_t i = 0; i < m->numel[p]; i++)
    dst[i] = (float)((2.0 * uniform01(m->seed, STREAM_INIT * 1024 + (uint64_t)p, i) - 1.0) * bound);
}

void mlp_make_batch(mlp_model *m, uint64_t first_sample) {
  float hid[MLP_TEACHER_HIDDEN];
  for (int b = 0; b < m->batch; b++) {
    float *x = m->act[0] + (size_t)b * MLP_IN;
    const uint64_t s = first_sample + (uint64_t)b;
    for (int i = 0; i < MLP_IN; i++) x[i] = normal(m->seed, STREAM_DATA, s * MLP_IN + i);
    linear(x, m->teacher[0], m->teacher[1], hid, 1, MLP_IN, MLP_TEACHER_HIDDEN);
    for (int j = 0; j < MLP_TEACHER_HIDDEN; j++) hid[j] = tanhf(hid[j]);
    linear(hid, m->teacher[2], m->teacher[3], m->target + (size_t)b * MLP_OUT, 1,
           MLP_TEACHER_HIDDEN, MLP_OUT);
  }
}

float mlp_forward(mlp_model *m, float *const *params) {
  return mlp_forward_hooked(m, params, NULL, NULL);
}

float mlp_forward_hooked(mlp_model *m, float *const *params, mlp_layer_hook before_layer,
                         void *ctx) {
  for (int l = 0; l < m->layers; l++) {
    if (before_layer && before_layer(ctx, l)) return NAN;
    const int nin = m->dims[l], nout = m->dims[l + 1];
    float *out = m->act[l + 1];
    linear(m->act[l], params[2 * l], params[2 * l + 1], out, m->batch, nin, nout);
    if (l + 1 < m->layers)
      for (size_t i = 0; i < (size_t)m->batch * nout; i++) out[i] = tanhf(out[i]);
  }
  const size_t n = (size_t)m->batch * MLP_OUT;
  double sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = (double)m->act[m->layers][i] - m->target[i];
    sum += d * d;
  }
  return (float)(sum / (double)n);
}

/* Where the backward pass writes gradient p: the caller's slot in its dtype, or m->grad (f32). */
typedef struct grad_dst {
  char *ptr; /* the slot; NULL: m->grad */
  sg_dtype dtype;
} grad_dst;

static int open_dst(const mlp_model *m, int p, mlp_grad_slot slot, void *ctx, grad_dst *d) {
  void *ptr = NULL;
  sg_dtype dt = SG_F32;
  const int rc = slot ? slot(ctx, p, m->numel[p], &ptr, &dt) : 0;
  *d = (grad_dst){ptr, ptr ? dt : SG_F32};
  return rc;
}

/* The f32 values for elements off.. of the gradient: in place when the destination is f32,
 * else in m->row until put_dst converts them. */
static float *dst_f32(const mlp_model *m, const grad_dst *d, size_t off) {
  if (!d->ptr) return m->grad + off;
  return d->dtype == SG_F32 ? (float *)(void *)d->ptr + off : m->row;
}

static void put_dst(const grad_dst *d, const float *g, size_t off, size_t n) {
  if (d->ptr && d->dtype != SG_F32) mlp_from_f32(g, d->dtype, d->ptr + off * 2, n);
}

static int emit(const mlp_model *m, int p, const grad_dst *d, mlp_grad_sink sink, void *ctx) {
  return sink(ctx, p, d->ptr ? NULL : m->grad, m->numel[p]);
}

/* Row o of W for batch rows b and b+1: g = (0 or g) + d0 a0 + d1 a1 (the weight gradient, in
 * the order of adding the rows one by one to a zeroed buffer) and, when dp0 is given,
 * dp0 += d0 w and dp1 += d1 w (the backward of the layer's input): one pass over w and g. */
static void pair_row(int first, float d0, float d1, const float *a0, const float *a1,
                     const float *w, float *g, float *dp0, float *dp1, int n) {
  if (first)
    for (int i = 0; i < n; i++) g[i] = 0.0f + d0 * a0[i] + d1 * a1[i];
  else
    for (int i = 0; i < n; i++) g[i] = g[i] + d0 * a0[i] + d1 * a1[i];
  if (dp0)
    for (int i = 0; i < n; i++) {
      dp0[i] += d0 * w[i];
      dp1[i] += d1 * w[i];
    }
}

/* The same for one batch row b. */
static void one_row(int first, float d0, const float *a0, const float *w, float *g, float *dp0,
                    int n) {
  if (first)
    for (int i = 0; i < n; i++) g[i] = 0.0f + d0 * a0[i];
  else
    axpy(d0, a0, g, n);
  if (dp0) axpy(d0, w, dp0, n);
}

/* Row o of layer l's weight gradient (sum over the batch of delta[b][o] act[l][b]) into g, and
 * delta_prev[b] += delta[b][o] W[o] when back is set. */
static void weight_row(mlp_model *m, int l, int o, const float *wo, float *g, int back) {
  const int nin = m->dims[l], nout = m->dims[l + 1];
  const float *a = m->act[l], *d = m->delta;
  float *dp = back ? m->delta_prev : NULL;
  int b = 0;
  for (; b + 2 <= m->batch; b += 2) {
    const size_t r0 = (size_t)b * nin, r1 = r0 + (size_t)nin;
    pair_row(b == 0, d[(size_t)b * nout + o], d[(size_t)(b + 1) * nout + o], a + r0, a + r1, wo,
             g, dp ? dp + r0 : NULL, dp ? dp + r1 : NULL, nin);
  }
  if (b < m->batch)
    one_row(b == 0, d[(size_t)b * nout + o], a + (size_t)b * nin, wo, g,
            dp ? dp + (size_t)b * nin : NULL, nin);
}

/* Layer l given m->delta (dLoss/d(pre-activation of layer l)): the gradient of b, then in one
 * pass over W the gradient of W and (l > 0) delta_prev += delta W, which then becomes delta
 * (times tanh'(act[l])). Each row of W and of its gradient is touched once for the whole batch. */
static int layer_backward(mlp_model *m, int l, const float *w, mlp_grad_slot slot,
                          mlp_grad_sink sink, void *ctx) {
  const int nin = m->dims[l], nout = m->dims[l + 1];
  grad_dst d;
  int rc = open_dst(m, 2 * l + 1, slot, ctx, &d);
  if (rc) return rc;
  float *g = dst_f32(m, &d, 0);
  memset(g, 0, (size_t)nout * sizeof(float));
  for (int b = 0; b < m->batch; b++) axpy(1.0f, m->delta + (size_t)b * nout, g, nout);
  put_dst(&d, g, 0, (size_t)nout);
  if ((rc = emit(m, 2 * l + 1, &d, sink, ctx)) != 0) return rc;
  if ((rc = open_dst(m, 2 * l, slot, ctx, &d)) != 0) return rc;
  if (l > 0) memset(m->delta_prev, 0, (size_t)m->batch * nin * sizeof(float));
  for (int o = 0; o < nout; o++) {
    const size_t off = (size_t)o * nin;
    g = dst_f32(m, &d, off);
    weight_row(m, l, o, w + off, g, l > 0);
    put_dst(&d, g, off, (size_t)nin);
  }
  if ((rc = emit(m, 2 * l, &d, sink, ctx)) != 0 || l == 0) return rc;
  for (int b = 0; b < m->batch; b++) {
    float *dp = m->delta_prev + (size_t)b * nin;
    const float *a = m->act[l] + (size_t)b * nin;
    for (int i = 0; i < nin; i++) dp[i] *= 1.0f - a[i] * a[i];
  }
  float *t = m->delta;
  m->delta = m->delta_prev;
  m->delta_prev = t;
  return 0;
}

int mlp_backward(mlp_model *m, float *const *params, float scale, mlp_grad_slot slot,
                 mlp_grad_sink sink, void *ctx) {
  const size_t n = (size_t)m->batch * MLP_OUT;
  const float k = 2.0f * scale / (float)n; /* d(mean of squares) */
  for (size_t i = 0; i < n; i++) m->delta[i] = k * (m->act[m->layers][i] - m->target[i]);
  for (int l = m->layers - 1; l >= 0; l--) {
    const int rc = layer_backward(m, l, params[2 * l], slot, sink, ctx);
    if (rc) return rc;
  }
  return 0;
}

/* ---- one gradient buffer ------------------------------------------------------------------- */

int mlp_grads_init(mlp_grads *g, const mlp_model *m) {
  memset(g, 0, sizeof *g);
  size_t off = 0;
  for (int p = 0; p < m->nparams; p++) {
    g->off[p] = off;
    off += m->numel[p];
  }
  g->grad = calloc(m->total_numel ? m->total_numel : 1, sizeof(float));
  return g->grad ? 0 : -1;
}

void mlp_grads_free(mlp_grads *g) {
  free(g->grad);
  g->grad = NULL;
}

int mlp_grads_slot(void *ctx, int p, size_t n, void **dst, sg_dtype *dtype) {
  mlp_grads *g = ctx;
  (void)n;
  *dst = g->grad + g->off[p];
  *dtype = SG_F32;
  return 0;
}

/* The gradient is in its place already. */
int mlp_grads_sink(void *ctx, int p, const float *grad, size_t n) {
  (void)ctx, (void)p, (void)grad, (void)n;
  return 0;
}

/* ---- dtype conversion ---------------------------------------------------------------------- */

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  const float v = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24, exact */
  return sign ? -v : v;
}

static uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
  if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to >= 65520: inf */
  if (a < 0x38800000u) { /* below the smallest normal 2^-14: subnormal or zero */
    const float v = bits_f32(a) * 16777216.0f; /* exact scaling by 2^24 */
    /* v < 1024; rounding to an integer with ties to even gives the subnormal mantissa */
    float r = (float)(int)v;
    const float frac = v - r;
    if (frac > 0.5f || (frac == 0.5f && ((int)r & 1))) r += 1.0f;
    return sign | (uint16_t)(int)r;
  }
  /* normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even */
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

void mlp_to_f32(const void *src, sg_dtype dtype, float *dst, size_t n) {
  const uint16_t *h = src;
  if (dtype == SG_F32)
    memcpy(dst, src, n * sizeof(float));
  else if (dtype == SG_BF16)
    for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16);
  else
    for (size_t i = 0; i < n; i++) dst[i] = f16_to_f32(h[i]);
}

void mlp_from_f32(const float *src, sg_dtype dtype, void *dst, size_t n) {
  uint16_t *h = dst;
  if (dtype == SG_F32)
    memcpy(dst, src, n * sizeof(float));
  else if (dtype == SG_BF16)
    for (size_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
  else
    for (size_t i = 0; i < n; i++) h[i] = f32_to_f16(src[i]);
}

/* ---- engine glue --------------------------------------------------------------------------- */

sg_status mlp_engine_register(mlp_engine *me, mlp_model *m, sg_engine *e, const sg_config *cfg) {
  memset(me, 0, sizeof *me);
  me->e = e;
  me->m = m;
  me->param_dtype = cfg->param_dtype;
  me->grad_dtype = cfg->grad_dtype;
  for (int p = 0; p < m->nparams; p++) {
    char name[32];
    snprintf(name, sizeof name, "fc%d.%s", p / 2, p % 2 ? "bias" : "weight");
    const uint32_t flags = p % 2 ? SG_PARAM_NO_DECAY : 0u;
    const sg_status st = sg_add_param(e, name, m->numel[p], flags, &me->ids[p]);
    if (st != SG_OK) return st;
  }
  return SG_OK;
}

sg_status mlp_engine_init_params(mlp_engine *me) {
  const mlp_model *m = me->m;
  float *tmp = NULL;
  sg_status st = SG_ERR_OUT_OF_MEMORY;
  for (int p = 0; p < m->nparams; p++) {
    free(tmp);
    st = SG_ERR_OUT_OF_MEMORY;
    if (!(tmp = malloc(m->numel[p] * sizeof(float)))) goto done;
    mlp_init_param(m, p, tmp);
    if ((st = sg_set_param(me->e, me->ids[p], tmp, SG_F32)) != SG_OK) goto done;
    void *ptr = NULL;
    if ((st = sg_param_ptr(me->e, me->ids[p], &ptr)) != SG_OK) goto done;
    if (me->param_dtype == SG_F32) {
      me->view[p] = ptr; /* the engine's working copy, updated in place by sg_step */
    } else {
      st = SG_ERR_OUT_OF_MEMORY;
      if (!(me->conv[p] = malloc(m->numel[p] * sizeof(float)))) goto done;
      me->view[p] = me->conv[p];
    }
  }
  st = SG_OK;
done:
  free(tmp);
  return st;
}

/* The backward pass writes each gradient straight into its engine slot, in the grad dtype. */
static int engine_slot(void *ctx, int p, size_t n, void **dst, sg_dtype *dtype) {
  mlp_engine *me = ctx;
  (void)n;
  *dtype = me->grad_dtype;
  return (me->status = sg_grad_ptr(me->e, me->ids[p], dst)) == SG_OK ? 0 : -1;
}

/* Gradient p is in its slot: mark it ready. */
static int engine_sink(void *ctx, int p, const float *grad, size_t n) {
  mlp_engine *me = ctx;
  (void)grad, (void)n;
  return (me->status = sg_grad_ready(me->e, me->ids[p])) == SG_OK ? 0 : -1;
}

/* Before layer l reads W_l and b_l: wait for their all-gather (a no-op unless the engine runs
 * with overlap_param_gather), then make the f32 copies of low-precision parameters. */
static int engine_layer(void *ctx, int l) {
  mlp_engine *me = ctx;
  for (int p = 2 * l; p < 2 * l + 2; p++) {
    if ((me->status = sg_param_wait(me->e, me->ids[p])) != SG_OK) return -1;
    if (me->param_dtype == SG_F32) continue;
    void *ptr = NULL;
    if ((me->status = sg_param_ptr(me->e, me->ids[p], &ptr)) != SG_OK) return -1;
    mlp_to_f32(ptr, me->param_dtype, me->conv[p], me->m->numel[p]);
  }
  return 0;
}

sg_status mlp_engine_micro_batch(mlp_engine *me, float scale, float *loss) {
  mlp_model *m = me->m;
  me->status = SG_OK;
  *loss = mlp_forward_hooked(m, me->view, engine_layer, me);
  if (me->status != SG_OK) return me->status;
  mlp_backward(m, me->view, scale, engine_slot, engine_sink, me);
  return me->status;
}

void mlp_engine_free(mlp_engine *me) {
  for (int p = 0; p < 2 * MLP_MAX_LAYERS; p++) free(me->conv[p]);
  memset(me, 0, sizeof *me);
}
