/* The allocator (DESIGN.md section 3): one arena per memory kind, carved into aligned pieces,
 * with exact accounting. The layout is a pure function of (plan, config) so that sg_memory and
 * sg_estimate_memory report the same numbers. */
#ifndef SG_MEMORY_H
#define SG_MEMORY_H

#include <stddef.h>

#include "../core/sg_core.h"     /* sg_status */
#include "../device/sg_device.h" /* sg__device */
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

/* Offsets (bytes) of each buffer inside its kind's arena; SIZE_MAX when absent. */
typedef struct sg__layout {
  size_t bytes[SG_MEM_KINDS];
  size_t params_off;            /* PARAMS: full working params, param dtype */
  size_t slots_off, slots_bytes;/* GRADS: full grad slots (NO_SHARD, SHARD_OPT) or staging */
  int nstaging;                 /* SHARD_GRAD_OP: staging buffers of staging_numel each */
  size_t staging_numel;
  size_t accum_off;             /* GRADS: accumulator (full for NO_SHARD, shard otherwise) */
  size_t accum_numel;
  size_t master_off;            /* MASTER: fp32 master (absent for f32 params) */
  size_t m_off, v_off;          /* OPTIM */
  size_t opt_numel;             /* elements of master/m/v (full for NO_SHARD, shard otherwise) */
  size_t comm_off;              /* COMM: collective scratch, comm_scratch_bytes long */
  size_t comm_scratch_bytes;
  size_t small_off;             /* COMM: the step's tiny all-reduce (norm, non-finite count) */
  size_t reduce_off;            /* COMM: bucket in reduce_dtype, max bucket numel elements;
                                   only when reduce_dtype != grad_dtype (SIZE_MAX otherwise) */
} sg__layout;

sg_status sg__layout_compute(const sg__plan *p, const sg_config *cfg, sg__layout *out);

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
/* Fills the public stats from a layout (and extra bytes). */
void sg__memory_stats_fill(const sg__plan *p, const sg__layout *l, size_t extra_grads,
                           size_t peak, sg_memory_stats *full);

#endif /* SG_MEMORY_H */
