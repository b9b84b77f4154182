/* Defects of the CUDA path that the mock CUDA runtime and mock NCCL (tests/cudamock) can show
 * without a GPU (issue 13, items 4-7 and 9). Each case fails on the code before its fix:
 *   - a stale cudaErrorNotReady left by a polling wait fails the next kernel launch (the mock
 *     keeps NotReady as the thread's last error, as the runtime does);
 *   - a copy from or to pageable host memory blocks in the driver until the stream gets there,
 *     before any deadline (the mock blocks too): it must end at the engine's timeout instead;
 *   - sg_engine_destroy with a reduction stuck on a dead NCCL peer must return within the
 *     timeout (it waited forever);
 *   - local ranks on different GPUs must be refused at the first rendezvous (they read each
 *     other's buffers without peer access);
 *   - every device and communicator call leaves the caller's current device as it found it. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h> /* the mock's: streams, stalls, call counts */
#include <nccl.h>         /* the mock's */

#include "comm/sg_comm.h"     /* collectives through the vtable */
#include "device/sg_device.h" /* the CUDA device */
#include "shardgrad.h"

#include "sg_test_check.h" /* CHECK, counted under one lock across threads */

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

typedef struct unstall {
  cudaStream_t s;
  int after_ms;
} unstall;

static void *unstall_later(void *arg) {
  const unstall *u = (const unstall *)arg;
  sleep_ms(u->after_ms);
  sg_cudamock_stall(u->s, 0);
  return NULL;
}

#define N 4096

/* sync polls a stalled caller's stream (NotReady) until another thread releases it; the next
 * kernel on this thread must launch. */
static void stale_not_ready(void) {
  sg__device *d = NULL;
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "not ready: create");
  cudaStream_t user;
  cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking);
  d->ops->set_stream(d, user);
  float *a = NULL;
  d->ops->alloc(d, N * 4, (void **)&a);
  d->ops->zero(d, SG_Q_COMPUTE, a, N * 4);
  sg_cudamock_stall(user, 1);
  unstall u = {user, 30};
  pthread_t th;
  pthread_create(&th, NULL, unstall_later, &u);
  check(d->ops->sync(d, sg__deadline(10000)) == SG_OK, "not ready: sync after the stream ran");
  pthread_join(th, NULL);
  check(d->ops->accumulate(d, SG_Q_COMPUTE, a, SG_F32, a, SG_F32, N) == SG_OK,
        "not ready: the next launch does not report the polls' NotReady");
  d->ops->free(d, a);
  d->ops->set_stream(d, NULL);
  d->ops->destroy(d);
  cudaStreamDestroy(user);
}

/* A D2H copy into pageable memory behind a stalled stream: SG_ERR_TIMEOUT at the attached
 * communicator's timeout, not a block in the driver until the stream moves (2 s here). */
