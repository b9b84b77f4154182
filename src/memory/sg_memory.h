/* The allocator (DESIGN.md section 3): one arena per memory kind, carved into aligned pieces,
 * with exact accounting. The layout is a pure function of (plan, config) so that sg_memory and
 * sg_estimate_memory report the same numbers. */
#ifndef SG_MEMORY_H
#define SG_MEMORY_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h"     /* sg_status */
#include "../device/sg_device.h" /* sg__device; SG__OPTIM_MAX_STATES (kernels/sg_kernel_args.h) */
#include "../plan/sg_plan.h"     /* sg__plan */

typedef enum {
  SG_MEM_PARAMS = 0,
  SG_MEM_GRADS = 1,
  SG_MEM_MASTER = 2,
  SG_MEM_OPTIM = 3,
  SG_MEM_COMM = 4,
  SG_MEM_KINDS = 5
} sg__mem_kind;

#define SG_MEM_ALIGN 256 /* bytes: every piece starts here (128-bit loads, cache lines) */

/* The most one arena may hold (2^61 bytes): the five arenas and their sum then fit a size_t.
 * Byte counts above it saturate to SIZE_MAX instead of wrapping, and the layout is refused. */
#define SG_MEM_ARENA_MAX (SIZE_MAX / 8)
/* a * b, or SIZE_MAX when above SG_MEM_ARENA_MAX (sizes of a strategy's shape too). */
static inline size_t sg__mem_mul_sat(size_t a, size_t b) {
  return (b != 0 && a > SG_MEM_ARENA_MAX / b) ? SIZE_MAX : a * b;
}

/* What the strategy keeps, in elements (its `shape` op, src/engine/sg_strategy.h), and how many
 * fp32 state arrays the optimizer keeps: the layout carves exactly these. */
typedef struct sg__layout_shape {
  size_t opt_numel;     /* elements of each optimizer state array, the master and the
                           accumulator: full (replicated state) or this rank's shard */
  size_t slots_bytes;   /* GRADS: gradient slots (a full buffer, or the staging buffers) */
  int nstaging;         /* staging buffers of staging_numel elements (0: slots are a full buffer) */
  size_t staging_numel;
  size_t max_wire;      /* largest per-rank piece of a bucket in a collective: comm scratch */
  int nstates;          /* fp32 optimizer state arrays (the optimizer's descriptor) */
  int host_state;       /* 1: the master, the state arrays and the accumulator are pinned host
                           memory (optimizer offload), not carved from the device arenas */
  size_t host_extra;    /* host_state: pinned bytes beyond those arrays (pipeline buffers) */
  size_t replica_bytes; /* a hybrid engine's wire buffer across replicas (0: none): COMM, or
                           pinned host memory (in host_bytes) when host_state */
  size_t q8_blocks;     /* 8-bit state (sg_state_q8.c): blocks of SG__Q8_BLOCK state elements
                           (0: the state arrays are fp32, opt_numel each). Each state array is
                           then one byte per element and an fp32 scale per block, plus fp32
                           blocks for the small tensors, and one block map */
  size_t q8_f32_blocks; /* blocks of fp32 state per array (the most any rank holds, >= 1) */
} sg__layout_shape;

/* Offsets (bytes) of each buffer inside its kind's arena; SIZE_MAX when absent. */
typedef struct sg__layout {
  size_t bytes[SG_MEM_KINDS];
  size_t params_off;            /* PARAMS: full working params, param dtype */
  size_t slots_off, slots_bytes;/* GRADS: gradient slots (full buffer, or staging buffers) */
  int nstaging;                 /* staging buffers of staging_numel each (0: full buffer) */
  size_t staging_numel;
  size_t accum_off;             /* GRADS: accumulator (accum dtype), accum_numel elements */
  size_t accum_numel;
  size_t master_off;            /* MASTER: fp32 master (absent for f32 params) */
  int nstates;                  /* OPTIM: the optimizer's fp32 state arrays, opt_numel each */
  size_t state_off[SG__OPTIM_MAX_STATES];
  size_t opt_numel;             /* elements of master/state arrays (full or this rank's shard) */
  size_t comm_off;              /* COMM: collective scratch, comm_scratch_bytes long */
  size_t comm_scratch_bytes;
  size_t small_off;             /* COMM: the step's tiny all-reduce (norm, non-finite count) */
  size_t reduce_off;            /* COMM: bucket in reduce_dtype, max bucket numel elements;
                                   only when reduce_dtype != grad_dtype (SIZE_MAX otherwise) */
  int host_state;               /* accum, master and states live in pinned host memory: their
                                   offsets are SIZE_MAX and host_bytes counts them */
  size_t host_bytes;            /* pinned host bytes: (A + 4 unless f32 + 4 x nstates) x
                                   opt_numel + host_extra; with 8-bit state (q8_blocks) the
                                   states' codes, scales, fp32 blocks and the map instead of
                                   4 x nstates x opt_numel (their offsets SIZE_MAX) */
  size_t replica_off;           /* COMM: replica wire buffer, replica_bytes (SIZE_MAX: none or
                                   on the host) */
  size_t replica_bytes;
  size_t replica_host_bytes;    /* host_state: the replica wire buffer is pinned host memory of
                                   replica_bytes, counted in host_bytes (0: none or in COMM) */
  /* OPTIM, 8-bit state (q8_blocks > 0): state_off[k] is then the fp32 blocks of state k
   * (q8_f32_blocks x SG__Q8_BLOCK floats), q8_code_off[k] its codes (opt_numel bytes),
   * q8_scale_off[k] its scales (q8_blocks floats); q8_map_off the block map (q8_blocks u32). */
  size_t q8_blocks, q8_f32_blocks;
  size_t q8_code_off[SG__OPTIM_MAX_STATES], q8_scale_off[SG__OPTIM_MAX_STATES], q8_map_off;
} sg__layout;

/* The layout of a plan for a strategy's and optimizer's shape. SG_ERR_INVALID_ARGUMENT for more
 * state arrays than SG__OPTIM_MAX_STATES. */
sg_status sg__layout_compute(const sg__plan *p, const sg_config *cfg, const sg__layout_shape *shape,
                             sg__layout *out);

typedef struct sg__arenas {
  sg__device *dev;
  void *base[SG_MEM_KINDS];
  size_t bytes[SG_MEM_KINDS];
  size_t extra_grads;  /* lazily allocated no_sync buffer, counted as grads */
  size_t peak;
} sg__arenas;

/* All arenas at once, or nothing (SG_ERR_OUT_OF_MEMORY names the kind and size). */
sg_status sg__arenas_alloc(sg__arenas *a, sg__device *dev, const sg__layout *l);
void sg__arenas_free(sg__arenas *a);
size_t sg__arenas_total(const sg__arenas *a);
void sg__arenas_note(sg__arenas *a); /* update peak */
/* Memory allocated outside the arenas but counted as gradients (no_sync buffer, extra staging):
 * +bytes when allocated, -bytes when freed; the peak follows. */
void sg__arenas_extra_grads(sg__arenas *a, long long bytes);
/* Such a buffer: zeroed device memory of `bytes` on the arenas' device, counted; and its free
 * (p NULL: nothing). */
sg_status sg__arenas_extra_alloc(sg__arenas *a, size_t bytes, void **out);
void sg__arenas_extra_free(sg__arenas *a, void *p, size_t bytes);
/* Fills the public stats from a layout (and extra bytes). */
void sg__memory_stats_fill(const sg__plan *p, const sg__layout *l, size_t extra_grads,
                           size_t peak, sg_memory_stats *full);

#endif /* SG_MEMORY_H */
