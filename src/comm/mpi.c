/* MPI communicator: one rank per process (DESIGN.md section 6).
 *
 * Reduce-scatter (and the first half of all-reduce) has two algorithms, selected by
 * SG_MPI_REDUCE_SCATTER=direct|ring (read when the communicator is created; unset: ring for
 * two ranks, direct from three, as measured with bench/bench_comm.c on a 2-core machine). Open MPI's
 * MPI_Reduce_scatter_block is several times slower than either, and MPI has no bf16.
 *
 * Direct: every rank sends slice k of its buffer to rank k and receives every peer's values of
 * its own slice, in pieces of at most SG__MPI_RS_PIECE bytes: two pieces per peer are in
 * flight (the next one arrives while the current one is summed) and sends run a few pieces
 * ahead of the sum. The pieces land in our receive buffers (piece size shrinks with W so that
 * they always fit). Each element is summed over ranks
 * 0..W-1 in fp32 (f64: f64) and rounded once to the dtype, like the local communicator: the
 * result does not depend on arrival order. No rank waits on a forwarded partial, which is what
 * made the ring slow with ranks sharing cores (a chain of W-1 dependent waits).
 *
 * Ring: chunk q is summed around the ring starting at rank q+1 and ending at its owner q, each
 * chunk cut into pieces of at most SG__MPI_PIECE bytes so that the transfer of one piece
 * overlaps the add of the previous one. f32 and f64 partials travel and are stored in the
 * buffer's own type (the buffer slice of a chunk is no longer needed once its contribution is
 * added). For bf16 and f16 the first hop sends the raw values; later hops send fp32 partials
 * held in c->scratch, so the sum is computed in fp32 and rounded once, at the owner. That
 * doubles the bytes of those hops; with W = 2 there are none.
 *
 * Both orders are fixed, so results are deterministic and all-reduce gives the same bits on
 * every rank (they differ between the two algorithms only for three or more ranks).
 *
 * All-gather (and the second half of all-reduce) is direct by default: every rank posts its
 * slice to every peer at once. It moves the same bytes per rank as a ring without the chain of
 * forwards, and measured >= MPI_Allgather here, where the ring fell behind with ranks sharing
 * cores. SG_MPI_ALLGATHER=ring|mpi selects the ring or MPI_Iallgather (bench/bench_comm.c).
 * Broadcast is MPI_Ibcast, polled.
 *
 * Wire data is bytes (MPI has no bf16). Buffers on a GPU (the engine's CUDA device) go through
 * pinned host memory of that device: the input is copied down, the host algorithm above runs on
 * the copy, the result is copied back (MPI moves host memory, whatever it knows of CUDA).
 *
 * Threads: MPI_THREAD_SERIALIZED or better makes the communicator `threaded` (the engine calls
 * it from its comm worker, one call at a time); below that the engine runs collectives on the
 * calling thread.
 *
 * Deadlines. Every wait polls MPI_Test until done or the deadline passes; then the pending
 * receives are cancelled, the sends released, and the communicator is broken (SG_ERR_TIMEOUT).
 * Messages carry a tag derived from (call number, op, count, dtype), so a rank that skipped or
 * mismatched a call does not feed a peer's buffer: the peers time out instead. */
#define _POSIX_C_SOURCE 200809L /* sched_yield */

#include <limits.h>  /* INT_MAX */
#include <mpi.h>     /* the only file of the library that includes it */
#include <pthread.h> /* pthread_mutex_t for the init/finalize count */
#include <sched.h>   /* sched_yield */
#include <stdint.h>  /* uint64_t, INT64_MAX */
#include <stdlib.h>  /* malloc, free, getenv */
#include <string.h>  /* strcmp */

#include "../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_reduce_add, _accumulate, _cast */
#include "sg_comm.h"                          /* sg_comm, sg__comm_ops, sg__comm_fail */

#ifndef SG__MPI_PIECE
#define SG__MPI_PIECE ((size_t)1 << 20) /* bytes of one message of a reduction (fp32 partials) */
#endif
#ifndef SG__MPI_AG_PIECE
#define SG__MPI_AG_PIECE ((size_t)4 << 20) /* bytes of one message of all_gather (copy only) */
#endif
#ifndef SG__MPI_DIRECT_PIECE
#define SG__MPI_DIRECT_PIECE ((size_t)1 << 30) /* bytes of one message of a direct all-gather */
#endif
#ifndef SG__MPI_RS_PIECE
#define SG__MPI_RS_PIECE ((size_t)256 << 10) /* most bytes of one message of a direct reduce */
#endif
#ifndef SG__MPI_SENDS_AHEAD
#define SG__MPI_SENDS_AHEAD 3 /* pieces a direct reduce-scatter sends before summing its first */
#endif
#ifndef SG__MPI_NRX
#define SG__MPI_NRX 4 /* receives in flight per reduction */
#endif
#define SG__MPI_CANCEL_GRACE_MS 200 /* how long a cancelled receive may take to finish */
#ifndef SG__MPI_SPINS
#define SG__MPI_SPINS 2000u
#endif /* polls before a waiting rank starts yielding its core */

enum { OP_ALL_REDUCE = 1, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST };
enum { AG_DIRECT = 0, AG_RING, AG_MPI };
enum { RS_DIRECT = 0, RS_RING };

