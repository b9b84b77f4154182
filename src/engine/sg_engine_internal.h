/* Engine internals shared by the engine files (DESIGN.md section 1): the engine struct, then
 * each file's functions under its name. */
#ifndef SG_ENGINE_INTERNAL_H
#define SG_ENGINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../comm/sg_comm.h"     /* sg_comm internals, collectives */
#include "../core/sg_core.h"     /* errors, logging */
#include "../device/sg_device.h" /* device vtable */
#include "../memory/sg_memory.h" /* layout, arenas */
#include "../plan/sg_plan.h"     /* plan */
#include "../optim/sg_optimizer.h" /* optimizer descriptors */
#include "sg_guard.h"            /* sg__guard, SG_ENGINE_GUARD */
#include "sg_names.h"            /* sg__names */
#include "sg_strategy.h"         /* strategy ops */

typedef enum { SG_ES_BUILDING = 0, SG_ES_READY = 1, SG_ES_BROKEN = 2 } sg__engine_state;

/* Each sub-structure below has one owner file that initialises, frees and restores it; other
 * files read its fields and change them only through the owner's functions. */

/* Registration (sg_engine.c): the parameters as registered, before and after finalize. */
typedef struct sg__registry {
  int nparams, cap;
  char **names;
  sg__names name_index; /* sg_names.c: names -> id */
  size_t *numels;
  uint32_t *flags;
  int *group; /* [cap]: parameter group of each parameter */
} sg__registry;

/* Gradients and micro-batches (sg_grads.c). The slots themselves belong to the strategy
 * (slot_state, its slots_init). */
typedef struct sg__grads {
  char *slots;           /* the GRADS arena's slot region (full buffer or staging buffers) */
  char *accum;           /* accumulator, accum dtype, in state coordinates */
  float *nosync;         /* full fp32 buffer for sg_set_sync(0), allocated on first use */
  uint8_t *ready;        /* [nparams] */
  int *pending;          /* [nbuckets]: params of the bucket not yet ready */
  uint8_t *nosync_dirty; /* [nbuckets]: local gradients waiting in `nosync` */
  void *slot_state;      /* the strategy's slot bookkeeping */
  int next_launch;       /* next bucket (plan order) to launch in this micro-batch */
  int touched;           /* any gradient touched in this micro-batch */
  int sync;
  int norm_valid;        /* norm_ss holds the sum of squares of `accum` (sg_grad_norm); 0 once
                            gradients arrive or accum is cleared */
  double norm_ss[3];      /* sum of squares, non-finite count, ranks with an absent parameter */
  double user_scale;     /* sg_grad_scale's product since the accumulator was last cleared */
  uint8_t *empty;        /* [nbuckets]: no reduction of the bucket since accum was emptied, so
                            its part holds stale values: the next reduction writes it instead of
                            adding, and a norm or step before that zeroes it */
  double *norm_host;     /* 4 doubles, pinned host memory: where the step's norm is read
                            ([0..2], norm_ss's), and [3] this rank's absent flag on its way
                            into the device's small piece */
  uint8_t *present;      /* [nparams]: this rank gave the parameter a gradient (sg_grad_ptr,
                            sg_grad_add, sg_grad_ready) since accum was last emptied */
  uint8_t *agreed;       /* [nparams]: some rank did (sg__grads_presence) */
  uint64_t *bits;        /* [nwords * world]: the presence bits all-gathered */
  double small_flag;     /* what the small piece's absent count holds now; -1 unknown */
} sg__grads;

/* All-gathers of the last step (sg_gather.c). */
typedef struct sg__gathers {
  uint64_t *ticket; /* [nbuckets]: the comm job gathering bucket b */
  uint64_t last;    /* ticket of the last gather of the step */
  uint64_t waited;  /* the caller's queue is ordered after this ticket */
  int pending;      /* gathers the caller's queue has not waited for yet */
} sg__gathers;

