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
 * Families. sg_comm_split and sg_comm_split_nodes of such a communicator make communicators
 * over the same transport: a family (this process's communicators of one sg_xport) shares the
 * transport, which is released when the family's last communicator is destroyed, so parents
 * and children may be destroyed in any order. A child keeps the transport rank of each of its
 * ranks (its rank map). Each communicator of a family has a context (0 for the one made by
 * sg_comm_create_xport) that no other live communicator with a process in common has: a split
 * all-gathers every rank's free contexts and takes the lowest one free on all of them.
 *
 * Tags: context (6 bits) | channel slot (9 bits: the channel index mod 512) | the call's tag
 * (16 bits), below 2^31. Every channel of a communicator is the same transport with a tag
 * space of its own, so binding is not collective and engines never see each other's messages;
 * a channel whose slot is still held by a live channel of the same communicator is refused.
 * The transport belongs to the family; communicators and channels borrow it (a communicator
 * with channels is never destroyed, comm.c). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_condattr_setclock */

#include <pthread.h>   /* the family's lock, the bell */
#include <stdatomic.h> /* the records' state */
#include <stdio.h>     /* snprintf */
#include <stdlib.h>    /* calloc, free */
#include <string.h>    /* memcpy, strlen */
#include <time.h>      /* clock_gettime */

#include "../coll/sg_coll.h" /* the algorithms, the transport interface */
#include "../sg_comm.h" /* sg_comm, sg__comm_ops, sg__comm_channel_init */
#include "../coll/sg_stage.h" /* sg__stage_needed: buffers the host cannot address */

#define SG__XPORT_CALL_BITS 16 /* tags of one call space: 0 .. 2^16-1 */
#define SG__XPORT_SLOT_BITS 9  /* channel index mod 512 */
#define SG__XPORT_CTX_BITS 6   /* communicators of one family alive with a process in common */
#define SG__XPORT_SLOTS (1u << SG__XPORT_SLOT_BITS)
#define SG__XPORT_CTXS (1u << SG__XPORT_CTX_BITS) /* = the bits of a uint64_t */
#define SG__XPORT_MSG 512 /* longest message kept from the transport */

enum { REC_PENDING = 0, REC_DONE = 1, REC_FAILED = 2, REC_WRITING = 3 };

/* One started transfer: the token the transport completes. */
typedef struct xrec {
  _Atomic int state;
  size_t got;
  char msg[SG__XPORT_MSG];
} xrec;

/* The communicators of one sg_xport on this process (see "Families" above). */
typedef struct xfam {
  sg_xport t;         /* the copy of the caller's */
  pthread_mutex_t mu; /* the fields below */
  int refs;           /* communicators of the family alive */
  uint64_t ctx_used;  /* bit k: context k is a live communicator's */
  int splitting;      /* a split of a family member is agreeing on a context */
} xfam;

typedef struct xcomm {
  sg_comm c; /* first: the sg_comm pointer is the allocation */
  xfam *fam;
  int *peer;        /* rank -> transport rank (NULL: the same); a channel borrows its parent's */
  char name[32];
  int ctx;
  int tag_base;     /* a channel: (ctx, slot) in the tag's upper bits */
  uint64_t slots[SG__XPORT_SLOTS / 64]; /* a communicator: slots of its live channels */
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
  const sg_xport *t = &x->fam->t;
  const int wire_tag = x->tag_base | tag, to = x->peer ? x->peer[peer] : peer;
  const int rc = recv ? t->irecv(t->user, buf, bytes, to, wire_tag, r, msg, sizeof msg)
                      : t->isend(t->user, buf, bytes, to, wire_tag, r, msg, sizeof msg);
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
      const int still = x->fam->t.cancel(x->fam->t.user, r);
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

/* The bell: sg_xport_done wakes the algorithms' waits that sleep on it (block). One for the
 * process, since a wakeup for another record only costs a re-check; `sleepers` spares the
 * completing thread the lock when nobody sleeps. Both sides use sequentially consistent
 * operations on state and sleepers, so a sleeper either sees its record done or is woken. */
static pthread_mutex_t g_bell_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_bell_cv;
static pthread_once_t g_bell_once = PTHREAD_ONCE_INIT;
static int g_bell_ok;
static _Atomic int g_bell_sleepers;

static void bell_init(void) {
  pthread_condattr_t ca;
  if (pthread_condattr_init(&ca) != 0) return;
  g_bell_ok = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 &&
              pthread_cond_init(&g_bell_cv, &ca) == 0;
  pthread_condattr_destroy(&ca);
}

static void bell_ring(void) {
  if (atomic_load(&g_bell_sleepers) == 0) return;
  pthread_mutex_lock(&g_bell_mu);
  pthread_cond_broadcast(&g_bell_cv);
  pthread_mutex_unlock(&g_bell_mu);
}

static void x_block(void *tp, sg__xreq *rq, unsigned us) {
  (void)tp;
  if (pthread_once(&g_bell_once, bell_init) != 0 || !g_bell_ok || !rq->active) return;
  const xrec *r = rec_of(rq);
  struct timespec until;
  if (clock_gettime(CLOCK_MONOTONIC, &until) != 0) return;
  until.tv_nsec += (long)us * 1000L;
  until.tv_sec += until.tv_nsec / 1000000000L;
  until.tv_nsec %= 1000000000L;
  atomic_fetch_add(&g_bell_sleepers, 1);
  pthread_mutex_lock(&g_bell_mu);
  int rc = 0;
  while (rc == 0 && atomic_load(&r->state) == REC_PENDING)
    rc = pthread_cond_timedwait(&g_bell_cv, &g_bell_mu, &until);
  pthread_mutex_unlock(&g_bell_mu);
  atomic_fetch_sub(&g_bell_sleepers, 1);
}

static const sg__xport_ops xport_ops = {"xport", x_isend, x_irecv, x_test, x_abandon, NULL, NULL,
                                        1 /* release_rx: the per-byte cost hides the faults */,
                                        x_block};

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
  atomic_store(&r->state, error ? REC_FAILED : REC_DONE); /* r may be freed from here on */
  bell_ring();
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

static sg_status x_reduce_scatter_fold(sg_comm *c, void *buf, size_t count, int dtype,
                                       const sg__fold *f, int64_t dl) {
  if (c)
    sg__comm_count(c, SG__COUNT_REDUCE_SCATTER,
                   (size_t)c->world * count * sg__comm_elem_bytes(dtype), -1);
  return sg__coll_reduce_scatter_fold(&xc(c)->coll, buf, count, dtype, f, dl);
}

static sg_status x_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  return sg__coll_all_gather(&xc(c)->coll, buf, bytes, dl);
}

static sg_status x_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_BROADCAST, bytes, root);
  return sg__coll_broadcast(&xc(c)->coll, buf, bytes, root, dl);
}

