/* NCCL communicator (DESIGN.md section 6): one rank per GPU, collectives on the CUDA device's
 * comm stream.
 *
 * Streams and ordering. A channel bound to a CUDA device (sg__comm_bind) attaches to it as a
 * stream-ordered communicator and gets its comm stream: collectives on device memory are
 * enqueued there and return at once: they run after the compute work that comm_submit ordered
 * before the job, and the device's ticket events mark their end. Such collectives must
 * therefore be issued from comm jobs. The device's host waits poll the channel (its attachment):
 * an asynchronous NCCL error or a passed deadline aborts it. Collectives on host memory are
 * staged through device memory; they, and collectives with no CUDA device bound, complete
 * before returning, within the deadline (device buffers must then be ready when the call is
 * made). Every call leaves the calling thread's current CUDA device as it found it.
 *
 * Channels: the first one uses the communicator's NCCL communicator; later ones (a second
 * engine, or the next engine after one was destroyed, or the rendezvous of an sg_comm_split)
 * get a split of it (ncclCommSplit, NCCL >= 2.18; refused with SG_ERR_UNSUPPORTED before),
 * non-blocking and waited for with the engine's deadline, so that the collectives of two
 * engines never share NCCL's queue.
 *
 * sg_comm_split: ncclCommSplit with the caller's color and key on the rendezvous channel, or,
 * without it, a fresh unique id per color made by its new rank 0 and all-gathered over the
 * channel (host memory, staged), each new communicator then initialized from its id.
 *
 * Communicators are created non-blocking (ncclConfig_t.blocking = 0), so that initialization
 * and every enqueue can be waited for with a deadline: calls may return ncclInProgress, and a
 * call is complete when ncclCommGetAsyncError no longer says ncclInProgress. On a failure or a
 * passed deadline the communicator is aborted (ncclCommAbort) and stays broken.
 *
 * Sums are NCCL's ncclSum in the wire dtype (bf16/f16 partial sums are rounded at each step of
 * NCCL's algorithm, unlike the fp32 sums of the local and MPI backends); f64 is supported.
 *
 * Bootstrap: an id the caller distributed (sg_nccl_unique_id), a file on a shared file system
 * (SG_NCCL_ID_FILE: rank 0 writes it atomically and removes it once every rank has joined), or
 * MPI (sg_comm_create_nccl_mpi). The file and MPI bootstraps wait at most
 * SG_NCCL_INIT_TIMEOUT_MS (default 600000 ms); so does NCCL's initialization.
 *
 * NCCL is not linked: it is loaded with dlopen by the first sg_nccl_unique_id,
 * sg_comm_create_nccl or sg_comm_create_nccl_mpi (sg_nccl_dl.h: an NCCL the process already
 * has, e.g. torch's, else SG_NCCL_LIBRARY, else libnccl.so.2). So sg_has_backend("nccl") is 1
 * whenever this file was built against <nccl.h>, and a missing or unusable NCCL shows up as
 * SG_ERR_UNSUPPORTED from those calls. The creation calls look for the GPU first, so a machine
 * without one still gets SG_ERR_CUDA.
 *
 * The id file, the init timeout and the MPI bootstrap live in sg_nccl_boot.c. Without NCCL
 * (SG_HAVE_NCCL undefined) both files are empty and sg_nccl_stub.c provides the public
 * functions. */
#ifdef SG_HAVE_NCCL

#define _POSIX_C_SOURCE 200809L /* nanosleep, access under -std=c11 */

#include <pthread.h> /* the lock around the NCCL handle */
#include <stdio.h>   /* snprintf */
#include <stdlib.h>  /* calloc, free */
#include <string.h>  /* memcpy, strrchr */
#include <time.h>    /* nanosleep */
#include <unistd.h>  /* access, unlink */

#include <cuda_runtime.h> /* streams, staging copies */
#include <nccl.h>         /* the collectives */

#include "../../device/sg_device_cuda.h" /* sg__device_cuda_pick, sg__device_cuda_mem_kind */
#include "../sg_comm.h"                  /* sg_comm, sg__comm_ops, sg__comm_fail */
#include "sg_nccl_dl.h"               /* NCCL's functions, loaded at run time */
#include "sg_nccl_internal.h"         /* the id file and the init timeout (sg_nccl_boot.c) */

/* One NCCL communicator. */
typedef struct sg__nccl {
  const sg__nccl_lib *nc; /* NCCL's functions */
  /* NULL once aborted; only base->comm is used, under base->mu: an abort from another thread
   * (a device wait's deadline, the staged hybrid's worker failing) must not free the handle
   * while a call is inside NCCL with it. */
  ncclComm_t comm;
  pthread_mutex_t mu;
  struct sg__nccl *base;  /* the one whose comm the collectives use (itself, or a channel's
                             communicator) */
  int ordinal;            /* its GPU */
  cudaStream_t own;       /* collectives with no CUDA device bound */
  cudaStream_t bound;     /* a channel on a CUDA device: the device's comm stream */
  void *stage;            /* device staging for host buffers, stream-ordered allocation */
  size_t stage_cap;
} sg__nccl;

static const char *sg__nccl_base(const char *file) {
  const char *s = strrchr(file, '/');
  return s ? s + 1 : file;
}

/* Spin a little, then sleep with a growing pause up to 50 us (a longer nap would leave the GPU
 * idle after the collective it waits for). */
static void sg__nccl_backoff(unsigned iter) {
  if (iter < 64) return;
  long ns = 1000L << (iter < 70 ? iter - 64 : 6);
  struct timespec ts = {0, ns > 50000L ? 50000L : ns};
  nanosleep(&ts, NULL);
}

/* Makes `ordinal` current on the calling thread; returns the device to restore afterwards (-1:
 * none, sg__device_cuda_current: the thread had no context, and "restoring" device 0 would
 * create one there). */
