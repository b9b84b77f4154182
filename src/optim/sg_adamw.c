/* AdamW (torch.optim.AdamW's single-tensor path, DESIGN.md section 5): two state arrays, m and
 * v (the checkpoint's section names since format version 1), the step's scalars in double on
 * the host, and the fused update kernels of kernels/cpu and kernels/cuda over sg_elem_adamw. */
#include "../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_adamw */
#include "../../kernels/sg_adamw_args.h"      /* states, scalars, sg__adamw_scalars */
#include "sg_optimizer.h"

/* Betas and eps are every group's (group 0's hp); lr and weight decay each group's. */
static void adamw_scalars(sg__update_args *a, const sg_hparams *hp) {
  sg__adamw_scalars(a, hp[0].lr, hp[0].beta1, hp[0].beta2, hp[0].eps, hp[0].weight_decay,
                    a->step);
  for (int g = 1; g < a->ngroups; g++)
    sg__adamw_group_scalars(a, g, hp[g].lr, hp[0].beta1, hp[g].weight_decay);
}

/* m and v in 8-bit blocks (kernels/cpu/sg_cpu_q8.c, the CUDA kernel beside AdamW's). */
static const sg__optim_desc adamw_q8 = {
    .name = "adamw (8-bit state)",
    .nstates = SG__ADAMW_NSTATES,
    .state_name = {[SG__ADAMW_M] = "m", [SG__ADAMW_V] = "v"},
    .scalars = adamw_scalars,
    .cpu_update = sg__cpu_adamw_q8,
#ifdef SG_HAVE_CUDA
    .cuda_update = sg__cuda_adamw_q8,
#endif
};

const sg__optim_desc sg__optim_adamw = {
    .name = "adamw",
    .nstates = SG__ADAMW_NSTATES,
    .state_name = {[SG__ADAMW_M] = "m", [SG__ADAMW_V] = "v"},
    .scalars = adamw_scalars,
    .cpu_update = sg__cpu_adamw,
#ifdef SG_HAVE_CUDA
    .cuda_update = sg__cuda_adamw,
#endif
    .q8 = &adamw_q8,
};
