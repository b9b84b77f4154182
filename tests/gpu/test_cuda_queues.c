/* GPU only (tests/gpu/run.sh; not in ctest): the CUDA device's queues and the NCCL
 * communicator on one GPU.
 *  - comm jobs run after the compute work issued before them (event), the compute queue waits
 *    for a job with compute_wait_comm, tickets, a caller's stream through set_stream;
 *  - host-driven jobs (no stream-ordered communicator attached) complete their comm-queue work
 *    before each call returns;
 *  - a wait past its deadline gives SG_ERR_TIMEOUT and breaks the device for later calls;
 *  - allocation failures (the test hook, and a request larger than the GPU);
 *  - NCCL at world 1: every collective on device and host buffers, bound and unbound, f64; the
 *    file bootstrap (the file is removed afterwards); initialization that times out when the
 *    second rank never comes. */
#define _POSIX_C_SOURCE 200809L /* setenv, mkdtemp */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>   /* nanosleep */
#include <unistd.h> /* access, rmdir */

#include <cuda_runtime.h> /* a caller's stream, cudaLaunchHostFunc, cudaStreamQuery */

#include "comm/sg_comm.h"          /* sg_comm internals: dev, ops */
#include "device/sg_device.h"      /* sg__device_cuda_create */
#include "../sg_test_check.h"      /* CHECK */

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

static int says(const char *s) { return strstr(sg_last_error(), s) != NULL; }

#define N_BIG ((size_t)1 << 24) /* 64 MiB of floats: a missing dependency would show */

/* ---- comm jobs ------------------------------------------------------------------------------ */

/* The comm stream of the device under test, as a communicator gets it (comm_attach), taken
 * outside the jobs: jobs read it here. */
static cudaStream_t g_comm;

static cudaStream_t comm_stream_of(sg__device *d) {
  const sg__comm_attach probe = {0, 1, NULL, NULL, NULL, 0};
  sg__comm_native native = {NULL, -1};
  if (d->ops->comm_attach(d, &probe, &native) != SG_OK) return NULL;
  d->ops->comm_detach(d);
  return (cudaStream_t)native.stream;
}

typedef struct copy_job {
  sg__device *d;
  void *dst;
  const void *src;
  size_t bytes;
  int done_on_return; /* host-driven: was the comm stream idle after the copy? */
} copy_job;

static sg_status copy_job_fn(void *arg) {
  copy_job *j = (copy_job *)arg;
  sg_status st = j->d->ops->copy(j->d, SG_Q_COMM, j->dst, j->src, j->bytes, SG_COPY_D2D);
  cudaStream_t s = g_comm;
  j->done_on_return = cudaStreamQuery(s) == cudaSuccess;
  return st;
}

static void test_jobs(sg__device *d) {
  const sg__device_ops *o = d->ops;
  float *h = malloc(N_BIG * 4), *back = malloc(N_BIG * 4);
  for (size_t i = 0; i < N_BIG; i++) h[i] = (float)(i % 1000);
  void *a = NULL, *b = NULL;
  check(o->alloc(d, N_BIG * 4, &a) == SG_OK && o->alloc(d, N_BIG * 4, &b) == SG_OK, "alloc");
  check(o->copy(d, SG_Q_COMPUTE, a, h, N_BIG * 4, SG_COPY_H2D) == SG_OK, "H2D");
  /* compute: a += a (async); the job copies a to b on the comm queue */
  check(o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N_BIG) == SG_OK, "accumulate on compute");
  copy_job j = {d, b, a, N_BIG * 4, 0};
  uint64_t t1 = 0, t2 = 0;
  check(o->comm_submit(d, copy_job_fn, NULL, &j, &t1) == SG_OK && t1 > 0, "comm_submit: ticket");
  check(j.done_on_return, "host-driven job: comm work complete when the call returned");
  check(o->comm_wait(d, t1, sg__deadline(30000)) == SG_OK, "comm_wait");
  /* compute waits for the job, then b += b */
  check(o->compute_wait_comm(d, t1, sg__deadline(30000)) == SG_OK, "compute_wait_comm");
  check(o->accumulate(d, SG_Q_COMPUTE, b, 0, b, 0, N_BIG) == SG_OK, "accumulate b");
  check(o->copy(d, SG_Q_COMPUTE, back, b, N_BIG * 4, SG_COPY_D2H) == SG_OK, "D2H");
  int ok = 1;
  for (size_t i = 0; i < N_BIG && ok; i++) ok = back[i] == 4.0f * h[i];
  check(ok, "job saw the compute result; compute saw the job's result (b == 4*h)");
  check(o->comm_submit(d, copy_job_fn, NULL, &j, &t2) == SG_OK && t2 == t1 + 1, "tickets increase");
  check(o->comm_wait(d, 0, sg__deadline(1000)) == SG_OK, "comm_wait(0) returns at once");
  check(o->comm_wait(d, t2 + 5, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "comm_wait on a ticket never issued");

  /* a caller's stream */
  cudaStream_t user;
  cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking);
  check(o->set_stream(d, user) == SG_OK, "set_stream(user)");
  check(o->copy(d, SG_Q_COMPUTE, a, h, N_BIG * 4, SG_COPY_H2D) == SG_OK &&
            o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N_BIG) == SG_OK &&
            o->copy(d, SG_Q_COMPUTE, back, a, N_BIG * 4, SG_COPY_D2H) == SG_OK &&
            back[N_BIG - 1] == 2.0f * h[N_BIG - 1] && back[7] == 14.0f,
        "work on the caller's stream");
  check(o->sync(d, sg__deadline(30000)) == SG_OK, "sync on the caller's stream");
  check(o->set_stream(d, NULL) == SG_OK, "set_stream(NULL)");
  cudaStreamDestroy(user);
  double s = 0, nf = -1;
  check(o->sumsq(d, SG_Q_COMM, a, 0, 1000, &s, &nf) == SG_OK && nf == 0.0 && s > 0.0,
        "sumsq on the comm queue");
  o->free(d, a);
  o->free(d, b);
  free(h);
  free(back);
}

