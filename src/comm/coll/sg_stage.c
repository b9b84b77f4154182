/* Device buffers for host collectives through pinned host memory (sg_stage.h). */
#include "sg_stage.h"

#include <stdio.h> /* snprintf */

#include "sg_coll.h" /* sg__coll_check */

enum { ST_ALL_REDUCE, ST_REDUCE_SCATTER, ST_ALL_GATHER, ST_BROADCAST, ST_ALL_TO_ALL };

static size_t elem_size(int dtype) { return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : 2u; }

int sg__stage_needed(const sg_comm *c) {
  return c && c->dev && c->dev->kind != SG_DEVICE_CPU;
}

/* What a staged call copies down before and back up after the host collective, in bytes from
 * the start of the buffer (the same offsets in the copy), and the fp32 scratch it needs next to
 * the copy. all_to_all, out of place: send copied down to the copy's start, recv back from
 * `total` bytes further (up_from), the host collective between the two halves. */
typedef struct stage_plan {
  int op;
  size_t count; /* elements (reductions) or bytes per rank (all_gather, broadcast, all_to_all) */
  int dtype, root;
  int64_t deadline_ms;
  size_t total, down_off, down_len, up_off, up_len, scratch;
  size_t up_from; /* where in the copy the part copied back begins */
} stage_plan;

static sg_status run_host(sg_comm *c, const sg__comm_ops *host, void *h, const stage_plan *p) {
  switch (p->op) {
    case ST_REDUCE_SCATTER: return host->reduce_scatter(c, h, p->count, p->dtype, p->deadline_ms);
    case ST_ALL_REDUCE: return host->all_reduce(c, h, p->count, p->dtype, p->deadline_ms);
    case ST_ALL_GATHER: return host->all_gather(c, h, p->count, p->deadline_ms);
    case ST_ALL_TO_ALL:
      return host->all_to_all(c, h, (unsigned char *)h + p->up_from, p->count, p->deadline_ms);
    default: return host->broadcast(c, h, p->count, p->root, p->deadline_ms);
  }
}

/* Pinned memory from the bound device, grown to a multiple of 1 MiB. */
static sg_status stage_reserve(sg_comm *c, sg__stage *s, size_t bytes) {
  if (s->cap >= bytes) return SG_OK;
  const size_t cap = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
  void *p = NULL;
  SG_TRY(c->dev->ops->host_alloc(c->dev, cap, &p));
  if (s->buf && !s->lost) c->dev->ops->host_free(c->dev, s->buf);
  s->buf = p;
  s->cap = cap;
  s->lost = 0;
  return SG_OK;
}

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

/* src: the device memory copied down; dst: copied back into (the same buffer but for
 * all_to_all). */
static sg_status staged(sg_comm *c, sg__stage *s, const sg__comm_ops *host, const char *fn,
                        const void *src, void *dst, const stage_plan *p) {
  const size_t copy = p->op == ST_ALL_TO_ALL ? 2 * p->total : p->total;
  const size_t at = (copy + 63) & ~(size_t)63; /* scratch after the copy, aligned */
  sg_status st = stage_reserve(c, s, at + p->scratch);
  if (st != SG_OK) return stage_failed(c, fn, st);
  unsigned char *h = s->buf, *d = dst;
  const unsigned char *from = src;
  if ((st = stage_copy(c, h + p->down_off, from + p->down_off, p->down_len, SG_COPY_D2H)))
    return stage_failed(c, fn, st);
  void *dev_scratch = c->scratch;
  const size_t dev_scratch_bytes = c->scratch_bytes;
  c->scratch = h + at; /* the host collective keeps its fp32 partials on the host too */
  c->scratch_bytes = p->scratch;
  st = run_host(c, host, h, p);
  c->scratch = dev_scratch;
  c->scratch_bytes = dev_scratch_bytes;
  if (st != SG_OK) {
    s->lost = c->broken; /* the transport may still write into it */
    return st;
  }
  st = stage_copy(c, d + p->up_off, h + p->up_from, p->up_len, SG_COPY_H2D);
  return st == SG_OK ? SG_OK : stage_failed(c, fn, st);
}

