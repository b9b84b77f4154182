/* src/device/cuda.c on the mock CUDA runtime of tests/cudamock (lazy streams: work runs only
 * when something forces it), so that its stream logic is checked without a GPU:
 *  - a comm job sees the compute work issued before it (event at submit), the compute queue
 *    sees a job's work after compute_wait_comm, a stream switch keeps earlier work first;
 *    both for host-driven jobs and for stream-ordered ones (communicator hooks attached);
 *  - deadlines: a stalled comm stream gives SG_ERR_TIMEOUT, calls the abort hook, and breaks
 *    the device; a communicator error seen by the poll hook breaks it too; detach on destroy;
 *  - kernels through the device (adamw with its cached segment table, sumsq, reduce_sum, cast,
 *    accumulate) against the CPU kernels;
 *  - per-bucket AdamW tables: alternating sub-arrays of one segment array on both queues, bitwise
 *    against the CPU, and no upload or host wait once each table is cached (mock call counts);
 *  - host-driven jobs on the device's worker thread: a blocked job does not block submit or
 *    compute work, short waits time out without breaking the device, a failing job's status and
 *    text reach every later wait, destroy drains queued jobs;
 *  - allocation failures, and no device memory left behind by destroy. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h> /* the mock's: controls (stall, pending) and streams */

#include "cpu/sg_cpu_kernels.h"    /* references */
#include "device/sg_device.h"      /* the vtable, sg__device_cuda_create */
#include "sg_test_check.h"         /* CHECK */

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

static int says(const char *s) { return strstr(sg_last_error(), s) != NULL; }

#define N 10000

/* ---- hooks -------------------------------------------------------------------------------- */

typedef struct hook_state {
  int polls, aborts;
  sg_status poll_result;
} hook_state;

static sg_status hook_poll(void *arg) {
  hook_state *h = (hook_state *)arg;
  h->polls++;
  if (h->poll_result != SG_OK) return sg__err(h->poll_result, "mock comm: peer failed");
  return SG_OK;
}
static void hook_abort(void *arg) { ((hook_state *)arg)->aborts++; }

/* A stream-ordered communicator (as NCCL attaches); returns the comm stream. */
static cudaStream_t attach(sg__device *d, hook_state *h) {
  const sg__comm_attach a = {1, 0, hook_poll, hook_abort, h, 0};
  sg__comm_native nat = {NULL, -1};
  check(d->ops->comm_attach(d, &a, &nat) == SG_OK && nat.stream && nat.ordinal == 0,
        "comm_attach (stream-ordered): the comm stream and the GPU");
  return (cudaStream_t)nat.stream;
}

/* The comm stream without an attachment left behind. */
static cudaStream_t comm_stream_of(sg__device *d) {
  const sg__comm_attach a = {0, 1, NULL, NULL, NULL, 0};
  sg__comm_native nat = {NULL, -1};
  d->ops->comm_attach(d, &a, &nat);
  d->ops->comm_detach(d);
  return (cudaStream_t)nat.stream;
}

/* ---- jobs ----------------------------------------------------------------------------------- */

typedef struct copy_job {
  sg__device *d;
  float *dst;
  const float *src;
} copy_job;

static sg_status copy_job_fn(void *arg) {
  copy_job *j = (copy_job *)arg;
  return j->d->ops->copy(j->d, SG_Q_COMM, j->dst, j->src, N * 4, SG_COPY_D2D);
}

/* compute: a += a; job: b = a (comm); compute after compute_wait_comm: b += b. Lazy streams
 * make any missing dependency visible as b != 4h. */
static void ordering(sg__device *d, const char *mode) {
  const sg__device_ops *o = d->ops;
  float h[N], back[N];
  for (int i = 0; i < N; i++) h[i] = (float)(i % 97);
  float *a = NULL, *b = NULL;
  o->alloc(d, N * 4, (void **)&a);
  o->alloc(d, N * 4, (void **)&b);
  o->copy(d, SG_Q_COMPUTE, a, h, N * 4, SG_COPY_H2D);
  o->zero(d, SG_Q_COMPUTE, b, N * 4);
  o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N);
  copy_job j = {d, b, a};
  uint64_t t = 0;
  char what[128];
  snprintf(what, sizeof what, "%s: comm_submit", mode);
  check(o->comm_submit(d, copy_job_fn, NULL, &j, &t) == SG_OK, what);
  check(o->compute_wait_comm(d, t, sg__deadline(5000)) == SG_OK, "compute_wait_comm");
  o->accumulate(d, SG_Q_COMPUTE, b, 0, b, 0, N);
  memset(back, 0, sizeof back);
  o->copy(d, SG_Q_COMPUTE, back, b, N * 4, SG_COPY_D2H);
  int ok = 1;
  for (int i = 0; i < N && ok; i++) ok = back[i] == 4.0f * h[i];
  snprintf(what, sizeof what, "%s: job after compute work, compute after the job (b == 4h)", mode);
  check(ok, what);
  snprintf(what, sizeof what, "%s: comm_wait", mode);
  check(o->comm_wait(d, t, sg__deadline(5000)) == SG_OK, what);
  o->free(d, a);
  o->free(d, b);
}

