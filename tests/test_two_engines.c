/* Several engines on one communicator (issue 14: a GAN's two models, teacher and student, share
 * one process group). Two engines A and B with different parameters, strategies and dtypes are
 * created on the same communicator and step alternately, their gradients interleaved
 * (A's first bucket, B's first, A's second...), so that their reductions and gathers are in
 * flight together on their comm workers. Each must end bitwise equal to the same engine trained
 * alone on the same gradients (parameters, master weights, moments). Then a third engine on the
 * communicator after A was destroyed (the next channel), and the same check.
 *
 *   --local W   W ranks as threads (local communicator)
 *   --mpi       one rank per process (mpirun -np 2..4)
 *   --nccl W    mock CUDA + mock NCCL (tests/cudamock), W ranks as threads, engines on the CUDA
 *               device (built against the mock only) */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sg_engine_internal.h" /* e->dev: gradients into device slots (CUDA) */
#include "shardgrad.h"
#include "sg_test_check.h" /* CHECK, counted under one lock across threads */

#define MAXW 8
#define STEPS 4

static int g_cuda;

static void check(int ok, const char *what, int rank) { CHECK(ok, "rank %d: %s", rank, what); }

/* ---- two models ------------------------------------------------------------------------------ */

typedef struct model {
  const char *name;
  int nparams;
  size_t sizes[4];
  sg_strategy strategy;
  sg_dtype pdt, gdt;
  int overlap;
  float lr;
} model;

static const model k_models[3] = {
    {"A", 3, {1000, 37, 5000, 0}, SG_SHARD_GRAD_OP, SG_BF16, SG_BF16, 1, 0.01f},
    {"B", 2, {300, 7001, 0, 0}, SG_NO_SHARD, SG_F32, SG_F32, 0, 0.003f},
    {"C", 4, {64, 129, 2048, 3}, SG_SHARD_OPT, SG_F32, SG_BF16, 0, 0.02f},
};

typedef struct run {
  const model *m;
  sg_engine *e;
  int ids[4];
  float *out[4]; /* params, then master, m, v, each param after the last step */
} run;

static size_t total(const model *m) {
  size_t t = 0;
  for (int p = 0; p < m->nparams; p++) t += m->sizes[p];
  return t;
}

static sg_status create(sg_comm *c, const model *m, run *r) {
  memset(r, 0, sizeof *r);
  r->m = m;
  sg_config cfg;
  SG_TRY(sg_config_init(&cfg, sizeof cfg));
  cfg.strategy = m->strategy;
  cfg.param_dtype = m->pdt;
  cfg.grad_dtype = m->gdt;
  cfg.reduce_dtype = m->gdt;
  cfg.bucket_bytes = 4096; /* several buckets: several collectives per step */
  cfg.lr = m->lr;
  cfg.loss_scale = 1.0f;
  cfg.timeout_ms = 60000;
  cfg.overlap_param_gather = m->overlap;
  cfg.device = g_cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg.cuda_device = 0;
  SG_TRY(sg_engine_create(c, &cfg, &r->e));
  char name[32];
  for (int p = 0; p < m->nparams; p++) {
    snprintf(name, sizeof name, "%s.p%d", m->name, p);
    SG_TRY(sg_add_param(r->e, name, m->sizes[p], 0, &r->ids[p]));
  }
  return sg_finalize(r->e);
}

/* Gradient of element i of param p at (rank, step): a value that differs everywhere. */
static float grad_val(int model, int rank, int step, int p, size_t i) {
  const unsigned h = (unsigned)(i * 2654435761u) ^ (unsigned)(model * 97 + rank * 31 + step * 7 + p);
  return ((float)(h % 2001u) - 1000.0f) / 512.0f;
}

