/* Kernels of examples/cnn_cudnn; see cnn_cudnn_kernels.h. With CNNK_EMULATE the kernel runs on
 * the host through kernels/cuda/sg_cuda_emu.h (test_cnn_cudnn_cudamock, tests/cuda.cmake). */
#include <math.h> /* exp, log, fmaxf */

#ifdef CNNK_EMULATE
#include "cuda/sg_cuda_emu.h"
#define CNNK_LAUNCH_1(k, threads, stream, ...) \
  sg_emu_launch_sync((cudaStream_t)(stream), (k), 1u, (threads), __VA_ARGS__)
#else
#include <cuda_runtime.h>
#define CNNK_LAUNCH_1(k, threads, stream, ...) \
  (k)<<<1, (threads), 0, (cudaStream_t)(stream)>>>(__VA_ARGS__)
#endif

#include "cnn_cudnn_kernels.h"

namespace {

constexpr int kThreads = 256;

/* One block: thread t takes rows t, t + 256, ...; the per-thread sums meet in a fixed tree. */
__global__ void softmax_xent(const float *logits, const int *labels, int n, int classes, float k,
                             float *dlogits, float *loss_dst) {
  __shared__ double part[kThreads];
  double s = 0.0;
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const float *l = logits + (size_t)r * classes;
    float mx = l[0];
    for (int c = 1; c < classes; c++) mx = fmaxf(mx, l[c]);
    double se = 0.0;
    for (int c = 0; c < classes; c++) se += exp((double)l[c] - (double)mx);
    const int y = labels[r];
    s += (double)mx + log(se) - (double)l[y];
    for (int c = 0; c < classes; c++) {
      const double p = exp((double)l[c] - (double)mx) / se;
      dlogits[(size_t)r * classes + c] = (float)((double)k * (p - (c == y ? 1.0 : 0.0)));
    }
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss_dst[0] = (float)(part[0] / (double)n);
}

}  // namespace

extern "C" int cnnk_softmax_xent(void *stream, const float *logits, const int *labels, int n,
                                 int classes, float k, float *dlogits, float *loss_dst) {
  if (n < 1 || classes < 1) return (int)cudaErrorInvalidValue;
  CNNK_LAUNCH_1(softmax_xent, kThreads, stream, logits, labels, n, classes, k, dlogits, loss_dst);
  return (int)cudaGetLastError();
}
