/* examples/cnn_cudnn's network on the CPU: data, initial values, and the reference pass
 * (cnn_model.h). Plain loops in double: slow and obviously right, which is all a reference
 * needs to be. */
#include "cnn_model.h"

#include <math.h>   /* exp, log, sqrt, cos, sin */
#include <stdlib.h> /* calloc, free */
#include <string.h> /* memset */

static const double kPi = 3.14159265358979323846;

int cnn_dims_init(cnn_dims *d, int batch, int c1) {
  static const char *const names[CNN_NPARAMS] = {"conv1.weight", "conv1.bias", "conv2.weight",
                                                 "conv2.bias",   "fc.weight",  "fc.bias"};
  if (batch < 1 || c1 < 1 || c1 > 256) return -1;
  memset(d, 0, sizeof *d);
  d->batch = batch;
  d->c1 = c1;
  d->c2 = 2 * c1;
  d->feat = d->c2 * (CNN_IMG / 4) * (CNN_IMG / 4);
  d->numel[0] = (size_t)c1 * 9;
  d->numel[1] = (size_t)c1;
  d->numel[2] = (size_t)d->c2 * (size_t)c1 * 9;
  d->numel[3] = (size_t)d->c2;
  d->numel[4] = (size_t)CNN_CLASSES * (size_t)d->feat;
  d->numel[5] = CNN_CLASSES;
  for (int p = 0; p < CNN_NPARAMS; p++) d->names[p] = names[p];
  return 0;
}

/* ---- random numbers: a hash of (seed, a, b), so that any image can be made on its own ---- */

static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint64_t hash3(uint64_t seed, uint64_t a, uint64_t b) { return mix(mix(mix(seed) ^ a) ^ b); }

static double unit(uint64_t h) { return (double)(h >> 11) * 0x1.0p-53; } /* [0, 1) */

static double gauss(uint64_t seed, uint64_t a, uint64_t b) {
  const double u1 = 1.0 - unit(hash3(seed, a, 2 * b)), u2 = unit(hash3(seed, a, 2 * b + 1));
  return sqrt(-2.0 * log(u1)) * cos(2.0 * kPi * u2);
}

void cnn_make_batch(const cnn_dims *d, uint64_t seed, uint64_t first, float *x, int *labels) {
  for (int n = 0; n < d->batch; n++) {
    const uint64_t g = first + (uint64_t)n, h = hash3(seed, g, 0x5eed);
    const int label = (int)(h % CNN_CLASSES);
    const double theta = label * kPi / CNN_CLASSES;
    const double cx = 7.5 + (double)((int)((h >> 8) % 5) - 2);
    const double cy = 7.5 + (double)((int)((h >> 16) % 5) - 2);
    float *img = x + (size_t)n * CNN_IMG * CNN_IMG;
    for (int r = 0; r < CNN_IMG; r++)
      for (int c = 0; c < CNN_IMG; c++) {
        const double dist = -sin(theta) * (c - cx) + cos(theta) * (r - cy);
        const uint64_t px = (uint64_t)(r * CNN_IMG + c) + 1;
        img[r * CNN_IMG + c] = (float)(exp(-0.5 * dist * dist) + 0.4 * gauss(seed, g, px));
      }
    labels[n] = label;
  }
}

void cnn_init_param(const cnn_dims *d, uint64_t seed, int p, float *out) {
  const double fan_in = p == 0 ? 9.0 : p == 2 ? 9.0 * d->c1 : (double)d->feat;
  const double bound = p == 4 ? sqrt(6.0 / (fan_in + CNN_CLASSES)) : sqrt(6.0 / fan_in);
  for (size_t i = 0; i < d->numel[p]; i++)
    out[i] =
        p % 2 ? 0.0f : (float)(bound * (2.0 * unit(hash3(seed, 0x1417 + (uint64_t)p, i)) - 1.0));
}

/* ---- the reference pass --------------------------------------------------------------------- */

