/* MPI communicator: one rank per process (DESIGN.md section 6). This file is the MPI transport
 * of the collective algorithms (sg_coll.h: nonblocking byte messages, polled), the bootstrap
 * (initialization, thread level, finalization) and the channels (sg_comm.h); buffers on a GPU
 * go through pinned staging (sg_stage.h).
 *
 * Threads: MPI_THREAD_MULTIPLE makes the communicator `threaded`: engines call it from their
 * comm workers, and the application may call MPI at the same time (so may another engine's
 * worker, on its own channel). Below that the engine runs collectives on the calling thread,
 * between the application's own MPI calls.
 *
 * Channels: the first one uses the communicator's MPI communicator (so creating one engine is
 * not collective); every later one a duplicate of it (MPI_Comm_idup at bind, collective over
 * the ranks, polled with the engine's deadline), so that the messages of different engines
 * never match each other's receives.
 *
 * Deadlines. Every wait polls MPI_Test until done or the deadline passes; then the pending
 * receives are cancelled, the sends released, and the communicator is broken (SG_ERR_TIMEOUT). */
#define _POSIX_C_SOURCE 200809L

#include <limits.h>  /* INT_MAX */
#include <mpi.h>     /* with sg_nccl_boot.c, the only files of the library that include it */
#include <pthread.h> /* pthread_mutex_t for the init/finalize count */
#include <sched.h>   /* sched_yield */
#include <stdlib.h>  /* calloc, free */
#include <string.h>  /* memcpy */
#include <time.h>    /* nanosleep: polling the exit barrier */

#include "../coll/sg_coll.h"  /* the algorithms, the transport interface */
#include "../sg_comm.h"  /* sg_comm, sg__comm_ops, sg__comm_fail */
#include "../coll/sg_stage.h" /* device buffers through pinned memory */

#define SG__MPI_CANCEL_GRACE_MS 200 /* how long a cancelled receive may take to finish */

typedef struct mcomm {
  sg_comm c; /* first: the sg_comm pointer is the allocation */
  MPI_Comm comm;
  int own_comm; /* comm is ours to free (not a channel 0's borrowed one) */
  int tag_ub;
  sg__coll coll;   /* the algorithms' state */
  sg__stage stage; /* a channel on a GPU: pinned staging */
} mcomm;

_Static_assert(sizeof(MPI_Request) <= sizeof(((sg__xreq *)0)->h), "MPI_Request fits sg__xreq");

/* Whether this library initialized MPI, and how many MPI communicators are alive: the last
 * destroy finalizes what we initialized. */
static pthread_mutex_t g_mpi_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_mpi_live;
static int g_mpi_we_init;

static mcomm *mc(sg_comm *c) { return (mcomm *)c; }

static sg_status mpi_err(const char *what, int rc, const char *file, int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
  return sg__err_at(SG_ERR_COMM, file, line, "%s failed: %s", what, text);
}
#define SG__MPI_ERR(what, rc) mpi_err((what), (rc), __FILE__, __LINE__)

/* ---- the transport ------------------------------------------------------------------------ */

static MPI_Request req_get(const sg__xreq *rq) {
  MPI_Request r;
  memcpy(&r, rq->h, sizeof r);
  return r;
}

static void req_put(sg__xreq *rq, MPI_Request r) {
  memcpy(rq->h, &r, sizeof r);
  rq->active = r != MPI_REQUEST_NULL;
}

static sg_status x_isend(void *tp, const void *buf, size_t bytes, int peer, int tag,
                         sg__xreq *rq) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int rc = MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, tag, ((mcomm *)tp)->comm, &r);
  if (rc != MPI_SUCCESS) return SG__MPI_ERR("MPI_Isend", rc);
  req_put(rq, r);
  return SG_OK;
}

