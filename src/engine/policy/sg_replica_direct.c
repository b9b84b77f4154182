/* The replica transports whose all-reduce is a job on the engine's comm queue right behind the
 * bucket's reduction (DESIGN.md section 1, "Hybrid engines"): host (a CPU engine: host buffers,
 * the channel bound without a device), attached (beside the shard channel on the engine's
 * device, the same way: both stream-ordered or both host-driven), unbound (an NCCL channel
 * without a device beside a host-driven shard: inside a host-driven job its collective on
 * device memory completes within the call). They differ in what the channel shares with the
 * shard channel and in the memory its host-side collectives take (rep.mem, set with them). */
#include "sg_replica_policy.h"

static sg_status direct_claim(sg_engine *e, int b) {
  return sg__replica_submit(e, b, sg__replica_reduce_device);
}

#define SG__DIRECT_OPS                                                                            \
  SG__REPLICA_ENTRIES, .prepare = sg__replica_no_prepare, .release = sg__replica_no_release,     \
  .claim = direct_claim, .finish = sg__replica_no_finish, .run = sg__replica_run_comm,           \
  .drain = sg__replica_no_drain, SG__REPLICA_EVERY_STEP, SG__REPLICA_NO_CK

/* Collectives of both channels run one at a time on the comm queue: one scratch serves both
 * where the channels take the same memory (an unbound channel never uses it on device buffers). */
const sg__replica_ops sg__replica_host = {.name = "host", .share_scratch = 1, SG__DIRECT_OPS};
const sg__replica_ops sg__replica_attached = {.name = "attached", .share_scratch = 1, SG__DIRECT_OPS};
const sg__replica_ops sg__replica_unbound = {.name = "unbound", .share_scratch = 0, SG__DIRECT_OPS};
