/* cnn_cudnn: a small convolutional network (cnn_model.h) trained on generated images, with
 * cuDNN for the convolutions, bias, ReLU and pooling and cuBLAS for the linear head.
 *
 *   cnn_cudnn --ranks 2 --steps 200 --check      (2 ranks as threads on one GPU, local comm)
 *   mpirun -np 8 cnn_cudnn --nccl                (one GPU per rank, NCCL)
 *   cnn_cudnn --nccl-solo --trace t.json         (one rank, NCCL of world 1, traced)
 *
 * Each rank keeps its activations on the GPU and runs everything on one stream of its own,
 * which cuDNN, cuBLAS and the engine (sg_set_stream) share. The parameters are read where the
 * engine keeps them (sg_param_ptr); every gradient is written by cuDNN or cuBLAS straight into
 * the engine's slot (sg_grad_ptr), fc first, conv1 last, and handed over with sg_grad_ready, so
 * the reductions of the head overlap the backward convolutions and the host waits only to read
 * the loss. --check recomputes the first steps on the CPU (cnn_model.c, double precision) from
 * the same parameters and images and compares the loss and every gradient; it also requires the
 * loss to halve by the end, as examples/mlp's --check does. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (mlp_cli.h) */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef CNN_CUDNN_HAVE_MPI
#include <mpi.h>
#define MLP_GPU_HAVE_MPI
#endif

#include "cnn_cudnn_kernels.h" /* softmax cross-entropy */
#include "cnn_model.h"         /* shapes, data, initial values, the CPU reference */
#include "mlp_cli.h"           /* flags, ranks as threads, result lines, --trace */
#include "mlp_gpu.h"           /* --nccl, --nccl-solo, --gpu */
#include "shardgrad.h"

#define CHECK_STEPS 3       /* --check compares the first 3 steps with the CPU */
#define CHECK_GRAD_TOL 1e-3 /* max |gpu - cpu| <= tol * max |cpu| (Winograd/FFT included) */
#define CHECK_LOSS_TOL 1e-4 /* relative */

typedef struct options {
  mlp_cli c; /* the flags shared with examples/mlp; --hidden and --layers are refused */
  mlp_gpu_flags g;
  int channels;
} options;

/* One convolution layer's descriptors and the algorithms picked for it. */
typedef struct conv_layer {
  cudnnTensorDescriptor_t in, out, bias; /* [N,Ci,H,W], [N,Co,H,W], [1,Co,1,1] */
  cudnnTensorDescriptor_t pooled;        /* [N,Co,H/2,W/2] */
  cudnnFilterDescriptor_t w;             /* [Co,Ci,3,3] */
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
} conv_layer;

typedef struct gpu_net {
  cnn_dims d;
  cudaStream_t stream;
  cudnnHandle_t dnn;
  cublasHandle_t blas;
  cudnnConvolutionDescriptor_t conv; /* 3x3, pad 1, stride 1, f32, FMA math (no TF32) */
  cudnnActivationDescriptor_t relu;
  cudnnPoolingDescriptor_t pool; /* 2x2 max, stride 2 */
  conv_layer l1, l2;
  cudnnTensorDescriptor_t logits_t, fc_bias_t; /* [N,10,1,1], [1,10,1,1] */
  void *ws;
  size_t ws_bytes;
  /* activations (z: conv + bias, a: ReLU, p: pooled) and their gradients */
  float *x, *z1, *a1, *p1, *z2, *a2, *p2, *logits;
  float *dlogits, *dp2, *da2, *dz2, *dp1, *da1, *dz1;
  int *labels;
  float *loss, *loss_host; /* device, one per micro-batch; pinned */
  float *host_x;
  int *host_labels;
  void *params[CNN_NPARAMS];
  int ids[CNN_NPARAMS];
  /* --check: the first micro-batch's images, the parameters it saw, its gradients (pinned) */
  float *chk_x, *chk_params[CNN_NPARAMS], *chk_grads[CNN_NPARAMS];
  int *chk_labels, checking;
} gpu_net;

static int failed(int rank, const char *what, sg_status st) {
  return mlp_cli_failed("cnn_cudnn", rank, what, st);
}

static int cuda_failed(int rank, const char *what, cudaError_t e) {
  fprintf(stderr, "cnn_cudnn: rank %d: %s failed: %s\n", rank, what, cudaGetErrorString(e));
  return 1;
}

static int dnn_failed(int rank, const char *what, cudnnStatus_t s) {
  fprintf(stderr, "cnn_cudnn: rank %d: %s failed: %s\n", rank, what, cudnnGetErrorString(s));
  if (s == CUDNN_STATUS_NOT_INITIALIZED || s == CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED)
    fprintf(stderr,
            "cnn_cudnn: is cuDNN's library directory on LD_LIBRARY_PATH? (libcudnn.so.9 "
            "loads libcudnn_ops/cnn/engines* by name)\n");
  return 1;
}