/* Activations of one pass; z: pre-activation (conv + bias), a: after ReLU, p: after pooling. */
typedef struct ref_buffers {
  double *z1, *a1, *p1, *z2, *a2, *p2, *logits;
  int *arg1, *arg2; /* the pooled element of each window (index into a1 / a2) */
} ref_buffers;

static void ref_free(ref_buffers *b) {
  free(b->z1), free(b->a1), free(b->p1), free(b->z2), free(b->a2), free(b->p2), free(b->logits);
  free(b->arg1), free(b->arg2);
}

static int ref_alloc(const cnn_dims *d, ref_buffers *b) {
  const size_t n = (size_t)d->batch, s1 = (size_t)CNN_IMG * CNN_IMG, s2 = s1 / 4, s3 = s1 / 16;
  b->z1 = calloc(n * d->c1 * s1, sizeof(double));
  b->a1 = calloc(n * d->c1 * s1, sizeof(double));
  b->p1 = calloc(n * d->c1 * s2, sizeof(double));
  b->z2 = calloc(n * d->c2 * s2, sizeof(double));
  b->a2 = calloc(n * d->c2 * s2, sizeof(double));
  b->p2 = calloc(n * d->c2 * s3, sizeof(double));
  b->logits = calloc(n * CNN_CLASSES, sizeof(double));
  b->arg1 = calloc(n * d->c1 * s2, sizeof(int));
  b->arg2 = calloc(n * d->c2 * s3, sizeof(int));
  if (b->z1 && b->a1 && b->p1 && b->z2 && b->a2 && b->p2 && b->logits && b->arg1 && b->arg2)
    return 0;
  ref_free(b);
  return -1;
}

/* out[n,co,y,x] = b[co] + sum over ci, ky, kx of w[co,ci,ky,kx] in[n,ci,y+ky-1,x+kx-1]: cuDNN's
 * CUDNN_CROSS_CORRELATION with zero padding 1, stride 1. */
static void conv_fwd(int n, int ci, int co, int hw, const double *in, const double *w,
                     const double *b, double *out) {
  for (int i = 0; i < n; i++)
    for (int o = 0; o < co; o++)
      for (int y = 0; y < hw; y++)
        for (int x = 0; x < hw; x++) {
          double s = b[o];
          for (int c = 0; c < ci; c++)
            for (int ky = 0; ky < 3; ky++)
              for (int kx = 0; kx < 3; kx++) {
                const int yy = y + ky - 1, xx = x + kx - 1;
                if (yy < 0 || yy >= hw || xx < 0 || xx >= hw) continue;
                s += w[((o * ci + c) * 3 + ky) * 3 + kx] *
                     in[((size_t)(i * ci + c) * hw + yy) * hw + xx];
              }
          out[((size_t)(i * co + o) * hw + y) * hw + x] = s;
        }
}

/* dw, db from dout; din (when not NULL) from dout and w. */
static void conv_bwd(int n, int ci, int co, int hw, const double *in, const double *w,
                     const double *dout, double *dw, double *db, double *din) {
  memset(dw, 0, sizeof(double) * (size_t)co * ci * 9);
  memset(db, 0, sizeof(double) * (size_t)co);
  if (din) memset(din, 0, sizeof(double) * (size_t)n * ci * hw * hw);
  for (int i = 0; i < n; i++)
    for (int o = 0; o < co; o++)
      for (int y = 0; y < hw; y++)
        for (int x = 0; x < hw; x++) {
          const double g = dout[((size_t)(i * co + o) * hw + y) * hw + x];
          db[o] += g;
          for (int c = 0; c < ci; c++)
            for (int ky = 0; ky < 3; ky++)
              for (int kx = 0; kx < 3; kx++) {
                const int yy = y + ky - 1, xx = x + kx - 1;
                if (yy < 0 || yy >= hw || xx < 0 || xx >= hw) continue;
                const size_t wi = (size_t)((o * ci + c) * 3 + ky) * 3 + kx;
                const size_t ii = ((size_t)(i * ci + c) * hw + yy) * hw + xx;
                dw[wi] += g * in[ii];
                if (din) din[ii] += g * w[wi];
              }
        }
}

