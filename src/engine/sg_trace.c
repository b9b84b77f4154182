/* Tracing (sg_trace_*): when gradients became ready on the caller's queue, when each bucket's
 * reduction ran on the comm queue, and the step, on the device's own clocks.
 *
 * Every event owns two timing marks of the device (start, end) and mark 0 is the origin,
 * recorded on the caller's queue at sg_trace_start. Records are created on the caller's thread
 * only (a reduction's record when its job is submitted), so the comm queue touches nothing but
 * its own marks and never the record array; times are read only after both queues drained. */
#define _POSIX_C_SOURCE 200809L /* POSIX declarations under -std=c11 */

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_engine_internal.h"

#define SG__TRACE_DEFAULT 16384
#define SG__TRACE_MAX 4194304
#define SG__TRACE_PATH 4096

typedef struct sg__trace_rec {
  int32_t kind, id;
  uint64_t step;
  char label[sizeof(((sg_trace_event *)0)->label)];
} sg__trace_rec;

typedef struct sg__trace {
  int active;
  size_t cap, n;
  uint64_t dropped;
  sg__trace_rec *recs;
  void *marks; /* 1 + 2 * cap device marks */
  char *auto_path; /* SG_TRACE: written at sg_engine_destroy */
} sg__trace;

static size_t nmarks(const sg__trace *t) { return 1 + 2 * t->cap; }

static void free_marks(sg_engine *e, sg__trace *t) {
  if (t->marks) e->dev->ops->marks_destroy(e->dev, t->marks, nmarks(t));
  free(t->recs);
  t->marks = NULL;
  t->recs = NULL;
  t->cap = t->n = 0;
  t->dropped = 0;
}

/* The comm queue must not hold a job that still marks into the old set. */
static sg_status drain(sg_engine *e) {
  if (e->last_ticket)
    SG_TRY(sg__engine_broken(e, e->dev->ops->comm_wait(e->dev, e->last_ticket,
                                                       sg__engine_host_deadline(e))));
  return sg__engine_broken(e, e->dev->ops->sync(e->dev, sg__engine_host_deadline(e)));
}

/* ---------------------------------------------------------------------------------------- */
/* recording (engine internals)                                                             */

/* The label of an engine event, made only when it is recorded (the reduction launch and
 * sg_grad_ready are hot paths). */
static void engine_label(const sg_engine *e, int kind, int id, char *out, size_t cap) {
  switch (kind) {
    case SG_TRACE_GRAD_READY: snprintf(out, cap, "%s", e->reg.names[id]); break;
    case SG_TRACE_REDUCE:
      snprintf(out, cap, "%s b%d", e->strat->reduce_label, id);
      break;
    case SG_TRACE_STEP: snprintf(out, cap, "step"); break;
    case SG_TRACE_GATHER: snprintf(out, cap, "all-gather b%d", id); break;
    case SG_TRACE_WAIT: snprintf(out, cap, "wait for all-gather b%d", id); break;
    default: snprintf(out, cap, "?");
  }
}

int64_t sg__trace_new(sg_engine *e, int kind, int id, const char *label) {
  sg__trace *t = e->trace;
  if (!t || !t->active) return -1;
  if (t->n == t->cap) {
    if (t->dropped++ == 0)
      SG_LOG(SG_LOG_WARN, e->rank, "trace full (%zu events): later events are dropped", t->cap);
    return -1;
  }
  sg__trace_rec *r = &t->recs[t->n];
  r->kind = kind;
  r->id = id;
  r->step = e->opt.step;
  if (label)
    snprintf(r->label, sizeof r->label, "%s", label);
  else
    engine_label(e, kind, id, r->label, sizeof r->label);
  return (int64_t)t->n++;
}

void sg__trace_at(sg_engine *e, int64_t rec, int which, sg__queue q) {
  if (rec < 0) return;
  sg_status st = e->dev->ops->mark(e->dev, e->trace->marks, 1 + 2 * (size_t)rec + (which != 0), q);
  /* A lost mark loses one event (read back as dropped), not the training step. */
  if (st != SG_OK) SG_LOG(SG_LOG_WARN, e->rank, "trace mark failed: %s", sg_last_error());
}

int64_t sg__trace_instant(sg_engine *e, int kind, int id, const char *label) {
  int64_t r = sg__trace_new(e, kind, id, label);
  sg__trace_at(e, r, 0, SG_Q_COMPUTE);
  return r;
}

/* ---------------------------------------------------------------------------------------- */
/* public                                                                                    */

