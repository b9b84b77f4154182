/* A communicator over the caller's point-to-point transport (sg_comm_create_xport; DESIGN.md
 * section 6): the collective algorithms of sg_coll.h over the callbacks of an sg_xport. The
 * Python binding fills it with torch.distributed sends and receives (shardgrad/_torch_xport.py).
 *
 * Completion. A started transfer owns a record (its token) that the transport completes with
 * sg_xport_done from any thread; the algorithms' polls (test) only read the record's state, so
 * they never call the transport (the Python one would take the GIL on every poll). The record
 * is freed by the poll that sees it done, or after cancel, which ends the transport's right to
 * complete it.
 *
 * Channels: every channel is the same transport with a tag space of its own (the channel
 * index in the tag's upper bits), so binding is not collective and engines never see each
 * other's messages. The transport and its user pointer belong to the communicator; channels
 * borrow them (a communicator with channels is never destroyed, comm.c). */
#include <stdatomic.h> /* the records' state */
#include <stdio.h>     /* snprintf */
#include <stdlib.h>    /* calloc, free */
#include <string.h>    /* memcpy, strlen */

#include "sg_coll.h" /* the algorithms, the transport interface */
#include "sg_comm.h" /* sg_comm, sg__comm_ops, sg__comm_channel_init */
#include "sg_stage.h" /* sg__stage_needed: buffers the host cannot address */

#define SG__XPORT_TAG_BITS 20 /* tags of one channel: 0 .. 2^20-1 */
#define SG__XPORT_CHANNELS 2048u /* channel index mod this goes above them (tag < 2^31) */
#define SG__XPORT_MSG 512 /* longest message kept from the transport */

enum { REC_PENDING = 0, REC_DONE = 1, REC_FAILED = 2, REC_WRITING = 3 };

/* One started transfer: the token the transport completes. */
typedef struct xrec {
  _Atomic int state;
  size_t got;
  char msg[SG__XPORT_MSG];
} xrec;

typedef struct xcomm {
  sg_comm c; /* first: the sg_comm pointer is the allocation */
  sg_xport t;       /* a communicator: the copy of the caller's; a channel: its parent's */
  char name[32];
  int tag_base;     /* channel index << SG__XPORT_TAG_BITS */
  sg__coll coll;
} xcomm;

static xcomm *xc(sg_comm *c) { return (xcomm *)c; }

/* ---- the transport ------------------------------------------------------------------------ */

static xrec *rec_of(const sg__xreq *rq) {
  xrec *r;
  memcpy(&r, rq->h, sizeof r);
  return r;
}

/* One callback's failure text into the thread's error (the collective's prefix names the
 * transport). */
static sg_status cb_fail(const char *what, int rc, const char *msg) {
  return sg__err(SG_ERR_COMM, "%s failed (%d): %s", what, rc, msg[0] ? msg : "no message");
}

static sg_status start(xcomm *x, int recv, void *buf, size_t bytes, int peer, int tag,
                       sg__xreq *rq) {
  xrec *r = calloc(1, sizeof *r);
  if (!r) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(%s): out of memory", x->name);
  atomic_init(&r->state, REC_PENDING);
  char msg[SG__XPORT_MSG] = "";
  const int wire_tag = x->tag_base | tag;
  const int rc = recv ? x->t.irecv(x->t.user, buf, bytes, peer, wire_tag, r, msg, sizeof msg)
                      : x->t.isend(x->t.user, buf, bytes, peer, wire_tag, r, msg, sizeof msg);
  if (rc != 0) {
    msg[sizeof msg - 1] = '\0';
    free(r);
    return cb_fail(recv ? "irecv" : "isend", rc, msg);
  }
  memcpy(rq->h, &r, sizeof r);
  rq->active = 1;
  return SG_OK;
}

static sg_status x_isend(void *tp, const void *buf, size_t bytes, int peer, int tag,
                         sg__xreq *rq) {
  return start(tp, 0, (void *)buf, bytes, peer, tag, rq);
}

