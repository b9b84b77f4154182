/* sg_grad_zero (issue 14, item 4): after an interrupted backward pass, sg_grad_zero drops every
 * gradient accumulated since the last step, and the next step applies only what comes after:
 * the state after it is bitwise equal to a run that never saw the dropped gradients.
 *
 * Each case trains one step, then does one of
 *   partial   half of a backward pass (some buckets already reducing, one slot written but
 *             not marked ready) on every rank
 *   one_rank  the same on rank 0 only; the other ranks finished their backward pass
 *   accum     a complete micro-batch, then a partial one
 *   nosync    sg_set_sync(e, 0): a complete micro-batch accumulated locally, then a partial one
 *   idle      a complete micro-batch ended with sg_backward_end
 * then sg_grad_zero on every rank and a normal step, and compares master, m, v and the working
 * parameters with a fresh engine that trained the first and the last step only. Gradient slots
 * handed out after sg_grad_zero read as zeros. Every strategy, f32 and bf16, W = 1..3 as
 * threads; with --mpi one rank per process (the thread sweep is skipped). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_ckpt_util.h"

#define SG_TRY(x)                 \
  do {                            \
    const sg_status st_ = (x);    \
    if (st_ != SG_OK) return st_; \
  } while (0)

enum { V_PARTIAL, V_ONE_RANK, V_ACCUM, V_NOSYNC, V_IDLE, V_COUNT };
static const char *const k_variant[V_COUNT] = {"partial", "one_rank", "accum", "nosync", "idle"};

typedef struct {
  model_cfg m;
  int variant;
  snap got[8], want[8];
  sg_status st[8];
  char err[8][512];
  int zero_slots[8];
} zcase;

/* Gradients of step `step` for params [first, nparams), backward order; then one more param's
 * slot written with junk and not marked ready (the exception). */
static sg_status partial_backward(sg_engine *e, const model_cfg *m, const int *ids, int step,
                                  int first) {
  for (int p = m->nparams - 1; p >= first; p--) {
    void *g = NULL;
    SG_TRY(sg_grad_ptr(e, ids[p], &g));
    for (size_t i = 0; i < m->sizes[p]; i++) sg_elem_store(g, m->dtype, i, grad_val(step, p, i));
    SG_TRY(sg_grad_ready(e, ids[p]));
  }
  if (first > 0) {
    void *g = NULL;
    SG_TRY(sg_grad_ptr(e, ids[first - 1], &g));
    for (size_t i = 0; i < m->sizes[first - 1]; i++) sg_elem_store(g, m->dtype, i, 1000.0f);
  }
  return SG_OK;
}

static sg_status full_microbatch(sg_engine *e, const model_cfg *m, const int *ids, int step) {
  SG_TRY(partial_backward(e, m, ids, step, 0));
  return SG_OK;
}

/* 1 when every slot handed out now reads as zeros (CPU device). */
static int slots_zero(sg_engine *e, const model_cfg *m, const int *ids) {
  int ok = 1;
  for (int p = m->nparams - 1; p >= 0; p--) {
    void *g = NULL;
    if (sg_grad_ptr(e, ids[p], &g) != SG_OK) return 0;
    const size_t bytes = m->sizes[p] * (m->dtype == SG_F32 ? 4 : 2);
    for (size_t i = 0; i < bytes; i++) ok &= ((const unsigned char *)g)[i] == 0;
    for (size_t i = 0; i < m->sizes[p]; i++) sg_elem_store(g, m->dtype, i, grad_val(2, p, i));
    if (sg_grad_ready(e, ids[p]) != SG_OK) return 0;
  }
  return ok;
}

static sg_status interrupted(sg_engine *e, const zcase *z, const int *ids, int rank) {
  const model_cfg *m = &z->m;
  const int half = m->nparams / 2;
  switch (z->variant) {
    case V_PARTIAL:
      return partial_backward(e, m, ids, 1, half);
    case V_ONE_RANK:
      return rank == 0 ? partial_backward(e, m, ids, 1, half) : full_microbatch(e, m, ids, 1);
    case V_ACCUM:
      SG_TRY(full_microbatch(e, m, ids, 1));
      return partial_backward(e, m, ids, 3, half);
    case V_NOSYNC:
      SG_TRY(sg_set_sync(e, 0));
      SG_TRY(full_microbatch(e, m, ids, 1));
      SG_TRY(sg_backward_end(e));
      return partial_backward(e, m, ids, 3, half);
    default:
      SG_TRY(full_microbatch(e, m, ids, 1));
      return sg_backward_end(e);
  }
}

