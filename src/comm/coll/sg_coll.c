/* Collective algorithms over a point-to-point transport (sg_coll.h).
 *
 * Direct reduce-scatter: every rank sends slice k of its buffer to rank k and receives every
 * peer's values of its own slice, in pieces of at most SG__COLL_RS_PIECE bytes: two pieces per
 * peer are in flight (the next one arrives while the current one is summed) and sends run a
 * few pieces ahead of the sum. The pieces land in our receive buffers (piece size shrinks with
 * W so that they always fit). Each element is summed over ranks 0..W-1 in fp32 (f64: f64) and
 * rounded once to the dtype, like the local communicator: the result does not depend on
 * arrival order. No rank waits on a forwarded partial, which is what made the ring slow with
 * ranks sharing cores (a chain of W-1 dependent waits).
 *
 * Ring reduce-scatter: chunk q is summed around the ring starting at rank q+1 and ending at its
 * owner q, each chunk cut into pieces of at most SG__COLL_PIECE bytes so that the transfer of
 * one piece overlaps the add of the previous one. f32 and f64 partials travel and are stored in
 * the buffer's own type (the buffer slice of a chunk is no longer needed once its contribution
 * is added). For bf16 and f16 the first hop sends the raw values; later hops send fp32 partials
 * held in c->scratch, so the sum is computed in fp32 and rounded once, at the owner. That
 * doubles the bytes of those hops; with W = 2 there are none.
 *
 * Both orders are fixed, so results are deterministic and all-reduce gives the same bits on
 * every rank (they differ between the two algorithms only for three or more ranks).
 *
 * All-gather (and the second half of all-reduce) is direct by default: every rank posts its
 * slice to every peer at once. It moves the same bytes per rank as a ring without the chain of
 * forwards, and measured >= MPI_Allgather here, where the ring fell behind with ranks sharing
 * cores. Wire data is bytes (MPI has no bf16). */
#define _POSIX_C_SOURCE 200809L /* sched_yield, nanosleep */
#define _DEFAULT_SOURCE         /* MAP_ANONYMOUS, madvise */

#include "sg_coll.h"

#include <sched.h>  /* sched_yield */
#include <stdint.h> /* SIZE_MAX, INT32_MAX */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* malloc, realloc, free */
#include <string.h> /* memcpy, memset, strcmp */
#include <time.h>   /* nanosleep */
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h> /* mmap, madvise, munmap: receive buffers that leave RSS when idle */
#endif

#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_reduce_add, _accumulate, _cast */

#ifndef SG__COLL_PIECE
#define SG__COLL_PIECE ((size_t)1 << 20) /* bytes of one message of a reduction (fp32 partials) */
#endif
#ifndef SG__COLL_AG_PIECE
#define SG__COLL_AG_PIECE ((size_t)4 << 20) /* bytes of one message of all_gather (copy only) */
#endif
#ifndef SG__COLL_DIRECT_PIECE
#define SG__COLL_DIRECT_PIECE ((size_t)1 << 30) /* bytes of one message of a direct all-gather */
#endif
#ifndef SG__COLL_RS_PIECE
#define SG__COLL_RS_PIECE ((size_t)256 << 10) /* most bytes of one message of a direct reduce */
#endif
#ifndef SG__COLL_SENDS_AHEAD
#define SG__COLL_SENDS_AHEAD 3 /* pieces a direct reduce-scatter sends before summing its first */
#endif
#ifndef SG__COLL_NRX
#define SG__COLL_NRX 4 /* receives in flight per reduction */
#endif
#define SG__COLL_SPIN_US 20.0    /* a wait polls flat out this long, */
#define SG__COLL_YIELD_US 100.0  /* then with a yield between polls until this long, */
#define SG__COLL_NAP_MIN_US 8u   /* then sleeps, first this long, */
#define SG__COLL_NAP_MAX_US 128u /* doubling up to this: a message waits at most this past its arrival */
#define SG__COLL_BLOCK_US 2000u  /* one blocking sleep of a transport that signals completion */

enum { OP_ALL_REDUCE = 1, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST, OP_ALL_TO_ALL };
enum { AG_DIRECT = 0, AG_RING, AG_NATIVE };
enum { RS_DIRECT = 0, RS_RING };

static size_t elem_size(int dtype) { return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : 2u; }

/* bf16/f16 reductions keep fp32 partials (rounded once at the end); f32 and f64 are their own
 * accumulation type. */
static int is_wide(int dtype) { return dtype == SG_BF16 || dtype == SG_F16; }

/* A transport failure (its text is set): the communicator is broken. */
static sg_status xfail(sg_comm *c, const char *fn, sg_status st) {
  c->broken = 1;
  SG_LOG(SG_LOG_INFO, c->rank, "%s: %s (communicator now broken)", fn, sg_last_error());
  return sg__err_prefix(st, fn);
}

static int grow(void **p, size_t *cap, size_t n, size_t es) {
  if (n <= *cap) return 1;
  void *q = realloc(*p, n * es);
  if (!q) return 0;
  *p = q;
  *cap = n;
  return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* Receive buffers                                                                           */

/* Touched once, a channel's receive buffers (4 MiB) stay resident for good, yet they are only
 * needed while a reduction runs, and the engine's peak comes while it reduces buckets, mostly
 * outside those reductions' receives. Where the transport asks for it (xport: torch's gloo
 * through Python, whose per-byte cost hides the faults) they are an anonymous mapping of
 * their own whose pages are given back after every reduction (1-2 MiB less peak RSS per rank
 * in bench/torch_side_by_side.py). The next reduction then faults in fresh zeroed pages:
 * about 0.4 ms per MiB received here, as much as a shared-memory MPI transfer, so MPI keeps
 * them resident. Huge pages would make the faults cheap but make 2 MiB resident at a
 * reduction's first byte, and measured no gain. Without mmap: malloc, kept resident. */
#if defined(MAP_ANONYMOUS) && defined(MADV_DONTNEED)
#define SG__COLL_RX_MAP 1
#else
#define SG__COLL_RX_MAP 0
#endif

static int release_wanted(const sg__xport_ops *xp) {
  return (int)sg__env_value(SG_ENV_COMM_RX_RELEASE, xp->release_rx);
}

static unsigned char *rx_alloc(sg__coll *k, size_t bytes) {
#if SG__COLL_RX_MAP
  if (release_wanted(k->xp)) {
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
      k->rx_mapped = 1;
      return m;
    }
  }
#endif
  return malloc(bytes);
}

