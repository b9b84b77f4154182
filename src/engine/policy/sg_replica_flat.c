/* The flat transport: one replica (sg_engine_create), no channel; every entry point of the
 * replica stage does nothing (the agreement passes the shard's verdict on). */
#include "sg_replica_policy.h"

static sg_status flat_ok(sg_engine *e) {
  (void)e;
  return SG_OK;
}

static void flat_nothing(sg_engine *e) { (void)e; }

static sg_status flat_agree(sg_engine *e, sg_status st) {
  (void)e;
  return st;
}

static sg_status flat_open(sg_engine *e, const char *fn) {
  (void)e, (void)fn;
  return SG_OK;
}

static sg_status flat_bucket(sg_engine *e, int b) {
  (void)e, (void)b;
  return SG_OK;
}

static sg_status flat_allgather_host(sg_engine *e, void *host, size_t bytes) {
  (void)e, (void)host, (void)bytes;
  return SG_OK;
}

static int flat_one(const sg_engine *e) {
  (void)e;
  return 1;
}

static int flat_never(sg_engine *e) {
  (void)e;
  return 0;
}

static sg_status flat_run(sg_engine *e, sg__job_fn fn, void *arg) {
  (void)e, (void)fn, (void)arg;
  return SG_OK;
}

const sg__replica_ops sg__replica_flat = {
    .name = "flat", .init = flat_ok, .free = flat_nothing, .detach = flat_nothing,
    .agree = flat_agree, .open = flat_open, .after_reduce = flat_bucket, .rest = flat_ok,
    .allgather_host = flat_allgather_host, .broadcast_params = flat_bucket,
    .share_scratch = 0, .prepare = flat_ok, .release = flat_nothing, .claim = flat_bucket,
    .finish = flat_ok, .run = flat_run, .drain = flat_ok, .grad_replicas = flat_one,
    .sync_due = flat_never, .sync = flat_ok, .ck_describe = sg__replica_no_ck_describe,
    .ck_save = sg__replica_no_ck_save, .restore = sg__replica_no_restore,
};
