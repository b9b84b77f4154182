/* Kernels of examples/mlp_cuda; see mlp_cuda_kernels.h. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mlp_cuda_kernels.h"

namespace {

constexpr int kThreads = 256;

int blocks_for(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return b > 4096 ? 4096 : (int)b;
}

int launched() { return (int)cudaGetLastError(); }

__device__ float load(const void *p, int bf16, size_t i) {
  return bf16 ? __bfloat162float(((const __nv_bfloat16 *)p)[i]) : ((const float *)p)[i];
}

__global__ void bias_act(float *out, __nv_bfloat16 *out_lo, const void *bias, int bias_bf16,
                         size_t n, int nout, int use_tanh) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float y = out[i] + load(bias, bias_bf16, i % (size_t)nout);
    if (use_tanh) y = tanhf(y);
    out[i] = y;
    if (out_lo) out_lo[i] = __float2bfloat16_rn(y);
  }
}

/* One block: each thread sums a strided set in double, then a fixed tree. */
__global__ void mse(const float *out, const float *target, float *delta, __nv_bfloat16 *delta_lo,
                    int n, float k, float *loss_dst) {
  __shared__ double part[kThreads];
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = out[i] - target[i];
    const float g = k * d;
    delta[i] = g;
    if (delta_lo) delta_lo[i] = __float2bfloat16_rn(g);
    s += (double)d * (double)d;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss_dst[0] = (float)(part[0] / (double)n);
}

__global__ void tanh_grad(float *d, __nv_bfloat16 *d_lo, const float *a, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float g = d[i] * (1.0f - a[i] * a[i]);
    d[i] = g;
    if (d_lo) d_lo[i] = __float2bfloat16_rn(g);
  }
}

__global__ void to_bf16(__nv_bfloat16 *dst, const float *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void fill(void *dst, int bf16, size_t n, float value) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    if (bf16)
      ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(value);
    else
      ((float *)dst)[i] = value;
  }
}

}  // namespace

extern "C" int mlpc_bias_act(void *stream, float *out, void *out_lo, const void *bias,
                             int bias_bf16, int rows, int nout, int use_tanh) {
  const size_t n = (size_t)rows * (size_t)nout;
  bias_act<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(
      out, (__nv_bfloat16 *)out_lo, bias, bias_bf16, n, nout, use_tanh);
  return launched();
}

extern "C" int mlpc_mse(void *stream, const float *out, const float *target, float *delta,
                        void *delta_lo, int n, float k, float *loss_dst) {
  mse<<<1, kThreads, 0, (cudaStream_t)stream>>>(out, target, delta, (__nv_bfloat16 *)delta_lo, n,
                                                k, loss_dst);
  return launched();
}

extern "C" int mlpc_tanh_grad(void *stream, float *d, void *d_lo, const float *a, size_t n) {
  tanh_grad<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(d, (__nv_bfloat16 *)d_lo, a, n);
  return launched();
}

extern "C" int mlpc_to_bf16(void *stream, void *dst, const float *src, size_t n) {
  to_bf16<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>((__nv_bfloat16 *)dst, src, n);
  return launched();
}

extern "C" int mlpc_fill(void *stream, void *dst, int bf16, size_t n, float value) {
  fill<<<blocks_for(n), kThreads, 0, (cudaStream_t)stream>>>(dst, bf16, n, value);
  return launched();
}
