/* Shared by the checkpoint tests: checks, ranks as threads, a small model with gradients that
 * sum exactly (multiples of 1/8, the same on every rank, so the 1/W average is exact for W =
 * 1..4), training, and state snapshots compared bit for bit. */
#ifndef TEST_CKPT_UTIL_H
#define TEST_CKPT_UTIL_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/sg_elem.h" /* sg_elem_store: the test writes gradients in any dtype */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h" /* CHECK (failures printed), counted under one lock across threads */
#include "sg_test_state.h" /* sg_test_mix, reading and freeing the engine's state */

/* Prints the "N passed, M failed" line; the exit code. */
static inline int finish(void) { return sg_test_summary(""); }

/* ---------------------------------------------------------------------------------------- */
/* ranks as threads                                                                          */

typedef void (*rank_fn)(int rank, int world, sg_comm *comm, void *arg);

typedef struct {
  rank_fn fn;
  int rank, world;
  sg_comm *comm;
  void *arg;
} rank_thread;

static inline void *rank_main(void *p) {
  rank_thread *t = p;
  t->fn(t->rank, t->world, t->comm, t->arg);
  return NULL;
}

/* fn(rank, world, comm, arg) on `world` threads; arg is shared. */
static inline void run_ranks(int world, rank_fn fn, void *arg) {
  sg_comm *comms[8];
  pthread_t th[8];
  rank_thread rt[8];
  if (world > 8 || sg_comm_create_local(world, comms) != SG_OK) {
    CHECK(0, "sg_comm_create_local(%d): %s", world, sg_last_error());
    return;
  }
  for (int r = 0; r < world; r++) {
    rt[r] = (rank_thread){fn, r, world, comms[r], arg};
    pthread_create(&th[r], NULL, rank_main, &rt[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++) sg_comm_destroy(comms[r]);
}

/* ---------------------------------------------------------------------------------------- */
/* model                                                                                     */

#define MAXP 8

/* The device every engine of the test runs on: SG_DEVICE_CUDA when the test is built against
 * the mock CUDA runtime (SG_TEST_CUDA_MOCK), so that every device copy of the checkpoint code
 * goes through src/device/cuda.c. */
#ifdef SG_TEST_CUDA_MOCK
static const sg_device g_test_device = SG_DEVICE_CUDA;
#else
static const sg_device g_test_device = SG_DEVICE_CPU;
#endif

typedef struct {
  int nparams;
  size_t sizes[MAXP];
  sg_strategy strategy;
  sg_dtype dtype; /* param and grad dtype */
  size_t bucket_bytes;
  int dynamic;        /* f16: dynamic loss scale with a short window */
  const char *rename; /* register param 0 under this name instead (mismatch tests) */
} model_cfg;

static inline void param_name(const model_cfg *m, int p, char *buf, size_t n) {
  if (p == 0 && m->rename)
    snprintf(buf, n, "%s", m->rename);
  else
    snprintf(buf, n, "layer%d.%s", p, p % 3 == 1 ? "bias" : "weight");
}

/* Gradient of element i of param p at optimizer step `step`: k/8, k in -2..2. */
static inline float grad_val(int step, int p, size_t i) {
  const uint64_t h =
      sg_test_mix(((uint64_t)step << 48) ^ ((uint64_t)p << 40) ^ (uint64_t)i ^ 0x5eed);
  return (float)((int)(h % 5) - 2) * 0.125f;
}

static inline float init_val(int p, size_t i) {
  return (float)sin(0.37 * (double)i + (double)p) * 0.5f;
}

/* Engine with the model registered, finalized and initialized (identically on every rank). */
static inline sg_status make_engine(sg_comm *c, const model_cfg *m, sg_engine **out, int *ids) {
  *out = NULL;
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = m->strategy;
  cfg.device = g_test_device;
  cfg.param_dtype = cfg.grad_dtype = cfg.reduce_dtype = m->dtype;
  cfg.bucket_bytes = m->bucket_bytes;
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  if (m->dynamic) {
    cfg.loss_scale = 0;
    cfg.init_loss_scale = 1024;
    cfg.scale_window = 2;
  } else {
    cfg.loss_scale = 1.0f;
  }
  if ((st = sg_engine_create(c, &cfg, out))) return st;
  for (int p = 0; p < m->nparams && !st; p++) {
    char name[64];
    param_name(m, p, name, sizeof name);
    st = sg_add_param(*out, name, m->sizes[p], p % 3 == 1 ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st) st = sg_finalize(*out);
  size_t maxn = 1;
  for (int p = 0; p < m->nparams; p++) maxn = m->sizes[p] > maxn ? m->sizes[p] : maxn;
  float *buf = malloc(maxn * sizeof *buf);
  for (int p = 0; p < m->nparams && !st; p++) {
    for (size_t i = 0; i < m->sizes[p]; i++) buf[i] = init_val(p, i);
    st = sg_set_param(*out, ids[p], buf, SG_F32);
  }
  free(buf);
  if (st) {
    sg_engine_destroy(*out);
    *out = NULL;
  }
  return st;
}

/* Optimizer steps [from, to): every rank writes the same gradients, in backward order. */
static inline sg_status train(sg_engine *e, const model_cfg *m, const int *ids, int from, int to) {
  sg_status st = SG_OK;
  for (int s = from; s < to && !st; s++) {
    for (int p = m->nparams - 1; p >= 0 && !st; p--) {
      void *g = NULL;
      if ((st = sg_grad_ptr(e, ids[p], &g))) break;
      for (size_t i = 0; i < m->sizes[p]; i++) sg_elem_store(g, m->dtype, i, grad_val(s, p, i));
      st = sg_grad_ready(e, ids[p]);
    }
    if (!st) st = sg_step(e, NULL);
  }
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* state snapshots                                                                           */

typedef struct {
  float *v[4][MAXP]; /* param (as f32), master, m, v */
  float loss_scale;
  int ok;
} snap;
#define SNAP_STATE(s) ((float **[4]){(s)->v[0], (s)->v[1], (s)->v[2], (s)->v[3]})

/* Collective (sg_get_master / sg_get_optim_state). */
static inline sg_status take_snap(sg_engine *e, const model_cfg *m, const int *ids, snap *s) {
  memset(s, 0, sizeof *s);
  sg_status st = sg_test_read_state(e, ids, m->sizes, m->nparams, SNAP_STATE(s));
  if (!st) st = sg_get_loss_scale(e, &s->loss_scale);
  s->ok = st == SG_OK;
  return st;
}

static inline void free_snap(snap *s) {
  sg_test_free_state(MAXP, SNAP_STATE(s));
  memset(s, 0, sizeof *s);
}

/* 1 when bitwise equal; prints the first difference under `label` otherwise. */
static inline int same_snap(const char *label, const model_cfg *m, const snap *a, const snap *b) {
  if (!a->ok || !b->ok) {
    printf("  %s: snapshot missing\n", label);
    return 0;
  }
  for (int k = 0; k < 4; k++)
    for (int p = 0; p < m->nparams; p++)
      if (memcmp(a->v[k][p], b->v[k][p], m->sizes[p] * 4) != 0) {
        const size_t i = sg_test_first_diff(a->v[k][p], b->v[k][p], m->sizes[p]);
        static const char *const what[4] = {"param", "master", "m", "v"};
        printf("  %s: %s of param %d differs at %zu: %.9g vs %.9g\n", label, what[k], p, i,
               a->v[k][p][i], b->v[k][p][i]);
        return 0;
      }
  if (memcmp(&a->loss_scale, &b->loss_scale, 4) != 0) {
    printf("  %s: loss scale %g vs %g\n", label, a->loss_scale, b->loss_scale);
    return 0;
  }
  return 1;
}

static inline int contains(const char *hay, const char *needle) {
  return strstr(hay, needle) != NULL;
}

#endif /* TEST_CKPT_UTIL_H */
