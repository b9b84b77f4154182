/* Collective algorithms over point-to-point messages (DESIGN.md section 6), for communicators
 * whose transport only moves bytes between ranks: the MPI communicator today; a
 * torch.distributed transport or one level of a hierarchical communicator next.
 *
 * A transport is the table sg__xport_ops over an opaque handle: nonblocking send and receive
 * of bytes to and from a peer rank with a tag, a test that polls one request, and the
 * abandonment of requests after a failure. Optional native broadcast and all-gather (NULL:
 * the algorithms here). Requests are plain values the transport fills (sg__xreq). Messages of
 * one call carry one tag (call number, op, count, dtype), so a rank that skipped or mismatched
 * a call never feeds a peer's buffer. The transport never blocks: every wait is a poll loop
 * here, with the caller's deadline.
 *
 * What the algorithms do (reduce-scatter and all-reduce sum in fp32 for bf16/f16, f64 in f64,
 * in a fixed order; all results deterministic):
 *   reduce-scatter, and all-reduce's first half: a ring (chunk q summed around the ring, fp32
 *     partials on the wire after the first hop for bf16/f16, kept in c->scratch) or direct
 *     (each rank sends chunk k to its owner, who sums it in rank order);
 *   all-gather, and all-reduce's second half: direct (every rank posts its slice to every peer)
 *     or a ring; native all-gather where the transport has one and SG_COLL_ALLGATHER=mpi;
 *   broadcast: the transport's native one, or a binomial tree.
 * SG_COLL_REDUCE_SCATTER=direct|ring and SG_COLL_ALLGATHER=direct|ring|mpi pick them (read at
 * sg__coll_init; unset: ring reduce-scatter for two ranks, direct from three; direct
 * all-gather), as measured with bench/bench_comm.c.
 *
 * Failures mark c broken (sg__comm_fail) and return SG_ERR_COMM, SG_ERR_TIMEOUT (deadline) or
 * SG_ERR_OUT_OF_MEMORY; pending requests are abandoned through the transport. */
#ifndef SG_COLL_H
#define SG_COLL_H

#include <stddef.h>
#include <stdint.h>

#include "../sg_comm.h" /* sg_comm, sg_status, SG__F64 */

/* One request; the transport keeps its own handle in h. active = 0: nothing pending. */
typedef struct sg__xreq {
  uint64_t h[2];
  int active;
} sg__xreq;

typedef struct sg__xport_ops {
  const char *name; /* in messages: "MPI_Isend failed" etc. */
  /* Start sending / receiving `bytes` (at most INT32_MAX) to / from rank `peer` with `tag`
   * (0 <= tag <= tag_ub). On failure the text is set; *rq stays inactive. */
  sg_status (*isend)(void *tp, const void *buf, size_t bytes, int peer, int tag, sg__xreq *rq);
  sg_status (*irecv)(void *tp, void *buf, size_t bytes, int peer, int tag, sg__xreq *rq);
  /* Polls: *done = 1 once complete (rq becomes inactive); *got = bytes received (receives). */
  sg_status (*test)(void *tp, sg__xreq *rq, int *done, size_t *got);
  /* After a failure: releases sends, cancels receives (waiting up to a short grace period).
   * Returns 1 when a receive could not be stopped and its buffer may still be written. */
  int (*abandon)(void *tp, sg__xreq *sends, size_t nsend, sg__xreq *recvs, size_t nrecv);
  /* Optional: native in-place broadcast and all-gather, polled with the deadline here through
   * test (NULL: the algorithms). */
  sg_status (*ibcast)(void *tp, void *buf, size_t bytes, int root, sg__xreq *rq);
  sg_status (*iallgather)(void *tp, void *buf, size_t bytes_per_rank, sg__xreq *rq);
  /* 1: the receive buffers give their pages back after each reduction (sg_coll.c, rx_release):
   * for transports whose own cost per byte hides the page faults of the next reduction.
   * SG_COMM_RX_RELEASE=0|1 overrides it. */
  int release_rx;
  /* Optional: sleeps until rq may have completed (the transport signals it) or `us`
   * microseconds pass, whichever is first; a waiting rank then costs no CPU (NULL: the waits
   * here nap with a growing interval instead). Never reports: the next test does. */
  void (*block)(void *tp, sg__xreq *rq, unsigned us);
} sg__xport_ops;

/* Per-channel state of the algorithms (request arrays, receive buffers, call counter). */
typedef struct sg__coll {
  sg_comm *c; /* rank, world, scratch; marked broken on failure */
  const sg__xport_ops *xp;
  void *tp;
  int tag_ub;
  uint64_t seq;      /* collectives called so far (same on every healthy rank) */
  unsigned char *rx; /* receive buffers of the reductions */
  int rx_lost;       /* a receive into rx could not be stopped: rx is never freed */
  int rx_mapped;     /* rx is its own mapping, whose pages go back after each reduction */
  int ag_algo, rs_algo;
  int nap; /* waits sleep once spinning and yielding found nothing (SG_COMM_WAIT) */
  sg__xreq *sends, *recvs;
  size_t *slot_send; /* per fp32 slot: index into sends of its last send */
  size_t cap_sends, cap_recvs, cap_slots;
  char fn[6][48]; /* "sg_comm(<transport>) <op>" per op, for messages */
} sg__coll;

/* c: the communicator (or channel) the collectives run for; tag_ub: the largest tag. */
sg_status sg__coll_init(sg__coll *k, sg_comm *c, const sg__xport_ops *xp, void *tp, int tag_ub);
void sg__coll_free(sg__coll *k);

/* The collectives of sg_comm.h on host memory. fp32 partials for bf16/f16 reductions over
 * three or more ranks (ring) live in c->scratch (sg__comm_scratch_bytes). */
sg_status sg__coll_all_reduce(sg__coll *k, void *buf, size_t count, int dtype, int64_t deadline);
sg_status sg__coll_reduce_scatter(sg__coll *k, void *buf, size_t count, int dtype,
                                  int64_t deadline);
/* reduce_scatter_fold (sg_comm.h) */
sg_status sg__coll_reduce_scatter_fold(sg__coll *k, void *buf, size_t count, int dtype,
                                       const sg__fold *f, int64_t deadline);
sg_status sg__coll_all_gather(sg__coll *k, void *buf, size_t bytes, int64_t deadline);
sg_status sg__coll_broadcast(sg__coll *k, void *buf, size_t bytes, int root, int64_t deadline);
/* all_to_all (sg_comm.h) */
sg_status sg__coll_all_to_all(sg__coll *k, const void *send, void *recv, size_t bytes,
                              int64_t deadline);

/* The argument checks of every collective (also for staged device buffers). */
sg_status sg__coll_check(sg_comm *c, const char *fn, const void *buf, size_t count, int dtype,
                         size_t per_rank_mult);

#endif /* SG_COLL_H */