static int blas_failed(int rank, const char *what, cublasStatus_t s) {
  fprintf(stderr, "cnn_cudnn: rank %d: %s failed: cuBLAS status %d\n", rank, what, (int)s);
  return 1;
}

/* In functions returning int (0 = success) with `rank` in scope. */
#define CU(call)                                                  \
  do {                                                            \
    cudaError_t ce_ = (cudaError_t)(call);                        \
    if (ce_ != cudaSuccess) return cuda_failed(rank, #call, ce_); \
  } while (0)
#define DNN(call)                                                         \
  do {                                                                    \
    cudnnStatus_t ds_ = (call);                                           \
    if (ds_ != CUDNN_STATUS_SUCCESS) return dnn_failed(rank, #call, ds_); \
  } while (0)
#define BLAS(call)                                                          \
  do {                                                                      \
    cublasStatus_t bs_ = (call);                                            \
    if (bs_ != CUBLAS_STATUS_SUCCESS) return blas_failed(rank, #call, bs_); \
  } while (0)
#define SG(call)                                       \
  do {                                                 \
    sg_status st_ = (call);                            \
    if (st_ != SG_OK) return failed(rank, #call, st_); \
  } while (0)

/* ---- descriptors and algorithms ------------------------------------------------------------ */

static cudnnStatus_t tensor4(cudnnTensorDescriptor_t *t, int n, int c, int h, int w) {
  cudnnStatus_t s = cudnnCreateTensorDescriptor(t);
  if (s == CUDNN_STATUS_SUCCESS)
    s = cudnnSetTensor4dDescriptor(*t, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w);
  return s;
}

/* What the three perf structs share, for pick_algo. */
typedef struct algo_cand {
  cudnnStatus_t status;
  cudnnDeterminism_t determinism;
  cudnnMathType_t math;
} algo_cand;

/* A heuristic's pick among its entries (best first): the first that ran, is deterministic (the
 * same gradients on every run) and uses no tensor-op math (no TF32, so that --check holds);
 * else the first that ran without tensor-op math. -1 when none. */
static int pick_algo(const algo_cand *c, int n) {
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < n; i++)
      if (c[i].status == CUDNN_STATUS_SUCCESS && c[i].math != CUDNN_TENSOR_OP_MATH &&
          c[i].math != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
          (pass == 1 || c[i].determinism == CUDNN_DETERMINISTIC))
        return i;
  return -1;
}

enum { kMaxAlgos = 16 };

/* The three algorithms of layer l (input in, output out) and the workspace they need. */
static int pick_algos(gpu_net *g, conv_layer *l, size_t *ws, int rank) {
  cudnnConvolutionFwdAlgoPerf_t fp[kMaxAlgos];
  cudnnConvolutionBwdDataAlgoPerf_t dp[kMaxAlgos];
  cudnnConvolutionBwdFilterAlgoPerf_t wp[kMaxAlgos];
  int nf = 0, nd = 0, nw = 0;
  size_t b = 0;
  *ws = 0;
  DNN(cudnnGetConvolutionForwardAlgorithm_v7(g->dnn, l->in, l->w, g->conv, l->out, kMaxAlgos, &nf,
                                             fp));
  DNN(cudnnGetConvolutionBackwardDataAlgorithm_v7(g->dnn, l->w, l->out, g->conv, l->in, kMaxAlgos,
                                                  &nd, dp));
  DNN(cudnnGetConvolutionBackwardFilterAlgorithm_v7(g->dnn, l->in, l->out, g->conv, l->w, kMaxAlgos,
                                                    &nw, wp));
  algo_cand cf[kMaxAlgos], cd[kMaxAlgos], cw[kMaxAlgos];
  for (int i = 0; i < nf; i++) cf[i] = (algo_cand){fp[i].status, fp[i].determinism, fp[i].mathType};
  for (int i = 0; i < nd; i++) cd[i] = (algo_cand){dp[i].status, dp[i].determinism, dp[i].mathType};
  for (int i = 0; i < nw; i++) cw[i] = (algo_cand){wp[i].status, wp[i].determinism, wp[i].mathType};
  const int f = pick_algo(cf, nf), dd = pick_algo(cd, nd), w = pick_algo(cw, nw);
  if (f < 0 || dd < 0 || w < 0) {
    fprintf(stderr,
            "cnn_cudnn: rank %d: cuDNN offers no usable FMA algorithm (forward %d, "
            "backward data %d, backward filter %d candidates)\n",
            rank, nf, nd, nw);
    return 1;
  }
  l->fwd = fp[f].algo;
  l->bwd_data = dp[dd].algo;
  l->bwd_filter = wp[w].algo;
  DNN(cudnnGetConvolutionForwardWorkspaceSize(g->dnn, l->in, l->w, g->conv, l->out, l->fwd, &b));
  *ws = b > *ws ? b : *ws;
  DNN(cudnnGetConvolutionBackwardDataWorkspaceSize(g->dnn, l->w, l->out, g->conv, l->in,
                                                   l->bwd_data, &b));
  *ws = b > *ws ? b : *ws;
  DNN(cudnnGetConvolutionBackwardFilterWorkspaceSize(g->dnn, l->in, l->out, g->conv, l->w,
                                                     l->bwd_filter, &b));
  *ws = b > *ws ? b : *ws;
  return 0;
}

/* Layer with ci -> co channels on hw x hw images; checks cuDNN's output shape against ours. */
static int layer_init(gpu_net *g, conv_layer *l, int ci, int co, int hw, int rank) {
  const int n = g->d.batch;
  int on = 0, oc = 0, oh = 0, ow = 0;
  DNN(tensor4(&l->in, n, ci, hw, hw));
  DNN(tensor4(&l->out, n, co, hw, hw));
  DNN(tensor4(&l->bias, 1, co, 1, 1));
  DNN(tensor4(&l->pooled, n, co, hw / 2, hw / 2));
  DNN(cudnnCreateFilterDescriptor(&l->w));
  DNN(cudnnSetFilter4dDescriptor(l->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, co, ci, 3, 3));
  DNN(cudnnGetConvolution2dForwardOutputDim(g->conv, l->in, l->w, &on, &oc, &oh, &ow));
  if (on != n || oc != co || oh != hw || ow != hw) {
    fprintf(stderr,
            "cnn_cudnn: rank %d: cuDNN's conv output is [%d,%d,%d,%d], expected "
            "[%d,%d,%d,%d]\n",
            rank, on, oc, oh, ow, n, co, hw, hw);
    return 1;
  }
  return 0;
}

/* Descriptors that were created (a failed setup leaves the rest NULL). */
#define DESTROY(fn, d)  \
  do {                  \
    if (d) (void)fn(d); \
  } while (0)

static void layer_free(conv_layer *l) {
  DESTROY(cudnnDestroyTensorDescriptor, l->in);
  DESTROY(cudnnDestroyTensorDescriptor, l->out);
  DESTROY(cudnnDestroyTensorDescriptor, l->bias);
  DESTROY(cudnnDestroyTensorDescriptor, l->pooled);
  DESTROY(cudnnDestroyFilterDescriptor, l->w);
}

static int descriptors_init(gpu_net *g, int rank) {
  DNN(cudnnCreateConvolutionDescriptor(&g->conv));
  DNN(cudnnSetConvolution2dDescriptor(g->conv, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                      CUDNN_DATA_FLOAT));
  DNN(cudnnSetConvolutionMathType(g->conv, CUDNN_FMA_MATH));
  DNN(cudnnCreateActivationDescriptor(&g->relu));
  DNN(cudnnSetActivationDescriptor(g->relu, CUDNN_ACTIVATION_RELU, CUDNN_PROPAGATE_NAN, 0.0));
  DNN(cudnnCreatePoolingDescriptor(&g->pool));
  DNN(cudnnSetPooling2dDescriptor(g->pool, CUDNN_POOLING_MAX_DETERMINISTIC, CUDNN_PROPAGATE_NAN, 2,
                                  2, 0, 0, 2, 2));
  if (layer_init(g, &g->l1, 1, g->d.c1, CNN_IMG, rank) ||
      layer_init(g, &g->l2, g->d.c1, g->d.c2, CNN_IMG / 2, rank))
    return 1;
  DNN(tensor4(&g->logits_t, g->d.batch, CNN_CLASSES, 1, 1));
  DNN(tensor4(&g->fc_bias_t, 1, CNN_CLASSES, 1, 1));
  size_t w1 = 0, w2 = 0;
  if (pick_algos(g, &g->l1, &w1, rank) || pick_algos(g, &g->l2, &w2, rank)) return 1;
  g->ws_bytes = w1 > w2 ? w1 : w2;
  if (g->ws_bytes) CU(cudaMalloc(&g->ws, g->ws_bytes));
  return 0;
}

/* ---- buffers --------------------------------------------------------------------------------- */

static cudaError_t dev_floats(float **p, size_t n) {
  return cudaMalloc((void **)p, n * sizeof(float));
}

static int buffers_init(gpu_net *g, int micro, int rank) {
  const size_t n = (size_t)g->d.batch, s1 = (size_t)CNN_IMG * CNN_IMG, s2 = s1 / 4, s3 = s1 / 16;
  const size_t c1 = (size_t)g->d.c1, c2 = (size_t)g->d.c2;
  float **one[] = {&g->z1, &g->a1, &g->da1, &g->dz1};
  float **two[] = {&g->z2, &g->a2, &g->da2, &g->dz2};
  CU(dev_floats(&g->x, n * s1));
  for (size_t i = 0; i < 4; i++) CU(dev_floats(one[i], n * c1 * s1));
  CU(dev_floats(&g->p1, n * c1 * s2));
  CU(dev_floats(&g->dp1, n * c1 * s2));
  for (size_t i = 0; i < 4; i++) CU(dev_floats(two[i], n * c2 * s2));
  CU(dev_floats(&g->p2, n * c2 * s3));
  CU(dev_floats(&g->dp2, n * c2 * s3));
  CU(dev_floats(&g->logits, n * CNN_CLASSES));
  CU(dev_floats(&g->dlogits, n * CNN_CLASSES));
  CU(cudaMalloc((void **)&g->labels, n * sizeof(int)));
  CU(dev_floats(&g->loss, (size_t)micro));
  CU(cudaMallocHost((void **)&g->loss_host, (size_t)micro * sizeof(float)));
  g->host_x = malloc(n * s1 * sizeof(float));
  g->host_labels = malloc(n * sizeof(int));
  g->chk_x = malloc(n * s1 * sizeof(float));
  g->chk_labels = malloc(n * sizeof(int));
  if (!g->host_x || !g->host_labels || !g->chk_x || !g->chk_labels)
    return cuda_failed(rank, "host buffers", cudaErrorMemoryAllocation);
  for (int p = 0; p < CNN_NPARAMS; p++) {
    CU(cudaMallocHost((void **)&g->chk_grads[p], g->d.numel[p] * sizeof(float)));
    g->chk_params[p] = malloc(g->d.numel[p] * sizeof(float));
    if (!g->chk_params[p]) return cuda_failed(rank, "host buffers", cudaErrorMemoryAllocation);
  }
  return 0;
}

static void net_free(gpu_net *g) {
  float *dev[] = {g->x,       g->z1,  g->a1,  g->p1,  g->z2,  g->a2,  g->p2,  g->logits,
                  g->dlogits, g->dp2, g->da2, g->dz2, g->dp1, g->da1, g->dz1, g->loss};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
  cudaFree(g->labels), cudaFree(g->ws), cudaFreeHost(g->loss_host);
  free(g->host_x), free(g->host_labels), free(g->chk_x), free(g->chk_labels);
  for (int p = 0; p < CNN_NPARAMS; p++) cudaFreeHost(g->chk_grads[p]), free(g->chk_params[p]);
  if (g->dnn) {
    layer_free(&g->l1), layer_free(&g->l2);
    DESTROY(cudnnDestroyTensorDescriptor, g->logits_t);
    DESTROY(cudnnDestroyTensorDescriptor, g->fc_bias_t);
    DESTROY(cudnnDestroyConvolutionDescriptor, g->conv);
    DESTROY(cudnnDestroyActivationDescriptor, g->relu);
    DESTROY(cudnnDestroyPoolingDescriptor, g->pool);
    cudnnDestroy(g->dnn);
  }
  if (g->blas) cublasDestroy(g->blas);
  if (g->stream) cudaStreamDestroy(g->stream);
  memset(g, 0, sizeof *g);
}

/* Registers the six parameters (cnn_model.h order), finalizes, sets the initial values and
 * fetches their device pointers. */
static int params_init(gpu_net *g, sg_engine *e, uint64_t seed, int rank) {
  for (int p = 0; p < CNN_NPARAMS; p++)
    SG(sg_add_param(e, g->d.names[p], g->d.numel[p], p % 2 ? SG_PARAM_NO_DECAY : 0u, &g->ids[p]));
  SG(sg_finalize(e));
  for (int p = 0; p < CNN_NPARAMS; p++) {
    float *v = malloc(g->d.numel[p] * sizeof(float));
    if (!v) return failed(rank, "malloc", SG_ERR_OUT_OF_MEMORY);
    cnn_init_param(&g->d, seed, p, v);
    const sg_status st = sg_set_param(e, g->ids[p], v, SG_F32);
    free(v);
    if (st != SG_OK) return failed(rank, "sg_set_param", st);
    SG(sg_param_ptr(e, g->ids[p], &g->params[p]));
  }
  return 0;
}

/* ---- forward and backward -------------------------------------------------------------------- */

static const float kOne = 1.0f, kZero = 0.0f;

/* z = conv(in, w) + b; a = ReLU(z); p = maxpool(a). */
static int conv_forward(gpu_net *g, const conv_layer *l, const float *in, const void *w,
                        const void *b, float *z, float *a, float *p, int rank) {
  DNN(cudnnConvolutionForward(g->dnn, &kOne, l->in, in, l->w, w, g->conv, l->fwd, g->ws,
                              g->ws_bytes, &kZero, l->out, z));
  DNN(cudnnAddTensor(g->dnn, &kOne, l->bias, b, &kOne, l->out, z));
  DNN(cudnnActivationForward(g->dnn, g->relu, &kOne, l->out, z, &kZero, l->out, a));
  DNN(cudnnPoolingForward(g->dnn, g->pool, &kOne, l->out, a, &kZero, l->pooled, p));
  return 0;
}

/* The parameters are the engine's (sg_param_ptr); --overlap-gather waits on the stream for
 * each one's all-gather first. logits = p2 W^T + b: row-major p2 [N, feat] is column-major
 * feat x N and W [10, feat] column-major feat x 10, so logits^T = W^T p2^T is
 * gemm(T, N, 10, N, feat). */
static int forward(gpu_net *g, sg_engine *e, int rank) {
  for (int p = 0; p < CNN_NPARAMS; p++) SG(sg_param_wait(e, g->ids[p]));
  if (conv_forward(g, &g->l1, g->x, g->params[0], g->params[1], g->z1, g->a1, g->p1, rank) ||
      conv_forward(g, &g->l2, g->p1, g->params[2], g->params[3], g->z2, g->a2, g->p2, rank))
    return 1;
  const int n = g->d.batch, f = g->d.feat;
  BLAS(cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, CNN_CLASSES, n, f, &kOne, g->params[4], f,
                   g->p2, f, &kZero, g->logits, CNN_CLASSES));
  DNN(cudnnAddTensor(g->dnn, &kOne, g->fc_bias_t, g->params[5], &kOne, g->logits_t, g->logits));
  return 0;
}

/* The gradient of parameter p is in its slot: (--check) a copy for the comparison, then it is
 * the engine's. */
static int grad_done(gpu_net *g, sg_engine *e, int p, const void *slot, int rank) {
  if (g->checking)
    CU(cudaMemcpyAsync(g->chk_grads[p], slot, g->d.numel[p] * sizeof(float), cudaMemcpyDeviceToHost,
                       g->stream));
  SG(sg_grad_ready(e, g->ids[p]));
  return 0;
}

/* Slot of parameter p. */
static int slot_of(sg_engine *e, const gpu_net *g, int p, void **slot, int rank) {
  SG(sg_grad_ptr(e, g->ids[p], slot));
  return 0;
}

/* Through ReLU and pooling back to dz, then the layer's bias and filter gradients into their
 * slots (bias first), and (din != NULL) the gradient of its input. */
static int conv_backward(gpu_net *g, sg_engine *e, const conv_layer *l, int pw, const float *in,
                         const float *z, const float *a, const float *p, const float *dp, float *da,
                         float *dz, float *din, int rank) {
  void *slot = NULL;
  DNN(cudnnPoolingBackward(g->dnn, g->pool, &kOne, l->pooled, p, l->pooled, dp, l->out, a, &kZero,
                           l->out, da));
  DNN(cudnnActivationBackward(g->dnn, g->relu, &kOne, l->out, a, l->out, da, l->out, z, &kZero,
                              l->out, dz));
  if (slot_of(e, g, pw + 1, &slot, rank)) return 1;
  DNN(cudnnConvolutionBackwardBias(g->dnn, &kOne, l->out, dz, &kZero, l->bias, slot));
  if (grad_done(g, e, pw + 1, slot, rank) || slot_of(e, g, pw, &slot, rank)) return 1;
  DNN(cudnnConvolutionBackwardFilter(g->dnn, &kOne, l->in, in, l->out, dz, g->conv, l->bwd_filter,
                                     g->ws, g->ws_bytes, &kZero, l->w, slot));
  if (grad_done(g, e, pw, slot, rank)) return 1;
  if (din)
    DNN(cudnnConvolutionBackwardData(g->dnn, &kOne, l->w, g->params[pw], l->out, dz, g->conv,
                                     l->bwd_data, g->ws, g->ws_bytes, &kZero, l->in, din));
  return 0;
}

/* From dlogits: fc.bias = column sums (cuDNN's bias gradient over [N,10,1,1]), fc.weight =
 * dlogits^T p2, column-major feat x 10 = p2^T dlogits (gemm(N, T, feat, 10, N)), and
 * dp2 = dlogits W, column-major feat x N = W dlogits^T (gemm(N, N, feat, N, 10)). */
static int backward(gpu_net *g, sg_engine *e, int rank) {
  const int n = g->d.batch, f = g->d.feat;
  void *slot = NULL;
  if (slot_of(e, g, 5, &slot, rank)) return 1;
  DNN(cudnnConvolutionBackwardBias(g->dnn, &kOne, g->logits_t, g->dlogits, &kZero, g->fc_bias_t,
                                   slot));
  if (grad_done(g, e, 5, slot, rank) || slot_of(e, g, 4, &slot, rank)) return 1;
  BLAS(cublasSgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, f, CNN_CLASSES, n, &kOne, g->p2, f,
                   g->dlogits, CNN_CLASSES, &kZero, slot, f));
  if (grad_done(g, e, 4, slot, rank)) return 1;
  BLAS(cublasSgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, f, n, CNN_CLASSES, &kOne, g->params[4], f,
                   g->dlogits, CNN_CLASSES, &kZero, g->dp2, f));
  if (conv_backward(g, e, &g->l2, 2, g->p1, g->z2, g->a2, g->p2, g->dp2, g->da2, g->dz2, g->dp1,
                    rank))
    return 1;
  return conv_backward(g, e, &g->l1, 0, g->x, g->z1, g->a1, g->p1, g->dp1, g->da1, g->dz1, NULL,
                       rank);
}

