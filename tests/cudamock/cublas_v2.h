/* A mock of cublasSgemm and its handle over the mock CUDA runtime (cuda_runtime.h here), for
 * examples/cnn_cudnn on the mock (tests/cuda.cmake): column-major C = alpha op(A) op(B) +
 * beta C, queued on the handle's stream and computed on the host. */
#ifndef SG_CUBLASMOCK_H
#define SG_CUBLASMOCK_H

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef struct cublasContext *cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *a, int lda,
                           const float *b, int ldb, const float *beta, float *c, int ldc);

#ifdef __cplusplus
}
#endif

#endif /* SG_CUBLASMOCK_H */