/* Optimizer state and hyperparameters (sg_optim.c). Hyperparameters are doubles (the config's
 * floats convert exactly); every group, 0 included, has its lr and weight decay here. */
typedef struct sg__optim {
  const sg__optim_desc *od; /* the optimizer: its state arrays, scalars and kernels */
  uint64_t step;
  double lr[SG_MAX_GROUPS], wd[SG_MAX_GROUPS];
  double beta1, beta2, eps, max_grad_norm; /* every group's */
  int ngroups;      /* highest group of any parameter + 1 (after finalize) */
  float *master;    /* NULL for f32 params */
  int nstates;      /* od->nstates once bound */
  float *state[SG__OPTIM_MAX_STATES];
  sg__seg *segs;    /* this rank's update segments, bucket by bucket */
  int nsegs;
  int *bucket_seg;  /* [nbuckets+1]: segments of bucket b are [bucket_seg[b], bucket_seg[b+1]) */
  uint64_t *lag;    /* [nparams]: steps the parameter was skipped in (no gradient on any rank):
                       its own step count, the bias correction's t, is step - lag */
  int nlag;         /* parameters with lag > 0 */
  const uint8_t *present; /* during a step: which parameters it updates (NULL: all) */
  sg__seg *cls;     /* [max params of a bucket]: the segments of one class of a bucket */
} sg__optim;

/* A replica transport's checkpointed state (sg__replica_ops.ck_*): the states, each a section
 * of every rank file (one record per element, the kind SG_CK_REP0 + k of src/ckpt). */
enum {
  SG__REP_OUTER_PARAMS = 0, /* fp32: the parameters at the last outer step */
  SG__REP_OUTER_MOM = 1,    /* fp32: the outer momentum */
  SG__REP_RESID = 2,        /* a codec's residuals: fp32 r2 (the chunk owner's), then r1 of
                               replica 0..N-1: 4 (N + 1) bytes */
  SG__REP_OUTER_RESID = 3,  /* the same, of the outer steps' pseudo-gradient (outer, int8) */
  SG__REP_STATES = 4
};
typedef struct sg__rep_ck {
  uint32_t esz[SG__REP_STATES]; /* record bytes; 0: not kept / not in the checkpoint */
  void *rec[SG__REP_STATES];    /* host records, opt_numel each, state coordinates */
  uint64_t position;            /* outer steps: sg_steps since the last outer step */
} sg__rep_ck;

/* Replica transport (DESIGN.md section 1, "Hybrid engines"): how the accumulator's slices are
 * summed across the replicas of a hybrid engine, one never-NULL table per row of the table
 * there, chosen once at sg_engine_create (src/engine/policy/sg_replica_select.c): flat (one
 * replica: every entry does nothing), host (a CPU device), attached (beside the shard channel
 * on the device), unbound (an NCCL channel without a device beside a host-driven shard),
 * staged (a host communicator beside an NCCL shard, through pinned host memory on a host queue
 * of its own), at-step (an offloaded accumulator: summed on the host at the step; with
 * a codec, at-step-int8/int4; outer steps: outer-host, policy/sg_replica_outer_host.c). */