typedef struct mcomm {
  sg_comm c; /* first: the sg_comm pointer is the allocation */
  MPI_Comm comm;
  int tag_ub;
  uint64_t seq;       /* collectives called so far (same on every healthy rank) */
  unsigned char *rx;  /* SG__MPI_NRX receive buffers of SG__MPI_PIECE bytes */
  int rx_lost;        /* a receive into rx could not be finished: rx must never be freed */
  int ag_algo;        /* all_gather algorithm: AG_DIRECT, AG_RING or AG_MPI */
  int rs_algo;        /* reduce_scatter (and all_reduce's first half): RS_DIRECT or RS_RING */
  MPI_Request *sends; /* per-call request arrays, grown on demand */
  MPI_Request *recvs;
  size_t *slot_send; /* per fp32 slot: index into sends of its last send */
  size_t cap_sends, cap_recvs, cap_slots;
  unsigned char *stage; /* device buffers: pinned host copy (from c.dev), stage_cap bytes */
  size_t stage_cap;
  int stage_lost; /* a collective on it was left pending: never freed */
} mcomm;

/* Whether this library initialized MPI, and how many MPI communicators are alive: the last
 * destroy finalizes what we initialized. */
static pthread_mutex_t g_mpi_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_mpi_live;
static int g_mpi_we_init;

static mcomm *mc(sg_comm *c) { return (mcomm *)c; }

static size_t elem_size(int dtype) { return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : 2u; }

/* bf16/f16 reductions keep fp32 partials (rounded once at the end); f32 and f64 are their own
 * accumulation type. */
static int is_wide(int dtype) { return dtype == SG_BF16 || dtype == SG_F16; }

static sg_status fail_mpi(sg_comm *c, const char *fn, const char *what, int rc, const char *file,
                          int line) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
  c->broken = 1;
  SG_LOG(SG_LOG_INFO, c->rank, "%s: %s failed: %s", fn, what, text);
  return sg__err_at(SG_ERR_COMM, file, line, "%s: %s failed: %s (communicator now broken)", fn,
                    what, text);
}
#define SG__MPI_FAIL(c, fn, what, rc) fail_mpi((c), (fn), (what), (rc), __FILE__, __LINE__)

