/* sg_grad_scale (issue 24): scaling the step's gradient in place, as torch's clip_grads_with_norm_
 * does to every .grad, which is how ShardedAdamW's p.grad.mul_(c) reaches the library.
 *
 * For every strategy, f32 and bf16, W = 1..3 threads, with and without max_grad_norm clipping:
 * engine A gets gradients g and sg_grad_scale(0.5) (given as 4 then 0.125, so that factors
 * multiply); engine B gets 0.5 g directly. Their sg_grad_norm agree exactly (the gradients are
 * multiples of 1/8: every product is exact), and so does the whole state after the step, bit for
 * bit. A second step on both without any scale checks that the factor reset with the step. Then
 * the argument and call-order checks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_ckpt_util.h"

typedef struct {
  model_cfg m;
  double max_norm;
  snap got[4], want[4];
  float norm_got[4], norm_want[4];
  sg_status st[4];
  char err[4][512];
} scase;

static sg_status set_max_norm(sg_engine *e, double max_norm) {
  sg_hparams h;
  memset(&h, 0, sizeof h);
  h.struct_size = sizeof h;
  sg_status st = sg_get_hparams(e, 0, &h);
  h.max_grad_norm = max_norm;
  return st ? st : sg_set_hparams(e, 0, &h);
}

/* One micro-batch of step `step`'s gradients times `mul` (exact: multiples of 1/16). */
static sg_status grads(sg_engine *e, const model_cfg *m, const int *ids, int step, float mul) {
  sg_status st = SG_OK;
  for (int p = m->nparams - 1; p >= 0 && !st; p--) {
    void *g = NULL;
    if ((st = sg_grad_ptr(e, ids[p], &g))) break;
    for (size_t i = 0; i < m->sizes[p]; i++)
      sg_elem_store(g, m->dtype, i, mul * grad_val(step, p, i));
    st = sg_grad_ready(e, ids[p]);
  }
  return st;
}

/* scaled: gradients g then sg_grad_scale 4 x 0.125; else 0.5 g. The norm, a step, a plain step. */
static sg_status run(sg_comm *comm, scase *z, int scaled, float *norm, snap *out) {
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &z->m, &e, ids);
  if (!st) st = set_max_norm(e, z->max_norm);
  if (!st) st = grads(e, &z->m, ids, 1, scaled ? 1.0f : 0.5f);
  if (!st && scaled) st = sg_grad_scale(e, 4.0);
  if (!st && scaled) st = sg_grad_scale(e, 0.125);
  if (!st) st = sg_grad_norm(e, norm);
  if (!st) st = sg_step(e, NULL);
  if (!st) st = train(e, &z->m, ids, 2, 3);
  if (!st) st = take_snap(e, &z->m, ids, out);
  sg_engine_destroy(e);
  return st;
}

static void case_rank(int rank, int world, sg_comm *comm, void *arg) {
  (void)world;
  scase *z = arg;
  sg_status st = run(comm, z, 1, &z->norm_got[rank], &z->got[rank]);
  if (!st) st = run(comm, z, 0, &z->norm_want[rank], &z->want[rank]);
  z->st[rank] = st;
  snprintf(z->err[rank], sizeof z->err[rank], "%s", st ? sg_last_error() : "");
}

static void check_case(scase *z, int w) {
  static const char *const sname[3] = {"NO_SHARD", "SHARD_OPT", "SHARD_GRAD_OP"};
  char label[160];
  snprintf(label, sizeof label, "%s %s W=%d max_grad_norm=%g", sname[z->m.strategy],
           z->m.dtype == SG_F32 ? "f32" : "bf16", w, z->max_norm);
  int ok = 1;
  for (int r = 0; r < w; r++) ok &= z->st[r] == SG_OK;
  if (!CHECK(ok, "%s: runs: %s", label, z->err[0][0] ? z->err[0] : z->err[w - 1])) return;
  int norms = 1, same = 1;
  for (int r = 0; r < w; r++) {
    norms &= z->norm_got[r] == z->norm_want[r] && z->norm_got[r] > 0;
    same &= same_snap(label, &z->m, &z->got[r], &z->want[r]);
  }
  CHECK(norms, "%s: sg_grad_norm after the scale is the scaled gradient's (%.9g vs %.9g)", label,
        z->norm_got[0], z->norm_want[0]);
  CHECK(same, "%s: the steps equal those of the pre-scaled gradients, bitwise", label);
}

static void check_arguments(void) {
  CHECK(sg_grad_scale(NULL, 0.5) == SG_ERR_INVALID_ARGUMENT, "NULL engine refused");
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  int id = -1;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK && sg_engine_create(c, &cfg, &e) == SG_OK,
             "engine")) return;
  CHECK(sg_grad_scale(e, 0.5) == SG_ERR_INVALID_STATE, "before sg_finalize: refused");
  CHECK(sg_add_param(e, "w", 100, 0, &id) == SG_OK && sg_finalize(e) == SG_OK, "finalized");
  CHECK(sg_grad_scale(e, NAN) == SG_ERR_INVALID_ARGUMENT &&
            contains(sg_last_error(), "sg_grad_scale: factor must be finite"),
        "NaN factor refused: %s", sg_last_error());
  CHECK(sg_grad_scale(e, INFINITY) == SG_ERR_INVALID_ARGUMENT, "inf factor refused");
  CHECK(sg_grad_scale(e, 1e300) == SG_OK && sg_grad_scale(e, 1e300) == SG_ERR_INVALID_ARGUMENT,
        "a product out of double range refused");
  CHECK(sg_grad_scale(e, 0.0) == SG_OK && sg_grad_scale(e, -2.0) == SG_OK, "0 and -2 accepted");
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

int main(void) {
  for (int s = 0; s < 3; s++)
    for (int d = 0; d < 2; d++)
      for (int clip = 0; clip < 2; clip++)
        for (int w = 1; w <= 3; w++) {
          scase *z = calloc(1, sizeof *z);
          const model_cfg m = {5, {300, 65, 1000, 7, 513}, (sg_strategy)s,
                               d ? SG_BF16 : SG_F32, 1024, 0, NULL};
          z->m = m;
          z->max_norm = clip ? 0.5 : 0.0; /* the scaled norm is ~5: clipping is active */
          run_ranks(w, case_rank, z);
          check_case(z, w);
          for (int r = 0; r < 4; r++) {
            free_snap(&z->got[r]);
            free_snap(&z->want[r]);
          }
          free(z);
        }
  check_arguments();
  return finish();
}