typedef struct sg__replica_ops {
  const char *name;
  /* The stage's entry points (sg_replica.c calls them; flat: nothing; every other transport:
   * the shared ones of src/engine/policy/sg_replica_common.c). */
  sg_status (*init)(sg_engine *e);
  void (*free)(sg_engine *e);
  void (*detach)(sg_engine *e);
  sg_status (*agree)(sg_engine *e, sg_status st);
  sg_status (*open)(sg_engine *e, const char *fn);
  sg_status (*after_reduce)(sg_engine *e, int b);
  sg_status (*rest)(sg_engine *e);
  sg_status (*allgather_host)(sg_engine *e, void *host, size_t bytes);
  sg_status (*broadcast_params)(sg_engine *e, int root);
  /* The transport. Declared: its channel's collectives share the shard channel's comm scratch
   * (they run on the same queue, on buffers of the same kind). */
  int share_scratch;
  /* init's own part (staged: the pinned stage), and the release of what select made (staged:
   * its host queue) once the channel is unbound. */
  sg_status (*prepare)(sg_engine *e);
  void (*release)(sg_engine *e);
  /* Bucket b's sum across replicas begins (queued now, or left for the step), and the step's
   * part once every bucket was claimed (staged: copied back; at-step: summed now). */
  sg_status (*claim)(sg_engine *e, int b);
  sg_status (*finish)(sg_engine *e);
  /* fn(arg) on the queue of the channel's collectives, waited for; the jobs queued there so far
   * finished (their failure, if any). */
  sg_status (*run)(sg_engine *e, sg__job_fn fn, void *arg);
  sg_status (*drain)(sg_engine *e);
  /* The replicas the step's gradient is summed over (the averaging's N; outer steps: 1, each
   * replica steps on its node's gradient). */
  int (*grad_replicas)(const sg_engine *e);
  /* After each sg_step: 1 when this step ends an outer period (outer steps: every H-th), then,
   * once the step's gathers landed, sync makes every replica's parameters the outer step's
   * (the engine gathers them in the node after it); streaming: 1 when the step's group has
   * buckets, and sync begins their sum, which the next step's finish merges; others: 0,
   * nothing. */
  int (*sync_due)(sg_engine *e);
  sg_status (*sync)(sg_engine *e);
  /* Checkpoints (src/ckpt): the per-element state the transport keeps beyond the optimizer's
   * (a codec's residuals, the outer parameters and momentum) and the outer period's position.
   * ck_describe: the record bytes of each state it keeps (0: none) and the position. ck_save:
   * collective over the replicas (every rank calls it, idle): fills the records the caller
   * allocated (ck->rec[k] for esz[k] > 0, lay.opt_numel records in state coordinates) on
   * replica 0, whose ranks write; elsewhere rec is NULL. restore, after sg_load: from the
   * loaded records (rec[k] NULL: not in the checkpoint, that state begins afresh; esz[k] the
   * checkpoint's record bytes) or with ck NULL everything afresh. */
  void (*ck_describe)(const sg_engine *e, struct sg__rep_ck *ck);
  sg_status (*ck_save)(sg_engine *e, struct sg__rep_ck *ck);
  void (*restore)(sg_engine *e, const struct sg__rep_ck *ck);
} sg__replica_ops;


/* The memory a replica channel's host-side collectives take (rep.mem, chosen with the table):
 * either kind, device memory only (attached to a CUDA device), host memory only (a host
 * communicator without a device beside a CUDA device). */
enum { SG__REP_MEM_ANY = 0, SG__REP_MEM_DEVICE = 1, SG__REP_MEM_HOST = 2 };

/* Replicas (sg_replica.c): the copies of this shard group on other nodes of a hybrid engine
 * (sg_engine_create_hybrid), the replica communicator's channel, and which buckets' all-reduce
 * across replicas this step has queued. A flat engine has one replica, no channel and the flat
 * transport. */