static sg_status x_irecv(void *tp, void *buf, size_t bytes, int peer, int tag, sg__xreq *rq) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int rc = MPI_Irecv(buf, (int)bytes, MPI_BYTE, peer, tag, ((mcomm *)tp)->comm, &r);
  if (rc != MPI_SUCCESS) return SG__MPI_ERR("MPI_Irecv", rc);
  req_put(rq, r);
  return SG_OK;
}

static sg_status x_test(void *tp, sg__xreq *rq, int *done, size_t *got) {
  *done = 1;
  *got = 0;
  if (!rq->active) return SG_OK;
  MPI_Request r = req_get(rq);
  MPI_Status st;
  const int rc = MPI_Test(&r, done, &st);
  if (rc != MPI_SUCCESS) return SG__MPI_ERR("MPI_Test", rc);
  if (!*done) return SG_OK;
  req_put(rq, MPI_REQUEST_NULL);
  int n = 0;
  if (MPI_Get_count(&st, MPI_BYTE, &n) == MPI_SUCCESS && n > 0) *got = (size_t)n;
  return SG_OK;
}

/* Open MPI cannot cancel sends; releasing them lets the call return. Receives are cancelled;
 * one that does not finish within the grace period (it was already matched) is freed, and
 * reported: its buffer may still be written. */
static int x_abandon(void *tp, sg__xreq *sends, size_t nsend, sg__xreq *recvs, size_t nrecv) {
  for (size_t i = 0; i < nsend; i++) {
    if (!sends[i].active) continue;
    MPI_Request r = req_get(&sends[i]);
    MPI_Request_free(&r);
    req_put(&sends[i], MPI_REQUEST_NULL);
  }
  for (size_t i = 0; i < nrecv; i++) {
    if (!recvs[i].active) continue;
    MPI_Request r = req_get(&recvs[i]);
    MPI_Cancel(&r);
  }
  const int64_t until = sg__now_ms() + SG__MPI_CANCEL_GRACE_MS;
  int lost = 0;
  for (size_t i = 0; i < nrecv; i++) {
    while (recvs[i].active) {
      MPI_Request r = req_get(&recvs[i]);
      int one = 0;
      if (MPI_Test(&r, &one, MPI_STATUS_IGNORE) == MPI_SUCCESS && one) {
        req_put(&recvs[i], MPI_REQUEST_NULL);
        break;
      }
      if (sg__now_ms() < until) {
        sched_yield();
        continue;
      }
      MPI_Request_free(&r);
      req_put(&recvs[i], MPI_REQUEST_NULL);
      lost = 1;
      SG_LOG(SG_LOG_WARN, ((mcomm *)tp)->c.rank,
             "sg_comm(mpi): a cancelled receive did not finish; its buffer may still be written");
    }
  }
  return lost;
}

static sg_status x_ibcast(void *tp, void *buf, size_t bytes, int root, sg__xreq *rq) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int rc = MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, ((mcomm *)tp)->comm, &r);
  if (rc != MPI_SUCCESS) return SG__MPI_ERR("MPI_Ibcast", rc);
  req_put(rq, r);
  return SG_OK;
}

static sg_status x_iallgather(void *tp, void *buf, size_t bytes, sg__xreq *rq) {
  MPI_Request r = MPI_REQUEST_NULL;
  const int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)bytes, MPI_BYTE,
                                ((mcomm *)tp)->comm, &r);
  if (rc != MPI_SUCCESS) return SG__MPI_ERR("MPI_Iallgather", rc);
  req_put(rq, r);
  return SG_OK;
}

static const sg__xport_ops mpi_xport = {"mpi",    x_isend,  x_irecv,     x_test,
                                        x_abandon, x_ibcast, x_iallgather,
                                        0 /* release_rx: faults cost as much as a transfer */,
                                        NULL /* block: MPI progresses only inside its calls */};

/* ---- collectives: host memory through the algorithms, device memory staged ------------------ */

static sg_status host_all_reduce(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  return sg__coll_all_reduce(&mc(c)->coll, buf, count, dtype, dl);
}

static sg_status host_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  return sg__coll_reduce_scatter(&mc(c)->coll, buf, count, dtype, dl);
}

