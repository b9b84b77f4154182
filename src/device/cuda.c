/* CUDA device (DESIGN.md sections 1 and 4): device memory, pinned host memory, two streams
 * ordered with events, and the kernels of kernels/cuda.
 *
 * Queues. SG_Q_COMPUTE is the caller's stream (sg_set_stream) or a non-blocking stream of our
 * own; SG_Q_COMM is an internal non-blocking stream with the highest priority, so that
 * reductions overlap the backward pass. Nothing runs on the legacy default stream.
 *
 * Comm jobs. comm_submit records an event on the compute stream, makes the comm stream wait
 * for it (the collective's input is complete when it runs), then calls the job on the host: it
 * only enqueues work on the comm stream. A ticket event recorded after it marks the job's end.
 * Ticket events live in a ring; a slot reused by a later ticket still answers for the earlier
 * one, since the comm stream runs in order (waiting on the later ticket only waits longer).
 *
 * Jobs and communicators. Jobs go through the shared job queue (sg_jobq.h); how they run is
 * fixed when a communicator attaches (comm_attach, at bind time, before its first job).
 * Stream-ordered communicators (NCCL) only enqueue work on the comm stream: their jobs run
 * inline in comm_submit after the comm stream was made to wait for the compute stream, and the
 * ticket's ring event, recorded on the comm stream after the job, marks their end. Host-driven
 * communicators (local: rank threads reading each other's buffers between barriers; MPI
 * through pinned staging) need the CPU device's semantics: the job's input complete when it
 * starts, and every SG_Q_COMM copy or kernel it issues complete when that call returns.
 * comm_submit records the ticket's ring event on the compute stream; the job, on the queue's
 * worker thread (or inline when the communicator must not be called from another thread),
 * waits on the host for that event and for the comm stream to be idle, runs, waits for the
 * comm stream again (its marks), and completes its ticket in the queue. Waits for such a
 * ticket are host waits on the queue. Without an attachment jobs are host-driven on the worker.
 *
 * Threads. The caller's thread issues compute work while the worker runs a job: tickets and
 * the failure live in the queue (its lock), the ring bookkeeping and the attachment under `mu`
 * (taken after the queue's lock, never before it); the sumsq scratch is per queue; the update
 * segment-table cache is under `tab_mu`. The worker never reads d->compute (the caller may
 * switch it). SG_Q_COMM work issued outside a job first waits for every queued job, as on the
 * CPU device.
 *
 * Waits. Every host wait polls (cudaEventQuery / cudaStreamQuery) with a deadline, so that a
 * collective that never completes gives SG_ERR_TIMEOUT instead of a hang; the NCCL communicator
 * joins the polls through its attachment (its asynchronous error, its abort). No
 * cudaDeviceSynchronize anywhere. */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c11 */

#include "sg_cuda_internal.h"

/* The device whose replica-lane job this thread submits or runs (stream-ordered jobs run
 * inline, on the submitting thread): its SG_Q_COMM work goes to the replica stream. */
_Thread_local const struct sg__cuda_dev *sg__cuda_lane_of;
_Thread_local const struct sg__cuda_dev *sg__cuda_out_of;

/* ---- errors ---------------------------------------------------------------------------- */

/* Every CUDA failure: status, function, the call, CUDA's name and text, file:line. Running out
 * of memory is SG_ERR_OUT_OF_MEMORY so that the engine can report it as such. */
sg_status sg__cuda_err(cudaError_t e, const char *fn, const char *call, const char *file,
                       int line) {
  sg_status st = e == cudaErrorMemoryAllocation ? SG_ERR_OUT_OF_MEMORY : SG_ERR_CUDA;
  if (e == cudaErrorMemoryAllocation) (void)cudaGetLastError(); /* not sticky: clear it */
  return sg__err_at(st, file, line, "%s: %s failed: %s (%s)", fn, call, cudaGetErrorString(e),
                    cudaGetErrorName(e));
}



sg__cuda_dev *sg__cuda(sg__device *d) { return (sg__cuda_dev *)d; }


/* Aborts every stream-ordered communicator attached (a hybrid engine's shard and replica
 * channels): after one failed, the other's collectives may wait forever for peers that gave
 * up, and every cudaFree/cudaFreeHost would then block behind their kernels. */
void sg__cuda_abort_all(sg__cuda_dev *d) {
  sg__comm_attach h[SG__CUDA_MAX_ATT];
  const int hooked = sg__cuda_hooks_get(d, h);
  for (int i = 0; i < hooked; i++)
    if (h[i].abort) h[i].abort(h[i].arg);
}

/* Keeps the first failure; the engine is broken from then on and every wait returns it. The
 * text is the calling thread's last error (the thread that saw the failure). */
sg_status sg__cuda_record_failure(sg__cuda_dev *d, sg_status st) {
  sg__cuda_abort_all(d);
  return sg__jobq_fail(&d->q, st, NULL);
}

