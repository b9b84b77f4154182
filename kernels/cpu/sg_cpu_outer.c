/* CPU loops of the outer steps (DiLoCo) over kernels/sg_elem.h's sg_elem_outer_*; the CUDA
 * kernels (kernels/cuda/sg_cuda_kernels.cu) loop over the same calls. */
#include "../sg_elem.h"     /* sg_elem_outer_delta, sg_elem_outer_mean, sg_elem_outer_nesterov */
#include "sg_cpu_kernels.h" /* declarations */

void sg__cpu_outer_delta(float *d, const float *po, const float *theta, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = sg_elem_outer_delta(po[i], theta[i]);
}

void sg__cpu_outer_step(float *po, float *m, float *theta, const float *dsum, size_t n, int nrep,
                        float lr, float mu) {
  const float fn = (float)nrep;
  for (size_t i = 0; i < n; i++) {
    po[i] = sg_elem_outer_nesterov(po[i], sg_elem_outer_mean(dsum[i], fn), &m[i], lr, mu);
    theta[i] = po[i];
  }
}
