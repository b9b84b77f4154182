/* Defects of the CUDA path that the mocks hid while they were kinder than the real runtimes
 * (issue 28). The mocks (tests/cudamock) now behave like CUDA >= 12 and NCCL >= 2.18; each case
 * failed on the code before its fix:
 *   - contexts (defect 3): cudaGetDevice answers 0 on a thread that never chose a device, and
 *     the library "restored" that with cudaSetDevice(0), creating GPU 0's primary context in a
 *     process whose rank only uses GPU 1 (the mock counts contexts per device);
 *   - abort (defect 6): a device wait's abort set the NCCL handle to NULL and freed it while
 *     another thread was inside NCCL with it (the mock keeps a freed handle poisoned and counts
 *     the calls that still use it);
 *   - cudaFree (defect 5): it waits for every stream of the device, and blocks on a stalled one
 *     (the mock counts those blocks): freeing while a collective is stuck must not happen, the
 *     engine aborts every communicator first.
 * The context case must run first: the process may not have touched GPU 0 before it. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h> /* the mock's: contexts, stalls, call counts */
#include <nccl.h>         /* the mock's: dead handles, held calls */

#include "comm/sg_comm.h"     /* collectives through the vtable, bind */
#include "device/sg_device.h" /* the CUDA device */
#include "shardgrad.h"

#include "sg_test_check.h"
#include "sg_test_ranks.h" /* sg_test_train_small_on */

enum { N = 4096 };

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- defect 3: no context created on GPU 0 ------------------------------------------------ */

/* A rank thread that never chose a device: an NCCL communicator and an engine on GPU 1, three
 * steps, its parameters read back, everything destroyed. */
static void *gpu1_rank(void *arg) {
  const unsigned char *id = (const unsigned char *)arg;
  sg_comm *c = NULL;
  float out[SG_TEST_SMALL_NUMEL];
  sg_status st = sg_comm_create_nccl(0, 1, id, 1, &c);
  if (st == SG_OK) st = sg_test_train_small_on(c, SG_DEVICE_CUDA, 1, 0, out);
  CHECK(st == SG_OK, "GPU 1 rank: communicator, engine, 3 steps, read back (%s)",
        sg_status_string(st));
  sg_comm_destroy(c);
  return NULL;
}

static void no_context_on_gpu0(void) {
  unsigned char id[128];
  if (!CHECK(sg_nccl_unique_id(id) == SG_OK, "contexts: sg_nccl_unique_id")) return;
  CHECK(sg_cudamock_contexts(0) == 0 && sg_cudamock_contexts(1) == 0,
        "contexts: none before the rank starts");
  pthread_t th;
  pthread_create(&th, NULL, gpu1_rank, id);
  pthread_join(th, NULL);
  CHECK(sg_cudamock_contexts(1) == 1, "contexts: the rank's GPU 1 has its context (%d)",
        sg_cudamock_contexts(1));
  CHECK(sg_cudamock_contexts(0) == 0,
        "contexts: no context created on GPU 0, which the rank never uses (%d)",
        sg_cudamock_contexts(0));
}

/* A thread that did choose GPU 0 gets it back after every call on GPU 1. */
static void *chosen_rank(void *arg) {
  cudaSetDevice(0);
  gpu1_rank(arg);
  int cur = -1;
  cudaGetDevice(&cur);
  CHECK(cur == 0, "contexts: a thread that chose GPU 0 is on GPU 0 again (%d)", cur);
  return NULL;
}

static void chosen_device_restored(void) {
  unsigned char id[128];
  if (!CHECK(sg_nccl_unique_id(id) == SG_OK, "restore: sg_nccl_unique_id")) return;
  pthread_t th;
  pthread_create(&th, NULL, chosen_rank, id);
  pthread_join(th, NULL);
}

/* ---- defect 6: abort while another thread is inside NCCL ------------------------------------ */

/* The attachment the NCCL channel hands the device at bind: its abort is what a device wait
 * calls when a deadline passes, possibly while another thread issues a collective. */
static sg__comm_attach g_att;
static const sg__device_ops *g_real_ops;

static sg_status spy_attach(sg__device *d, const sg__comm_attach *a, sg__comm_native *out) {
  g_att = *a;
  return g_real_ops->comm_attach(d, a, out);
}

typedef struct issuer {
  sg_comm *chan;
  float *buf;
  sg_status st;
} issuer;

static void *issue_one(void *arg) {
  issuer *x = (issuer *)arg;
  x->st = x->chan->ops->all_reduce(x->chan, x->buf, N, SG_F32, sg__deadline(10000));
  return NULL;
}

