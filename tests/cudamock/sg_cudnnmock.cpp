// The mock cuDNN (cudnn.h here) and cuBLAS (cublas_v2.h here) over the mock CUDA runtime, for
// examples/cnn_cudnn on a machine without a GPU (test_cnn_cudnn_cudamock). Every operation
// checks its arguments now, as cuDNN does, and queues its arithmetic on the handle's stream
// (sg_emu_enqueue), so that it runs when the mock runtime runs that stream: a reduction of the
// engine that does not wait for it reads what the slot held before. The loops are written from
// cuDNN's and BLAS's definitions, independently of the example's CPU reference (cnn_model.c).
//
// Heuristics: each *_v7 query returns three candidates, best first: a tensor-op one (TF32; the
// mock refuses to run it under FMA math), a non-deterministic one, and a deterministic one that
// needs a workspace of kWorkspace bytes (refused with a smaller or missing workspace).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <type_traits>  // std::remove_pointer
#include <vector>

#include "cublas_v2.h"
#include "cuda/sg_cuda_emu_hook.h"  // sg_emu_enqueue: the mock runtime's streams
#include "cudnn.h"

struct cudnnContext {
  cudaStream_t stream = nullptr;
};
struct cudnnTensorStruct {
  int n = 0, c = 0, h = 0, w = 0;
};
struct cudnnFilterStruct {
  int k = 0, c = 0, h = 0, w = 0;
};
struct cudnnConvolutionStruct {
  int pad_h = 0, pad_w = 0, u = 1, v = 1, dil_h = 1, dil_w = 1;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};
struct cudnnActivationStruct {
  cudnnActivationMode_t mode = CUDNN_ACTIVATION_RELU;
};
struct cudnnPoolingStruct {
  cudnnPoolingMode_t mode = CUDNN_POOLING_MAX;
  int wh = 0, ww = 0, vpad = 0, hpad = 0, vs = 1, hs = 1;
};
struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace {

constexpr size_t kWorkspace = 4096;
constexpr int kTensorOpAlgo = 0, kNondetAlgo = 1, kGoodAlgo = 2;

cudnnStatus_t bad(const char *fn, const char *why) {
  fprintf(stderr, "cudnnmock: %s: %s\n", fn, why);
  return CUDNN_STATUS_BAD_PARAM;
}

bool on_device(const void *p) {
  cudaPointerAttributes a;
  return p && cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeDevice;
}

size_t numel(const cudnnTensorStruct *t) { return (size_t)t->n * t->c * t->h * t->w; }

bool same_shape(const cudnnTensorStruct *a, const cudnnTensorStruct *b) {
  return a->n == b->n && a->c == b->c && a->h == b->h && a->w == b->w;
}

// y = alpha * v + beta * y, without reading y when beta is 0 (cuDNN's rule: y may be garbage).
void blend(float *y, size_t i, float alpha, double v, float beta) {
  y[i] = beta == 0.0f ? (float)(alpha * v) : (float)(alpha * v + beta * (double)y[i]);
}

cudnnStatus_t submit(cudnnHandle_t h, const char *fn, std::function<void()> work) {
  if (!h) return bad(fn, "NULL handle");
  if (!h->stream) return bad(fn, "no stream set (cudnnSetStream)");
  sg_emu_enqueue(h->stream, std::move(work));
  return CUDNN_STATUS_SUCCESS;
}

// The output shape of a convolution; false when it does not fit.
bool conv_out(const cudnnConvolutionStruct *c, const cudnnTensorStruct *x,
              const cudnnFilterStruct *w, cudnnTensorStruct *y) {
  if (!c || !x || !w || x->c != w->c) return false;
  y->n = x->n;
  y->c = w->k;
  y->h = (x->h + 2 * c->pad_h - c->dil_h * (w->h - 1) - 1) / c->u + 1;
  y->w = (x->w + 2 * c->pad_w - c->dil_w * (w->w - 1) - 1) / c->v + 1;
  return y->h > 0 && y->w > 0;
}

// The checks every convolution call shares: shapes, algorithm, math, workspace, pointers.
cudnnStatus_t conv_check(const char *fn, cudnnConvolutionDescriptor_t c, cudnnTensorDescriptor_t x,
                         cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t y, int algo, void *ws,
                         size_t ws_bytes, std::initializer_list<const void *> ptrs) {
  cudnnTensorStruct want;
  if (!conv_out(c, x, w, &want) || !same_shape(&want, y))
    return bad(fn, "tensor shapes do not fit the convolution");
  if (algo == kTensorOpAlgo && c->math == CUDNN_FMA_MATH)
    return bad(fn, "tensor-op algorithm under CUDNN_FMA_MATH");
  if (algo < 0 || algo > kGoodAlgo) return bad(fn, "unknown algorithm");
  if (algo == kGoodAlgo && (ws_bytes < kWorkspace || !on_device(ws)))
    return bad(fn, "workspace smaller than the algorithm's or not device memory");
  for (const void *p : ptrs)
    if (!on_device(p)) return bad(fn, "a data pointer is not device memory");
  return CUDNN_STATUS_SUCCESS;
}

// Input coordinate of output position o and filter tap t; -1 outside (zero padding).
int tap(int o, int t, int stride, int pad, int dil, int size) {
  const int i = o * stride - pad + t * dil;
  return i >= 0 && i < size ? i : -1;
}

template <typename P>
void heuristic(int requested, int *returned, P *perf) {
  const int n = requested < 3 ? requested : 3;
  for (int i = 0; i < n; i++) {
    memset(&perf[i], 0, sizeof perf[i]);
    perf[i].algo = i == 0 ? kTensorOpAlgo : i == 1 ? kNondetAlgo : kGoodAlgo;
    perf[i].status = CUDNN_STATUS_SUCCESS;
    perf[i].determinism = i == 1 ? CUDNN_NON_DETERMINISTIC : CUDNN_DETERMINISTIC;
    perf[i].mathType = i == 0 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    perf[i].memory = i == 2 ? kWorkspace : 0;
  }
  *returned = n;
}

// The filter index of tap (ky, kx): flipped for true convolution.
int widx(const cudnnConvolutionStruct *c, const cudnnFilterStruct *w, int k, int ch, int ky,
         int kx) {
  if (c->mode == CUDNN_CONVOLUTION) ky = w->h - 1 - ky, kx = w->w - 1 - kx;
  return ((k * w->c + ch) * w->h + ky) * w->w + kx;
}

}  // namespace