static int sg__nccl_enter(int ordinal, cudaError_t *e) {
  const int prev = sg__device_cuda_current();
  cudaError_t r = prev == ordinal ? cudaSuccess : cudaSetDevice(ordinal);
  if (e) *e = r;
  return prev;
}

static void sg__nccl_leave(int prev, int ordinal) {
  if (prev >= 0 && prev != ordinal) (void)cudaSetDevice(prev); /* the caller's, as it was */
}

static int sg__nccl_expired(int64_t deadline_ms) {
  return deadline_ms != INT64_MAX && sg__now_ms() > deadline_ms;
}

/* ---- failures ------------------------------------------------------------------------------ */

/* NCCL calls on the handle run under the base's lock (non-blocking mode: each one returns
 * soon), so that the abort waits for a call in progress instead of freeing under it. */
static void sg__nccl_abort(sg__nccl *n) {
  n = n->base;
  pthread_mutex_lock(&n->mu);
  if (n->comm) (void)n->nc->CommAbort(n->comm);
  n->comm = NULL;
  pthread_mutex_unlock(&n->mu);
}

static int sg__nccl_alive(sg__nccl *n) {
  n = n->base;
  pthread_mutex_lock(&n->mu);
  const int alive = n->comm != NULL;
  pthread_mutex_unlock(&n->mu);
  return alive;
}

/* An NCCL failure: its text (and NCCL's last error) with file:line, then abort. */
static sg_status sg__nccl_fail(sg_comm *c, sg_status st, const char *fn, const char *what,
                               ncclResult_t r, int line) {
  sg__nccl *n = (sg__nccl *)c->impl;
  char detail[256];
  pthread_mutex_lock(&n->base->mu);
  const char *last = n->nc->GetLastError(n->base->comm);
  snprintf(detail, sizeof detail, "%s", last ? last : "");
  pthread_mutex_unlock(&n->base->mu);
  sg__nccl_abort(n);
  return sg__comm_fail(c, st, fn, "%s failed: %s%s%s (rank %d of %d) (%s:%d)", what,
                       n->nc->GetErrorString(r), detail[0] ? ": " : "", detail, c->rank, c->world,
                       sg__nccl_base(__FILE__), line);
}

static sg_status sg__nccl_cuda_fail(sg_comm *c, const char *fn, const char *what, cudaError_t e,
                                    int line) {
  sg__nccl_abort((sg__nccl *)c->impl);
  return sg__comm_fail(c, SG_ERR_CUDA, fn, "%s failed: %s (%s) (%s:%d)", what,
                       cudaGetErrorString(e), cudaGetErrorName(e), sg__nccl_base(__FILE__), line);
}

static sg_status sg__nccl_timeout(sg_comm *c, const char *fn, const char *what, int line) {
  sg__nccl_abort((sg__nccl *)c->impl);
  return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                       "%s did not complete before the deadline (rank %d of %d); communicator "
                       "aborted (%s:%d)",
                       what, c->rank, c->world, sg__nccl_base(__FILE__), line);
}

/* The communicator's asynchronous state: ncclSuccess, ncclInProgress or an error
 * (ncclInvalidUsage once aborted). */
static ncclResult_t sg__nccl_async(sg__nccl *n) {
  n = n->base;
  ncclResult_t r = ncclInvalidUsage;
  pthread_mutex_lock(&n->mu);
  ncclResult_t e = n->comm ? n->nc->CommGetAsyncError(n->comm, &r) : ncclSuccess;
  pthread_mutex_unlock(&n->mu);
  return e != ncclSuccess ? e : r;
}

/* A call on a non-blocking communicator returned r; waits until it is complete. */
static sg_status sg__nccl_settle(sg_comm *c, ncclResult_t r, const char *fn, const char *what,
                                 int64_t deadline_ms, int line) {
  sg__nccl *n = (sg__nccl *)c->impl;
  for (unsigned iter = 0; r == ncclInProgress; iter++) {
    if (sg__nccl_expired(deadline_ms)) return sg__nccl_timeout(c, fn, what, line);
    sg__nccl_backoff(iter);
    r = sg__nccl_async(n);
  }
  if (r != ncclSuccess) return sg__nccl_fail(c, SG_ERR_COMM, fn, what, r, line);
  return SG_OK;
}

/* Host wait for stream s, watching the communicator's asynchronous error and the deadline. */
static sg_status sg__nccl_wait_stream(sg_comm *c, cudaStream_t s, const char *fn,
                                      int64_t deadline_ms) {
  sg__nccl *n = (sg__nccl *)c->impl;
  for (unsigned iter = 0;; iter++) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return SG_OK;
    if (e != cudaErrorNotReady) return sg__nccl_cuda_fail(c, fn, "cudaStreamQuery", e, __LINE__);
    (void)cudaGetLastError(); /* NotReady stays the thread's last error otherwise */
    ncclResult_t r = sg__nccl_async(n);
    if (r != ncclSuccess && r != ncclInProgress)
      return sg__nccl_fail(c, SG_ERR_COMM, fn, "collective", r, __LINE__);
    if (sg__nccl_expired(deadline_ms)) return sg__nccl_timeout(c, fn, "collective", __LINE__);
    sg__nccl_backoff(iter);
  }
}

/* ---- hooks for the CUDA device's waits ------------------------------------------------------ */

static sg_status sg__nccl_hook_poll(void *arg) {
  sg_comm *c = (sg_comm *)arg;
  sg__nccl *n = (sg__nccl *)c->impl;
  if (!sg__nccl_alive(n))
    return sg__err(SG_ERR_COMM, "sg_comm(nccl): communicator (rank %d of %d) was aborted", c->rank,
                   c->world);
  ncclResult_t r = sg__nccl_async(n);
  if (r == ncclSuccess || r == ncclInProgress) return SG_OK;
  return sg__nccl_fail(c, SG_ERR_COMM, "sg_comm(nccl)", "asynchronous NCCL operation", r, __LINE__);
}