static void abort_while_inside(void) {
  sg__device *d = NULL;
  if (!CHECK(sg__device_cuda_create(0, 0, &d) == SG_OK, "abort: CUDA device")) return;
  sg__device_ops spy = *d->ops;
  g_real_ops = d->ops;
  spy.comm_attach = spy_attach;
  d->ops = &spy;
  unsigned char id[128];
  sg_comm *c = NULL, *chan = NULL;
  float *buf = NULL;
  int ok = sg_nccl_unique_id(id) == SG_OK && sg_comm_create_nccl(0, 1, id, 0, &c) == SG_OK &&
           sg__comm_bind(c, d, 10000, &chan) == SG_OK && g_att.abort &&
           d->ops->alloc(d, N * sizeof(float), (void **)&buf) == SG_OK &&
           d->ops->zero(d, SG_Q_COMPUTE, buf, N * sizeof(float)) == SG_OK;
  if (!CHECK(ok, "abort: NCCL channel bound to the device (%s)", sg_last_error())) return;
  const long long dead0 = sg_ncclmock_dead_calls();
  sg_ncclmock_hold(200); /* the collective stays inside NCCL for 200 ms */
  issuer x = {chan, buf, SG_ERR_INTERNAL};
  pthread_t th;
  pthread_create(&th, NULL, issue_one, &x);
  while (sg_ncclmock_inside() == 0) sleep_ms(1);
  g_att.abort(g_att.arg); /* as a device wait at its deadline would, on this thread */
  pthread_join(th, NULL);
  sg_ncclmock_hold(0);
  CHECK(sg_ncclmock_dead_calls() == dead0,
        "abort: no NCCL call used the handle after the abort freed it (%lld did)",
        sg_ncclmock_dead_calls() - dead0);
  CHECK(x.st == SG_OK || x.st == SG_ERR_COMM, "abort: the collective in flight ends (%s)",
        sg_status_string(x.st));
  const sg_status again = chan->ops->all_reduce(chan, buf, N, SG_F32, sg__deadline(10000));
  CHECK(again == SG_ERR_COMM, "abort: the next collective is SG_ERR_COMM (%s: %s)",
        sg_status_string(again), sg_last_error());
  CHECK(sg_ncclmock_dead_calls() == dead0, "abort: still no call on the freed handle");
  d->ops->sync(d, sg__deadline(10000));
  sg__comm_unbind(chan);
  sg_comm_destroy(c);
  d->ops->free(d, buf);
  d->ops = g_real_ops;
  d->ops->destroy(d);
}

/* ---- defect 5: cudaFree / cudaFreeHost wait for the whole device ---------------------------- */

/* A pageable copy that outgrows the staging buffer while another stream of the device is stuck:
 * the old buffer must not go through cudaFreeHost (it would block behind the stuck stream). */
static void staging_regrow_no_device_sync(void) {
  sg__device *d = NULL;
  if (!CHECK(sg__device_cuda_create(0, 0, &d) == SG_OK, "regrow: CUDA device")) return;
  enum { BIG = 64 << 10 };
  static unsigned char src[BIG], back[BIG];
  for (int i = 0; i < BIG; i++) src[i] = (unsigned char)(i * 13 + 1);
  unsigned char *dbuf = NULL, *other = NULL;
  cudaStream_t stuck = NULL;
  int ok = d->ops->alloc(d, BIG, (void **)&dbuf) == SG_OK &&
           d->ops->alloc(d, 256, (void **)&other) == SG_OK &&
           cudaStreamCreateWithFlags(&stuck, cudaStreamNonBlocking) == cudaSuccess;
  if (!CHECK(ok, "regrow: buffers and a second stream")) return;
  sg_cudamock_stall(stuck, 1); /* as behind a collective whose peer died */
  cudaMemsetAsync(other, 0, 256, stuck);
  const long long blocked0 = sg_cudamock_calls("free_block");
  ok = d->ops->copy(d, SG_Q_COMPUTE, dbuf, src, 1024, SG_COPY_H2D) == SG_OK &&
       d->ops->copy(d, SG_Q_COMPUTE, dbuf, src, BIG, SG_COPY_H2D) == SG_OK &&
       d->ops->copy(d, SG_Q_COMPUTE, back, dbuf, BIG, SG_COPY_D2H) == SG_OK;
  CHECK(ok && memcmp(src, back, BIG) == 0, "regrow: staged copies of 1 KiB then 64 KiB, both ways");
  CHECK(sg_cudamock_calls("free_block") == blocked0,
        "regrow: no cudaFreeHost blocked behind the stuck stream (%lld did)",
        sg_cudamock_calls("free_block") - blocked0);
  sg_cudamock_stall(stuck, 0);
  sg_cudamock_drain();
  cudaStreamDestroy(stuck);
  d->ops->free(d, other);
  d->ops->free(d, dbuf);
  d->ops->destroy(d);
}

