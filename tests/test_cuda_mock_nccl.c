/* src/comm/nccl.c on the mock CUDA runtime and mock NCCL of tests/cudamock (ranks are threads):
 *  - every collective (the all-to-all too: grouped sends and receives) and wire dtype, on device
 *    buffers (unbound: complete on return), on host buffers (staged through device memory), and
 *    bound to a CUDA device inside comm jobs (stream-ordered, finished by the device's waits);
 *  - the SG_NCCL_ID_FILE bootstrap (file removed afterwards);
 *  - deadlines and failures: initialization without every rank times out; a collective a peer
 *    never joins times out in the device's wait, which aborts the communicator; an
 *    asynchronous NCCL error reaches the device's wait as SG_ERR_COMM; broken communicators
 *    refuse later calls; destroying the device before the communicator, or after, is safe. */
#define _POSIX_C_SOURCE 200809L /* setenv, mkdtemp */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* access, rmdir */

#include <cuda_runtime.h> /* the mock's: device buffers */
#include <nccl.h>         /* the mock's controls */

#include "comm/sg_comm.h"     /* collectives through the vtable */
#include "device/sg_device.h" /* CUDA devices to bind */
#include "sg_elem.h"          /* bf16/f16 values */

#include "sg_test_check.h" /* CHECK, counted under one lock across threads */

#define W 3

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

static int says(const char *s) { return strstr(sg_last_error(), s) != NULL; }

/* ---- running W ranks --------------------------------------------------------------------- */

typedef struct rank_ctx {
  int rank, world;
  const unsigned char *id; /* NULL: SG_NCCL_ID_FILE */
  void (*body)(struct rank_ctx *);
  sg_comm *c;
  sg_status create_st;
} rank_ctx;

static void *rank_thread(void *arg) {
  rank_ctx *x = (rank_ctx *)arg;
  x->create_st = sg_comm_create_nccl(x->rank, x->world, x->id, 0, &x->c);
  if (x->create_st == SG_OK && x->body) x->body(x);
  return NULL;
}

/* Runs body on `world` rank threads, each with its communicator (destroyed afterwards). */
static int run_ranks(int world, const unsigned char *id, void (*body)(rank_ctx *),
                     const char *what) {
  pthread_t th[W];
  rank_ctx x[W];
  for (int r = 0; r < world; r++) {
    rank_ctx init = {r, world, id, body, NULL, SG_ERR_INTERNAL};
    x[r] = init;
    pthread_create(&th[r], NULL, rank_thread, &x[r]);
  }
  int ok = 1;
  for (int r = 0; r < world; r++) {
    pthread_join(th[r], NULL);
    ok &= x[r].create_st == SG_OK;
    sg_comm_destroy(x[r].c);
  }
  check(ok, what);
  return ok;
}

/* ---- collectives ----------------------------------------------------------------------------- */

static size_t esize(int dt) { return dt == SG__F64 ? 8 : dt == SG_F32 ? 4 : 2; }

static double val(int dt, int rank, size_t i) {
  (void)dt;
  return (double)((int)(i % 13) - 6) * 0.5 + rank;
}

static void put(void *p, int dt, size_t i, double v) {
  if (dt == SG__F64)
    ((double *)p)[i] = v;
  else
    sg_elem_store(p, dt, i, (float)v);
}

static double get(const void *p, int dt, size_t i) {
  return dt == SG__F64 ? ((const double *)p)[i] : (double)sg_elem_load(p, dt, i);
}

typedef struct op_job {
  sg_comm *c;
  int op, dt, root;
  void *buf;
  size_t n;
  void *recv; /* all_to_all's */
} op_job;

static sg_status op_run(void *arg) {
  op_job *j = (op_job *)arg;
  const int64_t dl = sg__deadline(10000);
  const size_t es = esize(j->dt);
  switch (j->op) {
    case 0: return j->c->ops->all_reduce(j->c, j->buf, j->n, j->dt, dl);
    case 1: return j->c->ops->reduce_scatter(j->c, j->buf, j->n, j->dt, dl);
    case 2: return j->c->ops->all_gather(j->c, j->buf, j->n * es, dl);
    case 3: return j->c->ops->broadcast(j->c, j->buf, j->n * es, j->root, dl);
    default: return j->c->ops->all_to_all(j->c, j->buf, j->recv, j->n * es, dl);
  }
}

static int expected(int op, int dt, int w, int r, size_t n, const void *buf) {
  for (size_t i = 0; i < n; i++) {
    double want = 0, got;
    if (op == 0 || op == 1) {
      const size_t k = op == 0 ? i : (size_t)r * n + i; /* reduce_scatter: this rank's slice */
      for (int q = 0; q < w; q++) want += val(dt, q, k);
      got = get(buf, dt, k);
    } else if (op == 2) {
      const int q = (int)(i % (size_t)w); /* one element of every rank's part */
      const size_t k = (size_t)q * n + i;
      want = val(dt, q, k);
      got = get(buf, dt, k);
    } else if (op == 4) { /* all_to_all: part q of recv is part r of rank q's send */
      for (int q = 0; q < w; q++)
        if ((float)val(dt, q, (size_t)r * n + i) != (float)get(buf, dt, (size_t)q * n + i))
          return 0;
      continue;
    } else {
      want = val(dt, w - 1, i);
      got = get(buf, dt, i);
    }
    if ((float)want != (float)got) return 0;
  }
  return 1;
}