/* ---- deadline -------------------------------------------------------------------------------- */

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void CUDART_CB sleepy(void *arg) { sleep_ms((long)(size_t)arg); }

typedef struct sleep_job {
  sg__device *d;
  int ms;
} sleep_job;

static sg_status sleep_job_fn(void *arg) {
  sleep_job *j = (sleep_job *)arg;
  cudaStream_t s = g_comm;
  cudaLaunchHostFunc(s, sleepy, (void *)(size_t)j->ms);
  return SG_OK;
}

static void test_timeout(void) {
  sg__device *d = NULL;
  if (sg__device_cuda_create(0, -1, &d) != SG_OK) {
    check(0, "second device");
    return;
  }
  /* stream-ordered, as NCCL attaches: the job only enqueues, the wait polls the stream */
  const sg__comm_attach ordered = {1, 0, NULL, NULL, NULL, 0};
  sg__comm_native native = {NULL, -1};
  check(d->ops->comm_attach(d, &ordered, &native) == SG_OK, "attach stream-ordered");
  cudaStream_t outer = g_comm;
  g_comm = (cudaStream_t)native.stream;
  sleep_job j = {d, 1500};
  uint64_t t = 0;
  check(d->ops->comm_submit(d, sleep_job_fn, NULL, &j, &t) == SG_OK, "submit a 1.5 s job");
  int64_t t0 = sg__now_ms();
  sg_status st = d->ops->comm_wait(d, t, sg__now_ms() + 100);
  check(st == SG_ERR_TIMEOUT && sg__now_ms() - t0 < 1400,
        "comm_wait past its deadline: SG_ERR_TIMEOUT");
  check(d->ops->comm_wait(d, t, sg__deadline(10000)) == SG_ERR_TIMEOUT,
        "later waits return the recorded failure");
  check(d->ops->comm_submit(d, sleep_job_fn, NULL, &j, &t) != SG_OK, "later submits fail");
  sleep_ms(1600); /* let the host function finish before the streams go */
  d->ops->comm_detach(d);
  d->ops->destroy(d);
  g_comm = outer;
}

static void test_alloc_failures(sg__device *d) {
  void *p = (void *)&p;
  sg__device_fail_alloc_after(0);
  check(d->ops->alloc(d, 64, &p) == SG_ERR_OUT_OF_MEMORY && p == NULL, "injected alloc failure");
  sg__device_fail_alloc_after(-1);
  check(d->ops->alloc(d, (size_t)1 << 52, &p) == SG_ERR_OUT_OF_MEMORY && says("cudaMalloc"),
        "a request larger than the GPU: SG_ERR_OUT_OF_MEMORY");
  check(d->ops->alloc(d, 0, &p) == SG_OK && p != NULL, "alloc of 0 bytes gives a block");
  d->ops->free(d, p);
  check(d->ops->host_alloc(d, 4096, &p) == SG_OK && p != NULL, "host_alloc (pinned)");
  d->ops->host_free(d, p);
}

/* ---- NCCL at world 1 ------------------------------------------------------------------------ */

#ifdef SG_HAVE_NCCL
typedef struct coll_job {
  sg_comm *c;
  void *buf;
  size_t count;
  int dtype;
  int op; /* 0 all_reduce, 1 reduce_scatter, 2 all_gather, 3 broadcast */
} coll_job;

static sg_status coll_job_fn(void *arg) {
  coll_job *j = (coll_job *)arg;
  int64_t dl = sg__deadline(30000);
  switch (j->op) {
    case 0: return j->c->ops->all_reduce(j->c, j->buf, j->count, j->dtype, dl);
    case 1: return j->c->ops->reduce_scatter(j->c, j->buf, j->count, j->dtype, dl);
    case 2: return j->c->ops->all_gather(j->c, j->buf, j->count, dl);
    default: return j->c->ops->broadcast(j->c, j->buf, j->count, 0, dl);
  }
}