/* set_stream: work queued on the old stream stays ahead of work on the new one. */
static void stream_switch(sg__device *d) {
  const sg__device_ops *o = d->ops;
  float h[N], back[N];
  for (int i = 0; i < N; i++) h[i] = (float)i;
  float *a = NULL;
  o->alloc(d, N * 4, (void **)&a);
  o->copy(d, SG_Q_COMPUTE, a, h, N * 4, SG_COPY_H2D);
  o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N); /* on our own stream, not run yet */
  cudaStream_t user;
  cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking);
  check(o->set_stream(d, user) == SG_OK, "set_stream(user)");
  o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N); /* on the user's stream */
  o->copy(d, SG_Q_COMPUTE, back, a, N * 4, SG_COPY_D2H);
  check(back[3] == 12.0f && back[N - 1] == 4.0f * (N - 1), "stream switch keeps the order");
  check(o->set_stream(d, NULL) == SG_OK, "set_stream(NULL)");
  check(o->sync(d, sg__deadline(1000)) == SG_OK, "sync");
  check(sg_cudamock_pending(user) == 0, "user stream drained");
  cudaStreamDestroy(user);
  o->free(d, a);
}

/* host-driven jobs: the comm work is done when the job's call returns */
typedef struct probe_job {
  sg__device *d;
  float *dst, *src;
  size_t pending_after;
  cudaStream_t comm;
} probe_job;

static sg_status probe_job_fn(void *arg) {
  probe_job *j = (probe_job *)arg;
  sg_status st = j->d->ops->copy(j->d, SG_Q_COMM, j->dst, j->src, 64, SG_COPY_D2D);
  j->pending_after = sg_cudamock_pending(j->comm);
  return st;
}

static void host_driven(sg__device *d, int attached, cudaStream_t comm) {
  float *a = NULL, *b = NULL;
  d->ops->alloc(d, 64, (void **)&a);
  d->ops->alloc(d, 64, (void **)&b);
  probe_job j = {d, b, a, 99, comm ? comm : comm_stream_of(d)};
  uint64_t t;
  d->ops->comm_submit(d, probe_job_fn, NULL, &j, &t);
  if (attached) {
    check(j.pending_after > 0, "stream-ordered jobs: comm work stays queued");
    d->ops->comm_wait(d, t, sg__deadline(1000));
  } else { /* the job may run on the worker: look once it is done */
    d->ops->comm_wait(d, t, sg__deadline(5000));
    check(j.pending_after == 0, "host-driven jobs: comm work done when the call returns");
  }
  d->ops->free(d, a);
  d->ops->free(d, b);
}

/* ---- failures ---------------------------------------------------------------------------------
 */

typedef struct nothing_job {
  int ran;
} nothing_job;

static sg_status nothing_fn(void *arg) {
  ((nothing_job *)arg)->ran++;
  return SG_OK;
}

/* Each queue ordered after the other's work so far (adamw calls on different queues are not
 * ordered by the device: that is the caller's job). No host wait once hooks are attached. */
static void queue_barrier(sg__device *d) {
  nothing_job nj = {0};
  uint64_t t = 0;
  d->ops->comm_submit(d, nothing_fn, NULL, &nj, &t);
  d->ops->compute_wait_comm(d, t, sg__deadline(5000));
}

static sg_status failing_fn(void *arg) {
  (void)arg;
  return sg__err(SG_ERR_COMM, "mock job: collective failed");
}