static sg_status start(sg_engine *e, size_t cap, const char *fn) {
  if (!e->trace && !(e->trace = calloc(1, sizeof *e->trace)))
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  sg__trace *t = e->trace;
  SG_TRY(drain(e));
  free_marks(e, t);
  t->recs = malloc(cap * sizeof *t->recs);
  if (!t->recs) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory (%zu events)", fn, cap);
  t->cap = cap;
  sg_status st = e->dev->ops->marks_create(e->dev, nmarks(t), &t->marks);
  if (st == SG_OK) st = e->dev->ops->mark(e->dev, t->marks, 0, SG_Q_COMPUTE);
  if (st != SG_OK) {
    free_marks(e, t);
    return sg__err_prefix(st, fn);
  }
  t->active = 1;
  return SG_OK;
}

sg_status sg_trace_start(sg_engine *e, size_t max_events) {
  SG_ENGINE_GUARD(e, "sg_trace_start");
  static const char *fn = "sg_trace_start";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (max_events > SG__TRACE_MAX)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: max_events %zu > %d", fn, max_events,
                   SG__TRACE_MAX);
  if (e->trace && e->trace->active)
    return sg__err(SG_ERR_INVALID_STATE, "%s: already recording (sg_trace_stop first)", fn);
  return start(e, max_events ? max_events : SG__TRACE_DEFAULT, fn);
}

sg_status sg_trace_stop(sg_engine *e) {
  SG_ENGINE_GUARD(e, "sg_trace_stop");
  static const char *fn = "sg_trace_stop";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!e->trace || !e->trace->active)
    return sg__err(SG_ERR_INVALID_STATE, "%s: not recording", fn);
  e->trace->active = 0;
  return SG_OK;
}

sg_status sg_trace_mark(sg_engine *e, const char *label) {
  SG_ENGINE_GUARD(e, "sg_trace_mark");
  static const char *fn = "sg_trace_mark";
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!label) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: label is NULL", fn);
  if (!e->trace || !e->trace->active)
    return sg__err(SG_ERR_INVALID_STATE, "%s: not recording (sg_trace_start first)", fn);
  sg__trace_instant(e, SG_TRACE_MARK, -1, label);
  return SG_OK;
}

/* Times of record i; SG_ERR_INVALID_STATE when a mark was never recorded (its job failed or
 * never ran). */
static sg_status resolve(sg_engine *e, size_t i, sg_trace_event *ev) {
  const sg__trace *t = e->trace;
  const sg__trace_rec *r = &t->recs[i];
  const int instant = r->kind == SG_TRACE_GRAD_READY || r->kind == SG_TRACE_MARK;
  SG_TRY(e->dev->ops->mark_elapsed(e->dev, t->marks, 0, 1 + 2 * i, &ev->start_us));
  ev->end_us = ev->start_us;
  if (!instant) SG_TRY(e->dev->ops->mark_elapsed(e->dev, t->marks, 0, 2 + 2 * i, &ev->end_us));
  ev->kind = r->kind;
  ev->id = r->id;
  ev->step = r->step;
  memcpy(ev->label, r->label, sizeof ev->label);
  return SG_OK;
}

/* Calls fn for every event whose times are known, in issue order; *missing counts the rest. */
static sg_status for_events(sg_engine *e, sg_status (*fn)(const sg_trace_event *, void *),
                            void *ctx, uint64_t *missing) {
  SG_TRY(drain(e));
  *missing = 0;
  for (size_t i = 0; i < e->trace->n; i++) {
    sg_trace_event ev;
    memset(&ev, 0, sizeof ev);
    sg_status st = resolve(e, i, &ev);
    if (st == SG_ERR_INVALID_STATE) {
      (*missing)++;
      continue;
    }
    SG_TRY(st);
    SG_TRY(fn(&ev, ctx));
  }
  return SG_OK;
}

typedef struct { sg_trace_event *out; size_t cap, n; } sg__copy_ctx;

static sg_status copy_event(const sg_trace_event *ev, void *ctx) {
  sg__copy_ctx *c = ctx;
  if (c->n < c->cap) c->out[c->n] = *ev;
  c->n++;
  return SG_OK;
}

static sg_status check_trace(sg_engine *e, const char *fn) {
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!e->trace || !e->trace->recs)
    return sg__err(SG_ERR_INVALID_STATE, "%s: nothing recorded (sg_trace_start first)", fn);
  return SG_OK;
}

sg_status sg_trace_events(sg_engine *e, sg_trace_event *out, size_t cap, size_t *count,
                          uint64_t *dropped) {
  SG_ENGINE_GUARD(e, "sg_trace_events");
  static const char *fn = "sg_trace_events";
  SG_TRY(check_trace(e, fn));
  if (!count) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: count is NULL", fn);
  if (cap && !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL with cap %zu", fn, cap);
  sg__copy_ctx c = {out, cap, 0};
  uint64_t missing = 0;
  SG_TRY(for_events(e, copy_event, &c, &missing));
  *count = c.n;
  if (dropped) *dropped = e->trace->dropped + missing;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Chrome trace JSON                                                                         */

typedef struct { FILE *f; int rank; } sg__json_ctx;

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    const unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      fprintf(f, "\\%c", c);
    else if (c < 0x20)
      fprintf(f, "\\u%04x", c);
    else
      fputc(c, f);
  }
  fputc('"', f);
}