/* The recorded failure with its text in the calling thread's error; SG_OK while healthy. */
sg_status sg__cuda_failed(sg__cuda_dev *d) { return sg__jobq_failed(&d->q); }

/* Copies of the attachments when they take part in waits (stream-ordered): how many; 0
 * otherwise. */
int sg__cuda_hooks_get(sg__cuda_dev *d, sg__comm_attach h[]) {
  pthread_mutex_lock(&d->mu);
  const int have = d->stream_mode ? d->attached : 0;
  for (int i = 0; i < have; i++) h[i] = d->att[i];
  pthread_mutex_unlock(&d->mu);
  return have;
}

/* The calling thread runs a host-driven job of d (its comm work completes call by call). */
int sg__cuda_in_host_job(sg__cuda_dev *d) {
  if (!sg__jobq_in_job(&d->q)) return 0;
  pthread_mutex_lock(&d->mu);
  const int host = !d->stream_mode;
  pthread_mutex_unlock(&d->mu);
  return host;
}

/* Binds the calling thread to our GPU: the engine may run on another thread than the one that
 * created the device, and the runtime's current device is per thread. */
sg_status sg__cuda_enter(sg__cuda_dev *d, const char *fn) {
  if (sg__device_cuda_current() == d->ordinal) return SG_OK;
  SG__CU(cudaSetDevice(d->ordinal), fn);
  return SG_OK;
}


/* The driver's cuCtxGetCurrent, found through the runtime (no link to libcuda); NULL where the
 * runtime cannot give it. */
typedef int (*sg__cu_ctx_get_fn)(void **ctx);
static sg__cu_ctx_get_fn sg__cuda_ctx_get;
static pthread_once_t sg__cuda_ctx_once = PTHREAD_ONCE_INIT;

static void sg__cuda_ctx_resolve(void) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000,
                                                   cudaEnableDefault, &q);
#else
  cudaError_t e = cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    fn = NULL;
  }
  sg__cuda_ctx_get = (sg__cu_ctx_get_fn)fn;
}

/* cudaGetDevice answers 0 on a thread that never chose a device, and cudaSetDevice(0) to
 * "restore" that would create GPU 0's primary context (hundreds of MB, refused under
 * EXCLUSIVE_PROCESS) in every rank's process: -1 unless a context is current on the thread.
 * Without cuCtxGetCurrent, cudaGetDevice's answer. */
int sg__device_cuda_current(void) {
  (void)pthread_once(&sg__cuda_ctx_once, sg__cuda_ctx_resolve);
  void *ctx = NULL;
  if (sg__cuda_ctx_get && sg__cuda_ctx_get(&ctx) == 0 && !ctx) return -1;
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return cur;
}

int sg__device_cuda_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

sg__cuda_scope sg__cuda_scope_begin(const sg__cuda_dev *d) {
  (void)d;
  sg__cuda_scope sc = {sg__device_cuda_current()};
  return sc;
}

void sg__cuda_scope_end(const sg__cuda_scope *sc) {
  int cur = -1;
  if (sc->prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != sc->prev)
    (void)cudaSetDevice(sc->prev);
}


sg_status sg__cuda_check_queue(sg__queue q, const char *fn) {
  if (q != SG_Q_COMPUTE && q != SG_Q_COMM)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown queue (%d)", fn, (int)q);
  return SG_OK;
}


cudaStream_t sg__cuda_stream(sg__cuda_dev *d, sg__queue q) {
  if (q != SG_Q_COMM) return d->compute;
  if (sg__cuda_out_of == d) return d->out;
  return sg__cuda_lane_of == d && d->rep ? d->rep : d->comm;
}

sg__cuda_launch sg__cuda_launch_on(sg__cuda_dev *d, sg__queue q) {
  sg__cuda_launch L;
  L.stream = (void *)sg__cuda_stream(d, q);
  L.max_blocks = d->max_blocks;
  return L;
}

/* ---- memory ----------------------------------------------------------------------------- */

/* Device memory (cudaMalloc) or pinned host memory (cudaMallocHost); 0 bytes still gets a
 * distinct non-NULL block, as on the CPU device. */
static sg_status sg__cuda_alloc_any(sg__device *dev, size_t bytes, void **out, int pinned_host) {
  const char *fn = pinned_host ? "sg__device_cuda.host_alloc" : "sg__device_cuda.alloc";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  *out = NULL;
  if (sg__device_should_fail_alloc())
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: injected allocation failure (%zu bytes)", fn, bytes);
  SG_TRY(sg__cuda_enter(d, fn));
  if (pinned_host)
    SG__CU(cudaMallocHost(out, bytes ? bytes : 64), fn);
  else
    SG__CU(cudaMalloc(out, bytes ? bytes : 256), fn);
  return SG_OK;
}

static sg_status sg__cudev_alloc(sg__device *dev, size_t bytes, void **out) {
  return sg__cuda_alloc_any(dev, bytes, out, 0);
}