/* One micro-batch: the rank's slice of the image stream, forward, loss into g->loss[mb],
 * backward with the gradients of scale * (mean loss) into the engine. */
static int micro_batch(gpu_net *g, sg_engine *e, const options *o, int step, int mb, int rank,
                       int world, float scale) {
  const uint64_t slot = ((uint64_t)step * (uint64_t)o->c.micro + (uint64_t)mb) * (uint64_t)world;
  const size_t nx = (size_t)g->d.batch * CNN_IMG * CNN_IMG;
  cnn_make_batch(&g->d, o->c.seed, (slot + (uint64_t)rank) * (uint64_t)g->d.batch, g->host_x,
                 g->host_labels);
  if (g->checking) {
    memcpy(g->chk_x, g->host_x, nx * sizeof(float));
    memcpy(g->chk_labels, g->host_labels, (size_t)g->d.batch * sizeof(int));
  }
  /* pageable sources: the copies are staged before they return, so the host may refill */
  CU(cudaMemcpyAsync(g->x, g->host_x, nx * sizeof(float), cudaMemcpyHostToDevice, g->stream));
  CU(cudaMemcpyAsync(g->labels, g->host_labels, (size_t)g->d.batch * sizeof(int),
                     cudaMemcpyHostToDevice, g->stream));
  if (forward(g, e, rank)) return 1;
  CU(cnnk_softmax_xent(g->stream, g->logits, g->labels, g->d.batch, CNN_CLASSES,
                       scale / (float)g->d.batch, g->dlogits, g->loss + mb));
  return backward(g, e, rank);
}