static sg_status host_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t dl) {
  return sg__coll_all_gather(&mc(c)->coll, buf, bytes, dl);
}

static sg_status host_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t dl) {
  return sg__coll_broadcast(&mc(c)->coll, buf, bytes, root, dl);
}

static sg_status host_all_to_all(sg_comm *c, const void *send, void *recv, size_t bytes,
                                 int64_t dl) {
  return sg__coll_all_to_all(&mc(c)->coll, send, recv, bytes, dl);
}

/* The host-memory collectives, for the staging wrapper. */
static const sg__comm_ops mpi_host_ops = {"mpi", host_all_reduce, host_reduce_scatter,
                                          host_all_gather, host_broadcast, NULL, NULL, NULL, NULL,
                                          NULL, NULL, host_all_to_all, NULL, 0};

static sg_status mpi_all_reduce(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_REDUCE, count * sg__comm_elem_bytes(dtype), -1);
  if (!sg__stage_needed(c)) return host_all_reduce(c, buf, count, dtype, dl);
  return sg__stage_all_reduce(c, &mc(c)->stage, &mpi_host_ops, buf, count, dtype, dl);
}

static sg_status mpi_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                 (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  if (!sg__stage_needed(c)) return host_reduce_scatter(c, buf, count, dtype, dl);
  return sg__stage_reduce_scatter(c, &mc(c)->stage, &mpi_host_ops, buf, count, dtype, dl);
}

/* Host memory only: a staged channel's sums land in pinned memory, not in an accumulator. */
static sg_status mpi_reduce_scatter_fold(sg_comm *c, void *buf, size_t count, int dtype,
                                         const sg__fold *f, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                 (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  if (sg__stage_needed(c))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "sg_comm(mpi) reduce_scatter_fold: device memory (host memory only)");
  return sg__coll_reduce_scatter_fold(&mc(c)->coll, buf, count, dtype, f, dl);
}

static sg_status mpi_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  if (!sg__stage_needed(c)) return host_all_gather(c, buf, bytes, dl);
  return sg__stage_all_gather(c, &mc(c)->stage, &mpi_host_ops, buf, bytes, dl);
}

static sg_status mpi_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t dl) {
  sg__comm_count(c, SG__COUNT_BROADCAST, bytes, root);
  if (!sg__stage_needed(c)) return host_broadcast(c, buf, bytes, root, dl);
  return sg__stage_broadcast(c, &mc(c)->stage, &mpi_host_ops, buf, bytes, root, dl);
}

/* ---- lifetime ------------------------------------------------------------------------------- */

/* The last destroy finalizes MPI if this library initialized it and nobody finalized it yet.
 * After a communicator failed, MPI_Finalize may never return: it waits for every peer (Open
 * MPI's fence through its runtime), and a peer that is gone or a link that is down would hold
 * the caller there (measured on the simulated cluster, tests/fault_matrix.sh: until the link
 * came back; forever after a kill -9). So a process that saw a failure first asks whether
 * every peer got here too: a nonblocking barrier on a communicator of our own that no failure
 * touched, polled for SG__MPI_FINALIZE_WAIT_MS. Completed (every rank failed the same way and
 * is shutting down, as after a timeout with all peers alive): finalize as usual. Not
 * completed: leave MPI_Finalize out with a warning; the process exits with its error and mpirun
 * reports it. */
#define SG__MPI_FINALIZE_WAIT_MS 10000
static int g_mpi_failed;                   /* under g_mpi_mu: a destroyed communicator was broken */
static MPI_Comm g_mpi_exit = MPI_COMM_NULL; /* under g_mpi_mu: for the barrier above */