static void timeouts(void) {
  sg__device *d = NULL;
  hook_state h = {0, 0, SG_OK};
  sg__device_cuda_create(0, 0, &d);
  cudaStream_t comm = attach(d, &h);
  sg_cudamock_stall(comm, 1);
  nothing_job nj = {0};
  uint64_t t = 0;
  check(d->ops->comm_submit(d, nothing_fn, NULL, &nj, &t) == SG_OK && nj.ran == 1,
        "submit on a stalled stream");
  int64_t t0 = sg__now_ms();
  check(d->ops->comm_wait(d, t, sg__now_ms() + 50) == SG_ERR_TIMEOUT && says("deadline"),
        "stalled comm stream: SG_ERR_TIMEOUT");
  check(sg__now_ms() - t0 < 5000, "timeout returned promptly");
  check(h.aborts == 1 && h.polls > 0, "abort hook called once, poll hook called while waiting");
  check(d->ops->comm_wait(d, t, sg__deadline(1000)) == SG_ERR_TIMEOUT,
        "later waits return the recorded timeout");
  check(d->ops->sync(d, sg__deadline(1000)) == SG_ERR_TIMEOUT, "sync returns it too");
  check(d->ops->comm_submit(d, nothing_fn, NULL, &nj, &t) == SG_ERR_TIMEOUT && nj.ran == 1,
        "later submits fail without running the job");
  sg_cudamock_stall(comm, 0);
  d->ops->destroy(d);
  check(h.aborts == 1, "destroy calls nothing of the attached communicator");

  /* the communicator reports a failure through the poll hook */
  hook_state h2 = {0, 0, SG_ERR_COMM};
  sg__device_cuda_create(0, 0, &d);
  comm = attach(d, &h2);
  sg_cudamock_stall(comm, 1);
  d->ops->comm_submit(d, nothing_fn, NULL, &nj, &t);
  check(d->ops->comm_wait(d, t, sg__deadline(5000)) == SG_ERR_COMM && says("peer failed"),
        "poll hook failure: SG_ERR_COMM with its text");
  check(d->ops->comm_wait(d, t, sg__deadline(5000)) == SG_ERR_COMM, "and it sticks");
  sg_cudamock_stall(comm, 0);
  d->ops->destroy(d);

  /* a failing job inline (a communicator that must not be called from another thread):
   * returned by submit and by every later wait */
  sg__device_cuda_create(0, 0, &d);
  const sg__comm_attach inline_comm = {0, 0, NULL, NULL, NULL, 0};
  sg__comm_native nat;
  check(d->ops->comm_attach(d, &inline_comm, &nat) == SG_OK, "attach host-driven, not threaded");
  /* a hybrid engine's replica channel attaches beside its shard channel, the same way only */
  const sg__comm_attach stream_comm = {1, 0, NULL, NULL, NULL, 0};
  check(d->ops->comm_attach(d, &stream_comm, &nat) == SG_ERR_INVALID_STATE &&
            says("host-driven communicator is attached"),
        "a stream-ordered attachment beside a host-driven one is refused");
  check(d->ops->comm_attach(d, &inline_comm, &nat) == SG_OK,
        "a second host-driven attachment is accepted");
  check(d->ops->comm_attach(d, &inline_comm, &nat) == SG_ERR_INVALID_STATE &&
            says("already attached"),
        "a third attachment is refused");
  const int ran = nj.ran;
  check(d->ops->comm_submit(d, nothing_fn, NULL, &nj, &t) == SG_OK && nj.ran == ran + 1,
        "not threaded: the job ran inline in comm_submit");
  check(d->ops->comm_submit(d, failing_fn, NULL, NULL, &t) == SG_ERR_COMM && says("collective failed"),
        "failing job: submit returns its failure");
  check(d->ops->comm_wait(d, t, sg__deadline(1000)) == SG_ERR_COMM && says("collective failed"),
        "failing job: comm_wait returns it");
  check(d->ops->comm_wait(d, t + 1, sg__deadline(1000)) == SG_ERR_COMM,
        "failing job: the device stays broken");
  d->ops->destroy(d);
}

/* ---- host-driven jobs on the worker thread ----------------------------------------------- */

/* A job that blocks until the test releases it (or 20 s pass: then it fails, so that a broken
 * device gives failed checks instead of a hang). */
typedef struct gate_job {
  atomic_int released, started, finished;
  sg__device *d;
  float *dst, *src; /* a comm-queue copy once released */
} gate_job;

static sg_status gate_fn(void *arg) {
  gate_job *g = (gate_job *)arg;
  atomic_store(&g->started, 1);
  const int64_t give_up = sg__now_ms() + 20000;
  while (!atomic_load(&g->released)) {
    if (sg__now_ms() > give_up) return sg__err(SG_ERR_COMM, "gate job: never released");
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
  }
  sg_status st = SG_OK;
  if (g->d) st = g->d->ops->copy(g->d, SG_Q_COMM, g->dst, g->src, N * 4, SG_COPY_D2D);
  atomic_store(&g->finished, 1);
  return st;
}

typedef struct count_job {
  atomic_int *count;
} count_job;

static sg_status count_fn(void *arg) {
  atomic_fetch_add(((count_job *)arg)->count, 1);
  return SG_OK;
}

static void *release_later(void *arg) {
  struct timespec ts = {0, 50000000};
  nanosleep(&ts, NULL);
  atomic_store(&((gate_job *)arg)->released, 1);
  return NULL;
}