static sg_status write_grad(run *r, int model, int rank, int step, int p) {
  void *slot = NULL;
  SG_TRY(sg_grad_ptr(r->e, r->ids[p], &slot));
  const size_t n = r->m->sizes[p], es = r->m->gdt == SG_F32 ? 4 : 2;
  float *f = malloc(n * 4);
  uint16_t *h = malloc(n * 2);
  if (!f || !h) {
    free(f);
    free(h);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "test: grads");
  }
  for (size_t i = 0; i < n; i++) f[i] = grad_val(model, rank, step, p, i);
  const void *src = f;
  if (es == 2) { /* bf16 by truncation: exact in the test's own terms, same for both runs */
    for (size_t i = 0; i < n; i++) {
      uint32_t u;
      memcpy(&u, &f[i], 4);
      h[i] = (uint16_t)(u >> 16);
    }
    src = h;
  }
  sg_status st = r->e->dev->ops->copy(r->e->dev, SG_Q_COMPUTE, slot, src, n * es, SG_COPY_H2D);
  free(f);
  free(h);
  SG_TRY(st);
  return sg_grad_ready(r->e, r->ids[p]);
}

/* Backward in reverse registration order, interleaved across the runs given (run k at its step
 * base[k] + step), then their steps one after the other. */
static sg_status step_all(run **rs, const int *models, const int *base, int nr, int rank,
                          int step) {
  int maxp = 0;
  for (int k = 0; k < nr; k++)
    if (rs[k]->m->nparams > maxp) maxp = rs[k]->m->nparams;
  for (int j = 0; j < maxp; j++)
    for (int k = 0; k < nr; k++) {
      const int np = rs[k]->m->nparams;
      if (j < np) SG_TRY(write_grad(rs[k], models[k], rank, base[k] + step, np - 1 - j));
    }
  for (int k = 0; k < nr; k++) SG_TRY(sg_step(rs[k]->e, NULL));
  return SG_OK;
}

static sg_status collect(run *r) {
  const size_t n = total(r->m);
  for (int f = 0; f < 4; f++) {
    r->out[f] = calloc(n, 4);
    if (!r->out[f]) return sg__err(SG_ERR_OUT_OF_MEMORY, "test: results");
  }
  size_t off = 0;
  for (int p = 0; p < r->m->nparams; p++) {
    SG_TRY(sg_get_param(r->e, r->ids[p], r->out[0] + off, SG_F32));
    if (r->m->pdt != SG_F32) SG_TRY(sg_get_master(r->e, r->ids[p], r->out[1] + off));
    SG_TRY(sg_get_optim_state(r->e, r->ids[p], 0, r->out[2] + off));
    SG_TRY(sg_get_optim_state(r->e, r->ids[p], 1, r->out[3] + off));
    off += r->m->sizes[p];
  }
  return SG_OK;
}

static void release(run *r) {
  sg_engine_destroy(r->e);
  r->e = NULL;
}

static void free_out(run *r) {
  for (int f = 0; f < 4; f++) free(r->out[f]);
}

static int same(const run *a, const run *b) {
  const size_t n = total(a->m);
  for (int f = 0; f < 4; f++)
    if (memcmp(a->out[f], b->out[f], n * 4) != 0) return 0;
  return 1;
}

/* One rank: A alone, B alone (twice as many steps), C alone: the references; then A and B
 * together, then C beside B after A is gone. Every rank creates its engines in the same order. */
