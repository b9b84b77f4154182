/* The all-gathers of the working parameters after a step (DESIGN.md section 4): one comm job
 * per bucket through the strategy's gather op, and the waits that order the caller's queue
 * after them (sg_param_wait, and before engine work that touches the parameters). */
#include <stdlib.h>

#include "sg_engine_internal.h"

sg_status sg__gathers_init(sg_engine *e) {
  sg__gathers *g = &e->gat;
  g->ticket = calloc((size_t)e->plan->nbuckets, sizeof *g->ticket);
  if (!g->ticket) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  g->last = g->waited = 0;
  g->pending = 0;
  return SG_OK;
}

void sg__gathers_free(sg_engine *e) {
  free(e->gat.ticket);
  e->gat.ticket = NULL;
  e->gat.pending = 0;
}

int sg__gathers_needed(const sg_engine *e) { return e->strat->shard->sharded && e->world > 1; }

typedef struct { sg_engine *e; int b; int64_t trace; } sg__gather_job;

static sg_status gather_job_fn(void *arg) {
  const sg__gather_job j = *(sg__gather_job *)arg; /* the queue frees arg (comm_submit's drop) */
  sg__trace_at(j.e, j.trace, 0, SG_Q_COMM);
  sg_status st = j.e->strat->shard->gather(j.e, j.b);
  if (st == SG_OK) sg__trace_at(j.e, j.trace, 1, SG_Q_COMM);
  return st;
}

sg_status sg__gathers_submit(sg_engine *e, int b) {
  sg__gather_job *j = malloc(sizeof *j);
  if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_step: out of host memory");
  *j = (sg__gather_job){e, b, sg__trace_new(e, SG_TRACE_GATHER, b, NULL)};
  uint64_t t = 0;
  sg_status st = sg__engine_submit(e, gather_job_fn, free, j, &t);
  if (st != SG_OK) return st;
  e->gat.last = e->gat.ticket[b] = t;
  e->gat.pending = 1;
  return SG_OK;
}

/* The caller's queue waits for the gather job `ticket` (and every job before it). */
static sg_status wait_gathers(sg_engine *e, uint64_t ticket, int b) {
  sg__gathers *g = &e->gat;
  if (!g->pending || ticket <= g->waited) return SG_OK;
  const int64_t trace = sg__trace_new(e, SG_TRACE_WAIT, b, NULL);
  sg__trace_at(e, trace, 0, SG_Q_COMPUTE);
  sg_status st = e->dev->ops->compute_wait_comm(e->dev, ticket, sg__engine_host_deadline(e));
  if (st != SG_OK) return sg__engine_broken(e, st);
  sg__trace_at(e, trace, 1, SG_Q_COMPUTE);
  g->waited = ticket;
  if (ticket >= g->last) g->pending = 0;
  return SG_OK;
}

sg_status sg__step_settle(sg_engine *e) {
  return wait_gathers(e, e->gat.last, 0); /* bucket 0 is gathered last */
}

sg_status sg__gathers_new_queue(sg_engine *e) {
  if (!e->gat.pending) return SG_OK;
  e->gat.waited = 0;
  return sg__step_settle(e);
}

static sg_status gather_all_job(void *arg) {
  sg_engine *e = arg;
  for (int b = 0; b < e->plan->nbuckets; b++) SG_TRY(e->strat->shard->gather(e, b));
  return SG_OK;
}

sg_status sg__gathers_all(sg_engine *e) {
  if (!sg__gathers_needed(e)) return SG_OK;
  return sg__engine_run_comm(e, gather_all_job, e);
}

sg_status sg_param_wait(sg_engine *e, int id) {
  SG_ENGINE_GUARD(e, "sg_param_wait");
  static const char *fn = "sg_param_wait";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (id == -1) return sg__err_prefix(sg__step_settle(e), fn);
  SG_TRY(sg__engine_check_id(e, id, fn));
  const int b = e->plan->params[id].bucket;
  return sg__err_prefix(wait_gathers(e, e->gat.ticket[b], b), fn);
}
