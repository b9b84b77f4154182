/* Local communicator: W ranks as threads of one process (DESIGN.md section 6).
 *
 * The ranks share one group. A collective is a rendezvous: each rank posts what it called
 * (op, count, dtype, root, buffer), waits at a barrier, checks that every rank called the same
 * thing, then reads the other ranks' buffers directly, and waits at a last barrier so that no
 * rank returns (and reuses its buffer) while a peer still reads it.
 *
 * Reductions sum in rank order 0..W-1 (fp32 math, f64 for f64, rounded once to the dtype), so
 * the result does not depend on which thread does the work, and every rank of an all-reduce
 * holds the same bits.
 *
 * Channels (sg_comm.h). Channel 0 of a rank uses the group of its communicator; channel k > 0
 * uses the k-th subgroup, made by the first rank that binds it and kept in a list of the base
 * group until the last communicator goes. Ranks are threads of one process, so collectives of
 * different channels interleave freely: each subgroup has its own barrier and posts.
 *
 * Devices. Ranks read each other's buffers directly, so every rank of a group must be on the
 * same device (host memory, or one GPU): each post carries its GPU, and the first rendezvous of
 * ranks on different GPUs fails on every rank with SG_ERR_UNSUPPORTED (no peer access is set
 * up; one process driving several GPUs should use NCCL).
 *
 * Failures. A barrier that passes its deadline marks the group broken and wakes everyone: the
 * rank that timed out gets SG_ERR_TIMEOUT, the ranks waiting with it SG_ERR_COMM, and every
 * later call on any rank SG_ERR_COMM. Invalid arguments on one rank, mismatched calls across
 * ranks and a rank destroying its communicator also break the group, so that peers fail at
 * once instead of waiting for their deadline. */
#define _POSIX_C_SOURCE 200809L /* pthread_condattr_setclock, CLOCK_MONOTONIC */

#include <errno.h>   /* ETIMEDOUT */
#include <pthread.h> /* mutex, cond */
#include <stdint.h>  /* SIZE_MAX, INT64_MAX */
#include <stdio.h>   /* snprintf */
#include <stdlib.h>  /* calloc, free */
#include <string.h>  /* memcpy */
#include <time.h>    /* struct timespec */

#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_reduce_sum */
#include "../sg_comm.h"                          /* sg_comm, sg__comm_ops, sg__comm_fail */

/* The collectives, numbered as sg__comm_count counts them. */
enum {
  OP_ALL_REDUCE = SG__COUNT_ALL_REDUCE,
  OP_REDUCE_SCATTER = SG__COUNT_REDUCE_SCATTER,
  OP_ALL_GATHER = SG__COUNT_ALL_GATHER,
  OP_BROADCAST = SG__COUNT_BROADCAST,
  OP_ALL_TO_ALL = SG__COUNT_BROADCAST + 1 /* counted as an all-gather */
};

static const char *op_name(int op) {
  switch (op) {
    case OP_ALL_REDUCE:
      return "all_reduce";
    case OP_REDUCE_SCATTER:
      return "reduce_scatter";
    case OP_ALL_GATHER:
      return "all_gather";
    case OP_BROADCAST:
      return "broadcast";
    case OP_ALL_TO_ALL:
      return "all_to_all";
  }
  return "?";
}

/* What one rank called; written by its owner before the first barrier, read by all after. */
typedef struct lpost {
  void *buf;
  size_t count; /* elements (reductions) or bytes (gather, broadcast) */
  int op, dtype, root;
  int ordinal; /* the GPU of buf, -1 for host memory */
} lpost;

typedef struct lgroup {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC, like the deadlines */
  int world;
  int refs;     /* communicators not yet destroyed */
  int arrived;  /* at the current barrier */
  int busy;     /* ranks inside a data phase (reading peers' buffers) */
  uint64_t gen; /* barrier generation: bumped when the last rank arrives */
  int broken;   /* never cleared */
  int broken_rank;
  char broken_why[96];
  uint64_t index;      /* a subgroup: its channel index; 0 for a communicator's group */
  struct lgroup *subs; /* a communicator's group: its subgroups (under mu); a subgroup: next */
  lpost posts[];       /* [world] */
} lgroup;

/* One rank's communicator; c first so that the sg_comm pointer is the allocation. */
typedef struct lcomm {
  sg_comm c;
  lgroup *g;
  int ordinal;        /* a channel: its device's GPU (-1: host memory) */
  const void *srcs[]; /* [world]: per-call source pointers, kept here to avoid a malloc */
} lcomm;

