/* Streaming outer steps (cfg.outer_every = H with cfg.outer_streaming = 1, docs/slow-links.md):
 * the outer steps of sg_replica_outer.c spread over the period. The buckets fall into H groups,
 * bucket b into group b mod H; at the end of the k-th sg_step of a period (k = 1..H) group k - 1
 * alone takes its outer step: the pseudo-gradient of its buckets' runs summed across the
 * replicas (f32 or bf16 wire, or the int8 codes of sg_replica_outer_int8.c), the Nesterov step
 * of their outer parameters and momentum, the new parameters gathered in the node. So each step
 * sends about 1/H of an outer step's bytes, and no step stalls on all of them. The sync runs at
 * the end of sg_step, waited for (not yet overlapped with the next step's compute). The state,
 * its bytes and its checkpoint sections are the non-streaming variant's (the position in the
 * period says which group is next). */
#include "sg_replica_policy.h"

static sg_status stream_sync(sg_engine *e) {
  return sg__replica_outer_stream_sync(e, sg__replica_outer_wire_sum);
}

static sg_status stream_sync_int8(sg_engine *e) {
  return sg__replica_outer_stream_sync(e, sg__replica_outer_int8_sum);
}

const sg__replica_ops sg__replica_outer_stream = {
    .name = "host, streaming outer steps", SG__REPLICA_ENTRIES, SG__REPLICA_OUTER_STREAM_STEPS,
    .prepare = sg__replica_outer_prepare, .release = sg__replica_no_release, .sync = stream_sync,
    .ck_describe = sg__replica_outer_describe, .ck_save = sg__replica_outer_save,
    .restore = sg__replica_outer_restore,
};

const sg__replica_ops sg__replica_outer_stream_int8 = {
    .name = "host, streaming outer steps, int8 codes", SG__REPLICA_ENTRIES,
    SG__REPLICA_OUTER_STREAM_STEPS, .prepare = sg__replica_outer_int8_prepare,
    .release = sg__replica_codec_release, .sync = stream_sync_int8,
    .ck_describe = sg__replica_outer_int8_describe, .ck_save = sg__replica_outer_int8_save,
    .restore = sg__replica_outer_int8_restore,
};
