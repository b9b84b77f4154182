/* The host-side pipelines of optimizer offload (sg_host_step.h). */
#include "sg_host_step.h"

#include <stdlib.h> /* realloc, free */
#include <string.h> /* memset */


/* ---- buffers and copy jobs ----------------------------------------------------------------- */

sg_status sg__host_pipe_init(sg__host_pipe *p, sg__device *d, size_t chunk, size_t out_esize) {
  static const char fn[] = "sg__host_pipe_init";
  if (!p || !d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL %s", fn, p ? "device" : "pipe");
  memset(p, 0, sizeof *p);
  if (out_esize != 2 && out_esize != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out element size %zu (2 or 4)", fn, out_esize);
  p->dev = d;
  p->chunk = chunk ? chunk : SG__HOST_PIPE_CHUNK;
  if (p->chunk > SIZE_MAX / 8)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: chunk of %zu elements", fn, p->chunk);
  p->out_esize = out_esize;
  sg_status st = SG_OK;
  for (int k = 0; k < SG__HOST_PIPE_NBUF && st == SG_OK; k++) {
    st = d->ops->host_alloc(d, p->chunk * out_esize, &p->out[k]);
    if (st == SG_OK) p->host_bytes += p->chunk * out_esize;
  }
  if (st != SG_OK) sg__host_pipe_free(p, INT64_MAX); /* nothing in flight yet */
  return st;
}

sg_status sg__host_pipe_drain(sg__host_pipe *p, int64_t deadline_ms) {
  if (!p || !p->dev) return SG_OK;
  uint64_t t = 0;
  for (int k = 0; k < SG__HOST_PIPE_NBUF; k++)
    if (p->out_ticket[k] > t) t = p->out_ticket[k];
  /* tickets complete in order: the latest one covers the others */
  sg_status st = t ? p->dev->ops->comm_wait(p->dev, t, deadline_ms) : SG_OK;
  if (st == SG_OK) memset(p->out_ticket, 0, sizeof p->out_ticket);
  return st;
}

void sg__host_pipe_free(sg__host_pipe *p, int64_t deadline_ms) {
  if (!p || !p->dev) return;
  /* A copy that did not finish in time may still read the buffer: keep it (a leak, not a
   * use after free). */
  const int drained = sg__host_pipe_drain(p, deadline_ms) == SG_OK;
  for (int k = 0; k < SG__HOST_PIPE_NBUF && drained; k++)
    if (p->out[k]) p->dev->ops->host_free(p->dev, p->out[k]);
  free(p->cseg);
  memset(p, 0, sizeof *p);
}

static sg_status copy_job_fn(void *arg) {
  const sg__host_copy *c = arg;
  return c->dev->ops->copy(c->dev, SG_Q_COMM, c->dst, c->src, c->bytes, c->kind);
}

/* Queues job *c (a buffer's own, not in flight) on the comm queue; its ticket in *ticket. */
static sg_status submit_copy(sg__host_pipe *p, sg__host_copy *c, void *dst, const void *src,
                             size_t bytes, sg__copy_kind kind, uint64_t *ticket) {
  *c = (sg__host_copy){p->dev, dst, src, bytes, kind};
  return p->dev->ops->comm_submit(p->dev, copy_job_fn, NULL, c, ticket);
}

/* Buffer k free again: its last copy completed. */
static sg_status reclaim(sg__host_pipe *p, uint64_t *ticket, int64_t deadline_ms) {
  if (*ticket == 0) return SG_OK;
  SG_TRY(p->dev->ops->comm_wait(p->dev, *ticket, deadline_ms));
  *ticket = 0;
  return SG_OK;
}

/* ---- update -------------------------------------------------------------------------------- */

static sg_status check_segs(const sg__optim_desc *od, const sg__update_args *a, const char *fn) {
  if (a->nsegs < 0 || (a->nsegs > 0 && !a->segs))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad segments (nsegs %d)", fn, a->nsegs);
  int missing = a->nsegs > 0 && (!a->grad || (a->param_dtype != SG_F32 && !a->master));
  for (int k = 0; a->nsegs > 0 && k < od->nstates; k++) missing |= !a->state[k];
  if (missing) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL optimizer state", fn);
  if (!sg__dtype_valid(a->param_dtype) || (a->grad_dtype != SG_F32 && a->grad_dtype != SG_BF16))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad dtype (param %d, grad %d)", fn,
                   a->param_dtype, a->grad_dtype);
  if (!sg__update_groups_ok(a))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: a segment's group is outside ngroups %d", fn,
                   a->ngroups);
  for (int s = 1; s < a->nsegs; s++)
    if (a->segs[s].flat_off < a->segs[s - 1].flat_off + a->segs[s - 1].len)
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: segment %d is not after segment %d", fn, s,
                     s - 1);
  return SG_OK;
}