static sg_status sg__cudev_host_alloc(sg__device *dev, size_t bytes, void **out) {
  return sg__cuda_alloc_any(dev, bytes, out, 1);
}

/* Whether streams `first`, d->comm, d->rep and d->out ran everything queued before
 * `deadline_ms` (polled, no hooks). */
static int sg__cuda_drained_by(sg__cuda_dev *d, cudaStream_t first, int64_t deadline_ms) {
  for (unsigned iter = 0;; iter++) {
    int busy = 0;
    cudaStream_t s[4] = {first, d->comm, d->rep, d->out};
    for (int i = 0; i < 4; i++) {
      const cudaError_t e = s[i] ? cudaStreamQuery(s[i]) : cudaSuccess;
      if (e == cudaErrorNotReady) (void)cudaGetLastError();
      if (e == cudaErrorNotReady) busy = 1;
      else if (e != cudaSuccess) return 0; /* a sticky error: the device is gone */
    }
    if (!busy) return 1;
    if (deadline_ms != INT64_MAX && sg__now_ms() > deadline_ms) return 0;
    sg__cuda_backoff(iter);
  }
}

/* cudaFree and cudaFreeHost synchronize the whole device, with no deadline: behind a collective
 * whose peer died they never return. So a free first waits for our streams itself, until the
 * attached communicator's timeout; past it, it aborts every communicator (their kernels then
 * leave) and waits a grace period more. 0 when the device may be freed; otherwise the memory is
 * given up (logged once) rather than hang. `first`: the compute stream to wait for besides the
 * comm stream. */
static int sg__cuda_quiesce(sg__cuda_dev *d, cudaStream_t first, const char *fn) {
  if (d->leaking) return -1;
  pthread_mutex_lock(&d->mu);
  const int timeout_ms = d->attached ? d->att[0].timeout_ms : 0;
  pthread_mutex_unlock(&d->mu);
  if (sg__cuda_drained_by(d, first, sg__deadline(timeout_ms))) return 0;
  sg__cuda_abort_all(d);
  if (sg__cuda_drained_by(d, first, sg__deadline(SG__CUDA_FREE_GRACE_MS))) return 0;
  d->leaking = 1;
  SG_LOG(SG_LOG_WARN, d->base.rank,
         "%s: GPU %d still busy after its communicators were aborted; its memory is not freed "
         "(cudaFree would wait for the stuck work forever)",
         fn, d->ordinal);
  return -1;
}

static void sg__cuda_free_any(sg__device *dev, void *p, int pinned_host) {
  const char *fn = pinned_host ? "sg__device_cuda.host_free" : "sg__device_cuda.free";
  sg__cuda_dev *d = sg__cuda(dev);
  if (!d || !p) return;
  SG__CUDA_SCOPE(d);
  (void)sg__cuda_enter(d, fn);
  if (sg__cuda_quiesce(d, d->compute, fn) != 0) return;
  (void)(pinned_host ? cudaFreeHost(p) : cudaFree(p));
}

static void sg__cudev_free(sg__device *dev, void *p) { sg__cuda_free_any(dev, p, 0); }

static void sg__cudev_host_free(sg__device *dev, void *p) { sg__cuda_free_any(dev, p, 1); }

/* ---- copies and fills ------------------------------------------------------------------- */

int sg__device_cuda_mem_kind(const void *p) {
  struct cudaPointerAttributes a;
  memset(&a, 0, sizeof a);
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: an unknown pointer is pageable host memory */
    return SG__CUDA_MEM_HOST;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return SG__CUDA_MEM_DEVICE;
  return a.type == cudaMemoryTypeHost ? SG__CUDA_MEM_PINNED : SG__CUDA_MEM_HOST;
}

static int sg__cuda_is_pinned(const void *p) {
  return sg__device_cuda_mem_kind(p) == SG__CUDA_MEM_PINNED;
}

/* Grows queue q's pageable-copy staging to at least `chunk` bytes (doubling, up to
 * SG__CUDA_COPY_CHUNK). The old buffer is retired until destroy, not freed: cudaFreeHost would
 * wait for the whole device, the other queue's stuck collective included, with no deadline. */
static sg_status sg__cuda_cstage_grow(sg__cuda_dev *d, sg__queue q, size_t chunk, const char *fn) {
  size_t cap = 2 * d->cstage_cap[q];
  if (cap > SG__CUDA_COPY_CHUNK) cap = SG__CUDA_COPY_CHUNK;
  if (cap < chunk) cap = chunk;
  sg__cuda_stage *old = NULL;
  if (d->cstage[q]) {
    old = (sg__cuda_stage *)calloc(1, sizeof *old);
    if (!old) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: staging record", fn);
  }
  void *p = NULL;
  cudaError_t e = cudaMallocHost(&p, cap);
  if (e != cudaSuccess) {
    free(old);
    return sg__cuda_err(e, fn, "cudaMallocHost(copy staging)", __FILE__, __LINE__);
  }
  if (old) {
    old->base = (char *)d->cstage[q];
    old->next = d->cretired;
    d->cretired = old;
  }
  d->cstage[q] = p;
  d->cstage_cap[q] = cap;
  return SG_OK;
}

