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

#include <errno.h>   /* ETIMEDOUT */
#include <pthread.h> /* the host-driven comm worker */
#include <stdint.h>  /* uint64_t, INT64_MAX */
#include <stdlib.h> /* calloc, free */
#include <string.h> /* memcpy, memset */
#include <stdio.h>  /* snprintf */
#include <time.h>   /* nanosleep */

#include <cuda_runtime.h> /* the runtime API: only this file (and kernels/cuda) include it */

#include "../../kernels/cuda/sg_cuda_kernels.h" /* sg__cuda_* launchers */
#include "sg_device.h"                          /* sg__device, sg__device_ops */
#include "sg_device_cuda.h"                     /* sg__device_cuda_pick, _mem_kind */
#include "sg_jobq.h"                            /* the comm job queue */

#define SG__CUDA_RING 1024 /* ticket events; power of two */
#define SG__CUDA_FAIL_CAP 512
/* Attachments at a time: an engine's shard channel and a hybrid engine's replica channel. */
#define SG__CUDA_MAX_ATT 2
/* Segment table cache bounds: past either one, every cached table is dropped (after a host wait
 * for their last users) before the next upload. Far above what an engine needs: one table per
 * bucket, a few dozen bytes per segment. */
#define SG__CUDA_TAB_MAX 4096
#define SG__CUDA_TAB_MAX_BYTES ((size_t)64 << 20)
#define SG__CUDA_STAGE_CHUNK ((size_t)64 << 10)
#define SG__CUDA_COPY_CHUNK ((size_t)8 << 20) /* pinned staging of pageable copies, per queue */
/* A free after a failure waits this long past the attachment's deadline for the aborted
 * collectives' kernels to leave before it gives the memory up as lost. */
#define SG__CUDA_FREE_GRACE_MS 2000

/* One cached update segment table, keyed by the segments' content. */
typedef struct sg__cuda_segtab {
  uint64_t hash;
  int nsegs;
  sg__seg *segs;          /* host copy of the key */
  void *dev;              /* device table (cudaMallocAsync on the upload stream) */
  size_t bytes;
  uint64_t work;          /* groups of 4 over all segments */
  cudaEvent_t ready;      /* recorded after the upload */
  cudaStream_t synced[2]; /* streams known to run after the upload: no wait needed there */
} sg__cuda_segtab;

/* Pinned staging for table uploads: chunks handed out front to back, never reused while the
 * cache lives (an upload may still read its slice), all freed together. Also the outgrown
 * staging buffers of pageable copies, kept until destroy (cudaFreeHost waits for the whole
 * device, with no deadline). */
typedef struct sg__cuda_stage {
  struct sg__cuda_stage *next;
  char *base;
  size_t cap, used;
} sg__cuda_stage;

typedef struct sg__cuda_dev {
  sg__device base;
  int ordinal;
  int max_blocks;       /* grid-stride launches: 8 blocks per SM */
  cudaStream_t compute; /* the caller's stream or own_compute */
  cudaStream_t own_compute;
  cudaStream_t comm;
  cudaEvent_t order_ev; /* compute -> comm ordering at submit, stream switches */
  cudaEvent_t ring[SG__CUDA_RING];
  /* The replica lane (issue 28, defect 2): a hybrid engine's replica channel, stream-ordered
   * beside its shard channel, gets a stream of its own, made at its attach, so that a slow
   * cross-node all-reduce does not hold up the next bucket's reduce-scatter. Its jobs
   * (comm_submit_lane 1) run their SG_Q_COMM work on it, after the comm stream's work so far
   * (lane_ev); a ticket's wait covers both lanes: ring[] on the job's lane, ring2[] recorded on
   * the other lane after the job. NULL while no replica channel is attached stream-ordered. */
  cudaStream_t rep;
  cudaEvent_t lane_ev;
  cudaEvent_t *ring2; /* SG__CUDA_RING events, with rep */
  sg__jobq q; /* comm jobs: tickets, the first failure, the worker */
  int q_ready;
  int sync_ready; /* mu and tab_mu exist */
  /* Under mu: the ring bookkeeping and the attachment. */
  pthread_mutex_t mu;
  uint64_t ring_tk[SG__CUDA_RING];        /* the ticket that last used each slot */
  unsigned char ring_two[SG__CUDA_RING];  /* 1: that ticket's ring2 event covers the other lane */
  unsigned char ring_host[SG__CUDA_RING]; /* 1: that ticket is host-driven (queue waits) */
  uint64_t done_ticket; /* every stream-ordered ticket <= this one is known to be complete */
  sg__comm_attach att[SG__CUDA_MAX_ATT]; /* the attached communicators, in attach order */
  int attached;    /* how many */
  int stream_mode; /* 1: jobs are stream-ordered (the attachments say so) */
  pthread_mutex_t tab_mu; /* the segment-table cache and use_ev: updates on either thread */
  /* update segment tables (see "segment tables" below) */
  struct sg__cuda_segtab *tabs;
  int ntabs, tabs_cap;
  int tab_next;            /* where the next lookup looks first (the entry after the last hit) */
  size_t tab_bytes;        /* device bytes of all cached tables */
  struct sg__cuda_stage *stage; /* pinned staging chunks of the uploads, newest first */
  cudaEvent_t use_ev[2];   /* per queue: after its last upload or update kernel */
  uint64_t tab_uploads;    /* tables uploaded so far (log line on eviction) */
  /* sumsq: device scratch (stream-ordered allocation) and a pinned result pair, per queue */
  void *red_dev[2];
  size_t red_cap[2];
  double *red_host; /* 4 doubles: queue q's pair at 2q */
  /* per queue: pinned staging of copies from and to pageable host memory */
  void *cstage[2];
  size_t cstage_cap[2];
  struct sg__cuda_stage *cretired; /* outgrown cstage buffers (base only), freed at destroy */
  int leaking; /* a free could not wait for the GPU: memory is given up from then on */
} sg__cuda_dev;