typedef struct sg__replicas {
  const sg__replica_ops *ops; /* the transport, never NULL after sg_engine_create */
  sg_comm *comm;     /* channel of the replica communicator; NULL: one replica */
  int mem;           /* SG__REP_MEM_*: what its host-side collectives take */
  int elem_q;        /* sg__queue of its element work (outer steps, codes): sg_replica_select.c */
  int rank, n;       /* this rank's replica and the replica count (flat: 0, 1) */
  int microbatches;  /* sg_set_microbatches (0: not said) */
  int mb;            /* micro-batches begun since the accumulator was last cleared */
  int nclaimed;      /* buckets whose all-reduce across replicas is queued this step */
  uint8_t *claimed;  /* [nbuckets]: SG__CLAIM_*, 0: not yet */
  char *wire;        /* one slice in replica_reduce_dtype (COMM arena; pinned host memory of
                        the replica stage when the accumulator is offloaded); NULL when the
                        accumulator itself goes on the wire (same dtype). With a codec or outer
                        steps the layout's replica buffer is their state instead, which they
                        address themselves (wire then points at it unused) */
  int host_wire;     /* wire is this stage's pinned host memory (offload) */
  /* Staged (an NCCL shard, a host replica communicator, the accumulator on the GPU): the
   * channel's own host queue (a CPU device), the shard's slices in replica_reduce_dtype in
   * pinned host memory (shard offsets), and that queue's last job. Streaming outer steps have
   * the host queue too (their sums run there beside the node's reductions; on a CUDA device
   * with host-driven communicators it is the device's twin, sg__device_ops.twin). */
  sg__device *host_dev;
  char *stage;
  uint64_t host_last;
  /* The device of the replica element work (outer steps, codes, wire casts) and of the memory
   * its state lies in: the engine's; with an offloaded optimizer a CPU device over pinned host
   * memory (rep.host_dev, beside the host master and accumulator it reads);
   * sg_replica_select.c. */
  sg__device *elem_dev;
  /* The device of the sums' own element work (wire casts, codes): elem_dev, or with streaming
   * outer steps over host-driven communicators on CUDA the twin their channel is bound to (its
   * queue runs the sums; the same GPU's memory); sg_replica_select.c. */
  sg__device *sum_dev;
  /* A replica codec (cfg.replica_codec): its residuals and code buffers, in the layout's
   * replica buffer (src/engine/policy/sg_replica_codec.c owns it); NULL without one. */
  struct sg__codec *codec;
  /* Outer steps (cfg.outer_every; src/engine/policy/sg_replica_outer.c owns it): where the
   * period stands, on the host (the outer parameters and momentum themselves are in the
   * layout's replica buffer, device memory on a CUDA device). */
  struct {
    int fresh; /* the outer parameters and momentum are to be taken at the next step */
    int inner; /* steps since the last outer step (streaming: since the period began) */
    int group; /* streaming: the group of buckets the step that just ended syncs */
    /* where a run's fp32 parameters are read and written (sg_replica_outer.c: the device's;
     * sg_replica_outer_host.c: an offloaded optimizer's, on the host) */
    const struct sg__outer_place *place;
  } outer;
  /* Streaming outer steps (src/engine/policy/sg_replica_outer_stream.c owns it): whether a
   * group's sum is in flight, which group, and where the sums run on the engine's replica lane
   * (no host_dev) the ticket of its job. */
  struct {
    int pending, group;
    uint64_t ticket;
  } stream;
} sg__replicas;

/* rep.claimed[b]: its all-reduce across replicas is queued; it waits for the step (at-step);
 * staged: summed on the host and copied back. */
enum { SG__CLAIM_QUEUED = 1, SG__CLAIM_AT_STEP = 2, SG__CLAIM_BACK = 3 };

/* Loss scale (sg_scale.c). */
typedef struct sg__scale {
  float loss_scale;
  int clean_steps;
  int dynamic;
} sg__scale;

/* The step's outcome decided on the device (sg_outcome.c). */
typedef struct sg__outcome {
  sg_elem_step_out *host; /* pinned: the device's copy of the last record; NULL: the host
                             decides every step (no step kernel, or offloaded state) */
  uint64_t seq;           /* the last step decided on the device */
  int pending;            /* its outcome not yet applied to the step count and loss scale */
  sg_step_info last;      /* the latest sg_step's info (sg_last_step_info) */
  int last_valid;         /* a step completed since the engine was made */
  int last_pending;       /* last's norm, clip, skip and step await the record of seq */
} sg__outcome;