static void sg__nccl_hook_abort(void *arg) {
  sg_comm *c = (sg_comm *)arg;
  sg__nccl_abort((sg__nccl *)c->impl);
  __atomic_store_n(&c->broken, 1, __ATOMIC_RELAXED); /* the thread of a device wait */
}

/* The stream to use: the bound CUDA device's comm stream (*bound = 1), or our own stream. */
static void sg__nccl_stream(sg_comm *c, cudaStream_t *s, int *bound) {
  sg__nccl *n = (sg__nccl *)c->impl;
  *bound = n->bound != NULL;
  *s = n->bound ? n->bound : n->own;
}

/* ---- collectives ---------------------------------------------------------------------------- */

typedef enum {
  SG__NC_ALL_REDUCE,
  SG__NC_REDUCE_SCATTER,
  SG__NC_ALL_GATHER,
  SG__NC_BROADCAST,
  SG__NC_ALL_TO_ALL
} sg__nccl_kind;

/* One collective: count elements of dtype (per rank for reduce-scatter / all-gather). Byte
 * collectives use dtype SG__NCCL_BYTES. */
#define SG__NCCL_BYTES (-1)
typedef struct sg__nccl_call {
  sg__nccl_kind kind;
  size_t count;
  int dtype;
  int root;
  char *recv; /* the receive buffer, device memory: a reduce-scatter out of place (this
               * rank's slice; NULL: in place), an all-to-all (the call's buffer sends) */
} sg__nccl_call;

static size_t sg__nccl_esize(int dtype) {
  return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : dtype == SG__NCCL_BYTES ? 1u : 2u;
}

static ncclDataType_t sg__nccl_type(int dtype) {
  switch (dtype) {
    case SG_F32: return ncclFloat32;
    case SG_BF16: return ncclBfloat16;
    case SG_F16: return ncclFloat16;
    case SG__F64: return ncclFloat64;
  }
  return ncclInt8;
}

/* Bytes of the whole in-place buffer. */
static size_t sg__nccl_total(const sg_comm *c, const sg__nccl_call *k) {
  size_t b = k->count * sg__nccl_esize(k->dtype);
  return (k->kind == SG__NC_REDUCE_SCATTER || k->kind == SG__NC_ALL_GATHER ||
          k->kind == SG__NC_ALL_TO_ALL)
             ? b * (size_t)c->world
             : b;
}

/* NCCL has no all-to-all: part p of buf to rank p and rank p's part into part p of recv, as
 * sends and receives inside the caller's group (count bytes each). */
static ncclResult_t sg__nccl_all_to_all_issue(sg_comm *c, ncclComm_t comm, const char *buf,
                                              char *recv, size_t count, cudaStream_t s) {
  const sg__nccl_lib *nc = ((sg__nccl *)c->impl)->nc;
  ncclResult_t r = ncclSuccess;
  for (int p = 0; p < c->world && r == ncclSuccess; p++) {
    const size_t off = (size_t)p * count;
    r = nc->Send(buf + off, count, ncclInt8, p, comm, s);
    if (r == ncclSuccess) r = nc->Recv(recv + off, count, ncclInt8, p, comm, s);
  }
  return r;
}

/* Under the base's lock, comm its live handle. */
static ncclResult_t sg__nccl_issue(sg_comm *c, ncclComm_t comm, const sg__nccl_call *k, char *buf,
                                   cudaStream_t s) {
  const sg__nccl_lib *nc = ((sg__nccl *)c->impl)->nc;
  const ncclDataType_t t = sg__nccl_type(k->dtype);
  const size_t slice = k->count * sg__nccl_esize(k->dtype) * (size_t)c->rank;
  switch (k->kind) {
    case SG__NC_ALL_REDUCE: return nc->AllReduce(buf, buf, k->count, t, ncclSum, comm, s);
    case SG__NC_REDUCE_SCATTER: /* in place: NCCL wants recvbuff = sendbuff + rank*count */
      return nc->ReduceScatter(buf, k->recv ? k->recv : buf + slice, k->count, t, ncclSum, comm,
                               s);
    case SG__NC_ALL_GATHER: /* in place: sendbuff = recvbuff + rank*count */
      return nc->AllGather(buf + slice, buf, k->count, ncclInt8, comm, s);
    case SG__NC_BROADCAST:
      return nc->Broadcast(buf, buf, k->count, ncclInt8, k->root, comm, s);
    case SG__NC_ALL_TO_ALL: return sg__nccl_all_to_all_issue(c, comm, buf, k->recv, k->count, s);
  }
  return ncclInvalidArgument;
}

/* Enqueues one collective as a group on stream s and waits until NCCL has enqueued it. The
 * group runs under the base's lock (an abort on another thread waits for it). */
static sg_status sg__nccl_enqueue(sg_comm *c, const sg__nccl_call *k, void *buf, cudaStream_t s,
                                  const char *fn, int64_t deadline_ms) {
  sg__nccl *b = ((sg__nccl *)c->impl)->base;
  pthread_mutex_lock(&b->mu);
  if (!b->comm) {
    pthread_mutex_unlock(&b->mu);
    return sg__comm_fail(c, SG_ERR_COMM, fn, "the NCCL communicator (rank %d of %d) was aborted",
                         c->rank, c->world);
  }
  ncclResult_t r = b->nc->GroupStart(), g = ncclSuccess;
  if (r == ncclSuccess) {
    r = sg__nccl_issue(c, b->comm, k, (char *)buf, s);
    g = b->nc->GroupEnd();
  }
  pthread_mutex_unlock(&b->mu);
  if (r != ncclSuccess && r != ncclInProgress)
    return sg__nccl_fail(c, SG_ERR_COMM, fn, "collective", r, __LINE__);
  return sg__nccl_settle(c, g, fn, "ncclGroupEnd", deadline_ms, __LINE__);
}

/* Host buffers go through device memory: copy in, collective, wait (deadline), copy out. The
 * wait comes before the copy back, which would otherwise block without a deadline. */
