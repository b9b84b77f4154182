/* sg_memory (what an engine allocated) against sg_estimate_memory (the same layout computed
 * without allocating) and against the formulas of DESIGN.md section 3, for every strategy,
 * param dtype, accumulator dtype and W in 1..4 (ranks as threads), and for gradient dtypes
 * with another reduce_dtype (the reduce buffer in the comm bytes). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"

static const size_t k_numels[] = {7, 4096, 100003, 65, 1, 300000, 2048};
#define NP ((int)(sizeof k_numels / sizeof k_numels[0]))
#define ALIGN 256 /* bytes: every buffer in an arena starts here */

typedef struct {
  sg_config cfg;
  sg_comm *comm;
  sg_memory_stats mem;
  sg_status st;
} rank_arg;

static void *rank_main(void *p) {
  rank_arg *a = p;
  sg_engine *e = NULL;
  a->st = sg_engine_create(a->comm, &a->cfg, &e);
  for (int i = 0; i < NP && a->st == SG_OK; i++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", i);
    int id;
    a->st = sg_add_param(e, name, k_numels[i], 0, &id);
  }
  if (a->st == SG_OK) a->st = sg_finalize(e);
  a->mem.struct_size = sizeof a->mem;
  if (a->st == SG_OK) a->st = sg_memory(e, &a->mem);
  sg_engine_destroy(e);
  return NULL;
}

static size_t up(size_t x) { return (x + ALIGN - 1) / ALIGN * ALIGN; }

static size_t dsize(sg_dtype d) { return d == SG_F32 ? 4 : 2; }

/* DESIGN.md section 3 per kind, on the plan's padded sizes; each buffer rounded up to ALIGN. */
static void check_formula(const sg_config *c, int w, const sg_memory_stats *m) {
  const sg_dtype gdt = c->grad_dtype == SG_DTYPE_AUTO ? c->param_dtype : c->grad_dtype;
  const sg_dtype rdt = c->reduce_dtype == SG_DTYPE_AUTO ? gdt : c->reduce_dtype;
  const size_t P = dsize(c->param_dtype), G = dsize(gdt), R = dsize(rdt);
  const size_t A = c->accum_dtype == SG_F32 ? 4 : 2;
  const size_t psi = m->numel, shard = m->shard_numel;
  /* the largest bucket: the 300000-element param alone, padded to 64 W (bucket_bytes is
   * smaller than it in every grad dtype) */
  const size_t big = (300000 + 64 * (size_t)w - 1) / (64 * (size_t)w) * (64 * (size_t)w);
  CHECK(m->params_bytes == up(P * psi), "W=%d params %zu, want %zu", w, m->params_bytes,
        up(P * psi));
  CHECK(m->master_bytes == (P < 4 ? up(4 * shard) : 0), "W=%d master %zu", w, m->master_bytes);
  CHECK(m->optim_bytes == 2 * up(4 * shard), "W=%d optim %zu", w, m->optim_bytes);
  if (c->strategy == SG_NO_SHARD) {
    CHECK(shard == psi, "NO_SHARD shard_numel %zu == numel %zu", shard, psi);
  } else {
    CHECK(shard * (size_t)w == psi, "W=%d shard_numel %zu * W == numel %zu", w, shard, psi);
  }
  if (c->strategy == SG_SHARD_GRAD_OP) {
    /* staging: S buckets of the largest bucket */
    const size_t want = 2 * up(G * big) + up(A * shard);
    CHECK(m->grads_bytes == want, "W=%d SHARD_GRAD_OP grads %zu, want %zu", w, m->grads_bytes,
          want);
  } else {
    const size_t acc = c->strategy == SG_NO_SHARD ? psi : shard;
    CHECK(m->grads_bytes == up(G * psi) + up(A * acc), "W=%d grads %zu", w, m->grads_bytes);
  }
  /* comm: fp32 scratch for the largest bucket's slice per rank and 256 bytes for the step's
   * norm reduction, plus, when reduce_dtype != grad_dtype, the largest bucket in reduce_dtype */
  const size_t comm = up(4 * (big / (size_t)w) + 256) + (rdt != gdt ? up(R * big) : 0);
  CHECK(m->comm_bytes == comm, "W=%d g%d r%d comm %zu, want %zu", w, (int)gdt, (int)rdt,
        m->comm_bytes, comm);
  CHECK(m->total_bytes == m->params_bytes + m->grads_bytes + m->master_bytes + m->optim_bytes +
                              m->comm_bytes,
        "total is the sum of the kinds");
  CHECK(m->peak_bytes >= m->total_bytes, "peak >= total");
}