static void rank_body(sg_comm *c) {
  const int rank = sg_comm_rank(c);
  run ref[3], a, b, cc;
  char what[160];
  const int zero[2] = {0, 0};
  for (int k = 0; k < 3; k++) {
    run *one[1] = {&ref[k]};
    const int mk[1] = {k};
    const int steps = k == 1 ? 2 * STEPS : STEPS;
    sg_status st = create(c, &k_models[k], &ref[k]);
    for (int s = 0; s < steps && st == SG_OK; s++) st = step_all(one, mk, zero, 1, rank, s);
    if (st == SG_OK) st = collect(&ref[k]);
    snprintf(what, sizeof what, "engine %s alone: %d steps", k_models[k].name, STEPS);
    check(st == SG_OK, what, rank);
    release(&ref[k]);
  }
  sg_status st = create(c, &k_models[0], &a);
  if (st == SG_OK) st = create(c, &k_models[1], &b);
  check(st == SG_OK, "engines A and B on one communicator", rank);
  run *both[2] = {&a, &b};
  const int mb[2] = {0, 1};
  for (int s = 0; s < STEPS && st == SG_OK; s++) st = step_all(both, mb, zero, 2, rank, s);
  check(st == SG_OK, "A and B step alternately, their gradients interleaved", rank);
  if (st == SG_OK) st = collect(&a);
  release(&a);
  /* C joins while B lives: the next channel; C and B interleave too */
  if (st == SG_OK) st = create(c, &k_models[2], &cc);
  run *bc[2] = {&b, &cc};
  const int mc[2] = {1, 2}, bases[2] = {STEPS, 0}; /* B goes on from its STEPS */
  check(st == SG_OK, "engine C on the communicator after A was destroyed", rank);
  for (int s = 0; s < STEPS && st == SG_OK; s++) st = step_all(bc, mc, bases, 2, rank, s);
  check(st == SG_OK, "B and C step alternately", rank);
  if (st == SG_OK) st = collect(&b);
  if (st == SG_OK) st = collect(&cc);
  check(st == SG_OK, "results of A, B and C", rank);
  if (st == SG_OK) {
    check(same(&a, &ref[0]), "A beside B == A alone, bitwise (params, master, m, v)", rank);
    check(same(&b, &ref[1]), "B beside A == B alone, bitwise", rank);
    check(same(&cc, &ref[2]), "C after A, beside B == C alone, bitwise", rank);
  }
  release(&b);
  release(&cc);
  for (int k = 0; k < 3; k++) free_out(&ref[k]);
  free_out(&a);
  free_out(&b);
  free_out(&cc);
}

static void *rank_thread(void *arg) {
  rank_body((sg_comm *)arg);
  return NULL;
}

static int run_threads(sg_comm **cs, int w) {
  pthread_t th[MAXW];
  for (int r = 0; r < w; r++) pthread_create(&th[r], NULL, rank_thread, cs[r]);
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) sg_comm_destroy(cs[r]);
  return 0;
}

#ifdef SG_TEST_NCCL
typedef struct nccl_rank {
  int rank, world;
  const unsigned char *id;
} nccl_rank;

static void *nccl_thread(void *arg) {
  const nccl_rank *x = (const nccl_rank *)arg;
  sg_comm *c = NULL;
  if (sg_comm_create_nccl(x->rank, x->world, x->id, 0, &c) != SG_OK) {
    check(0, "sg_comm_create_nccl", x->rank);
    return NULL;
  }
  rank_body(c);
  sg_comm_destroy(c);
  return NULL;
}
#endif

int main(int argc, char **argv) {
  int w = 2, mpi = 0, nccl = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--local") && i + 1 < argc) w = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--mpi")) mpi = 1;
    else if (!strcmp(argv[i], "--nccl") && i + 1 < argc) nccl = 1, w = atoi(argv[++i]);
  }
  if (w < 1 || w > MAXW) w = 2;
  if (mpi) {
    sg_comm *c = NULL;
    if (sg_comm_create_mpi(NULL, &c) != SG_OK) {
      printf("FAIL sg_comm_create_mpi: %s\n", sg_last_error());
      return 1;
    }
    rank_body(c);
    const int rank = sg_comm_rank(c);
    sg_comm_destroy(c);
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d: ", rank);
    return sg_test_summary(prefix);
  }
  if (nccl) {
#ifdef SG_TEST_NCCL
    g_cuda = 1;
    unsigned char id[128];
    if (sg_nccl_unique_id(id) != SG_OK) {
      printf("FAIL sg_nccl_unique_id: %s\n", sg_last_error());
      return 1;
    }
    pthread_t th[MAXW];
    nccl_rank x[MAXW];
    for (int r = 0; r < w; r++) {
      x[r] = (nccl_rank){r, w, id};
      pthread_create(&th[r], NULL, nccl_thread, &x[r]);
    }
    for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
#else
    printf("--nccl needs the mock build\n");
    return 77;
#endif
  } else {
    sg_comm *cs[MAXW];
    if (sg_comm_create_local(w, cs) != SG_OK) {
      printf("FAIL sg_comm_create_local: %s\n", sg_last_error());
      return 1;
    }
    run_threads(cs, w);
  }
  return sg_test_summary("");
}