static void pageable_copy(void) {
  sg__device *d = NULL;
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "pageable: create");
  const sg__comm_attach a = {0, 1, NULL, NULL, NULL, 200};
  sg__comm_native nat;
  check(d->ops->comm_attach(d, &a, &nat) == SG_OK, "pageable: attach with a 200 ms timeout");
  cudaStream_t user;
  cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking);
  d->ops->set_stream(d, user);
  float *dev = NULL;
  static float host[N]; /* pageable */
  d->ops->alloc(d, N * 4, (void **)&dev);
  d->ops->zero(d, SG_Q_COMPUTE, dev, N * 4);
  sg_cudamock_stall(user, 1);
  unstall u = {user, 2000};
  pthread_t th;
  pthread_create(&th, NULL, unstall_later, &u);
  const long long blocked0 = sg_cudamock_calls("pageable_block");
  const int64_t t0 = sg__now_ms();
  const sg_status st = d->ops->copy(d, SG_Q_COMPUTE, host, dev, N * 4, SG_COPY_D2H);
  const int64_t took = sg__now_ms() - t0;
  char what[160];
  snprintf(what, sizeof what,
           "pageable: D2H behind a stuck stream ends with SG_ERR_TIMEOUT at the deadline (%lld ms)",
           (long long)took);
  check(st == SG_ERR_TIMEOUT && took < 1500, what);
  check(sg_cudamock_calls("pageable_block") == blocked0,
        "pageable: no copy of pageable memory reached the driver");
  pthread_join(th, NULL);
  d->ops->free(d, dev);
  d->ops->comm_detach(d);
  d->ops->destroy(d);
  cudaStreamDestroy(user);

  /* healthy: the staged copies move every byte, both ways, in several chunks */
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "pageable: create again");
  const size_t big = ((size_t)8 << 20) + 12345; /* more than one staging chunk */
  unsigned char *src = malloc(big), *back = malloc(big), *dbuf = NULL;
  for (size_t i = 0; i < big; i++) src[i] = (unsigned char)(i * 7 + 3);
  d->ops->alloc(d, big, (void **)&dbuf);
  int ok = d->ops->copy(d, SG_Q_COMPUTE, dbuf, src, big, SG_COPY_H2D) == SG_OK;
  memset(back, 0, big);
  ok = ok && d->ops->copy(d, SG_Q_COMPUTE, back, dbuf, big, SG_COPY_D2H) == SG_OK;
  check(ok && memcmp(src, back, big) == 0, "pageable: staged H2D and D2H of 8 MiB + 12345 bytes");
  d->ops->free(d, dbuf);
  free(src);
  free(back);
  d->ops->destroy(d);
}

/* ---- the engine ------------------------------------------------------------------------------ */

static sg_status make_engine(sg_comm *c, int cuda_device, int timeout_ms, sg_engine **e, int *id) {
  sg_config cfg;
  SG_TRY(sg_config_init(&cfg, sizeof cfg));
  cfg.device = SG_DEVICE_CUDA;
  cfg.cuda_device = cuda_device;
  cfg.timeout_ms = timeout_ms;
  cfg.loss_scale = 1.0f;
  SG_TRY(sg_engine_create(c, &cfg, e));
  return sg_add_param(*e, "w", 1000, 0, id);
}

typedef struct rank_ctx {
  int rank, world;
  const unsigned char *id;
  sg_comm *c;
  int dead; /* rank 1 of the destroy case: finalizes, then never comes back */
  pthread_barrier_t *bar;
  int64_t destroy_ms;
  sg_status st;
} rank_ctx;

/* Rank 0 marks its gradient ready (a reduction on NCCL that rank 1 never joins) and destroys
 * its engine. */
static void *destroy_rank(void *arg) {
  rank_ctx *x = (rank_ctx *)arg;
  x->st = sg_comm_create_nccl(x->rank, x->world, x->id, 0, &x->c);
  sg_engine *e = NULL;
  int id = -1;
  if (x->st == SG_OK) x->st = make_engine(x->c, 0, 300, &e, &id);
  if (x->st == SG_OK) x->st = sg_finalize(e);
  pthread_barrier_wait(x->bar);
  if (x->dead) {
    pthread_barrier_wait(x->bar); /* until rank 0 is done: then leave without a word */
    sg_engine_destroy(e);
    return NULL;
  }
  if (x->st == SG_OK) x->st = sg_grad_ready(e, id);
  const int64_t t0 = sg__now_ms();
  sg_engine_destroy(e);
  x->destroy_ms = sg__now_ms() - t0;
  pthread_barrier_wait(x->bar);
  return NULL;
}