/* Every collective and dtype on buffers of one kind: 0 device memory (unbound: complete on
 * return), 1 host memory (staged), 2 device memory with the communicator bound to a CUDA
 * device, issued from comm jobs and waited for through the device. */
static void collectives(rank_ctx *x, int mode) {
  static const char *const kinds[] = {"device", "host (staged)", "bound device"};
  static const char *const ops[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                    "all_to_all"};
  sg_comm *c = x->c;
  const int w = x->world, r = x->rank;
  const size_t n = 1000; /* not a multiple of 13: every rank's parts hold different values */
  sg__device *d = NULL;
  if (mode == 2) { /* a channel bound (and attached) to the device */
    sg__device_cuda_create(r, 0, &d);
    check(sg__comm_bind(x->c, d, 0, &c) == SG_OK && c && c->dev == d, "bind to a CUDA device");
  }
  for (int dt = 0; dt <= SG__F64; dt++) {
    const size_t bytes = n * esize(dt) * (size_t)w;
    char *h = (char *)malloc(bytes), *buf = NULL, *recv = NULL;
    if (mode == 1) {
      buf = (char *)malloc(bytes);
      recv = (char *)malloc(bytes);
    } else {
      cudaMalloc((void **)&buf, bytes);
      cudaMalloc((void **)&recv, bytes);
    }
    for (int op = 0; op < 5; op++) {
      for (size_t i = 0; i < n * (size_t)w; i++) put(h, dt, i, val(dt, r, i));
      memcpy(buf, h, bytes); /* mock device memory is host memory, with nothing queued on it */
      memset(recv, 0, bytes);
      op_job j = {c, op, dt, w - 1, buf, n, recv};
      sg_status st;
      if (mode == 2) {
        uint64_t t = 0;
        st = d->ops->comm_submit(d, op_run, NULL, &j, &t);
        if (st == SG_OK) st = d->ops->comm_wait(d, t, sg__deadline(10000));
      } else {
        st = op_run(&j);
      }
      char what[160];
      snprintf(what, sizeof what, "rank %d: %s dtype %d on %s buffers", r, ops[op], dt,
               kinds[mode]);
      check(st == SG_OK && expected(op, dt, w, r, n, op == 4 ? recv : buf), what);
    }
    free(h);
    if (mode == 1) {
      free(buf);
      free(recv);
    } else {
      cudaFree(buf);
      cudaFree(recv);
    }
  }
  if (d) {
    sg__comm_unbind(c);
    d->ops->destroy(d);
  }
}

static void body_device(rank_ctx *x) { collectives(x, 0); }
static void body_host(rank_ctx *x) { collectives(x, 1); }
static void body_bound(rank_ctx *x) { collectives(x, 2); }