/* ---- --check ------------------------------------------------------------------------------- */

/* max |a - b| / max |b| over n values (0 when b is all zeros and a equals it). */
static double rel_err(const float *a, const double *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    const double d = fabs((double)a[i] - b[i]);
    num = d > num || d != d ? d : num;
    den = fabs(b[i]) > den ? fabs(b[i]) : den;
  }
  return den > 0 ? num / den : num;
}

/* The first micro-batch of this step on the CPU, from the parameters it saw; 0 when the GPU's
 * loss and every gradient agree, 2 when not (printed by every rank that disagrees). */
static int compare_with_cpu(gpu_net *g, int step, float scale, int rank) {
  double *ref[CNN_NPARAMS] = {0}, loss = 0;
  int rc = 0;
  for (int p = 0; p < CNN_NPARAMS && rc == 0; p++)
    if (!(ref[p] = malloc(g->d.numel[p] * sizeof(double)))) rc = 1;
  if (rc == 0 && cnn_ref_step(&g->d, (const float *const *)g->chk_params, g->chk_x, g->chk_labels,
                              scale, &loss, ref) != 0)
    rc = 1;
  if (rc) {
    fprintf(stderr, "cnn_cudnn: rank %d: --check: out of host memory\n", rank);
  } else {
    char line[512];
    int len = snprintf(line, sizeof line, "check step %d rank %d: loss gpu %.7f cpu %.7f;", step,
                       rank, (double)g->loss_host[0], loss);
    const double le = fabs((double)g->loss_host[0] - loss) / fabs(loss);
    int bad = !(le <= CHECK_LOSS_TOL);
    for (int p = 0; p < CNN_NPARAMS; p++) {
      const double err = rel_err(g->chk_grads[p], ref[p], g->d.numel[p]);
      bad |= !(err <= CHECK_GRAD_TOL);
      if (len < (int)sizeof line)
        len += snprintf(line + len, sizeof line - (size_t)len, " %s %.1e", g->d.names[p], err);
    }
    if (rank == 0 || bad) printf("%s%s\n", line, bad ? "  MISMATCH" : "");
    rc = bad ? 2 : 0;
  }
  for (int p = 0; p < CNN_NPARAMS; p++) free(ref[p]);
  return rc;
}

