/* Optimizers (DESIGN.md sections 1 and 5): one descriptor per optimizer, one file each in
 * src/optim/, registered in the table of sg_optimizer.c. The engine, the devices, the
 * checkpoints and the offload pipeline know an optimizer only through its descriptor: how many
 * fp32 state arrays it keeps and their names, how the host turns the hyperparameters into the
 * step's scalars, and its update kernels (a CPU loop and a CUDA launcher over the element math
 * of kernels/sg_elem.h), which every device runs through its one `update` op. */
#ifndef SG_OPTIMIZER_H
#define SG_OPTIMIZER_H

#include "../../include/shardgrad.h"            /* sg_hparams */
#include "../../kernels/cuda/sg_cuda_kernels.h" /* sg__cuda_update_fn (plain C) */
#include "../../kernels/sg_kernel_args.h"       /* sg__update_args, SG__OPTIM_MAX_* */

typedef struct sg__optim_desc {
  const char *name; /* logs and messages */
  /* fp32 state arrays of the shard's size, zero at the start; their names are the checkpoint's
   * section names (in this order) and sg_get_optim_state's `which` indexes them */
  int nstates;
  const char *state_name[SG__OPTIM_MAX_STATES];
  /* a->scalar and a->group_scalar[0 .. max(ngroups, 1)) for step a->step (set), from the
   * hyperparameters of those groups (hp[g]), computed in double on the host */
  void (*scalars)(sg__update_args *a, const sg_hparams *hp);
  /* the update of a->segs: a CPU loop (kernels/cpu), and the CUDA launcher (kernels/cuda;
   * NULL in a build without CUDA) */
  void (*cpu_update)(const sg__update_args *a);
  sg__cuda_update_fn cuda_update;
  /* Its variant over 8-bit blockwise state (cfg.optim_state_dtype SG_Q8): the same states,
   * names and scalars, kernels that read a->q8_* (kernels/sg_kernel_args.h); NULL where the
   * optimizer has none (an engine asking for it is refused at sg_engine_create). */
  const struct sg__optim_desc *q8;
} sg__optim_desc;

/* The optimizer an engine runs: the table's first (the only one for now). */
const sg__optim_desc *sg__optim_default(void);
/* The registered optimizer called `name`, or NULL. */
const sg__optim_desc *sg__optim_find(const char *name);
/* Index of the state array called `name` in od, or -1. */
int sg__optim_state_index(const sg__optim_desc *od, const char *name);

#endif /* SG_OPTIMIZER_H */