/* A copy from or to pageable host memory. The driver would do it synchronously, blocking
 * before any deadline poll while the stream sits behind a stuck collective (sg_get_param after
 * a gather whose peer died). Through pinned staging, chunk by chunk, every wait is one of ours,
 * with the deadline of the attached communicator. */
static sg_status sg__cuda_copy_staged(sg__cuda_dev *d, sg__queue q, void *dst, const void *src,
                                      size_t bytes, sg__copy_kind kind, const char *fn) {
  const size_t chunk = bytes < SG__CUDA_COPY_CHUNK ? bytes : SG__CUDA_COPY_CHUNK;
  if (d->cstage_cap[q] < chunk) SG_TRY(sg__cuda_cstage_grow(d, q, chunk, fn));
  cudaStream_t s = sg__cuda_stream(d, q);
  char *stage = (char *)d->cstage[q];
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t n = bytes - off < chunk ? bytes - off : chunk;
    if (kind == SG_COPY_H2D) {
      memcpy(stage, (const char *)src + off, n);
      SG__CU(cudaMemcpyAsync((char *)dst + off, stage, n, cudaMemcpyHostToDevice, s), fn);
    } else {
      SG__CU(cudaMemcpyAsync(stage, (const char *)src + off, n, cudaMemcpyDeviceToHost, s), fn);
    }
    SG_TRY(sg__cuda_wait(d, NULL, s, INT64_MAX, fn)); /* INT64_MAX: the attachment's timeout */
    if (kind == SG_COPY_D2H) memcpy((char *)dst + off, stage, n);
  }
  return SG_OK;
}

static sg_status sg__cudev_copy(sg__device *dev, sg__queue q, void *dst, const void *src,
                                size_t bytes, sg__copy_kind kind) {
  static const char fn[] = "sg__device_cuda.copy";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (bytes == 0) return SG_OK;
  if (!dst || !src) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  enum cudaMemcpyKind k;
  switch (kind) {
    case SG_COPY_H2D: k = cudaMemcpyHostToDevice; break;
    case SG_COPY_D2H: k = cudaMemcpyDeviceToHost; break;
    case SG_COPY_D2D: k = cudaMemcpyDeviceToDevice; break;
    default: return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown copy kind (%d)", fn, (int)kind);
  }
  SG_TRY(sg__cuda_enter(d, fn));
  cudaStream_t s = sg__cuda_stream(d, q);
  /* Pinned host memory where the kind says device memory (an offloaded optimizer state, which
   * checkpoints and sg_get_master read like device state): the kind follows the pointers, as
   * cudaMemcpyDefault would have it. */
  const int src_host = kind == SG_COPY_H2D || sg__cuda_is_pinned(src);
  const int dst_host = kind == SG_COPY_D2H || sg__cuda_is_pinned(dst);
  if (src_host && dst_host) { /* in stream order, then on the host */
    SG_TRY(sg__cuda_wait(d, NULL, s, INT64_MAX, fn));
    memcpy(dst, src, bytes);
    return SG_OK;
  }
  kind = src_host ? SG_COPY_H2D : dst_host ? SG_COPY_D2H : SG_COPY_D2D;
  k = src_host ? cudaMemcpyHostToDevice : dst_host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
  const void *host = kind == SG_COPY_H2D ? src : kind == SG_COPY_D2H ? dst : NULL;
  if (host && !sg__cuda_is_pinned(host)) return sg__cuda_copy_staged(d, q, dst, src, bytes, kind, fn);
  SG__CU(cudaMemcpyAsync(dst, src, bytes, k, s), fn);
  /* Host memory is the caller's again when a compute-queue H2D/D2H returns. */
  if (q == SG_Q_COMPUTE && kind != SG_COPY_D2D) return sg__cuda_wait(d, NULL, s, INT64_MAX, fn);
  return sg__cuda_after(d, q, fn);
}

static sg_status sg__cudev_zero(sg__device *dev, sg__queue q, void *dst, size_t bytes) {
  static const char fn[] = "sg__device_cuda.zero";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (bytes == 0) return SG_OK;
  if (!dst) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU(cudaMemsetAsync(dst, 0, bytes, sg__cuda_stream(d, q)), fn);
  return sg__cuda_after(d, q, fn);
}

/* ---- kernels ---------------------------------------------------------------------------- */

int sg__cuda_dtype_ok(int dt) { return dt == SG_F32 || dt == SG_BF16 || dt == SG_F16; }