/* After a reduction: no receive of this channel is pending (or rx_lost is set), so the pages
 * can go. A failed madvise keeps them. */
static void rx_release(sg__coll *k) {
#if SG__COLL_RX_MAP
  if (k->rx_mapped && !k->rx_lost)
    (void)madvise(k->rx, SG__COLL_NRX * SG__COLL_PIECE, MADV_DONTNEED);
#else
  (void)k;
#endif
}

static void rx_free(sg__coll *k) {
  if (k->rx_lost || !k->rx) return; /* a receive may still write it */
#if SG__COLL_RX_MAP
  if (k->rx_mapped) {
    (void)munmap(k->rx, SG__COLL_NRX * SG__COLL_PIECE);
    return;
  }
#endif
  free(k->rx);
}

/* ---------------------------------------------------------------------------------------- */
/* Requests: polling with a deadline, and clean-up after a failure                           */

/* After a failure: the transport releases the sends and cancels the receives. One that cannot
 * be stopped may still write its buffer: internal receive buffers are then never freed. The
 * peer is broken too (or will time out), and the tags differ per call, so nobody consumes those
 * messages later. */
static void abort_requests(sg__coll *k, sg__xreq *recvs, size_t nrecv, int into_rx, size_t nsend) {
  if (k->xp->abandon(k->tp, k->sends, nsend, recvs, nrecv) && into_rx) k->rx_lost = 1;
}

static sg_status timed_out(sg_comm *c, const char *fn, const char *what) {
  return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                       "deadline passed while waiting for %s (rank %d of %d; a peer is late, "
                       "gone, or called a different collective)",
                       what, c->rank, c->world);
}

/* A wait's progress from spinning to sleeping. */
typedef struct backoff {
  double t0_us; /* when the wait began (0: not yet read) */
  unsigned nap_us;
} backoff;

/* Between two polls: spin first (a yield on a busy machine can cost a whole time slice, which
 * ruins small messages), then yield a while so that ranks sharing a core let the peer they
 * wait for run, then sleep. A yielding thread stays runnable and the scheduler still gives it
 * its share of the core: with ranks (and their comm workers) sharing cores, every waiter
 * spinning on yields took CPU from the backward passes the messages wait for. The phases are
 * timed, not counted: one MPI poll over TCP is a poll() system call, and 2000 of them before
 * the first yield cost milliseconds per message. A transport that signals completion (block)
 * wakes the sleeper when rq is done; the others (MPI, which only progresses inside its calls)
 * are polled again after 8, 16, ... up to 128 microseconds, short against a socket's buffer at
 * 10 Gbit/s and against any piece of a reduction. */
static void idle(const sg__coll *k, sg__xreq *rq, backoff *b) {
  const double now = sg__now_us();
  if (b->t0_us == 0.0) b->t0_us = now;
  const double waited = now - b->t0_us;
  if (waited < SG__COLL_SPIN_US) return;
  if (!k->nap || waited < SG__COLL_YIELD_US) {
    sched_yield();
    return;
  }
  if (k->xp->block && rq) {
    k->xp->block(k->tp, rq, SG__COLL_BLOCK_US);
    return;
  }
  b->nap_us = b->nap_us == 0                          ? SG__COLL_NAP_MIN_US
              : b->nap_us >= SG__COLL_NAP_MAX_US / 2u ? SG__COLL_NAP_MAX_US
                                                      : 2u * b->nap_us;
  struct timespec ts = {0, (long)b->nap_us * 1000L};
  (void)nanosleep(&ts, NULL);
}

/* Polls one request until it completes or the deadline passes. expect >= 0: the received byte
 * count must match (a peer that called with another count is a mismatch, not data). */
static sg_status wait_one(sg__coll *k, const char *fn, sg__xreq *rq, long long expect,
                          int64_t deadline_ms) {
  sg_comm *c = k->c;
  int done = 0;
  size_t got = 0;
  backoff b = {0.0, 0};
  while (rq->active) {
    const sg_status st = k->xp->test(k->tp, rq, &done, &got);
    if (st != SG_OK) return xfail(c, fn, st);
    if (done) break;
    if (sg__now_ms() > deadline_ms) return timed_out(c, fn, expect >= 0 ? "a message" : "a send");
    idle(k, rq, &b);
  }
  if (expect >= 0 && (long long)got != expect)
    return sg__comm_fail(c, SG_ERR_COMM, fn,
                         "received %zu bytes where %lld were expected (ranks called "
                         "mismatched collectives?)",
                         got, expect);
  return SG_OK;
}