struct sg_engine {
  /* lifecycle (sg_engine.c) */
  sg_config cfg;
  sg_comm *comm;
  int rank, world;
  sg__device *dev;
  sg__engine_state state;
  sg__guard guard; /* sg_guard.c: one thread at a time in the public functions */
  const sg__strategy_ops *strat;
  sg__plan *plan;
  sg__layout lay;
  sg__arenas ar;
  char *params;   /* working params, param dtype, flat plan layout */
  char *small;    /* 256 bytes of device memory for the step's tiny all-reduce */
  uint64_t last_ticket; /* last comm job submitted (sg__engine_submit) */
  sg__registry reg;
  sg__grads g;
  sg__gathers gat;
  sg__optim opt;
  sg__scale sc;
  sg__outcome out;
  sg__replicas rep;
  struct sg__trace *trace; /* sg_trace.c; NULL until first started */
  struct sg__offload *off; /* the offloaded optimizer state (src/offload/sg_offload.c, made and
                              freed by the offloading strategies' state ops); NULL otherwise */
  struct sg__q8 *q8;       /* the 8-bit state's bookkeeping (policy/sg_state_q8.c, made and
                              freed by its state ops); NULL otherwise */
};

/* sg_engine_base.c: the base services every engine file may call (they call no other engine
 * file; scripts/check_deps.sh checks that the engine files call each other without a circle).
 * Call-order and argument checks shared by the public functions. */
sg_status sg__engine_check(sg_engine *e, const char *fn, int need_ready);
sg_status sg__engine_check_id(sg_engine *e, int id, const char *fn);
/* sg__engine_check (finalized) and sg__engine_check_id, then ptr (the argument `what`) not NULL. */
sg_status sg__engine_check_param(sg_engine *e, int id, const void *ptr, const char *what,
                                 const char *fn);
/* dt (the argument `what`) is an sg_dtype. */
sg_status sg__engine_check_dtype(int dt, const char *what, const char *fn);
sg_status sg__engine_check_group(int group, const char *fn);
/* A public getter's checks: the engine and its output pointer `what` not NULL. */
sg_status sg__engine_check_out(const sg_engine *e, const void *out, const char *what,
                               const char *fn);
/* Marks the engine broken when st is the failure of a collective (ranks out of step for good)
 * and returns st; the failure text stays. */
sg_status sg__engine_broken(sg_engine *e, sg_status st);
/* Marks the engine broken whatever st is (state left half-changed, `where` says how) and
 * returns st. The only two ways the engine state becomes SG_ES_BROKEN. */
sg_status sg__engine_break(sg_engine *e, sg_status st, const char *where);

/* Deadline of a host wait for the comm queue: every collective on it has its own deadline, so
 * this is only a backstop for a queue of several (2 x timeout_ms; none when timeout_ms <= 0). */
int64_t sg__engine_host_deadline(const sg_engine *e);
/* Submits fn(arg) to the comm queue and records its ticket (*ticket, and e->last_ticket). On
 * failure *ticket == 0 means the job was not queued (arg is still the caller's). */
sg_status sg__engine_submit(sg_engine *e, sg__job_fn fn, void (*drop)(void *arg), void *arg,
                            uint64_t *ticket);
/* Runs fn(arg) on the comm queue and waits for it (host), with the deadline. */
sg_status sg__engine_run_comm(sg_engine *e, sg__job_fn fn, void *arg);
/* The same for a job on the replica channel: the device's replica lane (a stream of its own
 * where both channels are stream-ordered: the next bucket's reduction does not wait for it),
 * or the comm queue. Every job that calls the replica channel goes this way. */
sg_status sg__engine_submit_replica(sg_engine *e, sg__job_fn fn, void (*drop)(void *arg),
                                    void *arg, uint64_t *ticket);
