/* The CUDA device's ops of the slow-link modes (sg_device.h): outer_delta and outer_step (DiLoCo,
 * src/engine/policy/sg_replica_outer.c), code_encode and code_decode (the replica codecs,
 * sg_replica_codec.c): the launchers of kernels/cuda/sg_cuda_kernels.cu, which loop over the
 * element math the CPU loops use, so that a CUDA engine's outer steps and codes are the CPU
 * engine's bits. */
#include "sg_cuda_internal.h"

sg_status sg__cudev_outer_delta(sg__device *dev, sg__queue q, float *dst, const float *po,
                                const float *theta, size_t n) {
  static const char fn[] = "sg__device_cuda.outer_delta";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (n == 0) return SG_OK;
  if (!dst || !po || !theta) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_outer_delta(sg__cuda_launch_on(d, q), dst, po, theta, n), fn);
  return sg__cuda_after(d, q, fn);
}

sg_status sg__cudev_outer_step(sg__device *dev, sg__queue q, float *po, float *m, float *theta,
                               const float *dsum, size_t n, int nrep, float lr, float mu) {
  static const char fn[] = "sg__device_cuda.outer_step";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (nrep < 1) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: nrep must be >= 1 (%d)", fn, nrep);
  if (n == 0) return SG_OK;
  if (!po || !m || !theta || !dsum) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_outer_step(sg__cuda_launch_on(d, q), po, m, theta, dsum, n, nrep, lr, mu),
                fn);
  return sg__cuda_after(d, q, fn);
}

sg_status sg__cudev_code_encode(sg__device *dev, sg__queue q, void *out, const float *src,
                                float *resid, size_t n, int bits) {
  static const char fn[] = "sg__device_cuda.code_encode";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (bits != 8 && bits != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bits must be 8 or 4 (%d)", fn, bits);
  if (n == 0) return SG_OK;
  if (!out || !src || !resid) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_code_encode(sg__cuda_launch_on(d, q), out, src, resid, n, bits), fn);
  return sg__cuda_after(d, q, fn);
}

sg_status sg__cudev_code_decode(sg__device *dev, sg__queue q, float *dst, const void *in,
                                size_t n, int bits, int add) {
  static const char fn[] = "sg__device_cuda.code_decode";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (bits != 8 && bits != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bits must be 8 or 4 (%d)", fn, bits);
  if (n == 0) return SG_OK;
  if (!dst || !in) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_code_decode(sg__cuda_launch_on(d, q), dst, in, n, bits, add), fn);
  return sg__cuda_after(d, q, fn);
}