extern "C" {

const char *cudnnGetErrorString(cudnnStatus_t s) {
  return s == CUDNN_STATUS_SUCCESS ? "CUDNN_STATUS_SUCCESS (mock)"
                                   : "CUDNN_STATUS_BAD_PARAM (mock)";
}
size_t cudnnGetVersion(void) { return 90000; }

cudnnStatus_t cudnnCreate(cudnnHandle_t *h) {
  if (!h) return bad("cudnnCreate", "NULL");
  *h = new cudnnContext;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t h) {
  delete h;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
  if (!h) return bad("cudnnSetStream", "NULL handle");
  h->stream = s;
  return CUDNN_STATUS_SUCCESS;
}

#define SG_MOCK_CREATE_DESTROY(T, create, destroy)   \
  cudnnStatus_t create(T *d) {                       \
    if (!d) return bad(#create, "NULL");             \
    *d = new std::remove_pointer<T>::type;           \
    return CUDNN_STATUS_SUCCESS;                     \
  }                                                  \
  cudnnStatus_t destroy(T d) {                       \
    if (!d) return bad(#destroy, "NULL descriptor"); \
    delete d;                                        \
    return CUDNN_STATUS_SUCCESS;                     \
  }
SG_MOCK_CREATE_DESTROY(cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor,
                       cudnnDestroyTensorDescriptor)
SG_MOCK_CREATE_DESTROY(cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor,
                       cudnnDestroyFilterDescriptor)
SG_MOCK_CREATE_DESTROY(cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                       cudnnDestroyConvolutionDescriptor)
SG_MOCK_CREATE_DESTROY(cudnnActivationDescriptor_t, cudnnCreateActivationDescriptor,
                       cudnnDestroyActivationDescriptor)
SG_MOCK_CREATE_DESTROY(cudnnPoolingDescriptor_t, cudnnCreatePoolingDescriptor,
                       cudnnDestroyPoolingDescriptor)

cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t t, cudnnTensorFormat_t f,
                                         cudnnDataType_t dt, int n, int c, int h, int w) {
  if (!t || f != CUDNN_TENSOR_NCHW || dt != CUDNN_DATA_FLOAT || n < 1 || c < 1 || h < 1 || w < 1)
    return bad("cudnnSetTensor4dDescriptor", "bad argument");
  *t = cudnnTensorStruct{n, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t f, cudnnDataType_t dt,
                                         cudnnTensorFormat_t fmt, int k, int c, int h, int w) {
  if (!f || fmt != CUDNN_TENSOR_NCHW || dt != CUDNN_DATA_FLOAT || k < 1 || c < 1 || h < 1 || w < 1)
    return bad("cudnnSetFilter4dDescriptor", "bad argument");
  *f = cudnnFilterStruct{k, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t c, int pad_h, int pad_w,
                                              int u, int v, int dil_h, int dil_w,
                                              cudnnConvolutionMode_t mode, cudnnDataType_t dt) {
  if (!c || pad_h < 0 || pad_w < 0 || u < 1 || v < 1 || dil_h < 1 || dil_w < 1 ||
      dt != CUDNN_DATA_FLOAT)
    return bad("cudnnSetConvolution2dDescriptor", "bad argument");
  const cudnnMathType_t math = c->math;
  *c = cudnnConvolutionStruct{pad_h, pad_w, u, v, dil_h, dil_w, mode, math};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t c, cudnnMathType_t m) {
  if (!c) return bad("cudnnSetConvolutionMathType", "NULL");
  c->math = m;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolution2dForwardOutputDim(cudnnConvolutionDescriptor_t c,
                                                    cudnnTensorDescriptor_t x,
                                                    cudnnFilterDescriptor_t w, int *n, int *ch,
                                                    int *h, int *wd) {
  cudnnTensorStruct y;
  if (!conv_out(c, x, w, &y)) return bad("cudnnGetConvolution2dForwardOutputDim", "bad shapes");
  *n = y.n, *ch = y.c, *h = y.h, *wd = y.w;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t a, cudnnActivationMode_t m,
                                           cudnnNanPropagation_t nan, double coef) {
  (void)nan, (void)coef;
  if (!a || m != CUDNN_ACTIVATION_RELU) return bad("cudnnSetActivationDescriptor", "ReLU only");
  a->mode = m;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetPooling2dDescriptor(cudnnPoolingDescriptor_t p, cudnnPoolingMode_t m,
                                          cudnnNanPropagation_t nan, int wh, int ww, int vpad,
                                          int hpad, int vstride, int hstride) {
  (void)nan;
  if (!p || (m != CUDNN_POOLING_MAX && m != CUDNN_POOLING_MAX_DETERMINISTIC) || wh < 1 || ww < 1 ||
      vpad < 0 || hpad < 0 || vstride < 1 || hstride < 1)
    return bad("cudnnSetPooling2dDescriptor", "max pooling with a positive window only");
  *p = cudnnPoolingStruct{m, wh, ww, vpad, hpad, vstride, hstride};
  return CUDNN_STATUS_SUCCESS;
}

// ---- heuristics and workspaces ----------------------------------------------------------------

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                     cudnnFilterDescriptor_t w,
                                                     cudnnConvolutionDescriptor_t c,
                                                     cudnnTensorDescriptor_t y, int requested,
                                                     int *returned,
                                                     cudnnConvolutionFwdAlgoPerf_t *perf) {
  cudnnTensorStruct want;
  if (!h || !returned || !perf || !conv_out(c, x, w, &want) || !same_shape(&want, y))
    return bad("cudnnGetConvolutionForwardAlgorithm_v7", "bad arguments or shapes");
  heuristic(requested, returned, perf);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnTensorDescriptor_t dx, int requested, int *returned,
    cudnnConvolutionBwdDataAlgoPerf_t *perf) {
  cudnnTensorStruct want;
  if (!h || !returned || !perf || !conv_out(c, dx, w, &want) || !same_shape(&want, dy))
    return bad("cudnnGetConvolutionBackwardDataAlgorithm_v7", "bad arguments or shapes");
  heuristic(requested, returned, perf);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnFilterDescriptor_t dw, int requested, int *returned,
    cudnnConvolutionBwdFilterAlgoPerf_t *perf) {
  cudnnTensorStruct want;
  if (!h || !returned || !perf || !conv_out(c, x, dw, &want) || !same_shape(&want, dy))
    return bad("cudnnGetConvolutionBackwardFilterAlgorithm_v7", "bad arguments or shapes");
  heuristic(requested, returned, perf);
  return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t ws_size(const char *fn, int algo, size_t *bytes) {
  if (!bytes || algo < 0 || algo > kGoodAlgo) return bad(fn, "bad algorithm");
  *bytes = algo == kGoodAlgo ? kWorkspace : 0;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t, cudnnTensorDescriptor_t,
                                                      cudnnFilterDescriptor_t,
                                                      cudnnConvolutionDescriptor_t,
                                                      cudnnTensorDescriptor_t,
                                                      cudnnConvolutionFwdAlgo_t a, size_t *bytes) {
  return ws_size("cudnnGetConvolutionForwardWorkspaceSize", a, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t, cudnnFilterDescriptor_t, cudnnTensorDescriptor_t, cudnnConvolutionDescriptor_t,
    cudnnTensorDescriptor_t, cudnnConvolutionBwdDataAlgo_t a, size_t *bytes) {
  return ws_size("cudnnGetConvolutionBackwardDataWorkspaceSize", a, bytes);
}
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t, cudnnTensorDescriptor_t, cudnnTensorDescriptor_t, cudnnConvolutionDescriptor_t,
    cudnnFilterDescriptor_t, cudnnConvolutionBwdFilterAlgo_t a, size_t *bytes) {
  return ws_size("cudnnGetConvolutionBackwardFilterWorkspaceSize", a, bytes);
}

// ---- convolutions -------------------------------------------------------------------------------

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha,
                                      cudnnTensorDescriptor_t xd, const void *x,
                                      cudnnFilterDescriptor_t wd, const void *w,
                                      cudnnConvolutionDescriptor_t c, cudnnConvolutionFwdAlgo_t a,
                                      void *ws, size_t ws_bytes, const void *beta,
                                      cudnnTensorDescriptor_t yd, void *y) {
  const char *fn = "cudnnConvolutionForward";
  const cudnnStatus_t s = conv_check(fn, c, xd, wd, yd, a, ws, ws_bytes, {x, w, y});
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnTensorStruct X = *xd, Y = *yd;
  const cudnnFilterStruct W = *wd;
  const cudnnConvolutionStruct C = *c;
  return submit(h, fn, [=] {
    const float *xp = (const float *)x, *wp = (const float *)w;
    float *yp = (float *)y;
    for (int n = 0; n < Y.n; n++)
      for (int k = 0; k < Y.c; k++)
        for (int oy = 0; oy < Y.h; oy++)
          for (int ox = 0; ox < Y.w; ox++) {
            double acc = 0;
            for (int ch = 0; ch < X.c; ch++)
              for (int ky = 0; ky < W.h; ky++)
                for (int kx = 0; kx < W.w; kx++) {
                  const int iy = tap(oy, ky, C.u, C.pad_h, C.dil_h, X.h);
                  const int ix = tap(ox, kx, C.v, C.pad_w, C.dil_w, X.w);
                  if (iy < 0 || ix < 0) continue;
                  acc += (double)wp[widx(&C, &W, k, ch, ky, kx)] *
                         xp[((n * X.c + ch) * X.h + iy) * X.w + ix];
                }
            blend(yp, ((size_t)(n * Y.c + k) * Y.h + oy) * Y.w + ox, al, acc, be);
          }
  });
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void *alpha,
                                           cudnnFilterDescriptor_t wd, const void *w,
                                           cudnnTensorDescriptor_t dyd, const void *dy,
                                           cudnnConvolutionDescriptor_t c,
                                           cudnnConvolutionBwdDataAlgo_t a, void *ws,
                                           size_t ws_bytes, const void *beta,
                                           cudnnTensorDescriptor_t dxd, void *dx) {
  const char *fn = "cudnnConvolutionBackwardData";
  const cudnnStatus_t s = conv_check(fn, c, dxd, wd, dyd, a, ws, ws_bytes, {w, dy, dx});
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnTensorStruct X = *dxd, Y = *dyd;
  const cudnnFilterStruct W = *wd;
  const cudnnConvolutionStruct C = *c;
  return submit(h, fn, [=] {
    const float *wp = (const float *)w, *dyp = (const float *)dy;
    float *dxp = (float *)dx;
    std::vector<double> acc(numel(&X), 0.0);
    for (int n = 0; n < Y.n; n++)
      for (int k = 0; k < Y.c; k++)
        for (int oy = 0; oy < Y.h; oy++)
          for (int ox = 0; ox < Y.w; ox++) {
            const double g = dyp[((n * Y.c + k) * Y.h + oy) * Y.w + ox];
            for (int ch = 0; ch < X.c; ch++)
              for (int ky = 0; ky < W.h; ky++)
                for (int kx = 0; kx < W.w; kx++) {
                  const int iy = tap(oy, ky, C.u, C.pad_h, C.dil_h, X.h);
                  const int ix = tap(ox, kx, C.v, C.pad_w, C.dil_w, X.w);
                  if (iy >= 0 && ix >= 0)
                    acc[((size_t)(n * X.c + ch) * X.h + iy) * X.w + ix] +=
                        g * wp[widx(&C, &W, k, ch, ky, kx)];
                }
          }
    for (size_t i = 0; i < acc.size(); i++) blend(dxp, i, al, acc[i], be);
  });
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void *alpha,
                                             cudnnTensorDescriptor_t xd, const void *x,
                                             cudnnTensorDescriptor_t dyd, const void *dy,
                                             cudnnConvolutionDescriptor_t c,
                                             cudnnConvolutionBwdFilterAlgo_t a, void *ws,
                                             size_t ws_bytes, const void *beta,
                                             cudnnFilterDescriptor_t dwd, void *dw) {
  const char *fn = "cudnnConvolutionBackwardFilter";
  const cudnnStatus_t s = conv_check(fn, c, xd, dwd, dyd, a, ws, ws_bytes, {x, dy, dw});
  if (s != CUDNN_STATUS_SUCCESS) return s;
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnTensorStruct X = *xd, Y = *dyd;
  const cudnnFilterStruct W = *dwd;
  const cudnnConvolutionStruct C = *c;
  return submit(h, fn, [=] {
    const float *xp = (const float *)x, *dyp = (const float *)dy;
    float *dwp = (float *)dw;
    std::vector<double> acc((size_t)W.k * W.c * W.h * W.w, 0.0);
    for (int n = 0; n < Y.n; n++)
      for (int k = 0; k < Y.c; k++)
        for (int oy = 0; oy < Y.h; oy++)
          for (int ox = 0; ox < Y.w; ox++) {
            const double g = dyp[((n * Y.c + k) * Y.h + oy) * Y.w + ox];
            for (int ch = 0; ch < X.c; ch++)
              for (int ky = 0; ky < W.h; ky++)
                for (int kx = 0; kx < W.w; kx++) {
                  const int iy = tap(oy, ky, C.u, C.pad_h, C.dil_h, X.h);
                  const int ix = tap(ox, kx, C.v, C.pad_w, C.dil_w, X.w);
                  if (iy >= 0 && ix >= 0)
                    acc[widx(&C, &W, k, ch, ky, kx)] +=
                        g * xp[((n * X.c + ch) * X.h + iy) * X.w + ix];
                }
          }
    for (size_t i = 0; i < acc.size(); i++) blend(dwp, i, al, acc[i], be);
  });
}

cudnnStatus_t cudnnConvolutionBackwardBias(cudnnHandle_t h, const void *alpha,
                                           cudnnTensorDescriptor_t dyd, const void *dy,
                                           const void *beta, cudnnTensorDescriptor_t dbd,
                                           void *db) {
  const char *fn = "cudnnConvolutionBackwardBias";
  if (!dyd || !dbd || dbd->n != 1 || dbd->c != dyd->c || dbd->h != 1 || dbd->w != 1)
    return bad(fn, "the bias tensor must be [1,C,1,1] with dy's C");
  if (!on_device(dy) || !on_device(db)) return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnTensorStruct Y = *dyd;
  return submit(h, fn, [=] {
    const float *dyp = (const float *)dy;
    for (int k = 0; k < Y.c; k++) {
      double s = 0;
      for (int n = 0; n < Y.n; n++)
        for (int i = 0; i < Y.h * Y.w; i++) s += dyp[(size_t)(n * Y.c + k) * Y.h * Y.w + i];
      blend((float *)db, (size_t)k, al, s, be);
    }
  });
}

// ---- elementwise, pooling -----------------------------------------------------------------------

cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t ad,
                             const void *a, const void *beta, cudnnTensorDescriptor_t cd, void *c) {
  const char *fn = "cudnnAddTensor";
  if (!ad || !cd || (ad->n != 1 && ad->n != cd->n) || (ad->c != 1 && ad->c != cd->c) ||
      (ad->h != 1 && ad->h != cd->h) || (ad->w != 1 && ad->w != cd->w))
    return bad(fn, "every dimension of A must be C's or 1");
  if (!on_device(a) || !on_device(c)) return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnTensorStruct A = *ad, Cd = *cd;
  return submit(h, fn, [=] {
    const float *ap = (const float *)a;
    float *cp = (float *)c;
    for (int n = 0; n < Cd.n; n++)
      for (int k = 0; k < Cd.c; k++)
        for (int y = 0; y < Cd.h; y++)
          for (int x = 0; x < Cd.w; x++) {
            const size_t ai = (((size_t)(A.n == 1 ? 0 : n) * A.c + (A.c == 1 ? 0 : k)) * A.h +
                               (A.h == 1 ? 0 : y)) *
                                  A.w +
                              (A.w == 1 ? 0 : x);
            blend(cp, (((size_t)n * Cd.c + k) * Cd.h + y) * Cd.w + x, al, ap[ai], be);
          }
  });
}

cudnnStatus_t cudnnActivationForward(cudnnHandle_t h, cudnnActivationDescriptor_t act,
                                     const void *alpha, cudnnTensorDescriptor_t xd, const void *x,
                                     const void *beta, cudnnTensorDescriptor_t yd, void *y) {
  const char *fn = "cudnnActivationForward";
  if (!act || !xd || !yd || !same_shape(xd, yd)) return bad(fn, "x and y must have one shape");
  if (!on_device(x) || !on_device(y)) return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const size_t n = numel(xd);
  return submit(h, fn, [=] {
    for (size_t i = 0; i < n; i++) {
      const float v = ((const float *)x)[i];
      blend((float *)y, i, al, v > 0.0f ? v : 0.0f, be);
    }
  });
}

cudnnStatus_t cudnnActivationBackward(cudnnHandle_t h, cudnnActivationDescriptor_t act,
                                      const void *alpha, cudnnTensorDescriptor_t yd, const void *y,
                                      cudnnTensorDescriptor_t dyd, const void *dy,
                                      cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                      cudnnTensorDescriptor_t dxd, void *dx) {
  const char *fn = "cudnnActivationBackward";
  if (!act || !yd || !dyd || !xd || !dxd || !same_shape(yd, dyd) || !same_shape(yd, xd) ||
      !same_shape(yd, dxd))
    return bad(fn, "y, dy, x and dx must have one shape");
  if (!on_device(y) || !on_device(dy) || !on_device(x) || !on_device(dx))
    return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const size_t n = numel(xd);
  return submit(h, fn, [=] {
    for (size_t i = 0; i < n; i++) {
      const float g = ((const float *)x)[i] > 0.0f ? ((const float *)dy)[i] : 0.0f;
      blend((float *)dx, i, al, g, be);
    }
  });
}

// The pooled shape of x; false when it does not fit.
static bool pool_out(const cudnnPoolingStruct *p, const cudnnTensorStruct *x,
                     cudnnTensorStruct *y) {
  y->n = x->n, y->c = x->c;
  y->h = (x->h + 2 * p->vpad - p->wh) / p->vs + 1;
  y->w = (x->w + 2 * p->hpad - p->ww) / p->hs + 1;
  return y->h > 0 && y->w > 0;
}

// The element of window (n, c, oy, ox) holding its maximum (the first in row order on ties).
static size_t pool_arg(const cudnnPoolingStruct &p, const cudnnTensorStruct &X, const float *x,
                       int n, int c, int oy, int ox) {
  size_t best = (size_t)-1;
  for (int ky = 0; ky < p.wh; ky++)
    for (int kx = 0; kx < p.ww; kx++) {
      const int iy = oy * p.vs - p.vpad + ky, ix = ox * p.hs - p.hpad + kx;
      if (iy < 0 || iy >= X.h || ix < 0 || ix >= X.w) continue;
      const size_t i = (((size_t)n * X.c + c) * X.h + iy) * X.w + ix;
      if (best == (size_t)-1 || x[i] > x[best]) best = i;
    }
  return best;
}

cudnnStatus_t cudnnPoolingForward(cudnnHandle_t h, cudnnPoolingDescriptor_t p, const void *alpha,
                                  cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                  cudnnTensorDescriptor_t yd, void *y) {
  const char *fn = "cudnnPoolingForward";
  cudnnTensorStruct want;
  if (!p || !xd || !yd || !pool_out(p, xd, &want) || !same_shape(&want, yd))
    return bad(fn, "y's shape does not fit the pooling of x");
  if (!on_device(x) || !on_device(y)) return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnPoolingStruct P = *p;
  const cudnnTensorStruct X = *xd, Y = *yd;
  return submit(h, fn, [=] {
    const float *xp = (const float *)x;
    for (int n = 0; n < Y.n; n++)
      for (int c = 0; c < Y.c; c++)
        for (int oy = 0; oy < Y.h; oy++)
          for (int ox = 0; ox < Y.w; ox++)
            blend((float *)y, (((size_t)n * Y.c + c) * Y.h + oy) * Y.w + ox, al,
                  xp[pool_arg(P, X, xp, n, c, oy, ox)], be);
  });
}

cudnnStatus_t cudnnPoolingBackward(cudnnHandle_t h, cudnnPoolingDescriptor_t p, const void *alpha,
                                   cudnnTensorDescriptor_t yd, const void *y,
                                   cudnnTensorDescriptor_t dyd, const void *dy,
                                   cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                   cudnnTensorDescriptor_t dxd, void *dx) {
  const char *fn = "cudnnPoolingBackward";
  cudnnTensorStruct want;
  if (!p || !yd || !dyd || !xd || !dxd || !pool_out(p, xd, &want) || !same_shape(&want, yd) ||
      !same_shape(yd, dyd) || !same_shape(xd, dxd))
    return bad(fn, "shapes do not fit the pooling");
  if (!on_device(y) || !on_device(dy) || !on_device(x) || !on_device(dx))
    return bad(fn, "a data pointer is not device memory");
  const float al = *(const float *)alpha, be = *(const float *)beta;
  const cudnnPoolingStruct P = *p;
  const cudnnTensorStruct X = *xd, Y = *yd;
  return submit(h, fn, [=] {
    const float *xp = (const float *)x, *dyp = (const float *)dy;
    std::vector<double> acc(numel(&X), 0.0);
    for (int n = 0; n < Y.n; n++)
      for (int c = 0; c < Y.c; c++)
        for (int oy = 0; oy < Y.h; oy++)
          for (int ox = 0; ox < Y.w; ox++)
            acc[pool_arg(P, X, xp, n, c, oy, ox)] +=
                dyp[(((size_t)n * Y.c + c) * Y.h + oy) * Y.w + ox];
    for (size_t i = 0; i < acc.size(); i++) blend((float *)dx, i, al, acc[i], be);
  });
}

// ---- cuBLAS
// --------------------------------------------------------------------------------------

cublasStatus_t cublasCreate(cublasHandle_t *h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  *h = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

// Column-major C (m x n) = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n.
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc) {
  if (!h || !h->stream) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) || lda < 1 ||
      ldb < (tb == CUBLAS_OP_N ? k : n) || ldb < 1 || ldc < m || ldc < 1 || !on_device(a) ||
      !on_device(b) || !on_device(c)) {
    fprintf(stderr, "cublasmock: cublasSgemm: bad dimensions, leading dimensions or pointers\n");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float al = *alpha, be = *beta;
  sg_emu_enqueue(h->stream, [=] {
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) {
        double s = 0;
        for (int l = 0; l < k; l++) {
          const float av = ta == CUBLAS_OP_N ? a[i + (size_t)l * lda] : a[l + (size_t)i * lda];
          const float bv = tb == CUBLAS_OP_N ? b[l + (size_t)j * ldb] : b[j + (size_t)l * ldb];
          s += (double)av * bv;
        }
        blend(c, i + (size_t)j * ldc, al, s, be);
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
