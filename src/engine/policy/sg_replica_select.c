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
  if (dev != NULL && dev->kind != SG_DEVICE_CPU) return SG__REP_MEM_DEVICE; /* e->dev, its twin */
  return replica->stream_ordered ? SG__REP_MEM_ANY : SG__REP_MEM_HOST;
}

/* On the CPU device a codec's exchange runs on host buffers through a host communicator's
 * all-to-all (NCCL has one, grouped sends and receives, but the codecs over it on host buffers
 * are not done). */
static sg_status codec_comm_cpu(const sg_comm *replica) {
  if (replica->ops->all_to_all && !replica->stream_ordered) return SG_OK;
  return sg__err(SG_ERR_UNSUPPORTED, "cfg->replica_codec on the CPU device needs a host replica "
                 "communicator with an all-to-all (threads, MPI, a caller's transport); not %s",
                 replica->ops->name);
}

/* On a CUDA device the slow-link modes work in its memory (the device's outer and code ops),
 * their sums through the replica channel: attached beside the shard channel where both are of
 * one kind (both NCCL, or both host-driven: threads or MPI); unbound (*dev NULL) for NCCL
 * across a host-driven shard (inside a host-driven job its collectives on device memory
 * complete within the call); for NCCL inside with a host-driven channel across (staged_pair)
 * *dev is NULL too and the caller picks a staged table with a host queue of its own. (An
 * offloaded optimizer: pick_offload.) */
static void attach_cuda(const sg_engine *e, const sg_comm *replica, sg__device **dev) {
  if (e->comm->stream_ordered == replica->stream_ordered) *dev = e->dev;
}

/* NCCL inside the node, a host-driven replica communicator (threads, MPI) across. */
static int staged_pair(const sg_engine *e, const sg_comm *replica) {
  return e->comm->stream_ordered && !replica->stream_ordered;
}

/* A codec on a CUDA device: its codes in device memory go through the replica channel's
 * all-to-all and all-gather, so that all-to-all must take device memory (threads, NCCL, MPI
 * through pinned staging). */
static sg_status codec_comm_cuda(const sg_comm *replica) {
  if (replica->ops->all_to_all && replica->ops->all_to_all_device) return SG_OK;
  return sg__err(SG_ERR_UNSUPPORTED, "cfg->replica_codec on the CUDA device needs a replica "
                 "communicator whose all-to-all takes device memory (threads, MPI, NCCL); %s's "
                 "does not", replica->ops->name);
}

static sg_status codec_comm(sg_engine *e, const sg_comm *replica, sg__device **dev) {
  if (e->dev->kind == SG_DEVICE_CPU) return codec_comm_cpu(replica);
  attach_cuda(e, replica, dev);
  /* staged: the codes cross through a pinned stage, the channel's all-to-all on host memory */
  if (staged_pair(e, replica)) return codec_comm_cpu(replica);
  return codec_comm_cuda(replica);
}

/* An offloaded optimizer (CUDA): the modes work where its master and accumulator live, on
 * the host: their state in the pinned replica buffer, their element work on a CPU device of
 * their own (rep.host_dev, the element device), their sums through the channel bound without
 * a device (host memory; NCCL stages it through device memory and completes each call), at
 * the step after the state's settle (codes: at-step) or from sg_step's thread (outer steps:
 * sg_replica_outer_host.c); streaming: bound to that CPU device, whose host queue runs the
 * sums (as on the CPU device; a host communicator). */
static sg_status pick_offload(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                              sg__device **dev) {
  const int outer = e->cfg.outer_every > 0, codec = e->cfg.replica_codec != SG_CODEC_NONE;
  const int stream = outer && e->cfg.outer_streaming;
  if (codec && !replica->ops->all_to_all)
    return sg__err(SG_ERR_UNSUPPORTED, "cfg->replica_codec needs a replica communicator with an "
                   "all-to-all; %s has none", replica->ops->name);
  if (stream && replica->stream_ordered)
    return sg__err(SG_ERR_UNSUPPORTED, "cfg->outer_streaming with cfg->offload_optimizer on the "
                   "CUDA device needs a host replica communicator (threads, MPI, a caller's "
                   "transport): its sums run on a host queue of their own; not %s",
                   replica->ops->name);
  if (stream) { /* the sums on that device's host queue */
    *ops = codec ? &sg__replica_outer_stream_host_int8 : &sg__replica_outer_stream_host;
    SG_TRY(sg__replica_staged_host_queue(e, replica, dev));
  } else {
    if (outer)
      *ops = codec ? &sg__replica_outer_host_int8 : &sg__replica_outer_host;
    else
      *ops = e->cfg.replica_codec == SG_CODEC_INT8 ? &sg__replica_at_step_int8
                                                   : &sg__replica_at_step_int4;
    SG_TRY(sg__device_cpu_create(e->rank, 0, &e->rep.host_dev));
  }
  e->rep.elem_dev = e->rep.host_dev;
  return SG_OK;
}

