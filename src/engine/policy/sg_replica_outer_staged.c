/* Outer steps (cfg.outer_every, sg_replica_outer.c) on the CUDA device with NCCL inside the node
 * and a host-driven replica communicator (threads, MPI) across (DESIGN.md section 1, the table
 * of "Hybrid engines": outer-staged). The replica channel cannot sit beside the NCCL channel on
 * the device (one attachment runs its jobs one way), so it is bound to a CPU device of its own
 * (rep.host_dev: a host queue and its worker, as the staged transport's) and takes host memory.
 * An outer step runs after the step, where everything is waited for anyway, so each bucket goes
 * through three waited phases instead of one job:
 *
 *   1. engine comm queue: d = po - theta (the outer step's own piece), copied into a pinned
 *      stage;
 *   2. host queue: the stage summed over the replicas, fp32, or through the bf16/f16 wire cast
 *      on the host (sg__cpu_cast: the element math of the device's cast, so the same bits);
 *   3. engine comm queue: the sum copied back into d, the Nesterov step (outer_apply).
 *
 * then the node's gathers. Its state, checkpoints and bytes are the outer steps' own; the stage
 * (the largest run in fp32 and in the wire dtype) is communication staging like the staged
 * transport's, not counted in sg_memory. With int8 codes (sg__replica_outer_int8_staged) phase
 * 2 is the codec's staged sum (sg_replica_codec_staged.c) of d on the device, between the
 * delta and the step; its state and checkpoints are those of sg_replica_outer_int8.c. */
#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_cast: the wire on the host */
#include "sg_replica_policy.h"

/* The stage: the run in fp32, then (a narrower wire) in the wire dtype, 64-byte aligned. */
static size_t wire_at(size_t n) { return (n * sizeof(float) + 63u) / 64u * 64u; }

static sg_status staged_prepare(sg_engine *e) {
  SG_TRY(sg__replica_outer_prepare(e));
  const size_t n = sg__plan_max_slice_numel(e->plan);
  const int w = e->cfg.replica_reduce_dtype;
  const size_t bytes = wire_at(n) + (w == SG_F32 ? 0u : n * sg__dtype_size(w));
  return e->dev->ops->host_alloc(e->dev, bytes ? bytes : 1u, (void **)&e->rep.stage);
}

typedef struct {
  sg_engine *e;
  int b;
  size_t n; /* the run's values (phase 1) */
} phase_job;

/* Engine comm queue: the pseudo-gradient into d and down into the stage. */
static sg_status down_fn(void *arg) {
  phase_job *j = arg;
  sg_engine *e = j->e;
  float *d = sg__replica_outer_dbuf(e);
  SG_TRY(sg__replica_outer_delta(e, j->b, d, &j->n));
  return e->dev->ops->copy(e->dev, sg__replica_elem_queue(e), e->rep.stage, d,
                           j->n * sizeof(float), SG_COPY_D2H);
}

/* Host queue: the run summed over the replicas in the stage, as sg__replica_outer_wire_sum. */
static sg_status sum_fn(void *arg) {
  const phase_job *j = arg;
  sg_engine *e = j->e;
  sg_comm *c = e->rep.comm;
  const int w = e->cfg.replica_reduce_dtype;
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  float *h = (float *)e->rep.stage;
  if (w == SG_F32) return c->ops->all_reduce(c, h, j->n, SG_F32, dl);
  char *wire = e->rep.stage + wire_at(j->n);
  sg__cpu_cast(wire, w, h, SG_F32, j->n);
  SG_TRY(c->ops->all_reduce(c, wire, j->n, w, dl));
  sg__cpu_cast(h, SG_F32, wire, w, j->n);
  return SG_OK;
}

/* Engine comm queue: the sum back into d, then the bucket's Nesterov step. */
static sg_status up_fn(void *arg) {
  const phase_job *j = arg;
  sg_engine *e = j->e;
  float *d = sg__replica_outer_dbuf(e);
  SG_TRY(e->dev->ops->copy(e->dev, sg__replica_elem_queue(e), d, e->rep.stage,
                           j->n * sizeof(float), SG_COPY_H2D));
  return sg__replica_outer_apply(e, j->b, d);
}

static sg_status staged_sync(sg_engine *e) {
  for (int b = 0; b < e->plan->nbuckets; b++) {
    phase_job j = {e, b, 0};
    SG_TRY(sg__engine_run_comm(e, down_fn, &j));
    SG_TRY(sg__replica_staged_run(e, sum_fn, &j));
    SG_TRY(sg__engine_run_comm(e, up_fn, &j));
  }
  return sg__replica_outer_gather(e, 0, 1);
}

/* ---- with int8 codes: the pseudo-gradient through the codec's staged sum ---------------- */

static sg_status int8_prepare(sg_engine *e) {
  SG_TRY(sg__replica_outer_int8_prepare(e));
  return sg__replica_codec_staged_stage(e);
}

static sg_status delta_fn(void *arg) {
  phase_job *j = arg;
  return sg__replica_outer_delta(j->e, j->b, sg__replica_outer_dbuf(j->e), &j->n);
}

static sg_status apply_fn(void *arg) {
  const phase_job *j = arg;
  return sg__replica_outer_apply(j->e, j->b, sg__replica_outer_dbuf(j->e));
}

static sg_status int8_sync(sg_engine *e) {
  for (int b = 0; b < e->plan->nbuckets; b++) {
    phase_job j = {e, b, 0};
    SG_TRY(sg__engine_run_comm(e, delta_fn, &j));
    SG_TRY(sg__replica_codec_staged_sum(e, b, sg__replica_outer_dbuf(e)));
    SG_TRY(sg__engine_run_comm(e, apply_fn, &j));
  }
  return sg__replica_outer_gather(e, 0, 1);
}

#define SG__OUTER_STAGED_OPS                                                                       \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .claim = sg__replica_outer_claim,                       \
  .finish = sg__replica_outer_finish, .run = sg__replica_staged_run,                               \
  .drain = sg__replica_staged_drain, .grad_replicas = sg__replica_outer_grad_replicas,             \
  .sync_due = sg__replica_outer_due

const sg__replica_ops sg__replica_outer_staged = {
    .name = "staged, outer steps", SG__OUTER_STAGED_OPS, .prepare = staged_prepare,
    .release = sg__replica_staged_release, .sync = staged_sync,
    .ck_describe = sg__replica_outer_describe, .ck_save = sg__replica_outer_save,
    .restore = sg__replica_outer_restore,
};

const sg__replica_ops sg__replica_outer_int8_staged = {
    .name = "staged, outer steps, int8 codes", SG__OUTER_STAGED_OPS, .prepare = int8_prepare,
    .release = sg__replica_codec_release_queue, .sync = int8_sync,
    .ck_describe = sg__replica_outer_int8_describe, .ck_save = sg__replica_outer_int8_save,
    .restore = sg__replica_outer_int8_restore,
};