/* accumulate and cast: one launcher of that shape over dst and src, each f32/bf16/f16. */
typedef struct sg__cuda_conv_op {
  const char *fn;       /* the vtable op, for messages */
  const char *dst_name; /* its destination's name in messages */
  int (*launch)(sg__cuda_launch L, void *dst, int dst_dtype, const void *src, int src_dtype,
                size_t n);
  const char *call; /* the launcher, for CUDA errors */
} sg__cuda_conv_op;

static sg_status sg__cuda_convert(sg__device *dev, sg__queue q, void *dst, int dst_dtype,
                                  const void *src, int src_dtype, size_t n,
                                  const sg__cuda_conv_op *op) {
  const char *fn = op->fn;
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (!sg__cuda_dtype_ok(dst_dtype) || !sg__cuda_dtype_ok(src_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype (%s %d, src %d)", fn, op->dst_name,
                   dst_dtype, src_dtype);
  if (n == 0) return SG_OK;
  if (!dst || !src) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  const int rc = op->launch(sg__cuda_launch_on(d, q), dst, dst_dtype, src, src_dtype, n);
  if (rc != 0) return sg__cuda_err((cudaError_t)rc, fn, op->call, __FILE__, __LINE__);
  return sg__cuda_after(d, q, fn);
}

/* any acc dtype: f32/bf16 accumulators, and f16 gradient slots (sg_grad_add) */
static sg_status sg__cudev_accumulate(sg__device *dev, sg__queue q, void *acc, int acc_dtype,
                                      const void *src, int src_dtype, size_t n) {
  static const sg__cuda_conv_op op = {"sg__device_cuda.accumulate", "acc", sg__cuda_accumulate,
                                      "sg__cuda_accumulate"};
  return sg__cuda_convert(dev, q, acc, acc_dtype, src, src_dtype, n, &op);
}

static sg_status sg__cudev_cast(sg__device *dev, sg__queue q, void *dst, int dst_dtype,
                                const void *src, int src_dtype, size_t n) {
  static const sg__cuda_conv_op op = {"sg__device_cuda.cast", "dst", sg__cuda_cast,
                                      "sg__cuda_cast"};
  return sg__cuda_convert(dev, q, dst, dst_dtype, src, src_dtype, n, &op);
}

static sg_status sg__cudev_reduce_sum(sg__device *dev, sg__queue q, void *dst,
                                      const void *const *srcs, int nsrc, int dtype, size_t n) {
  static const char fn[] = "sg__device_cuda.reduce_sum";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (!sg__cuda_dtype_ok(dtype) && dtype != 3)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype (%d)", fn, dtype);
  if (nsrc < 1 || nsrc > SG__CUDA_MAX_SRCS)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: nsrc must be in 1..%d (%d)", fn, SG__CUDA_MAX_SRCS,
                   nsrc);
  if (n == 0) return SG_OK;
  if (!dst || !srcs) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  for (int k = 0; k < nsrc; k++)
    if (!srcs[k]) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: srcs[%d] is NULL", fn, k);
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_reduce_sum(sg__cuda_launch_on(d, q), dst, srcs, nsrc, dtype, n), fn);
  return sg__cuda_after(d, q, fn);
}

/* Grows queue q's stream-ordered sumsq scratch; the old one is freed in stream order after its
 * last use (sumsq waits for its kernel anyway). One per queue: a job on the worker and the
 * caller's thread may both be in sumsq. */
static sg_status sg__cuda_red_reserve(sg__cuda_dev *d, sg__queue q, size_t bytes,
                                      const char *fn) {
  cudaStream_t s = sg__cuda_stream(d, q);
  if (bytes <= d->red_cap[q]) return SG_OK;
  if (d->red_dev[q]) {
    SG__CU(cudaFreeAsync(d->red_dev[q], s), fn);
    d->red_dev[q] = NULL;
    d->red_cap[q] = 0;
  }
  SG__CU(cudaMallocAsync(&d->red_dev[q], bytes, s), fn);
  d->red_cap[q] = bytes;
  return SG_OK;
}

