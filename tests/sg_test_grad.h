/* sg_test_grad.h — a gradient into a parameter's slot through the engine's device, as the
 * engine tests that compare against a host reference hand their gradients over:
 *   sg_test_put_grad(e, id, dtype, buf, n)   buf holds n f32 values; f32 slots take them as
 *                                            they are, bf16 slots their bf16 (buf is overwritten
 *                                            with them: exact for the tests' multiples of 1/8);
 *                                            then sg_grad_ready.
 * Needs the engine's internals (e->dev) before it: the slot may be device memory. */
#ifndef SG_TEST_GRAD_H
#define SG_TEST_GRAD_H

#include <stdint.h>

#include "../kernels/sg_elem.h" /* sg_elem_f32_to_bf16 */
#include "shardgrad.h"

static inline sg_status sg_test_put_grad(sg_engine *e, int id, sg_dtype dtype, float *buf,
                                         size_t n) {
  void *g = NULL;
  sg_status st = sg_grad_ptr(e, id, &g);
  if (st != SG_OK) return st;
  uint16_t *h = (uint16_t *)buf; /* h[i] overwrites bytes of buf[i / 2] or before: read already */
  if (dtype != SG_F32)
    for (size_t i = 0; i < n; i++) h[i] = sg_elem_f32_to_bf16(buf[i]);
  st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, g, buf, n * (dtype == SG_F32 ? 4u : 2u),
                         SG_COPY_H2D);
  return st != SG_OK ? st : sg_grad_ready(e, id);
}

#endif /* SG_TEST_GRAD_H */