static sg_status x_irecv(void *tp, void *buf, size_t bytes, int peer, int tag, sg__xreq *rq) {
  return start(tp, 1, buf, bytes, peer, tag, rq);
}

static sg_status x_test(void *tp, sg__xreq *rq, int *done, size_t *got) {
  *done = 1;
  *got = 0;
  if (!rq->active) return SG_OK;
  xrec *r = rec_of(rq);
  const int state = atomic_load_explicit(&r->state, memory_order_acquire);
  if (state == REC_PENDING || state == REC_WRITING) {
    *done = 0;
    return SG_OK;
  }
  rq->active = 0;
  sg_status st = SG_OK;
  if (state == REC_DONE)
    *got = r->got;
  else
    st = sg__err(SG_ERR_COMM, "a transfer failed: %s", r->msg[0] ? r->msg : "no message");
  free(r);
  return st;
}

/* Records of transfers the transport may still touch are freed too: after cancel it never
 * completes them. */
static int x_abandon(void *tp, sg__xreq *sends, size_t nsend, sg__xreq *recvs, size_t nrecv) {
  xcomm *x = tp;
  int lost = 0;
  for (int pass = 0; pass < 2; pass++) {
    sg__xreq *rq = pass ? recvs : sends;
    const size_t n = pass ? nrecv : nsend;
    for (size_t i = 0; i < n; i++) {
      if (!rq[i].active) continue;
      xrec *r = rec_of(&rq[i]);
      const int still = x->t.cancel(x->t.user, r);
      if (still && pass) lost = 1;
      rq[i].active = 0;
      free(r);
    }
  }
  if (lost)
    SG_LOG(SG_LOG_WARN, x->c.rank,
           "sg_comm(%s): a cancelled receive may still write its buffer", x->name);
  return lost;
}

static const sg__xport_ops xport_ops = {"xport", x_isend, x_irecv, x_test, x_abandon, NULL, NULL};

sg_status sg_xport_done(void *token, int error, size_t bytes, const char *msg) {
  static const char fn[] = "sg_xport_done";
  if (!token) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: token is NULL", fn);
  xrec *r = token;
  int expect = REC_PENDING;
  if (!atomic_compare_exchange_strong_explicit(&r->state, &expect, REC_WRITING,
                                               memory_order_acquire, memory_order_relaxed))
    return sg__err(SG_ERR_INVALID_STATE, "%s: the transfer was already completed", fn);
  r->got = error ? 0 : bytes;
  if (error) {
    const size_t n = msg ? strlen(msg) : 0;
    const size_t k = n < sizeof r->msg - 1 ? n : sizeof r->msg - 1;
    if (k) memcpy(r->msg, msg, k);
    r->msg[k] = '\0';
  }
  atomic_store_explicit(&r->state, error ? REC_FAILED : REC_DONE, memory_order_release);
  return SG_OK;
}

/* ---- collectives (host memory) -------------------------------------------------------------- */

static sg_status x_all_reduce(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_REDUCE, count * sg__comm_elem_bytes(dtype), -1);
  return sg__coll_all_reduce(&xc(c)->coll, buf, count, dtype, dl);
}

static sg_status x_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype, int64_t dl) {
  if (c)
    sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                   (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  return sg__coll_reduce_scatter(&xc(c)->coll, buf, count, dtype, dl);
}

static sg_status x_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  return sg__coll_all_gather(&xc(c)->coll, buf, bytes, dl);
}

static sg_status x_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_BROADCAST, bytes, root);
  return sg__coll_broadcast(&xc(c)->coll, buf, bytes, root, dl);
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static void x_unbind(sg_comm *chan) {
  if (chan->dev) chan->dev->ops->comm_detach(chan->dev);
  sg__coll_free(&xc(chan)->coll);
  free(chan);
}

static void x_destroy(sg_comm *c) {
  xcomm *x = xc(c);
  void (*release)(void *) = x->t.release;
  void *user = x->t.user;
  sg__coll_free(&x->coll);
  free(x);
  if (release) release(user);
}