static sg_status sg__nccl_staged(sg_comm *c, const sg__nccl_call *k, void *buf, cudaStream_t s,
                                 const char *fn, int64_t deadline_ms) {
  sg__nccl *n = (sg__nccl *)c->impl;
  const size_t total = sg__nccl_total(c, k);
  const int a2a = k->kind == SG__NC_ALL_TO_ALL; /* received into the stage's second half */
  const size_t need = a2a ? 2u * total : total;
  cudaError_t e;
  if (need > n->stage_cap) {
    if (n->stage) (void)cudaFreeAsync(n->stage, s);
    n->stage = NULL;
    n->stage_cap = 0;
    if ((e = cudaMallocAsync(&n->stage, need, s)) != cudaSuccess)
      return sg__nccl_cuda_fail(c, fn, "cudaMallocAsync(staging)", e, __LINE__);
    n->stage_cap = need;
  }
  if ((e = cudaMemcpyAsync(n->stage, buf, total, cudaMemcpyHostToDevice, s)) != cudaSuccess)
    return sg__nccl_cuda_fail(c, fn, "cudaMemcpyAsync(H2D)", e, __LINE__);
  sg__nccl_call ks = *k;
  if (a2a) ks.recv = (char *)n->stage + total;
  SG_TRY(sg__nccl_enqueue(c, &ks, n->stage, s, fn, deadline_ms));
  SG_TRY(sg__nccl_wait_stream(c, s, fn, deadline_ms));
  if ((e = cudaMemcpyAsync(a2a ? k->recv : buf, a2a ? ks.recv : n->stage, total,
                           cudaMemcpyDeviceToHost, s)) != cudaSuccess)
    return sg__nccl_cuda_fail(c, fn, "cudaMemcpyAsync(D2H)", e, __LINE__);
  return sg__nccl_wait_stream(c, s, fn, deadline_ms);
}

static sg_status sg__nccl_run(sg_comm *c, const sg__nccl_call *k, void *buf, const char *fn,
                              int64_t deadline_ms) {
  SG_TRY(sg__comm_usable(c, fn));
  sg__nccl *n = (sg__nccl *)c->impl;
  if (k->count == 0) return SG_OK;
  if (!buf) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: buf is NULL (count %zu)", fn, k->count);
  if (k->count > SIZE_MAX / 8u / (size_t)c->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: count too large (%zu)", fn, k->count);
  cudaError_t e;
  const int prev = sg__nccl_enter(n->ordinal, &e);
  if (e != cudaSuccess) return sg__nccl_cuda_fail(c, fn, "cudaSetDevice", e, __LINE__);
  cudaStream_t s;
  int bound;
  sg__nccl_stream(c, &s, &bound);
  sg_status st;
  const int on_dev = sg__device_cuda_mem_kind(buf) == SG__CUDA_MEM_DEVICE &&
                     (!k->recv || sg__device_cuda_mem_kind(k->recv) == SG__CUDA_MEM_DEVICE);
  if (!on_dev) { /* NCCL can use device memory */
    st = sg__nccl_staged(c, k, buf, s, fn, deadline_ms);
  } else {
    st = sg__nccl_enqueue(c, k, buf, s, fn, deadline_ms);
    /* Bound: stream-ordered, the device's ticket covers it. Otherwise complete it here. */
    if (st == SG_OK && !bound) st = sg__nccl_wait_stream(c, s, fn, deadline_ms);
  }
  sg__nccl_leave(prev, n->ordinal);
  return st;
}

static sg_status sg__nccl_check_dtype(int dtype, const char *fn) {
  if (sg__dtype_valid(dtype) || dtype == SG__F64) return SG_OK;
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown dtype (%d)", fn, dtype);
}

static sg_status sg__nccl_all_reduce(sg_comm *c, void *buf, size_t count, int dtype,
                                     int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) all_reduce";
  if (c) sg__comm_count(c, SG__COUNT_ALL_REDUCE, count * sg__comm_elem_bytes(dtype), -1);
  SG_TRY(sg__nccl_check_dtype(dtype, fn));
  sg__nccl_call k = {SG__NC_ALL_REDUCE, count, dtype, 0, NULL};
  return sg__nccl_run(c, &k, buf, fn, deadline_ms);
}

static sg_status sg__nccl_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype,
                                         int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) reduce_scatter";
  if (c)
    sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                   (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  SG_TRY(sg__nccl_check_dtype(dtype, fn));
  sg__nccl_call k = {SG__NC_REDUCE_SCATTER, count, dtype, 0, NULL};
  return sg__nccl_run(c, &k, buf, fn, deadline_ms);
}

/* Out of place, device memory only (no staging through host memory: the engine offers it
 * device buffers, and a staged copy would be the pass this saves). */
static sg_status sg__nccl_reduce_scatter_to(sg_comm *c, const void *send, void *recv,
                                            size_t count, int dtype, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) reduce_scatter_to";
  if (c)
    sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                   (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  SG_TRY(sg__nccl_check_dtype(dtype, fn));
  if (count && (!recv || sg__device_cuda_mem_kind(recv) != SG__CUDA_MEM_DEVICE ||
                !send || sg__device_cuda_mem_kind(send) != SG__CUDA_MEM_DEVICE))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: send %p and recv %p must be device memory",
                   fn, send, recv);
  sg__nccl_call k = {SG__NC_REDUCE_SCATTER, count, dtype, 0, recv};
  return sg__nccl_run(c, &k, (void *)send, fn, deadline_ms);
}

static sg_status sg__nccl_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) all_gather";
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  sg__nccl_call k = {SG__NC_ALL_GATHER, bytes, SG__NCCL_BYTES, 0, NULL};
  return sg__nccl_run(c, &k, buf, fn, deadline_ms);
}

