/* What the NCCL communicator needs from the CUDA device beyond the sg_device.h vtable: its comm
 * stream (collectives are enqueued there, ordered after the compute work by comm_submit) and a
 * way to take part in the device's host waits (poll the communicator's asynchronous error,
 * abort it when a deadline passes). No CUDA types: streams travel as void *. */
#ifndef SG_DEVICE_CUDA_H
#define SG_DEVICE_CUDA_H

#include "sg_device.h" /* sg__device, sg_status */

/* Called by the device's host waits (comm_wait, sync, and the waits inside copy/sumsq). */
typedef struct sg__cuda_comm_hooks {
  /* On every poll round while a wait is pending: SG_OK, or the communicator's failure (with
   * its text set), which the device then records as a failed comm job. */
  sg_status (*poll)(void *arg);
  /* Once, when a wait passes its deadline, before SG_ERR_TIMEOUT is returned: abort the
   * communicator so that kernels stuck in a collective exit. */
  void (*abort)(void *arg);
  /* The device is being destroyed: forget it (it will call nothing more). */
  void (*detach)(void *arg);
  void *arg;
} sg__cuda_comm_hooks;

#ifdef SG_HAVE_CUDA
/* cudaStream_t of the internal comm stream; NULL when d is not a CUDA device. */
void *sg__device_cuda_comm_stream(sg__device *d);
/* The CUDA ordinal the device runs on; -1 when d is not a CUDA device. */
int sg__device_cuda_ordinal(const sg__device *d);
/* Installs (h != NULL) or removes (h == NULL) the hooks. One set at a time: a new set replaces
 * the old one without calling its detach. SG_ERR_INVALID_ARGUMENT when d is not CUDA. */
sg_status sg__device_cuda_set_comm_hooks(sg__device *d, const sg__cuda_comm_hooks *h);
/* threaded = 0: host-driven comm jobs run inline in comm_submit (no overlap), for communicators
 * that must not be called from another thread (sg_comm.threaded = 0: MPI below
 * MPI_THREAD_SERIALIZED). Default 1: they run on the device's comm worker thread. */
sg_status sg__device_cuda_set_threaded_comm(sg__device *d, int threaded);
/* Checks and picks the GPU for `fn`: cuda_device, or the calling thread's current one for -1
 * (SG_ERR_CUDA "no CUDA device found", SG_ERR_INVALID_ARGUMENT out of range). */
sg_status sg__device_cuda_pick(int cuda_device, int *ordinal, const char *fn);
#endif

#endif /* SG_DEVICE_CUDA_H */
