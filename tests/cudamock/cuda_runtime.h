/* A mock of the part of the CUDA runtime API that src/device/cuda.c uses, for testing the CUDA
 * device (and the engine on it) on machines without a GPU. Only tests/cuda.cmake's mock library
 * puts this directory on the include path; real builds use the toolkit's header.
 *
 * Model (tests/cudamock/sg_cudamock.cpp): "device" memory is host memory; a stream is a FIFO of
 * work that runs only when something forces it (cudaStreamQuery, cudaEventQuery, a stream that
 * waits on one of its events, cudaFree). Work is therefore as late as CUDA allows, so a missing
 * event between two streams, or a host read without a wait, gives wrong data in a test instead
 * of passing by luck. Kernels are the emulated kernels of kernels/cuda (sg_cuda_emu.h), queued
 * on the stream they are launched on. Stricter than CUDA where a real GPU would give garbage
 * rather than an error: fresh allocations hold 0xff bytes (NaN), cudaMemcpyAsync's kind must
 * match where its buffers are, cudaMemsetAsync takes device memory only. */
#ifndef SG_CUDAMOCK_RUNTIME_H
#define SG_CUDAMOCK_RUNTIME_H

#include <stddef.h> /* size_t */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600
} cudaError_t;

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *user_data);

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
  enum cudaMemoryType type;
  int device;
  void *devicePointer;
  void *hostPointer;
};

/* the CUDA runtime version the mock follows (contexts as CUDA >= 12 makes them) */
#define CUDART_VERSION 13000

enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2
};
#define cudaEnableDefault 0x0

#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
#define CUDART_CB

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);

cudaError_t cudaGetDeviceCount(int *count);
/* The thread's current device: 0 on a thread that never chose one (as CUDA answers), though no
 * context is current there. */
cudaError_t cudaGetDevice(int *device);
/* Makes the device's primary context current on the thread, creating it the first time in the
 * process (counted: sg_cudamock_contexts). Allocations, streams and events on a thread without
 * a context create device 0's (its current device), as the runtime does. */
cudaError_t cudaSetDevice(int device);
/* Knows one driver symbol: cuCtxGetCurrent (int (*)(void **ctx)), which gives NULL on a thread
 * without a current context. */
cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest);
struct cudaDeviceProp {
  char name[256];
  int multiProcessorCount;
};
/* name "cudamock GPU N" */
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);

cudaError_t cudaMalloc(void **p, size_t bytes);
/* cudaFree and cudaFreeHost synchronize the device first: they block while a stream created by
 * the calling thread (a rank's "GPU") cannot finish, at most 60 s (then cudaErrorNotReady). */
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMallocAsync(void **p, size_t bytes, cudaStream_t s);
/* device for cudaMalloc/cudaMallocAsync memory, host for cudaMallocHost, else unregistered */
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s);
/* On the legacy stream, which no stream of the mock waits for: a pageable H2D copy returns
 * before it lands (as in CUDA); other kinds complete before return. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user_data);

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned int flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
/* Runs the stream's work; a mock cannot block, so a stream that cannot finish (stalled) gives
 * cudaErrorNotReady instead of waiting forever. */
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags);

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
/* Milliseconds between two completed timing events (the steady clock when each one's stream
 * reached it); cudaErrorNotReady when either is not complete yet (nothing is forced). */
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---- controls for tests ----------------------------------------------------------------- */

/* Number of mock GPUs (default 1); 0 makes cudaGetDeviceCount fail with cudaErrorNoDevice. */
void sg_cudamock_set_devices(int n);
/* A stalled stream runs nothing (queries say cudaErrorNotReady), like a stream stuck behind a
 * collective that never completes. */
void sg_cudamock_stall(cudaStream_t s, int on);
/* A slow copy-out: from now on every stream on which an asynchronous device-to-host copy into
 * pinned memory is queued is stalled right before that copy runs (sg_cudamock_stall), until
 * sg_cudamock_stall_d2h(0) releases them all. */
void sg_cudamock_stall_d2h(int on);
/* Work items queued on s and not yet run. */
size_t sg_cudamock_pending(cudaStream_t s);
/* Runs everything that can run (all streams), as time passing on a real GPU would. */
void sg_cudamock_drain(void);
/* Primary contexts created on `device` so far in the process (0 or 1; -1 for a bad device). */
int sg_cudamock_contexts(int device);
/* Allocations made with cudaMalloc / cudaMallocAsync / cudaMallocHost and not freed. */
size_t sg_cudamock_live_allocations(void);
/* Calls so far (all threads) of the runtime function `name`, one of: cudaMemcpyAsync,
 * cudaMallocAsync, cudaMallocHost, cudaEventQuery, cudaStreamQuery (cudaStreamSynchronize
 * included), cudaStreamWaitEvent, cudaEventRecord, cudaFree (cudaFreeHost included). -1 for
 * another name. Tests count uploads and host waits with it. */
long long sg_cudamock_calls(const char *name);
/* The same counters for the calling thread only (a rank's own calls when ranks are threads),
 * and these, counted per thread too:
 *   kernel           emulated kernel launches (kernels/cuda on the mock streams)
 *   cudaMemsetAsync  fills
 *   collective       NCCL collectives (the mock NCCL)
 *   host_sync        times the host waited for the device: a poll (cudaEventQuery or
 *                    cudaStreamQuery) of an object other than the one this thread's previous
 *                    poll found not ready (a poll loop counts once), a copy from or to
 *                    pageable memory, a cudaMemcpy, a cudaFree/cudaFreeHost (a device sync)
 *   free_block       cudaFree/cudaFreeHost calls that blocked: a stream created by the calling
 *                    thread (a rank's "GPU") could not finish its work, stalled or behind a
 *                    collective that never completes; they wait (at most 60 s here) as the
 *                    driver would, past any deadline of the caller's
 * cudaMemcpyAsync also counts the emulated kernels' device-to-device copies here. */
long long sg_cudamock_thread_calls(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* SG_CUDAMOCK_RUNTIME_H */