static sg_status sg__nccl_broadcast(sg_comm *c, void *buf, size_t bytes, int root,
                                    int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) broadcast";
  if (c && (root < 0 || root >= c->world))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: root %d out of range (world %d)", fn, root,
                   c->world);
  sg__comm_count(c, SG__COUNT_BROADCAST, bytes, root);
  sg__nccl_call k = {SG__NC_BROADCAST, bytes, SG__NCCL_BYTES, root, NULL};
  return sg__nccl_run(c, &k, buf, fn, deadline_ms);
}

/* Flushes (ncclCommFinalize, bounded by the init timeout) and frees; aborts when a peer does not
 * let it finish. */
static void sg__nccl_finalize(sg__nccl *n) {
  if (n->base != n || !sg__nccl_alive(n)) return; /* not ours, or aborted */
  int64_t deadline = sg__deadline(sg__nccl_init_timeout_ms());
  pthread_mutex_lock(&n->mu);
  ncclResult_t r = n->nc->CommFinalize(n->comm);
  pthread_mutex_unlock(&n->mu);
  for (unsigned iter = 0; r == ncclInProgress && !sg__nccl_expired(deadline); iter++) {
    sg__nccl_backoff(iter);
    r = sg__nccl_async(n);
  }
  pthread_mutex_lock(&n->mu);
  if (n->comm && r == ncclSuccess)
    (void)n->nc->CommDestroy(n->comm);
  else if (n->comm)
    (void)n->nc->CommAbort(n->comm);
  n->comm = NULL;
  pthread_mutex_unlock(&n->mu);
}

/* A zeroed sg__nccl with its lock, or NULL. */
static sg__nccl *sg__nccl_alloc(void) {
  sg__nccl *n = (sg__nccl *)calloc(1, sizeof *n);
  if (n && pthread_mutex_init(&n->mu, NULL) != 0) {
    free(n);
    n = NULL;
  }
  return n;
}

static void sg__nccl_free(sg__nccl *n) {
  if (!n) return;
  pthread_mutex_destroy(&n->mu);
  free(n);
}

static void sg__nccl_destroy(sg_comm *c) {
  if (!c) return;
  sg__nccl *n = (sg__nccl *)c->impl;
  if (n) {
    const int prev = sg__nccl_enter(n->ordinal, NULL);
    sg__nccl_finalize(n);
    if (n->stage && n->own) (void)cudaFreeAsync(n->stage, n->own);
    if (n->own) (void)cudaStreamDestroy(n->own);
    sg__nccl_leave(prev, n->ordinal);
    sg__nccl_free(n);
  }
  free(c);
}

static sg_status sg__nccl_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                               sg_comm **chan);
static void sg__nccl_unbind(sg_comm *chan);
static sg_status sg__nccl_split_op(sg_comm *chan, const int *colors, const int *keys,
                                   int64_t deadline_ms, sg_comm **out);
static sg_status sg__nccl_new(const sg__nccl_lib *nc, int rank, int world, const ncclUniqueId *id,
                              ncclComm_t made, int ordinal, sg_comm **out, const char *fn);

/* Part p of send (bytes each) to rank p, rank p's part of its send into part p of recv. Device
 * memory, or host memory through the staging buffer (both buffers of one kind or the other). */
static sg_status sg__nccl_all_to_all(sg_comm *c, const void *send, void *recv, size_t bytes,
                                     int64_t deadline_ms) {
  static const char fn[] = "sg_comm(nccl) all_to_all";
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  if (c && bytes > 0 && !recv)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: recv is NULL (%zu bytes)", fn, bytes);
  sg__nccl_call k = {SG__NC_ALL_TO_ALL, bytes, SG__NCCL_BYTES, 0, (char *)recv};
  return sg__nccl_run(c, &k, (void *)send, fn, deadline_ms);
}

static const sg__comm_ops sg__nccl_ops = {
    "nccl",
    sg__nccl_all_reduce,
    sg__nccl_reduce_scatter,
    sg__nccl_all_gather,
    sg__nccl_broadcast,
    sg__nccl_bind,
    sg__nccl_unbind,
    sg__nccl_destroy,
    sg__nccl_split_op,
    NULL, /* node_leader: by host name */
    NULL, /* reduce_scatter_fold: device memory */
    sg__nccl_all_to_all,
    sg__nccl_reduce_scatter_to,
    1, /* all_to_all_device */
};

/* ---- channels --------------------------------------------------------------------------------- */

/* A CUDA device: attach stream-ordered (its waits poll and abort us); another device (the CPU
 * one, host buffers): host-driven, since every call completes before it returns. */
static sg_status sg__nccl_attach(sg_comm *chan, sg__device *dev, int timeout_ms, const char *fn) {
  sg__nccl *n = (sg__nccl *)chan->impl;
  const int cuda = dev->kind == SG_DEVICE_CUDA;
  const sg__comm_attach a = {cuda, !cuda, cuda ? sg__nccl_hook_poll : NULL,
                             cuda ? sg__nccl_hook_abort : NULL, chan, timeout_ms};
  sg__comm_native native;
  SG_TRY(dev->ops->comm_attach(dev, &a, &native));
  if (cuda && native.ordinal != n->ordinal) {
    dev->ops->comm_detach(dev);
    return sg__err(SG_ERR_INVALID_STATE,
                   "%s: the communicator is on GPU %d but its engine's device is GPU %d", fn,
                   n->ordinal, native.ordinal);
  }
  n->bound = cuda ? (cudaStream_t)native.stream : NULL;
  return SG_OK;
}

/* ---- non-blocking creation ------------------------------------------------------------------
 *
 * NCCL >= 2.18 in non-blocking mode: ncclCommSplit returns ncclInProgress with *newcomm still
 * NULL, its own thread writes the child handle later and keeps the parent in progress until
 * then (the parent's next call fails before that). ncclCommInitRankConfig may do the same. So
 * the handle's cell is on the heap (a call that gives up at its deadline leaks it: NCCL may still
 * write it), read atomically, and a split waits for the parent to leave in-progress first, then
 * for the child. */

#ifndef NCCL_SPLIT_NOCOLOR
#define NCCL_SPLIT_NOCOLOR -1 /* <nccl.h> before 2.18 */
#endif