/* ---- errors ---------------------------------------------------------------------------- */

/* Every CUDA failure: status, function, the call, CUDA's name and text, file:line. Running out
 * of memory is SG_ERR_OUT_OF_MEMORY so that the engine can report it as such. */
static sg_status sg__cuda_err(cudaError_t e, const char *fn, const char *call, const char *file,
                              int line) {
  sg_status st = e == cudaErrorMemoryAllocation ? SG_ERR_OUT_OF_MEMORY : SG_ERR_CUDA;
  if (e == cudaErrorMemoryAllocation) (void)cudaGetLastError(); /* not sticky: clear it */
  return sg__err_at(st, file, line, "%s: %s failed: %s (%s)", fn, call, cudaGetErrorString(e),
                    cudaGetErrorName(e));
}

#define SG__CU(call, fn)                                                                     \
  do {                                                                                       \
    cudaError_t sg__e_ = (call);                                                             \
    if (sg__e_ != cudaSuccess) return sg__cuda_err(sg__e_, (fn), #call, __FILE__, __LINE__); \
  } while (0)

/* A launcher's result (a cudaError_t value). */
#define SG__CU_LAUNCH(expr, fn)                                                                   \
  do {                                                                                            \
    int sg__rc_ = (expr);                                                                         \
    if (sg__rc_ != 0) return sg__cuda_err((cudaError_t)sg__rc_, (fn), #expr, __FILE__, __LINE__); \
  } while (0)

static sg__cuda_dev *sg__cuda(sg__device *d) { return (sg__cuda_dev *)d; }

static int sg__cuda_hooks_get(sg__cuda_dev *d, sg__comm_attach h[]);

/* Aborts every stream-ordered communicator attached (a hybrid engine's shard and replica
 * channels): after one failed, the other's collectives may wait forever for peers that gave
 * up, and every cudaFree/cudaFreeHost would then block behind their kernels. */
static void sg__cuda_abort_all(sg__cuda_dev *d) {
  sg__comm_attach h[SG__CUDA_MAX_ATT];
  const int hooked = sg__cuda_hooks_get(d, h);
  for (int i = 0; i < hooked; i++)
    if (h[i].abort) h[i].abort(h[i].arg);
}

/* Keeps the first failure; the engine is broken from then on and every wait returns it. The
 * text is the calling thread's last error (the thread that saw the failure). */
static sg_status sg__cuda_record_failure(sg__cuda_dev *d, sg_status st) {
  sg__cuda_abort_all(d);
  return sg__jobq_fail(&d->q, st, NULL);
}

/* The recorded failure with its text in the calling thread's error; SG_OK while healthy. */
static sg_status sg__cuda_failed(sg__cuda_dev *d) { return sg__jobq_failed(&d->q); }

/* Copies of the attachments when they take part in waits (stream-ordered): how many; 0
 * otherwise. */
static int sg__cuda_hooks_get(sg__cuda_dev *d, sg__comm_attach h[]) {
  pthread_mutex_lock(&d->mu);
  const int have = d->stream_mode ? d->attached : 0;
  for (int i = 0; i < have; i++) h[i] = d->att[i];
  pthread_mutex_unlock(&d->mu);
  return have;
}

/* The calling thread runs a host-driven job of d (its comm work completes call by call). */
static int sg__cuda_in_host_job(sg__cuda_dev *d) {
  if (!sg__jobq_in_job(&d->q)) return 0;
  pthread_mutex_lock(&d->mu);
  const int host = !d->stream_mode;
  pthread_mutex_unlock(&d->mu);
  return host;
}

/* Binds the calling thread to our GPU: the engine may run on another thread than the one that
 * created the device, and the runtime's current device is per thread. */
static sg_status sg__cuda_enter(sg__cuda_dev *d, const char *fn) {
  if (sg__device_cuda_current() == d->ordinal) return SG_OK;
  SG__CU(cudaSetDevice(d->ordinal), fn);
  return SG_OK;
}

/* Every vtable call leaves the calling thread's current device as it found it (the caller's
 * framework, e.g. torch, keeps its own): SG__CUDA_SCOPE(d) at the top of a call restores it on
 * every return path. */
typedef struct sg__cuda_scope {
  int prev; /* -1: unknown, nothing to restore */
} sg__cuda_scope;

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

static sg__cuda_scope sg__cuda_scope_begin(const sg__cuda_dev *d) {
  (void)d;
  sg__cuda_scope sc = {sg__device_cuda_current()};
  return sc;
}

static void sg__cuda_scope_end(const sg__cuda_scope *sc) {
  int cur = -1;
  if (sc->prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != sc->prev)
    (void)cudaSetDevice(sc->prev);
}

#if defined(__GNUC__) /* gcc, clang */
#define SG__CUDA_SCOPE(d) \
  __attribute__((cleanup(sg__cuda_scope_end))) const sg__cuda_scope sg__scope_ = sg__cuda_scope_begin(d)
#else
#error "src/device/cuda.c restores the current CUDA device with __attribute__((cleanup))"
#endif

static sg_status sg__cuda_check_queue(sg__queue q, const char *fn) {
  if (q != SG_Q_COMPUTE && q != SG_Q_COMM)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown queue (%d)", fn, (int)q);
  return SG_OK;
}

/* The device whose replica-lane job this thread submits or runs (stream-ordered jobs run
 * inline, on the submitting thread): its SG_Q_COMM work goes to the replica stream. */
static _Thread_local const struct sg__cuda_dev *sg__cuda_lane_of;

static cudaStream_t sg__cuda_stream(sg__cuda_dev *d, sg__queue q) {
  if (q != SG_Q_COMM) return d->compute;
  return sg__cuda_lane_of == d && d->rep ? d->rep : d->comm;
}

static sg__cuda_launch sg__cuda_launch_on(sg__cuda_dev *d, sg__queue q) {
  sg__cuda_launch L;
  L.stream = (void *)sg__cuda_stream(d, q);
  L.max_blocks = d->max_blocks;
  return L;
}

/* ---- polling waits ------------------------------------------------------------------------ */

/* Spin briefly (collectives of small buckets finish in microseconds), then sleep with a growing
 * pause up to SG__CUDA_NAP_MAX_NS: a wait sits between GPU phases (the norm, then the update), so a
 * nap of a millisecond would leave the GPU idle that long; 50 us still frees the core. */
#define SG__CUDA_NAP_MAX_NS 50000L
static void sg__cuda_backoff(unsigned iter) {
  if (iter < 64) return;
  long ns = 1000L << (iter < 70 ? iter - 64 : 6);
  struct timespec ts = {0, ns > SG__CUDA_NAP_MAX_NS ? SG__CUDA_NAP_MAX_NS : ns};
  nanosleep(&ts, NULL);
}

/* Waits for ev (or, when ev is NULL, for all of stream s) until deadline_ms. Comm failures seen
 * through the hooks and timeouts are recorded: the comm queue's state is unknown afterwards. */
static sg_status sg__cuda_wait(sg__cuda_dev *d, cudaEvent_t ev, cudaStream_t s, int64_t deadline_ms,
                               const char *fn) {
  /* The device's own waits (copies, sumsq, host-driven jobs) end at the attached communicator's
   * timeout: the GPU work they wait for may sit behind a collective that never completes. */
  if (deadline_ms == INT64_MAX) {
    pthread_mutex_lock(&d->mu);
    const int timeout_ms = d->attached ? d->att[0].timeout_ms : 0;
    pthread_mutex_unlock(&d->mu);
    deadline_ms = sg__deadline(timeout_ms);
  }
  for (unsigned iter = 0;; iter++) {
    cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
    if (e == cudaSuccess) return SG_OK;
    /* NotReady is not a failure, but the runtime keeps it as the thread's last error, which the
     * next launcher's cudaGetLastError would report: clear it. */
    if (e == cudaErrorNotReady) (void)cudaGetLastError();
    if (e != cudaErrorNotReady)
      return sg__cuda_record_failure(
          d, sg__cuda_err(e, fn, ev ? "cudaEventQuery" : "cudaStreamQuery", __FILE__, __LINE__));
    sg__comm_attach h[SG__CUDA_MAX_ATT];
    const int hooked = sg__cuda_hooks_get(d, h);
    for (int i = 0; i < hooked; i++) {
      sg_status st = h[i].poll ? h[i].poll(h[i].arg) : SG_OK;
      if (st != SG_OK) return sg__cuda_record_failure(d, sg__err_prefix(st, fn));
    }
    if (deadline_ms != INT64_MAX && sg__now_ms() > deadline_ms) {
      return sg__cuda_record_failure( /* which aborts the attached communicators */
          d, sg__err_at(SG_ERR_TIMEOUT, __FILE__, __LINE__,
                        "%s: deadline passed while waiting for the GPU (rank %d, device %d)", fn,
                        d->base.rank, d->ordinal));
    }
    sg__cuda_backoff(iter);
  }
}

/* Host-driven jobs (see the top of the file): their comm-queue work completes before the call
 * that issued it returns. */
static sg_status sg__cuda_after(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (q != SG_Q_COMM || !sg__cuda_in_host_job(d)) return SG_OK;
  return sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn);
}

/* Before SG_Q_COMM work issued outside a job: every queued job finishes first (the order a
 * stream would give). */
static sg_status sg__cuda_enter_queue(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (q != SG_Q_COMM) return SG_OK;
  return sg__jobq_wait_all(&d->q, INT64_MAX, fn);
}

/* The checks of every op that issues work to queue q: a device, a known queue, and (see
 * sg__cuda_enter_queue) the queued jobs finished first. */
static sg_status sg__cuda_queue_op(sg__cuda_dev *d, sg__queue q, const char *fn) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  SG_TRY(sg__cuda_check_queue(q, fn));
  return sg__cuda_enter_queue(d, q, fn);
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

/* Whether streams `first`, d->comm and d->rep ran everything queued before `deadline_ms`
 * (polled, no hooks). */
static int sg__cuda_drained_by(sg__cuda_dev *d, cudaStream_t first, int64_t deadline_ms) {
  for (unsigned iter = 0;; iter++) {
    int busy = 0;
    cudaStream_t s[3] = {first, d->comm, d->rep};
    for (int i = 0; i < 3; i++) {
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

static int sg__cuda_dtype_ok(int dt) { return dt == SG_F32 || dt == SG_BF16 || dt == SG_F16; }

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

/* ---- segment tables ------------------------------------------------------------------------
 *
 * The engine calls update once per bucket, each time with a sub-array of one stable segment
 * array, so that the all-gather of a bucket overlaps the update of the next one. Each distinct
 * table is uploaded once (pinned staging, an asynchronous copy on the calling stream) and kept,
 * so a steady state of per-bucket calls neither uploads nor waits on the host. A table used on
 * another stream than the one it was uploaded on makes that stream wait for its upload once.
 * use_ev[q] marks the last upload or kernel on queue q: eviction (past SG__CUDA_TAB_MAX tables
 * or SG__CUDA_TAB_MAX_BYTES) waits for both on the host, destroy makes the comm stream wait for
 * both before the stream-ordered frees. */

/* Key hash over every field (sr_index included: it changes the stochastic rounding bits; group
 * too: it picks the lr and weight decay). */
static uint64_t sg__cuda_mix(uint64_t h, uint64_t x) {
  h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

static uint64_t sg__cuda_segs_hash(const sg__seg *segs, int n) {
  uint64_t h = (uint64_t)n;
  for (int i = 0; i < n; i++) {
    h = sg__cuda_mix(h, segs[i].shard_off);
    h = sg__cuda_mix(h, segs[i].flat_off);
    h = sg__cuda_mix(h, segs[i].len);
    h = sg__cuda_mix(h, (uint64_t)segs[i].decay);
    h = sg__cuda_mix(h, segs[i].sr_index);
    h = sg__cuda_mix(h, (uint64_t)(uint32_t)segs[i].group);
  }
  return h;
}

/* Field by field: sg__seg has padding that memcmp would read. */
static int sg__cuda_segs_equal(const sg__seg *a, const sg__seg *b, int n) {
  for (int i = 0; i < n; i++)
    if (a[i].shard_off != b[i].shard_off || a[i].flat_off != b[i].flat_off ||
        a[i].len != b[i].len || a[i].decay != b[i].decay || a[i].sr_index != b[i].sr_index ||
        a[i].group != b[i].group)
      return 0;
  return 1;
}

static int sg__cuda_tab_matches(const sg__cuda_segtab *t, uint64_t h, const sg__seg *segs, int n) {
  return t->hash == h && t->nsegs == n && sg__cuda_segs_equal(t->segs, segs, n);
}

/* The cached table of segs, or -1. Calls come bucket after bucket in a fixed order: the entry
 * after the last hit is tried first, then all of them. */
static int sg__cuda_tab_find(const sg__cuda_dev *d, uint64_t h, const sg__seg *segs, int n) {
  if (d->tab_next < d->ntabs && sg__cuda_tab_matches(&d->tabs[d->tab_next], h, segs, n))
    return d->tab_next;
  for (int i = 0; i < d->ntabs; i++)
    if (sg__cuda_tab_matches(&d->tabs[i], h, segs, n)) return i;
  return -1;
}

/* Frees every table and staging chunk. Device tables go in stream order on s: the caller made s
 * wait for their last users (or waited on the host). */
static void sg__cuda_tabs_release(sg__cuda_dev *d, cudaStream_t s) {
  for (int i = 0; i < d->ntabs; i++) {
    sg__cuda_segtab *t = &d->tabs[i];
    if (t->dev && s) (void)cudaFreeAsync(t->dev, s);
    if (t->ready) (void)cudaEventDestroy(t->ready);
    free(t->segs);
  }
  d->ntabs = 0;
  d->tab_next = 0;
  d->tab_bytes = 0;
  /* cudaFreeHost waits for the device: a staging slice whose upload is still queued is safe. */
  while (d->stage) {
    sg__cuda_stage *c = d->stage;
    d->stage = c->next;
    if (c->base) (void)cudaFreeHost(c->base);
    free(c);
  }
}

/* Drops the whole cache when one more table of `bytes` would pass a bound. Rare: a host wait
 * for every upload and kernel that may still read a table. */
static sg_status sg__cuda_tabs_make_room(sg__cuda_dev *d, cudaStream_t s, size_t bytes,
                                         const char *fn) {
  if (d->ntabs < SG__CUDA_TAB_MAX && d->tab_bytes + bytes <= SG__CUDA_TAB_MAX_BYTES) return SG_OK;
  SG_LOG(SG_LOG_INFO, d->base.rank,
         "cuda device %d: dropping %d cached segment tables (%zu bytes, %llu uploads so far)",
         d->ordinal, d->ntabs, d->tab_bytes, (unsigned long long)d->tab_uploads);
  for (int q = 0; q < 2; q++) SG_TRY(sg__cuda_wait(d, d->use_ev[q], NULL, INT64_MAX, fn));
  sg__cuda_tabs_release(d, s);
  return SG_OK;
}

/* A pinned slice of `bytes` (16-byte aligned) for an upload. */
static sg_status sg__cuda_stage_take(sg__cuda_dev *d, size_t bytes, void **out, const char *fn) {
  bytes = (bytes + 15u) & ~(size_t)15u;
  sg__cuda_stage *c = d->stage;
  if (!c || c->cap - c->used < bytes) {
    c = (sg__cuda_stage *)calloc(1, sizeof *c);
    if (!c) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: staging chunk", fn);
    c->cap = bytes > SG__CUDA_STAGE_CHUNK ? bytes : SG__CUDA_STAGE_CHUNK;
    cudaError_t e = cudaMallocHost((void **)&c->base, c->cap);
    if (e != cudaSuccess) {
      free(c);
      return sg__cuda_err(e, fn, "cudaMallocHost(segment staging)", __FILE__, __LINE__);
    }
    c->next = d->stage;
    d->stage = c;
  }
  *out = c->base + c->used;
  c->used += bytes;
  return SG_OK;
}

/* Uploads entry t's table on s through a pinned slice. */
static sg_status sg__cuda_tab_upload(sg__cuda_dev *d, cudaStream_t s, sg__cuda_segtab *t,
                                     const char *fn) {
  void *stage = NULL;
  SG_TRY(sg__cuda_stage_take(d, t->bytes, &stage, fn));
  SG__CU(cudaEventCreateWithFlags(&t->ready, cudaEventDisableTiming), fn);
  SG__CU(cudaMallocAsync(&t->dev, t->bytes, s), fn);
  sg__cuda_seg_table_build(stage, t->segs, t->nsegs, &t->work);
  SG__CU(cudaMemcpyAsync(t->dev, stage, t->bytes, cudaMemcpyHostToDevice, s), fn);
  SG__CU(cudaEventRecord(t->ready, s), fn);
  t->synced[0] = s;
  return SG_OK;
}

/* A new cache entry for segs, uploaded on s; its index in *idx. A failed upload leaves no
 * entry behind (a half-built one would be found again and skip the update). */
static sg_status sg__cuda_tab_add(sg__cuda_dev *d, cudaStream_t s, uint64_t h, const sg__seg *segs,
                                  int n, int *idx, const char *fn) {
  const size_t bytes = sg__cuda_seg_table_bytes(n);
  SG_TRY(sg__cuda_tabs_make_room(d, s, bytes, fn));
  if (d->ntabs == d->tabs_cap) {
    int cap = d->tabs_cap ? 2 * d->tabs_cap : 16;
    sg__cuda_segtab *grown = (sg__cuda_segtab *)realloc(d->tabs, (size_t)cap * sizeof *grown);
    if (!grown) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: segment table cache (%d)", fn, cap);
    d->tabs = grown;
    d->tabs_cap = cap;
  }
  sg__cuda_segtab *t = &d->tabs[d->ntabs];
  memset(t, 0, sizeof *t);
  t->segs = (sg__seg *)malloc((size_t)n * sizeof *segs);
  if (!t->segs) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: segment cache (%d segments)", fn, n);
  memcpy(t->segs, segs, (size_t)n * sizeof *segs);
  t->hash = h;
  t->nsegs = n;
  t->bytes = bytes;
  sg_status st = sg__cuda_tab_upload(d, s, t, fn);
  if (st != SG_OK) {
    if (t->dev) (void)cudaFreeAsync(t->dev, s);
    if (t->ready) (void)cudaEventDestroy(t->ready);
    free(t->segs);
    memset(t, 0, sizeof *t);
    return st;
  }
  d->tab_bytes += bytes;
  d->tab_uploads++;
  *idx = d->ntabs++;
  return SG_OK;
}

/* The device table for segs, usable on s (uploaded now, or s made to wait for its upload). */
static sg_status sg__cuda_tab_get(sg__cuda_dev *d, cudaStream_t s, const sg__seg *segs, int n,
                                  sg__cuda_segtab **out, const char *fn) {
  const uint64_t h = sg__cuda_segs_hash(segs, n);
  int i = sg__cuda_tab_find(d, h, segs, n);
  if (i < 0) SG_TRY(sg__cuda_tab_add(d, s, h, segs, n, &i, fn));
  sg__cuda_segtab *t = &d->tabs[i];
  if (t->synced[0] != s && t->synced[1] != s) {
    SG__CU(cudaStreamWaitEvent(s, t->ready, 0), fn);
    t->synced[1] = s; /* one slot for the other queue (or the caller's latest stream) */
  }
  d->tab_next = i + 1 < d->ntabs ? i + 1 : 0;
  *out = t;
  return SG_OK;
}

static sg_status sg__cuda_update_check(const sg__optim_desc *od, const sg__update_args *a,
                                       const char *fn) {
  if (!od) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", fn);
  if (!od->cuda_update)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: optimizer %s has no CUDA kernel", fn, od->name);
  if (!a) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL args", fn);
  if (!sg__cuda_dtype_ok(a->param_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad param_dtype (%d)", fn, a->param_dtype);
  if (!sg__cuda_dtype_ok(a->grad_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad grad_dtype (%d)", fn, a->grad_dtype);
  if (a->nsegs < 0 || (a->nsegs > 0 && !a->segs))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad segments (%d)", fn, a->nsegs);
  int bad = a->nsegs > 0 && (!a->param || !a->grad);
  for (int k = 0; a->nsegs > 0 && k < od->nstates; k++) bad |= !a->state[k];
  if (bad) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL buffer", fn);
  if (a->param_dtype != SG_F32 && a->nsegs > 0 && !a->master)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s params need a master copy", fn,
                   sg__dtype_name((sg_dtype)a->param_dtype));
  if (!sg__update_groups_ok(a))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad parameter groups (ngroups %d)", fn,
                   a->ngroups);
  return SG_OK;
}

static sg_status sg__cudev_update(sg__device *dev, sg__queue q, const sg__optim_desc *od,
                                  const sg__update_args *a) {
  static const char fn[] = "sg__device_cuda.update";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  SG_TRY(sg__cuda_queue_op(d, q, fn));
  SG_TRY(sg__cuda_update_check(od, a, fn));
  if (a->nsegs == 0) return SG_OK;
  SG_TRY(sg__cuda_enter(d, fn));
  cudaStream_t s = sg__cuda_stream(d, q);
  sg__cuda_segtab *t = NULL;
  pthread_mutex_lock(&d->tab_mu); /* the cache is shared by both queues' threads */
  sg_status st = sg__cuda_tab_get(d, s, a->segs, a->nsegs, &t, fn);
  if (st == SG_OK && t->work > 0) {
    int rc = od->cuda_update(sg__cuda_launch_on(d, q), a, t->dev, t->work);
    if (rc != 0) st = sg__cuda_err((cudaError_t)rc, fn, od->name, __FILE__, __LINE__);
  }
  /* Even after a failure: an upload may have been queued, and eviction and destroy wait here. */
  cudaError_t e = cudaEventRecord(d->use_ev[q], s);
  pthread_mutex_unlock(&d->tab_mu);
  if (e != cudaSuccess) return sg__cuda_err(e, fn, "cudaEventRecord(use_ev)", __FILE__, __LINE__);
  SG_TRY(st);
  return sg__cuda_after(d, q, fn);
}

/* ---- queues ----------------------------------------------------------------------------- */

static cudaEvent_t sg__cuda_ticket_event(sg__cuda_dev *d, uint64_t ticket) {
  return d->ring[ticket & (SG__CUDA_RING - 1)];
}

/* Queue hook, submitting thread, queue lock held: job t's bookkeeping, and for a host-driven
 * job its input (the compute stream now) on its ring event. */
static sg_status sg__cuda_job_mark(void *ctx, uint64_t t, int worker) {
  static const char fn[] = "sg__device_cuda.comm_submit";
  sg__cuda_dev *d = (sg__cuda_dev *)ctx;
  (void)worker;
  const size_t slot = t & (SG__CUDA_RING - 1);
  pthread_mutex_lock(&d->mu);
  const int host = !d->stream_mode;
  cudaError_t e = host ? cudaEventRecord(d->ring[slot], d->compute) : cudaSuccess;
  if (e == cudaSuccess) {
    d->ring_tk[slot] = t;
    d->ring_host[slot] = (unsigned char)host;
    d->ring_two[slot] = (unsigned char)(!host && d->rep != NULL);
  }
  pthread_mutex_unlock(&d->mu);
  if (e != cudaSuccess) return sg__cuda_err(e, fn, "cudaEventRecord(job input)", __FILE__, __LINE__);
  return SG_OK;
}

/* A stream-ordered job: the comm stream after the compute work issued so far, the job, the
 * ticket's ring event after it (recorded even when the job failed: waits look at it). */
static sg_status sg__cuda_run_stream_job(sg__cuda_dev *d, sg__jobq_fn job, void *arg,
                                         uint64_t t, const char *fn) {
  SG__CU(cudaEventRecord(d->order_ev, d->compute), fn);
  SG__CU(cudaStreamWaitEvent(d->comm, d->order_ev, 0), fn);
  /* A replica-lane job: after everything queued on the comm stream so far (its bucket's
   * reduce-scatter), on the replica stream; the comm stream goes on without it. */
  const int lane = sg__cuda_lane_of == d && d->rep;
  cudaStream_t s = lane ? d->rep : d->comm, other = lane ? d->comm : d->rep;
  if (lane) {
    SG__CU(cudaEventRecord(d->lane_ev, d->comm), fn);
    SG__CU(cudaStreamWaitEvent(d->rep, d->lane_ev, 0), fn);
  }
  const sg_status st = job(arg);
  SG__CU(cudaEventRecord(sg__cuda_ticket_event(d, t), s), fn);
  if (d->rep) SG__CU(cudaEventRecord(d->ring2[t & (SG__CUDA_RING - 1)], other), fn);
  return st;
}

/* A host-driven job: its input (the ring event), earlier comm-stream work, the job with its
 * SG_Q_COMM work waited for call by call, then the comm stream idle (its marks). */
static sg_status sg__cuda_run_host_job(sg__cuda_dev *d, sg__jobq_fn job, void *arg, uint64_t t,
                                       const char *fn) {
  SG_TRY(sg__cuda_wait(d, sg__cuda_ticket_event(d, t), NULL, INT64_MAX, fn));
  SG_TRY(sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn));
  SG_TRY(job(arg));
  return sg__cuda_wait(d, NULL, d->comm, INT64_MAX, fn);
}

/* Queue hook: runs job t on the worker or inline. */
static sg_status sg__cuda_job_run(void *ctx, sg__jobq_fn job, void *arg, uint64_t t) {
  static const char fn[] = "sg__device_cuda.comm_job";
  sg__cuda_dev *d = (sg__cuda_dev *)ctx;
  SG_TRY(sg__cuda_enter(d, fn)); /* the worker thread's first job binds it to our GPU */
  pthread_mutex_lock(&d->mu);
  const int stream = d->stream_mode;
  pthread_mutex_unlock(&d->mu);
  const sg_status st = stream ? sg__cuda_run_stream_job(d, job, arg, t, fn)
                              : sg__cuda_run_host_job(d, job, arg, t, fn);
  if (st != SG_OK) sg__cuda_abort_all(d); /* the queue records it: the engine is broken */
  return st;
}

static const sg__jobq_ops sg__cuda_jobq_ops = {sg__cuda_job_mark, sg__cuda_job_run};

static sg_status sg__cudev_comm_submit_lane(sg__device *dev, int lane, sg__job_fn job,
                                            void (*drop)(void *), void *arg, uint64_t *ticket);

static sg_status sg__cudev_comm_submit(sg__device *dev, sg__job_fn job, void (*drop)(void *),
                                       void *arg, uint64_t *ticket) {
  return sg__cudev_comm_submit_lane(dev, 0, job, drop, arg, ticket);
}

static sg_status sg__cudev_comm_submit_lane(sg__device *dev, int lane, sg__job_fn job,
                                            void (*drop)(void *), void *arg, uint64_t *ticket) {
  static const char fn[] = "sg__device_cuda.comm_submit";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !job || !ticket) {
    if (drop) drop(arg);
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  }
  *ticket = 0;
  const sg_status st = sg__cuda_enter(d, fn);
  if (st != SG_OK) {
    if (drop) drop(arg);
    return st;
  }
  /* host-driven jobs run on the worker, all on the comm stream: the lane is stream-ordered */
  const struct sg__cuda_dev *was = sg__cuda_lane_of;
  sg__cuda_lane_of = lane == 1 ? d : NULL;
  const sg_status sub = sg__jobq_submit(&d->q, job, drop, arg, ticket);
  sg__cuda_lane_of = was;
  return sub;
}

/* The replica lane's stream and events (kept until destroy: a detach and a new attach reuse
 * them). */
static sg_status sg__cuda_lane_open(sg__cuda_dev *d, const char *fn) {
  if (d->rep) return SG_OK;
  int least = 0, greatest = 0;
  SG__CU(cudaDeviceGetStreamPriorityRange(&least, &greatest), fn);
  cudaEvent_t *ring2 = (cudaEvent_t *)calloc(SG__CUDA_RING, sizeof *ring2);
  if (!ring2) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: replica lane events", fn);
  cudaError_t e = cudaEventCreateWithFlags(&d->lane_ev, cudaEventDisableTiming);
  for (int i = 0; i < SG__CUDA_RING && e == cudaSuccess; i++)
    e = cudaEventCreateWithFlags(&ring2[i], cudaEventDisableTiming);
  cudaStream_t s = NULL;
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest);
  if (e != cudaSuccess) {
    for (int i = 0; i < SG__CUDA_RING; i++)
      if (ring2[i]) (void)cudaEventDestroy(ring2[i]);
    free(ring2);
    return sg__cuda_err(e, fn, "replica lane (stream, events)", __FILE__, __LINE__);
  }
  d->ring2 = ring2;
  pthread_mutex_lock(&d->mu);
  d->rep = s; /* read by the waits under mu (ring_two) */
  pthread_mutex_unlock(&d->mu);
  return SG_OK;
}

/* Pending jobs finish before the mode changes. A second attachment (a hybrid engine's replica
 * channel beside its shard channel) must run its jobs the same way as the first: both
 * stream-ordered (their collectives share the comm stream, every wait polls both), or both
 * host-driven (the first one's threading stays). */
static sg_status sg__cudev_comm_attach(sg__device *dev, const sg__comm_attach *a,
                                       sg__comm_native *out) {
  static const char fn[] = "sg__device_cuda.comm_attach";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d || !a || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(sg__jobq_wait_all(&d->q, INT64_MAX, fn));
  pthread_mutex_lock(&d->mu);
  const int n = d->attached, stream = a->stream_ordered != 0;
  const int fits = n == 0 || (n < SG__CUDA_MAX_ATT && stream == d->stream_mode);
  if (fits) {
    d->att[n] = *a;
    d->attached = n + 1;
    d->stream_mode = stream;
  }
  pthread_mutex_unlock(&d->mu);
  if (!fits && n >= SG__CUDA_MAX_ATT)
    return sg__err(SG_ERR_INVALID_STATE, "%s: %d communicators are already attached", fn, n);
  if (!fits)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a %s communicator is attached; a %s one cannot "
                   "share its comm queue", fn, stream ? "host-driven" : "stream-ordered",
                   stream ? "stream-ordered" : "host-driven");
  /* stream-ordered jobs only enqueue: inline, on the caller's thread */
  if (n == 0) sg__jobq_set_threaded(&d->q, !a->stream_ordered && a->threaded);
  out->stream = (void *)d->comm;
  if (n == 1 && stream) {
    const sg_status st = sg__cuda_lane_open(d, fn);
    if (st != SG_OK) {
      pthread_mutex_lock(&d->mu);
      memset(&d->att[1], 0, sizeof d->att[1]);
      d->attached = 1;
      pthread_mutex_unlock(&d->mu);
      return st;
    }
    out->stream = (void *)d->rep;
  }
  out->ordinal = d->ordinal;
  return SG_OK;
}

/* Detaches the latest attachment (channels unbind in the reverse order of their binds). */
/* The replica lane stays; jobs submitted on it after the detach run on the comm stream. */
static void sg__cudev_comm_detach(sg__device *dev) {
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return;
  (void)sg__jobq_wait_all(&d->q, INT64_MAX, "sg__device_cuda.comm_detach");
  pthread_mutex_lock(&d->mu);
  const int left = d->attached > 0 ? d->attached - 1 : 0;
  memset(&d->att[left], 0, sizeof d->att[left]);
  d->attached = left;
  if (left == 0) d->stream_mode = 0;
  pthread_mutex_unlock(&d->mu);
  if (left == 0) sg__jobq_set_threaded(&d->q, 1);
}

static sg_status sg__cudev_comm_start(sg__device *dev) {
  sg__cuda_dev *d = sg__cuda(dev);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__device_cuda.comm_start: NULL device");
  return sg__jobq_start(&d->q, "sg__device_cuda.comm_start");
}

/* Common checks of comm_wait and compute_wait_comm. *done: nothing left to wait for; else
 * *wait_for is the ticket to wait for (the one now in the ticket's ring slot: a later one waits
 * longer, since jobs complete in ticket order) and *host says whether it is host-driven. */
static sg_status sg__cuda_ticket_check(sg__cuda_dev *d, uint64_t ticket, const char *fn,
                                       int *done, uint64_t *wait_for, int *host, int *two) {
  *done = 1;
  SG_TRY(sg__cuda_failed(d));
  const uint64_t last = sg__jobq_last(&d->q);
  if (ticket > last)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: ticket %llu was never issued (last %llu)", fn,
                   (unsigned long long)ticket, (unsigned long long)last);
  const size_t slot = ticket & (SG__CUDA_RING - 1);
  pthread_mutex_lock(&d->mu);
  *wait_for = d->ring_tk[slot];
  *host = d->ring_host[slot];
  *two = d->ring_two[slot];
  *done = !*host && ticket <= d->done_ticket;
  pthread_mutex_unlock(&d->mu);
  if (*host && sg__jobq_done(&d->q) >= *wait_for) *done = 1;
  return SG_OK;
}

/* comm_wait (the host waits until deadline_ms) and compute_wait_comm (stream_wait: the compute
 * stream waits; the deadline applies to whoever waits on the host later). A host-driven
 * worker job's CUDA work is complete when the job is: for it, a host wait on the queue. */
static sg_status sg__cuda_ticket_wait(sg__device *dev, uint64_t ticket, int64_t deadline_ms,
                                      int stream_wait, int own_lane, const char *fn) {
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  int done, host = 0, two = 0;
  uint64_t w = 0;
  SG_TRY(sg__cuda_ticket_check(d, ticket, fn, &done, &w, &host, &two));
  if (done) return SG_OK;
  if (host) return sg__jobq_wait(&d->q, w, deadline_ms, fn);
  SG_TRY(sg__cuda_enter(d, fn));
  /* with the replica lane: the other lane's work up to the ticket too */
  cudaEvent_t other = two && !(own_lane && w == ticket) ? d->ring2[w & (SG__CUDA_RING - 1)] : NULL;
  if (stream_wait) {
    SG__CU(cudaStreamWaitEvent(d->compute, sg__cuda_ticket_event(d, w), 0), fn);
    if (other) SG__CU(cudaStreamWaitEvent(d->compute, other, 0), fn);
    return SG_OK;
  }
  SG_TRY(sg__cuda_wait(d, sg__cuda_ticket_event(d, w), NULL, deadline_ms, fn));
  if (other) SG_TRY(sg__cuda_wait(d, other, NULL, deadline_ms, fn));
  pthread_mutex_lock(&d->mu);
  if (d->done_ticket < ticket) d->done_ticket = ticket;
  pthread_mutex_unlock(&d->mu);
  return SG_OK;
}

static sg_status sg__cudev_comm_wait(sg__device *dev, uint64_t ticket, int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 0, 0, "sg__device_cuda.comm_wait");
}

static sg_status sg__cudev_compute_wait_comm(sg__device *dev, uint64_t ticket,
                                             int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 1, 0, "sg__device_cuda.compute_wait_comm");
}