sg_status sg__engine_run_replica(sg_engine *e, sg__job_fn fn, void *arg);
/* In-place all-gather of device memory through the comm queue, waited for. */
sg_status sg__engine_allgather(sg_engine *e, void *dev_buf, size_t bytes_per_rank);
/* Broadcast of `bytes` of device memory from shard rank root through the comm queue, waited for. */
sg_status sg__engine_broadcast(sg_engine *e, void *dev_buf, size_t bytes, int root);
/* All-gather `bytes_per_rank` from host memory through a temporary device buffer. */
sg_status sg__engine_allgather_host(sg_engine *e, void *host, size_t bytes_per_rank);

/* sg_engine.c (the lifecycle: called by nothing in src/engine; the checkpoints use this) */
/* Pieces of parameter `id` held by this rank in the state arrays (state coordinates). */
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
/* Empties the accumulator: after a step, and a load (with the no_sync sums). Nothing is written:
 * each bucket's next reduction writes its part (DESIGN.md section 4). */
sg_status sg__grads_clear_accum(sg_engine *e);
sg_status sg__grads_clear(sg_engine *e);
/* Sum of squares and non-finite count of the reduced (still scaled) gradient over all ranks,
 * once every reduction of the step was submitted: the step's one host synchronization. */
sg_status sg__grads_sumsq(sg_engine *e, double out[3]);
/* Which parameters some rank gave a gradient since the accumulator was emptied (sumsq's out[2]
 * counts the ranks that missed one: when every rank did, they exchange their bits, a
 * collective; when some rank missed none, every parameter has a gradient).
 * *present: NULL when every parameter has one, else [nparams] flags; *count: how many. */
sg_status sg__grads_presence(sg_engine *e, const double ss[3], const uint8_t **present,
                             int *count);
/* 1 when this rank gave some (tracked) parameter no gradient since the accumulator was emptied:
 * such a rank must learn the others' presence on the host (sg_step's host path). */
int sg__grads_locally_absent(const sg_engine *e);
/* The same sum into e->small (device memory), the compute queue ordered after it: no wait. The
 * same collectives as sg__grads_sumsq, so that ranks may take either. */
sg_status sg__grads_sumsq_dev(sg_engine *e);
/* sg_grad_scale: the step's gradient is multiplied by factor (reset to 1 with the accumulator). */
void sg__grads_scale_by(sg_engine *e, double factor);
/* The sum of squares of the reduced gradient kept by sg_grad_norm for the step's sg_step (its
 * norm_ss, valid until gradients arrive or the accumulator is cleared). */
void sg__grads_norm_keep(sg_engine *e, const double ss[3]);
void sg__grads_norm_drop(sg_engine *e);

/* sg_accum.c */
/* Bucket b's slice of the accumulator (this rank's part, accum_dtype). */
char *sg__accum_of(const sg_engine *e, int b);
/* On the comm queue, from a strategy's reduce: n reduced elements (reduce_dtype) into the
 * accumulator at state index state_off, written when `first`, else added. */
sg_status sg__accum_into(sg_engine *e, size_t state_off, const void *src, size_t n, int first);
/* The parts of the buckets not reduced since the accumulator was emptied zeroed (compute
 * queue): they count as zeros in a norm or a step. */
sg_status sg__accum_zero_empty(sg_engine *e);

/* sg_gather.c */
sg_status sg__gathers_init(sg_engine *e);
void sg__gathers_free(sg_engine *e);
/* 1 when the strategy refreshes working parameters by gathering (and there is another rank). */
int sg__gathers_needed(const sg_engine *e);
/* Queues bucket b's gather after everything issued to the compute queue so far. */
sg_status sg__gathers_submit(sg_engine *e, int b);
/* Orders the caller's queue after every pending all-gather: before any engine work that reads
 * or writes the working parameters. */
sg_status sg__step_settle(sg_engine *e);
/* A new caller's queue (sg_set_stream): ordered after the pending gathers too. */
sg_status sg__gathers_new_queue(sg_engine *e);
/* Every bucket's gather at once, waited for (after a checkpoint load). */
sg_status sg__gathers_all(sg_engine *e);