static ncclComm_t sg__nccl_cell_get(ncclComm_t *cell) {
  return __atomic_load_n(cell, __ATOMIC_ACQUIRE);
}

static ncclResult_t sg__nccl_query(const sg__nccl_lib *nc, ncclComm_t comm) {
  ncclResult_t r = ncclSuccess;
  ncclResult_t e = nc->CommGetAsyncError(comm, &r);
  return e != ncclSuccess ? e : r;
}

/* Waits for a creation call that returned r (parent: the parent of a split, else NULL; child
 * expected unless the split was NCCL_SPLIT_NOCOLOR). *expired: the deadline passed. */
static ncclResult_t sg__nccl_await(const sg__nccl_lib *nc, sg__nccl *parent, ncclComm_t *cell,
                                   int want_child, ncclResult_t r, int64_t deadline_ms,
                                   int *expired) {
  int parent_busy = parent != NULL && r == ncclInProgress;
  *expired = 0;
  for (unsigned iter = 0; r == ncclInProgress; iter++) {
    if (sg__nccl_expired(deadline_ms)) {
      *expired = 1;
      return r;
    }
    sg__nccl_backoff(iter);
    if (parent_busy) {
      r = sg__nccl_async(parent);
      if (r != ncclSuccess) continue; /* still in progress, or failed */
      parent_busy = 0;
    }
    ncclComm_t child = sg__nccl_cell_get(cell);
    if (child)
      r = sg__nccl_query(nc, child);
    else if (parent)
      r = want_child ? ncclInternalError : ncclSuccess; /* the parent is done: no child */
    else
      r = ncclInProgress; /* init: NCCL has not written the handle yet */
  }
  if (r == ncclSuccess && want_child && !sg__nccl_cell_get(cell)) r = ncclInternalError;
  return r;
}

/* After a wait that failed: aborts what NCCL wrote into the cell and frees the cell, unless
 * NCCL may still write it (nothing written, the deadline passed). */
static void sg__nccl_cell_drop(const sg__nccl_lib *nc, ncclComm_t *cell, int expired) {
  ncclComm_t child = sg__nccl_cell_get(cell);
  if (child) (void)nc->CommAbort(child);
  if (child || !expired) free(cell);
}

/* ncclCommSplit of p (NCCL_SPLIT_NOCOLOR: *out = NULL), non-blocking, waited for until the
 * deadline (the init timeout when there is none). A failure breaks c: ranks that split and
 * ranks that did not are out of step; a passed deadline aborts p too (NCCL keeps it in
 * progress). */
static sg_status sg__nccl_split(sg_comm *c, sg__nccl *p, int color, int key, int64_t deadline_ms,
                                ncclComm_t *out, const char *fn) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t *cell = (ncclComm_t *)calloc(1, sizeof *cell);
  if (!cell) return sg__comm_fail(c, SG_ERR_OUT_OF_MEMORY, fn, "out of memory");
  if (deadline_ms == INT64_MAX) deadline_ms = sg__deadline(sg__nccl_init_timeout_ms());
  ncclResult_t r = ncclInvalidUsage;
  pthread_mutex_lock(&p->mu);
  if (p->comm) r = p->nc->CommSplit(p->comm, color, key, cell, &cfg);
  pthread_mutex_unlock(&p->mu);
  int expired = 0;
  if (r == ncclSuccess || r == ncclInProgress)
    r = sg__nccl_await(p->nc, p, cell, color != NCCL_SPLIT_NOCOLOR, r, deadline_ms, &expired);
  if (r != ncclSuccess) {
    sg__nccl_cell_drop(p->nc, cell, expired);
    if (expired) {
      sg__nccl_abort(p);
      return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                           "ncclCommSplit did not complete before the deadline (rank %d of %d; "
                           "do all ranks create their engines and split in the same order?); "
                           "communicator aborted",
                           c->rank, c->world);
    }
    return sg__comm_fail(c, SG_ERR_COMM, fn, "ncclCommSplit failed: %s",
                         p->nc->GetErrorString(r));
  }
  *out = sg__nccl_cell_get(cell);
  free(cell);
  return SG_OK;
}

static sg_status sg__nccl_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                               sg_comm **chan) {
  static const char fn[] = "sg_comm(nccl) bind";
  sg__nccl *p = (sg__nccl *)c->impl;
  if (index > 0 && !p->nc->CommSplit)
    return sg__err(SG_ERR_UNSUPPORTED,
                   "%s: a second engine or sg_comm_split on one NCCL communicator needs "
                   "ncclCommSplit (NCCL >= 2.18; this NCCL is %d): create another NCCL "
                   "communicator for it (without ncclCommSplit only the first use, an engine or "
                   "one sg_comm_split or sg_comm_split_nodes, has the communicator to itself)",
                   fn, p->nc->version);
  if (!sg__nccl_alive(p)) return sg__err(SG_ERR_COMM, "%s: the NCCL communicator was aborted", fn);
  sg_comm *ch = (sg_comm *)calloc(1, sizeof *ch);
  sg__nccl *n = sg__nccl_alloc();
  sg_status st = SG_OK;
  int prev = -1;
  if (!ch || !n) {
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "%s: channel struct", fn);
    goto fail;
  }
  n->nc = p->nc;
  n->base = index == 0 ? p : n;
  n->ordinal = p->ordinal;
  sg__comm_channel_init(ch, c, &sg__nccl_ops, dev, n);
  cudaError_t e;
  prev = sg__nccl_enter(n->ordinal, &e);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&n->own, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    st = sg__err_at(SG_ERR_CUDA, __FILE__, __LINE__, "%s: cannot set up GPU %d: %s", fn,
                    n->ordinal, cudaGetErrorString(e));
    goto fail;
  }
  if (index > 0)
    SG_TRY_GOTO(sg__nccl_split(c, p, 0, c->rank, sg__deadline(timeout_ms), &n->comm, fn), st, fail);
  if (dev) SG_TRY_GOTO(sg__nccl_attach(ch, dev, timeout_ms, fn), st, fail);
  sg__nccl_leave(prev, n->ordinal);
  *chan = ch;
  return SG_OK;