static sg_status reserve_cseg(sg__host_pipe *p, int n) {
  if (n <= p->cseg_cap) return SG_OK;
  sg__seg *q = realloc(p->cseg, (size_t)n * sizeof *q);
  if (!q) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__host_pipe_update: out of host memory");
  p->cseg = q;
  p->cseg_cap = n;
  return SG_OK;
}

/* The parts of segments [*cur, nsegs) inside flat [c0, c1), rebased so that flat c0 is index 0
 * of the out buffer; the gaps between them are zeroed in out (unless NULL). Advances *cur past segments that
 * end inside the chunk. Returns the number of chunk segments. */
static int chunk_segs(sg__host_pipe *p, const sg__update_args *a, int *cur, size_t c0, size_t c1,
                      void *out) {
  int n = 0;
  size_t pos = c0; /* first flat index not yet covered */
  for (int s = *cur; s < a->nsegs && a->segs[s].flat_off < c1; s++) {
    sg__seg g = a->segs[s];
    const size_t b = g.flat_off > c0 ? g.flat_off : c0;
    const size_t e = g.flat_off + g.len < c1 ? g.flat_off + g.len : c1;
    if (out && b > pos) memset((char *)out + (pos - c0) * p->out_esize, 0, (b - pos) * p->out_esize);
    const size_t d = b - g.flat_off;
    g.shard_off += d;
    g.sr_index += d;
    g.flat_off = b - c0;
    g.len = e - b;
    p->cseg[n++] = g;
    pos = e;
    if (a->segs[s].flat_off + a->segs[s].len <= c1) *cur = s + 1;
  }
  if (out && pos < c1) memset((char *)out + (pos - c0) * p->out_esize, 0, (c1 - pos) * p->out_esize);
  return n;
}

/* Flat [c0, c1) of chunk c. */
static void chunk_range(const sg__host_pipe *p, size_t lo, size_t hi, size_t c, size_t *c0,
                        size_t *c1) {
  *c0 = lo + c * p->chunk;
  *c1 = hi - *c0 < p->chunk ? hi : *c0 + p->chunk;
}

/* f32 params keep no master: the chunk's working values come from the device first. */
static sg_status stage_in(sg__host_pipe *p, const void *dev_param, size_t lo, size_t hi, size_t c,
                          int64_t deadline_ms) {
  const int k = (int)(c % SG__HOST_PIPE_NBUF);
  size_t c0, c1;
  chunk_range(p, lo, hi, c, &c0, &c1);
  SG_TRY(reclaim(p, &p->out_ticket[k], deadline_ms));
  return submit_copy(p, &p->out_job[k], p->out[k], (const char *)dev_param + c0 * p->out_esize,
                     (c1 - c0) * p->out_esize, SG_COPY_D2H, &p->out_ticket[k]);
}

sg_status sg__host_pipe_update(sg__host_pipe *p, const sg__optim_desc *od,
                               const sg__update_args *a, void *dev_param, int64_t deadline_ms,
                               uint64_t *last) {
  static const char fn[] = "sg__host_pipe_update";
  if (last) *last = 0;
  if (!p || !p->dev || !od || !od->cpu_update || !a)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  SG_TRY(check_segs(od, a, fn));
  if (a->nsegs == 0) return SG_OK;
  if (!dev_param) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device buffer", fn);
  if (sg__dtype_size(a->param_dtype) != p->out_esize)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: param dtype %d does not fit the pipe", fn,
                   a->param_dtype);
  SG_TRY(reserve_cseg(p, a->nsegs)); /* a chunk holds at most every segment */
  const int copy_in = a->master == NULL;
  const size_t lo = a->segs[0].flat_off;
  const size_t hi = a->segs[a->nsegs - 1].flat_off + a->segs[a->nsegs - 1].len;
  const size_t nc = (hi - lo + p->chunk - 1) / p->chunk;
  if (copy_in) SG_TRY(stage_in(p, dev_param, lo, hi, 0, deadline_ms));
  int cur = 0;
  for (size_t c = 0; c < nc; c++) {
    const int k = (int)(c % SG__HOST_PIPE_NBUF);
    size_t c0, c1;
    chunk_range(p, lo, hi, c, &c0, &c1);
    if (copy_in && c + 1 < nc) SG_TRY(stage_in(p, dev_param, lo, hi, c + 1, deadline_ms));
    /* the buffer's last job: its H2D three chunks ago, or (copy_in) this chunk's D2H */
    SG_TRY(reclaim(p, &p->out_ticket[k], deadline_ms));
    sg__update_args ca = *a;
    ca.param = p->out[k];
    ca.segs = p->cseg;
    ca.nsegs = chunk_segs(p, a, &cur, c0, c1, copy_in ? NULL : p->out[k]);
    od->cpu_update(&ca);
    SG_TRY(submit_copy(p, &p->out_job[k], (char *)dev_param + c0 * p->out_esize, p->out[k],
                       (c1 - c0) * p->out_esize, SG_COPY_H2D, &p->out_ticket[k]));
    if (last) *last = p->out_ticket[k];
  }
  return SG_OK;
}
