/* Argument structs of the kernels, shared by kernels/cpu, kernels/cuda and src/device.
 * Plain C: no CUDA types, so the CPU build and the engine can use them. */
#ifndef SG_KERNEL_ARGS_H
#define SG_KERNEL_ARGS_H

#include <math.h>   /* pow, sqrt: host-side step scalars */
#include <stddef.h>
#include <stdint.h>

#include "../include/shardgrad.h" /* SG_MAX_GROUPS */

/* A contiguous run of a rank's shard that belongs to one parameter (or to several adjacent
 * parameters with the same decay flag and group). Padding is in no segment and is never
 * touched. */
typedef struct sg__seg {
  size_t shard_off; /* index into master / m / v / grad */
  size_t flat_off;  /* index into the full working-parameter buffer (and stochastic rounding) */
  size_t len;
  int decay;        /* 1: apply decay_factor; 0: SG_PARAM_NO_DECAY */
  uint64_t sr_index;/* stochastic rounding counter of the first element: (param id << 40) +
                       offset inside the parameter, so the random bits do not depend on W or on
                       the padding of the layout (flat_off does) */
  int group;        /* parameter group 0..SG_MAX_GROUPS-1: picks decay_factor and step_size
                       (appended last, so that initializers of the fields above stay valid) */
} sg__seg;

/* One fused AdamW update over a rank's shard (DESIGN.md section 5). All math in fp32.
 * For each segment s and i in [0, s.len):
 *   g = grad[s.shard_off+i] * grad_scale
 *   p = master ? master[s.shard_off+i] : param_f32[s.flat_off+i]
 *   if s.decay: p = p * decay_factor                  (decay_factor = (float)(1 - lr*wd))
 *   m = m + (1-beta1) * (g - m)                        (torch lerp, weight < 0.5)
 *   v = v * beta2 + (1-beta2) * g * g
 *   p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps) (step_size = (float)(lr/bc1))
 *   master[...] = p (when master); param[s.flat_off+i] = round(p) to param_dtype
 * The exact operation order is in kernels/sg_elem.h (sg_elem_adamw), shared by CPU and CUDA. */
typedef struct sg__adamw_args {
  void *param;              /* full working-param buffer (param_dtype), indexed by flat_off */
  int param_dtype;          /* sg_dtype */
  float *master;            /* NULL for f32 params: the working param is the master */
  float *m;
  float *v;
  const void *grad;         /* shard accumulator, indexed by shard_off */
  int grad_dtype;           /* SG_F32 or SG_BF16 */
  const sg__seg *segs;      /* host memory */
  int nsegs;
  float grad_scale;         /* (1/W if averaging) * (1/loss_scale) * clip_coef */
  float decay_factor;       /* (float)(1 - (double)lr * wd) */
  float beta1, one_minus_beta1; /* one_minus_beta1 = (float)(1 - (double)beta1) */
  float beta2, one_minus_beta2;
  float step_size;          /* (float)(lr / bc1), bc1 = 1 - beta1^t in double */
  float bc2_sqrt;           /* (float)sqrt(1 - beta2^t) in double */
  float eps;
  int stochastic_rounding;  /* bf16 params only */
  uint64_t seed;            /* stochastic rounding: hash of (seed, step, sr_index + i) */
  uint64_t step;
  /* Parameter groups 1..ngroups-1 (ngroups 0 or 1: every segment is in group 0). Group 0 uses
   * decay_factor and step_size above; group g >= 1 uses group_decay_factor[g] and
   * group_step_size[g] (index 0 is not read). Same rules: (float)(1 - (double)lr_g * wd_g)
   * and (float)(lr_g / bc1). A segment whose group is >= max(ngroups, 1) is invalid. */
  int ngroups;
  float group_decay_factor[SG_MAX_GROUPS];
  float group_step_size[SG_MAX_GROUPS];
} sg__adamw_args;

/* The per-step scalars of sg__adamw_args from the hyperparameters, computed in double on the
 * host and rounded to float once, where torch.optim.AdamW's single-tensor path rounds its Python
 * (double) scalars: 1 - lr*wd, 1 - beta1, 1 - beta2, lr / (1 - beta1^t), sqrt(1 - beta2^t)
 * (DESIGN.md section 5). Float hyperparameters (sg_config) arrive as the doubles of their float
 * values. The engine and the benchmarks share this rule. */
static inline void sg__adamw_scalars(sg__adamw_args *a, double lr, double beta1, double beta2,
                                     double eps, double wd, uint64_t t) {
  const double bc1 = 1.0 - pow(beta1, (double)t);
  const double bc2 = 1.0 - pow(beta2, (double)t);
  a->decay_factor = (float)(1.0 - lr * wd);
  a->beta1 = (float)beta1;
  a->one_minus_beta1 = (float)(1.0 - beta1);
  a->beta2 = (float)beta2;
  a->one_minus_beta2 = (float)(1.0 - beta2);
  a->step_size = (float)(lr / bc1);
  a->bc2_sqrt = (float)sqrt(bc2);
  a->eps = (float)eps;
  a->step = t;
}

/* The lr and weight decay dependent scalars of group g (0: decay_factor and step_size), by
 * the rule of sg__adamw_scalars; a->step must already be set. */
static inline void sg__adamw_group_scalars(sg__adamw_args *a, int g, double lr, double beta1,
                                           double wd) {
  const double bc1 = 1.0 - pow(beta1, (double)a->step);
  const float df = (float)(1.0 - lr * wd);
  const float ss = (float)(lr / bc1);
  if (g == 0) {
    a->decay_factor = df;
    a->step_size = ss;
  } else if (g > 0 && g < SG_MAX_GROUPS) {
    a->group_decay_factor[g] = df;
    a->group_step_size[g] = ss;
  }
}

/* 1 when ngroups is 0..SG_MAX_GROUPS and (ngroups > 1) every segment's group is below it. */
static inline int sg__adamw_groups_ok(const sg__adamw_args *a) {
  if (a->ngroups < 0 || a->ngroups > SG_MAX_GROUPS) return 0;
  if (a->ngroups <= 1) return 1;
  for (int s = 0; s < a->nsegs; s++)
    if (a->segs[s].group < 0 || a->segs[s].group >= a->ngroups) return 0;
  return 1;
}

/* Group g's decay factor and step size (what the kernels read). */
static inline float sg__adamw_group_decay(const sg__adamw_args *a, int g) {
  return g == 0 ? a->decay_factor : a->group_decay_factor[g];
}
static inline float sg__adamw_group_step(const sg__adamw_args *a, int g) {
  return g == 0 ? a->step_size : a->group_step_size[g];
}

#endif /* SG_KERNEL_ARGS_H */
