/* The CPU reference of examples/cnn_cudnn (cnn_model.c), which cnn_cudnn --check holds the
 * cuDNN/cuBLAS pass to: its gradients against central finite differences of its loss, their
 * linearity in the loss scale, and that the generated task can be learned (the example's
 * defaults, trained here with a plain Adam on the reference, halve the loss within its steps). */
#include <math.h>   /* fabs, sqrt */
#include <stdio.h>  /* printf */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcpy */

#include "cnn_model.h"
#include "sg_test_check.h" /* CHECK */

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

typedef struct net {
  cnn_dims d;
  float *pf[CNN_NPARAMS];
  double *pd[CNN_NPARAMS], *g[CNN_NPARAMS];
  float *x;
  int *labels;
} net;

static int net_init(net *t, int batch, int c1, uint64_t seed) {
  memset(t, 0, sizeof *t);
  if (cnn_dims_init(&t->d, batch, c1) != 0) return -1;
  for (int p = 0; p < CNN_NPARAMS; p++) {
    t->pf[p] = malloc(t->d.numel[p] * sizeof(float));
    t->pd[p] = malloc(t->d.numel[p] * sizeof(double));
    t->g[p] = malloc(t->d.numel[p] * sizeof(double));
    if (!t->pf[p] || !t->pd[p] || !t->g[p]) return -1;
    cnn_init_param(&t->d, seed, p, t->pf[p]);
  }
  t->x = malloc((size_t)batch * CNN_IMG * CNN_IMG * sizeof(float));
  t->labels = malloc((size_t)batch * sizeof(int));
  return t->x && t->labels ? 0 : -1;
}

static void net_free(net *t) {
  for (int p = 0; p < CNN_NPARAMS; p++) free(t->pf[p]), free(t->pd[p]), free(t->g[p]);
  free(t->x), free(t->labels);
}

/* Every gradient coordinate of a few per parameter against (L(w+h) - L(w-h)) / 2h in double. */
static void test_finite_differences(void) {
  net t;
  if (net_init(&t, 3, 3, 7) != 0) {
    check(0, "finite differences: out of memory");
    return;
  }
  cnn_make_batch(&t.d, 11, 0, t.x, t.labels);
  for (int p = 0; p < CNN_NPARAMS; p++) /* nonzero biases, so that their gradients matter */
    for (size_t i = 0; i < t.d.numel[p]; i++)
      if (p % 2) t.pf[p][i] = 0.05f * (float)((int)(i % 7) - 3);
  double loss = 0;
  int ok = cnn_ref_step(&t.d, (const float *const *)t.pf, t.x, t.labels, 1.0, &loss, t.g) == 0;
  for (int p = 0; p < CNN_NPARAMS; p++)
    for (size_t i = 0; i < t.d.numel[p]; i++) t.pd[p][i] = t.pf[p][i];
  const double h = 1e-5;
  double worst = 0;
  int checked = 0;
  for (int p = 0; p < CNN_NPARAMS && ok; p++) {
    const size_t n = t.d.numel[p], stride = n > 12 ? n / 12 : 1;
    for (size_t i = 0; i < n; i += stride) {
      double lp = 0, lm = 0;
      const double w0 = t.pd[p][i];
      t.pd[p][i] = w0 + h;
      ok &= cnn_ref_loss(&t.d, (const double *const *)t.pd, t.x, t.labels, &lp) == 0;
      t.pd[p][i] = w0 - h;
      ok &= cnn_ref_loss(&t.d, (const double *const *)t.pd, t.x, t.labels, &lm) == 0;
      t.pd[p][i] = w0;
      const double num = (lp - lm) / (2 * h), err = fabs(num - t.g[p][i]) / (1e-6 + fabs(num));
      if (err > worst) worst = err;
      if (err > 1e-4) {
        printf("     %s[%zu]: analytic %.10g, finite difference %.10g\n", t.d.names[p], i,
               t.g[p][i], num);
        ok = 0;
      }
      checked++;
    }
  }
  char what[160];
  snprintf(what, sizeof what,
           "gradients of all 6 parameters match finite differences (%d "
           "coordinates, worst relative error %.2g, loss %.4f)",
           checked, worst, loss);
  check(ok, what);
  net_free(&t);
}

