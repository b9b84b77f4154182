/* sg_test_params.h — the parameters of the mock-runtime engine tests that need only equal-sized
 * ones:
 *   sg_test_ramp_params(e, nparam, numel, no_decay_every, ids)
 *       adds nparam parameters "p0", "p1", ... of numel elements (SG_PARAM_NO_DECAY on every
 *       parameter p with p % no_decay_every == no_decay_every - 1; 0: on none), finalizes, and
 *       sets parameter p to the ramp 0.01 * ((i * 37 + p) % 101); their ids in ids[0..nparam).
 *   sg_test_fill_grads(src, rank, steps, mbs, nparam, numel)
 *       rank's gradients for every step, micro-batch and parameter, in that order, numel each:
 *       src[((s * mbs + mb) * nparam + p) * numel + i], eighths from -1 to 1 that differ by
 *       rank, step, micro-batch, parameter and element (exact in every dtype the tests use). */
#ifndef SG_TEST_PARAMS_H
#define SG_TEST_PARAMS_H

#include <stdio.h>
#include <stdlib.h>

#include "shardgrad.h"

static inline sg_status sg_test_ramp_params(sg_engine *e, int nparam, size_t numel,
                                            int no_decay_every, int *ids) {
  sg_status st = SG_OK;
  for (int p = 0; p < nparam && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    const int no_decay = no_decay_every > 0 && p % no_decay_every == no_decay_every - 1;
    st = sg_add_param(e, name, numel, no_decay ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st) st = sg_finalize(e);
  float *init = st ? NULL : (float *)malloc(numel * sizeof *init);
  if (!st && !init) return SG_ERR_OUT_OF_MEMORY;
  for (int p = 0; p < nparam && !st; p++) {
    for (size_t i = 0; i < numel; i++) init[i] = 0.01f * (float)((i * 37 + (size_t)p) % 101);
    st = sg_set_param(e, ids[p], init, SG_F32);
  }
  free(init);
  return st;
}

static inline void sg_test_fill_grads(float *src, int rank, int steps, int mbs, int nparam,
                                      size_t numel) {
  size_t at = 0;
  for (int s = 0; s < steps; s++)
    for (int mb = 0; mb < mbs; mb++)
      for (int p = 0; p < nparam; p++)
        for (size_t i = 0; i < numel; i++, at++) {
          const size_t k =
              i * 7 + (size_t)p * 13 + (size_t)s * 5 + (size_t)mb * 11 + (size_t)rank * 3;
          src[at] = (float)((int)(k % 17) - 8) * 0.125f;
        }
}

#endif /* SG_TEST_PARAMS_H */