static void async_jobs(void) {
  sg__device *d = NULL;
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "async: create");
  const sg__device_ops *o = d->ops;
  nothing_job nj = {0};
  uint64_t t0 = 0, t = 0, t2 = 0;
  check(o->comm_submit(d, nothing_fn, NULL, &nj, &t0) == SG_OK &&
            o->comm_wait(d, t0, sg__deadline(5000)) == SG_OK && nj.ran == 1,
        "async: the first job runs on the worker like every other (no first-job special case)");
  float h[N], back[N];
  for (int i = 0; i < N; i++) h[i] = (float)(i % 31);
  float *a = NULL, *b = NULL, *c = NULL;
  o->alloc(d, N * 4, (void **)&a);
  o->alloc(d, N * 4, (void **)&b);
  o->alloc(d, N * 4, (void **)&c);
  o->copy(d, SG_Q_COMPUTE, a, h, N * 4, SG_COPY_H2D);
  o->accumulate(d, SG_Q_COMPUTE, a, 0, a, 0, N); /* a = 2h, before the job */
  gate_job g;
  atomic_init(&g.released, 0);
  atomic_init(&g.started, 0);
  atomic_init(&g.finished, 0);
  g.d = d;
  g.dst = b;
  g.src = a;
  check(o->comm_submit(d, gate_fn, NULL, &g, &t) == SG_OK && !atomic_load(&g.finished),
        "async: submit of a blocked job returns at once");
  /* compute work while the job is blocked on the worker */
  o->copy(d, SG_Q_COMPUTE, c, h, N * 4, SG_COPY_H2D);
  o->accumulate(d, SG_Q_COMPUTE, c, 0, c, 0, N);
  o->copy(d, SG_Q_COMPUTE, back, c, N * 4, SG_COPY_D2H);
  int ok = 1;
  for (int i = 0; i < N && ok; i++) ok = back[i] == 2.0f * h[i];
  check(ok && !atomic_load(&g.finished), "async: compute work runs while the job is blocked");
  check(o->comm_wait(d, t, sg__now_ms() + 30) == SG_ERR_TIMEOUT && says("deadline"),
        "async: comm_wait while blocked: SG_ERR_TIMEOUT");
  check(o->compute_wait_comm(d, t, sg__now_ms() + 30) == SG_ERR_TIMEOUT,
        "async: compute_wait_comm while blocked: SG_ERR_TIMEOUT");
  check(o->comm_wait(d, t0, sg__now_ms() + 30) == SG_OK, "async: an earlier ticket is done");
  atomic_store(&g.released, 1);
  check(o->comm_wait(d, t, sg__deadline(10000)) == SG_OK && atomic_load(&g.finished),
        "async: comm_wait after release: SG_OK (a timeout does not break the device)");
  o->accumulate(d, SG_Q_COMPUTE, b, 0, b, 0, N); /* after the job's copy: b = 4h */
  o->copy(d, SG_Q_COMPUTE, back, b, N * 4, SG_COPY_D2H);
  ok = 1;
  for (int i = 0; i < N && ok; i++) ok = back[i] == 4.0f * h[i];
  check(ok, "async: the job saw the compute work before submit, compute sees the job's copy");

  /* a failing job on the worker: its status and text reach every later wait */
  check(o->comm_submit(d, failing_fn, NULL, NULL, &t2) == SG_OK, "async: failing job queued");
  check(o->comm_wait(d, t2, sg__deadline(10000)) == SG_ERR_COMM && says("collective failed"),
        "async: comm_wait returns the job's failure with its text");
  check(o->compute_wait_comm(d, t, sg__deadline(1000)) == SG_ERR_COMM && says("collective failed"),
        "async: every later wait returns it (an earlier ticket too)");
  check(o->comm_submit(d, nothing_fn, NULL, &nj, &t) == SG_ERR_COMM && nj.ran == 1,
        "async: later submits fail without running the job");
  check(o->sync(d, sg__deadline(1000)) == SG_ERR_COMM, "async: sync returns it");
  o->free(d, a);
  o->free(d, b);
  o->free(d, c);
  o->destroy(d);

  /* destroy with jobs queued behind a blocked one runs them all */
  check(sg__device_cuda_create(0, 0, &d) == SG_OK, "async: create again");
  o = d->ops;
  atomic_int count;
  atomic_init(&count, 0);
  count_job cj = {&count};
  o->comm_submit(d, count_fn, NULL, &cj, &t);
  o->comm_wait(d, t, sg__deadline(5000));
  gate_job g2;
  atomic_init(&g2.released, 0);
  atomic_init(&g2.started, 0);
  atomic_init(&g2.finished, 0);
  g2.d = NULL;
  ok = o->comm_submit(d, gate_fn, NULL, &g2, &t) == SG_OK;
  for (int i = 0; i < 3; i++) ok = ok && o->comm_submit(d, count_fn, NULL, &cj, &t) == SG_OK;
  check(ok && atomic_load(&count) == 1, "async: three jobs queued behind a blocked one");
  pthread_t rel;
  pthread_create(&rel, NULL, release_later, &g2);
  o->destroy(d);
  pthread_join(rel, NULL);
  check(atomic_load(&g2.finished) && atomic_load(&count) == 4, "async: destroy drains the queue");
}

static void allocations(sg__device *d) {
  void *p = (void *)&p;
  sg__device_fail_alloc_after(0);
  check(d->ops->alloc(d, 64, &p) == SG_ERR_OUT_OF_MEMORY && p == NULL, "injected alloc failure");
  sg__device_fail_alloc_after(-1);
  check(d->ops->alloc(d, (size_t)1 << 45, &p) == SG_ERR_OUT_OF_MEMORY && says("cudaMalloc") &&
            says("cuda.c:"),
        "too large: SG_ERR_OUT_OF_MEMORY naming cudaMalloc with file:line");
  check(d->ops->alloc(d, 0, &p) == SG_OK && p != NULL, "0 bytes: a block");
  d->ops->free(d, p);
  check(d->ops->host_alloc(d, 100, &p) == SG_OK && p != NULL, "host_alloc");
  d->ops->host_free(d, p);
  check(d->ops->copy(d, 7, p, p, 4, SG_COPY_D2D) == SG_ERR_INVALID_ARGUMENT, "bad queue");
  check(d->ops->copy(d, SG_Q_COMPUTE, NULL, p, 4, SG_COPY_D2D) == SG_ERR_INVALID_ARGUMENT,
        "NULL dst");
  check(d->ops->accumulate(d, SG_Q_COMPUTE, p, 7, p, 0, 4) == SG_ERR_INVALID_ARGUMENT,
        "accumulate: unknown dtype rejected");
  check(d->ops->comm_wait(d, 1000000, sg__deadline(10)) == SG_ERR_INVALID_ARGUMENT,
        "ticket never issued");
}