static sg_status wait_all(sg__coll *k, const char *fn, sg__xreq *rq, size_t n,
                          int64_t deadline_ms) {
  for (size_t i = 0; i < n; i++) SG_TRY(wait_one(k, fn, &rq[i], -1, deadline_ms));
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Ring layout                                                                               */

typedef struct ring {
  sg__coll *k;
  sg_comm *c;
  const char *fn;
  unsigned char *buf;
  int dtype;    /* element dtype; -1: bytes (all_gather) */
  size_t es;    /* bytes per element in buf */
  size_t count; /* reduce-scatter / all-gather: per rank; all-reduce: total */
  int split;    /* 1: chunks split `count` near-equally (all-reduce); 0: `count` each */
  size_t pe;    /* elements per piece */
  int tag;
  int64_t deadline_ms;
  const sg__fold *fold; /* reduce_scatter_fold: this rank's sums go there, not into buf */
} ring;

static void chunk(const ring *R, int k, size_t *off, size_t *len) {
  const size_t kk = (size_t)k, w = (size_t)R->c->world;
  if (!R->split) {
    *off = kk * R->count;
    *len = R->count;
    return;
  }
  const size_t base = R->count / w, rem = R->count % w;
  *off = kk * base + (kk < rem ? kk : rem);
  *len = base + (kk < rem ? 1u : 0u);
}

static size_t npieces(size_t len, size_t pe) { return (len + pe - 1) / pe; }

static int mod(int a, int w) { return ((a % w) + w) % w; }

/* Piece j of chunk k: element offset within buf and element count. */
static void piece(const ring *R, int k, size_t j, size_t *off, size_t *len) {
  size_t coff, clen;
  chunk(R, k, &coff, &clen);
  const size_t start = j * R->pe;
  *off = coff + start;
  *len = clen - start < R->pe ? clen - start : R->pe;
}

/* Item cursor over (step, piece) in the order messages flow between neighbours. */
typedef struct cursor {
  int step, k; /* k: chunk handled at this step */
  size_t j, np;
} cursor;

/* Moves the cursor to the next item that exists (chunks may be empty or shorter). At step s
 * rank r receives chunk (r-shift-s): shift 2 for reduce-scatter, 1 for all-gather. Returns 0
 * after the last step. */
static int cursor_seek(const ring *R, cursor *cu, int shift) {
  const int w = R->c->world, r = R->c->rank;
  while (cu->step < w - 1) {
    cu->k = mod(r - shift - cu->step, w);
    size_t off, len;
    chunk(R, cu->k, &off, &len);
    cu->np = npieces(len, R->pe);
    if (cu->j < cu->np) return 1;
    cu->step++;
    cu->j = 0;
  }
  return 0;
}

static int cursor_next(const ring *R, cursor *cu, int shift) {
  cu->j++;
  return cursor_seek(R, cu, shift);
}

static sg_status send_to(const ring *R, const void *p, size_t bytes, int peer, sg__xreq *rq) {
  const sg_status st = R->k->xp->isend(R->k->tp, p, bytes, peer, R->tag, rq);
  return st == SG_OK ? SG_OK : xfail(R->c, R->fn, st);
}

static sg_status recv_from(const ring *R, void *p, size_t bytes, int peer, sg__xreq *rq) {
  const sg_status st = R->k->xp->irecv(R->k->tp, p, bytes, peer, R->tag, rq);
  return st == SG_OK ? SG_OK : xfail(R->c, R->fn, st);
}

static sg_status isend(const ring *R, const void *p, size_t bytes, sg__xreq *rq) {
  return send_to(R, p, bytes, mod(R->c->rank + 1, R->c->world), rq);
}

static sg_status irecv(const ring *R, void *p, size_t bytes, sg__xreq *rq) {
  return recv_from(R, p, bytes, mod(R->c->rank - 1, R->c->world), rq);
}

/* Sends every piece of chunk k from buf (the first step of both rings). */
static sg_status send_chunk(const ring *R, int k, size_t *nsend) {
  size_t off, len;
  chunk(R, k, &off, &len);
  sg__coll *m = R->k;
  for (size_t j = 0; j < npieces(len, R->pe); j++) {
    size_t po, pl;
    piece(R, k, j, &po, &pl);
    SG_TRY(isend(R, R->buf + po * R->es, pl * R->es, &m->sends[(*nsend)++]));
  }
  return SG_OK;
}

/* Upper bound of messages a rank sends (or receives) in one ring pass. */
static size_t max_items(const ring *R) {
  size_t off, len;
  chunk(R, 0, &off, &len); /* chunk 0 is the longest */
  return (size_t)R->c->world * (npieces(len, R->pe) + 1);
}

/* ---------------------------------------------------------------------------------------- */
/* Ring reduce-scatter                                                                       */

/* Bytes of the message received (or sent) at a step: raw values first, then partials. */
static size_t msg_bytes(const ring *R, int step, size_t len) {
  return (is_wide(R->dtype) && step > 0 ? 4u : R->es) * len;
}

/* dst[i] += src[i] for f32 and f64: the same single IEEE add as sg__cpu_reduce_add, but as a
 * plain loop that the compiler vectorizes; the tiled kernel (built for the 16-bit types) is
 * about 2x slower here, and this add is half of a reduce-scatter's time. */
static void add_native(void *dst, const void *src, int dtype, size_t n) {
  if (dtype == SG_F32) {
    float *restrict d = dst;
    const float *restrict s = src;
    for (size_t i = 0; i < n; i++) d[i] = d[i] + s[i];
  } else {
    double *restrict d = dst;
    const double *restrict s = src;
    for (size_t i = 0; i < n; i++) d[i] = d[i] + s[i];
  }
}

/* Elements [po, po + pl) of this rank's chunk, summed over srcs (in their order, source k in
 * dts[k]; NULL: all in the call's dtype), folded into their place in the accumulator. */
static void fold_sum(const ring *R, size_t po, size_t pl, const void *const *srcs, const int *dts,
                     int nsrc) {
  size_t off, len;
  chunk(R, R->c->rank, &off, &len);
  const sg__fold *f = R->fold;
  unsigned char *acc = (unsigned char *)f->acc + (po - off) * elem_size(f->acc_dtype);
  sg__cpu_reduce_fold(acc, f->acc_dtype, srcs, dts, nsrc, R->dtype, pl, f->first);
}

/* The last hop of the ring with a fold: the sum consume would store over our piece, folded
 * instead (after the first hop of bf16/f16 rx holds an fp32 partial, which comes first). */
static void fold_last(const ring *R, int step, size_t po, size_t pl, const void *own,
                      const void *rx) {
  const int partial = is_wide(R->dtype) && step > 0;
  const void *srcs[2] = {partial ? rx : own, partial ? own : rx};
  const int dts[2] = {partial ? SG_F32 : R->dtype, R->dtype};
  fold_sum(R, po, pl, srcs, dts, 2);
}

/* Combines the partial that arrived in rx with this rank's piece. */
static sg_status consume(const ring *R, const cursor *cu, const void *rx, size_t *nsend) {
  sg__coll *m = R->k;
  const int last = cu->step == R->c->world - 2;
  size_t po, pl;
  piece(R, cu->k, cu->j, &po, &pl);
  unsigned char *own = R->buf + po * R->es;
  if (last && R->fold) {
    fold_last(R, cu->step, po, pl, own, rx);
    return SG_OK;
  }
  if (!is_wide(R->dtype)) {
    add_native(own, rx, R->dtype, pl); /* partial stored in place of our slice */
    return last ? SG_OK : isend(R, own, pl * R->es, &m->sends[(*nsend)++]);
  }
  if (last && cu->step == 0) {
    sg__cpu_reduce_add(own, rx, R->dtype, pl); /* W = 2: two raw values, rounded once */
    return SG_OK;
  }
  const int rx_dtype = cu->step == 0 ? R->dtype : SG_F32;
  if (last) {
    sg__cpu_accumulate((void *)rx, SG_F32, own, R->dtype, pl); /* fp32 total */
    sg__cpu_cast(own, R->dtype, rx, SG_F32, pl);               /* the one rounding */
    return SG_OK;
  }
  /* the fp32 partial goes to slot j of scratch, once the previous send from that slot is done */
  float *slot = (float *)R->c->scratch + cu->j * R->pe;
  if (m->slot_send[cu->j] != SIZE_MAX)
    SG_TRY(wait_one(R->k, R->fn, &m->sends[m->slot_send[cu->j]], -1, R->deadline_ms));
  sg__cpu_cast(slot, SG_F32, own, R->dtype, pl);
  sg__cpu_accumulate(slot, SG_F32, rx, rx_dtype, pl);
  m->slot_send[cu->j] = *nsend;
  return isend(R, slot, pl * 4u, &m->sends[(*nsend)++]);
}

static sg_status post_rx(const ring *R, cursor *post, int *more, size_t i, sg__xreq *rq) {
  sg__coll *m = R->k;
  size_t po, pl;
  if (!*more) return SG_OK;
  piece(R, post->k, post->j, &po, &pl);
  SG_TRY(irecv(R, m->rx + (i % SG__COLL_NRX) * SG__COLL_PIECE, msg_bytes(R, post->step, pl), rq));
  *more = cursor_next(R, post, 2);
  return SG_OK;
}

/* Rank r receives chunk (r-2-s) at step s from r-1, adds its own values and passes the sum to
 * r+1 at step s+1; after W-1 steps it holds the total of chunk r. */
static sg_status ring_reduce_scatter(const ring *R) {
  sg__coll *m = R->k;
  sg__xreq rx_req[SG__COLL_NRX];
  size_t nsend = 0;
  sg_status st = SG_OK;
  for (int i = 0; i < SG__COLL_NRX; i++) rx_req[i].active = 0;
  cursor cu = {0, 0, 0, 0}, post = {0, 0, 0, 0};
  int more = cursor_seek(R, &post, 2), have = cursor_seek(R, &cu, 2);
  for (int i = 0; i < SG__COLL_NRX; i++)
    SG_TRY_GOTO(post_rx(R, &post, &more, (size_t)i, &rx_req[i]), st, fail);
  SG_TRY_GOTO(send_chunk(R, mod(R->c->rank - 1, R->c->world), &nsend), st, fail);
  for (size_t i = 0; have; i++) {
    sg__xreq *rq = &rx_req[i % SG__COLL_NRX];
    size_t po, pl;
    piece(R, cu.k, cu.j, &po, &pl);
    SG_TRY_GOTO(wait_one(R->k, R->fn, rq, (long long)msg_bytes(R, cu.step, pl), R->deadline_ms), st,
                fail);
    SG_TRY_GOTO(consume(R, &cu, m->rx + (i % SG__COLL_NRX) * SG__COLL_PIECE, &nsend), st, fail);
    SG_TRY_GOTO(post_rx(R, &post, &more, i + SG__COLL_NRX, rq), st, fail);
    have = cursor_next(R, &cu, 2);
  }
  SG_TRY_GOTO(wait_all(R->k, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, rx_req, SG__COLL_NRX, 1, nsend);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Ring all-gather (in place)                                                                */

/* Rank r sends its chunk at step 0 and forwards chunk (r-1-s), received at step s, at step
 * s+1. Receives land in their final place, so all are posted at once. */
static sg_status ring_all_gather(const ring *R) {
  sg__coll *m = R->k;
  size_t nsend = 0, nrecv = 0;
  sg_status st = SG_OK;
  cursor cu = {0, 0, 0, 0};
  for (int more = cursor_seek(R, &cu, 1); more; more = cursor_next(R, &cu, 1)) {
    size_t po, pl;
    piece(R, cu.k, cu.j, &po, &pl);
    SG_TRY_GOTO(irecv(R, R->buf + po * R->es, pl * R->es, &m->recvs[nrecv++]), st, fail);
  }
  SG_TRY_GOTO(send_chunk(R, R->c->rank, &nsend), st, fail);
  cu = (cursor){0, 0, 0, 0};
  size_t i = 0;
  for (int more = cursor_seek(R, &cu, 1); more; more = cursor_next(R, &cu, 1), i++) {
    size_t po, pl;
    piece(R, cu.k, cu.j, &po, &pl);
    SG_TRY_GOTO(wait_one(R->k, R->fn, &m->recvs[i], (long long)(pl * R->es), R->deadline_ms), st,
                fail);
    if (cu.step < R->c->world - 2)
      SG_TRY_GOTO(isend(R, R->buf + po * R->es, pl * R->es, &m->sends[nsend++]), st, fail);
  }
  SG_TRY_GOTO(wait_all(R->k, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, m->recvs, nrecv, 0, nsend);
  return st;
}

/* Direct all-gather: every rank sends its slice to every other rank and receives theirs, all
 * posted at once (rank r talks to r+1, r+2, ... and hears r-1, r-2, ... so that the pairs stay
 * balanced). The same bytes per rank as the ring, without its chain of forwards, which stalls
 * when ranks share cores. */
static sg_status direct_all_gather(const ring *ring_layout) {
  /* nothing is forwarded, so nothing gains from small pieces: one message per peer, split
   * only where MPI's int count requires it */
  ring D = *ring_layout;
  const ring *R = &D;
  D.pe = SG__COLL_DIRECT_PIECE / D.es;
  sg__coll *m = R->k;
  const int w = R->c->world, r = R->c->rank;
  size_t nsend = 0, nrecv = 0, off, len;
  sg_status st = SG_OK;
  for (int d = 1; d < w; d++) {
    const int from = mod(r - d, w), to = mod(r + d, w);
    chunk(R, from, &off, &len);
    for (size_t j = 0; j < npieces(len, R->pe); j++) {
      size_t po, pl;
      piece(R, from, j, &po, &pl);
      SG_TRY_GOTO(recv_from(R, R->buf + po * R->es, pl * R->es, from, &m->recvs[nrecv++]), st,
                  fail);
    }
    chunk(R, r, &off, &len);
    for (size_t j = 0; j < npieces(len, R->pe); j++) {
      size_t po, pl;
      piece(R, r, j, &po, &pl);
      SG_TRY_GOTO(send_to(R, R->buf + po * R->es, pl * R->es, to, &m->sends[nsend++]), st, fail);
    }
  }
  SG_TRY_GOTO(wait_all(R->k, R->fn, m->recvs, nrecv, R->deadline_ms), st, fail);
  SG_TRY_GOTO(wait_all(R->k, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, m->recvs, nrecv, 0, nsend);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Direct reduce-scatter                                                                     */

#define SG__COLL_SUM_BLOCK 1024 /* elements summed per block: the fp32 partials stay in L1 */

/* Elements [b, b + m) of the sum in element type T, in k order, as plain loops over a block
 * (the compiler vectorizes them, unlike the tiled kernel). Written once for float and double:
 * C has no generics, and the two differ only in T. */
#define SG__COLL_SUM_BLOCK_FN(name, T)                                                    \
  static void name(void *dst, const void *const *src, int nsrc, size_t b, size_t m) {   \
    T acc[SG__COLL_SUM_BLOCK];                                                          \
    const T *s0 = (const T *)src[0] + b;                                                \
    for (size_t i = 0; i < m; i++) acc[i] = s0[i];                                      \
    for (int k = 1; k < nsrc; k++) {                                                    \
      const T *restrict sk = (const T *)src[k] + b;                                     \
      for (size_t i = 0; i < m; i++) acc[i] = acc[i] + sk[i];                           \
    }                                                                                   \
    memcpy((T *)dst + b, acc, m * sizeof *acc);                                         \
  }
SG__COLL_SUM_BLOCK_FN(sum_block_f32, float)
SG__COLL_SUM_BLOCK_FN(sum_block_f64, double)
#undef SG__COLL_SUM_BLOCK_FN

/* dst[i] = sum over k of src[k][i] in k order, rounded once to dtype (fp32 math; f64: f64).
 * dst may be one of the sources. f32 and f64 by blocks; bf16/f16 use the kernel the local
 * backend uses. */
static void sum_sources(void *dst, const void *const *src, int nsrc, int dtype, size_t n) {
  if (is_wide(dtype)) {
    sg__cpu_reduce_sum(dst, src, nsrc, dtype, n);
    return;
  }
  for (size_t b = 0; b < n; b += SG__COLL_SUM_BLOCK) {
    const size_t m = n - b < SG__COLL_SUM_BLOCK ? n - b : SG__COLL_SUM_BLOCK;
    if (dtype == SG_F32)
      sum_block_f32(dst, src, nsrc, b, m);
    else
      sum_block_f64(dst, src, nsrc, b, m);
  }
}

/* Elements per message: two pieces of every peer fit in our receive buffers. It depends only on
 * the call's arguments, so sender and receiver cut a chunk the same way. */
static size_t direct_piece(const ring *R) {
  const size_t peers = (size_t)R->c->world - 1, rx_bytes = SG__COLL_NRX * SG__COLL_PIECE;
  size_t pe = rx_bytes / (2u * peers * R->es);
  if (pe > SG__COLL_RS_PIECE / R->es) pe = SG__COLL_RS_PIECE / R->es;
  return pe > 0 ? pe : 1u;
}

/* The pieces land in our receive buffers, never in the engine's scratch: a receive that cannot
 * be cancelled after a failure then never writes into memory the engine has freed. */
static sg_status direct_region(const ring *R, unsigned char **region, int *into_rx) {
  const size_t need = 2u * ((size_t)R->c->world - 1) * R->pe * R->es;
  if (need > SG__COLL_NRX * SG__COLL_PIECE)
    return sg__err(SG_ERR_INTERNAL, "%s: direct pieces (%zu bytes) exceed the receive buffers",
                   R->fn, need);
  *into_rx = 1;
  *region = R->k->rx;
  return SG_OK;
}

/* Posts the receives of piece j of our chunk from every peer, into half j%2 of the region:
 * peer k's values go to slot k (k < rank) or k-1. */
static sg_status post_piece(const ring *R, unsigned char *region, size_t j) {
  sg__coll *m = R->k;
  const int w = R->c->world, r = R->c->rank;
  const size_t peers = (size_t)w - 1, half = j % 2u;
  size_t po, pl;
  piece(R, r, j, &po, &pl);
  for (int k = 0; k < w; k++) {
    if (k == r) continue;
    const size_t slot = (size_t)(k < r ? k : k - 1);
    unsigned char *dst = region + ((half * peers + slot) * R->pe) * R->es;
    SG_TRY(recv_from(R, dst, pl * R->es, k, &m->recvs[half * peers + slot]));
  }
  return SG_OK;
}

/* Sends piece j of chunk k to its owner k, for every peer whose chunk has a piece j (rank r
 * serves r+1, r+2, ... first, so that no rank is everybody's first target). Sends follow the
 * receiver's pace (see direct_reduce_scatter): posting every piece at once left hundreds of
 * unexpected rendezvous headers, each with an eagerly copied first fragment, and was slower
 * for large buffers. */
static sg_status post_sends(const ring *R, size_t j, size_t *nsend) {
  sg__coll *m = R->k;
  const int w = R->c->world, r = R->c->rank;
  for (int d = 1; d < w; d++) {
    const int to = mod(r + d, w);
    size_t off, len, po, pl;
    chunk(R, to, &off, &len);
    if (j >= npieces(len, R->pe)) continue;
    piece(R, to, j, &po, &pl);
    SG_TRY(send_to(R, R->buf + po * R->es, pl * R->es, to, &m->sends[(*nsend)++]));
  }
  return SG_OK;
}

/* Waits for piece j from every peer and writes the sum over ranks 0..W-1 (ours read from buf)
 * over our own values. */
static sg_status sum_piece(const ring *R, unsigned char *region, size_t j) {
  sg__coll *m = R->k;
  const int w = R->c->world, r = R->c->rank;
  const size_t peers = (size_t)w - 1, half = j % 2u;
  const void *src[64];
  const void **srcs = w <= 64 ? src : malloc((size_t)w * sizeof *srcs);
  if (!srcs) return sg__comm_fail(R->c, SG_ERR_OUT_OF_MEMORY, R->fn, "out of memory (%d)", w);
  size_t po, pl;
  piece(R, r, j, &po, &pl);
  sg_status st = SG_OK;
  for (int k = 0; k < w; k++) {
    if (k == r) {
      srcs[k] = R->buf + po * R->es;
      continue;
    }
    const size_t slot = (size_t)(k < r ? k : k - 1);
    srcs[k] = region + ((half * peers + slot) * R->pe) * R->es;
    st = wait_one(R->k, R->fn, &m->recvs[half * peers + slot], (long long)(pl * R->es),
                  R->deadline_ms);
    if (st != SG_OK) goto done;
  }
  if (R->fold)
    fold_sum(R, po, pl, srcs, NULL, w);
  else
    sum_sources(R->buf + po * R->es, srcs, w, R->dtype, pl);
done:
  if (srcs != src) free(srcs);
  return st;
}

/* Every rank sends chunk k straight to its owner k and sums what it receives for its own chunk
 * in rank order. Unlike the ring nothing waits for a forwarded partial, so ranks sharing cores
 * do not stall in a chain; the receives of piece j+1 are in flight while piece j is summed. */
static sg_status direct_reduce_scatter(const ring *R) {
  sg__coll *m = R->k;
  const size_t peers = (size_t)R->c->world - 1;
  size_t nsend = 0, off, len;
  unsigned char *region = NULL;
  int into_rx = 0;
  sg_status st = direct_region(R, &region, &into_rx);
  if (st != SG_OK) return st;
  chunk(R, R->c->rank, &off, &len);
  const size_t np = npieces(len, R->pe);
  chunk(R, 0, &off, &len);
  const size_t np_max = npieces(len, R->pe); /* chunk 0 is the longest */
  for (size_t j = 0; j < 2 && j < np; j++) SG_TRY_GOTO(post_piece(R, region, j), st, fail);
  /* piece j+SENDS_AHEAD goes out once piece j is summed: every rank runs a few pieces ahead
   * of its peers' receives, never the whole chunk */
  for (size_t j = 0; j < SG__COLL_SENDS_AHEAD; j++) SG_TRY_GOTO(post_sends(R, j, &nsend), st, fail);
  for (size_t j = 0; j < np; j++) {
    SG_TRY_GOTO(sum_piece(R, region, j), st, fail);
    if (j + 2 < np) SG_TRY_GOTO(post_piece(R, region, j + 2), st, fail);
    SG_TRY_GOTO(post_sends(R, j + SG__COLL_SENDS_AHEAD, &nsend), st, fail);
  }
  for (size_t j = np + SG__COLL_SENDS_AHEAD; j < np_max; j++) /* peers' longer chunks */
    SG_TRY_GOTO(post_sends(R, j, &nsend), st, fail);
  SG_TRY_GOTO(wait_all(R->k, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, m->recvs, 2 * peers, into_rx, nsend);
  return st;
}

/* Request arrays of a direct reduce-scatter: every piece of every peer's chunk is sent at once;
 * two pieces per peer are received at a time. */
static sg_status prepare_direct(ring *R) {
  sg__coll *m = R->k;
  R->pe = direct_piece(R);
  size_t off, len;
  chunk(R, 0, &off, &len);
  const size_t peers = (size_t)R->c->world - 1, nsend = peers * npieces(len, R->pe);
  if (!grow((void **)&m->sends, &m->cap_sends, nsend, sizeof(sg__xreq)) ||
      !grow((void **)&m->recvs, &m->cap_recvs, 2 * peers, sizeof(sg__xreq)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu requests", R->fn, nsend);
  for (size_t i = 0; i < nsend; i++) m->sends[i].active = 0;
  for (size_t i = 0; i < 2 * peers; i++) m->recvs[i].active = 0;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Collectives                                                                               */

/* Tag of a call: differs between calls, ops and sizes, so stray or mismatched messages never
 * match. Even for the first ring of a call, odd for the second. */
static int call_tag(sg__coll *m, int op, size_t count, int dtype) {
  uint64_t h = SG__HASH_INIT;
  const uint64_t v[4] = {m->seq++, (uint64_t)op, (uint64_t)count, (uint64_t)(dtype + 1)};
  h = sg__hash_bytes(h, v, sizeof v);
  const uint64_t half = (uint64_t)(m->tag_ub / 2);
  return (int)(h % half) * 2;
}

/* Request arrays and, for bf16/f16 with three or more ranks, fp32 scratch for the partials. */
static sg_status prepare(const ring *R, int reduce) {
  sg__coll *m = R->k;
  const size_t items = max_items(R);
  if (!grow((void **)&m->sends, &m->cap_sends, 2 * items, sizeof(sg__xreq)) ||
      !grow((void **)&m->recvs, &m->cap_recvs, items, sizeof(sg__xreq)) ||
      !grow((void **)&m->slot_send, &m->cap_slots, items, sizeof(size_t)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu requests", R->fn, items);
  for (size_t i = 0; i < 2 * items; i++) m->sends[i].active = 0;
  for (size_t i = 0; i < items; i++) m->recvs[i].active = 0;
  for (size_t i = 0; i < items; i++) m->slot_send[i] = SIZE_MAX; /* no send from the slot yet */
  if (reduce && is_wide(R->dtype) && R->c->world > 2) {
    size_t off, len;
    chunk(R, 0, &off, &len);
    if (!R->c->scratch || R->c->scratch_bytes < len * 4u)
      return sg__err(SG_ERR_INVALID_ARGUMENT,
                     "%s: scratch too small for fp32 partials (%zu bytes, need %zu)", R->fn,
                     R->c->scratch ? R->c->scratch_bytes : 0, len * 4u);
  }
  return SG_OK;
}

sg_status sg__coll_check(sg_comm *c, const char *fn, const void *buf, size_t count, int dtype,
                         size_t per_rank_mult) {
  SG_TRY(sg__comm_usable(c, fn));
  if (dtype >= 0 && !(sg__dtype_valid(dtype) || dtype == SG__F64))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown dtype (%d)", fn, dtype);
  const size_t es = dtype >= 0 ? elem_size(dtype) : 1u;
  if (count > SIZE_MAX / es / per_rank_mult)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: count too large (%zu)", fn, count);
  if (!buf && count > 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: buf is NULL (count %zu)", fn, count);
  return SG_OK;
}

static ring make_ring(sg__coll *k, const char *fn, void *buf, size_t count, int dtype, int split,
                      int64_t deadline_ms) {
  ring R;
  R.k = k;
  R.c = k->c;
  R.fn = fn;
  R.buf = (unsigned char *)buf;
  R.dtype = dtype;
  R.es = dtype >= 0 ? elem_size(dtype) : 1u;
  R.count = count;
  R.split = split;
  /* pieces sized by the widest message: fp32 partials (f64: f64); plain all-gathers only copy
   * and take bigger pieces (fewer handshakes) */
  R.pe = dtype >= 0 ? SG__COLL_PIECE / (dtype == SG__F64 ? 8u : 4u) : SG__COLL_AG_PIECE;
  R.tag = 0;
  R.deadline_ms = deadline_ms;
  R.fold = NULL;
  return R;
}

/* The reduction (reduce-scatter, or all-reduce's first half) by the channel's algorithm, on a
 * copy of R: the direct one sets its own piece size, and all-reduce's all-gather keeps the
 * ring's. Its receive buffers are given back once it is over, failed or not. */
static sg_status reduce(const ring *R) {
  ring D = *R;
  const int direct = R->k->rs_algo == RS_DIRECT;
  sg_status st = direct ? prepare_direct(&D) : prepare(&D, 1);
  if (st == SG_OK) st = direct ? direct_reduce_scatter(&D) : ring_reduce_scatter(&D);
  rx_release(R->k);
  return st;
}

/* Both reduce-scatters: the same messages (tag, bytes), so ranks may differ in whether they
 * fold (f); only what this rank does with its sums differs. */
static sg_status reduce_scatter(sg__coll *k, void *buf, size_t count, int dtype, const sg__fold *f,
                                int64_t deadline_ms) {
  const char *fn = k->fn[OP_REDUCE_SCATTER];
  sg_comm *c = k->c;
  SG_TRY(sg__coll_check(c, fn, buf, count, dtype, (size_t)c->world));
  if (f) SG_TRY(sg__comm_fold_check(fn, dtype, count, f));
  ring R = make_ring(k, fn, buf, count, dtype, 0, deadline_ms);
  R.tag = call_tag(k, OP_REDUCE_SCATTER, count, dtype);
  R.fold = f;
  if (count == 0) return SG_OK;
  if (c->world == 1) { /* the sum of one buffer is that buffer: folded as it is, if at all */
    const void *own = buf;
    if (f) fold_sum(&R, 0, count, &own, NULL, 1);
    return SG_OK;
  }
  return reduce(&R);
}

sg_status sg__coll_reduce_scatter(sg__coll *k, void *buf, size_t count, int dtype,
                                  int64_t deadline_ms) {
  return reduce_scatter(k, buf, count, dtype, NULL, deadline_ms);
}

sg_status sg__coll_reduce_scatter_fold(sg__coll *k, void *buf, size_t count, int dtype,
                                       const sg__fold *f, int64_t deadline_ms) {
  if (!f) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: no fold", k->fn[OP_REDUCE_SCATTER]);
  return reduce_scatter(k, buf, count, dtype, f, deadline_ms);
}

sg_status sg__coll_all_reduce(sg__coll *k, void *buf, size_t count, int dtype,
                              int64_t deadline_ms) {
  const char *fn = k->fn[OP_ALL_REDUCE];
  sg_comm *c = k->c;
  SG_TRY(sg__coll_check(c, fn, buf, count, dtype, 1));
  ring R = make_ring(k, fn, buf, count, dtype, 1, deadline_ms);
  R.tag = call_tag(k, OP_ALL_REDUCE, count, dtype);
  if (c->world == 1 || count == 0) return SG_OK;
  SG_TRY(reduce(&R));
  SG_TRY(prepare(&R, 0));
  R.tag += 1;
  return k->ag_algo == AG_RING ? ring_all_gather(&R) : direct_all_gather(&R);
}

/* Polls a native collective. It cannot be cancelled: on expiry it is left pending (the
 * communicator is broken and never freed, so the transport keeps a valid handle). */
static sg_status wait_native(sg__coll *k, const char *fn, const char *what, sg__xreq *rq,
                             int64_t deadline_ms) {
  int done = 0;
  size_t got = 0;
  for (backoff b = {0.0, 0};;) {
    const sg_status st = k->xp->test(k->tp, rq, &done, &got);
    if (st != SG_OK) return xfail(k->c, fn, st);
    if (done) return SG_OK;
    if (sg__now_ms() > deadline_ms) return timed_out(k->c, fn, what);
    idle(k, rq, &b);
  }
}

sg_status sg__coll_all_gather(sg__coll *k, void *buf, size_t bytes, int64_t deadline_ms) {
  const char *fn = k->fn[OP_ALL_GATHER];
  sg_comm *c = k->c;
  SG_TRY(sg__coll_check(c, fn, buf, bytes, -1, (size_t)c->world));
  ring R = make_ring(k, fn, buf, bytes, -1, 0, deadline_ms);
  R.tag = call_tag(k, OP_ALL_GATHER, bytes, -1);
  if (c->world == 1 || bytes == 0) return SG_OK;
  if (k->ag_algo != AG_NATIVE || !k->xp->iallgather || bytes > (size_t)INT32_MAX) {
    SG_TRY(prepare(&R, 0));
    return k->ag_algo == AG_RING ? ring_all_gather(&R) : direct_all_gather(&R);
  }
  sg__xreq rq = {{0, 0}, 0};
  const sg_status st = k->xp->iallgather(k->tp, buf, bytes, &rq);
  if (st != SG_OK) return xfail(c, fn, st);
  return wait_native(k, fn, "the native all-gather", &rq, deadline_ms);
}

/* Binomial tree from the root, in pieces of at most 1 GiB: in round r, ranks that have the
 * data (relative rank < 2^r) send it to relative rank + 2^r. */
static sg_status tree_broadcast(const ring *R, int root, size_t bytes) {
  sg__coll *k = R->k;
  const int w = R->c->world, me = mod(R->c->rank - root, w);
  const size_t piece_max = SG__COLL_DIRECT_PIECE;
  for (size_t off = 0; off < bytes; off += piece_max) {
    const size_t n = bytes - off < piece_max ? bytes - off : piece_max;
    unsigned char *p = R->buf + off;
    for (int step = 1; step < w; step <<= 1) {
      sg__xreq rq = {{0, 0}, 0};
      if (me >= step && me < 2 * step) {
        SG_TRY(recv_from(R, p, n, mod(me - step + root, w), &rq));
        SG_TRY(wait_one(k, R->fn, &rq, (long long)n, R->deadline_ms));
      } else if (me < step && me + step < w) {
        SG_TRY(send_to(R, p, n, mod(me + step + root, w), &rq));
        SG_TRY(wait_one(k, R->fn, &rq, -1, R->deadline_ms));
      }
    }
  }
  return SG_OK;
}

sg_status sg__coll_broadcast(sg__coll *k, void *buf, size_t bytes, int root, int64_t deadline_ms) {
  const char *fn = k->fn[OP_BROADCAST];
  sg_comm *c = k->c;
  SG_TRY(sg__coll_check(c, fn, buf, bytes, -1, 1));
  if (root < 0 || root >= c->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: root out of range (%d, world %d)", fn, root,
                   c->world);
  ring R = make_ring(k, fn, buf, bytes, -1, 0, deadline_ms);
  R.tag = call_tag(k, OP_BROADCAST, bytes, -1);
  if (c->world == 1 || bytes == 0) return SG_OK;
  if (!k->xp->ibcast) return tree_broadcast(&R, root, bytes);
  /* native counts may be int: parts of at most 1 GiB */
  for (size_t off = 0; off < bytes; off += SG__COLL_DIRECT_PIECE) {
    const size_t n = bytes - off < SG__COLL_DIRECT_PIECE ? bytes - off : SG__COLL_DIRECT_PIECE;
    sg__xreq rq = {{0, 0}, 0};
    const sg_status st = k->xp->ibcast(k->tp, (unsigned char *)buf + off, n, root, &rq);
    if (st != SG_OK) return xfail(c, fn, st);
    SG_TRY(wait_native(k, fn, "the native broadcast", &rq, deadline_ms));
  }
  return SG_OK;
}

/* Every rank posts slot `to` of send to each peer `to` and receives each peer's slot for it
 * into recv, all at once (r talks to r+1, r+2, ... and hears r-1, r-2, ..., as the direct
 * all-gather does), in pieces of at most SG__COLL_DIRECT_PIECE. */
static sg_status post_all_to_all(const ring *R, const unsigned char *send, unsigned char *recv,
                                 size_t *nsend, size_t *nrecv) {
  sg__coll *m = R->k;
  const int w = R->c->world, r = R->c->rank;
  const size_t b = R->count;
  for (int d = 1; d < w; d++) {
    const int from = mod(r - d, w), to = mod(r + d, w);
    for (size_t o = 0; o < b; o += SG__COLL_DIRECT_PIECE) {
      const size_t n = b - o < SG__COLL_DIRECT_PIECE ? b - o : SG__COLL_DIRECT_PIECE;
      SG_TRY(recv_from(R, recv + (size_t)from * b + o, n, from, &m->recvs[(*nrecv)++]));
      SG_TRY(send_to(R, send + (size_t)to * b + o, n, to, &m->sends[(*nsend)++]));
    }
  }
  return SG_OK;
}

sg_status sg__coll_all_to_all(sg__coll *k, const void *send, void *recv, size_t bytes,
                              int64_t deadline_ms) {
  const char *fn = k->fn[OP_ALL_TO_ALL];
  sg_comm *c = k->c;
  SG_TRY(sg__coll_check(c, fn, send, bytes, -1, (size_t)c->world));
  SG_TRY(sg__coll_check(c, fn, recv, bytes, -1, (size_t)c->world));
  ring R = make_ring(k, fn, recv, bytes, -1, 0, deadline_ms);
  R.tag = call_tag(k, OP_ALL_TO_ALL, bytes, -1);
  if (bytes == 0) return SG_OK;
  const size_t own = (size_t)c->rank * bytes;
  memcpy((unsigned char *)recv + own, (const unsigned char *)send + own, bytes);
  const size_t per = (bytes + SG__COLL_DIRECT_PIECE - 1) / SG__COLL_DIRECT_PIECE;
  const size_t nreq = (size_t)(c->world - 1) * per;
  if (!grow((void **)&k->sends, &k->cap_sends, nreq, sizeof(sg__xreq)) ||
      !grow((void **)&k->recvs, &k->cap_recvs, nreq, sizeof(sg__xreq)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu requests", fn, nreq);
  for (size_t i = 0; i < nreq; i++) k->sends[i].active = k->recvs[i].active = 0;
  size_t nsend = 0, nrecv = 0;
  sg_status st = post_all_to_all(&R, send, recv, &nsend, &nrecv);
  if (st == SG_OK) st = wait_all(k, fn, k->recvs, nrecv, deadline_ms);
  if (st == SG_OK) st = wait_all(k, fn, k->sends, nsend, deadline_ms);
  if (st != SG_OK) abort_requests(k, k->recvs, nrecv, 0, nsend);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Setup                                                                                     */

sg_status sg__coll_init(sg__coll *k, sg_comm *c, const sg__xport_ops *xp, void *tp, int tag_ub) {
  memset(k, 0, sizeof *k);
  k->c = c;
  k->xp = xp;
  k->tp = tp;
  k->tag_ub = tag_ub > 2 ? tag_ub : 32767;
  static const char *const names[] = {"", "all_reduce", "reduce_scatter", "all_gather",
                                      "broadcast", "all_to_all"};
  for (int op = OP_ALL_REDUCE; op <= OP_ALL_TO_ALL; op++)
    snprintf(k->fn[op], sizeof k->fn[op], "sg_comm(%s) %s", xp->name, names[op]);
  k->rx = rx_alloc(k, SG__COLL_NRX * SG__COLL_PIECE);
  if (!k->rx)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(%s): out of memory for receive buffers",
                   xp->name);
  /* SG_COLL_ALLGATHER=direct|ring|mpi overrides the measured default (bench/bench_comm.c) */
  static const int ag_algo[] = {AG_DIRECT, AG_RING, AG_NATIVE}; /* its words, in order */
  k->ag_algo = ag_algo[sg__env_value(SG_ENV_COLL_ALLGATHER, 0)];
  /* SG_COLL_REDUCE_SCATTER=direct|ring likewise (also all_reduce's reduction half); unset:
   * the ring for two ranks (one hop, bigger pieces: measured faster), direct from three */
  static const int rs_algo[] = {RS_DIRECT, RS_RING};
  k->rs_algo = rs_algo[sg__env_value(SG_ENV_COLL_REDUCE_SCATTER, c->world == 2)];
  /* SG_COMM_WAIT=yield keeps waiting ranks runnable (spin, then yield) instead of sleeping */
  k->nap = sg__env_value(SG_ENV_COMM_WAIT, 0) == 0;
  return SG_OK;
}

void sg__coll_free(sg__coll *k) {
  rx_free(k);
  free(k->sends);
  free(k->recvs);
  free(k->slot_send);
  memset(k, 0, sizeof *k);
}
