/* What the CUDA-specific parts of the library (the NCCL communicator: its GPU, where a buffer
 * lives) need from the CUDA device beyond the sg_device.h vtable. Communicators get the device's comm stream and
 * take part in its waits through comm_attach (sg_device.h). */
#ifndef SG_DEVICE_CUDA_H
#define SG_DEVICE_CUDA_H

#include "sg_device.h" /* sg__device, sg_status */

#ifdef SG_HAVE_CUDA
/* Checks and picks the GPU for `fn`: cuda_device, or the calling thread's current one for -1
 * (SG_ERR_CUDA "no CUDA device found", SG_ERR_INVALID_ARGUMENT out of range). */
sg_status sg__device_cuda_pick(int cuda_device, int *ordinal, const char *fn);

/* Where the runtime says p lives: device or managed memory (a collective or kernel can use it
 * directly), host memory it pinned (cudaMallocHost, cudaHostRegister: async copies), or anything
 * else, pageable host memory. */
enum { SG__CUDA_MEM_HOST, SG__CUDA_MEM_PINNED, SG__CUDA_MEM_DEVICE };
int sg__device_cuda_mem_kind(const void *p);

/* The calling thread's current device, or -1 when no context is current on it (a thread that
 * never chose a device: nothing to restore, and cudaSetDevice(0) would create a context). */
int sg__device_cuda_current(void);

/* GPUs the runtime sees; 0 when it sees none or fails (its error is cleared). */
int sg__device_cuda_count(void);
#endif

#endif /* SG_DEVICE_CUDA_H */
