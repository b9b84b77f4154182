/* Argument structs of the kernels, shared by kernels/cpu, kernels/cuda and src/device.
 * Plain C: no CUDA types, so the CPU build and the engine can use them. */
#ifndef SG_KERNEL_ARGS_H
#define SG_KERNEL_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include "../include/shardgrad.h" /* SG_MAX_GROUPS */
#include "sg_elem.h"                /* sg_elem_step_out: the step's outcome an update may read */

/* A contiguous run of a rank's shard that belongs to one parameter (or to several adjacent
 * parameters with the same decay flag and group). Padding is in no segment and is never
 * touched. */
typedef struct sg__seg {
  size_t shard_off; /* index into master / the state arrays / grad */
  size_t flat_off;  /* index into the full working-parameter buffer (and stochastic rounding) */
  size_t len;
  int decay;        /* 1: weight decay applies; 0: SG_PARAM_NO_DECAY */
  uint64_t sr_index;/* stochastic rounding counter of the first element: (param id << 40) +
                       offset inside the parameter, so the random bits do not depend on W or on
                       the padding of the layout (flat_off does) */
  int group;        /* parameter group 0..SG_MAX_GROUPS-1: picks the group's scalars (lr,
                       weight decay; appended last, so that initializers of the fields above stay valid) */
} sg__seg;

/* Most fp32 state arrays, step-wide scalars and per-group scalars of one optimizer (its
 * descriptor, src/optim/sg_optimizer.h, says how many it uses). */
#define SG__OPTIM_MAX_STATES 4
#define SG__OPTIM_MAX_SCALARS 8
#define SG__OPTIM_MAX_GROUP_SCALARS 2

/* One fused optimizer update over a rank's shard (DESIGN.md section 5). All math in fp32.
 * For each segment s and i in [0, s.len):
 *   g = grad[s.shard_off+i] * grad_scale
 *   p = master ? master[s.shard_off+i] : param_f32[s.flat_off+i]
 *   p = the optimizer's element function of (p, g, state[k][s.shard_off+i] for every k, the
 *       scalars, group s.group's scalars, s.decay), state updated in place
 *   master[...] = p (when master); param[s.flat_off+i] = round(p) to param_dtype
 * What the state arrays and scalars mean is the optimizer's (src/optim: AdamW's in
 * kernels/sg_adamw_args.h); the element math is in kernels/sg_elem.h, shared by CPU and CUDA. */
typedef struct sg__update_args {
  void *param;              /* full working-param buffer (param_dtype), indexed by flat_off */
  int param_dtype;          /* sg_dtype */
  float *master;            /* NULL for f32 params: the working param is the master */
  float *state[SG__OPTIM_MAX_STATES]; /* the optimizer's fp32 state arrays, by index */
  const void *grad;         /* shard accumulator, indexed by shard_off */
  int grad_dtype;           /* SG_F32 or SG_BF16 */
  const sg__seg *segs;      /* host memory */
  int nsegs;
  float grad_scale;         /* (1/W if averaging) * (1/loss_scale) * clip_coef */
  /* NULL, or the step's outcome in the update's memory (kernels/sg_elem.h; the CUDA device's
   * step kernel writes it on the same queue): its factor replaces grad_scale, and with its skip
   * set the update writes nothing. */
  const sg_elem_step_out *outcome;
  float scalar[SG__OPTIM_MAX_SCALARS]; /* step-wide, computed on the host in double */
  int stochastic_rounding;  /* bf16 params only */
  uint64_t seed;            /* stochastic rounding: hash of (seed, step, sr_index + i) */
  uint64_t step;
  /* Parameter groups (ngroups 0 or 1: every segment is in group 0, whatever its group field).
   * group_scalar[g] holds group g's lr and weight decay dependent scalars, group 0 included.
   * A segment whose group is >= max(ngroups, 1) is invalid. */
  int ngroups;
  float group_scalar[SG_MAX_GROUPS][SG__OPTIM_MAX_GROUP_SCALARS];
  /* 8-bit state (cfg.optim_state_dtype SG_Q8, src/engine/policy/sg_state_q8.c; the optimizer's
   * q8 update reads these instead of fp32 arrays at shard_off). The state is in blocks of
   * SG__Q8_BLOCK state indices from 0; every segment lies inside one block and starts at its
   * start (the planner aligns tensors and slices to blocks). Block j of state k is either
   * q8_code[k][j * SG__Q8_BLOCK ..] (one byte per element) with scale q8_scale[k][j], or, where
   * q8_f32[j] is not SG__Q8_CODED, fp32 values at state[k][q8_f32[j] * SG__Q8_BLOCK ..]
   * (tensors below cfg.optim_state_min_numel). */
  uint8_t *q8_code[SG__OPTIM_MAX_STATES];
  float *q8_scale[SG__OPTIM_MAX_STATES];
  const uint32_t *q8_f32;
} sg__update_args;

#define SG__Q8_BLOCK 256         /* = SG_ELEM_Q8_BLOCK of kernels/sg_elem.h (checked there) */
#define SG__Q8_CODED 0xffffffffu      /* q8_f32[j]: block j is coded in 8 bits */

/* 1 when ngroups is 0..SG_MAX_GROUPS and (ngroups > 1) every segment's group is below it. */
static inline int sg__update_groups_ok(const sg__update_args *a) {
  if (a->ngroups < 0 || a->ngroups > SG_MAX_GROUPS) return 0;
  if (a->ngroups <= 1) return 1;
  for (int s = 0; s < a->nsegs; s++)
    if (a->segs[s].group < 0 || a->segs[s].group >= a->ngroups) return 0;
  return 1;
}

/* The group whose scalars segment s uses. */
static inline int sg__update_group_of(const sg__update_args *a, const sg__seg *s) {
  return a->ngroups > 1 ? s->group : 0;
}

/* The partition of the one reduction (sum of squares and non-finite count): fixed chunks of this
 * many elements, one partial per chunk, combined in chunk order. The CUDA kernel, the CPU copy of
 * its order and the offloaded accumulator's per-chunk partials all use it, so that the norm has
 * the same bits wherever it is computed. */
#define SG__SUMSQ_CHUNK 8192

#endif /* SG_KERNEL_ARGS_H */