static lgroup *group_of(const sg_comm *c) { return ((const lcomm *)c)->g; }

static size_t elem_size(int dtype) { return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : 2u; }

/* Marks the group broken (first reason wins) and wakes every waiter. Caller holds g->mu. */
static void break_locked(lgroup *g, int rank, const char *why) {
  if (g->broken) return;
  g->broken = 1;
  g->broken_rank = rank;
  snprintf(g->broken_why, sizeof g->broken_why, "%s", why);
  pthread_cond_broadcast(&g->cv);
}

static void break_group(lgroup *g, int rank, const char *why) {
  pthread_mutex_lock(&g->mu);
  break_locked(g, rank, why);
  pthread_mutex_unlock(&g->mu);
}

/* The early check of every collective; peers set the flag under the mutex at any time. */
static int group_is_broken(lgroup *g) {
  pthread_mutex_lock(&g->mu);
  const int b = g->broken;
  pthread_mutex_unlock(&g->mu);
  return b;
}

/* Fails this rank because the group is broken (by a peer or by itself earlier). */
static sg_status fail_broken(sg_comm *c, const char *fn) {
  lgroup *g = group_of(c);
  char why[96];
  int who;
  pthread_mutex_lock(&g->mu);
  who = g->broken_rank;
  memcpy(why, g->broken_why, sizeof why);
  pthread_mutex_unlock(&g->mu);
  return sg__comm_fail(c, SG_ERR_COMM, fn, "peer rank %d %s", who, why);
}

/* Waits on the condition until woken or the deadline passes; returns ETIMEDOUT on expiry. */
static int wait_until(lgroup *g, int64_t deadline_ms) {
  if (deadline_ms == INT64_MAX) return pthread_cond_wait(&g->cv, &g->mu);
  struct timespec ts;
  ts.tv_sec = (time_t)(deadline_ms / 1000);
  ts.tv_nsec = (long)(deadline_ms % 1000) * 1000000L;
  return pthread_cond_timedwait(&g->cv, &g->mu, &ts);
}

/* Data phases. A rank that fails or times out must not return while a peer may still read its
 * buffer (the caller could free it). The barrier that starts a data phase sets busy = world;
 * each rank leaving the phase (next barrier, or failure) decrements it; a failing barrier
 * waits for busy == 0. That wait is bounded: ranks in a data phase only copy and add. */
static void leave_data_locked(lgroup *g) {
  if (--g->busy == 0) pthread_cond_broadcast(&g->cv);
}

static void leave_data(lgroup *g) {
  pthread_mutex_lock(&g->mu);
  leave_data_locked(g);
  pthread_mutex_unlock(&g->mu);
}

/* Barrier with a deadline. `leaving`: this rank ends a data phase here; `entering`: a data
 * phase follows. The generation is checked before the broken flag: a rank released by the last
 * arrival succeeds even if someone breaks the group right after. */
static sg_status barrier(sg_comm *c, const char *fn, int64_t deadline_ms, int leaving,
                         int entering) {
  lgroup *g = group_of(c);
  int state = 0; /* 0 ok, 1 peer broke it, 2 this rank timed out */
  pthread_mutex_lock(&g->mu);
  if (leaving) leave_data_locked(g);
  if (g->broken) {
    state = 1;
  } else if (++g->arrived == g->world) {
    g->arrived = 0;
    g->gen++;
    if (entering) g->busy = g->world;
    pthread_cond_broadcast(&g->cv);
  } else {
    const uint64_t gen = g->gen;
    while (g->gen == gen && !g->broken) {
      if (wait_until(g, deadline_ms) == ETIMEDOUT && g->gen == gen && !g->broken) {
        break_locked(g, c->rank, "timed out waiting for its peers");
        state = 2;
        break;
      }
    }
    if (state == 0 && g->gen == gen) state = 1;
  }
  const int arrived = g->arrived;
  if (state != 0)
    while (g->busy > 0) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
  if (state == 1) return fail_broken(c, fn);
  if (state == 2)
    return sg__comm_fail(c, SG_ERR_TIMEOUT, fn,
                         "deadline passed with %d of %d ranks at the rendezvous (rank %d waited)",
                         arrived, g->world, c->rank);
  return SG_OK;
}

/* After the first barrier: every rank compares all posts with rank 0's, so all ranks reach
 * the same verdict from the same data and fail together. */
