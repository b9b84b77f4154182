/* The replica codecs (sg_replica_codec.c) on the CUDA device with NCCL inside the node and a
 * host-driven replica communicator (threads, MPI) across (DESIGN.md section 1, the table of
 * "Hybrid engines": codec-staged). The replica channel is bound to a CPU device of its own
 * (rep.host_dev, as the staged transport's) and takes host memory, so the codec's exchanges go
 * through a pinned stage (send and receive regions) and each bucket's two-stage sum is five
 * waited phases run from the caller's thread:
 *
 *   engine comm queue   stage 1's codes (encode), copied down into the stage's send regions
 *   host queue          all-to-all of the stage's send regions into its receive regions
 *   engine comm queue   the receive regions copied up, the owner's sum encoded (owner), its
 *                       region copied down
 *   host queue          all-gather of the stage's send regions
 *   engine comm queue   the send regions copied up, every chunk decoded (decode)
 *
 * The codes, residuals and their order are the codec's own, so the bits are the CPU engine's.
 * The per-step codecs claim each bucket for the step (no overlap with the backward pass, as
 * the at-step transport); outer steps with int8 codes (sg_replica_outer_staged.c) take the
 * same sum of their pseudo-gradient. The stage is communication staging like the staged
 * transport's, not counted in sg_memory. */
#include "sg_replica_policy.h"

/* The stage: the send regions, then the receive regions, of the largest bucket. */
sg_status sg__replica_codec_staged_stage(sg_engine *e) {
  size_t most = 0;
  for (int b = 0; b < e->plan->nbuckets; b++) {
    char *send, *recv;
    size_t region;
    sg__replica_codec_bufs(e, b, &send, &recv, &region);
    if (region > most) most = region;
  }
  const size_t bytes = 2u * (size_t)e->rep.n * most;
  return e->dev->ops->host_alloc(e->dev, bytes ? bytes : 1u, (void **)&e->rep.stage);
}

typedef struct {
  sg_engine *e;
  int b;
  float *x;
  char *send, *recv, *hsend, *hrecv; /* device regions, stage regions */
  size_t region, all;                /* a region's bytes, N of them */
} phase_job;

static sg_status copy(sg_engine *e, void *dst, const void *src, size_t bytes,
                      sg__copy_kind kind) {
  return e->dev->ops->copy(e->dev, sg__replica_elem_queue(e), dst, src, bytes, kind);
}

static sg_status encode_fn(void *arg) {
  const phase_job *j = arg;
  SG_TRY(sg__replica_codec_encode(j->e, j->b, j->x));
  return copy(j->e, j->hsend, j->send, j->all, SG_COPY_D2H);
}

static sg_status all_to_all_fn(void *arg) {
  const phase_job *j = arg;
  sg_comm *c = j->e->rep.comm;
  return c->ops->all_to_all(c, j->hsend, j->hrecv, j->region,
                            sg__deadline(j->e->cfg.timeout_ms));
}

static sg_status owner_fn(void *arg) {
  const phase_job *j = arg;
  const size_t mine = (size_t)j->e->rep.rank * j->region;
  SG_TRY(copy(j->e, j->recv, j->hrecv, j->all, SG_COPY_H2D));
  SG_TRY(sg__replica_codec_owner(j->e, j->b, j->x));
  return copy(j->e, j->hsend + mine, j->send + mine, j->region, SG_COPY_D2H);
}

static sg_status all_gather_fn(void *arg) {
  const phase_job *j = arg;
  sg_comm *c = j->e->rep.comm;
  return c->ops->all_gather(c, j->hsend, j->region, sg__deadline(j->e->cfg.timeout_ms));
}

static sg_status decode_fn(void *arg) {
  const phase_job *j = arg;
  SG_TRY(copy(j->e, j->send, j->hsend, j->all, SG_COPY_H2D));
  return sg__replica_codec_decode(j->e, j->b, j->x);
}

/* Bucket b's slice x (device memory) summed across replicas through the stage. */
sg_status sg__replica_codec_staged_sum(sg_engine *e, int b, float *x) {
  phase_job j = {e, b, x, NULL, NULL, NULL, NULL, 0, 0};
  sg__replica_codec_bufs(e, b, &j.send, &j.recv, &j.region);
  j.all = (size_t)e->rep.n * j.region;
  j.hsend = e->rep.stage;
  j.hrecv = e->rep.stage + j.all;
  SG_TRY(sg__engine_run_comm(e, encode_fn, &j));
  SG_TRY(sg__replica_staged_run(e, all_to_all_fn, &j));
  SG_TRY(sg__engine_run_comm(e, owner_fn, &j));
  SG_TRY(sg__replica_staged_run(e, all_gather_fn, &j));
  return sg__engine_run_comm(e, decode_fn, &j);
}

/* ---- the per-step codecs ------------------------------------------------------------------ */

static sg_status prepare(sg_engine *e, int bits) {
  SG_TRY(sg__replica_codec_prepare(e, bits, 0, SG__REP_RESID));
  return sg__replica_codec_staged_stage(e);
}

static sg_status int8_prepare(sg_engine *e) { return prepare(e, 8); }
static sg_status int4_prepare(sg_engine *e) { return prepare(e, 4); }

static sg_status finish(sg_engine *e) {
  for (int b = 0; b < e->plan->nbuckets; b++) {
    if (e->rep.claimed[b] != SG__CLAIM_AT_STEP) continue;
    SG_TRY(sg__replica_codec_staged_sum(e, b, (float *)sg__accum_of(e, b)));
    e->rep.claimed[b] = SG__CLAIM_BACK;
  }
  return SG_OK;
}

#define SG__CODEC_STAGED_OPS                                                                       \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .release = sg__replica_codec_release_queue,             \
  .claim = sg__replica_claim_at_step, .finish = finish, .run = sg__replica_staged_run,             \
  .drain = sg__replica_staged_drain, SG__REPLICA_EVERY_STEP, SG__REPLICA_CODEC_CK

const sg__replica_ops sg__replica_int8_staged = {
    .name = "staged, int8 codes", .prepare = int8_prepare, SG__CODEC_STAGED_OPS,
};
const sg__replica_ops sg__replica_int4_staged = {
    .name = "staged, 4-bit codes", .prepare = int4_prepare, SG__CODEC_STAGED_OPS,
};