/* sg_optim.c */
/* Hyperparameters from the config (sg_engine_create). */
void sg__optim_init(sg_engine *e);
/* State arrays in the arenas and the update segments (sg_finalize, after the arenas). */
sg_status sg__optim_bind(sg_engine *e);
void sg__optim_free(sg_engine *e);
/* Counters and hyperparameters from a checkpoint. ngroups 0 (a checkpoint before groups):
 * every group takes lr0 and keeps its weight decay; else groups below ngroups take theirs. */
void sg__optim_restore(sg_engine *e, uint64_t step, float lr0, uint32_t ngroups,
                       const float *group_lr, const float *group_wd);
/* The step's update of buckets [b1 .. b0] for the given gradient scale: `step` counted once
 * (sg__optim_begin), then bucket by bucket. */
/* present: the parameters the step updates (NULL: all); the others keep their state and their
 * own step count (DESIGN.md section 4, "Parameters without a gradient"). */
void sg__optim_begin(sg_engine *e, const uint8_t *present);
void sg__optim_undo_begin(sg_engine *e);
/* Parameter id's own step count (the t of its bias correction). */
uint64_t sg__optim_param_step(const sg_engine *e, int id);
/* 1 when some parameter's own step count differs from the engine's step. */
int sg__optim_steps_differ(const sg_engine *e);
/* After sg__optim_restore: parameter id's own step count (<= the restored step). */
void sg__optim_restore_param_step(sg_engine *e, int id, uint64_t step);
/* outcome: NULL, or the step's record in device memory, whose factor and skip the update
 * reads instead of grad_scale (sg_outcome.c). */
sg_status sg__optim_update_bucket(sg_engine *e, int b, float grad_scale,
                                  const sg_elem_step_out *outcome);
/* Every segment at once (no gathers to overlap). */
sg_status sg__optim_update_all(sg_engine *e, float grad_scale, const sg_elem_step_out *outcome);
/* The master from the working params, for every owned segment (after sg_broadcast_params). */
sg_status sg__optim_master_from_working(sg_engine *e);
/* SG_OK when `which` indexes a state array of the optimizer (message naming them otherwise). */
sg_status sg__optim_check_state(const sg_engine *e, int which, const char *fn);

/* sg_scale.c */
void sg__scale_init(sg_engine *e);
/* After a step's decision: halves on overflow, doubles after scale_window clean steps. */
void sg__scale_update(sg_engine *e, int overflow);
/* From a checkpoint saved with dynamic scaling, when this engine scales dynamically. */
void sg__scale_restore(sg_engine *e, int saved_dynamic, float loss_scale, uint32_t clean_steps);

/* sg_outcome.c: the step's outcome decided on the device, so that no host wait sits between
 * the norm and the update (DESIGN.md section 4). init at sg_finalize, after the strategy's state
 * (nothing where the device has no step kernel or the state is the host's); free at destroy. */
sg_status sg__outcome_init(sg_engine *e);
void sg__outcome_free(sg_engine *e);
/* 1: sg_step may decide on the device. */
int sg__outcome_on_device(const sg_engine *e);
/* The record the updates read (device memory; sg__update_args.outcome). */
const sg_elem_step_out *sg__outcome_dev(const sg_engine *e);
/* On the compute queue: the outcome of the summed partials in e->small for `in`. */
sg_status sg__outcome_decide(sg_engine *e, const sg_elem_step_in *in);
/* The step that sg__outcome_decide decided is enqueued (counted speculatively, its loss scale
 * update not done): sg__outcome_settle applies them. */
void sg__outcome_defer(sg_engine *e);
/* The deferred outcome applied to the host's counters (a skipped step uncounted, the dynamic
 * loss scale updated), read from pinned memory without a wait once the device wrote it, else
 * after one host wait; *out (may be NULL) gets the record. Nothing deferred: nothing. */
