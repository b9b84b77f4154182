/* What the CUDA-specific parts of the library (the NCCL communicator's creation) need from the
 * CUDA device beyond the sg_device.h vtable. Communicators get the device's comm stream and
 * take part in its waits through comm_attach (sg_device.h). */
#ifndef SG_DEVICE_CUDA_H
#define SG_DEVICE_CUDA_H

#include "sg_device.h" /* sg__device, sg_status */

#ifdef SG_HAVE_CUDA
/* Checks and picks the GPU for `fn`: cuda_device, or the calling thread's current one for -1
 * (SG_ERR_CUDA "no CUDA device found", SG_ERR_INVALID_ARGUMENT out of range). */
sg_status sg__device_cuda_pick(int cuda_device, int *ordinal, const char *fn);
#endif

#endif /* SG_DEVICE_CUDA_H */