fail:
  if (n) sg__nccl_finalize(n);
  if (n && n->own) (void)cudaStreamDestroy(n->own);
  if (n) sg__nccl_leave(prev, n->ordinal);
  sg__nccl_free(n);
  free(ch);
  return st;
}

/* The device's queue is drained: nothing of ours is pending on its stream. A failure seen by
 * the channel leaves its communicator broken too (the NCCL communicator was aborted). */
static void sg__nccl_unbind(sg_comm *chan) {
  sg__nccl *n = (sg__nccl *)chan->impl;
  if (chan->dev) chan->dev->ops->comm_detach(chan->dev);
  const int prev = sg__nccl_enter(n->ordinal, NULL);
  sg__nccl_finalize(n); /* a split of its own only */
  if (n->stage && n->own) (void)cudaFreeAsync(n->stage, n->own);
  if (n->own) (void)cudaStreamDestroy(n->own);
  sg__nccl_leave(prev, n->ordinal);
  sg__nccl_free(n);
  free(chan);
}

/* ---- sg_comm_split ---------------------------------------------------------------------------- */

/* Without ncclCommSplit: the new rank 0 of each color makes an id, every rank takes its
 * leader's from an all-gather over chan ([made flag, pad, id] per rank) and joins with it. */
#define SG__NCCL_ID_SLOT (8 + SG__NCCL_ID_BYTES)
static sg_status sg__nccl_split_by_ids(sg_comm *chan, const int *colors, const int *keys,
                                       int64_t deadline_ms, sg_comm **out, const char *fn) {
  sg__nccl *n = (sg__nccl *)chan->impl;
  const int world = chan->world, me = chan->rank;
  int size = 0;
  const int nr = sg__comm_split_rank(colors, keys, world, me, &size);
  unsigned char *slots = (unsigned char *)calloc((size_t)world, SG__NCCL_ID_SLOT);
  if (!slots) return sg__comm_fail(chan, SG_ERR_OUT_OF_MEMORY, fn, "out of memory (world %d)", world);
  unsigned char *mine = slots + (size_t)me * SG__NCCL_ID_SLOT;
  ncclUniqueId id;
  if (nr == 0 && n->nc->GetUniqueId(&id) == ncclSuccess) {
    mine[0] = 1;
    memcpy(mine + 8, id.internal, SG__NCCL_ID_BYTES);
  }
  sg_status st = chan->ops->all_gather(chan, slots, SG__NCCL_ID_SLOT, deadline_ms);
  if (st == SG_OK && nr >= 0) {
    const int lead = sg__comm_split_leader(colors, keys, world, me);
    const unsigned char *theirs = slots + (size_t)lead * SG__NCCL_ID_SLOT;
    if (!theirs[0]) {
      st = sg__comm_fail(chan, SG_ERR_COMM, fn, "rank %d could not make the NCCL id of color %d",
                         lead, colors[me]);
    } else {
      memcpy(id.internal, theirs + 8, SG__NCCL_ID_BYTES);
      st = sg__nccl_new(n->nc, nr, size, &id, NULL, n->ordinal, out, fn);
      if (st != SG_OK) chan->broken = 1; /* the others may have theirs */
    }
  }
  free(slots);
  return st;
}

/* sg_comm_split's part (sg_split.c has gathered every rank's color and key over chan, a host
 * channel): ncclCommSplit of the channel's NCCL communicator where NCCL has it, else fresh ids
 * handed out over the channel. The new communicator is on the same GPU. */
static sg_status sg__nccl_split_op(sg_comm *chan, const int *colors, const int *keys,
                                   int64_t deadline_ms, sg_comm **out) {
  static const char fn[] = "sg_comm_split(nccl)";
  sg__nccl *n = (sg__nccl *)chan->impl;
  if (!n->nc->CommSplit) return sg__nccl_split_by_ids(chan, colors, keys, deadline_ms, out, fn);
  const int me = chan->rank;
  int size = 0;
  const int nr = sg__comm_split_rank(colors, keys, chan->world, me, &size);
  const int prev = sg__nccl_enter(n->ordinal, NULL);
  ncclComm_t made = NULL;
  sg_status st = sg__nccl_split(chan, n->base, nr < 0 ? NCCL_SPLIT_NOCOLOR : colors[me], keys[me],
                                deadline_ms, &made, fn);
  sg__nccl_leave(prev, n->ordinal);
  if (st != SG_OK || nr < 0) return st;
  st = sg__nccl_new(n->nc, nr, size, NULL, made, n->ordinal, out, fn);
  if (st != SG_OK) chan->broken = 1; /* the others have theirs */
  return st;
}

/* ---- creation ------------------------------------------------------------------------------- */

/* NCCL's non-blocking initialization, waited for with the init timeout (see "non-blocking
 * creation" above: the handle may come later than the call's return). */
static sg_status sg__nccl_init_comm(const sg__nccl_lib *nc, int rank, int world,
                                    const ncclUniqueId *id, ncclComm_t *out, const char *fn) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t *cell = (ncclComm_t *)calloc(1, sizeof *cell);
  if (!cell) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int64_t deadline = sg__deadline(sg__nccl_init_timeout_ms());
  ncclResult_t r = nc->CommInitRankConfig(cell, world, *id, rank, &cfg);
  int expired = 0;
  if (r == ncclSuccess || r == ncclInProgress)
    r = sg__nccl_await(nc, NULL, cell, 1, r, deadline, &expired);
  if (r == ncclSuccess) {
    *out = sg__nccl_cell_get(cell);
    free(cell);
    return SG_OK;
  }
  char detail[256];
  const char *last = nc->GetLastError(sg__nccl_cell_get(cell));
  snprintf(detail, sizeof detail, "%s", last ? last : "");
  sg__nccl_cell_drop(nc, cell, expired);
  if (expired)
    return sg__err_at(SG_ERR_TIMEOUT, __FILE__, __LINE__,
                      "%s: NCCL initialization (rank %d of %d) did not complete within "
                      "SG_NCCL_INIT_TIMEOUT_MS=%d ms (do all ranks use the same id?)",
                      fn, rank, world, sg__nccl_init_timeout_ms());
  return sg__err_at(SG_ERR_COMM, __FILE__, __LINE__,
                    "%s: NCCL initialization (rank %d of %d) failed: %s%s%s", fn, rank, world,
                    nc->GetErrorString(r), detail[0] ? ": " : "", detail);
}