static int peers_at_exit(void) {
  MPI_Request rq = MPI_REQUEST_NULL;
  if (g_mpi_exit == MPI_COMM_NULL || MPI_Ibarrier(g_mpi_exit, &rq) != MPI_SUCCESS) return 0;
  const int64_t dl = sg__deadline(SG__MPI_FINALIZE_WAIT_MS);
  for (;;) {
    int done = 0;
    if (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return 0;
    if (done) return 1;
    if (sg__now_ms() > dl) return 0;
    nanosleep(&(struct timespec){0, 1000000L}, NULL);
  }
}

static void release_mpi(int broken) {
  pthread_mutex_lock(&g_mpi_mu);
  if (broken) g_mpi_failed = 1;
  if (--g_mpi_live == 0 && g_mpi_we_init) {
    int fin = 1;
    MPI_Finalized(&fin);
    if (!fin && g_mpi_failed && !peers_at_exit()) {
      SG_LOG(SG_LOG_WARN, -1, "sg_comm_destroy: MPI_Finalize left out: after a communication "
             "failure not every peer reached it within %d s (it would wait for them)",
             SG__MPI_FINALIZE_WAIT_MS / 1000);
    } else if (!fin) {
      if (g_mpi_exit != MPI_COMM_NULL) MPI_Comm_free(&g_mpi_exit);
      MPI_Finalize();
    }
    g_mpi_exit = MPI_COMM_NULL;
    g_mpi_we_init = 0;
  }
  pthread_mutex_unlock(&g_mpi_mu);
}

/* A broken communicator may still have requests in flight: freeing it could wait on peers that
 * are gone. MPI_Finalize reclaims it. */
static void free_mcomm(mcomm *m) {
  int fin = 1;
  MPI_Finalized(&fin);
  if (!fin && !m->c.broken && m->own_comm && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
  sg__coll_free(&m->coll);
  free(m);
}

static void mpi_destroy(sg_comm *c) {
  const int broken = c->broken;
  free_mcomm(mc(c));
  release_mpi(broken);
}

/* The bound device is going away: its pinned memory goes back first. */
static void mpi_unbind(sg_comm *chan) {
  mcomm *m = mc(chan);
  sg__stage_free(chan, &m->stage);
  if (chan->dev) chan->dev->ops->comm_detach(chan->dev);
  free_mcomm(m);
}

static sg_status mpi_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                          sg_comm **chan);

static sg_status mpi_split(sg_comm *chan, const int *colors, const int *keys, int64_t dl,
                           sg_comm **out);

static sg_status mpi_node_leader(sg_comm *chan, int64_t dl, int *leader);

/* Device memory staged as the other collectives (the codecs' exchange on a CUDA engine). */
static sg_status mpi_all_to_all(sg_comm *c, const void *send, void *recv, size_t bytes,
                                int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  if (!sg__stage_needed(c)) return host_all_to_all(c, send, recv, bytes, dl);
  return sg__stage_all_to_all(c, &mc(c)->stage, &mpi_host_ops, send, recv, bytes, dl);
}

static const sg__comm_ops mpi_ops = {
    "mpi",    mpi_all_reduce, mpi_reduce_scatter, mpi_all_gather, mpi_broadcast,
    mpi_bind, mpi_unbind,     mpi_destroy,        mpi_split,      mpi_node_leader,
    mpi_reduce_scatter_fold, mpi_all_to_all,
    NULL, /* reduce_scatter_to: the engine's fold (reduce_scatter_fold) serves host memory */
    1 /* all_to_all_device: staged through pinned memory */,
};

/* Every rank has arrived (sg_comm_split gathered the colors over this channel), so the blocking
 * MPI_Comm_split cannot wait for a missing peer. The result is duplicated into a communicator
 * of our own by sg_comm_create_mpi. */
static sg_status mpi_split(sg_comm *chan, const int *colors, const int *keys, int64_t dl,
                           sg_comm **out) {
  static const char fn[] = "sg_comm_split(mpi)";
  (void)dl;
  const int me = chan->rank;
  MPI_Comm nc = MPI_COMM_NULL;
  const int rc =
      MPI_Comm_split(mc(chan)->comm, colors[me] < 0 ? MPI_UNDEFINED : colors[me], keys[me], &nc);
  if (rc != MPI_SUCCESS) return sg__comm_fail(chan, SG_ERR_COMM, fn, "MPI_Comm_split failed (%d)", rc);
  if (nc == MPI_COMM_NULL) return SG_OK;
  const sg_status st = sg_comm_create_mpi(&nc, out);
  MPI_Comm_free(&nc);
  if (st != SG_OK) chan->broken = 1; /* the others may have theirs */
  return st;
}

/* The ranks MPI says share memory with this one (MPI_COMM_TYPE_SHARED: one node); the lowest
 * of them in chan. Every rank has arrived (sg_comm_split_nodes gathered its arguments over the
 * channel first), so the blocking MPI_Comm_split_type cannot wait for a missing peer. */
static sg_status mpi_node_leader(sg_comm *chan, int64_t dl, int *leader) {
  static const char fn[] = "sg_comm_split_nodes(mpi)";
  (void)dl;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Group gnode = MPI_GROUP_NULL, gall = MPI_GROUP_NULL;
  const int zero = 0;
  int rc = MPI_Comm_split_type(mc(chan)->comm, MPI_COMM_TYPE_SHARED, chan->rank, MPI_INFO_NULL,
                               &node);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_group(node, &gnode);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_group(mc(chan)->comm, &gall);
  if (rc == MPI_SUCCESS) rc = MPI_Group_translate_ranks(gnode, 1, &zero, gall, leader);
  if (gnode != MPI_GROUP_NULL) MPI_Group_free(&gnode);
  if (gall != MPI_GROUP_NULL) MPI_Group_free(&gall);
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
  if (rc != MPI_SUCCESS)
    return sg__comm_fail(chan, SG_ERR_COMM, fn, "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed (%d)", rc);
  return SG_OK;
}

/* MPI_Comm_idup, polled until the deadline (a duplicate is collective: a peer that never
 * binds leaves it pending, and the communicator broken). */
static sg_status dup_comm(sg_comm *c, MPI_Comm base, int64_t deadline_ms, MPI_Comm *out) {
  static const char fn[] = "sg_comm(mpi) bind";
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(base, out, &r);
  if (rc != MPI_SUCCESS) return sg__comm_fail(c, SG_ERR_COMM, fn, "MPI_Comm_idup failed (%d)", rc);
  int done = 0;
  for (unsigned spins = 0; !done; spins++) {
    if ((rc = MPI_Test(&r, &done, MPI_STATUS_IGNORE)) != MPI_SUCCESS)
      return sg__comm_fail(c, SG_ERR_COMM, fn, "MPI_Test(MPI_Comm_idup) failed (%d)", rc);
    if (!done && sg__now_ms() > deadline_ms)
      return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                           "deadline passed while duplicating the communicator for a new engine "
                           "(rank %d of %d; do all ranks create their engines in the same order?)",
                           c->rank, c->world);
    if (!done && spins > 1000) sched_yield();
  }
  rc = MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  return rc == MPI_SUCCESS ? SG_OK : sg__comm_fail(c, SG_ERR_COMM, fn, "errhandler (%d)", rc);
}

