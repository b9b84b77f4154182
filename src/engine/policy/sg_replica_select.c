/* The choice of the replica transport, once at sg_engine_create_hybrid (DESIGN.md section 1,
 * the table of "Hybrid engines"): from the device, where the accumulator lives (the state
 * placement's declared `host`) and the two communicators' kinds (sg_comm.stream_ordered: NCCL
 * attaches to a CUDA device stream-ordered, the host communicators are host-driven). The only
 * place that asks these questions; the stage then calls through the table. */
#include "sg_replica_policy.h"

/* What the channel's host-side collectives take: a channel attached to a CUDA device moves
 * device memory, a host communicator bound without one (offload, staged) host memory; NCCL
 * without a device, and anything on the CPU device, either. */
static int channel_mem(const sg_engine *e, const sg_comm *replica, const sg__device *dev) {
  if (e->dev->kind == SG_DEVICE_CPU) return SG__REP_MEM_ANY;
  if (dev != NULL && dev == e->dev) return SG__REP_MEM_DEVICE;
  return replica->stream_ordered ? SG__REP_MEM_ANY : SG__REP_MEM_HOST;
}

static sg_status pick(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                      sg__device **dev) {
  *dev = NULL;
  /* the CPU device's memory and an offloaded accumulator are host memory */
  if (e->dev->kind == SG_DEVICE_CPU) {
    *ops = &sg__replica_host;
    return SG_OK;
  }
  if (e->strat->place->host) {
    *ops = &sg__replica_at_step;
    return SG_OK;
  }
  const int shard_stream = e->comm->stream_ordered, rep_stream = replica->stream_ordered;
  if (shard_stream && !rep_stream) {
    *ops = &sg__replica_staged;
    return sg__replica_staged_host_queue(e, replica, dev);
  }
  if (!shard_stream && rep_stream) {
    *ops = &sg__replica_unbound;
    return SG_OK;
  }
  *ops = &sg__replica_attached;
  *dev = e->dev;
  return SG_OK;
}

sg_status sg__replica_select(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                             sg__device **dev) {
  SG_TRY(pick(e, replica, ops, dev));
  e->rep.mem = channel_mem(e, replica, *dev);
  return SG_OK;
}