/* ---- kernels through the device ------------------------------------------------------------- */

static uint64_t g_rng = 88172645463325252ull;
static float rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

static void kernels(sg__device *d) {
  const sg__device_ops *o = d->ops;
  enum { S = 5000 };
  /* adamw: bf16 params with master and stochastic rounding, segments with gaps */
  sg__seg segs[3] = {
      {0, 10, 1000, 1, 0, 0}, {1003, 1020, 1, 0, 1ull << 40, 0}, {1010, 1990, 3001, 1, 2ull << 40, 0}};
  static uint16_t p_h[S];
  static float mst_h[S], m_h[S], v_h[S], g_h[S];
  for (int i = 0; i < S; i++) {
    mst_h[i] = rnd();
    p_h[i] = (uint16_t)(i * 7);
    m_h[i] = rnd() * 0.01f;
    v_h[i] = fabsf(rnd()) * 1e-4f;
    g_h[i] = rnd() * 0.1f;
  }
  void *p, *mst, *m, *v, *g;
  o->alloc(d, sizeof p_h, &p);
  o->alloc(d, sizeof mst_h, &mst);
  o->alloc(d, sizeof m_h, &m);
  o->alloc(d, sizeof v_h, &v);
  o->alloc(d, sizeof g_h, &g);
  o->copy(d, SG_Q_COMPUTE, p, p_h, sizeof p_h, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, mst, mst_h, sizeof mst_h, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, m, m_h, sizeof m_h, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, v, v_h, sizeof v_h, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, g, g_h, sizeof g_h, SG_COPY_H2D);
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param_dtype = SG_BF16;
  a.grad_dtype = SG_F32;
  a.segs = segs;
  a.grad_scale = 0.5f;
  a.group_scalar[0][SG__ADAMW_DECAY_FACTOR] = 0.9999f;
  a.scalar[SG__ADAMW_BETA1] = 0.9f;
  a.scalar[SG__ADAMW_ONE_MINUS_BETA1] = 0.1f;
  a.scalar[SG__ADAMW_BETA2] = 0.999f;
  a.scalar[SG__ADAMW_ONE_MINUS_BETA2] = 0.001f;
  a.scalar[SG__ADAMW_BC2_SQRT] = 0.05f;
  a.scalar[SG__ADAMW_EPS] = 1e-8f;
  a.stochastic_rounding = 1;
  a.seed = 5;
  int ok = 1;
  for (int step = 1; step <= 3; step++) {
    a.step = (uint64_t)step;
    a.group_scalar[0][SG__ADAMW_STEP_SIZE] = 0.001f * (float)step;
    a.segs = step == 3 ? segs + 1 : segs; /* the third step changes the table: upload again */
    a.nsegs = step == 3 ? 2 : 3;
    a.param = p_h, a.master = mst_h, a.state[SG__ADAMW_M] = m_h, a.state[SG__ADAMW_V] = v_h, a.grad = g_h;
    sg__cpu_adamw(&a);
    a.param = p, a.master = mst, a.state[SG__ADAMW_M] = m, a.state[SG__ADAMW_V] = v, a.grad = g;
    /* Step 2's table is step 1's, used on the other queue; step 3 uploads another one. The
     * barriers order the data (same buffers on both queues). */
    if (step > 1) queue_barrier(d);
    ok &= o->update(d, step == 2 ? SG_Q_COMM : SG_Q_COMPUTE, sg__optim_find("adamw"), &a) == SG_OK;
  }
  static uint16_t p_got[S];
  static float f_got[S];
  o->copy(d, SG_Q_COMPUTE, p_got, p, sizeof p_got, SG_COPY_D2H);
  ok &= memcmp(p_got, p_h, sizeof p_h) == 0;
  o->copy(d, SG_Q_COMPUTE, f_got, mst, sizeof f_got, SG_COPY_D2H);
  ok &= memcmp(f_got, mst_h, sizeof mst_h) == 0;
  o->copy(d, SG_Q_COMPUTE, f_got, v, sizeof f_got, SG_COPY_D2H);
  ok &= memcmp(f_got, v_h, sizeof v_h) == 0;
  check(ok, "adamw (3 steps, both queues, table changed on step 3) == CPU bitwise");

  double cs, cn, gs = -1, gn = -1;
  sg__cpu_sumsq(mst_h, SG_F32, S, &cs, &cn);
  check(o->sumsq(d, SG_Q_COMPUTE, mst, SG_F32, S, &gs, &gn) == SG_OK &&
            fabs(gs - cs) <= 1e-12 * cs && gn == cn,
        "sumsq == CPU");

  /* reduce_sum in place over three device buffers, f32 */
  const void *srcs[3] = {m, v, mst};
  const void *hsrcs[3] = {m_h, v_h, mst_h};
  static float want[S];
  sg__cpu_reduce_sum(want, hsrcs, 3, SG_F32, S);
  o->reduce_sum(d, SG_Q_COMPUTE, m, srcs, 3, SG_F32, S);
  o->copy(d, SG_Q_COMPUTE, f_got, m, sizeof f_got, SG_COPY_D2H);
  check(memcmp(f_got, want, sizeof want) == 0, "reduce_sum in place == CPU");

  /* cast f32 -> f16, accumulate f16 into bf16 */
  static uint16_t h16[S], want16[S], got16[S];
  sg__cpu_cast(want16, SG_F16, mst_h, SG_F32, S);
  o->cast(d, SG_Q_COMPUTE, g, SG_F16, mst, SG_F32, S);
  o->copy(d, SG_Q_COMPUTE, h16, g, sizeof h16, SG_COPY_D2H);
  check(memcmp(h16, want16, sizeof h16) == 0, "cast f32 -> f16 == CPU");
  memcpy(want16, p_h, sizeof want16);
  sg__cpu_accumulate(want16, SG_BF16, h16, SG_F16, S);
  o->accumulate(d, SG_Q_COMPUTE, p, SG_BF16, g, SG_F16, S);
  o->copy(d, SG_Q_COMPUTE, got16, p, sizeof got16, SG_COPY_D2H);
  check(memcmp(got16, want16, sizeof got16) == 0, "accumulate f16 into bf16 == CPU");

  void *bufs[5] = {p, mst, m, v, g};
  for (int i = 0; i < 5; i++) o->free(d, bufs[i]);
}