static sg_status mpi_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                          sg_comm **chan) {
  mcomm *m = calloc(1, sizeof *m);
  if (!m) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(mpi) bind: out of memory");
  sg__comm_channel_init(&m->c, c, &mpi_ops, dev, m);
  m->comm = MPI_COMM_NULL;
  m->tag_ub = mc(c)->tag_ub;
  sg_status st = SG_OK;
  if (index == 0)
    m->comm = mc(c)->comm;
  else if ((st = dup_comm(c, mc(c)->comm, sg__deadline(timeout_ms), &m->comm)) == SG_OK)
    m->own_comm = 1;
  if (st == SG_OK) st = sg__coll_init(&m->coll, &m->c, &mpi_xport, m, m->tag_ub);
  if (st == SG_OK && dev) {
    /* host-driven; on the device's worker only where MPI allows calls from any thread */
    const sg__comm_attach a = {0, c->threaded, NULL, NULL, NULL, timeout_ms};
    sg__comm_native native;
    st = dev->ops->comm_attach(dev, &a, &native);
  }
  if (st != SG_OK) {
    m->c.dev = NULL; /* not attached */
    free_mcomm(m);
    return st;
  }
  *chan = &m->c;
  return SG_OK;
}

/* Initializes MPI when nobody has and reports the thread level. Counts one live communicator
 * on success. */
