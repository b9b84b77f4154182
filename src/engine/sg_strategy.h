/* Strategies (DESIGN.md sections 1 and 4): what a rank keeps of the gradients and optimizer
 * state, and how a bucket is reduced and the parameters refreshed. One ops table per strategy,
 * one file each under src/engine/strategy/, picked once at sg_engine_create from the table in
 * strategy/sg_strategy.c (sg__strategy_select); the engine calls through e->strat and never
 * looks at cfg.strategy again.
 *
 * Coordinates: "flat" is the full working-parameter buffer of the plan (every rank has all of
 * it); "state" indexes the fp32 optimizer state arrays, the master and the accumulator, which
 * hold either everything (replicated, state index = flat index) or this rank's shard (the
 * concatenation of its slices, DESIGN.md section 2). */
#ifndef SG_STRATEGY_H
#define SG_STRATEGY_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h"     /* sg_status, sg_config */
#include "../memory/sg_memory.h" /* sg__layout_shape */
#include "../plan/sg_plan.h"     /* sg__plan */

typedef struct sg_engine sg_engine;

/* The run of bucket b whose optimizer state this rank holds: flat elements [flat0, flat0 + n),
 * at state index state0 onwards. */
typedef struct sg__owned {
  size_t flat0, n, state0;
} sg__owned;

/* Policies: never-NULL tables of operations, one file each under src/engine/policy/, that a
 * strategy's table points at (chosen once with it at sg_engine_create). A variant with nothing
 * to do somewhere has an operation that does nothing or copies; what a caller must know of a
 * variant is a property the table declares (`sharded`, `host`), never a NULL test. */

/* Gradient slots (sg_slots_full.c: regions of one full buffer; sg_slots_staging.c: a pool of
 * staging buffers). init at sg_finalize (after the arenas), free at destroy (NULL state is
 * fine): the slot bookkeeping, in *state. */
typedef struct sg__slots_ops {
  const char *name;
  sg_status (*init)(sg_engine *e, void **state);
  void (*free)(sg_engine *e, void *state);
  /* Bucket b's slot for this micro-batch (its element bucket.start), zeroed and ready for the
   * compute queue to write: waits, on the compute queue, for the job that last zeroed it. */
  sg_status (*slot)(sg_engine *e, void *state, int b, char **base, const char *fn);
  /* Bucket b is done with its slot until the next micro-batch: comm job `ticket` zeroes it
   * (0: no new job; it was zeroed on the compute queue). */
  void (*release)(sg_engine *e, void *state, int b, uint64_t ticket);
  /* Asked just before bucket b's release(): 0 when its slot will be handed out again before
   * this micro-batch ends (a later bucket of the same backward pass writes into it), so it is
   * zeroed and stays resident; otherwise its next use is behind a forward pass, and this is
   * how many bytes from the slot's base then sit idle, all zero once the bucket's part is
   * zeroed (at least the bucket's; also what earlier holders of the same buffer wrote), which
   * may give their pages back meanwhile (the device's zero_release). Either kind of answer is
   * correct; a wrong 0 keeps pages resident while the activations grow, a wrong nonzero costs
   * page faults, so answer nonzero when unsure. */
  size_t (*idle_bytes)(const sg_engine *e, const void *state, int b);
} sg__slots_ops;

/* Sharding of the optimizer state (sg_shard_replicated.c: every rank holds all of it;
 * sg_shard_sharded.c: one slice of every bucket per rank). */
typedef struct sg__shard_ops {
  const char *name;
  /* Declared: the state is sharded over the ranks (what a hybrid engine replicates across
   * nodes, what needs gathering after a step and for a full view of a state array). */
  int sharded;
  /* On the comm queue: the step's norm partials (sum of squares, non-finite count, and the
   * rank's absent flag, sg_grads.c: 3 doubles in device memory) summed in place over the ranks
   * that share the gradient (replicated: every rank holds all of it already, nothing to do;
   * sg_grads.c then sums the flag alone). */
  sg_status (*sum_norm)(sg_engine *e, double *dev_ss);
  /* On the comm queue, after bucket b's update: the other ranks' parts of its working
   * parameters (replicated: none). */
  sg_status (*gather)(sg_engine *e, int b);
  /* Bucket b of an fp32 state array in full into tmp (device memory, bucket numel floats):
   * a gather through the comm queue (collective), or a copy where it is replicated. */
  sg_status (*gather_state)(sg_engine *e, int b, const float *state, float *tmp);
  /* Parameter id's full fp32 values from a state array (master or an optimizer state) into
   * host memory: a copy where replicated, through gather_state otherwise (collective). */
  sg_status (*param_state)(sg_engine *e, int id, const float *state, float *host_dst);
} sg__shard_ops;