/* The checks of sumsq and sumsq_to (d is not NULL). */
static sg_status sg__cuda_sumsq_check(sg__cuda_dev *d, sg__queue q, const void *x, int dtype,
                                      size_t n, const char *fn) {
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  if (!sg__cuda_dtype_ok(dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype (%d)", fn, dtype);
  if (n > 0 && !x) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  return SG_OK;
}

/* The two kernels of sumsq on queue q (arguments checked), writing the pair to result2 (device
 * memory; NULL: the scratch's first two doubles); nothing waited for. */
static sg_status sg__cuda_sumsq_launch(sg__cuda_dev *d, sg__queue q, const void *x, int dtype,
                                       size_t n, double *result2, const char *fn) {
  SG_TRY(sg__cuda_enter(d, fn));
  SG_TRY(sg__cuda_red_reserve(d, q, sg__cuda_sumsq_scratch_bytes(n), fn));
  if (!result2) result2 = (double *)d->red_dev[q]; /* the first two doubles of the scratch */
  SG__CU_LAUNCH(sg__cuda_sumsq(sg__cuda_launch_on(d, q), x, dtype, n, d->red_dev[q], result2), fn);
  return SG_OK;
}

static sg_status sg__cudev_sumsq(sg__device *dev, sg__queue q, const void *x, int dtype, size_t n,
                                 double *sumsq, double *nonfinite) {
  static const char fn[] = "sg__device_cuda.sumsq";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !sumsq || !nonfinite) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__cuda_sumsq_check(d, q, x, dtype, n, fn));
  *sumsq = 0.0;
  *nonfinite = 0.0;
  if (n == 0) return SG_OK;
  SG_TRY(sg__cuda_sumsq_launch(d, q, x, dtype, n, NULL, fn));
  cudaStream_t s = sg__cuda_stream(d, q);
  double *host = d->red_host + 2 * (int)q;
  SG__CU(cudaMemcpyAsync(host, d->red_dev[q], 2 * sizeof(double), cudaMemcpyDeviceToHost, s), fn);
  SG_TRY(sg__cuda_wait(d, NULL, s, INT64_MAX, fn));
  *sumsq = host[0];
  *nonfinite = host[1];
  return SG_OK;
}

static sg_status sg__cudev_sumsq_to(sg__device *dev, sg__queue q, const void *x, int dtype,
                                    size_t n, double *dev2) {
  static const char fn[] = "sg__device_cuda.sumsq_to";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !dev2) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__cuda_sumsq_check(d, q, x, dtype, n, fn));
  SG_TRY(sg__cuda_sumsq_launch(d, q, x, dtype, n, dev2, fn));
  return sg__cuda_after(d, q, fn);
}

/* One kernel of one thread, queue-ordered; the host reads host_out later without a wait. */
static sg_status sg__cudev_step_outcome(sg__device *dev, sg__queue q, const double *ss_dev,
                                        const struct sg_elem_step_in *in, void *out_dev,
                                        void *host_out, uint64_t seq) {
  static const char fn[] = "sg__device_cuda.step_outcome";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !ss_dev || !in || !out_dev)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU_LAUNCH(sg__cuda_step_outcome(sg__cuda_launch_on(d, q), ss_dev, in, out_dev, host_out,
                                      seq), fn);
  return sg__cuda_after(d, q, fn);
}

/* ---- timing marks: events with timing, read against each other ------------------------- */

static void sg__cudev_marks_destroy(sg__device *dev, void *marks, size_t n) {
  if (!dev || !marks) return;
  cudaEvent_t *ev = marks;
  SG__CUDA_SCOPE(sg__cuda(dev));
  (void)sg__cuda_enter(sg__cuda(dev), "sg__device_cuda.marks_destroy");
  for (size_t i = 0; i < n; i++)
    if (ev[i]) (void)cudaEventDestroy(ev[i]);
  free(ev);
}

static sg_status sg__cudev_marks_create(sg__device *dev, size_t n, void **marks) {
  static const char fn[] = "sg__device_cuda.marks_create";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !marks || n == 0) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad argument", fn);
  cudaEvent_t *ev = calloc(n, sizeof *ev);
  if (!ev) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory (%zu marks)", fn, n);
  sg_status st = sg__cuda_enter(d, fn);
  for (size_t i = 0; i < n && st == SG_OK; i++) {
    cudaError_t e = cudaEventCreateWithFlags(&ev[i], 0); /* 0: timing enabled */
    if (e != cudaSuccess) st = sg__cuda_err(e, fn, "cudaEventCreateWithFlags", __FILE__, __LINE__);
  }
  if (st != SG_OK) {
    sg__cudev_marks_destroy(dev, ev, n);
    return st;
  }
  *marks = ev;
  return SG_OK;
}

static sg_status sg__cudev_mark(sg__device *dev, void *marks, size_t i, sg__queue q) {
  static const char fn[] = "sg__device_cuda.mark";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !marks) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU(cudaEventRecord(((cudaEvent_t *)marks)[i], sg__cuda_stream(d, q)), fn);
  return SG_OK;
}

static sg_status sg__cudev_mark_elapsed(sg__device *dev, void *marks, size_t from, size_t to,
                                        double *us) {
  static const char fn[] = "sg__device_cuda.mark_elapsed";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !marks || !us) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  const cudaEvent_t *ev = marks;
  SG_TRY(sg__cuda_enter(d, fn));
  float ms = 0;
  cudaError_t e = cudaEventElapsedTime(&ms, ev[from], ev[to]);
  if (e == cudaErrorInvalidResourceHandle) {
    (void)cudaGetLastError(); /* an event never recorded: not sticky, not a device failure */
    return sg__err(SG_ERR_INVALID_STATE, "%s: mark %zu or %zu was never recorded", fn, from, to);
  }
  if (e != cudaSuccess) return sg__cuda_err(e, fn, "cudaEventElapsedTime", __FILE__, __LINE__);
  *us = (double)ms * 1e3;
  return SG_OK;
}