static sg_status acquire_mpi(int *provided) {
  static const char fn[] = "sg_comm_create_mpi";
  sg_status st = SG_OK;
  int init = 0, fin = 0;
  pthread_mutex_lock(&g_mpi_mu);
  MPI_Finalized(&fin);
  MPI_Initialized(&init);
  if (fin) {
    st = sg__err(SG_ERR_INVALID_STATE, "%s: MPI is already finalized", fn);
  } else if (!init) {
    const int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
    if (rc != MPI_SUCCESS)
      st = sg__err_at(SG_ERR_COMM, __FILE__, __LINE__, "%s: MPI_Init_thread failed (%d)", fn, rc);
    else
      g_mpi_we_init = 1;
    /* collective like this call: the communicator of release_mpi's exit barrier */
    if (rc == MPI_SUCCESS && MPI_Comm_dup(MPI_COMM_WORLD, &g_mpi_exit) != MPI_SUCCESS)
      g_mpi_exit = MPI_COMM_NULL;
  } else {
    MPI_Query_thread(provided);
  }
  if (st == SG_OK) g_mpi_live++;
  pthread_mutex_unlock(&g_mpi_mu);
  return st;
}

static sg_status setup(mcomm *m, MPI_Comm base) {
  static const char fn[] = "sg_comm_create_mpi";
  int rc = MPI_Comm_dup(base, &m->comm); /* our traffic never mixes with the caller's */
  if (rc != MPI_SUCCESS) return sg__err_prefix(SG__MPI_ERR("MPI_Comm_dup", rc), fn);
  rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->comm, &m->c.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->comm, &m->c.world);
  if (rc != MPI_SUCCESS) return sg__err_prefix(SG__MPI_ERR("MPI_Comm_rank/size", rc), fn);
  int *ub = NULL, flag = 0;
  MPI_Comm_get_attr(m->comm, MPI_TAG_UB, &ub, &flag);
  m->tag_ub = flag && ub && *ub > 2 ? *ub : 32767;
  return sg__coll_init(&m->coll, &m->c, &mpi_xport, m, m->tag_ub);
}

sg_status sg_comm_create_mpi(const void *mpi_comm, sg_comm **out) {
  static const char fn[] = "sg_comm_create_mpi";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  int provided = MPI_THREAD_SINGLE;
  SG_TRY(acquire_mpi(&provided));
  mcomm *m = calloc(1, sizeof *m);
  if (!m) {
    release_mpi(0);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  m->c.ops = &mpi_ops;
  m->c.impl = m;
  m->comm = MPI_COMM_NULL;
  m->own_comm = 1;
  /* A comm worker calls MPI while the application (or another engine's worker) may call it
   * too: only MPI_THREAD_MULTIPLE allows that. */
  m->c.threaded = provided >= MPI_THREAD_MULTIPLE;
  const sg_status st = setup(m, mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD);
  if (st != SG_OK) {
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    sg__coll_free(&m->coll);
    free(m);
    release_mpi(0);
    return st;
  }
  if (!m->c.threaded)
    SG_LOG(SG_LOG_INFO, m->c.rank,
           "%s: MPI thread level %d is below MPI_THREAD_MULTIPLE: collectives run on the "
           "calling thread (no overlap with backward)",
           fn, provided);
  SG_LOG(SG_LOG_DEBUG, m->c.rank, "%s: rank %d of %d, thread level %d", fn, m->c.rank, m->c.world,
         provided);
  *out = &m->c;
  return SG_OK;
}
