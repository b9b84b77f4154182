/* The one kernel of examples/cnn_cudnn that cuDNN and cuBLAS do not provide: softmax
 * cross-entropy and its gradient, behind a plain C launcher so that cnn_cudnn.c stays C. The
 * stream travels as void * (cudaStream_t); the launcher returns a cudaError_t value (0 =
 * success). */
#ifndef CNN_CUDNN_KERNELS_H
#define CNN_CUDNN_KERNELS_H

#ifdef __cplusplus
extern "C" {
#endif

/* For n rows of `classes` logits (row-major) and their labels: dlogits = k * (softmax - onehot)
 * and loss_dst[0] = mean over the rows of -log softmax[label], summed in double in a fixed
 * order by one block (the loss does not depend on the launch). */
int cnnk_softmax_xent(void *stream, const float *logits, const int *labels, int n, int classes,
                      float k, float *dlogits, float *loss_dst);

#ifdef __cplusplus
}
#endif

#endif /* CNN_CUDNN_KERNELS_H */
