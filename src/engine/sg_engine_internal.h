/* Engine internals shared by sg_engine.c (lifecycle, parameters), sg_grads.c (micro-batches and
 * bucket reductions) and sg_step.c (the optimizer step). */
#ifndef SG_ENGINE_INTERNAL_H
#define SG_ENGINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../comm/sg_comm.h"     /* sg_comm internals, collectives */
#include "../core/sg_core.h"     /* errors, logging */
#include "../device/sg_device.h" /* device vtable */
#include "../memory/sg_memory.h" /* layout, arenas */
#include "../plan/sg_plan.h"     /* plan */
#include "sg_guard.h"            /* sg__guard, SG_ENGINE_GUARD */
#include "sg_names.h"            /* sg__names */

typedef enum { SG_ES_BUILDING = 0, SG_ES_READY = 1, SG_ES_BROKEN = 2 } sg__engine_state;

struct sg_engine {
  sg_config cfg;
  sg_comm *comm;
  int rank, world;
  sg__device *dev;
  sg__engine_state state;
  sg__guard guard; /* sg_guard.c: one thread at a time in the public functions */
  /* registration (before finalize) */
  int nparams, cap;
  char **names;
  sg__names name_index; /* sg_names.c: names -> id */
  size_t *numels;
  uint32_t *flags;
  int *group;     /* [cap]: parameter group of each parameter */
  /* after finalize */
  sg__plan *plan;
  sg__layout lay;
  sg__arenas ar;
  char *params;   /* working params, param dtype, flat plan layout */
  char *slots;    /* full grad buffer (NO_SHARD, SHARD_OPT) or staging buffers (SHARD_GRAD_OP) */
  size_t staging_stride; /* bytes between staging buffers */
  char *accum;    /* accumulator, accum dtype: full (NO_SHARD) or shard */
  float *master;  /* NULL for f32 params */
  float *m, *v;
  char *small;    /* 256 bytes of device memory for the step's tiny all-reduce */
  float *nosync;  /* full fp32 buffer for sg_set_sync(0), allocated on first use */
  sg__seg *segs;  /* this rank's AdamW segments, bucket by bucket */
  int nsegs;
  int *bucket_seg; /* [nbuckets+1]: segments of bucket b are [bucket_seg[b], bucket_seg[b+1]) */
  /* all-gathers of the last step (sg_step.c) */
  uint64_t *gather_ticket; /* [nbuckets]: the comm job gathering bucket b */
  uint64_t gather_last;    /* ticket of the last gather of the step */
  uint64_t gather_waited;  /* the caller's queue is ordered after this ticket */
  int gather_pending;      /* gathers the caller's queue has not waited for yet */
  /* micro-batch state */
  uint8_t *ready;          /* [nparams] */
  int *pending;            /* [nbuckets]: params of the bucket not yet ready */
  int *bucket_staging;     /* [nbuckets]: staging index held, -1 none (SHARD_GRAD_OP) */
  uint64_t *bucket_ticket; /* [nbuckets]: job that last used the bucket's slot region */
  uint8_t *nosync_dirty;   /* [nbuckets]: local gradients waiting in `nosync` */
  int nstaging;            /* staging buffers: lay.nstaging in the arena, more if forced */
  char **staging_ptr;      /* [nstaging] */
  int *staging_owner;      /* [nstaging]: bucket holding it, -1 free */
  uint64_t *staging_ticket;/* [nstaging]: job after which it is zero and free */
  int next_launch;         /* next bucket (plan order) to launch in this micro-batch */
  int touched;             /* any gradient touched in this micro-batch */
  int sync;
  uint64_t last_ticket;
  /* optimizer state */
  uint64_t step;
  float lr;               /* group 0's lr */
  float group_lr[SG_MAX_GROUPS]; /* lr of groups >= 1 ([0] is not read: group 0 uses lr) */
  float group_wd[SG_MAX_GROUPS];
  int ngroups;            /* highest group of any parameter + 1 (after finalize) */
  float loss_scale;
  int clean_steps;
  int dynamic_scale;
  struct sg__trace *trace; /* sg_trace_*; NULL until first started */
};

/* Call-order and argument checks shared by the public functions. */
sg_status sg__engine_check(sg_engine *e, const char *fn, int need_ready);
sg_status sg__engine_check_id(sg_engine *e, int id, const char *fn);
/* Marks the engine broken after a failed collective and keeps the failure text. */
sg_status sg__engine_broken(sg_engine *e, sg_status st);

/* Deadline of a host wait for the comm queue: every collective on it has its own deadline, so
 * this is only a backstop for a queue of several (2 x timeout_ms; none when timeout_ms <= 0). */
int64_t sg__engine_host_deadline(const sg_engine *e);
/* Runs fn(arg) on the comm queue and waits for it (host), with the deadline. */
sg_status sg__engine_run_comm(sg_engine *e, sg__job_fn fn, void *arg);
/* In-place all-reduce of device memory through the comm queue, waited for. */
sg_status sg__engine_allreduce(sg_engine *e, void *dev_buf, size_t count, int dtype);
/* All-gather `bytes_per_rank` from host memory through a temporary device buffer. */
sg_status sg__engine_allgather_host(sg_engine *e, void *host, size_t bytes_per_rank);

/* Pieces of parameter `id` held by this rank in master/m/v (shard coordinates). */
typedef struct sg__piece { size_t param_off, opt_off, len; } sg__piece;
/* Calls fn for each piece; stops at the first failure. */
sg_status sg__engine_for_pieces(sg_engine *e, int id,
                                sg_status (*fn)(sg_engine *, const sg__piece *, void *),
                                void *ctx);

/* sg_grads.c */
sg_status sg__grads_init(sg_engine *e);
void sg__grads_free(sg_engine *e);
void sg__grads_reset_microbatch(sg_engine *e);
/* Launches every pending micro-batch reduction (backward_end) and flushes no_sync gradients. */
sg_status sg__grads_flush(sg_engine *e, const char *fn);
/* No micro-batch in progress (SG_ERR_INVALID_STATE otherwise) and the comm queue drained: the
 * collectives of sg_get_master and friends then line up on every rank. */
sg_status sg__grads_idle(sg_engine *e, const char *fn);

/* sg_step.c */
/* Builds segs and bucket_seg (and the gather tickets) at sg_finalize. */
sg_status sg__step_build_segments(sg_engine *e);
/* Orders the caller's queue after every pending all-gather: before any engine work that reads
 * or writes the working parameters. */
sg_status sg__step_settle(sg_engine *e);

/* sg_trace.c. Records are created on the caller's thread only: a comm job gets its record
 * index when it is submitted and marks its start and end from the comm queue. */
/* A new event (issued now, step = e->step); -1 when not recording or full. label NULL: the
 * engine's own name for the event (the parameter's name, "reduce-scatter b3", "step", ...). */
int64_t sg__trace_new(sg_engine *e, int kind, int id, const char *label);
/* Start (which 0) or end (which 1) of record `rec` when queue q gets here; rec < 0: nothing. */
void sg__trace_at(sg_engine *e, int64_t rec, int which, sg__queue q);
/* An instant on the caller's queue. */
int64_t sg__trace_instant(sg_engine *e, int kind, int id, const char *label);
/* sg_finalize: starts recording when SG_TRACE names a file. */
void sg__trace_auto_start(sg_engine *e);
/* sg_engine_destroy, before the device goes: writes the SG_TRACE file, frees the marks. */
void sg__trace_free(sg_engine *e);

#endif /* SG_ENGINE_INTERNAL_H */