static sg_status x_all_to_all(sg_comm *c, const void *send, void *recv, size_t bytes,
                              int64_t dl) {
  if (c) sg__comm_count(c, SG__COUNT_ALL_GATHER, (size_t)c->world * bytes, -1);
  return sg__coll_all_to_all(&xc(c)->coll, send, recv, bytes, dl);
}

/* ---- lifetime ------------------------------------------------------------------------------- */

static void fam_lock(xfam *f) { pthread_mutex_lock(&f->mu); }
static void fam_unlock(xfam *f) { pthread_mutex_unlock(&f->mu); }

/* The channel's tag slot back to its communicator. */
static void give_slot(xcomm *chan) {
  xcomm *base = xc(chan->c.parent);
  const unsigned slot =
      ((unsigned)chan->tag_base >> SG__XPORT_CALL_BITS) & (SG__XPORT_SLOTS - 1u);
  fam_lock(base->fam);
  base->slots[slot / 64] &= ~(1ull << (slot % 64));
  fam_unlock(base->fam);
}

static void x_unbind(sg_comm *chan) {
  if (chan->dev) chan->dev->ops->comm_detach(chan->dev);
  give_slot(xc(chan));
  sg__coll_free(&xc(chan)->coll);
  free(chan);
}

/* The family's last communicator takes the transport with it. */
static void x_destroy(sg_comm *c) {
  xcomm *x = xc(c);
  xfam *f = x->fam;
  fam_lock(f);
  f->ctx_used &= ~(1ull << x->ctx);
  const int last = --f->refs == 0;
  fam_unlock(f);
  sg__coll_free(&x->coll);
  free(x->peer);
  free(x);
  if (!last) return;
  pthread_mutex_destroy(&f->mu);
  if (f->t.release) f->t.release(f->t.user);
  free(f);
}

static sg_status x_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                        sg_comm **chan);

static sg_status x_split(sg_comm *chan, const int *colors, const int *keys, int64_t dl,
                         sg_comm **out);

/* Node leaders from host names. */
static const sg__comm_ops xcomm_ops = {
    "xport", x_all_reduce, x_reduce_scatter, x_all_gather, x_broadcast,
    x_bind,  x_unbind,     x_destroy,        x_split,      NULL,
    x_reduce_scatter_fold, x_all_to_all,
    NULL, /* reduce_scatter_to: the engine's fold (reduce_scatter_fold) serves host memory */
    0 /* all_to_all_device: host memory only */,
};