static void relu_fwd(size_t n, const double *z, double *a) {
  for (size_t i = 0; i < n; i++) a[i] = z[i] > 0.0 ? z[i] : 0.0;
}

/* 2x2 windows, stride 2: the largest element, the first one in row order on ties. */
static void pool_fwd(int nc, int hw, const double *a, double *p, int *arg) {
  const int ho = hw / 2;
  for (int k = 0; k < nc; k++)
    for (int y = 0; y < ho; y++)
      for (int x = 0; x < ho; x++) {
        int best = (k * hw + 2 * y) * hw + 2 * x;
        for (int dy = 0; dy < 2; dy++)
          for (int dx = 0; dx < 2; dx++) {
            const int j = (k * hw + 2 * y + dy) * hw + 2 * x + dx;
            if (a[j] > a[best]) best = j;
          }
        p[(k * ho + y) * ho + x] = a[best];
        arg[(k * ho + y) * ho + x] = best;
      }
}

/* dz = dp routed to each window's maximum, through the ReLU (zero where z <= 0). */
static void pool_relu_bwd(int nc, int hw, const double *dp, const int *arg, const double *z,
                          double *dz) {
  const size_t n = (size_t)nc * hw * hw, np = n / 4;
  memset(dz, 0, sizeof(double) * n);
  for (size_t i = 0; i < np; i++) dz[arg[i]] += dp[i];
  for (size_t i = 0; i < n; i++)
    if (!(z[i] > 0.0)) dz[i] = 0.0;
}

/* Forward through the logits; the mean loss. */
static double ref_forward(const cnn_dims *d, const double *const w[CNN_NPARAMS], const double *x,
                          const int *labels, ref_buffers *b) {
  const int n = d->batch, hw = CNN_IMG;
  conv_fwd(n, 1, d->c1, hw, x, w[0], w[1], b->z1);
  relu_fwd((size_t)n * d->c1 * hw * hw, b->z1, b->a1);
  pool_fwd(n * d->c1, hw, b->a1, b->p1, b->arg1);
  conv_fwd(n, d->c1, d->c2, hw / 2, b->p1, w[2], w[3], b->z2);
  relu_fwd((size_t)n * d->c2 * (hw / 2) * (hw / 2), b->z2, b->a2);
  pool_fwd(n * d->c2, hw / 2, b->a2, b->p2, b->arg2);
  double loss = 0.0;
  for (int i = 0; i < n; i++) {
    double *l = b->logits + (size_t)i * CNN_CLASSES, mx = -INFINITY, se = 0.0;
    for (int k = 0; k < CNN_CLASSES; k++) {
      double s = w[5][k];
      for (int j = 0; j < d->feat; j++)
        s += w[4][(size_t)k * d->feat + j] * b->p2[(size_t)i * d->feat + j];
      l[k] = s;
      mx = s > mx ? s : mx;
    }
    for (int k = 0; k < CNN_CLASSES; k++) se += exp(l[k] - mx);
    loss += mx + log(se) - l[labels[i]];
  }
  return loss / n;
}

