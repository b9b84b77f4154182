/* A mock of the part of cuDNN's legacy API that examples/cnn_cudnn uses, over the mock CUDA
 * runtime (cuda_runtime.h here): descriptors are plain structs, every operation is queued on the
 * handle's stream and computed on the host with cuDNN's documented semantics (NCHW f32,
 * y = alpha * op(x) + beta * y). It checks what a real cuDNN would refuse or what would give
 * garbage on a GPU: shapes that do not fit together, host pointers, a workspace smaller than the
 * algorithm asked for. Only tests/cuda.cmake's mock targets see this header. */
#ifndef SG_CUDNNMOCK_H
#define SG_CUDNNMOCK_H

#include <stddef.h> /* size_t */

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  CUDNN_STATUS_SUCCESS = 0,
  CUDNN_STATUS_NOT_INITIALIZED = 1001,
  CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED = 1008,
  CUDNN_STATUS_BAD_PARAM = 2000,
  CUDNN_STATUS_NOT_SUPPORTED = 3000
} cudnnStatus_t;

typedef enum { CUDNN_TENSOR_NCHW = 0 } cudnnTensorFormat_t;
typedef enum { CUDNN_DATA_FLOAT = 0 } cudnnDataType_t;
typedef enum { CUDNN_CONVOLUTION = 0, CUDNN_CROSS_CORRELATION = 1 } cudnnConvolutionMode_t;
typedef enum {
  CUDNN_DEFAULT_MATH = 0,
  CUDNN_TENSOR_OP_MATH = 1,
  CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION = 2,
  CUDNN_FMA_MATH = 3
} cudnnMathType_t;
typedef enum { CUDNN_NON_DETERMINISTIC = 0, CUDNN_DETERMINISTIC = 1 } cudnnDeterminism_t;
typedef enum { CUDNN_NOT_PROPAGATE_NAN = 0, CUDNN_PROPAGATE_NAN = 1 } cudnnNanPropagation_t;
typedef enum { CUDNN_ACTIVATION_RELU = 1 } cudnnActivationMode_t;
typedef enum { CUDNN_POOLING_MAX = 0, CUDNN_POOLING_MAX_DETERMINISTIC = 3 } cudnnPoolingMode_t;
typedef int cudnnConvolutionFwdAlgo_t;
typedef int cudnnConvolutionBwdDataAlgo_t;
typedef int cudnnConvolutionBwdFilterAlgo_t;

typedef struct cudnnContext *cudnnHandle_t;
typedef struct cudnnTensorStruct *cudnnTensorDescriptor_t;
typedef struct cudnnFilterStruct *cudnnFilterDescriptor_t;
typedef struct cudnnConvolutionStruct *cudnnConvolutionDescriptor_t;
typedef struct cudnnActivationStruct *cudnnActivationDescriptor_t;
typedef struct cudnnPoolingStruct *cudnnPoolingDescriptor_t;

#define SG_CUDNNMOCK_PERF(name, algo_t) \
  typedef struct name {                 \
    algo_t algo;                        \
    cudnnStatus_t status;               \
    float time;                         \
    size_t memory;                      \
    cudnnDeterminism_t determinism;     \
    cudnnMathType_t mathType;           \
    int reserved[3];                    \
  } name
SG_CUDNNMOCK_PERF(cudnnConvolutionFwdAlgoPerf_t, cudnnConvolutionFwdAlgo_t);
SG_CUDNNMOCK_PERF(cudnnConvolutionBwdDataAlgoPerf_t, cudnnConvolutionBwdDataAlgo_t);
SG_CUDNNMOCK_PERF(cudnnConvolutionBwdFilterAlgoPerf_t, cudnnConvolutionBwdFilterAlgo_t);

const char *cudnnGetErrorString(cudnnStatus_t s);
size_t cudnnGetVersion(void);
cudnnStatus_t cudnnCreate(cudnnHandle_t *h);
cudnnStatus_t cudnnDestroy(cudnnHandle_t h);
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s);

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *t);
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t t, cudnnTensorFormat_t f,
                                         cudnnDataType_t dt, int n, int c, int h, int w);
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t t);
cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *f);
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t f, cudnnDataType_t dt,
                                         cudnnTensorFormat_t fmt, int k, int c, int h, int w);
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t f);
cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *c);
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t c, int pad_h, int pad_w,
                                              int u, int v, int dil_h, int dil_w,
                                              cudnnConvolutionMode_t mode, cudnnDataType_t dt);
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t c, cudnnMathType_t m);
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t c);
cudnnStatus_t cudnnGetConvolution2dForwardOutputDim(cudnnConvolutionDescriptor_t c,
                                                    cudnnTensorDescriptor_t x,
                                                    cudnnFilterDescriptor_t w, int *n, int *ch,
                                                    int *h, int *wd);