static sg_status pick_codec(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                            sg__device **dev) {
  if (replica->world < 2)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "cfg->replica_codec with one replica: nothing "
                   "crosses nodes to compress (use SG_CODEC_NONE)");
  if (e->strat->place->host) return pick_offload(e, replica, ops, dev);
  SG_TRY(codec_comm(e, replica, dev));
  const int int8 = e->cfg.replica_codec == SG_CODEC_INT8;
  if (e->dev->kind != SG_DEVICE_CPU && staged_pair(e, replica)) { /* exchanges on a host queue */
    *ops = int8 ? &sg__replica_int8_staged : &sg__replica_int4_staged;
    return sg__replica_staged_host_queue(e, replica, dev);
  }
  *ops = int8 ? &sg__replica_int8 : &sg__replica_int4;
  return SG_OK;
}

/* Streaming: where each group's sum runs beside the node's reductions. The CPU device: a host
 * queue of its own. CUDA, an NCCL replica channel: the engine's replica lane (its own stream
 * beside an NCCL shard; beside a host-driven shard the engine's worker, whose jobs the lane's
 * share, so there the sum does not overlap the next step's reductions). CUDA, host-driven
 * (threads, MPI; also beside an NCCL shard): the device's twin (its own worker and streams),
 * the channel bound to it. */
static sg_status stream_queue(sg_engine *e, const sg_comm *replica, sg__device **dev) {
  if (e->dev->kind == SG_DEVICE_CPU) return sg__replica_staged_host_queue(e, replica, dev);
  if (replica->stream_ordered) return SG_OK;
  if (!e->dev->ops->twin)
    return sg__err(SG_ERR_UNSUPPORTED, "cfg->outer_streaming: the %s device has no second "
                   "queue for the sums", e->dev->ops->name);
  SG_TRY(e->dev->ops->twin(e->dev, &e->rep.host_dev));
  *dev = e->rep.host_dev;
  return SG_OK;
}

/* Outer steps: their element work goes through the device (either kind), each bucket's
 * pseudo-gradient summed by the replica channel inside one job on the engine's device (on CUDA
 * attached as above). With the int8 codec the pseudo-gradient goes through its exchange.
 * Streaming (one group of buckets per step, its sum overlapped with the next step): each sum
 * runs beside the node's reductions (stream_queue). */
static sg_status pick_outer(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                            sg__device **dev) {
  if (replica->world < 2)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "cfg->outer_every with one replica: there are no "
                   "other replicas to agree with (use 0)");
  const int stream = e->cfg.outer_streaming, codec = e->cfg.replica_codec != SG_CODEC_NONE;
  if (e->strat->place->host) return pick_offload(e, replica, ops, dev);
  if (!codec && e->dev->kind != SG_DEVICE_CPU) attach_cuda(e, replica, dev);
  if (codec) SG_TRY(codec_comm(e, replica, dev));
  if (!stream && e->dev->kind != SG_DEVICE_CPU && staged_pair(e, replica)) {
    /* the sums on a host queue of their own, through a pinned stage */
    *ops = codec ? &sg__replica_outer_int8_staged : &sg__replica_outer_staged;
    return sg__replica_staged_host_queue(e, replica, dev);
  }
  if (!stream) {
    *ops = codec ? &sg__replica_outer_int8 : &sg__replica_outer;
    return SG_OK;
  }
  *ops = codec ? &sg__replica_outer_stream_int8 : &sg__replica_outer_stream;
  return stream_queue(e, replica, dev);
}

static sg_status pick(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                      sg__device **dev) {
  *dev = NULL;
  if (e->cfg.outer_every > 0) return pick_outer(e, replica, ops, dev);
  if (e->cfg.replica_codec != SG_CODEC_NONE) return pick_codec(e, replica, ops, dev);
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
  e->rep.elem_dev = e->dev; /* pick_offload: a CPU device of its own */
  SG_TRY(pick(e, replica, ops, dev));
  e->rep.mem = channel_mem(e, replica, *dev);
  e->rep.sum_dev = *dev != NULL && (*dev)->kind != SG_DEVICE_CPU ? *dev : e->rep.elem_dev;
  /* the CPU device runs element work at once, in the caller's order (a replica job, or the
   * streaming sum's host queue, which must not wait for the node's comm jobs); the sums' casts
   * and codes go to the CUDA device the channel is bound to (the engine's, or its twin) */
  e->rep.elem_q = e->rep.elem_dev->kind == SG_DEVICE_CPU ? SG_Q_COMPUTE : SG_Q_COMM;
  return SG_OK;
}

/* A codec's residuals and exchange buffers, the outer state (and the codec's with both); else the wire buffer where the
 * wire dtype is not the accumulator's and there is another replica to sum with. */
size_t sg__replica_select_bytes(const sg__plan *p, const sg_config *cfg, int n) {
  if (cfg->outer_every > 0 && cfg->outer_streaming)
    return sg__replica_outer_stream_bytes(p, cfg, n);
  if (cfg->outer_every > 0 && cfg->replica_codec != SG_CODEC_NONE)
    return sg__replica_outer_int8_bytes(p, cfg, n);
  if (cfg->replica_codec != SG_CODEC_NONE)
    return sg__replica_codec_bytes(p, n, cfg->replica_codec == SG_CODEC_INT8 ? 8 : 4);
  if (cfg->outer_every > 0) return sg__replica_outer_bytes(p, cfg);
  if (n < 2 || cfg->replica_reduce_dtype == cfg->accum_dtype) return 0;
  return sg__mem_mul_sat(sg__plan_max_slice_numel(p), sg__dtype_size(cfg->replica_reduce_dtype));
}