static void body_args(rank_ctx *x) {
  sg_comm *c = x->c;
  float f[4];
  check(c->ops->broadcast(c, f, 4, x->world, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "broadcast: root out of range");
  check(c->ops->all_reduce(c, f, 1, 9, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "all_reduce: unknown dtype");
  check(c->ops->all_reduce(c, NULL, 4, SG_F32, sg__deadline(1000)) == SG_ERR_INVALID_ARGUMENT,
        "all_reduce: NULL buffer");
  check(c->ops->all_reduce(c, NULL, 0, SG_F32, sg__deadline(1000)) == SG_OK, "count 0: nothing");
  check(sg_comm_rank(c) == x->rank && sg_comm_size(c) == x->world, "rank and size");
}

/* ---- failures ----------------------------------------------------------------------------------
 */

typedef struct coll_job {
  sg_comm *c;
  float *buf;
} coll_job;

static sg_status allreduce_job(void *arg) {
  coll_job *j = (coll_job *)arg;
  return j->c->ops->all_reduce(j->c, j->buf, 256, SG_F32, sg__deadline(10000));
}

/* Rank 0's communicator bound to a CUDA device of its own: the channel and a device buffer for
 * allreduce_job, and the job's ticket. */
typedef struct bound {
  sg__device *d;
  coll_job j;
  uint64_t t;
} bound;

/* 0 on the other ranks (nothing made). */
static int bind_rank0(rank_ctx *x, bound *b) {
  if (x->rank != 0) return 0;
  *b = (bound){NULL, {NULL, NULL}, 0};
  sg__device_cuda_create(0, 0, &b->d);
  sg__comm_bind(x->c, b->d, 0, &b->j.c);
  cudaMalloc((void **)&b->j.buf, 1024);
  return 1;
}

/* Rank 0 reduces alone (rank 1 never joins): its device wait passes the deadline. */
static void body_stuck(rank_ctx *x) {
  bound b;
  if (!bind_rank0(x, &b)) return;
  sg__device *d = b.d;
  sg_comm *c = b.j.c;
  const int live = sg_ncclmock_live();
  check(d->ops->comm_submit(d, allreduce_job, NULL, &b.j, &b.t) == SG_OK,
        "stuck: the job is queued");
  check(d->ops->comm_wait(d, b.t, sg__now_ms() + 100) == SG_ERR_TIMEOUT, "stuck: SG_ERR_TIMEOUT");
  check(c->broken && sg_ncclmock_live() == live - 1, "stuck: communicator aborted and broken");
  check(c->ops->all_reduce(c, b.j.buf, 4, SG_F32, sg__deadline(1000)) == SG_ERR_COMM &&
            says("broken"),
        "stuck: later collectives refused");
  sg__comm_unbind(c); /* detached; the comm is destroyed after the device */
  check(x->c->broken, "stuck: the channel's failure leaves its communicator broken");
  d->ops->destroy(d);
  cudaFree(b.j.buf);
}

/* An asynchronous NCCL error while rank 0 waits: SG_ERR_COMM from the device's wait. */
static void body_async_error(rank_ctx *x) {
  bound b;
  if (!bind_rank0(x, &b)) return;
  sg__device *d = b.d;
  sg_comm *c = b.j.c;
  check(d->ops->comm_submit(d, allreduce_job, NULL, &b.j, &b.t) == SG_OK,
        "async error: the job is queued");
  sg_ncclmock_fail_all(ncclRemoteError);
  check(d->ops->comm_wait(d, b.t, sg__deadline(10000)) == SG_ERR_COMM && says("remote process"),
        "async error: SG_ERR_COMM with NCCL's text");
  check(c->broken, "async error: communicator broken");
  /* the communicator goes first this time: the device must not call it afterwards */
  sg_comm_destroy(x->c);
  check(x->c->ops != NULL, "destroy of a communicator with a channel bound is deferred");
  sg__comm_unbind(c); /* the last channel: it frees the communicator destroyed above */
  x->c = NULL;
  check(d->ops->sync(d, sg__deadline(1000)) == SG_ERR_COMM,
        "the device stays broken after its communicator is destroyed");
  d->ops->destroy(d);
  cudaFree(b.j.buf);
}

static void *lone_rank0(void *arg) {
  sg_comm **c = (sg_comm **)arg;
  sg_status st = sg_comm_create_nccl(0, 2, NULL, 0, c);
  return (void *)(size_t)st;
}

int main(void) {
  unsigned char id[128];
  sg_nccl_unique_id(id);
  run_ranks(W, id, body_args, "argument checks on 3 ranks");
  for (int w = 1; w <= W; w++) {
    char what[64];
    sg_nccl_unique_id(id);
    snprintf(what, sizeof what, "collectives on device buffers, %d ranks", w);
    run_ranks(w, id, body_device, what);
    sg_nccl_unique_id(id);
    snprintf(what, sizeof what, "collectives on host buffers, %d ranks", w);
    run_ranks(w, id, body_host, what);
    sg_nccl_unique_id(id);
    snprintf(what, sizeof what, "collectives bound to CUDA devices, %d ranks", w);
    run_ranks(w, id, body_bound, what);
  }

  /* the file bootstrap */
  char dir[] = "/tmp/sg_ncclmockXXXXXX", path[256];
  if (mkdtemp(dir)) {
    snprintf(path, sizeof path, "%s/id", dir);
    setenv("SG_NCCL_ID_FILE", path, 1);
    run_ranks(W, NULL, NULL, "SG_NCCL_ID_FILE bootstrap, 3 ranks");
    check(access(path, F_OK) != 0, "the id file is removed after initialization");
    /* rank 0 alone: the others never come, initialization times out and is aborted */
    setenv("SG_NCCL_INIT_TIMEOUT_MS", "200", 1);
    sg_comm *c = NULL;
    pthread_t th;
    pthread_create(&th, NULL, lone_rank0, &c);
    void *ret = NULL;
    pthread_join(th, &ret);
    check((sg_status)(size_t)ret == SG_ERR_TIMEOUT && c == NULL,
          "init without the other rank: SG_ERR_TIMEOUT");
    check(access(path, F_OK) != 0, "the id file is removed after a failed initialization too");
    unsetenv("SG_NCCL_INIT_TIMEOUT_MS");
    unsetenv("SG_NCCL_ID_FILE");
    rmdir(dir);
  }

  sg_nccl_unique_id(id);
  run_ranks(2, id, body_stuck, "a collective rank 1 never joins");
  sg_nccl_unique_id(id);
  run_ranks(2, id, body_async_error, "an asynchronous NCCL error");
  sg_cudamock_drain();
  check(sg_ncclmock_live() == 0, "every NCCL communicator destroyed or aborted");
  return sg_test_summary("");
}
