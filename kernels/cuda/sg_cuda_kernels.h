/* extern "C" launchers of the CUDA kernels (kernels/cuda/sg_cuda_kernels.cu), called by
 * src/device/cuda.c. Plain C: streams travel as void * (cudaStream_t), errors as int
 * (a cudaError_t value, 0 = cudaSuccess; the caller turns it into text).
 *
 * Every kernel loops over the element math of kernels/sg_elem.h, so each element gets the same
 * operations in the same order as the CPU loops of kernels/cpu. Results do not depend on the
 * launch shape: elementwise kernels compute each element independently, and the reduction
 * (sumsq) uses a partition fixed by n alone.
 *
 * dtype codes: 0 f32, 1 bf16, 2 f16 (sg_dtype); 3 f64 where stated. */
#ifndef SG_CUDA_KERNELS_H
#define SG_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "../sg_kernel_args.h" /* sg__update_args, sg__seg */

#ifdef __cplusplus
extern "C" {
#endif

/* Where and how wide to launch. */
typedef struct sg__cuda_launch {
  void *stream;   /* cudaStream_t; never the legacy default stream */
  int max_blocks; /* grid-stride kernels use at most this many blocks (>= 1) */
} sg__cuda_launch;

/* acc[i] = round_acc(acc[i] + src[i]) in fp32; acc and src any of f32/bf16/f16 (f32/bf16
 * accumulators, and f16 gradient slots for sg_grad_add). */
int sg__cuda_accumulate(sg__cuda_launch L, void *acc, int acc_dtype, const void *src, int src_dtype,
                        size_t n);
/* dst[i] = round_dst(src[i]) through fp32 (exact widening, one rounding). */
int sg__cuda_cast(sg__cuda_launch L, void *dst, int dst_dtype, const void *src, int src_dtype,
                  size_t n);

/* dst[i] = round(sum over k of srcs[k][i]) with sums in k order, fp32 (f64 for dtype 3).
 * srcs is a host array of device pointers, passed by value to the kernel (at most
 * SG__CUDA_MAX_SRCS). dst may be one of the srcs. */
#ifndef SG__CUDA_MAX_SRCS
/* 4000 pointers (32000 bytes) fit the 32 KB kernel parameter limit of CUDA 12.1+ on sm_70+; the
 * build passes 500 (4 KB) for older toolkits (CMakeLists.txt). */
#define SG__CUDA_MAX_SRCS 4000
#endif
int sg__cuda_reduce_sum(sg__cuda_launch L, void *dst, const void *const *srcs, int nsrc, int dtype,
                        size_t n);

/* Outer steps (DiLoCo), fp32, the loops of kernels/cpu/sg_cpu_outer.c: d[i] = po[i] - theta[i];
 * and from the replicas' sum dsum: po[i], m[i] by Nesterov momentum on dsum[i] / nrep (lr, mu),
 * theta[i] = po[i]. */
int sg__cuda_outer_delta(sg__cuda_launch L, float *d, const float *po, const float *theta,
                         size_t n);
int sg__cuda_outer_step(sg__cuda_launch L, float *po, float *m, float *theta, const float *dsum,
                        size_t n, int nrep, float lr, float mu);

/* The replica codecs' blockwise codes (bits 8 or 4), the layout and math of
 * kernels/cpu/sg_cpu_codec.c: n values src + resid encoded into out (resid: what the codes
 * missed), and n values decoded from in into dst (add: dst + them). */
int sg__cuda_code_encode(sg__cuda_launch L, void *out, const float *src, float *resid, size_t n,
                         int bits);
int sg__cuda_code_decode(sg__cuda_launch L, float *dst, const void *in, size_t n, int bits,
                         int add);

/* dst[i] = value rounded to dtype (0..3). */
int sg__cuda_fill(sg__cuda_launch L, void *dst, int dtype, size_t n, double value);

/* Sum of squares in double and count of non-finite values of x (f32, bf16 or f16), as two
 * passes: fixed chunks of SG__CUDA_SUMSQ_CHUNK elements, one double partial pair per chunk in a
 * fixed order, then one block combining the partials in a fixed order. No atomics. The two
 * results (sumsq, nonfinite) are written to result2[0..1] (device memory). scratch is device
 * memory of sg__cuda_sumsq_scratch_bytes(n) bytes. */
#define SG__CUDA_SUMSQ_CHUNK SG__SUMSQ_CHUNK /* sg_kernel_args.h */
size_t sg__cuda_sumsq_scratch_bytes(size_t n);
/* The step's outcome (kernels/sg_elem.h, sg_elem_step_outcome) from the 2 doubles ss (sum of
 * squares, non-finite count; device memory) into out (device memory) and, unless NULL, host_out
 * (pinned host memory, seq written last, after a system fence): one thread. */
struct sg_elem_step_in;
int sg__cuda_step_outcome(sg__cuda_launch L, const double *ss, const struct sg_elem_step_in *in,
                          void *out, void *host_out, uint64_t seq);
int sg__cuda_sumsq(sg__cuda_launch L, const void *x, int dtype, size_t n, void *scratch,
                   double *result2);

/* The update kernels take the segments as a device table: build it on the host into
 * host_table (sg__cuda_seg_table_bytes(nsegs) bytes; pinned memory lets the copy be
 * asynchronous), copy it to device memory, and pass the device copy and *work from the build to
 * the launch. a->segs is not read by a launch. Every optimizer's launcher has the signature of
 * sg__cuda_update_fn (its descriptor's cuda_update, src/optim/sg_optimizer.h). */
size_t sg__cuda_seg_table_bytes(int nsegs);
void sg__cuda_seg_table_build(void *host_table, const sg__seg *segs, int nsegs, uint64_t *work);
typedef int (*sg__cuda_update_fn)(sg__cuda_launch L, const sg__update_args *a,
                                  const void *dev_table, uint64_t work);

/* Fused AdamW (kernels/sg_adamw_args.h) over the segments of the table. */
int sg__cuda_adamw(sg__cuda_launch L, const sg__update_args *a, const void *dev_table,
                   uint64_t work);
/* The same over 8-bit blockwise state (a->q8_*): one block of threads per segment, each segment
 * one state block's run from its start; bit for bit kernels/cpu/sg_cpu_q8.c. */
int sg__cuda_adamw_q8(sg__cuda_launch L, const sg__update_args *a, const void *dev_table,
                      uint64_t work);

#ifdef __cplusplus
}
#endif

#endif /* SG_CUDA_KERNELS_H */