static sg_status check_posts(sg_comm *c, const char *fn) {
  lgroup *g = group_of(c);
  const lpost *p0 = &g->posts[0];
  for (int k = 1; k < g->world; k++) {
    const lpost *p = &g->posts[k];
    if (p->ordinal != p0->ordinal) {
      break_group(g, k, "is on another device");
      leave_data(g);
      c->broken = 1;
      return sg__err(SG_ERR_UNSUPPORTED,
                     "%s: local ranks must share one device: rank 0 is on %s %d, rank %d on %s "
                     "%d (ranks read each other's buffers; use NCCL for one rank per GPU); "
                     "communicator now broken",
                     fn, p0->ordinal < 0 ? "host" : "GPU", p0->ordinal, k,
                     p->ordinal < 0 ? "host" : "GPU", p->ordinal);
    }
    if (p->op == p0->op && p->count == p0->count && p->dtype == p0->dtype && p->root == p0->root)
      continue;
    break_group(g, k, "called a mismatched collective");
    leave_data(g); /* no data phase follows */
    c->broken = 1;
    return sg__err(SG_ERR_MISMATCH,
                   "%s: ranks disagree: rank 0 called %s(count=%zu, dtype=%d, root=%d), rank %d "
                   "called %s(count=%zu, dtype=%d, root=%d); communicator now broken",
                   fn, op_name(p0->op), p0->count, p0->dtype, p0->root, k, op_name(p->op), p->count,
                   p->dtype, p->root);
  }
  return SG_OK;
}

/* Invalid arguments on one rank: the others would wait for it until their deadline, so the
 * group is broken now and they fail at once. */
static sg_status fail_args(sg_comm *c, const char *what) {
  break_group(group_of(c), c->rank, what);
  c->broken = 1;
  return SG_ERR_INVALID_ARGUMENT; /* the text is already set */
}

/* CPU and host buffers run the host loops directly. Other devices get their own kernel and copy
 * (they must complete them before returning for the barrier to order them). */
static int host_path(const sg_comm *c) { return !c->dev || c->dev->kind == SG_DEVICE_CPU; }

static sg_status lreduce(sg_comm *c, void *dst, const void *const *srcs, int n, int dtype,
                         size_t count) {
  if (count == 0) return SG_OK;
  if (host_path(c)) {
    sg__cpu_reduce_sum(dst, srcs, n, dtype, count);
    return SG_OK;
  }
  return c->dev->ops->reduce_sum(c->dev, SG_Q_COMM, dst, srcs, n, dtype, count);
}

static sg_status lcopy(sg_comm *c, void *dst, const void *src, size_t bytes) {
  if (bytes == 0 || dst == src) return SG_OK;
  if (host_path(c)) {
    memcpy(dst, src, bytes);
    return SG_OK;
  }
  return c->dev->ops->copy(c->dev, SG_Q_COMM, dst, src, bytes, SG_COPY_D2D);
}

/* Chunk k of an all-reduce of n elements over w ranks: near-equal, the first n % w one longer. */
static void chunk_of(size_t n, int w, int k, size_t *off, size_t *len) {
  const size_t base = n / (size_t)w, rem = n % (size_t)w, kk = (size_t)k;
  *off = kk * base + (kk < rem ? kk : rem);
  *len = base + (kk < rem ? 1u : 0u);
}

/* Posts this rank's call and meets the others; on return every post is readable. */
static sg_status rendezvous(sg_comm *c, const char *fn, const lpost *mine, int64_t deadline_ms) {
  lgroup *g = group_of(c);
  g->posts[c->rank] = *mine;
  g->posts[c->rank].ordinal = ((const lcomm *)c)->ordinal;
  SG_TRY(barrier(c, fn, deadline_ms, 0, 1));
  return check_posts(c, fn);
}

/* A failure in the data phase: peers are at (or heading to) the last barrier; break the group
 * so that they do not wait for this rank. */
static sg_status fail_data(sg_comm *c, const char *fn, sg_status st) {
  lgroup *g = group_of(c);
  pthread_mutex_lock(&g->mu);
  break_locked(g, c->rank, "failed in a local copy or reduction");
  leave_data_locked(g);
  while (g->busy > 0) pthread_cond_wait(&g->cv, &g->mu); /* peers may still read our buffer */
  pthread_mutex_unlock(&g->mu);
  c->broken = 1;
  return sg__err_prefix(st, fn);
}

