/* sg_test_state.h — what the engine tests share to run an engine and compare it with another:
 * the hash that makes their gradients, and an engine's whole state per parameter read back in
 * f32 (working parameter, master weights, m, v) for bitwise comparisons.
 *
 * A test keeps the four arrays of pointers (one buffer per parameter) in its own result struct
 * and passes them in the order param, master, m, v; SG_TEST_STATE_OF(r) does so for a struct
 * whose arrays are named so:
 *   sg_test_read_state(e, ids, sizes, np, SG_TEST_STATE_OF(r));  ...
 *   sg_test_free_state(np, SG_TEST_STATE_OF(r)); */
#ifndef SG_TEST_STATE_H
#define SG_TEST_STATE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shardgrad.h" /* sg_get_param, sg_get_master, sg_get_optim_state */

#define SG_TEST_STATE_OF(r) ((float **[4]){(r)->param, (r)->master, (r)->m, (r)->v})

/* A 64-bit finalizer (MurmurHash3's fmix64): well-spread values from small structured keys such
 * as (rank, step, micro-batch, param, element). */
static inline uint64_t sg_test_mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* Index of the first element whose bits differ; n when none does. */
static inline size_t sg_test_first_diff(const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], 4) != 0) return i;
  return n;
}

/* Collective (sg_get_master, sg_get_optim_state gather from the owners): every rank of the
 * engine calls it. Fills st[0..3][p] with fresh buffers of sizes[p] floats for p < np; on an
 * error the buffers allocated so far stay in st for sg_test_free_state. */
static inline sg_status sg_test_read_state(sg_engine *e, const int *ids, const size_t *sizes,
                                           int np, float **st[4]) {
  sg_status s = SG_OK;
  for (int p = 0; p < np && !s; p++) {
    for (int k = 0; k < 4; k++) st[k][p] = malloc(sizes[p] * sizeof(float));
    s = sg_get_param(e, ids[p], st[0][p], SG_F32);
    if (!s) s = sg_get_master(e, ids[p], st[1][p]);
    if (!s) s = sg_get_optim_state(e, ids[p], 0, st[2][p]);
    if (!s) s = sg_get_optim_state(e, ids[p], 1, st[3][p]);
  }
  return s;
}

/* Frees what sg_test_read_state allocated and clears the pointers. */
static inline void sg_test_free_state(int np, float **st[4]) {
  for (int k = 0; k < 4; k++)
    for (int p = 0; p < np; p++) {
      free(st[k][p]);
      st[k][p] = NULL;
    }
}

#endif /* SG_TEST_STATE_H */