cudnnStatus_t cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t *a);
cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t a, cudnnActivationMode_t m,
                                           cudnnNanPropagation_t nan, double coef);
cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t a);
cudnnStatus_t cudnnCreatePoolingDescriptor(cudnnPoolingDescriptor_t *p);
cudnnStatus_t cudnnSetPooling2dDescriptor(cudnnPoolingDescriptor_t p, cudnnPoolingMode_t m,
                                          cudnnNanPropagation_t nan, int wh, int ww, int vpad,
                                          int hpad, int vstride, int hstride);
cudnnStatus_t cudnnDestroyPoolingDescriptor(cudnnPoolingDescriptor_t p);

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                     cudnnFilterDescriptor_t w,
                                                     cudnnConvolutionDescriptor_t c,
                                                     cudnnTensorDescriptor_t y, int requested,
                                                     int *returned,
                                                     cudnnConvolutionFwdAlgoPerf_t *perf);
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnTensorDescriptor_t dx, int requested, int *returned,
    cudnnConvolutionBwdDataAlgoPerf_t *perf);
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnFilterDescriptor_t dw, int requested, int *returned,
    cudnnConvolutionBwdFilterAlgoPerf_t *perf);
cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                      cudnnFilterDescriptor_t w,
                                                      cudnnConvolutionDescriptor_t c,
                                                      cudnnTensorDescriptor_t y,
                                                      cudnnConvolutionFwdAlgo_t a, size_t *bytes);
cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t h, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnTensorDescriptor_t dx, cudnnConvolutionBwdDataAlgo_t a,
    size_t *bytes);
cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t h, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
    cudnnConvolutionDescriptor_t c, cudnnFilterDescriptor_t dw, cudnnConvolutionBwdFilterAlgo_t a,
    size_t *bytes);

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void *alpha,
                                      cudnnTensorDescriptor_t xd, const void *x,
                                      cudnnFilterDescriptor_t wd, const void *w,
                                      cudnnConvolutionDescriptor_t c, cudnnConvolutionFwdAlgo_t a,
                                      void *ws, size_t ws_bytes, const void *beta,
                                      cudnnTensorDescriptor_t yd, void *y);
cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void *alpha,
                                           cudnnFilterDescriptor_t wd, const void *w,
                                           cudnnTensorDescriptor_t dyd, const void *dy,
                                           cudnnConvolutionDescriptor_t c,
                                           cudnnConvolutionBwdDataAlgo_t a, void *ws,
                                           size_t ws_bytes, const void *beta,
                                           cudnnTensorDescriptor_t dxd, void *dx);
cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void *alpha,
                                             cudnnTensorDescriptor_t xd, const void *x,
                                             cudnnTensorDescriptor_t dyd, const void *dy,
                                             cudnnConvolutionDescriptor_t c,
                                             cudnnConvolutionBwdFilterAlgo_t a, void *ws,
                                             size_t ws_bytes, const void *beta,
                                             cudnnFilterDescriptor_t dwd, void *dw);
cudnnStatus_t cudnnConvolutionBackwardBias(cudnnHandle_t h, const void *alpha,
                                           cudnnTensorDescriptor_t dyd, const void *dy,
                                           const void *beta, cudnnTensorDescriptor_t dbd, void *db);
cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void *alpha, cudnnTensorDescriptor_t ad,
                             const void *a, const void *beta, cudnnTensorDescriptor_t cd, void *c);
cudnnStatus_t cudnnActivationForward(cudnnHandle_t h, cudnnActivationDescriptor_t act,
                                     const void *alpha, cudnnTensorDescriptor_t xd, const void *x,
                                     const void *beta, cudnnTensorDescriptor_t yd, void *y);
cudnnStatus_t cudnnActivationBackward(cudnnHandle_t h, cudnnActivationDescriptor_t act,
                                      const void *alpha, cudnnTensorDescriptor_t yd, const void *y,
                                      cudnnTensorDescriptor_t dyd, const void *dy,
                                      cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                      cudnnTensorDescriptor_t dxd, void *dx);
cudnnStatus_t cudnnPoolingForward(cudnnHandle_t h, cudnnPoolingDescriptor_t p, const void *alpha,
                                  cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                  cudnnTensorDescriptor_t yd, void *y);
cudnnStatus_t cudnnPoolingBackward(cudnnHandle_t h, cudnnPoolingDescriptor_t p, const void *alpha,
                                   cudnnTensorDescriptor_t yd, const void *y,
                                   cudnnTensorDescriptor_t dyd, const void *dy,
                                   cudnnTensorDescriptor_t xd, const void *x, const void *beta,
                                   cudnnTensorDescriptor_t dxd, void *dx);

#ifdef __cplusplus
}
#endif

#endif /* SG_CUDNNMOCK_H */