/* Arguments shared by every collective; fills the error text on failure. */
static sg_status check_common(sg_comm *c, const char *fn, const void *buf, size_t count, int dtype,
                              int any_dtype) {
  if (!any_dtype && !(sg__dtype_valid(dtype) || dtype == SG__F64))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown dtype (%d)", fn, dtype);
  const size_t es = any_dtype ? 1u : elem_size(dtype);
  if (count > SIZE_MAX / es / (size_t)c->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: count too large (%zu)", fn, count);
  if (!buf && count > 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: buf is NULL (count %zu)", fn, count);
  return SG_OK;
}

/* The start of every collective: the communicator usable, the call counted (reduce-scatter and
 * all-gather: all world slices), the group still healthy, the arguments valid (a failure breaks
 * the group for the peers), then the rendezvous. */
static sg_status enter(sg_comm *c, const char *fn, const lpost *mine, int64_t deadline_ms) {
  SG_TRY(sg__comm_usable(c, fn));
  /* gathers and broadcasts count bytes, once (not per rank) */
  const int a2a = mine->op == OP_ALL_TO_ALL;
  const int bytes = mine->op == OP_ALL_GATHER || mine->op == OP_BROADCAST || a2a;
  const int slices = mine->op == OP_REDUCE_SCATTER || mine->op == OP_ALL_GATHER || a2a;
  const size_t b = bytes ? mine->count : mine->count * elem_size(mine->dtype);
  sg__comm_count(c, a2a ? SG__COUNT_ALL_GATHER : mine->op, slices ? (size_t)c->world * b : b,
                 mine->root);
  if (group_is_broken(group_of(c))) return fail_broken(c, fn);
  if (mine->op == OP_BROADCAST && (mine->root < 0 || mine->root >= c->world)) {
    sg__err(SG_ERR_INVALID_ARGUMENT, "%s: root out of range (%d, world %d)", fn, mine->root,
            c->world);
    return fail_args(c, "passed invalid arguments");
  }
  if (check_common(c, fn, mine->buf, mine->count, mine->dtype, bytes) != SG_OK)
    return fail_args(c, "passed invalid arguments");
  return rendezvous(c, fn, mine, deadline_ms);
}

/* Elements [off, off + len) of every rank's buffer reduced into this rank's; dst aliases
 * srcs[rank], which reduce_sum allows (others read only their own slices meanwhile). */
static sg_status reduce_slice(sg_comm *c, const lpost *mine, size_t off, size_t len) {
  const lgroup *g = group_of(c);
  if (g->world == 1) return SG_OK; /* the sum of one buffer is that buffer: no pass over it */
  const size_t es = elem_size(mine->dtype);
  const void **srcs = ((lcomm *)c)->srcs;
  for (int k = 0; k < g->world; k++) srcs[k] = (const char *)g->posts[k].buf + off * es;
  return lreduce(c, (char *)mine->buf + off * es, srcs, g->world, mine->dtype, len);
}

static sg_status local_all_reduce(sg_comm *c, void *buf, size_t count, int dtype,
                                  int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) all_reduce";
  const lpost mine = {buf, count, OP_ALL_REDUCE, dtype, -1, -1};
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  lgroup *g = group_of(c);
  const size_t es = elem_size(dtype);
  size_t off, len;
  /* phase 1: this rank reduces its chunk into its own buffer */
  chunk_of(count, g->world, c->rank, &off, &len);
  sg_status st = reduce_slice(c, &mine, off, len);
  if (st != SG_OK) return fail_data(c, fn, st);
  SG_TRY(barrier(c, fn, deadline_ms, 1, 1));
  /* phase 2: copy every other chunk from its owner: all ranks end with the same bits */
  for (int k = 0; k < g->world; k++) {
    if (k == c->rank) continue;
    chunk_of(count, g->world, k, &off, &len);
    st = lcopy(c, (char *)buf + off * es, (const char *)g->posts[k].buf + off * es, len * es);
    if (st != SG_OK) return fail_data(c, fn, st);
  }
  return barrier(c, fn, deadline_ms, 1, 0);
}

static sg_status local_reduce_scatter(sg_comm *c, void *buf, size_t count, int dtype,
                                      int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) reduce_scatter";
  const lpost mine = {buf, count, OP_REDUCE_SCATTER, dtype, -1, -1};
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  const sg_status st = reduce_slice(c, &mine, (size_t)c->rank * count, count); /* slice r */
  if (st != SG_OK) return fail_data(c, fn, st);
  return barrier(c, fn, deadline_ms, 1, 0);
}

