/* Public communicator functions (rank, size, destroy) and the helpers every backend shares
 * (DESIGN.md section 6). The backends live in local.c, mpi.c and nccl.c. */
#include <pthread.h> /* the bind lock */
#include <stdarg.h>  /* va_list */
#include <stdio.h>   /* vsnprintf */

#include "sg_comm.h" /* sg_comm, sg__comm_ops, sg__comm_fail, sg__comm_usable */

int sg_comm_rank(const sg_comm *c) { return c ? c->rank : -1; }

int sg_comm_size(const sg_comm *c) { return c ? c->world : -1; }

/* Channel counts of every communicator: engines may be created and destroyed on any thread. */
static pthread_mutex_t g_bind_mu = PTHREAD_MUTEX_INITIALIZER;

/* Destroying a communicator that an engine still holds cannot free it at once (the engine's
 * channel, maybe inside a collective on its comm worker right now, refers to it). So the free
 * is deferred: the communicator is marked destroyed (no new engine or split may use it) and
 * the last sg__comm_unbind, in the last such engine's sg_engine_destroy, frees it. Either
 * order of destroying engines and communicators then frees everything, and for MPI the last
 * free still finalizes MPI (an MPI program that destroyed its communicator first no longer
 * leaks it and exits without MPI_Finalize). */
void sg_comm_destroy(sg_comm *c) {
  if (!c) return;
  if (c->parent) {
    SG_LOG(SG_LOG_WARN, c->rank, "sg_comm_destroy: an engine's channel, not a communicator: "
           "not destroyed");
    return;
  }
  pthread_mutex_lock(&g_bind_mu);
  const int bound = c->nbound, again = c->destroyed;
  c->destroyed = 1;
  pthread_mutex_unlock(&g_bind_mu);
  if (again) {
    SG_LOG(SG_LOG_WARN, c->rank, "sg_comm_destroy: communicator already destroyed (its free "
           "waits for %d engine(s))", bound);
    return;
  }
  if (bound > 0) {
    SG_LOG(SG_LOG_INFO, c->rank, "sg_comm_destroy: communicator (rank %d of %d) still used by "
           "%d engine(s): freed with the last of them", c->rank, c->world, bound);
    return;
  }
  if (c->ops && c->ops->destroy) c->ops->destroy(c);
}

sg_status sg__comm_bind(sg_comm *c, sg__device *dev, int timeout_ms, sg_comm **chan) {
  static const char fn[] = "sg__comm_bind";
  if (!chan) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: chan is NULL", fn);
  *chan = NULL;
  if (!c || !c->ops) return sg__comm_usable(c, fn);
  if (c->parent)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: a channel cannot be bound again", fn);
  if (!c->ops->bind)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: the %s communicator has no channels", fn, c->ops->name);
  /* Indices advance even when a bind fails, so that ranks keep meeting at the same index. */
  pthread_mutex_lock(&g_bind_mu);
  const int broken = c->broken || c->destroyed;
  const uint64_t index = broken ? 0 : c->nbinds++;
  pthread_mutex_unlock(&g_bind_mu);
  if (broken) return sg__comm_usable(c, fn);
  sg_comm *ch = NULL;
  SG_TRY(c->ops->bind(c, index, dev, timeout_ms, &ch));
  pthread_mutex_lock(&g_bind_mu);
  c->nbound++;
  pthread_mutex_unlock(&g_bind_mu);
  *chan = ch;
  return SG_OK;
}

/* A channel's failure breaks its communicator for later engines: a collective that failed
 * half-way leaves the ranks out of step (a peer may be gone). */
void sg__comm_unbind(sg_comm *chan) {
  if (!chan) return;
  sg_comm *c = chan->parent;
  const int broken = chan->broken;
  chan->ops->unbind(chan);
  if (!c) return;
  pthread_mutex_lock(&g_bind_mu);
  c->nbound--;
  if (broken) c->broken = 1;
  const int last = c->nbound == 0 && c->destroyed;
  pthread_mutex_unlock(&g_bind_mu);
  if (last && c->ops && c->ops->destroy) c->ops->destroy(c); /* sg_comm_destroy came first */
}

void sg__comm_set_scratch(sg_comm *chan, void *scratch, size_t bytes) {
  if (!chan) return;
  chan->scratch = scratch;
  chan->scratch_bytes = scratch ? bytes : 0;
}

void sg__comm_channel_init(sg_comm *chan, const sg_comm *c, const sg__comm_ops *ops,
                           sg__device *dev, void *impl) {
  chan->ops = ops;
  chan->rank = c->rank;
  chan->world = c->world;
  chan->threaded = c->threaded;
  chan->stream_ordered = c->stream_ordered;
  chan->parent = (sg_comm *)c;
  chan->dev = dev;
  chan->impl = impl;
}