/* ---- per-bucket AdamW tables ------------------------------------------------------------------
 * The engine calls adamw once per bucket with sub-arrays of one segment array. Each distinct
 * table is uploaded once; later calls neither upload nor wait on the host, on either queue. */

typedef struct adam_bufs {
  void *p, *mst, *m, *v, *g;         /* device */
  uint16_t *hp;                      /* host reference (CPU kernels) */
  float *hmst, *hm, *hv, *hg;
} adam_bufs;

enum { TS = 3000 };

static void adam_bufs_init(sg__device *d, adam_bufs *b) {
  const sg__device_ops *o = d->ops;
  b->hp = calloc(TS, 2);
  b->hmst = calloc(TS, 4), b->hm = calloc(TS, 4), b->hv = calloc(TS, 4), b->hg = calloc(TS, 4);
  for (int i = 0; i < TS; i++) {
    b->hmst[i] = rnd();
    b->hp[i] = (uint16_t)(i * 13);
    b->hm[i] = rnd() * 0.01f;
    b->hv[i] = fabsf(rnd()) * 1e-4f;
    b->hg[i] = rnd() * 0.1f;
  }
  o->alloc(d, TS * 2, &b->p);
  o->alloc(d, TS * 4, &b->mst);
  o->alloc(d, TS * 4, &b->m);
  o->alloc(d, TS * 4, &b->v);
  o->alloc(d, TS * 4, &b->g);
  o->copy(d, SG_Q_COMPUTE, b->p, b->hp, TS * 2, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, b->mst, b->hmst, TS * 4, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, b->m, b->hm, TS * 4, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, b->v, b->hv, TS * 4, SG_COPY_H2D);
  o->copy(d, SG_Q_COMPUTE, b->g, b->hg, TS * 4, SG_COPY_H2D);
}

/* Device state == host reference, bitwise; frees both. */
static int adam_bufs_done(sg__device *d, adam_bufs *b) {
  const sg__device_ops *o = d->ops;
  uint16_t *gp = calloc(TS, 2);
  float *gf = calloc(TS, 4);
  int ok = o->copy(d, SG_Q_COMPUTE, gp, b->p, TS * 2, SG_COPY_D2H) == SG_OK &&
           memcmp(gp, b->hp, TS * 2) == 0;
  void *dev[3] = {b->mst, b->m, b->v};
  float *host[3] = {b->hmst, b->hm, b->hv};
  for (int k = 0; k < 3; k++)
    ok &= o->copy(d, SG_Q_COMPUTE, gf, dev[k], TS * 4, SG_COPY_D2H) == SG_OK &&
          memcmp(gf, host[k], TS * 4) == 0;
  void *all[5] = {b->p, b->mst, b->m, b->v, b->g};
  for (int k = 0; k < 5; k++) o->free(d, all[k]);
  free(b->hp), free(b->hmst), free(b->hm), free(b->hv), free(b->hg), free(gp), free(gf);
  return ok;
}

/* Parameter groups of the next adam_call (0: none; the segments' groups are then not read). */
static int g_adam_groups;