/* Slice r of every rank's buffer summed straight into the accumulator: nobody writes a buffer. */
static sg_status local_reduce_scatter_fold(sg_comm *c, void *buf, size_t count, int dtype,
                                           const sg__fold *f, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) reduce_scatter_fold";
  const lpost mine = {buf, count, OP_REDUCE_SCATTER, dtype, -1, -1};
  if (c && (!host_path(c) || sg__comm_fold_check(fn, dtype, count, f) != SG_OK)) {
    SG_TRY(sg__comm_usable(c, fn));
    if (!host_path(c)) sg__err(SG_ERR_INVALID_ARGUMENT, "%s: device memory (host memory only)", fn);
    return fail_args(c, "passed invalid arguments");
  }
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  const lgroup *g = group_of(c);
  const size_t es = elem_size(dtype), off = (size_t)c->rank * count;
  const void **srcs = ((lcomm *)c)->srcs;
  for (int k = 0; k < g->world; k++) srcs[k] = (const char *)g->posts[k].buf + off * es;
  sg__cpu_reduce_fold(f->acc, f->acc_dtype, srcs, NULL, g->world, dtype, count, f->first);
  return barrier(c, fn, deadline_ms, 1, 0);
}

static sg_status local_all_gather(sg_comm *c, void *buf, size_t bytes, int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) all_gather";
  const lpost mine = {buf, bytes, OP_ALL_GATHER, 0, -1, -1};
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  lgroup *g = group_of(c);
  /* slice k is read from its owner, where nobody writes it */
  for (int k = 0; k < g->world; k++) {
    if (k == c->rank) continue;
    const size_t off = (size_t)k * bytes;
    const sg_status st = lcopy(c, (char *)buf + off, (const char *)g->posts[k].buf + off, bytes);
    if (st != SG_OK) return fail_data(c, fn, st);
  }
  return barrier(c, fn, deadline_ms, 1, 0);
}

/* Slice `rank` of every peer's send buffer into slot k of this rank's own recv buffer, which
 * nobody else reads (a bound device's copies on its memory); the closing barrier keeps the send
 * buffers until every rank copied. */
static sg_status local_all_to_all(sg_comm *c, const void *send, void *recv, size_t bytes,
                                  int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) all_to_all";
  const lpost mine = {(void *)send, bytes, OP_ALL_TO_ALL, 0, -1, -1};
  if (c && bytes > 0 && !recv) {
    SG_TRY(sg__comm_usable(c, fn));
    sg__err(SG_ERR_INVALID_ARGUMENT, "%s: recv is NULL", fn);
    return fail_args(c, "passed invalid arguments");
  }
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  const lgroup *g = group_of(c);
  const size_t mine_off = (size_t)c->rank * bytes;
  for (int k = 0; k < g->world && bytes > 0; k++) {
    const sg_status st = lcopy(c, (char *)recv + (size_t)k * bytes,
                               (const char *)g->posts[k].buf + mine_off, bytes);
    if (st != SG_OK) return fail_data(c, fn, st);
  }
  return barrier(c, fn, deadline_ms, 1, 0);
}

static sg_status local_broadcast(sg_comm *c, void *buf, size_t bytes, int root,
                                 int64_t deadline_ms) {
  static const char fn[] = "sg_comm(local) broadcast";
  const lpost mine = {buf, bytes, OP_BROADCAST, 0, root, -1};
  SG_TRY(enter(c, fn, &mine, deadline_ms));
  if (c->rank != root) {
    const sg_status st = lcopy(c, buf, group_of(c)->posts[root].buf, bytes);
    if (st != SG_OK) return fail_data(c, fn, st);
  }
  return barrier(c, fn, deadline_ms, 1, 0);
}

static void group_free(lgroup *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
  free(g);
}

/* The last communicator of the group frees it, and its subgroups. An earlier one breaks it: a
 * rank that is gone can never join another collective, so peers fail at once instead of at
 * their deadline. */
static void local_destroy(sg_comm *c) {
  lgroup *g = group_of(c);
  pthread_mutex_lock(&g->mu);
  const int left = --g->refs;
  if (left > 0) break_locked(g, c->rank, "destroyed its communicator");
  pthread_mutex_unlock(&g->mu);
  if (left == 0) {
    while (g->subs) {
      lgroup *sub = g->subs;
      g->subs = sub->subs;
      group_free(sub);
    }
    group_free(g);
  }
  free(c);
}