sg_status sg__comm_fail(sg_comm *c, sg_status st, const char *fn, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  if (vsnprintf(msg, sizeof msg, fmt, ap) < 0) msg[0] = '\0';
  va_end(ap);
  if (c) {
    /* Broken for good: a collective that failed half-way leaves peers at unknown points. */
    __atomic_store_n(&c->broken, 1, __ATOMIC_RELAXED); /* an abort may come from another thread */
    /* info, not warn: the caller gets the status and the text; warn is for what it cannot see */
    SG_LOG(SG_LOG_INFO, c->rank, "%s: %s (communicator now broken)", fn ? fn : "comm", msg);
  }
  return sg__err(st, "%s: %s", fn ? fn : "comm", msg);
}

sg_status sg__comm_usable(sg_comm *c, const char *fn) {
  if (!c) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is NULL", fn);
  if (!c->ops) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm has no backend", fn);
  if (c->destroyed)
    return sg__err(SG_ERR_INVALID_STATE,
                   "%s: communicator (rank %d of %d) was destroyed (sg_comm_destroy); the engines "
                   "that use it keep it until they are destroyed, nothing new may",
                   fn, c->rank, c->world);
  if (__atomic_load_n(&c->broken, __ATOMIC_RELAXED))
    return sg__err(SG_ERR_COMM,
                   "%s: communicator (rank %d of %d) is broken by an earlier failure; create a "
                   "new one",
                   fn, c->rank, c->world);
  return SG_OK;
}

sg_status sg__comm_fold_check(const char *fn, int dtype, size_t count, const sg__fold *f) {
  if (dtype < 0 || dtype == SG__F64 || !f || (count > 0 && !f->acc) ||
      !(f->acc_dtype == SG_F32 || f->acc_dtype == SG_BF16))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: a fold takes f32/bf16/f16 values and an f32 or bf16 accumulator", fn);
  return SG_OK;
}

#ifndef SG_HAVE_MPI
sg_status sg_comm_create_mpi(const void *mpi_comm, sg_comm **out) {
  (void)mpi_comm;
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_mpi: out is NULL");
  *out = NULL;
  return sg__err(SG_ERR_UNSUPPORTED, "sg_comm_create_mpi: built without MPI");
}
#endif

/* Bandwidth-optimal byte counts (nccl-tests' bus bytes): a reduction of S bytes over W ranks
 * sends and receives (W-1)/W of S per phase (two phases for an all-reduce), an all-gather of a
 * W-slice buffer of S bytes (W-1)/W of S, a broadcast S from the root into every other rank. */
void sg__comm_count(sg_comm *c, int op, size_t bytes, int root) {
  if (!c) return;
  sg_comm *base = c->parent ? c->parent : c;
  const uint64_t w = c->world > 0 ? (uint64_t)c->world : 1u, b = (uint64_t)bytes;
  uint64_t sent = 0, recv = 0;
  switch (op) {
    case SG__COUNT_ALL_REDUCE:
      sent = recv = 2u * (w - 1u) * b / w;
      break;
    case SG__COUNT_REDUCE_SCATTER:
    case SG__COUNT_ALL_GATHER:
      sent = recv = (w - 1u) * b / w;
      break;
    case SG__COUNT_BROADCAST:
      if (w > 1 && c->rank == root)
        sent = b;
      else if (w > 1)
        recv = b;
      break;
  }
  __atomic_fetch_add(&base->sent, sent, __ATOMIC_RELAXED);
  __atomic_fetch_add(&base->received, recv, __ATOMIC_RELAXED);
  __atomic_fetch_add(&base->collectives, 1u, __ATOMIC_RELAXED);
}

sg_status sg_comm_stats(const sg_comm *c, sg_comm_traffic *out) {
  static const char fn[] = "sg_comm_stats";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  if (out->struct_size != sizeof(sg_comm_traffic))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out->struct_size %zu, expected %zu", fn,
                   out->struct_size, sizeof(sg_comm_traffic));
  if (!c) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is NULL", fn);
  const sg_comm *base = c->parent ? c->parent : c;
  out->bytes_sent = __atomic_load_n(&base->sent, __ATOMIC_RELAXED);
  out->bytes_received = __atomic_load_n(&base->received, __ATOMIC_RELAXED);
  out->collectives = __atomic_load_n(&base->collectives, __ATOMIC_RELAXED);
  return SG_OK;
}