/* Before a checked step: the parameters as the engine has them (all ranks alike). */
static int save_params(gpu_net *g, sg_engine *e, int rank) {
  for (int p = 0; p < CNN_NPARAMS; p++) SG(sg_get_param(e, g->ids[p], g->chk_params[p], SG_F32));
  return 0;
}

/* ---- training ------------------------------------------------------------------------------- */

static int setup(gpu_net *g, sg_engine *e, const options *o, int gpu, int rank) {
  CU(cudaSetDevice(gpu));
  CU(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
  DNN(cudnnCreate(&g->dnn));
  DNN(cudnnSetStream(g->dnn, g->stream));
  BLAS(cublasCreate(&g->blas));
  BLAS(cublasSetStream(g->blas, g->stream));
  SG(sg_set_stream(e, g->stream));
  if (descriptors_init(g, rank) || buffers_init(g, o->c.micro, rank)) return 1;
  return params_init(g, e, o->c.seed, rank);
}

static int read_loss(gpu_net *g, int micro, int rank, float *loss) {
  CU(cudaMemcpyAsync(g->loss_host, g->loss, (size_t)micro * sizeof(float), cudaMemcpyDeviceToHost,
                     g->stream));
  CU(cudaStreamSynchronize(g->stream));
  float s = 0.0f;
  for (int i = 0; i < micro; i++) s += g->loss_host[i];
  *loss = s / (float)micro;
  return 0;
}

static void print_header(const options *o, const gpu_net *g, const sg_memory_stats *mem,
                         const sg_memory_stats *ddp, int world, int gpu) {
  struct cudaDeviceProp prop;
  const int have_prop = cudaGetDeviceProperties(&prop, gpu) == cudaSuccess;
  size_t total = 0;
  for (int p = 0; p < CNN_NPARAMS; p++) total += g->d.numel[p];
  printf(
      "cnn_cudnn: %s, W=%d (%s), conv %d-%d channels + linear, %zu params, batch %d x %d "
      "micro-batch(es) per rank, GPU %d (%s), cuDNN %zu, workspace %zu bytes\n",
      mlp_cli_strategy_name(o->c.strategy), world,
      o->g.nccl || o->g.nccl_solo ? "NCCL" : "threads on one GPU", g->d.c1, g->d.c2, total, o->c.batch,
      o->c.micro, gpu, have_prop ? prop.name : "?", cudnnGetVersion(), g->ws_bytes);
  mlp_cli_print_memory(mem, ddp);
}

/* One step: the micro-batches, sg_step, the loss; --check compares its first micro-batch. */
static int train_step(gpu_net *g, sg_engine *e, const options *o, int step, int rank, int world,
                      float *loss, sg_step_info *info) {
  float scale = 1.0f;
  SG(sg_get_loss_scale(e, &scale));
  SG(mlp_cli_trace_step(&o->c, e, step, 0));
  g->checking = o->c.check && step < CHECK_STEPS;
  if (g->checking && save_params(g, e, rank)) return 1;
  for (int mb = 0; mb < o->c.micro; mb++) {
    SG(mlp_cli_trace_micro(&o->c, e, step, 0));
    if (micro_batch(g, e, o, step, mb, rank, world, scale / (float)o->c.micro)) return 1;
    g->checking = 0; /* the first micro-batch only */
    SG(sg_backward_end(e));
  }
  SG(sg_step(e, info));
  if (read_loss(g, o->c.micro, rank, loss)) return 1;
  if (o->c.check && step < CHECK_STEPS)
    return compare_with_cpu(g, step, scale / (float)o->c.micro, rank);
  return 0;
}

static void *train(void *arg) {
  mlp_rank_run *r = arg;
  const options *o = r->o;
  const int rank = sg_comm_rank(r->comm), world = sg_comm_size(r->comm);
  sg_engine *e = NULL;
  gpu_net g;
  memset(&g, 0, sizeof g);
  cnn_dims_init(&g.d, o->c.batch, o->channels);
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st == SG_OK) {
    mlp_cli_config(&o->c, &cfg);
    cfg.device = SG_DEVICE_CUDA;
    cfg.cuda_device = r->gpu;
    /* The engine first: on a machine without a GPU it fails here with the library's message. */
    st = sg_engine_create(r->comm, &cfg, &e);
  }
  if (st != SG_OK) {
    r->rc = failed(rank, "sg_engine_create", st);
    return NULL;
  }
  r->rc = setup(&g, e, o, r->gpu, rank);
  sg_memory_stats mem = {.struct_size = sizeof mem}, ddp = {.struct_size = sizeof ddp};
  if (r->rc == 0) {
    sg_config ddp_cfg = cfg;
    ddp_cfg.strategy = SG_NO_SHARD;
    if ((st = sg_memory(e, &mem)) == SG_OK)
      st = sg_estimate_memory(&ddp_cfg, g.d.numel, CNN_NPARAMS, world, &ddp);
    if (st != SG_OK) r->rc = failed(rank, "sg_memory", st);
  }
  if (r->rc == 0 && rank == 0) print_header(o, &g, &mem, &ddp, world, r->gpu);
  float first = 0.0f, last = 0.0f;
  int skipped = 0, mismatch = 0;
  const double t_start = mlp_cli_now_s();
  for (int step = 0; step < o->c.steps && r->rc == 0; step++) {
    const double t0 = mlp_cli_now_s();
    sg_step_info info = {.struct_size = sizeof info};
    const int rc = train_step(&g, e, o, step, rank, world, &last, &info);
    if (rc == 2)
      mismatch = 1;
    else if (rc)
      r->rc = rc;
    if (step == 0) first = last;
    skipped += info.skipped;
    if (rank == 0 && (step % o->c.log_every == 0 || step == o->c.steps - 1))
      printf("step %5d  loss %.6f  grad_norm %.5f  %.1f steps/s%s\n", step, (double)last,
             (double)info.grad_norm, 1.0 / (mlp_cli_now_s() - t0),
             info.skipped ? "  (skipped: non-finite gradients)" : "");
  }
  if (r->rc == 0 && (st = mlp_cli_trace_finish(&o->c, e, rank)) != SG_OK)
    r->rc = failed(rank, "--trace", st);
  if (r->rc == 0 && rank == 0) {
    const double rate = (double)o->c.steps / (mlp_cli_now_s() - t_start);
    r->rc = mlp_cli_report("cnn_cudnn", &o->c, first, last, o->c.steps, rate, world, &mem, &ddp,
                           skipped);
  }
  if (r->rc == 0 && mismatch) {
    fprintf(stderr,
            "cnn_cudnn: rank %d: --check failed: the GPU's loss or gradients differ from "
            "the CPU reference (see the check lines)\n",
            rank);
    r->rc = 2;
  } else if (r->rc == 0 && o->c.check && rank == 0) {
    printf(
        "check: the first %d steps match the CPU reference (loss within %.0e, gradients within "
        "%.0e of their largest value) on every rank\n",
        o->c.steps < CHECK_STEPS ? o->c.steps : CHECK_STEPS, CHECK_LOSS_TOL, CHECK_GRAD_TOL);
  }
  if (g.stream) (void)cudaStreamSynchronize(g.stream); /* our kernels may still read buffers */
  sg_engine_destroy(e);
  net_free(&g);
  return NULL;
}