/* Backward from the buffers of ref_forward: gradients of scale * (mean loss). */
static int ref_backward(const cnn_dims *d, const double *const w[CNN_NPARAMS], const double *x,
                        const int *labels, double scale, ref_buffers *b,
                        double *const g[CNN_NPARAMS]) {
  const int n = d->batch, hw = CNN_IMG;
  double *dl = calloc((size_t)n * CNN_CLASSES, sizeof(double));
  double *dp2 = calloc((size_t)n * d->feat, sizeof(double));
  double *dz2 = calloc((size_t)n * d->c2 * (hw / 2) * (hw / 2), sizeof(double));
  double *dp1 = calloc((size_t)n * d->c1 * (hw / 2) * (hw / 2), sizeof(double));
  double *dz1 = calloc((size_t)n * d->c1 * hw * hw, sizeof(double));
  int rc = dl && dp2 && dz2 && dp1 && dz1 ? 0 : -1;
  if (rc == 0) {
    for (int i = 0; i < n; i++) { /* d(loss)/d(logits) = (softmax - onehot) * scale / n */
      const double *l = b->logits + (size_t)i * CNN_CLASSES;
      double mx = -INFINITY, se = 0.0;
      for (int k = 0; k < CNN_CLASSES; k++) mx = l[k] > mx ? l[k] : mx;
      for (int k = 0; k < CNN_CLASSES; k++) se += exp(l[k] - mx);
      for (int k = 0; k < CNN_CLASSES; k++)
        dl[i * CNN_CLASSES + k] = (exp(l[k] - mx) / se - (k == labels[i])) * scale / n;
    }
    memset(g[4], 0, sizeof(double) * d->numel[4]);
    memset(g[5], 0, sizeof(double) * d->numel[5]);
    for (int i = 0; i < n; i++)
      for (int k = 0; k < CNN_CLASSES; k++) {
        const double e = dl[i * CNN_CLASSES + k];
        g[5][k] += e;
        for (int j = 0; j < d->feat; j++) {
          g[4][(size_t)k * d->feat + j] += e * b->p2[(size_t)i * d->feat + j];
          dp2[(size_t)i * d->feat + j] += e * w[4][(size_t)k * d->feat + j];
        }
      }
    pool_relu_bwd(n * d->c2, hw / 2, dp2, b->arg2, b->z2, dz2);
    conv_bwd(n, d->c1, d->c2, hw / 2, b->p1, w[2], dz2, g[2], g[3], dp1);
    pool_relu_bwd(n * d->c1, hw, dp1, b->arg1, b->z1, dz1);
    conv_bwd(n, 1, d->c1, hw, x, w[0], dz1, g[0], g[1], NULL);
  }
  free(dl), free(dp2), free(dz2), free(dp1), free(dz1);
  return rc;
}

/* The pass over double parameters; grads NULL: the loss alone. */
static int ref_pass(const cnn_dims *d, const double *const w[CNN_NPARAMS], const float *xf,
                    const int *labels, double scale, double *loss, double *const g[CNN_NPARAMS]) {
  const size_t nx = (size_t)d->batch * CNN_IMG * CNN_IMG;
  double *x = malloc(nx * sizeof(double));
  ref_buffers b;
  memset(&b, 0, sizeof b);
  if (!x || ref_alloc(d, &b) != 0) {
    free(x);
    return -1;
  }
  for (size_t i = 0; i < nx; i++) x[i] = xf[i];
  *loss = ref_forward(d, w, x, labels, &b);
  const int rc = g ? ref_backward(d, w, x, labels, scale, &b, g) : 0;
  ref_free(&b);
  free(x);
  return rc;
}

int cnn_ref_loss(const cnn_dims *d, const double *const params[CNN_NPARAMS], const float *x,
                 const int *labels, double *loss) {
  return ref_pass(d, params, x, labels, 1.0, loss, NULL);
}

int cnn_ref_step(const cnn_dims *d, const float *const params[CNN_NPARAMS], const float *x,
                 const int *labels, double scale, double *loss, double *const grads[CNN_NPARAMS]) {
  double *w[CNN_NPARAMS] = {0};
  int rc = 0;
  for (int p = 0; p < CNN_NPARAMS && rc == 0; p++) {
    w[p] = malloc(d->numel[p] * sizeof(double));
    if (!w[p]) rc = -1;
    for (size_t i = 0; w[p] && i < d->numel[p]; i++) w[p][i] = params[p][i];
  }
  if (rc == 0) rc = ref_pass(d, (const double *const *)w, x, labels, scale, loss, grads);
  for (int p = 0; p < CNN_NPARAMS; p++) free(w[p]);
  return rc;
}