/* Where the optimizer state and the accumulator live and who updates them
 * (sg_state_device.c: the device arenas and the device's kernels; sg_state_host.c: optimizer
 * offload, pinned host memory updated by the CPU, DESIGN.md section 4). Every op runs on the
 * caller's thread. */
#define SG__STATE_ACCUM (-1) /* array(): the accumulator (accum dtype) */
typedef struct sg__state_ops {
  const char *name;
  /* Declared: the accumulator and the state are host memory on a device that has its own. */
  int host;
  /* Declared: the state arrays are not fp32 arrays of the shard (8-bit blocks, sg_state_q8.c):
   * array() has none to give, read_state() dequantizes, checkpoints hold its own sections. */
  int coded;
  /* Declared: elements of a state block that must not straddle two tensors or two ranks; the
   * planner aligns parameter starts and slices to it (SG_PLAN_ALIGN where state is fp32). */
  size_t align;
  /* Declared: update() takes any subset of a bucket's segments, called once per class of
   * parameters with equal step counts (sg_optim.c), so that parameters no rank gave a gradient
   * are skipped (DESIGN.md section 4). 0: a step with such a parameter, or after a load that
   * left parameters behind in step count, is refused (SG_ERR_UNSUPPORTED). */
  int skips;
  /* sg_finalize, after the arenas and before the optimizer binds its arrays; free at destroy
   * (after the comm queue drained; nothing made: nothing). */
  sg_status (*init)(sg_engine *e);
  void (*free)(sg_engine *e);
  /* The arrays in state coordinates: 0 the master (NULL for f32 params), 1 + k state array k,
   * SG__STATE_ACCUM the accumulator. The device's copies accept them on either side. */
  void *(*array)(sg_engine *e, int which);
  /* Around the submit of bucket b's reduction job (sg_grads.c). */
  sg_status (*prepare)(sg_engine *e, int b);
  void (*submitted)(sg_engine *e, int b, uint64_t ticket);
  /* The step: the caller's queue ordered after every reduction submitted so far, the way the
   * state reads them (a stream wait on the device; a host wait for a host state). */
  sg_status (*wait_reductions)(sg_engine *e, int64_t deadline_ms);
  /* Host wait: every reduction landed in the accumulator, which the caller rewrites next (a
   * hybrid engine sums it across replicas, on the host; on the device nothing to wait for). */
  sg_status (*settle)(sg_engine *e);
  /* This rank's sum of squares and non-finite count of the accumulator (every reduction
   * waited for): into host memory out[2], or into device memory dev[2] (the step's norm
   * partials before they are summed over the ranks). */
  sg_status (*sumsq)(sg_engine *e, double out[2]);
  sg_status (*partials)(sg_engine *e, double *dev);
  /* The update of a->segs (device path: the device's update op on the compute queue); the new
   * working values reach e->params before any comm job submitted after it runs. */
  sg_status (*update)(sg_engine *e, const sg__update_args *a);
  /* The accumulator empty again (after a step, sg_grad_zero, a load). */
  sg_status (*clear)(sg_engine *e);
  /* The master from the working parameters of every owned segment (sg_broadcast_params). */
  sg_status (*master_from_working)(sg_engine *e);
  /* State array k (0 .. nstates-1) in fp32 state coordinates for a reader of parameter id:
   * fn(e, view, ctx) with view device memory of opt_numel floats that holds at least this
   * rank's part of id's bucket (the array itself where it is fp32; the 8-bit state of that
   * part decoded into a temporary, freed after fn), fn's status returned. */
  sg_status (*read_state)(sg_engine *e, int k, int id,
                          sg_status (*fn)(sg_engine *e, const float *view, void *ctx), void *ctx);
  /* Checkpoints of a coded state (declared `coded`): state k as opt_numel records of
   * SG__STATE_RECORD bytes in host memory, state coordinates (the format of src/ckpt/sg_ckpt.h,
   * SG_CK_Q8_RECORD). SG__REC_SAVE writes them from the state; SG__REC_CHECK checks those
   * present (class not SG__REC_PAD) against this engine's blocks (SG_ERR_MISMATCH: another
   * threshold made them fp32 or coded); SG__REC_LOAD makes the state from them;
   * SG__REC_CODE makes it from records of class SG__REC_F32 (an fp32-state checkpoint's
   * values, sg_load_options.convert_optim_state), coding them where this engine's blocks are
   * coded, with the update's rules and the random bits of step e->opt.step (the loaded one).
   * The fp32 placements keep no records: SG_ERR_INTERNAL. */
  sg_status (*records)(sg_engine *e, int k, uint8_t *rec, int mode);
} sg__state_ops;