/* The algorithms' state for x, named after the transport in messages. */
static sg_status coll_init(xcomm *x) {
  SG_TRY(sg__coll_init(&x->coll, &x->c, &xport_ops, x, (1 << SG__XPORT_CALL_BITS) - 1));
  static const char *const ops[] = {"", "all_reduce", "reduce_scatter", "all_gather",
                                    "broadcast", "all_to_all"};
  for (int op = 1; op <= 5; op++)
    snprintf(x->coll.fn[op], sizeof x->coll.fn[op], "sg_comm(%s) %s", x->name, ops[op]);
  return SG_OK;
}

/* The channel's slot, unless a live channel of c holds it (a channel made SG__XPORT_SLOTS
 * binds earlier and still alive would share its tags). */
static sg_status take_slot(xcomm *base, uint64_t index, int *tag_base) {
  const unsigned slot = (unsigned)(index % SG__XPORT_SLOTS);
  const uint64_t bit = 1ull << (slot % 64);
  fam_lock(base->fam);
  const int held = (base->slots[slot / 64] & bit) != 0;
  if (!held) base->slots[slot / 64] |= bit;
  fam_unlock(base->fam);
  if (held)
    return sg__err(SG_ERR_UNSUPPORTED,
                   "sg_comm(%s) bind: channel %llu would share the tags of channel %llu, which "
                   "is still alive (a transport communicator keeps at most %u channels apart; "
                   "destroy older engines first)",
                   base->name, (unsigned long long)index,
                   (unsigned long long)(index - SG__XPORT_SLOTS), SG__XPORT_SLOTS);
  *tag_base = (base->ctx << (SG__XPORT_SLOT_BITS + SG__XPORT_CALL_BITS)) |
              (int)(slot << SG__XPORT_CALL_BITS);
  return SG_OK;
}

static sg_status x_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                        sg_comm **chan) {
  xcomm *base = xc(c);
  xcomm *x = calloc(1, sizeof *x);
  if (!x) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(%s) bind: out of memory", base->name);
  sg__comm_channel_init(&x->c, c, &xcomm_ops, dev, x);
  x->fam = base->fam;
  x->peer = base->peer;
  x->ctx = base->ctx;
  memcpy(x->name, base->name, sizeof x->name);
  sg_status st = SG_OK;
  if (sg__stage_needed(&x->c))
    st = sg__err(SG_ERR_UNSUPPORTED,
                 "sg_comm(%s): buffers on a GPU are not supported by a transport communicator "
                 "(use an NCCL communicator, e.g. Comm.from_torch on an NCCL process group)",
                 x->name);
  if (st == SG_OK) st = take_slot(base, index, &x->tag_base);
  if (st != SG_OK) {
    free(x);
    return st;
  }
  st = coll_init(x);
  if (st == SG_OK && dev) {
    /* host-driven, on the device's worker where the transport allows any thread */
    const sg__comm_attach a = {0, c->threaded, NULL, NULL, NULL, timeout_ms};
    sg__comm_native native;
    st = dev->ops->comm_attach(dev, &a, &native);
  }
  if (st != SG_OK) {
    give_slot(x);
    sg__coll_free(&x->coll);
    free(x);
    return st;
  }
  *chan = &x->c;
  return SG_OK;
}

/* A communicator of family f with context ctx (already marked used) and rank map peer (owned;
 * NULL: the transport's ranks). On failure peer is freed and ctx given back. */
static sg_status new_comm(xfam *f, int rank, int world, int ctx, int *peer, const char *name,
                          sg_comm **out) {
  xcomm *x = calloc(1, sizeof *x);
  sg_status st = x ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(%s): out of memory", name);
  if (st == SG_OK) {
    x->c.ops = &xcomm_ops;
    x->c.impl = x;
    x->c.rank = rank;
    x->c.world = world;
    x->c.threaded = f->t.threaded != 0;
    x->fam = f;
    x->peer = peer;
    x->ctx = ctx;
    memcpy(x->name, name, strlen(name) + 1);
    st = coll_init(x);
  }
  if (st != SG_OK) {
    free(x);
    free(peer);
    fam_lock(f);
    f->ctx_used &= ~(1ull << ctx);
    fam_unlock(f);
    return st;
  }
  fam_lock(f);
  f->refs++;
  fam_unlock(f);
  *out = &x->c;
  return SG_OK;
}

/* ---- sg_comm_split -------------------------------------------------------------------------- */