sg_status sg__outcome_settle(sg_engine *e, sg_elem_step_out *out);
/* The info of the step that sg_step completed (sg_last_step_info); pending: decided on the
 * device, its norm, clip, skip and step count filled in by the settle that reads its record. */
void sg__outcome_keep(sg_engine *e, const sg_step_info *info, int pending);

/* sg_replica.c */
/* sg_engine_create: the transport (flat when replica is NULL); sg_engine_create_hybrid: binds
 * the replica communicator where the transport says, records the layout. */
sg_status sg__replicas_attach(sg_engine *e, sg_comm *replica, const char *fn);
/* sg_finalize, after the arenas: the bucket flags and the wire buffer. */
sg_status sg__replicas_init(sg_engine *e);
/* Frees what sg__replicas_init made (a failed finalize, destroy). */
void sg__replicas_free(sg_engine *e);
/* Destroy, once the comm queue is drained: unbinds the channel. */
void sg__replicas_detach(sg_engine *e);
/* Data-parallel ranks: shard ranks x replicas (the averaging divisor). */
int sg__replicas_world(const sg_engine *e);
/* This rank writes checkpoint files for its shard group (replica 0; flat: every rank). */
int sg__replicas_writer(const sg_engine *e);
/* The replica stage's piece of the layout for n replicas (estimate: W / shard_ranks). */
void sg__replicas_shape(const sg__plan *p, const sg_config *cfg, int n, sg__layout_shape *out);
/* The ranks the step's gradient sum spans: W, or the node's L with outer steps (averaging). */
int sg__replicas_grad_world(const sg_engine *e);
/* sg_step, after the update: whether this step ends an outer period, and the outer step
 * (collective over the replicas; the caller then gathers the parameters in the node). */
int sg__replicas_sync_due(sg_engine *e);
sg_status sg__replicas_sync(sg_engine *e);
/* Checkpoints: the transport's state (sg__replica_ops.ck_describe, ck_save); after sg_load,
 * the transport's own state from ck (NULL, or a state not in it: begins again). */
void sg__replicas_ck_describe(const sg_engine *e, sg__rep_ck *ck);
sg_status sg__replicas_ck_save(sg_engine *e, sg__rep_ck *ck);
void sg__replicas_restore(sg_engine *e, const sg__rep_ck *ck);
/* sg_finalize, after the shard's own agreement (st): every rank of the shard in the same
 * replica position, every replica with the same shard size, plan and config; any rank's
 * failure reaches every rank. Returns the verdict (SG_ERR_MISMATCH names the difference). */
sg_status sg__replicas_agree(sg_engine *e, sg_status st);
/* A new micro-batch may start (not after this step's replica reductions began), and counts it. */
sg_status sg__replicas_open(sg_engine *e, const char *fn);
void sg__replicas_count_microbatch(sg_engine *e);
/* sg_set_microbatches (checked by sg_grads.c, between micro-batches). */
void sg__replicas_set_microbatches(sg_engine *e, int n);
/* After bucket b's reduction job was queued: in the declared last micro-batch, its all-reduce
 * across replicas right behind it. */
sg_status sg__replicas_after_reduce(sg_engine *e, int b);
/* sg_step / sg_grad_norm, after every reduction was queued: the buckets not yet all-reduced
 * across replicas, in plan order. */
sg_status sg__replicas_rest(sg_engine *e);
/* The accumulator was cleared (step, sg_grad_zero, load): a new step's reductions. */
void sg__replicas_reset(sg_engine *e);
/* All-gather over the replicas of `bytes` per replica in host memory (flat: nothing). */
sg_status sg__replicas_allgather_host(sg_engine *e, void *host, size_t bytes);
/* Working parameters of replica `root` on every replica (each rank from its counterpart). */
sg_status sg__replicas_broadcast_params(sg_engine *e, int root);

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