/* ---- lifetime --------------------------------------------------------------------------- */

static void sg__cudev_destroy(sg__device *dev) {
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return;
  /* Queued jobs run (or are skipped after a failure) before the worker exits; a job stuck in a
   * collective is bounded by that communicator's own deadline, so the join ends. */
  if (d->q_ready) sg__jobq_stop(&d->q);
  (void)cudaSetDevice(d->ordinal);
  /* The frees below synchronize the device without a deadline: first our own streams, bounded
   * (sg__cuda_quiesce); a device still stuck after that keeps its memory. The caller's compute
   * stream is not touched: it may already be gone. */
  const int can_free = !d->comm || sg__cuda_quiesce(d, d->own_compute, "sg__device_cuda.destroy") == 0;
  /* Stream-ordered frees on the comm stream after the table's last use. The sumsq scratch has
   * no pending use. */
  if (d->comm && can_free) {
    for (int q = 0; q < 2; q++)
      if (d->use_ev[q]) (void)cudaStreamWaitEvent(d->comm, d->use_ev[q], 0);
    if (d->rep && cudaEventRecord(d->lane_ev, d->rep) == cudaSuccess)
      (void)cudaStreamWaitEvent(d->comm, d->lane_ev, 0);
    if (d->out && cudaEventRecord(d->out_ev, d->out) == cudaSuccess)
      (void)cudaStreamWaitEvent(d->comm, d->out_ev, 0);
    for (int q = 0; q < 2; q++)
      if (d->red_dev[q]) (void)cudaFreeAsync(d->red_dev[q], d->comm);
  }
  if (can_free) {
    sg__cuda_tabs_release(d, d->comm);
    if (d->red_host) (void)cudaFreeHost(d->red_host);
    for (int q = 0; q < 2; q++)
      if (d->cstage[q]) (void)cudaFreeHost(d->cstage[q]);
  }
  while (d->cretired) {
    sg__cuda_stage *c = d->cretired;
    d->cretired = c->next;
    if (can_free) (void)cudaFreeHost(c->base);
    free(c);
  }
  free(d->tabs);
  for (int i = 0; i < SG__CUDA_RING; i++)
    if (d->ring[i]) (void)cudaEventDestroy(d->ring[i]);
  if (d->order_ev) (void)cudaEventDestroy(d->order_ev);
  for (int i = 0; d->ring2 && i < SG__CUDA_RING; i++)
    if (d->ring2[i]) (void)cudaEventDestroy(d->ring2[i]);
  free(d->ring2);
  if (d->lane_ev) (void)cudaEventDestroy(d->lane_ev);
  if (d->rep) (void)cudaStreamDestroy(d->rep);
  for (int i = 0; d->ring3 && i < SG__CUDA_RING; i++)
    if (d->ring3[i]) (void)cudaEventDestroy(d->ring3[i]);
  free(d->ring3);
  if (d->out_ev) (void)cudaEventDestroy(d->out_ev);
  if (d->out) (void)cudaStreamDestroy(d->out);
  for (int q = 0; q < 2; q++)
    if (d->use_ev[q]) (void)cudaEventDestroy(d->use_ev[q]);
  if (d->comm) (void)cudaStreamDestroy(d->comm);
  if (d->own_compute) (void)cudaStreamDestroy(d->own_compute);
  if (d->sync_ready) {
    pthread_mutex_destroy(&d->tab_mu);
    pthread_mutex_destroy(&d->mu);
  }
  if (d->q_ready) sg__jobq_destroy(&d->q);
  free(d);
}

static sg_status sg__cudev_twin(sg__device *dev, sg__device **out);

static const sg__device_ops sg__cuda_ops = {
    "cuda",
    sg__cudev_alloc,
    sg__cudev_free,
    sg__cudev_host_alloc,
    sg__cudev_host_free,
    sg__cudev_copy,
    sg__cudev_zero,
    sg__cudev_update,
    sg__cudev_accumulate,
    sg__cudev_cast,
    sg__cudev_sumsq,
    sg__cudev_sumsq_to,
    sg__cudev_reduce_sum,
    sg__cudev_comm_submit,
    sg__cudev_comm_wait,
    sg__cudev_compute_wait_comm,
    sg__cudev_comm_attach,
    sg__cudev_comm_detach,
    sg__cudev_sync,
    sg__cudev_set_stream,
    sg__cudev_marks_create,
    sg__cudev_marks_destroy,
    sg__cudev_mark,
    sg__cudev_mark_elapsed,
    sg__cudev_destroy,
    NULL, /* alloc_zeroed: alloc, then zero */
    NULL, /* zero_release: zero (device memory stays allocated) */
    sg__cudev_comm_start,
    sg__cudev_step_outcome,
    sg__cudev_comm_submit_lane,
    sg__cudev_compute_wait_job,
    sg__cudev_copy_out,
    sg__cudev_outer_delta, /* sg_cuda_replica.c */
    sg__cudev_outer_step,
    sg__cudev_code_encode,
    sg__cudev_code_decode,
    sg__cudev_twin,
};