static void run(sg_strategy s, sg_dtype pdt, sg_dtype gdt, sg_dtype rdt, sg_dtype adt, int w) {
  sg_comm *comms[4];
  if (sg_comm_create_local(w, comms) != SG_OK) {
    CHECK(0, "sg_comm_create_local: %s", sg_last_error());
    return;
  }
  rank_arg args[4];
  pthread_t th[4];
  for (int r = 0; r < w; r++) {
    memset(&args[r], 0, sizeof args[r]);
    sg_config_init(&args[r].cfg, sizeof args[r].cfg);
    args[r].cfg.strategy = s;
    args[r].cfg.param_dtype = pdt;
    args[r].cfg.grad_dtype = gdt;
    args[r].cfg.reduce_dtype = rdt;
    args[r].cfg.accum_dtype = adt;
    args[r].cfg.bucket_bytes = 256 * 1024;
    args[r].cfg.timeout_ms = 30000;
    args[r].comm = comms[r];
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  size_t numels[NP];
  memcpy(numels, k_numels, sizeof numels);
  sg_memory_stats est;
  memset(&est, 0, sizeof est);
  est.struct_size = sizeof est;
  sg_status st = sg_estimate_memory(&args[0].cfg, numels, NP, w, &est);
  CHECK(st == SG_OK, "sg_estimate_memory: %s", sg_last_error());
  for (int r = 0; r < w; r++) {
    CHECK(args[r].st == SG_OK, "rank %d: %s", r, sg_status_string(args[r].st));
    if (args[r].st != SG_OK || st != SG_OK) continue;
    const sg_memory_stats *m = &args[r].mem;
    CHECK(m->params_bytes == est.params_bytes && m->grads_bytes == est.grads_bytes &&
              m->master_bytes == est.master_bytes && m->optim_bytes == est.optim_bytes &&
              m->comm_bytes == est.comm_bytes && m->total_bytes == est.total_bytes &&
              m->numel == est.numel && m->shard_numel == est.shard_numel,
          "strategy %d pdt %d gdt %d rdt %d adt %d W=%d rank %d: sg_memory total %zu != estimate "
          "%zu", (int)s, (int)pdt, (int)gdt, (int)rdt, (int)adt, w, r, m->total_bytes,
          est.total_bytes);
    check_formula(&args[r].cfg, w, m);
  }
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
}

int main(void) {
  const sg_strategy ss[] = {SG_NO_SHARD, SG_SHARD_OPT, SG_SHARD_GRAD_OP};
  const sg_dtype ps[] = {SG_F32, SG_BF16, SG_F16};
  for (int s = 0; s < 3; s++)
    for (int p = 0; p < 3; p++)
      for (int a = 0; a < 2; a++)
        for (int w = 1; w <= 4; w++)
          run(ss[s], ps[p], SG_DTYPE_AUTO, SG_DTYPE_AUTO, a ? SG_BF16 : SG_F32, w);
  /* (grad, reduce) dtype pairs that differ; bf16 params with f32 gradients once */
  static const sg_dtype pairs[][3] = {{SG_BF16, SG_BF16, SG_F32}, {SG_F32, SG_F32, SG_BF16},
                                      {SG_F16, SG_F16, SG_F32},   {SG_F32, SG_F32, SG_F16},
                                      {SG_BF16, SG_F32, SG_BF16}};
  for (int s = 0; s < 3; s++)
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++)
      for (int w = 1; w <= 4; w++) run(ss[s], pairs[k][0], pairs[k][1], pairs[k][2], SG_F32, w);
  return sg_test_summary("");
}