/* Rank 1 of the second communicator: joins its creation, then never takes part again (a peer
 * that died) until the main thread is done. */
typedef struct peer {
  const unsigned char *id;
  pthread_barrier_t *bar;
} peer;

static void *silent_peer(void *arg) {
  peer *p = (peer *)arg;
  sg_comm *c = NULL;
  CHECK(sg_comm_create_nccl(1, 2, p->id, 0, &c) == SG_OK, "abort all: the peer's communicator");
  pthread_barrier_wait(p->bar);
  sg_comm_destroy(c);
  return NULL;
}

typedef struct stuck_job {
  sg_comm *chan;
  float *buf;
} stuck_job;

static sg_status issue_stuck(void *arg) {
  stuck_job *j = (stuck_job *)arg;
  return j->chan->ops->all_reduce(j->chan, j->buf, N, SG_F32, sg__deadline(10000));
}

/* Two NCCL channels on one device (a hybrid engine's shard and replica): a collective of the
 * second waits for a peer that never comes, then the first reports an error. The failure must
 * abort both, so that the device's memory can be freed without blocking behind the second's
 * kernel. */
static void failure_aborts_every_channel(void) {
  unsigned char ida[128], idb[128];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, 2);
  if (!CHECK(sg_nccl_unique_id(ida) == SG_OK && sg_nccl_unique_id(idb) == SG_OK, "abort all: ids"))
    return;
  peer p = {idb, &bar};
  pthread_t th;
  pthread_create(&th, NULL, silent_peer, &p);
  sg__device *d = NULL;
  sg_comm *a = NULL, *b = NULL, *cha = NULL, *chb = NULL;
  float *buf = NULL;
  int ok = sg__device_cuda_create(0, 0, &d) == SG_OK &&
           sg_comm_create_nccl(0, 1, ida, 0, &a) == SG_OK &&
           sg_comm_create_nccl(0, 2, idb, 0, &b) == SG_OK &&
           sg__comm_bind(a, d, 300, &cha) == SG_OK && sg__comm_bind(b, d, 300, &chb) == SG_OK &&
           d->ops->alloc(d, N * sizeof(float), (void **)&buf) == SG_OK &&
           d->ops->zero(d, SG_Q_COMPUTE, buf, N * sizeof(float)) == SG_OK;
  uint64_t t = 0;
  stuck_job j = {chb, buf};
  ok = ok && d->ops->comm_submit(d, issue_stuck, NULL, &j, &t) == SG_OK;
  if (CHECK(ok, "abort all: two channels bound, a collective of the second in flight (%s)",
            sg_last_error())) {
    const int live = sg_ncclmock_live();
    sg_ncclmock_fail_world(1, ncclRemoteError); /* the first channel's communicator fails */
    const sg_status st = d->ops->comm_wait(d, t, sg__deadline(5000));
    CHECK(st == SG_ERR_COMM, "abort all: the wait reports the first channel's failure (%s)",
          sg_status_string(st));
    CHECK(sg_ncclmock_live() == live - 2, "abort all: both communicators aborted (%d of 2)",
          live - sg_ncclmock_live());
    const long long blocked0 = sg_cudamock_calls("free_block");
    d->ops->free(d, buf);
    buf = NULL;
    CHECK(sg_cudamock_calls("free_block") == blocked0,
          "abort all: the free did not block behind the second channel's collective");
  }
  pthread_barrier_wait(&bar);
  pthread_join(th, NULL);
  pthread_barrier_destroy(&bar);
  if (d && buf) d->ops->free(d, buf);
  if (chb) sg__comm_unbind(chb);
  if (cha) sg__comm_unbind(cha);
  sg_comm_destroy(b);
  sg_comm_destroy(a);
  if (d) d->ops->destroy(d);
}

int main(void) {
  sg_cudamock_set_devices(2);
  no_context_on_gpu0(); /* first: nothing has touched GPU 0 yet */
  chosen_device_restored();
  abort_while_inside();
  staging_regrow_no_device_sync();
  failure_aborts_every_channel();
  return sg_test_summary("");
}
