/* The replica stage of a hybrid engine (sg_engine_create_hybrid, DESIGN.md section 4): the
 * engine is a ZeRO-2 (or ZeRO-1) engine over its shard communicator, and the stage adds what its
 * replicas on the other nodes need: once per optimizer step, each bucket's slice of the shard
 * accumulator is all-reduced over the replica communicator, right behind that bucket's
 * reduction in the declared last micro-batch (sg_set_microbatches) or at the step. The engine
 * calls these functions at fixed points whatever its layout; they call through the transport
 * chosen at create (rep.ops, src/engine/policy/sg_replica_*.c), whose flat variant does
 * nothing. This file keeps the bookkeeping every transport shares. */
#include <stdlib.h>
#include <string.h>

#include "policy/sg_replica_policy.h" /* sg__replica_select, sg__replica_flat */
#include "sg_engine_internal.h"

sg_status sg__replicas_attach(sg_engine *e, sg_comm *replica, const char *fn) {
  e->rep.ops = &sg__replica_flat;
  if (!replica) return SG_OK;
  /* Jobs of a threaded shard channel run on the comm worker: the replica's must be callable
   * there too (MPI without MPI_THREAD_MULTIPLE is not). */
  if (e->comm->threaded && !replica->threaded)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: the replica communicator cannot be called from the "
                   "engine's comm thread (MPI without MPI_THREAD_MULTIPLE) while the shard "
                   "communicator runs its collectives there", fn);
  const sg__replica_ops *ops = NULL;
  sg__device *dev = NULL;
  SG_TRY(sg__err_prefix(sg__replica_select(e, replica, &ops, &dev), fn));
  sg_comm *chan = NULL;
  const sg_status st = sg__comm_bind(replica, dev, e->cfg.timeout_ms, &chan);
  if (st != SG_OK) {
    ops->release(e);
    return sg__err_prefix(st, fn);
  }
  e->rep.ops = ops;
  e->rep.comm = chan;
  e->rep.rank = replica->rank;
  e->rep.n = replica->world;
  SG_LOG(SG_LOG_INFO, e->rank, "replica transport: %s", ops->name);
  return SG_OK;
}

sg_status sg__replicas_init(sg_engine *e) { return e->rep.ops->init(e); }
void sg__replicas_free(sg_engine *e) { e->rep.ops->free(e); }
void sg__replicas_detach(sg_engine *e) { e->rep.ops->detach(e); }
sg_status sg__replicas_agree(sg_engine *e, sg_status st) { return e->rep.ops->agree(e, st); }
sg_status sg__replicas_open(sg_engine *e, const char *fn) { return e->rep.ops->open(e, fn); }
sg_status sg__replicas_after_reduce(sg_engine *e, int b) { return e->rep.ops->after_reduce(e, b); }
sg_status sg__replicas_rest(sg_engine *e) { return e->rep.ops->rest(e); }

sg_status sg__replicas_allgather_host(sg_engine *e, void *host, size_t bytes) {
  return e->rep.ops->allgather_host(e, host, bytes);
}

sg_status sg__replicas_broadcast_params(sg_engine *e, int root) {
  return e->rep.ops->broadcast_params(e, root);
}

int sg__replicas_world(const sg_engine *e) { return e->world * (e->rep.n > 0 ? e->rep.n : 1); }

int sg__replicas_writer(const sg_engine *e) { return e->rep.rank == 0; }

int sg__replicas_grad_world(const sg_engine *e) { return e->world * e->rep.ops->grad_replicas(e); }

int sg__replicas_sync_due(sg_engine *e) { return e->rep.ops->sync_due(e); }

sg_status sg__replicas_sync(sg_engine *e) { return e->rep.ops->sync(e); }

void sg__replicas_ck_describe(const sg_engine *e, sg__rep_ck *ck) {
  memset(ck, 0, sizeof *ck);
  e->rep.ops->ck_describe(e, ck);
}

sg_status sg__replicas_ck_save(sg_engine *e, sg__rep_ck *ck) { return e->rep.ops->ck_save(e, ck); }

void sg__replicas_restore(sg_engine *e, const sg__rep_ck *ck) { e->rep.ops->restore(e, ck); }

void sg__replicas_shape(const sg__plan *p, const sg_config *cfg, int n, sg__layout_shape *out) {
  out->replica_bytes = n >= 1 ? sg__replica_select_bytes(p, cfg, n) : 0; /* 0: flat */
}

void sg__replicas_set_microbatches(sg_engine *e, int n) { e->rep.microbatches = n; }

void sg__replicas_count_microbatch(sg_engine *e) { e->rep.mb++; }

void sg__replicas_reset(sg_engine *e) {
  e->rep.mb = 0;
  e->rep.nclaimed = 0;
  if (e->rep.claimed) memset(e->rep.claimed, 0, (size_t)e->plan->nbuckets);
}
