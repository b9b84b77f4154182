/* The replica lane (issue 28, defect 2), on the mock CUDA runtime and mock NCCL: a hybrid engine
 * of 3 nodes x 2 ranks (threads) over NCCL, SG_SHARD_GRAD_OP, one parameter per bucket, one
 * micro-batch per step (sg_set_microbatches: each bucket's all-reduce across the nodes starts
 * right after its reduce-scatter). In the measured micro-batch the cross-node link is slow: the
 * mock stalls every stream that a collective over 3 ranks (the replica channel) is queued on.
 * Every bucket's reduce-scatter over the node (2 ranks) must still complete: with one comm
 * stream it queued behind the first stalled all-reduce (head-of-line blocking). Released, the
 * step ends as the same run without the stall does, bit for bit, on every rank. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h> /* the mock's: sg_cudamock_drain, cudaMalloc */
#include <nccl.h>         /* the mock's: sg_ncclmock_stall_size, sg_ncclmock_done */

#include "shardgrad.h"
#include "sg_test_params.h" /* sg_test_ramp_params, sg_test_fill_grads */
#include "sg_test_check.h" /* CHECK, sg_test_summary */

#define W 6
#define PER_NODE 2
#define NODES (W / PER_NODE)
#define NPARAM 8 /* = buckets */
#define NUMEL 256
#define STEPS 3
#define SLOW_STEP 1

static pthread_barrier_t g_bar;
static unsigned char g_id[128];
static int g_stall;               /* this run stalls the replica link in SLOW_STEP */
static long long g_rs_done;       /* reduce-scatters completed while it was stalled */
static float g_params[2][W][NPARAM * NUMEL]; /* [stalled run][rank] */

static sg_status setup(sg_comm *shard, sg_comm *rep, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.device = SG_DEVICE_CUDA;
  cfg.bucket_bytes = NUMEL * 4; /* one parameter per bucket */
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  if ((st = sg_engine_create_hybrid(shard, rep, &cfg, e))) return st;
  st = sg_test_ramp_params(*e, NPARAM, NUMEL, 0, ids);
  if (!st) st = sg_set_microbatches(*e, 1);
  return st;
}

/* Rank 0 only, between barriers: everything that can run has run. */
static void settle_all(void) { sg_cudamock_drain(); }

static sg_status train(int rank, sg_engine *e, const int *ids, float *src) {
  sg_status st = SG_OK;
  for (int step = 0; step < STEPS && !st; step++) {
    const int slow = g_stall && step == SLOW_STEP;
    long long before = 0;
    if (slow) {
      pthread_barrier_wait(&g_bar);
      if (rank == 0) {
        settle_all();
        before = sg_ncclmock_done(PER_NODE);
        sg_ncclmock_stall_size(NODES);
      }
      pthread_barrier_wait(&g_bar);
    }
    for (int p = NPARAM - 1; p >= 0 && !st; p--) { /* reverse order: buckets in plan order */
      float *g = src + ((size_t)step * NPARAM + (size_t)p) * NUMEL;
      st = sg_grad_add(e, ids[p], g, SG_F32);
    }
    if (slow) {
      pthread_barrier_wait(&g_bar);
      if (rank == 0) {
        settle_all();
        g_rs_done = sg_ncclmock_done(PER_NODE) - before;
        sg_ncclmock_stall_size(0); /* the link recovers */
      }
      pthread_barrier_wait(&g_bar);
    }
    if (!st) st = sg_step(e, NULL);
  }
  return st;
}

static void *rank_main(void *arg) {
  const int rank = (int)(intptr_t)arg;
  sg_comm *c = NULL, *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  int ids[NPARAM];
  float *src = NULL;
  sg_status st = sg_comm_create_nccl(rank, W, g_id, 0, &c);
  if (!st) st = sg_comm_split_nodes(c, PER_NODE, &shard, &rep);
  if (!st) st = setup(shard, rep, &e, ids);
  /* the gradients in (mock) device memory, one buffer per step: sg_grad_add's kernel reads them
   * when the compute stream gets there */
  const size_t n = (size_t)STEPS * NPARAM * NUMEL;
  if (!st && cudaMalloc((void **)&src, n * 4) != cudaSuccess) st = SG_ERR_OUT_OF_MEMORY;
  if (!st) sg_test_fill_grads(src, rank, STEPS, 1, NPARAM, NUMEL);
  if (!st) st = train(rank, e, ids, src);
  for (int p = 0; p < NPARAM && !st; p++)
    st = sg_get_param(e, ids[p], g_params[g_stall][rank] + (size_t)p * NUMEL, SG_F32);
  CHECK(st == SG_OK, "rank %d, %s link: %d steps (%s%s%s)", rank, g_stall ? "a slow" : "no slow",
        STEPS, sg_status_string(st), st ? ": " : "", st ? sg_last_error() : "");
  sg_engine_destroy(e);
  if (src) cudaFree(src);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  sg_comm_destroy(c);
  return NULL;
}

static void run(int stall) {
  pthread_t th[W];
  g_stall = stall;
  g_rs_done = -1;
  if (sg_nccl_unique_id(g_id) != SG_OK) {
    CHECK(0, "sg_nccl_unique_id");
    return;
  }
  pthread_barrier_init(&g_bar, NULL, W);
  for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r);
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&g_bar);
}

int main(void) {
  run(0);
  run(1);
  CHECK(g_rs_done == (long long)NODES * NPARAM,
        "with the cross-node all-reduces stalled, every bucket's reduce-scatter completed on "
        "every node: %lld of %d",
        g_rs_done, NODES * NPARAM);
  for (int r = 0; r < W; r++)
    CHECK(memcmp(g_params[1][r], g_params[0][r], sizeof g_params[0][r]) == 0 &&
              memcmp(g_params[1][r], g_params[1][0], sizeof g_params[0][r]) == 0,
          "rank %d: the parameters after the slow link == without it == rank 0's", r);
  sg_cudamock_drain();
  return sg_test_summary("");
}