/* Job `ticket` and the jobs of its lane before it; a replica-lane job still running does not
 * hold up the compute stream here (a staging slot that a reduction zeroed). */
static sg_status sg__cudev_compute_wait_job(sg__device *dev, uint64_t ticket,
                                            int64_t deadline_ms) {
  return sg__cuda_ticket_wait(dev, ticket, deadline_ms, 1, 1, "sg__device_cuda.compute_wait_job");
}

static sg_status sg__cudev_sync(sg__device *dev, int64_t deadline_ms) {
  static const char fn[] = "sg__device_cuda.sync";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  SG_TRY(sg__cuda_enter(d, fn));
  SG_TRY(sg__cuda_wait(d, NULL, d->compute, deadline_ms, fn));
  return sg__cuda_failed(d);
}

/* NULL goes back to our own stream. Work already issued to the old stream stays ahead of
 * anything issued to the new one. */
static sg_status sg__cudev_set_stream(sg__device *dev, void *stream) {
  static const char fn[] = "sg__device_cuda.set_stream";
  sg__cuda_dev *d = sg__cuda(dev);
  SG__CUDA_SCOPE(d);
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  cudaStream_t next = stream ? (cudaStream_t)stream : d->own_compute;
  if (next == d->compute) return SG_OK;
  SG_TRY(sg__cuda_enter(d, fn));
  SG__CU(cudaEventRecord(d->order_ev, d->compute), fn);
  SG__CU(cudaStreamWaitEvent(next, d->order_ev, 0), fn);
  d->compute = next;
  return SG_OK;
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