/* A communicator over `made` (an NCCL communicator of world ranks, e.g. from ncclCommSplit; it
 * is ours from now on, also on failure), or, when made is NULL, over a new one joined with id. */
static sg_status sg__nccl_new(const sg__nccl_lib *nc, int rank, int world, const ncclUniqueId *id,
                              ncclComm_t made, int ordinal, sg_comm **out, const char *fn) {
  sg_comm *c = (sg_comm *)calloc(1, sizeof *c);
  sg__nccl *n = sg__nccl_alloc();
  sg_status st = SG_OK;
  int prev = -1;
  if (!c || !n) {
    if (made) (void)nc->CommAbort(made);
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "%s: communicator struct", fn);
    goto fail;
  }
  n->comm = made;
  n->nc = nc;
  n->base = n;
  n->ordinal = ordinal;
  c->ops = &sg__nccl_ops;
  c->rank = rank;
  c->world = world;
  c->threaded = 1;
  c->stream_ordered = 1;
  c->impl = n;
  cudaError_t e;
  prev = sg__nccl_enter(ordinal, &e);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&n->own, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    st = sg__err_at(SG_ERR_CUDA, __FILE__, __LINE__, "%s: cannot set up GPU %d: %s", fn, ordinal,
                    cudaGetErrorString(e));
    goto fail;
  }
  if (!made) SG_TRY_GOTO(sg__nccl_init_comm(nc, rank, world, id, &n->comm, fn), st, fail);
  SG_LOG(SG_LOG_INFO, rank, "nccl communicator: rank %d of %d on GPU %d", rank, world, ordinal);
  sg__nccl_leave(prev, ordinal);
  *out = c;
  return SG_OK;
fail:
  sg__nccl_leave(prev, ordinal);
  if (c && n) {
    sg__nccl_destroy(c);
  } else {
    free(c);
    sg__nccl_free(n);
  }
  return st;
}

/* The id: the caller's, or through SG_NCCL_ID_FILE (rank 0 creates and writes it). */
static sg_status sg__nccl_bootstrap(const sg__nccl_lib *nc, int rank, int world,
                                    const void *id128, const char *path, ncclUniqueId *id,
                                    const char *fn) {
  if (id128) {
    memcpy(id->internal, id128, SG__NCCL_ID_BYTES);
    return SG_OK;
  }
  if (rank != 0) {
    int64_t deadline = sg__deadline(sg__nccl_init_timeout_ms());
    return sg__err_prefix(sg__nccl_id_file_read(path, world, deadline, id->internal), fn);
  }
  ncclResult_t r = nc->GetUniqueId(id);
  if (r != ncclSuccess)
    return sg__err_at(SG_ERR_COMM, __FILE__, __LINE__, "%s: ncclGetUniqueId failed: %s", fn,
                      nc->GetErrorString(r));
  if (access(path, F_OK) == 0)
    SG_LOG(SG_LOG_WARN, rank, "%s: replacing an existing %s (left by an earlier run?)", fn, path);
  return sg__err_prefix(sg__nccl_id_file_write(path, id->internal, world), fn);
}

sg_status sg_comm_create_nccl(int rank, int world, const void *id128, int cuda_device,
                              sg_comm **out) {
  static const char fn[] = "sg_comm_create_nccl";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  if (world < 1 || rank < 0 || rank >= world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: rank %d / world %d out of range", fn, rank, world);
  if (cuda_device < -1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cuda_device must be >= -1 (%d)", fn, cuda_device);
  const char *path = id128 ? NULL : sg__env_text(SG_ENV_NCCL_ID_FILE);
  if (!id128 && (!path || !*path))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: id128 is NULL and SG_NCCL_ID_FILE is not set", fn);
  int ordinal = 0;
  SG_TRY(sg__device_cuda_pick(cuda_device, &ordinal, fn));
  const sg__nccl_lib *nc = NULL;
  SG_TRY(sg__nccl_lib_load(fn, &nc));
  ncclUniqueId id;
  SG_TRY(sg__nccl_bootstrap(nc, rank, world, id128, path, &id, fn));
  sg_status st = sg__nccl_new(nc, rank, world, &id, NULL, ordinal, out, fn);
  /* Every rank has read the file once initialization is over (it needs all of them). */
  if (path && rank == 0) (void)unlink(path);
  return st;
}

sg_status sg_nccl_unique_id(void *id128) {
  static const char fn[] = "sg_nccl_unique_id";
  if (!id128) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: id128 is NULL", fn);
  const sg__nccl_lib *nc = NULL;
  SG_TRY(sg__nccl_lib_load(fn, &nc));
  ncclUniqueId id;
  ncclResult_t r = nc->GetUniqueId(&id);
  if (r != ncclSuccess)
    return sg__err_at(SG_ERR_COMM, __FILE__, __LINE__, "%s: ncclGetUniqueId failed: %s", fn,
                      nc->GetErrorString(r));
  memcpy(id128, id.internal, SG__NCCL_ID_BYTES);
  return SG_OK;
}

#else  /* !SG_HAVE_NCCL */
typedef int sg__nccl_not_built; /* ISO C wants a translation unit to declare something */
#endif /* SG_HAVE_NCCL */