/* Every collective leaves a world-1 buffer as it was. */
static void nccl_collectives(sg__device *d, sg_comm *comm, int bound, int host) {
  sg_comm *c = comm; /* bound: a channel attached to the device (the second one a split) */
  if (bound && sg__comm_bind(comm, d, 30000, &c) != SG_OK) {
    check(0, "nccl: bind to the device");
    return;
  }
  const size_t n = 100003;
  double *h = malloc(n * 8), *back = malloc(n * 8);
  for (size_t i = 0; i < n; i++) h[i] = (double)i * 0.25;
  void *buf = NULL;
  if (host)
    buf = malloc(n * 8);
  else
    d->ops->alloc(d, n * 8, &buf);
  static const int dtypes[] = {0, 1, 2, 3};
  for (int op = 0; op < 4; op++)
    for (int k = 0; k < 4; k++) {
      if (op >= 2 && k > 0) continue; /* byte collectives: once */
      if (host)
        memcpy(buf, h, n * 8);
      else
        d->ops->copy(d, SG_Q_COMPUTE, buf, h, n * 8, SG_COPY_H2D);
      const size_t count = op >= 2 ? n * 8 : n * 8 / (dtypes[k] == 3 ? 8 : dtypes[k] == 0 ? 4 : 2);
      coll_job j = {c, buf, count, dtypes[k], op};
      sg_status st;
      if (bound) {
        uint64_t t = 0;
        st = d->ops->comm_submit(d, coll_job_fn, NULL, &j, &t);
        if (st == SG_OK) st = d->ops->comm_wait(d, t, sg__deadline(30000));
      } else {
        st = coll_job_fn(&j);
      }
      if (host)
        memcpy(back, buf, n * 8);
      else
        d->ops->copy(d, SG_Q_COMPUTE, back, buf, n * 8, SG_COPY_D2H);
      char what[128];
      snprintf(what, sizeof what, "nccl %s dtype %d, %s, %s buffer",
               op == 0   ? "all_reduce"
               : op == 1 ? "reduce_scatter"
               : op == 2 ? "all_gather"
                         : "broadcast",
               dtypes[k], bound ? "bound to the device" : "unbound", host ? "host" : "device");
      /* bf16/f16 sums of one rank are exact copies; the bits must be unchanged */
      check(st == SG_OK && memcmp(back, h, n * 8) == 0, what);
    }
  if (host)
    free(buf);
  else
    d->ops->free(d, buf);
  if (bound) sg__comm_unbind(c);
  free(h);
  free(back);
}

static void test_nccl(sg__device *d) {
  unsigned char id[128];
  sg_comm *c = NULL;
  check(sg_nccl_unique_id(id) == SG_OK, "nccl: unique id");
  check(sg_comm_create_nccl(0, 1, id, -1, &c) == SG_OK && c, "nccl: world 1 communicator");
  if (!c) return;
  for (int bound = 0; bound < 2; bound++)
    for (int host = 0; host < 2; host++) nccl_collectives(d, c, bound, host);
  check(c->ops->broadcast(c, id, 8, 1, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "nccl: broadcast root out of range");
  check(c->ops->all_reduce(c, id, 4, 7, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "nccl: unknown dtype");
  sg_comm_destroy(c);

  /* the file bootstrap */
  char dir[] = "/tmp/sg_nccl_gpuXXXXXX", path[256];
  if (mkdtemp(dir)) {
    snprintf(path, sizeof path, "%s/id", dir);
    setenv("SG_NCCL_ID_FILE", path, 1);
    c = NULL;
    check(sg_comm_create_nccl(0, 1, NULL, -1, &c) == SG_OK && c, "nccl: SG_NCCL_ID_FILE bootstrap");
    check(access(path, F_OK) != 0, "nccl: id file removed after initialization");
    sg_comm_destroy(c);
    unsetenv("SG_NCCL_ID_FILE");
    rmdir(dir);
  }

  /* world 2 with only rank 0: initialization must time out */
  setenv("SG_NCCL_INIT_TIMEOUT_MS", "3000", 1);
  c = NULL;
  int64_t t0 = sg__now_ms();
  sg_nccl_unique_id(id);
  sg_status st = sg_comm_create_nccl(0, 2, id, -1, &c);
  check(st == SG_ERR_TIMEOUT && c == NULL && sg__now_ms() - t0 < 60000,
        "nccl: init without the second rank times out");
  unsetenv("SG_NCCL_INIT_TIMEOUT_MS");
}
#endif

int main(void) {
  sg__device *d = NULL;
  if (sg__device_cuda_create(0, -1, &d) != SG_OK) {
    printf("FAIL cannot create the CUDA device: %s\n0 passed, 1 failed\n", sg_last_error());
    return 1;
  }
  g_comm = comm_stream_of(d);
  test_jobs(d);
  test_alloc_failures(d);
#ifdef SG_HAVE_NCCL
  test_nccl(d);
#endif
  d->ops->destroy(d);
  test_timeout();
  return sg_test_summary("");
}