static sg_status x_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                        sg_comm **chan);

/* No split yet (sg_comm_split: SG_ERR_UNSUPPORTED): it would need a rank map over the
 * transport. Node leaders from host names. */
static const sg__comm_ops xcomm_ops = {
    "xport", x_all_reduce, x_reduce_scatter, x_all_gather, x_broadcast,
    x_bind,  x_unbind,     x_destroy,        NULL,         NULL,
};

/* The algorithms' state for x, named after the transport in messages. */
static sg_status coll_init(xcomm *x) {
  SG_TRY(sg__coll_init(&x->coll, &x->c, &xport_ops, x, (1 << SG__XPORT_TAG_BITS) - 1));
  static const char *const ops[] = {"", "all_reduce", "reduce_scatter", "all_gather",
                                    "broadcast"};
  for (int op = 1; op <= 4; op++)
    snprintf(x->coll.fn[op], sizeof x->coll.fn[op], "sg_comm(%s) %s", x->name, ops[op]);
  return SG_OK;
}

static sg_status x_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                        sg_comm **chan) {
  const xcomm *base = xc(c);
  xcomm *x = calloc(1, sizeof *x);
  if (!x) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(%s) bind: out of memory", base->name);
  sg__comm_channel_init(&x->c, c, &xcomm_ops, dev, x);
  x->t = base->t;
  memcpy(x->name, base->name, sizeof x->name);
  x->tag_base = (int)((index % SG__XPORT_CHANNELS) << SG__XPORT_TAG_BITS);
  sg_status st = SG_OK;
  if (sg__stage_needed(&x->c))
    st = sg__err(SG_ERR_UNSUPPORTED,
                 "sg_comm(%s): buffers on a GPU are not supported by a transport communicator "
                 "(use an NCCL communicator, e.g. Comm.from_torch on an NCCL process group)",
                 x->name);
  if (st == SG_OK) st = coll_init(x);
  if (st == SG_OK && dev) {
    /* host-driven, on the device's worker where the transport allows any thread */
    const sg__comm_attach a = {0, c->threaded, NULL, NULL, NULL, timeout_ms};
    sg__comm_native native;
    st = dev->ops->comm_attach(dev, &a, &native);
  }
  if (st != SG_OK) {
    sg__coll_free(&x->coll);
    free(x);
    return st;
  }
  *chan = &x->c;
  return SG_OK;
}

sg_status sg_comm_create_xport(const sg_xport *t, int rank, int world, sg_comm **out) {
  static const char fn[] = "sg_comm_create_xport";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  if (!t) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: t is NULL", fn);
  if (t->struct_size != sizeof(sg_xport))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: t->struct_size %zu, expected %zu", fn,
                   t->struct_size, sizeof(sg_xport));
  if (!t->isend || !t->irecv || !t->cancel)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: t->%s is NULL", fn,
                   !t->isend ? "isend" : !t->irecv ? "irecv" : "cancel");
  if (world < 1 || world > 65536)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world must be in 1..65536 (got %d)", fn, world);
  if (rank < 0 || rank >= world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: rank %d outside 0..%d", fn, rank, world - 1);
  const char *name = t->name && t->name[0] ? t->name : "xport";
  if (strlen(name) >= sizeof(((xcomm *)0)->name))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: t->name longer than 31 characters", fn);
  xcomm *x = calloc(1, sizeof *x);
  if (!x) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  x->c.ops = &xcomm_ops;
  x->c.impl = x;
  x->c.rank = rank;
  x->c.world = world;
  x->c.threaded = t->threaded != 0;
  x->t = *t;
  memcpy(x->name, name, strlen(name) + 1);
  const sg_status st = coll_init(x);
  if (st != SG_OK) {
    free(x);
    return sg__err_prefix(st, fn);
  }
  SG_LOG(SG_LOG_DEBUG, rank, "%s: rank %d of %d over '%s'%s", fn, rank, world, x->name,
         x->c.threaded ? "" : " (calling thread only)");
  *out = &x->c;
  return SG_OK;
}
