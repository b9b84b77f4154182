/* Outer steps with int8 codes (cfg.outer_every = H with cfg.replica_codec = SG_CODEC_INT8,
 * docs/slow-links.md): the outer steps of sg_replica_outer.c, whose pseudo-gradient crosses
 * the nodes as the int8 codec's two-stage exchange (sg_replica_codec.c) instead of an fp32 or
 * bf16 all-reduce: per bucket, d = po - theta of this rank's run plus its residual is encoded,
 * the chunks exchanged, each owner sums its chunk in replica order and encodes the sum with
 * its own residual, and every replica decodes the same bits, so every replica takes the same
 * outer step. The residuals carry what the codes missed into the next outer step (error
 * feedback on the pseudo-gradient). The layout's replica buffer holds the outer state, then
 * the codec's residuals and exchange buffers (sg__replica_outer_int8_bytes); checkpoints hold
 * both. The streaming variant (sg_replica_outer_stream.c) shares these entries. */
#include "sg_replica_policy.h"

/* The codec's part begins after the outer state, 64-byte aligned. */
static size_t codec_off(const sg__plan *p, const sg_config *cfg) {
  return (sg__replica_outer_bytes(p, cfg) + 63u) / 64u * 64u;
}

size_t sg__replica_outer_int8_bytes(const sg__plan *p, const sg_config *cfg, int n) {
  return codec_off(p, cfg) + sg__replica_codec_bytes(p, n, 8);
}

sg_status sg__replica_outer_int8_prepare(sg_engine *e) {
  SG_TRY(sg__replica_outer_prepare(e));
  return sg__replica_codec_prepare(e, 8, codec_off(e->plan, &e->cfg), SG__REP_OUTER_RESID);
}

sg_status sg__replica_outer_int8_sum(sg_engine *e, int b, float *d, size_t n) {
  (void)n; /* the bucket's slice: n values */
  return sg__replica_codec_sum(e, b, d);
}

static sg_status sync(sg_engine *e) {
  return sg__replica_outer_sync(e, sg__replica_outer_int8_sum);
}

void sg__replica_outer_int8_describe(const sg_engine *e, sg__rep_ck *ck) {
  sg__replica_outer_describe(e, ck);
  sg__replica_codec_describe(e, ck);
}

sg_status sg__replica_outer_int8_save(sg_engine *e, sg__rep_ck *ck) {
  SG_TRY(sg__replica_outer_save(e, ck));
  return sg__replica_codec_save(e, ck);
}

void sg__replica_outer_int8_restore(sg_engine *e, const sg__rep_ck *ck) {
  sg__replica_outer_restore(e, ck);
  sg__replica_codec_restore(e, ck);
}

const sg__replica_ops sg__replica_outer_int8 = {
    .name = "host, outer steps, int8 codes", SG__REPLICA_ENTRIES, SG__REPLICA_OUTER_STEPS,
    .prepare = sg__replica_outer_int8_prepare, .release = sg__replica_codec_release, .sync = sync,
    .ck_describe = sg__replica_outer_int8_describe, .ck_save = sg__replica_outer_int8_save,
    .restore = sg__replica_outer_int8_restore,
};