static void case_rank(int rank, int world, sg_comm *comm, void *arg) {
  zcase *z = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  /* the run with an interruption */
  sg_status st = make_engine(comm, &z->m, &e, ids);
  if (!st) st = train(e, &z->m, ids, 0, 1);
  if (!st) st = interrupted(e, z, ids, rank);
  if (!st) st = sg_grad_zero(e);
  if (!st && z->variant == V_NOSYNC) st = sg_set_sync(e, 1);
  if (!st) z->zero_slots[rank] = slots_zero(e, &z->m, ids);
  if (!st) st = sg_step(e, NULL);
  if (!st) st = take_snap(e, &z->m, ids, &z->got[rank]);
  z->st[rank] = st;
  snprintf(z->err[rank], sizeof z->err[rank], "%s", st ? sg_last_error() : "");
  sg_engine_destroy(e);
  e = NULL;
  /* the fresh run: steps 0 and 2 only */
  st = make_engine(comm, &z->m, &e, ids);
  if (!st) st = train(e, &z->m, ids, 0, 1);
  if (!st) st = train(e, &z->m, ids, 2, 3);
  if (!st) st = take_snap(e, &z->m, ids, &z->want[rank]);
  if (st && !z->st[rank]) {
    z->st[rank] = st;
    snprintf(z->err[rank], sizeof z->err[rank], "reference: %s", sg_last_error());
  }
  sg_engine_destroy(e);
}

/* Ranks [0, n) of z hold results; world is the run's world size. */
static void check_case(zcase *z, int n, int world, const char *how) {
  static const char *const sname[3] = {"NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP"};
  char label[160];
  snprintf(label, sizeof label, "%s %s %s W=%d %s", k_variant[z->variant],
           sname[z->m.strategy], z->m.dtype == SG_F32 ? "f32" : "bf16", world, how);
  int ok = 1, zero = 1;
  for (int r = 0; r < n; r++) {
    ok &= z->st[r] == SG_OK;
    zero &= z->zero_slots[r];
  }
  CHECK(ok, "%s: runs: %s", label, z->err[0][0] ? z->err[0] : z->err[n - 1]);
  if (!ok) return;
  CHECK(zero, "%s: slots after sg_grad_zero read as zeros", label);
  int same = 1;
  for (int r = 0; r < n; r++) same &= same_snap(label, &z->m, &z->got[r], &z->want[r]);
  CHECK(same, "%s: the step after sg_grad_zero equals a fresh run, bitwise", label);
}

static void free_case(zcase *z) {
  for (int r = 0; r < 8; r++) {
    free_snap(&z->got[r]);
    free_snap(&z->want[r]);
  }
}

static model_cfg model(sg_strategy s, sg_dtype dt) {
  /* small buckets: several per step, so a partial backward has some reducing already */
  const model_cfg m = {6, {300, 65, 1000, 7, 513, 64}, s, dt, 1024, 0, NULL};
  return m;
}

int main(int argc, char **argv) {
  const int mpi = argc > 1 && strcmp(argv[1], "--mpi") == 0;
  sg_comm *mc = NULL;
  if (mpi && sg_comm_create_mpi(NULL, &mc) != SG_OK) {
    printf("sg_comm_create_mpi: %s\n", sg_last_error());
    return 1;
  }
  for (int s = 0; s < 3; s++)
    for (int d = 0; d < 2; d++)
      for (int v = 0; v < V_COUNT; v++) {
        if (mpi) {
          zcase *z = calloc(1, sizeof *z);
          z->m = model((sg_strategy)s, d ? SG_BF16 : SG_F32);
          z->variant = v;
          const int rank = sg_comm_rank(mc), world = sg_comm_size(mc);
          zcase *mine = calloc(1, sizeof *mine);
          *mine = *z;
          case_rank(rank, world, mc, mine);
          /* each process checks its own rank: copy its results to slot 0 */
          z->st[0] = mine->st[rank];
          memcpy(z->err[0], mine->err[rank], sizeof z->err[0]);
          z->zero_slots[0] = mine->zero_slots[rank];
          z->got[0] = mine->got[rank];
          z->want[0] = mine->want[rank];
          memset(&mine->got[rank], 0, sizeof(snap));
          memset(&mine->want[rank], 0, sizeof(snap));
          char how[32];
          snprintf(how, sizeof how, "(MPI rank %d)", rank);
          check_case(z, 1, world, how);
          free_case(z);
          free_case(mine);
          free(z);
          free(mine);
          continue;
        }
        for (int w = 1; w <= 3; w++) {
          zcase *z = calloc(1, sizeof *z);
          z->m = model((sg_strategy)s, d ? SG_BF16 : SG_F32);
          z->variant = v;
          run_ranks(w, case_rank, z);
          check_case(z, w, w, "(threads)");
          free_case(z);
          free(z);
        }
      }
  sg_comm_destroy(mc);
  return finish();
}