sg_status sg__device_cuda_pick(int cuda_device, int *ordinal, const char *fn) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return sg__err_at(SG_ERR_CUDA, __FILE__, __LINE__,
                      "%s: no CUDA device found (cudaGetDeviceCount: %s)", fn,
                      e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  }
  if (cuda_device >= count)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cuda_device %d out of range (%d devices)", fn,
                   cuda_device, count);
  if (cuda_device < 0) SG__CU(cudaGetDevice(&cuda_device), fn);
  *ordinal = cuda_device;
  return SG_OK;
}

/* The mutexes; 0 or an errno value. */
static int sg__cuda_sync_init(sg__cuda_dev *d) {
  int rc = pthread_mutex_init(&d->mu, NULL);
  if (rc != 0) return rc;
  if ((rc = pthread_mutex_init(&d->tab_mu, NULL)) != 0) pthread_mutex_destroy(&d->mu);
  return rc;
}

/* Streams, events, the sumsq result pairs; d->ordinal is set and current. */
static sg_status sg__cuda_init(sg__cuda_dev *d) {
  static const char fn[] = "sg__device_cuda_create";
  int least = 0, greatest = 0, sms = 0;
  SG__CU(cudaDeviceGetStreamPriorityRange(&least, &greatest), fn);
  SG__CU(cudaStreamCreateWithPriority(&d->comm, cudaStreamNonBlocking, greatest), fn);
  SG__CU(cudaStreamCreateWithFlags(&d->own_compute, cudaStreamNonBlocking), fn);
  d->compute = d->own_compute;
  SG__CU(cudaEventCreateWithFlags(&d->order_ev, cudaEventDisableTiming), fn);
  for (int q = 0; q < 2; q++)
    SG__CU(cudaEventCreateWithFlags(&d->use_ev[q], cudaEventDisableTiming), fn);
  for (int i = 0; i < SG__CUDA_RING; i++)
    SG__CU(cudaEventCreateWithFlags(&d->ring[i], cudaEventDisableTiming), fn);
  SG__CU(cudaMallocHost((void **)&d->red_host, 4 * sizeof(double)), fn);
  SG__CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d->ordinal), fn);
  d->max_blocks = sms > 0 ? 8 * sms : 256;
  return SG_OK;
}

sg_status sg__device_cuda_create(int rank, int cuda_device, sg__device **out) {
  static const char fn[] = "sg__device_cuda_create";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  if (rank < 0) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: rank must be >= 0 (%d)", fn, rank);
  if (cuda_device < -1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cuda_device must be >= -1 (%d)", fn, cuda_device);
  int ordinal = 0;
  SG_TRY(sg__device_cuda_pick(cuda_device, &ordinal, "sg__device_cuda_create"));
  sg__cuda_dev *d = (sg__cuda_dev *)calloc(1, sizeof *d);
  if (!d) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: device struct", fn);
  d->base.ops = &sg__cuda_ops;
  d->base.kind = SG_DEVICE_CUDA;
  d->base.rank = rank;
  d->ordinal = ordinal;
  SG__CUDA_SCOPE(d); /* the caller's current device stays as it is */
  int rc = sg__cuda_sync_init(d);
  if (rc == 0) {
    d->sync_ready = 1;
    rc = sg__jobq_init(&d->q, &sg__cuda_jobq_ops, d, 1);
    d->q_ready = rc == 0;
  }
  if (rc != 0) {
    sg__cudev_destroy(&d->base);
    return sg__err_at(SG_ERR_INTERNAL, __FILE__, __LINE__, "%s: pthread init failed (%d)", fn, rc);
  }
  sg_status st = SG_OK;
  SG_TRY_GOTO(sg__cuda_enter(d, fn), st, fail);
  SG_TRY_GOTO(sg__cuda_init(d), st, fail);
  SG_LOG(SG_LOG_INFO, rank, "cuda device %d: %d blocks per grid-stride launch", ordinal,
         d->max_blocks);
  *out = &d->base;
  return SG_OK;
fail:
  sg__cudev_destroy(&d->base);
  return st;
}

/* A second device on the same GPU: its own streams, events and comm worker; memory of either
 * works on both (one process, one GPU, its primary context). The caller's compute stream is
 * not passed on: the twin's compute stream is its own. */
static sg_status sg__cudev_twin(sg__device *dev, sg__device **out) {
  sg__cuda_dev *d = sg__cuda(dev);
  if (!d || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__device_cuda.twin: NULL argument");
  return sg__device_cuda_create(d->base.rank, d->ordinal, out);
}