static int grow(void **p, size_t *cap, size_t n, size_t es) {
  if (n <= *cap) return 1;
  void *q = realloc(*p, n * es);
  if (!q) return 0;
  *p = q;
  *cap = n;
  return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* Requests: polling with a deadline, and clean-up after a failure                           */

/* Open MPI cannot cancel sends; releasing them lets the call return. The peer is broken too
 * (or will time out), and the tags differ per call, so nobody consumes those messages later.
 * Receives are cancelled; one that does not finish within the grace period (it was already
 * matched) is freed, and as its buffer may still be written, internal receive buffers are then
 * never freed. */
static void abort_requests(mcomm *m, MPI_Request *recvs, size_t nrecv, int into_rx, size_t nsend) {
  for (size_t i = 0; i < nsend; i++)
    if (m->sends[i] != MPI_REQUEST_NULL) MPI_Request_free(&m->sends[i]);
  for (size_t i = 0; i < nrecv; i++)
    if (recvs[i] != MPI_REQUEST_NULL) MPI_Cancel(&recvs[i]);
  const int64_t until = sg__now_ms() + SG__MPI_CANCEL_GRACE_MS;
  int done = 0;
  while (!done && nrecv > 0 && sg__now_ms() < until)
    if (MPI_Testall((int)nrecv, recvs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
  if (done) return;
  for (size_t i = 0; i < nrecv; i++) {
    int one = 0;
    if (recvs[i] == MPI_REQUEST_NULL) continue;
    if (MPI_Test(&recvs[i], &one, MPI_STATUS_IGNORE) == MPI_SUCCESS && one) continue;
    MPI_Request_free(&recvs[i]);
    if (into_rx) m->rx_lost = 1;
    SG_LOG(SG_LOG_WARN, m->c.rank,
           "sg_comm(mpi): a cancelled receive did not finish; its buffer may still be written");
  }
}

static sg_status timed_out(sg_comm *c, const char *fn, const char *what) {
  return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                       "deadline passed while waiting for %s (rank %d of %d; a peer is late, "
                       "gone, or called a different collective)",
                       what, c->rank, c->world);
}

/* Between two polls: spin first (a yield on a busy machine can cost a whole time slice, which
 * ruins small messages), then yield so that ranks sharing a core (oversubscribed runs) let the
 * peer they wait for run. */
static void idle(unsigned spins) {
  if (spins >= SG__MPI_SPINS) sched_yield();
}

/* Polls one request until it completes or the deadline passes. expect >= 0: the received byte
 * count must match (a peer that called with another count is a mismatch, not data). */
static sg_status wait_one(sg_comm *c, const char *fn, MPI_Request *rq, long long expect,
                          int64_t deadline_ms) {
  MPI_Status st;
  int done = 0;
  for (unsigned spins = 0;; spins++) {
    const int rc = MPI_Test(rq, &done, &st);
    if (rc != MPI_SUCCESS) return SG__MPI_FAIL(c, fn, "MPI_Test", rc);
    if (done) break;
    if (sg__now_ms() > deadline_ms) return timed_out(c, fn, expect >= 0 ? "a message" : "a send");
    idle(spins);
  }
  if (expect >= 0) {
    int n = -1;
    MPI_Get_count(&st, MPI_BYTE, &n);
    if ((long long)n != expect)
      return sg__comm_fail(c, SG_ERR_COMM, fn,
                           "received %d bytes where %lld were expected (ranks called "
                           "mismatched collectives?)",
                           n, expect);
  }
  return SG_OK;
}

static sg_status wait_all(sg_comm *c, const char *fn, MPI_Request *rq, size_t n,
                          int64_t deadline_ms) {
  for (size_t i = 0; i < n; i++) SG_TRY(wait_one(c, fn, &rq[i], -1, deadline_ms));
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Ring layout                                                                               */

typedef struct ring {
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

static sg_status isend(const ring *R, const void *p, size_t bytes, MPI_Request *rq) {
  const int next = mod(R->c->rank + 1, R->c->world);
  const int rc = MPI_Isend(p, (int)bytes, MPI_BYTE, next, R->tag, mc(R->c)->comm, rq);
  return rc == MPI_SUCCESS ? SG_OK : SG__MPI_FAIL(R->c, R->fn, "MPI_Isend", rc);
}

static sg_status irecv(const ring *R, void *p, size_t bytes, MPI_Request *rq) {
  const int prev = mod(R->c->rank - 1, R->c->world);
  const int rc = MPI_Irecv(p, (int)bytes, MPI_BYTE, prev, R->tag, mc(R->c)->comm, rq);
  return rc == MPI_SUCCESS ? SG_OK : SG__MPI_FAIL(R->c, R->fn, "MPI_Irecv", rc);
}

/* Sends every piece of chunk k from buf (the first step of both rings). */
static sg_status send_chunk(const ring *R, int k, size_t *nsend) {
  size_t off, len;
  chunk(R, k, &off, &len);
  mcomm *m = mc(R->c);
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

/* Combines the partial that arrived in rx with this rank's piece. */
static sg_status consume(const ring *R, const cursor *cu, const void *rx, size_t *nsend) {
  mcomm *m = mc(R->c);
  const int last = cu->step == R->c->world - 2;
  size_t po, pl;
  piece(R, cu->k, cu->j, &po, &pl);
  unsigned char *own = R->buf + po * R->es;
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
    SG_TRY(wait_one(R->c, R->fn, &m->sends[m->slot_send[cu->j]], -1, R->deadline_ms));
  sg__cpu_cast(slot, SG_F32, own, R->dtype, pl);
  sg__cpu_accumulate(slot, SG_F32, rx, rx_dtype, pl);
  m->slot_send[cu->j] = *nsend;
  return isend(R, slot, pl * 4u, &m->sends[(*nsend)++]);
}

static sg_status post_rx(const ring *R, cursor *post, int *more, size_t i, MPI_Request *rq) {
  mcomm *m = mc(R->c);
  size_t po, pl;
  if (!*more) return SG_OK;
  piece(R, post->k, post->j, &po, &pl);
  SG_TRY(irecv(R, m->rx + (i % SG__MPI_NRX) * SG__MPI_PIECE, msg_bytes(R, post->step, pl), rq));
  *more = cursor_next(R, post, 2);
  return SG_OK;
}

/* Rank r receives chunk (r-2-s) at step s from r-1, adds its own values and passes the sum to
 * r+1 at step s+1; after W-1 steps it holds the total of chunk r. */
static sg_status ring_reduce_scatter(const ring *R) {
  mcomm *m = mc(R->c);
  MPI_Request rx_req[SG__MPI_NRX];
  size_t nsend = 0;
  sg_status st = SG_OK;
  for (int i = 0; i < SG__MPI_NRX; i++) rx_req[i] = MPI_REQUEST_NULL;
  cursor cu = {0, 0, 0, 0}, post = {0, 0, 0, 0};
  int more = cursor_seek(R, &post, 2), have = cursor_seek(R, &cu, 2);
  for (int i = 0; i < SG__MPI_NRX; i++)
    SG_TRY_GOTO(post_rx(R, &post, &more, (size_t)i, &rx_req[i]), st, fail);
  SG_TRY_GOTO(send_chunk(R, mod(R->c->rank - 1, R->c->world), &nsend), st, fail);
  for (size_t i = 0; have; i++) {
    MPI_Request *rq = &rx_req[i % SG__MPI_NRX];
    size_t po, pl;
    piece(R, cu.k, cu.j, &po, &pl);
    SG_TRY_GOTO(wait_one(R->c, R->fn, rq, (long long)msg_bytes(R, cu.step, pl), R->deadline_ms), st,
                fail);
    SG_TRY_GOTO(consume(R, &cu, m->rx + (i % SG__MPI_NRX) * SG__MPI_PIECE, &nsend), st, fail);
    SG_TRY_GOTO(post_rx(R, &post, &more, i + SG__MPI_NRX, rq), st, fail);
    have = cursor_next(R, &cu, 2);
  }
  SG_TRY_GOTO(wait_all(R->c, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, rx_req, SG__MPI_NRX, 1, nsend);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Ring all-gather (in place)                                                                */

/* Rank r sends its chunk at step 0 and forwards chunk (r-1-s), received at step s, at step
 * s+1. Receives land in their final place, so all are posted at once. */
static sg_status ring_all_gather(const ring *R) {
  mcomm *m = mc(R->c);
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
    SG_TRY_GOTO(wait_one(R->c, R->fn, &m->recvs[i], (long long)(pl * R->es), R->deadline_ms), st,
                fail);
    if (cu.step < R->c->world - 2)
      SG_TRY_GOTO(isend(R, R->buf + po * R->es, pl * R->es, &m->sends[nsend++]), st, fail);
  }
  SG_TRY_GOTO(wait_all(R->c, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
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
  D.pe = SG__MPI_DIRECT_PIECE / D.es;
  mcomm *m = mc(R->c);
  const int w = R->c->world, r = R->c->rank;
  size_t nsend = 0, nrecv = 0, off, len;
  sg_status st = SG_OK;
  int rc = MPI_SUCCESS;
  for (int d = 1; d < w && rc == MPI_SUCCESS; d++) {
    const int from = mod(r - d, w), to = mod(r + d, w);
    chunk(R, from, &off, &len);
    for (size_t j = 0; j < npieces(len, R->pe) && rc == MPI_SUCCESS; j++) {
      size_t po, pl;
      piece(R, from, j, &po, &pl);
      rc = MPI_Irecv(R->buf + po * R->es, (int)(pl * R->es), MPI_BYTE, from, R->tag, m->comm,
                     &m->recvs[nrecv++]);
    }
    chunk(R, r, &off, &len);
    for (size_t j = 0; j < npieces(len, R->pe) && rc == MPI_SUCCESS; j++) {
      size_t po, pl;
      piece(R, r, j, &po, &pl);
      rc = MPI_Isend(R->buf + po * R->es, (int)(pl * R->es), MPI_BYTE, to, R->tag, m->comm,
                     &m->sends[nsend++]);
    }
  }
  if (rc != MPI_SUCCESS) {
    st = SG__MPI_FAIL(R->c, R->fn, "MPI_Isend/MPI_Irecv", rc);
    goto fail;
  }
  SG_TRY_GOTO(wait_all(R->c, R->fn, m->recvs, nrecv, R->deadline_ms), st, fail);
  SG_TRY_GOTO(wait_all(R->c, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, m->recvs, nrecv, 0, nsend);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Direct reduce-scatter                                                                     */

#define SG__MPI_SUM_BLOCK 1024 /* elements summed per block: the fp32 partials stay in L1 */

/* dst[i] = sum over k of src[k][i] in k order, rounded once to dtype (fp32 math; f64: f64).
 * dst may be one of the sources. f32 and f64 are plain loops over a block (the compiler
 * vectorizes them, unlike the tiled kernel); bf16/f16 use the kernel the local backend uses. */
static void sum_sources(void *dst, const void *const *src, int nsrc, int dtype, size_t n) {
  if (is_wide(dtype)) {
    sg__cpu_reduce_sum(dst, src, nsrc, dtype, n);
    return;
  }
  for (size_t b = 0; b < n; b += SG__MPI_SUM_BLOCK) {
    const size_t m = n - b < SG__MPI_SUM_BLOCK ? n - b : SG__MPI_SUM_BLOCK;
    if (dtype == SG_F32) {
      float acc[SG__MPI_SUM_BLOCK];
      const float *s0 = (const float *)src[0] + b;
      for (size_t i = 0; i < m; i++) acc[i] = s0[i];
      for (int k = 1; k < nsrc; k++) {
        const float *restrict sk = (const float *)src[k] + b;
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] + sk[i];
      }
      memcpy((float *)dst + b, acc, m * sizeof *acc);
    } else {
      double acc[SG__MPI_SUM_BLOCK];
      const double *s0 = (const double *)src[0] + b;
      for (size_t i = 0; i < m; i++) acc[i] = s0[i];
      for (int k = 1; k < nsrc; k++) {
        const double *restrict sk = (const double *)src[k] + b;
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] + sk[i];
      }
      memcpy((double *)dst + b, acc, m * sizeof *acc);
    }
  }
}

/* Elements per message: two pieces of every peer fit in our receive buffers. It depends only on
 * the call's arguments, so sender and receiver cut a chunk the same way. */
static size_t direct_piece(const ring *R) {
  const size_t peers = (size_t)R->c->world - 1, rx_bytes = SG__MPI_NRX * SG__MPI_PIECE;
  size_t pe = rx_bytes / (2u * peers * R->es);
  if (pe > SG__MPI_RS_PIECE / R->es) pe = SG__MPI_RS_PIECE / R->es;
  return pe > 0 ? pe : 1u;
}

/* The pieces land in our receive buffers, never in the engine's scratch: a receive that cannot
 * be cancelled after a failure then never writes into memory the engine has freed. */
static sg_status direct_region(const ring *R, unsigned char **region, int *into_rx) {
  const size_t need = 2u * ((size_t)R->c->world - 1) * R->pe * R->es;
  if (need > SG__MPI_NRX * SG__MPI_PIECE)
    return sg__err(SG_ERR_INTERNAL, "%s: direct pieces (%zu bytes) exceed the receive buffers",
                   R->fn, need);
  *into_rx = 1;
  *region = mc(R->c)->rx;
  return SG_OK;
}

/* Posts the receives of piece j of our chunk from every peer, into half j%2 of the region:
 * peer k's values go to slot k (k < rank) or k-1. */
static sg_status post_piece(const ring *R, unsigned char *region, size_t j) {
  mcomm *m = mc(R->c);
  const int w = R->c->world, r = R->c->rank;
  const size_t peers = (size_t)w - 1, half = j % 2u;
  size_t po, pl;
  piece(R, r, j, &po, &pl);
  for (int k = 0; k < w; k++) {
    if (k == r) continue;
    const size_t slot = (size_t)(k < r ? k : k - 1);
    unsigned char *dst = region + ((half * peers + slot) * R->pe) * R->es;
    const int rc = MPI_Irecv(dst, (int)(pl * R->es), MPI_BYTE, k, R->tag, m->comm,
                             &m->recvs[half * peers + slot]);
    if (rc != MPI_SUCCESS) return SG__MPI_FAIL(R->c, R->fn, "MPI_Irecv", rc);
  }
  return SG_OK;
}

/* Sends piece j of chunk k to its owner k, for every peer whose chunk has a piece j (rank r
 * serves r+1, r+2, ... first, so that no rank is everybody's first target). Sends follow the
 * receiver's pace (see direct_reduce_scatter): posting every piece at once left hundreds of
 * unexpected rendezvous headers, each with an eagerly copied first fragment, and was slower
 * for large buffers. */
static sg_status post_sends(const ring *R, size_t j, size_t *nsend) {
  mcomm *m = mc(R->c);
  const int w = R->c->world, r = R->c->rank;
  for (int d = 1; d < w; d++) {
    const int to = mod(r + d, w);
    size_t off, len, po, pl;
    chunk(R, to, &off, &len);
    if (j >= npieces(len, R->pe)) continue;
    piece(R, to, j, &po, &pl);
    const int rc = MPI_Isend(R->buf + po * R->es, (int)(pl * R->es), MPI_BYTE, to, R->tag,
                             m->comm, &m->sends[(*nsend)++]);
    if (rc != MPI_SUCCESS) return SG__MPI_FAIL(R->c, R->fn, "MPI_Isend", rc);
  }
  return SG_OK;
}

/* Waits for piece j from every peer and writes the sum over ranks 0..W-1 (ours read from buf)
 * over our own values. */
static sg_status sum_piece(const ring *R, unsigned char *region, size_t j) {
  mcomm *m = mc(R->c);
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
    st = wait_one(R->c, R->fn, &m->recvs[half * peers + slot], (long long)(pl * R->es),
                  R->deadline_ms);
    if (st != SG_OK) goto done;
  }
  sum_sources(R->buf + po * R->es, srcs, w, R->dtype, pl);
done:
  if (srcs != src) free(srcs);
  return st;
}

/* Every rank sends chunk k straight to its owner k and sums what it receives for its own chunk
 * in rank order. Unlike the ring nothing waits for a forwarded partial, so ranks sharing cores
 * do not stall in a chain; the receives of piece j+1 are in flight while piece j is summed. */
static sg_status direct_reduce_scatter(const ring *R) {
  mcomm *m = mc(R->c);
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
  for (size_t j = 0; j < SG__MPI_SENDS_AHEAD; j++) SG_TRY_GOTO(post_sends(R, j, &nsend), st, fail);
  for (size_t j = 0; j < np; j++) {
    SG_TRY_GOTO(sum_piece(R, region, j), st, fail);
    if (j + 2 < np) SG_TRY_GOTO(post_piece(R, region, j + 2), st, fail);
    SG_TRY_GOTO(post_sends(R, j + SG__MPI_SENDS_AHEAD, &nsend), st, fail);
  }
  for (size_t j = np + SG__MPI_SENDS_AHEAD; j < np_max; j++) /* peers' longer chunks */
    SG_TRY_GOTO(post_sends(R, j, &nsend), st, fail);
  SG_TRY_GOTO(wait_all(R->c, R->fn, m->sends, nsend, R->deadline_ms), st, fail);
  return SG_OK;
fail:
  abort_requests(m, m->recvs, 2 * peers, into_rx, nsend);
  return st;
}

/* Request arrays of a direct reduce-scatter: every piece of every peer's chunk is sent at once;
 * two pieces per peer are received at a time. */
static sg_status prepare_direct(ring *R) {
  mcomm *m = mc(R->c);
  R->pe = direct_piece(R);
  size_t off, len;
  chunk(R, 0, &off, &len);
  const size_t peers = (size_t)R->c->world - 1, nsend = peers * npieces(len, R->pe);
  if (!grow((void **)&m->sends, &m->cap_sends, nsend, sizeof(MPI_Request)) ||
      !grow((void **)&m->recvs, &m->cap_recvs, 2 * peers, sizeof(MPI_Request)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu requests", R->fn, nsend);
  for (size_t i = 0; i < nsend; i++) m->sends[i] = MPI_REQUEST_NULL;
  for (size_t i = 0; i < 2 * peers; i++) m->recvs[i] = MPI_REQUEST_NULL;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Collectives                                                                               */

/* Tag of a call: differs between calls, ops and sizes, so stray or mismatched messages never
 * match. Even for the first ring of a call, odd for the second. */
static int call_tag(mcomm *m, int op, size_t count, int dtype) {
  uint64_t h = SG__HASH_INIT;
  const uint64_t v[4] = {m->seq++, (uint64_t)op, (uint64_t)count, (uint64_t)(dtype + 1)};
  h = sg__hash_bytes(h, v, sizeof v);
  const uint64_t half = (uint64_t)(m->tag_ub / 2);
  return (int)(h % half) * 2;
}

static sg_status check_call(sg_comm *c, const char *fn, const void *buf, size_t count, int dtype,
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

/* Request arrays and, for bf16/f16 with three or more ranks, fp32 scratch for the partials. */
static sg_status prepare(const ring *R, int reduce) {
  mcomm *m = mc(R->c);
  const size_t items = max_items(R);
  if (!grow((void **)&m->sends, &m->cap_sends, 2 * items, sizeof(MPI_Request)) ||
      !grow((void **)&m->recvs, &m->cap_recvs, items, sizeof(MPI_Request)) ||
      !grow((void **)&m->slot_send, &m->cap_slots, items, sizeof(size_t)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu requests", R->fn, items);
  for (size_t i = 0; i < 2 * items; i++) m->sends[i] = MPI_REQUEST_NULL;
  for (size_t i = 0; i < items; i++) m->recvs[i] = MPI_REQUEST_NULL;
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

static ring make_ring(sg_comm *c, const char *fn, void *buf, size_t count, int dtype, int split,
                      int64_t deadline_ms) {
  ring R;
  R.c = c;
  R.fn = fn;
  R.buf = (unsigned char *)buf;
  R.dtype = dtype;
  R.es = dtype >= 0 ? elem_size(dtype) : 1u;
  R.count = count;
  R.split = split;
  /* pieces sized by the widest message: fp32 partials (f64: f64); plain all-gathers only copy
   * and take bigger pieces (fewer handshakes) */
  R.pe = dtype >= 0 ? SG__MPI_PIECE / (dtype == SG__F64 ? 8u : 4u) : SG__MPI_AG_PIECE;
  R.tag = 0;
  R.deadline_ms = deadline_ms;
  return R;
}

static sg_status host_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype,
                                    int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) reduce_scatter";
  SG_TRY(check_call(c, fn, buf, count, dtype, (size_t)(c ? c->world : 1)));
  ring R = make_ring(c, fn, buf, count, dtype, 0, deadline_ms);
  R.tag = call_tag(mc(c), OP_REDUCE_SCATTER, count, dtype);
  if (c->world == 1 || count == 0) return SG_OK;
  if (mc(c)->rs_algo == RS_DIRECT) {
    SG_TRY(prepare_direct(&R));
    return direct_reduce_scatter(&R);
  }
  SG_TRY(prepare(&R, 1));
  return ring_reduce_scatter(&R);
}

static sg_status host_all_reduce(sg_comm *c, void *buf, size_t count, int dtype,
                                int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) all_reduce";
  SG_TRY(check_call(c, fn, buf, count, dtype, 1));
  ring R = make_ring(c, fn, buf, count, dtype, 1, deadline_ms);
  R.tag = call_tag(mc(c), OP_ALL_REDUCE, count, dtype);
  if (c->world == 1 || count == 0) return SG_OK;
  if (mc(c)->rs_algo == RS_DIRECT) {
    ring D = R; /* its own piece size; the all-gather below keeps the ring's */
    SG_TRY(prepare_direct(&D));
    SG_TRY(direct_reduce_scatter(&D));
  } else {
    SG_TRY(prepare(&R, 1));
    SG_TRY(ring_reduce_scatter(&R));
  }
  SG_TRY(prepare(&R, 0));
  R.tag += 1;
  return mc(c)->ag_algo == AG_RING ? ring_all_gather(&R) : direct_all_gather(&R);
}

/* Polls a nonblocking collective. It cannot be cancelled: on expiry it is left pending (the
 * communicator is broken and never freed, so MPI keeps a valid handle). */
static sg_status wait_coll(sg_comm *c, const char *fn, const char *what, MPI_Request *rq,
                           int64_t deadline_ms) {
  int done = 0;
  for (unsigned spins = 0;; spins++) {
    const int rc = MPI_Test(rq, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return SG__MPI_FAIL(c, fn, what, rc);
    if (done) return SG_OK;
    if (sg__now_ms() > deadline_ms) return timed_out(c, fn, what);
    idle(spins);
  }
}

static sg_status host_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) all_gather";
  SG_TRY(check_call(c, fn, buf, bytes, -1, (size_t)(c ? c->world : 1)));
  mcomm *m = mc(c);
  ring R = make_ring(c, fn, buf, bytes, -1, 0, deadline_ms);
  R.tag = call_tag(m, OP_ALL_GATHER, bytes, -1);
  if (c->world == 1 || bytes == 0) return SG_OK;
  if (m->ag_algo != AG_MPI || bytes > (size_t)INT_MAX) {
    SG_TRY(prepare(&R, 0));
    return m->ag_algo == AG_RING ? ring_all_gather(&R) : direct_all_gather(&R);
  }
  MPI_Request rq = MPI_REQUEST_NULL;
  const int rc =
      MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)bytes, MPI_BYTE, m->comm, &rq);
  if (rc != MPI_SUCCESS) return SG__MPI_FAIL(c, fn, "MPI_Iallgather", rc);
  return wait_coll(c, fn, "MPI_Iallgather", &rq, deadline_ms);
}

static sg_status host_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) broadcast";
  SG_TRY(check_call(c, fn, buf, bytes, -1, 1));
  if (root < 0 || root >= c->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: root out of range (%d, world %d)", fn, root,
                   c->world);
  mcomm *m = mc(c);
  m->seq++; /* keep call numbering aligned with the other collectives */
  /* MPI counts are int: broadcast in parts of at most 1 GiB */
  for (size_t off = 0; off < bytes && c->world > 1; off += (size_t)1 << 30) {
    const size_t n = bytes - off < ((size_t)1 << 30) ? bytes - off : (size_t)1 << 30;
    MPI_Request rq = MPI_REQUEST_NULL;
    const int rc = MPI_Ibcast((unsigned char *)buf + off, (int)n, MPI_BYTE, root, m->comm, &rq);
    if (rc != MPI_SUCCESS) return SG__MPI_FAIL(c, fn, "MPI_Ibcast", rc);
    SG_TRY(wait_coll(c, fn, "MPI_Ibcast", &rq, deadline_ms));
  }
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Device buffers: pinned host staging                                                       */

static int on_device(const sg_comm *c) { return c && c->dev && c->dev->kind != SG_DEVICE_CPU; }

/* What a staged call copies down before and back up after the host algorithm, in bytes from
 * the start of the buffer, and the fp32 scratch it needs next to the copy. */
typedef struct stage_plan {
  int op;
  size_t count; /* elements (reductions) or bytes per rank (all_gather, broadcast) */
  int dtype, root;
  int64_t deadline_ms;
  size_t total, down_off, down_len, up_off, up_len, scratch;
} stage_plan;

static sg_status run_host(sg_comm *c, void *h, const stage_plan *p) {
  switch (p->op) {
    case OP_REDUCE_SCATTER: return host_reduce_scatter(c, h, p->count, p->dtype, p->deadline_ms);
    case OP_ALL_REDUCE: return host_all_reduce(c, h, p->count, p->dtype, p->deadline_ms);
    case OP_ALL_GATHER: return host_all_gather(c, h, p->count, p->deadline_ms);
    default: return host_broadcast(c, h, p->count, p->root, p->deadline_ms);
  }
}

/* Pinned memory from the bound device, grown to a multiple of 1 MiB. */
static sg_status stage_reserve(sg_comm *c, size_t bytes) {
  mcomm *m = mc(c);
  if (m->stage_cap >= bytes) return SG_OK;
  const size_t cap = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
  void *p = NULL;
  SG_TRY(c->dev->ops->host_alloc(c->dev, cap, &p));
  if (m->stage && !m->stage_lost) c->dev->ops->host_free(c->dev, m->stage);
  m->stage = p;
  m->stage_cap = cap;
  m->stage_lost = 0;
  return SG_OK;
}

/* Copies run on the comm queue inside the engine's comm job, where the device completes them
 * before the call returns (as for the local communicator's). */
static sg_status stage_copy(sg_comm *c, void *dst, const void *src, size_t bytes,
                            sg__copy_kind kind) {
  return bytes ? c->dev->ops->copy(c->dev, SG_Q_COMM, dst, src, bytes, kind) : SG_OK;
}

/* A rank that fails around the collective has left (or never joined) it: its peers time out,
 * and this communicator is broken like after any failed collective. */
static sg_status stage_failed(sg_comm *c, const char *fn, sg_status st) {
  c->broken = 1;
  return sg__err_prefix(st, fn);
}

static sg_status staged(sg_comm *c, const char *fn, void *buf, const stage_plan *p) {
  mcomm *m = mc(c);
  const size_t at = (p->total + 63) & ~(size_t)63; /* scratch after the copy, aligned */
  sg_status st = stage_reserve(c, at + p->scratch);
  if (st != SG_OK) return stage_failed(c, fn, st);
  unsigned char *h = m->stage, *d = buf;
  if ((st = stage_copy(c, h + p->down_off, d + p->down_off, p->down_len, SG_COPY_D2H)))
    return stage_failed(c, fn, st);
  void *dev_scratch = c->scratch;
  const size_t dev_scratch_bytes = c->scratch_bytes;
  c->scratch = h + at; /* the host algorithm keeps its fp32 partials on the host too */
  c->scratch_bytes = p->scratch;
  st = run_host(c, h, p);
  c->scratch = dev_scratch;
  c->scratch_bytes = dev_scratch_bytes;
  if (st != SG_OK) {
    m->stage_lost = c->broken; /* MPI may still write into it */
    return st;
  }
  st = stage_copy(c, d + p->up_off, h + p->up_off, p->up_len, SG_COPY_H2D);
  return st == SG_OK ? SG_OK : stage_failed(c, fn, st);
}

static sg_status mpi_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype,
                                    int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) reduce_scatter";
  if (!on_device(c)) return host_reduce_scatter(c, buf, count, dtype, deadline_ms);
  SG_TRY(check_call(c, fn, buf, count, dtype, (size_t)c->world));
  const size_t slice = count * elem_size(dtype), total = slice * (size_t)c->world;
  const stage_plan p = {OP_REDUCE_SCATTER, count, dtype, 0, deadline_ms, total, 0, total,
                        (size_t)c->rank * slice, slice, count * 4u};
  return staged(c, fn, buf, &p);
}

static sg_status mpi_all_reduce(sg_comm *c, void *buf, size_t count, int dtype,
                                int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) all_reduce";
  if (!on_device(c)) return host_all_reduce(c, buf, count, dtype, deadline_ms);
  SG_TRY(check_call(c, fn, buf, count, dtype, 1));
  const size_t total = count * elem_size(dtype);
  const stage_plan p = {OP_ALL_REDUCE, count, dtype, 0, deadline_ms, total, 0, total, 0, total,
                        count * 4u};
  return staged(c, fn, buf, &p);
}

static sg_status mpi_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) all_gather";
  if (!on_device(c)) return host_all_gather(c, buf, bytes, deadline_ms);
  SG_TRY(check_call(c, fn, buf, bytes, -1, (size_t)c->world));
  const size_t total = bytes * (size_t)c->world;
  const stage_plan p = {OP_ALL_GATHER, bytes, -1, 0, deadline_ms, total, (size_t)c->rank * bytes,
                        bytes, 0, total, 0};
  return staged(c, fn, buf, &p);
}

static sg_status mpi_broadcast(sg_comm *c, void *buf, size_t bytes, int root, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(mpi) broadcast";
  if (!on_device(c)) return host_broadcast(c, buf, bytes, root, deadline_ms);
  SG_TRY(check_call(c, fn, buf, bytes, -1, 1));
  if (root < 0 || root >= c->world) return host_broadcast(c, buf, bytes, root, deadline_ms);
  const int mine = c->rank == root;
  const stage_plan p = {OP_BROADCAST, bytes, -1, root, deadline_ms, bytes, 0, mine ? bytes : 0, 0,
                        mine ? 0 : bytes, 0};
  return staged(c, fn, buf, &p);
}

/* The bound device is going away: its pinned memory goes back first. */
static void mpi_release(sg_comm *c) {
  mcomm *m = mc(c);
  if (m->stage && !m->stage_lost && c->dev) c->dev->ops->host_free(c->dev, m->stage);
  m->stage = NULL;
  m->stage_cap = 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Lifetime                                                                                  */

/* The last destroy finalizes MPI if this library initialized it and nobody finalized it yet. */
static void release_mpi(void) {
  pthread_mutex_lock(&g_mpi_mu);
  if (--g_mpi_live == 0 && g_mpi_we_init) {
    int fin = 1;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
    g_mpi_we_init = 0;
  }
  pthread_mutex_unlock(&g_mpi_mu);
}

static void mpi_destroy(sg_comm *c) {
  mcomm *m = mc(c);
  mpi_release(c);
  int fin = 1;
  MPI_Finalized(&fin);
  /* A broken communicator may still have requests in flight: freeing it could wait on peers
   * that are gone. MPI_Finalize reclaims it. */
  if (!fin && !c->broken && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
  if (!m->rx_lost) free(m->rx);
  free(m->sends);
  free(m->recvs);
  free(m->slot_send);
  free(m);
  release_mpi();
}

static const sg__comm_ops mpi_ops = {
    "mpi", mpi_all_reduce, mpi_reduce_scatter, mpi_all_gather, mpi_broadcast, mpi_release,
    mpi_destroy,
};

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
  if (rc != MPI_SUCCESS) return SG__MPI_FAIL(&m->c, fn, "MPI_Comm_dup", rc);
  rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(m->comm, &m->c.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(m->comm, &m->c.world);
  if (rc != MPI_SUCCESS) return SG__MPI_FAIL(&m->c, fn, "MPI_Comm_rank/size", rc);
  int *ub = NULL, flag = 0;
  MPI_Comm_get_attr(m->comm, MPI_TAG_UB, &ub, &flag);
  m->tag_ub = flag && ub && *ub > 2 ? *ub : 32767;
  m->rx = malloc(SG__MPI_NRX * SG__MPI_PIECE);
  if (!m->rx) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory for receive buffers", fn);
  /* SG_MPI_ALLGATHER=direct|ring|mpi overrides the measured default (bench/bench_comm.c) */
  const char *ag = getenv("SG_MPI_ALLGATHER");
  m->ag_algo = !ag                   ? AG_DIRECT
               : !strcmp(ag, "mpi")  ? AG_MPI
               : !strcmp(ag, "ring") ? AG_RING
                                     : AG_DIRECT;
  /* SG_MPI_REDUCE_SCATTER=direct|ring likewise (also all_reduce's reduction half); unset:
   * the ring for two ranks (one hop, bigger pieces: measured faster), direct from three */
  const char *rs = getenv("SG_MPI_REDUCE_SCATTER");
  m->rs_algo = rs && !strcmp(rs, "ring")     ? RS_RING
               : rs && !strcmp(rs, "direct") ? RS_DIRECT
               : m->c.world == 2             ? RS_RING
                                             : RS_DIRECT;
  return SG_OK;
}

sg_status sg_comm_create_mpi(const void *mpi_comm, sg_comm **out) {
  static const char fn[] = "sg_comm_create_mpi";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  int provided = MPI_THREAD_SINGLE;
  SG_TRY(acquire_mpi(&provided));
  mcomm *m = calloc(1, sizeof *m);
  if (!m) {
    release_mpi();
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  }
  m->c.ops = &mpi_ops;
  m->comm = MPI_COMM_NULL;
  /* SERIALIZED is enough: the engine calls MPI from its comm worker only, one call at a time */
  m->c.threaded = provided >= MPI_THREAD_SERIALIZED;
  const sg_status st = setup(m, mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD);
  if (st != SG_OK) {
    if (m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    free(m->rx);
    free(m);
    release_mpi();
    return st;
  }
  SG_LOG(SG_LOG_DEBUG, m->c.rank, "%s: rank %d of %d, thread level %d", fn, m->c.rank, m->c.world,
         provided);
  *out = &m->c;
  return SG_OK;
}