/* ---- command line --------------------------------------------------------------------------- */

static void usage(void) {
  const mlp_cli d = mlp_cli_defaults();
  printf(
      "usage: cnn_cudnn [options]: a small CNN with cuDNN convolutions and a cuBLAS head\n"
      "  --ranks N           ranks as threads on GPU G (local communicator), 1..64 (default %d)\n"
      "  --nccl              one rank per process under mpirun, one GPU each (NCCL)\n"
      "  --nccl-solo         one rank on GPU G over an NCCL communicator of world 1\n"
      "  --gpu G             the GPU of --ranks and --nccl-solo (default 0)\n"
      "  --channels C        conv1 has C output channels, conv2 2C, 1..256 (default 8)\n"
      "  --strategy S        no_shard, shard_opt (ZeRO-1) or shard_grad_op (ZeRO-2) (default %s)\n"
      "  --steps N           optimizer steps (default %d)\n"
      "  --micro-batches N   micro-batches per step, gradients summed (default %d)\n"
      "  --batch N           images per rank per micro-batch (default %d)\n"
      "  --bucket-mb X       gradient bucket size in MiB (default %g)\n"
      "  --lr X              AdamW learning rate (default %g)\n"
      "  --clip X            clip the global gradient norm to X, 0: off (default %g)\n"
      "  --seed N            seed of the initial values and the images (default %llu)\n"
      "  --log-every N       print every N steps (default %d; first and last always)\n"
      "  --check             the first %d steps against the CPU reference (loss and every\n"
      "                      gradient), and exit 2 unless the final loss is below half the first\n"
      "  --trace FILE        Chrome trace of the steps after the first, per rank (%%r: the rank)\n"
      "  --overlap-gather    each parameter's first use waits for its own all-gather\n"
      "  --help              this text\n"
      "f32 only (--dtype f32).\n",
      d.ranks, mlp_cli_strategy_flag(d.strategy), d.steps, d.micro, d.batch, d.bucket_mb,
      (double)mlp_cli_default_lr(d.hidden), (double)d.clip, (unsigned long long)d.seed, d.log_every,
      CHECK_STEPS);
}

