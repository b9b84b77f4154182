/* The CUDA device's internals shared by its three files (DESIGN.md section 1): cuda.c (the
 * device, its memory, copies, kernels, lifetime and ops table), sg_cuda_queue.c (the comm job
 * queue, tickets and every polling host wait) and sg_cuda_segtab.c (the update's segment-table
 * cache and the update op). Only these files and kernels/cuda include the CUDA runtime. */
#ifndef SG_CUDA_INTERNAL_H
#define SG_CUDA_INTERNAL_H

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
  /* The copy-out lane (issue 28, defect 2): offload's D2H copies of reduced slices (copy_out)
   * on a stream of their own, made by the first one, so that a slow copy does not hold up the
   * next bucket's reduce-scatter on the comm stream. A stream-ordered job that calls copy_out
   * moves the rest of its SG_Q_COMM work there, after the comm stream's work so far (out_ev).
   * Once the stream exists every stream-ordered job records ring3[its slot] on it after the
   * job (ring_three), and a ticket's waits cover it. NULL until the first copy_out. */
  cudaStream_t out;
  cudaEvent_t out_ev;
  cudaEvent_t *ring3; /* SG__CUDA_RING events, with out */
  sg__jobq q; /* comm jobs: tickets, the first failure, the worker */
  int q_ready;
  int sync_ready; /* mu and tab_mu exist */
  /* Under mu: the ring bookkeeping and the attachment. */
  pthread_mutex_t mu;
  uint64_t ring_tk[SG__CUDA_RING];        /* the ticket that last used each slot */
  unsigned char ring_two[SG__CUDA_RING];  /* 1: that ticket's ring2 event covers the other lane */
  unsigned char ring_host[SG__CUDA_RING]; /* 1: that ticket is host-driven (queue waits) */
  unsigned char ring_three[SG__CUDA_RING]; /* 1: that ticket's ring3 event covers the out lane */
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

/* Every vtable call leaves the calling thread's current device as it found it (the caller's
 * framework, e.g. torch, keeps its own): SG__CUDA_SCOPE(d) at the top of a call restores it on
 * every return path. */
typedef struct sg__cuda_scope {
  int prev; /* -1: unknown, nothing to restore */
} sg__cuda_scope;

#if defined(__GNUC__) /* gcc, clang */
#define SG__CUDA_SCOPE(d) \
  __attribute__((cleanup(sg__cuda_scope_end))) const sg__cuda_scope sg__scope_ = sg__cuda_scope_begin(d)
#else
#error "the CUDA device restores the current CUDA device with __attribute__((cleanup))"
#endif

/* The device whose replica-lane job this thread submits or runs (stream-ordered jobs run
 * inline, on the submitting thread): its SG_Q_COMM work goes to the replica stream. */
extern _Thread_local const struct sg__cuda_dev *sg__cuda_lane_of;
/* The device whose stream-ordered job, running on this thread, moved its SG_Q_COMM work to the
 * copy-out lane (copy_out). */
extern _Thread_local const struct sg__cuda_dev *sg__cuda_out_of;

/* Shared between the files (each defined, with its comment, where it belongs). */
sg__cuda_dev *sg__cuda(sg__device *d);
void sg__cuda_abort_all(sg__cuda_dev *d);
sg_status sg__cuda_after(sg__cuda_dev *d, sg__queue q, const char *fn);
void sg__cuda_backoff(unsigned iter);
sg_status sg__cuda_check_queue(sg__queue q, const char *fn);
int sg__cuda_dtype_ok(int dt);
sg_status sg__cuda_enter(sg__cuda_dev *d, const char *fn);
sg_status sg__cuda_err(cudaError_t e, const char *fn, const char *call, const char *file,
                       int line);
sg_status sg__cuda_failed(sg__cuda_dev *d);
int sg__cuda_hooks_get(sg__cuda_dev *d, sg__comm_attach h[]);
int sg__cuda_in_host_job(sg__cuda_dev *d);
sg__cuda_launch sg__cuda_launch_on(sg__cuda_dev *d, sg__queue q);
sg_status sg__cuda_queue_op(sg__cuda_dev *d, sg__queue q, const char *fn);
sg_status sg__cuda_record_failure(sg__cuda_dev *d, sg_status st);
cudaStream_t sg__cuda_stream(sg__cuda_dev *d, sg__queue q);
void sg__cuda_tabs_release(sg__cuda_dev *d, cudaStream_t s);
sg_status sg__cuda_wait(sg__cuda_dev *d, cudaEvent_t ev, cudaStream_t s, int64_t deadline_ms,
                        const char *fn);
sg_status sg__cudev_comm_attach(sg__device *dev, const sg__comm_attach *a,
                                sg__comm_native *out);
void sg__cudev_comm_detach(sg__device *dev);
sg_status sg__cudev_comm_start(sg__device *dev);
sg_status sg__cudev_comm_submit(sg__device *dev, sg__job_fn job, void (*drop)(void *),
                                void *arg, uint64_t *ticket);
sg_status sg__cudev_comm_submit_lane(sg__device *dev, int lane, sg__job_fn job,
                                     void (*drop)(void *), void *arg, uint64_t *ticket);
sg_status sg__cudev_comm_wait(sg__device *dev, uint64_t ticket, int64_t deadline_ms);
sg_status sg__cudev_compute_wait_comm(sg__device *dev, uint64_t ticket,
                                      int64_t deadline_ms);
sg_status sg__cudev_compute_wait_job(sg__device *dev, uint64_t ticket,
                                     int64_t deadline_ms);
sg_status sg__cudev_copy_out(sg__device *dev, void *dst, const void *src, size_t bytes);
sg_status sg__cudev_outer_delta(sg__device *dev, sg__queue q, float *dst, const float *po,
                                const float *theta, size_t n); /* sg_cuda_replica.c */
sg_status sg__cudev_outer_step(sg__device *dev, sg__queue q, float *po, float *m, float *theta,
                               const float *dsum, size_t n, int nrep, float lr, float mu);
sg_status sg__cudev_code_encode(sg__device *dev, sg__queue q, void *out, const float *src,
                                float *resid, size_t n, int bits); /* sg_cuda_replica.c */
sg_status sg__cudev_code_decode(sg__device *dev, sg__queue q, float *dst, const void *in,
                                size_t n, int bits, int add);
sg_status sg__cudev_set_stream(sg__device *dev, void *stream);
sg_status sg__cudev_sync(sg__device *dev, int64_t deadline_ms);
sg_status sg__cudev_update(sg__device *dev, sg__queue q, const sg__optim_desc *od,
                           const sg__update_args *a);
sg__cuda_scope sg__cuda_scope_begin(const sg__cuda_dev *d);
void sg__cuda_scope_end(const sg__cuda_scope *sc);

/* How the shared job queue (sg_jobq.h) marks and runs this device's jobs (sg_cuda_queue.c). */
extern const sg__jobq_ops sg__cuda_jobq_ops;

#endif /* SG_CUDA_INTERNAL_H */
