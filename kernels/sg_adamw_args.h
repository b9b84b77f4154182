/* AdamW's use of sg__update_args (kernels/sg_kernel_args.h): which state array and scalar is
 * which, how the host computes the scalars, and the per-element constants the CPU loop and the
 * CUDA kernel build from them. Plain C, no CUDA types. Its descriptor is src/optim/sg_adamw.c. */
#ifndef SG_ADAMW_ARGS_H
#define SG_ADAMW_ARGS_H

#include <math.h> /* pow, sqrt: host-side step scalars */

#include "sg_elem.h"        /* sg_elem_adamw_k, sg_elem_adamw_consts */
#include "sg_kernel_args.h" /* sg__update_args */

/* The kernels' argument struct under AdamW's name (tests and benchmarks of AdamW use it). */
typedef sg__update_args sg__adamw_args;

/* State arrays: the checkpoint's section names and sg_get_optim_state's `which`. */
enum { SG__ADAMW_M = 0, SG__ADAMW_V = 1, SG__ADAMW_NSTATES = 2 };
/* Step-wide scalars. */
enum {
  SG__ADAMW_BETA1 = 0,
  SG__ADAMW_ONE_MINUS_BETA1 = 1, /* (float)(1 - (double)beta1) */
  SG__ADAMW_BETA2 = 2,
  SG__ADAMW_ONE_MINUS_BETA2 = 3,
  SG__ADAMW_BC2_SQRT = 4,        /* (float)sqrt(1 - beta2^t) in double */
  SG__ADAMW_EPS = 5,
  SG__ADAMW_NSCALARS = 6
};
/* Per-group scalars. */
enum {
  SG__ADAMW_DECAY_FACTOR = 0, /* (float)(1 - (double)lr * wd) */
  SG__ADAMW_STEP_SIZE = 1,    /* (float)(lr / bc1), bc1 = 1 - beta1^t in double */
  SG__ADAMW_NGROUP_SCALARS = 2
};

/* The per-step scalars from the hyperparameters, computed in double on the host and rounded to
 * float once, where torch.optim.AdamW's single-tensor path rounds its Python (double) scalars:
 * 1 - lr*wd, 1 - beta1, 1 - beta2, lr / (1 - beta1^t), sqrt(1 - beta2^t) (DESIGN.md section 5).
 * Float hyperparameters (sg_config) arrive as the doubles of their float values. lr and wd are
 * group 0's. The engine and the benchmarks share this rule. */
static inline void sg__adamw_scalars(sg__update_args *a, double lr, double beta1, double beta2,
                                     double eps, double wd, uint64_t t) {
  const double bc1 = 1.0 - pow(beta1, (double)t);
  const double bc2 = 1.0 - pow(beta2, (double)t);
  a->group_scalar[0][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - lr * wd);
  a->scalar[SG__ADAMW_BETA1] = (float)beta1;
  a->scalar[SG__ADAMW_ONE_MINUS_BETA1] = (float)(1.0 - beta1);
  a->scalar[SG__ADAMW_BETA2] = (float)beta2;
  a->scalar[SG__ADAMW_ONE_MINUS_BETA2] = (float)(1.0 - beta2);
  a->group_scalar[0][SG__ADAMW_STEP_SIZE] = (float)(lr / bc1);
  a->scalar[SG__ADAMW_BC2_SQRT] = (float)sqrt(bc2);
  a->scalar[SG__ADAMW_EPS] = (float)eps;
  a->step = t;
}

/* The lr and weight decay dependent scalars of group g, by the rule of sg__adamw_scalars;
 * a->step must already be set. */
static inline void sg__adamw_group_scalars(sg__update_args *a, int g, double lr, double beta1,
                                           double wd) {
  if (g < 0 || g >= SG_MAX_GROUPS) return;
  const double bc1 = 1.0 - pow(beta1, (double)a->step);
  a->group_scalar[g][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - lr * wd);
  a->group_scalar[g][SG__ADAMW_STEP_SIZE] = (float)(lr / bc1);
}

/* The element constants of group g; decay 0: decay factor 1.0f (p * 1.0f == p for every p,
 * as torch skips the mul_ for no-decay parameters). */
static inline sg_elem_adamw_k sg__adamw_consts(const sg__update_args *a, int g, int decay) {
  const float *s = a->scalar, *gs = a->group_scalar[g];
  return sg_elem_adamw_consts(decay ? gs[SG__ADAMW_DECAY_FACTOR] : 1.0f,
                              s[SG__ADAMW_ONE_MINUS_BETA1], s[SG__ADAMW_BETA2],
                              s[SG__ADAMW_ONE_MINUS_BETA2], gs[SG__ADAMW_STEP_SIZE],
                              s[SG__ADAMW_BC2_SQRT], s[SG__ADAMW_EPS]);
}

#endif /* SG_ADAMW_ARGS_H */