static int switch_flag(void *opts, const char *flag) {
  return mlp_gpu_switch_flag(&((options *)opts)->g, flag);
}

static int value_flag(void *opts, const char *flag, const char *v, int *bad) {
  options *o = opts;
  if (!strcmp(flag, "--gpu"))
    *bad = mlp_cli_parse_int(v, 0, 1023, &o->g.gpu) != 0;
  else if (!strcmp(flag, "--channels"))
    *bad = mlp_cli_parse_int(v, 1, 256, &o->channels) != 0;
  else
    return 0;
  return 1;
}

/* f32 only (the cuDNN descriptors here are f32); --hidden and --layers are the MLP's. */
static const mlp_cli_prog *prog_info(void) {
  static const char *const values[] = {"--gpu", "a GPU index in 0..1023", "--channels",
                                       "an integer in 1..256", NULL};
  static const mlp_cli_prog prog = {.name = "cnn_cudnn",
                                    .max_ranks = 64,
                                    .n_dtypes = 1,
                                    .usage = usage,
                                    .switch_flag = switch_flag,
                                    .value_flag = value_flag,
                                    .value_flags = values};
  return &prog;
}

/* Under mpirun or srun only --nccl makes the processes one training. */
static int parse_args(int argc, char **argv, options *o) {
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--hidden") || !strcmp(argv[i], "--layers")) {
      fprintf(stderr, "cnn_cudnn: %s is an MLP flag; this network's width is --channels\n",
              argv[i]);
      return -1;
    }
  memset(o, 0, sizeof *o);
  o->channels = 8;
  if (mlp_cli_parse(prog_info(), argc, argv, &o->c, o) != 0) return -1;
  return mlp_gpu_check_launch("cnn_cudnn", &o->g, &o->c);
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) return 64;
  setvbuf(stdout, NULL, _IOLBF, 0);
  return mlp_gpu_run("cnn_cudnn", &o, &o.g, o.c.ranks, train);
}