static void adam_args(sg__adamw_args *a, uint64_t step) {
  memset(a, 0, sizeof *a);
  a->param_dtype = SG_BF16;
  a->grad_dtype = SG_F32;
  a->grad_scale = 0.25f;
  a->group_scalar[0][SG__ADAMW_DECAY_FACTOR] = 0.999f;
  a->scalar[SG__ADAMW_BETA1] = 0.9f, a->scalar[SG__ADAMW_ONE_MINUS_BETA1] = 0.1f;
  a->scalar[SG__ADAMW_BETA2] = 0.999f, a->scalar[SG__ADAMW_ONE_MINUS_BETA2] = 0.001f;
  a->scalar[SG__ADAMW_BC2_SQRT] = 0.05f;
  a->scalar[SG__ADAMW_EPS] = 1e-8f;
  a->stochastic_rounding = 1;
  a->seed = 11;
  a->step = step;
  a->group_scalar[0][SG__ADAMW_STEP_SIZE] = 0.002f * (float)step;
  a->ngroups = g_adam_groups;
  for (int g = 1; g < g_adam_groups; g++) {
    a->group_scalar[g][SG__ADAMW_DECAY_FACTOR] = 1.0f - 0.003f * (float)g;
    a->group_scalar[g][SG__ADAMW_STEP_SIZE] = 0.001f * (float)(g + 2) * (float)step;
  }
}

/* One AdamW over segs[0..n) on queue q, on the device (buffers of b) and on the CPU. */
static int adam_call(sg__device *d, sg__queue q, adam_bufs *b, const sg__seg *segs, int n,
                     uint64_t step) {
  sg__adamw_args a;
  adam_args(&a, step);
  a.segs = segs, a.nsegs = n;
  a.param = b->hp, a.master = b->hmst, a.state[SG__ADAMW_M] = b->hm, a.state[SG__ADAMW_V] = b->hv, a.grad = b->hg;
  sg__cpu_adamw(&a);
  a.param = b->p, a.master = b->mst, a.state[SG__ADAMW_M] = b->m, a.state[SG__ADAMW_V] = b->v, a.grad = b->g;
  return d->ops->update(d, q, sg__optim_find("adamw"), &a) == SG_OK;
}

static const char *const g_counted[] = {"cudaMemcpyAsync", "cudaMallocAsync", "cudaMallocHost",
                                        "cudaEventQuery", "cudaStreamQuery", "cudaStreamWaitEvent"};
enum { NCOUNTED = 6 };

static void counts_now(long long c[NCOUNTED]) {
  for (int k = 0; k < NCOUNTED; k++) c[k] = sg_cudamock_calls(g_counted[k]);
}

static void bucket_tables(void) {
  sg__device *d = NULL;
  hook_state h = {0, 0, SG_OK};
  sg__device_cuda_create(0, 0, &d);
  attach(d, &h); /* stream-ordered: barriers between steps wait on streams, not on the host */
  /* One segment array of three buckets (odd offsets: the scalar paths too), and a twin of
   * bucket 0 that differs from it only in sr_index (other stochastic rounding bits). */
  const sg__seg segs[7] = {{0, 1, 100, 1, 0, 0},           {100, 101, 37, 0, 1ull << 40, 0},
                           {137, 140, 400, 1, 2ull << 40, 0}, {537, 541, 603, 1, 3ull << 40, 0},
                           {1140, 1144, 5, 0, 4ull << 40, 0}, {1145, 1149, 800, 1, 5ull << 40, 0},
                           {1945, 1952, 1000, 0, 6ull << 40, 0}};
  const int first[3] = {0, 3, 5}, count[3] = {3, 2, 2};
  sg__seg twin[3];
  memcpy(twin, segs, sizeof twin);
  for (int k = 0; k < 3; k++) twin[k].sr_index += 777;
  adam_bufs A, B;
  adam_bufs_init(d, &A);
  adam_bufs_init(d, &B);
  check(sg_cudamock_calls("cudaMemcpyAsync") >= 0 && sg_cudamock_calls("nope") == -1,
        "mock call counters");

  /* A table uploaded on one queue and used at once on the other (other buffers, no barrier):
   * the other queue must wait for the upload. */
  int ok = adam_call(d, SG_Q_COMM, &A, segs + 3, 2, 1);
  ok &= adam_call(d, SG_Q_COMPUTE, &B, segs + 3, 2, 1);
  queue_barrier(d);

  /* Steps 2..7: bucket k on queue (k + step) % 2, bucket 0 replaced by its twin on even steps.
   * Steps 2 and 3 upload; from step 4 on, nothing is uploaded and nothing waits on the host. */
  long long busy[NCOUNTED] = {0}, steady_waits = 0;
  for (uint64_t step = 2; step <= 7; step++) {
    for (int k = 0; k < 3; k++) {
      const sg__seg *s = k == 0 && step % 2 == 0 ? twin : segs + first[k];
      long long c0[NCOUNTED], c1[NCOUNTED];
      counts_now(c0);
      ok &= adam_call(d, (sg__queue)((k + step) % 2), &A, s, count[k], step);
      counts_now(c1);
      if (step >= 4)
        for (int j = 0; j < NCOUNTED - 1; j++) busy[j] += c1[j] - c0[j];
      if (step >= 6) steady_waits += c1[NCOUNTED - 1] - c0[NCOUNTED - 1];
    }
    queue_barrier(d);
  }
  check(ok, "per-bucket adamw calls succeed");
  check(busy[0] == 0 && busy[1] == 0 && busy[2] == 0,
        "steady state: no table upload, no device or pinned allocation");
  check(busy[3] == 0 && busy[4] == 0, "steady state: no host wait (no event or stream query)");
  check(steady_waits == 0, "steady state: no stream waits once each queue has seen a table");
  check(adam_bufs_done(d, &B), "table used on the other queue right after its upload == CPU");
  check(adam_bufs_done(d, &A),
        "buckets alternating on both queues, sr_index-only twin (7 steps) == CPU bitwise");

  /* More distinct tables than the cache keeps (4096): it is dropped after a host wait, and the
   * results stay right. */
  adam_bufs C;
  adam_bufs_init(d, &C);
  long long q0 = sg_cudamock_calls("cudaEventQuery");
  ok = 1;
  for (int k = 0; k < 4200 && ok; k++) {
    sg__seg one = {(size_t)(k * 7) % TS, (size_t)(k * 7) % TS, 1 + (size_t)(k % 3), k % 2,
                   (uint64_t)k, 0};
    if (one.shard_off + one.len > TS) one.shard_off = one.flat_off = 0;
    ok &= adam_call(d, SG_Q_COMPUTE, &C, &one, 1, 1 + (uint64_t)(k % 5));
  }
  check(ok && sg_cudamock_calls("cudaEventQuery") > q0,
        "4200 distinct tables: the cache is dropped (host wait) when full");
  check(adam_bufs_done(d, &C), "4200 distinct tables == CPU bitwise");
  d->ops->destroy(d);
}