/* This rank's offer in the context agreement: the contexts free on its process, or a split of
 * another member of the family running on it right now (its offer would race that one's). */
typedef struct offer {
  uint64_t free_ctx;
  uint64_t busy;
} offer;

/* The context every rank of a color can use: the lowest free on all ranks taking part (colors
 * are disjoint, so one context serves all of them). Every rank reaches the same verdict from
 * the same table; a failure leaves chan as it was. */
static sg_status agree_ctx(const sg_comm *chan, const offer *tab, const int *colors, int *ctx) {
  static const char fn[] = "sg_comm_split(xport)";
  uint64_t common = ~0ull;
  for (int r = 0; r < chan->world; r++) {
    if (colors[r] < 0) continue;
    if (tab[r].busy)
      return sg__err(SG_ERR_INVALID_STATE,
                     "%s: rank %d was splitting another communicator over the same transport "
                     "at the same time (splits of one transport's communicators run one at a "
                     "time per process)",
                     fn, r);
    common &= tab[r].free_ctx;
  }
  if (!common)
    return sg__err(SG_ERR_UNSUPPORTED,
                   "%s: no tag context is free on every rank (at most %u communicators over one "
                   "transport may be alive on a process; destroy unused splits)",
                   fn, SG__XPORT_CTXS);
  int k = 0;
  while (!(common & (1ull << k))) k++;
  *ctx = k;
  return SG_OK;
}

/* The transport ranks of this rank's new communicator, in its rank order. */
static int *child_peers(const xcomm *x, const int *colors, const int *keys, int world, int size) {
  int *peer = calloc((size_t)size, sizeof *peer);
  if (!peer) return NULL;
  const int me = x->c.rank;
  for (int s = 0, n = 0; s < world; s++) {
    if (colors[s] != colors[me]) continue;
    const int nr = sg__comm_split_rank(colors, keys, world, s, &n);
    peer[nr] = x->peer ? x->peer[s] : s;
  }
  return peer;
}

/* Every rank has arrived (sg_comm_split gathered the colors over chan). One all-gather of the
 * offers, then each member makes its part of the new communicator: same family, the agreed
 * context, its rank map. Collective over chan. */
static sg_status x_split(sg_comm *chan, const int *colors, const int *keys, int64_t dl,
                         sg_comm **out) {
  static const char fn[] = "sg_comm_split(xport)";
  xcomm *x = xc(chan);
  xfam *f = x->fam;
  const int world = chan->world, me = chan->rank;
  offer *tab = calloc((size_t)world, sizeof *tab);
  if (!tab) return sg__comm_fail(chan, SG_ERR_OUT_OF_MEMORY, fn, "out of memory (world %d)", world);
  fam_lock(f);
  const int busy = f->splitting;
  f->splitting = 1;
  tab[me].free_ctx = busy ? 0 : ~f->ctx_used;
  fam_unlock(f);
  tab[me].busy = (uint64_t)busy;
  sg_status st = chan->ops->all_gather(chan, tab, sizeof *tab, dl);
  int ctx = -1, size = 0;
  const int nr = sg__comm_split_rank(colors, keys, world, me, &size);
  if (st == SG_OK) st = agree_ctx(chan, tab, colors, &ctx);
  if (st == SG_OK && nr >= 0) {
    fam_lock(f);
    f->ctx_used |= 1ull << ctx;
    fam_unlock(f);
    int *peer = child_peers(x, colors, keys, world, size);
    st = peer ? new_comm(f, nr, size, ctx, peer, x->name, out)
              : sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory (%d ranks)", fn, size);
    if (st != SG_OK) chan->broken = 1; /* the other members have theirs: out of step */
  }
  if (!busy) {
    fam_lock(f);
    f->splitting = 0;
    fam_unlock(f);
  }
  free(tab);
  return st;
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
  xfam *f = calloc(1, sizeof *f);
  if (!f || pthread_mutex_init(&f->mu, NULL) != 0) {
    free(f);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  f->t = *t;
  f->t.release = NULL; /* until the communicator exists: a failure here releases nothing */
  f->ctx_used = 1u;    /* context 0: this communicator */
  sg_comm *c = NULL;
  const sg_status st = new_comm(f, rank, world, 0, NULL, name, &c);
  if (st != SG_OK) {
    pthread_mutex_destroy(&f->mu);
    free(f);
    return sg__err_prefix(st, fn);
  }
  f->t.release = t->release;
  SG_LOG(SG_LOG_DEBUG, rank, "%s: rank %d of %d over '%s'%s", fn, rank, world, name,
         c->threaded ? "" : " (calling thread only)");
  *out = c;
  return SG_OK;
}