/* "sg_comm(<backend>) <op>" */
static const char *op_fn(const sg_comm *c, int op, char *out, size_t cap) {
  static const char *const names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                      "all_to_all"};
  snprintf(out, cap, "sg_comm(%s) %s", c && c->ops ? c->ops->name : "?", names[op]);
  return out;
}

sg_status sg__stage_reduce_scatter(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                                   size_t count, int dtype, int64_t deadline_ms) {
  char fn[64];
  op_fn(c, ST_REDUCE_SCATTER, fn, sizeof fn);
  SG_TRY(sg__coll_check(c, fn, buf, count, dtype, (size_t)c->world));
  const size_t slice = count * elem_size(dtype), total = slice * (size_t)c->world;
  const stage_plan p = {ST_REDUCE_SCATTER, count, dtype, 0, deadline_ms, total, 0, total,
                        (size_t)c->rank * slice, slice, count * 4u, (size_t)c->rank * slice};
  return staged(c, s, host, fn, buf, buf, &p);
}

sg_status sg__stage_all_reduce(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                               size_t count, int dtype, int64_t deadline_ms) {
  char fn[64];
  op_fn(c, ST_ALL_REDUCE, fn, sizeof fn);
  SG_TRY(sg__coll_check(c, fn, buf, count, dtype, 1));
  const size_t total = count * elem_size(dtype);
  const stage_plan p = {ST_ALL_REDUCE, count, dtype, 0, deadline_ms, total, 0, total, 0, total,
                        count * 4u, 0};
  return staged(c, s, host, fn, buf, buf, &p);
}

sg_status sg__stage_all_gather(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                               size_t bytes, int64_t deadline_ms) {
  char fn[64];
  op_fn(c, ST_ALL_GATHER, fn, sizeof fn);
  SG_TRY(sg__coll_check(c, fn, buf, bytes, -1, (size_t)c->world));
  const size_t total = bytes * (size_t)c->world;
  const stage_plan p = {ST_ALL_GATHER, bytes, -1, 0, deadline_ms, total, (size_t)c->rank * bytes,
                        bytes, 0, total, 0, 0};
  return staged(c, s, host, fn, buf, buf, &p);
}

sg_status sg__stage_broadcast(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                              size_t bytes, int root, int64_t deadline_ms) {
  char fn[64];
  op_fn(c, ST_BROADCAST, fn, sizeof fn);
  SG_TRY(sg__coll_check(c, fn, buf, bytes, -1, 1));
  /* an invalid root: the host collective reports it, nothing is copied */
  if (root < 0 || root >= c->world) return host->broadcast(c, buf, bytes, root, deadline_ms);
  const int mine = c->rank == root;
  const stage_plan p = {ST_BROADCAST, bytes, -1, root, deadline_ms, bytes, 0, mine ? bytes : 0, 0,
                        mine ? 0 : bytes, 0, 0};
  return staged(c, s, host, fn, buf, buf, &p);
}

/* Out of place through the two halves of the copy: every rank's send down (its own part
 * too: the host collective copies it across), recv back whole. */
sg_status sg__stage_all_to_all(sg_comm *c, sg__stage *s, const sg__comm_ops *host,
                               const void *send, void *recv, size_t bytes, int64_t deadline_ms) {
  char fn[64];
  op_fn(c, ST_ALL_TO_ALL, fn, sizeof fn);
  SG_TRY(sg__coll_check(c, fn, send, bytes, -1, (size_t)c->world));
  SG_TRY(sg__coll_check(c, fn, recv, bytes, -1, (size_t)c->world));
  const size_t total = bytes * (size_t)c->world;
  const stage_plan p = {ST_ALL_TO_ALL, bytes, -1, 0, deadline_ms, total, 0, total, 0, total, 0,
                        total};
  return staged(c, s, host, fn, send, recv, &p);
}

void sg__stage_free(sg_comm *c, sg__stage *s) {
  if (s->buf && !s->lost && c->dev) c->dev->ops->host_free(c->dev, s->buf);
  s->buf = NULL;
  s->cap = 0;
}