static sg_status group_create(int world, lgroup **out);

/* Subgroup `index` of the base group: the first rank to bind that channel makes it. */
static sg_status subgroup(lgroup *base, uint64_t index, lgroup **out) {
  sg_status st = SG_OK;
  pthread_mutex_lock(&base->mu);
  lgroup *g = base->subs;
  while (g && g->index != index) g = g->subs;
  if (!g && (st = group_create(base->world, &g)) == SG_OK) {
    g->index = index;
    g->subs = base->subs;
    base->subs = g;
  }
  pthread_mutex_unlock(&base->mu);
  *out = g;
  return st;
}

static const sg__comm_ops local_ops;

static sg_status local_bind(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms,
                            sg_comm **chan) {
  lgroup *g = group_of(c);
  if (index > 0) SG_TRY(subgroup(g, index, &g));
  const int world = c->world;
  lcomm *lc = calloc(1, sizeof *lc + (size_t)world * sizeof(const void *));
  if (!lc) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm(local) bind: out of memory");
  sg__comm_channel_init(&lc->c, c, &local_ops, dev, lc);
  lc->g = g;
  lc->ordinal = -1;
  if (dev) {
    /* host-driven: reads of the peers' buffers between barriers, on any thread */
    const sg__comm_attach a = {0, 1, NULL, NULL, NULL, timeout_ms};
    sg__comm_native native;
    const sg_status st = dev->ops->comm_attach(dev, &a, &native);
    if (st != SG_OK) {
      free(lc);
      return st;
    }
    lc->ordinal = native.ordinal;
  }
  *chan = &lc->c;
  return SG_OK;
}

/* Subgroups stay with the base group (a peer may still be in one of their collectives). */
static void local_unbind(sg_comm *chan) {
  if (chan->dev) chan->dev->ops->comm_detach(chan->dev);
  free(chan);
}

static const sg__comm_ops local_ops = {
    "local",         local_all_reduce, local_reduce_scatter, local_all_gather,
    local_broadcast, local_bind,       local_unbind,         local_destroy,
    sg__comm_split_threads, NULL, /* node_leader: by host name (all threads share one) */
    local_reduce_scatter_fold, local_all_to_all,
    NULL, /* reduce_scatter_to: the engine's fold (reduce_scatter_fold) serves host memory */
    1 /* all_to_all_device */,
};

static sg_status group_create(int world, lgroup **out) {
  lgroup *g = calloc(1, sizeof *g + (size_t)world * sizeof(lpost));
  pthread_condattr_t ca;
  int cond_ok = 0;
  if (!g)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm_create_local: out of memory (world %d)", world);
  if (pthread_condattr_init(&ca) == 0) {
    cond_ok =
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&g->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
  }
  if (!cond_ok) goto fail;
  if (pthread_mutex_init(&g->mu, NULL) != 0) {
    pthread_cond_destroy(&g->cv);
    goto fail;
  }
  g->world = world;
  g->refs = world;
  *out = g;
  return SG_OK;
fail:
  free(g);
  return sg__err_at(SG_ERR_INTERNAL, __FILE__, __LINE__,
                    "sg_comm_create_local: pthread mutex/cond init failed");
}

sg_status sg_comm_create_local(int world, sg_comm **comms) {
  if (!comms) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local: comms is NULL");
  if (world < 1 || world > 4096)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_local: world must be in 1..4096 (%d)",
                   world);
  for (int r = 0; r < world; r++) comms[r] = NULL;
  lgroup *g = NULL;
  SG_TRY(group_create(world, &g));
  for (int r = 0; r < world; r++) {
    lcomm *lc = calloc(1, sizeof *lc + (size_t)world * sizeof(const void *));
    if (!lc) goto fail;
    lc->c.ops = &local_ops;
    lc->c.rank = r;
    lc->c.world = world;
    lc->c.threaded = 1;
    lc->c.impl = lc;
    lc->g = g;
    lc->ordinal = -1;
    comms[r] = &lc->c;
  }
  return SG_OK;
fail:
  for (int r = 0; r < world; r++) {
    free(comms[r]);
    comms[r] = NULL;
  }
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
  free(g);
  return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_comm_create_local: out of memory (world %d)", world);
}