static const char *kind_name(int kind) {
  switch (kind) {
    case SG_TRACE_GRAD_READY: return "grad_ready";
    case SG_TRACE_REDUCE: return "reduce";
    case SG_TRACE_STEP: return "step";
    case SG_TRACE_GATHER: return "gather";
    case SG_TRACE_MARK: return "mark";
    case SG_TRACE_WAIT: return "wait";
  }
  return "?";
}

static sg_status json_event(const sg_trace_event *ev, void *ctx) {
  sg__json_ctx *c = ctx;
  const int comm = ev->kind == SG_TRACE_REDUCE || ev->kind == SG_TRACE_GATHER;
  const int instant = ev->kind == SG_TRACE_GRAD_READY || ev->kind == SG_TRACE_MARK;
  fprintf(c->f, ",\n{\"name\":");
  json_string(c->f, ev->label[0] ? ev->label : kind_name(ev->kind));
  fprintf(c->f, ",\"cat\":\"%s\",\"ph\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f", kind_name(ev->kind),
          instant ? "i" : "X", c->rank, comm, ev->start_us);
  if (instant)
    fprintf(c->f, ",\"s\":\"t\"");
  else
    fprintf(c->f, ",\"dur\":%.3f", ev->end_us - ev->start_us);
  fprintf(c->f, ",\"args\":{\"id\":%d,\"step\":%" PRIu64 "}}", ev->id, ev->step);
  return ferror(c->f) ? sg__err(SG_ERR_IO, "write failed") : SG_OK;
}

static void json_header(FILE *f, const sg_engine *e) {
  fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"library\":\"shardgrad %d\",\"rank\":%d,"
          "\"world\":%d,\"strategy\":\"%s\",\"device\":\"%s\",\"buckets\":%d},\n\"traceEvents\":[\n",
          sg_version(), e->rank, e->world, e->strat->name, e->dev->ops->name,
          e->plan->nbuckets);
  fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}},\n",
          e->rank, e->rank);
  fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":"
          "\"caller queue\"}},\n", e->rank);
  fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":1,\"args\":{\"name\":"
          "\"comm queue\"}}", e->rank);
}

static sg_status write_json(sg_engine *e, const char *path, const char *fn) {
  char file[SG__TRACE_PATH];
  if (!sg__path_for_rank(path, e->rank, file, sizeof file))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: path too long", fn);
  FILE *f = fopen(file, "w");
  if (!f) return sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot create '%s'", fn, file);
  json_header(f, e);
  sg__json_ctx c = {f, e->rank};
  uint64_t missing = 0;
  sg_status st = for_events(e, json_event, &c, &missing);
  fprintf(f, "\n]}\n");
  if (fclose(f) != 0 && st == SG_OK)
    st = sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot write '%s'", fn, file);
  if (st != SG_OK) remove(file); /* no half-written trace left behind */
  if (st == SG_ERR_IO) return sg__err_prefix(st, fn);
  return st;
}

sg_status sg_trace_write(sg_engine *e, const char *path) {
  SG_ENGINE_GUARD(e, "sg_trace_write");
  static const char *fn = "sg_trace_write";
  SG_TRY(check_trace(e, fn));
  if (!path || !path[0]) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: path is NULL or empty", fn);
  return write_json(e, path, fn);
}

/* ---------------------------------------------------------------------------------------- */
/* lifetime                                                                                  */

void sg__trace_auto_start(sg_engine *e) {
  const char *path = sg__env_text(SG_ENV_TRACE);
  if (!path || !path[0]) return;
  sg_status st = start(e, SG__TRACE_DEFAULT, "SG_TRACE");
  if (st == SG_OK && !(e->trace->auto_path = malloc(strlen(path) + 1))) st = SG_ERR_OUT_OF_MEMORY;
  if (st != SG_OK) {
    SG_LOG(SG_LOG_WARN, e->rank, "SG_TRACE=%s: tracing not started: %s", path, sg_last_error());
    return;
  }
  memcpy(e->trace->auto_path, path, strlen(path) + 1);
  SG_LOG(SG_LOG_INFO, e->rank, "tracing into %s at sg_engine_destroy", path);
}

void sg__trace_free(sg_engine *e) {
  sg__trace *t = e->trace;
  if (!t) return;
  if (t->auto_path && e->state == SG_ES_READY && t->recs) {
    sg_status st = write_json(e, t->auto_path, "SG_TRACE");
    if (st != SG_OK) SG_LOG(SG_LOG_WARN, e->rank, "trace not written: %s", sg_last_error());
  }
  if (e->dev) free_marks(e, t);
  free(t->auto_path);
  free(t);
  e->trace = NULL;
}
