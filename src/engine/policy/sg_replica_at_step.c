/* The at-step replica transport (DESIGN.md section 1, "Hybrid engines"): an offloaded
 * accumulator (pinned host memory, sg_state_host.c). A slice is complete only once its arrivals
 * are folded on the host, so the sums across replicas are claimed in the last micro-batch but
 * run at the step, after the state's settle (every arrival landed and folded), on the host
 * slices, with the channel bound without a device: no overlap with the backward pass. With a
 * codec (int8, int4) each slice's sum is the codec's exchange (sg_replica_codec.c) instead,
 * its codes made on the host by the CPU device select made for it (rep.elem_dev = host_dev),
 * its residuals and buffers in the pinned replica buffer: the CPU engine's bits. */
#include "../../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_cast: the wire on the host */
#include "sg_replica_policy.h"

/* Bucket b's host slice summed over the replicas, in place, through the host wire buffer when
 * the wire dtype differs (the host's casts: the element math of the device's). */
static sg_status host_reduce(sg_engine *e, int b) {
  sg_comm *c = e->rep.comm;
  const int adt = e->cfg.accum_dtype, wdt = e->cfg.replica_reduce_dtype;
  const size_t n = sg__plan_slice_numel(e->plan, b);
  char *acc = sg__accum_of(e, b);
  const int64_t dl = sg__deadline(e->cfg.timeout_ms);
  if (!e->rep.wire) return c->ops->all_reduce(c, acc, n, adt, dl);
  sg__cpu_cast(e->rep.wire, wdt, acc, adt, n);
  SG_TRY(c->ops->all_reduce(c, e->rep.wire, n, wdt, dl));
  sg__cpu_cast(acc, adt, e->rep.wire, wdt, n);
  return SG_OK;
}

static sg_status finish_with(sg_engine *e, sg_status (*reduce)(sg_engine *e, int b)) {
  int late = 0;
  for (int b = 0; b < e->plan->nbuckets; b++) late += e->rep.claimed[b] == SG__CLAIM_AT_STEP;
  if (late) SG_TRY(sg__engine_broken(e, e->strat->place->settle(e)));
  for (int b = 0; b < e->plan->nbuckets; b++)
    if (e->rep.claimed[b] == SG__CLAIM_AT_STEP) SG_TRY(sg__replica_submit(e, b, reduce));
  return SG_OK;
}

static sg_status at_step_finish(sg_engine *e) { return finish_with(e, host_reduce); }

static sg_status codec_finish(sg_engine *e) { return finish_with(e, sg__replica_codec_reduce); }

static sg_status int8_prepare(sg_engine *e) {
  return sg__replica_codec_prepare(e, 8, 0, SG__REP_RESID);
}

static sg_status int4_prepare(sg_engine *e) {
  return sg__replica_codec_prepare(e, 4, 0, SG__REP_RESID);
}

const sg__replica_ops sg__replica_at_step = {
    .name = "at-step", SG__REPLICA_ENTRIES, .share_scratch = 0,
    .prepare = sg__replica_no_prepare, .release = sg__replica_no_release,
    .claim = sg__replica_claim_at_step, .finish = at_step_finish, .run = sg__replica_run_comm,
    .drain = sg__replica_no_drain, SG__REPLICA_EVERY_STEP, SG__REPLICA_NO_CK,
};

/* The host collectives take host memory: the shard channel's scratch (device memory) is not
 * shared. */
#define AT_STEP_CODEC                                                                              \
  SG__REPLICA_ENTRIES, .share_scratch = 0, .release = sg__replica_codec_release_queue,             \
  .claim = sg__replica_claim_at_step, .finish = codec_finish, .run = sg__replica_run_comm,         \
  .drain = sg__replica_no_drain, SG__REPLICA_EVERY_STEP, SG__REPLICA_CODEC_CK

const sg__replica_ops sg__replica_at_step_int8 = {
    .name = "at-step, int8 codes", .prepare = int8_prepare, AT_STEP_CODEC,
};

const sg__replica_ops sg__replica_at_step_int4 = {
    .name = "at-step, int4 codes", .prepare = int4_prepare, AT_STEP_CODEC,
};
