/* The int4 replica codec (SG_CODEC_INT4, docs/slow-links.md): the host transport's all-reduce
 * across replicas replaced by the two-stage exchange of 4-bit blockwise codes with error
 * feedback (sg_replica_codec.c), as a job on the engine's comm queue right behind the bucket's
 * reduction. */
#include "sg_replica_policy.h"

static sg_status int4_prepare(sg_engine *e) { return sg__replica_codec_prepare(e, 4, 0, SG__REP_RESID); }

const sg__replica_ops sg__replica_int4 = {
    .name = "host, int4 codes", SG__REPLICA_ENTRIES, .share_scratch = 1,
    .prepare = int4_prepare, .release = sg__replica_codec_release, .claim = sg__replica_codec_claim,
    .finish = sg__replica_no_finish, .run = sg__replica_run_comm, .drain = sg__replica_no_drain,
    SG__REPLICA_EVERY_STEP, SG__REPLICA_CODEC_CK,
};