/* scale multiplies every gradient and leaves the loss alone. */
static void test_scale(void) {
  net t;
  if (net_init(&t, 4, 2, 3) != 0) {
    check(0, "scale: out of memory");
    return;
  }
  cnn_make_batch(&t.d, 5, 100, t.x, t.labels);
  double l1 = 0, l4 = 0, *g4[CNN_NPARAMS];
  int ok = 1;
  for (int p = 0; p < CNN_NPARAMS; p++) ok &= (g4[p] = malloc(t.d.numel[p] * sizeof(double))) != 0;
  ok = ok && cnn_ref_step(&t.d, (const float *const *)t.pf, t.x, t.labels, 1.0, &l1, t.g) == 0 &&
       cnn_ref_step(&t.d, (const float *const *)t.pf, t.x, t.labels, 4.0, &l4, g4) == 0 && l1 == l4;
  for (int p = 0; p < CNN_NPARAMS && ok; p++)
    for (size_t i = 0; i < t.d.numel[p]; i++)
      ok &= fabs(g4[p][i] - 4.0 * t.g[p][i]) <= 1e-12 * (fabs(g4[p][i]) + 1e-30);
  check(ok, "scale 4 gives 4 x the gradients and the same loss");
  for (int p = 0; p < CNN_NPARAMS; p++) free(g4[p]);
  net_free(&t);
}

/* The example's defaults (batch 32, 8 channels, lr 3e-3) with Adam on the reference. */
static void test_learnable(void) {
  net t;
  const int steps = 200;
  if (net_init(&t, 32, 8, 1) != 0) {
    check(0, "learnable: out of memory");
    return;
  }
  double *m[CNN_NPARAMS], *v[CNN_NPARAMS];
  int ok = 1;
  for (int p = 0; p < CNN_NPARAMS; p++) {
    m[p] = calloc(t.d.numel[p], sizeof(double));
    v[p] = calloc(t.d.numel[p], sizeof(double));
    ok &= m[p] && v[p];
  }
  double first = 0, last = 0, sum = 0;
  for (int s = 0; s < steps && ok; s++) {
    double loss = 0;
    cnn_make_batch(&t.d, 1, (uint64_t)s * 32, t.x, t.labels);
    ok = cnn_ref_step(&t.d, (const float *const *)t.pf, t.x, t.labels, 1.0, &loss, t.g) == 0;
    if (s < 10) first += loss / 10;
    if (s >= steps - 10) last += loss / 10;
    sum += loss;
    const double lr = 3e-3, b1 = 0.9, b2 = 0.999;
    for (int p = 0; p < CNN_NPARAMS; p++)
      for (size_t i = 0; i < t.d.numel[p]; i++) {
        m[p][i] = b1 * m[p][i] + (1 - b1) * t.g[p][i];
        v[p][i] = b2 * v[p][i] + (1 - b2) * t.g[p][i] * t.g[p][i];
        const double mh = m[p][i] / (1 - pow(b1, s + 1)), vh = v[p][i] / (1 - pow(b2, s + 1));
        t.pf[p][i] -= (float)(lr * mh / (sqrt(vh) + 1e-8));
      }
  }
  char what[160];
  snprintf(what, sizeof what,
           "the task is learnable: mean loss of the first 10 steps %.4f, of "
           "the last 10 %.4f (must halve in %d steps)",
           first, last, steps);
  check(ok && last < 0.5 * first, what);
  for (int p = 0; p < CNN_NPARAMS; p++) free(m[p]), free(v[p]);
  net_free(&t);
}

int main(void) {
  cnn_dims d;
  check(cnn_dims_init(&d, 0, 8) == -1 && cnn_dims_init(&d, 4, 0) == -1 &&
            cnn_dims_init(&d, 4, 257) == -1 && cnn_dims_init(&d, 4, 8) == 0 && d.feat == 256 &&
            d.numel[2] == 1152 && d.numel[4] == 2560,
        "shapes and their bounds");
  test_finite_differences();
  test_scale();
  test_learnable();
  return sg_test_summary("");
}