static void destroy_with_dead_peer(void) {
  unsigned char id[128];
  sg_nccl_unique_id(id);
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, 2);
  rank_ctx x[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    rank_ctx init = {r, 2, id, NULL, r == 1, &bar, -1, SG_ERR_INTERNAL};
    x[r] = init;
    pthread_create(&th[r], NULL, destroy_rank, &x[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&bar);
  check(x[0].st == SG_OK, "dead peer: rank 0 finalized and marked its gradient ready");
  char what[160];
  snprintf(what, sizeof what,
           "dead peer: sg_engine_destroy returns within the deadline (%lld ms, timeout 300 ms)",
           (long long)x[0].destroy_ms);
  check(x[0].destroy_ms >= 0 && x[0].destroy_ms < 5000, what);
  for (int r = 0; r < 2; r++) sg_comm_destroy(x[r].c);
}

/* Two local ranks, engines on GPUs 0 and 1: sg_finalize fails on both, naming the devices. */
typedef struct mixed_rank {
  sg_comm *c;
  int gpu;
  sg_status st;
  char err[512];
} mixed_rank;

static void *mixed_main(void *arg) {
  mixed_rank *m = (mixed_rank *)arg;
  sg_engine *e = NULL;
  int id = -1;
  m->st = make_engine(m->c, m->gpu, 10000, &e, &id);
  if (m->st == SG_OK) m->st = sg_finalize(e);
  snprintf(m->err, sizeof m->err, "%s", sg_last_error());
  sg_engine_destroy(e);
  return NULL;
}

static void mixed_devices(void) {
  sg_comm *cs[2];
  check(sg_comm_create_local(2, cs) == SG_OK, "mixed devices: local communicator");
  mixed_rank m[2] = {{cs[0], 0, SG_ERR_INTERNAL, ""}, {cs[1], 1, SG_ERR_INTERNAL, ""}};
  pthread_t th[2];
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, mixed_main, &m[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    char what[700];
    snprintf(what, sizeof what, "mixed devices: rank %d refused (%s: %s)", r,
             sg_status_string(m[r].st), m[r].err);
    check(m[r].st != SG_OK && strstr(m[r].err, "share one device"), what);
  }
  for (int r = 0; r < 2; r++) sg_comm_destroy(cs[r]);

  /* the same GPU on both ranks works */
  check(sg_comm_create_local(2, cs) == SG_OK, "same device: local communicator");
  mixed_rank s[2] = {{cs[0], 1, SG_ERR_INTERNAL, ""}, {cs[1], 1, SG_ERR_INTERNAL, ""}};
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, mixed_main, &s[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  check(s[0].st == SG_OK && s[1].st == SG_OK, "same device: both ranks finalize");
  for (int r = 0; r < 2; r++) sg_comm_destroy(cs[r]);
}

/* The caller's thread is on GPU 1; the device and the communicator work on GPU 0. */
static void current_device_kept(void) {
  cudaSetDevice(1);
  sg__device *d = NULL;
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "current device: create on GPU 0");
  int cur = -1;
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after sg__device_cuda_create");
  float *a = NULL;
  static float h[N];
  d->ops->alloc(d, N * 4, (void **)&a);
  d->ops->copy(d, SG_Q_COMPUTE, a, h, N * 4, SG_COPY_H2D);
  d->ops->accumulate(d, SG_Q_COMPUTE, a, SG_F32, a, SG_F32, N);
  double ss = 0, nf = 0;
  d->ops->sumsq(d, SG_Q_COMPUTE, a, SG_F32, N, &ss, &nf);
  d->ops->sync(d, sg__deadline(5000));
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after alloc, copy, kernels, sync");
  unsigned char id[128];
  sg_nccl_unique_id(id);
  sg_comm *c = NULL;
  check(sg_comm_create_nccl(0, 1, id, 0, &c) == SG_OK, "current device: NCCL on GPU 0");
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after sg_comm_create_nccl");
  float v[4] = {1, 2, 3, 4};
  check(c && c->ops->all_reduce(c, v, 4, SG_F32, sg__deadline(5000)) == SG_OK,
        "current device: an NCCL all-reduce of host memory");
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after the NCCL collective");
  sg_comm *chan = NULL;
  check(c && sg__comm_bind(c, d, 5000, &chan) == SG_OK, "current device: bind to the device");
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after bind");
  sg__comm_unbind(chan);
  sg_comm_destroy(c);
  d->ops->free(d, a);
  d->ops->destroy(d);
  cudaGetDevice(&cur);
  check(cur == 1, "current device: still GPU 1 after destroy");
  cudaSetDevice(0);
}

int main(void) {
  sg_cudamock_set_devices(2);
  stale_not_ready();
  pageable_copy();
  destroy_with_dead_peer();
  mixed_devices();
  current_device_kept();
  return sg_test_summary("");
}
