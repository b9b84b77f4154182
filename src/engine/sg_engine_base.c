/* The engine's base services, which every other engine file (and the policy tables) calls and
 * which call no other engine file: the call-order and argument checks, the two ways an engine
 * becomes broken, the host deadline, the submit of a comm job (which keeps last_ticket), and
 * the all-gathers through the comm queue. The lifecycle (sg_engine.c) sits above them. */
#include <stdlib.h>

#include "sg_engine_internal.h"

/* ---------------------------------------------------------------------------------------- */
/* checks                                                                                    */

sg_status sg__engine_check(sg_engine *e, const char *fn, int need_ready) {
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  if (e->state == SG_ES_BROKEN)
    return sg__err(SG_ERR_COMM, "%s: engine is unusable after an earlier communication failure; "
                                "destroy it", fn);
  if (need_ready && e->state != SG_ES_READY)
    return sg__err(SG_ERR_INVALID_STATE, "%s: call sg_finalize first", fn);
  if (!need_ready && e->state != SG_ES_BUILDING)
    return sg__err(SG_ERR_INVALID_STATE, "%s: not allowed after sg_finalize", fn);
  return SG_OK;
}

sg_status sg__engine_check_id(sg_engine *e, int id, const char *fn) {
  if (id < 0 || id >= e->reg.nparams)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: no parameter with id %d (have %d)", fn, id,
                   e->reg.nparams);
  return SG_OK;
}

sg_status sg__engine_check_param(sg_engine *e, int id, const void *ptr, const char *what,
                                 const char *fn) {
  SG_TRY(sg__engine_check(e, fn, 1));
  SG_TRY(sg__engine_check_id(e, id, fn));
  if (!ptr) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, what);
  return SG_OK;
}

sg_status sg__engine_check_dtype(int dt, const char *what, const char *fn) {
  if (!sg__dtype_valid(dt))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s %d is not a valid sg_dtype", fn, what, dt);
  return SG_OK;
}

sg_status sg__engine_break(sg_engine *e, sg_status st, const char *where) {
  e->state = SG_ES_BROKEN;
  SG_LOG(SG_LOG_WARN, e->rank, "engine broken%s%s: %s", where ? " " : "", where ? where : "",
         sg_last_error());
  return st;
}

sg_status sg__engine_broken(sg_engine *e, sg_status st) {
  /* A collective that failed or disagreed leaves the ranks out of step for good. */
  if (st == SG_ERR_COMM || st == SG_ERR_TIMEOUT || st == SG_ERR_CUDA || st == SG_ERR_MISMATCH)
    return sg__engine_break(e, st, NULL);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* collectives through the comm queue                                                        */

/* An all-gather (root < 0: n bytes per rank) or a broadcast from root (n bytes). */
typedef struct {
  sg_engine *e;
  void *buf;
  size_t n;
  int root;
} coll_job;

static sg_status coll_job_fn(void *arg) {
  const coll_job *j = arg;
  sg_comm *c = j->e->comm;
  const int64_t dl = sg__deadline(j->e->cfg.timeout_ms);
  return j->root < 0 ? c->ops->all_gather(c, j->buf, j->n, dl)
                     : c->ops->broadcast(c, j->buf, j->n, j->root, dl);
}

int64_t sg__engine_host_deadline(const sg_engine *e) {
  /* Every collective on the queue has its own deadline, so a host wait needs only a backstop
   * for a queue of several of them. */
  return e->cfg.timeout_ms > 0 ? sg__now_ms() + 2 * (int64_t)e->cfg.timeout_ms : INT64_MAX;
}

sg_status sg__engine_submit(sg_engine *e, sg__job_fn fn, void (*drop)(void *arg), void *arg,
                            uint64_t *ticket) {
  *ticket = 0;
  sg_status st = e->dev->ops->comm_submit(e->dev, fn, drop, arg, ticket);
  if (*ticket > e->last_ticket) e->last_ticket = *ticket;
  return st;
}

sg_status sg__engine_run_comm(sg_engine *e, sg__job_fn fn, void *arg) {
  uint64_t t = 0;
  sg_status st = sg__engine_submit(e, fn, NULL, arg, &t);
  if (st == SG_OK) st = e->dev->ops->comm_wait(e->dev, t, sg__engine_host_deadline(e));
  return sg__engine_broken(e, st);
}

/* The device's replica lane where it has one (sg_device.h, comm_submit_lane), else the queue. */
sg_status sg__engine_submit_replica(sg_engine *e, sg__job_fn fn, void (*drop)(void *arg),
                                    void *arg, uint64_t *ticket) {
  sg__device *d = e->dev;
  if (!d->ops->comm_submit_lane) return sg__engine_submit(e, fn, drop, arg, ticket);
  *ticket = 0;
  sg_status st = d->ops->comm_submit_lane(d, 1, fn, drop, arg, ticket);
  if (*ticket > e->last_ticket) e->last_ticket = *ticket;
  return st;
}

sg_status sg__engine_run_replica(sg_engine *e, sg__job_fn fn, void *arg) {
  uint64_t t = 0;
  sg_status st = sg__engine_submit_replica(e, fn, NULL, arg, &t);
  if (st == SG_OK) st = e->dev->ops->comm_wait(e->dev, t, sg__engine_host_deadline(e));
  return sg__engine_broken(e, st);
}

static sg_status run_coll(sg_engine *e, void *buf, size_t n, int root) {
  coll_job j = {e, buf, n, root};
  return sg__engine_run_comm(e, coll_job_fn, &j);
}

sg_status sg__engine_allgather(sg_engine *e, void *dev_buf, size_t bytes_per_rank) {
  return run_coll(e, dev_buf, bytes_per_rank, -1);
}

sg_status sg__engine_broadcast(sg_engine *e, void *dev_buf, size_t bytes, int root) {
  return run_coll(e, dev_buf, bytes, root);
}

sg_status sg__engine_allgather_host(sg_engine *e, void *host, size_t bytes_per_rank) {
  size_t total = bytes_per_rank * (size_t)e->world;
  void *d = NULL;
  sg_status st = e->dev->ops->alloc(e->dev, total, &d);
  if (st != SG_OK) return st;
  SG_TRY_GOTO(e->dev->ops->copy(e->dev, SG_Q_COMPUTE, d, host, total, SG_COPY_H2D), st, done);
  SG_TRY_GOTO(run_coll(e, d, bytes_per_rank, -1), st, done);
  st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, host, d, total, SG_COPY_D2H);
done:
  e->dev->ops->free(e->dev, d);
  return st;
}

sg_status sg__engine_check_out(const sg_engine *e, const void *out, const char *what,
                               const char *fn) {
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, what);
  return SG_OK;
}

sg_status sg__engine_check_group(int group, const char *fn) {
  if (group < 0 || group >= SG_MAX_GROUPS)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: group must be 0..%d (got %d)", fn,
                   SG_MAX_GROUPS - 1, group);
  return SG_OK;
}