/* Parameter groups: segments of several groups, with and without decay, and a twin table
 * that differs only in the groups (the cache key must include them), alternating on both
 * queues, == the CPU bitwise. */
static void group_tables(void) {
  sg__device *d = NULL;
  hook_state h = {0, 0, SG_OK};
  sg__device_cuda_create(0, 0, &d);
  attach(d, &h);
  const sg__seg segs[4] = {{0, 1, 100, 1, 0, 0},
                           {100, 101, 37, 0, 1ull << 40, 1},
                           {137, 140, 400, 1, 2ull << 40, 2},
                           {537, 541, 603, 1, 3ull << 40, 3}};
  sg__seg twin[4];
  memcpy(twin, segs, sizeof twin);
  for (int k = 0; k < 4; k++) twin[k].group = (k + 2) % 4;
  adam_bufs A;
  adam_bufs_init(d, &A);
  g_adam_groups = 4;
  int ok = 1;
  for (uint64_t step = 1; step <= 6; step++) {
    ok &= adam_call(d, (sg__queue)(step % 2), &A, step % 2 ? segs : twin, 2, step);
    ok &= adam_call(d, (sg__queue)((step + 1) % 2), &A, (step % 2 ? segs : twin) + 2, 2, step);
    queue_barrier(d);
  }
  check(ok, "adamw calls with 4 parameter groups succeed");
  check(adam_bufs_done(d, &A), "4 parameter groups, group-only twin tables, both queues == CPU");
  /* a segment in a group the call does not have is refused */
  sg__seg bad = {0, 0, 10, 1, 0, 4};
  adam_bufs_init(d, &A);
  check(!adam_call(d, SG_Q_COMPUTE, &A, &bad, 1, 1), "segment group >= ngroups: refused");
  g_adam_groups = 0;
  queue_barrier(d);
  adam_bufs_done(d, &A);
  d->ops->destroy(d);
}

int main(void) {
  sg__device *d = NULL;
  sg_cudamock_set_devices(0);
  check(
      sg__device_cuda_create(0, -1, &d) == SG_ERR_CUDA && says("no CUDA device found") && d == NULL,
      "no mock GPU: SG_ERR_CUDA, no CUDA device found");
  sg_cudamock_set_devices(1);
  check(sg__device_cuda_create(0, 1, &d) == SG_ERR_INVALID_ARGUMENT, "cuda_device out of range");
  const size_t live0 = sg_cudamock_live_allocations();
  check(sg__device_cuda_create(0, -1, &d) == SG_OK && d, "create");
  ordering(d, "host-driven");
  host_driven(d, 0, NULL);
  stream_switch(d);
  allocations(d);
  kernels(d);
  hook_state h = {0, 0, SG_OK};
  cudaStream_t comm = attach(d, &h);
  ordering(d, "stream-ordered");
  host_driven(d, 1, comm);
  check(d->ops->sync(d, sg__deadline(1000)) == SG_OK, "sync");
  d->ops->destroy(d);
  sg_cudamock_drain();
  check(sg_cudamock_live_allocations() == live0, "destroy leaves no device or pinned memory");
  timeouts();
  async_jobs();
  const size_t live1 = sg_cudamock_live_allocations();
  bucket_tables();
  sg_cudamock_drain();
  check(sg_cudamock_live_allocations() == live1, "per-bucket tables: destroy frees every table");
  group_tables();
  sg_cudamock_drain();
  check(sg_cudamock_live_allocations() == live1, "group tables: destroy frees every table");
  return sg_test_summary("");
}
