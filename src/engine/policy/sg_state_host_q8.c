/* 8-bit optimizer state with optimizer offload (cfg.optim_state_dtype SG_Q8 and
 * offload_optimizer on the CUDA device; DESIGN.md sections 4 and 10): the host placement
 * (sg_state_host.c: the master and the accumulator in pinned host memory, the slices arriving
 * D2H, the norm and the update on the CPU, each bucket's working values H2D before its gather)
 * with the optimizer's state in the 8-bit blocks of sg_state_q8.c, which allocates them in
 * pinned host memory here and cuts the update's segments at its blocks. The CPU runs the 8-bit
 * loop (the optimizer's q8 variant, kernels/cpu/sg_cpu_q8.c): the bits of the CPU device's
 * 8-bit engine. */
#include "../../offload/sg_offload.h"
#include "sg_policy.h"

/* The offloaded master and accumulator without fp32 state arrays, then the 8-bit arrays; the
 * two together are the layout's host_bytes. */
static sg_status init(sg_engine *e) {
  size_t q8_bytes = 0;
  SG_TRY(sg__state_q8_make_host(e, &q8_bytes));
  sg_status st = sg__state_host_make(e, NULL, q8_bytes);
  /* the pipeline's chunks must not cut a block: the 8-bit loop takes whole blocks' segments */
  if (st == SG_OK && e->off->pipe.chunk % SG__Q8_BLOCK)
    st = sg__err(SG_ERR_INTERNAL, "sg_finalize: the host pipeline's chunk of %zu elements is "
                 "not a multiple of the 8-bit state's blocks", e->off->pipe.chunk);
  if (st != SG_OK) {
    sg__state_host.free(e);
    sg__state_q8_free(e);
  }
  return st;
}

/* The offloaded state first: its free waits for the copies in flight. */
static void state_free(sg_engine *e) {
  sg__state_host.free(e);
  sg__state_q8_free(e);
}

/* The host update of the 8-bit blocks. */
static sg_status update(sg_engine *e, const sg__update_args *a) {
  sg__update_args b;
  SG_TRY(sg__state_q8_args(e, a, &b));
  return sg__state_host_update_with(e, e->opt.od->q8, &b);
}

/* The master and the accumulator are the host placement's; the state arrays are not fp32
 * arrays of the shard (read_state decodes them). */
static void *array(sg_engine *e, int which) {
  return which == 0 || which == SG__STATE_ACCUM ? sg__state_host.array(e, which) : NULL;
}

/* ---- the host placement's for the arrival, the norm and the accumulator -------------------- */

static sg_status prepare(sg_engine *e, int b) { return sg__state_host.prepare(e, b); }
static void submitted(sg_engine *e, int b, uint64_t t) { sg__state_host.submitted(e, b, t); }
static sg_status wait_reductions(sg_engine *e, int64_t deadline_ms) {
  return sg__state_host.wait_reductions(e, deadline_ms);
}
static sg_status settle(sg_engine *e) { return sg__state_host.settle(e); }
static sg_status sumsq(sg_engine *e, double out[2]) { return sg__state_host.sumsq(e, out); }
static sg_status partials(sg_engine *e, double *dev) { return sg__state_host.partials(e, dev); }
static sg_status clear(sg_engine *e) { return sg__state_host.clear(e); }
static sg_status master_from_working(sg_engine *e) {
  return sg__state_host.master_from_working(e);
}

/* ---- the 8-bit placement's readers (through the device's copies, host memory both sides) --- */

static sg_status read_state(sg_engine *e, int k, int id,
                            sg_status (*fn)(sg_engine *e, const float *view, void *ctx),
                            void *ctx) {
  return sg__state_q8.read_state(e, k, id, fn, ctx);
}
static sg_status records(sg_engine *e, int k, uint8_t *rec, int mode) {
  return sg__state_q8.records(e, k, rec, mode);
}

const sg__state_ops sg__state_host_q8 = {
    .name = "host, 8-bit state", .host = 1, .coded = 1, .align = SG__Q8_BLOCK,
    .skips = 0, /* neither the host pipeline nor the 8-bit segments take classes */
    .init = init, .free = state_free, .array = array, .prepare = prepare,
    .submitted = submitted, .wait_reductions = wait_reductions, .settle = settle,
    .sumsq = sumsq, .partials = partials, .update = update, .clear = clear,
    .master_from_working = master_from_working, .read_state = read_state, .records = records,
};