#define SG__STATE_RECORD 6
enum { SG__REC_PAD = 0, SG__REC_CODED = 1, SG__REC_F32 = 2 };
enum { SG__REC_SAVE = 0, SG__REC_CHECK = 1, SG__REC_LOAD = 2, SG__REC_CODE = 3 };
/* One record: its class, its code, then a float in little-endian bytes (a coded block's first
 * record: the block's scale; an fp32 one: the value). sg_state_q8.c owns the format; the
 * checkpoint's conversions (src/ckpt/sg_ckpt_convert.c) write and read it through these. */
void sg__state_rec_put(uint8_t *r, int cls, uint8_t code, float value);
float sg__state_rec_value(const uint8_t *r);

extern const sg__slots_ops sg__slots_full, sg__slots_staging;
extern const sg__shard_ops sg__shard_replicated, sg__shard_sharded;
extern const sg__state_ops sg__state_device, sg__state_host, sg__state_q8, sg__state_host_q8;

typedef struct sg__strategy_ops {
  const char *name;         /* "SHARD_GRAD_OP": trace metadata, logs */
  const char *reduce_label; /* trace label of a bucket's reduction ("reduce-scatter") */

  /* Memory: the sizes it keeps, from the plan and config alone, so that sg_memory and
   * sg_estimate_memory agree. Fills every field but nstates (the optimizer's). */
  void (*shape)(const sg__plan *p, const sg_config *cfg, sg__layout_shape *out);
  /* Ownership of bucket b on `rank`: a pure function of the plan. Every flat element of a
   * bucket is owned by at least this rank or gathered from the one that owns it. */
  void (*owned)(const sg__plan *p, int rank, int b, sg__owned *out);
  /* On the comm queue: sums bucket b over the ranks from `wire` (reduce_dtype, the whole
   * bucket, may be used as scratch) and puts this rank's owned part into the accumulator with
   * sg__accum_into (first: the first reduction of the bucket since the accumulator was
   * emptied, which writes instead of adding). */
  sg_status (*reduce)(sg_engine *e, int b, char *wire, int first);

  const sg__slots_ops *slots;
  const sg__shard_ops *shard;
  const sg__state_ops *place; /* state placement */
} sg__strategy_ops;

/* The ops of cfg->strategy (validated by sg__config_check), the offloading variant where
 * cfg->offload_optimizer asks for it on the CUDA device. */
const sg__strategy_ops *sg__strategy_select(const sg_config *cfg);
/* 1 when cfg asks for offload and its strategy has an offloading variant (on the CUDA device). */
int sg__strategy_offloads(const sg_config *cfg);
/* 1 when s names a strategy of the table (a checkpoint's manifest). */
int sg__strategy_known(uint32_t s);

/* State index of flat element `flat` of bucket b, which `rank` owns. */
static inline size_t sg__strategy_state_index(const sg__strategy_ops *st, const sg__plan *p,
                                              int rank, int b, size_t flat) {
  sg__owned o;
  st->owned(p, rank, b, &o);
  return o.state0 + (flat - o.flat0);
}

/* The strategy shards optimizer state over the ranks (what a hybrid engine replicates across
 * nodes): its sharding policy says so. */
static inline int sg__strategy_sharded(const sg__strategy_ops *st) { return st->shard->sharded; }

#endif /* SG_STRATEGY_H */
