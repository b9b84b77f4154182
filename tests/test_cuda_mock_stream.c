/* Streaming outer steps on the replica lane (issue 26), on the mock CUDA runtime and mock NCCL:
 * a hybrid engine of 3 nodes x 2 ranks (threads) over NCCL, SG_SHARD_GRAD_OP, one parameter per
 * bucket, cfg.outer_every = 2 with cfg.outer_streaming = 1: every step ends by queueing the sum
 * across the nodes of one group of buckets (b mod 2), merged in the next step before its
 * update. In the measured step the cross-node link is slow: the mock stalls every stream that a
 * collective over 3 ranks (the replica channel) is queued on, from before the sg_step that
 * queues a group's sum until after the next step's gradients are in. Every bucket's
 * reduce-scatter over the node (2 ranks) in that next step must still complete: queued on the
 * comm stream behind the stalled sum (or with the compute stream waiting for it) none would.
 * Released, the run ends as the same run without the stall does, bit for bit, on every rank. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h> /* the mock's: sg_cudamock_drain, cudaMalloc */
#include <nccl.h>         /* the mock's: sg_ncclmock_stall_size, sg_ncclmock_done */

#include "shardgrad.h"
#include "sg_test_check.h" /* CHECK, sg_test_summary */

#define W 6
#define PER_NODE 2
#define NODES (W / PER_NODE)
#define NPARAM 8 /* = buckets: groups of 4 */
#define NUMEL 256
#define STEPS 5
#define SLOW_STEP 2 /* its sg_step queues a stalled sum; step SLOW_STEP + 1 must reduce */

static pthread_barrier_t g_bar;
static unsigned char g_id[128];
static int g_stall;         /* this run stalls the replica link after SLOW_STEP's gradients */
static long long g_rs_done; /* node collectives completed in step SLOW_STEP + 1 while stalled */
static float g_params[2][W][NPARAM * NUMEL]; /* [stalled run][rank] */

static float grad_val(int rank, int step, int p, int i) {
  return (float)(((i * 7 + p * 13 + step * 5 + rank * 3) % 17) - 8) * 0.125f;
}

static sg_status setup(sg_comm *shard, sg_comm *rep, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.device = SG_DEVICE_CUDA;
  cfg.bucket_bytes = NUMEL * 4; /* one parameter per bucket */
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  cfg.outer_every = 2;
  cfg.outer_streaming = 1;
  if ((st = sg_engine_create_hybrid(shard, rep, &cfg, e))) return st;
  for (int p = 0; p < NPARAM && !st; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(*e, name, NUMEL, 0, &ids[p]);
  }
  if (!st) st = sg_finalize(*e);
  if (!st) st = sg_set_microbatches(*e, 1);
  float init[NUMEL];
  for (int p = 0; p < NPARAM && !st; p++) {
    for (int i = 0; i < NUMEL; i++) init[i] = 0.01f * (float)((i * 37 + p) % 101);
    st = sg_set_param(*e, ids[p], init, SG_F32);
  }
  return st;
}

/* Every rank at the barrier, rank 0 runs fn (everything that can run has run first), again. */
static void all_at(int rank, void (*fn)(void)) {
  pthread_barrier_wait(&g_bar);
  if (rank == 0) {
    sg_cudamock_drain();
    fn();
  }
  pthread_barrier_wait(&g_bar);
}

static long long g_before;
static void stall_on(void) { sg_ncclmock_stall_size(NODES); }
static void count_from(void) { g_before = sg_ncclmock_done(PER_NODE); }
static void count_release(void) {
  g_rs_done = sg_ncclmock_done(PER_NODE) - g_before;
  sg_ncclmock_stall_size(0); /* the link recovers */
}

static sg_status grads(sg_engine *e, const int *ids, const float *src, int step) {
  sg_status st = SG_OK;
  for (int p = NPARAM - 1; p >= 0 && !st; p--) /* reverse order: buckets in plan order */
    st = sg_grad_add(e, ids[p], src + ((size_t)step * NPARAM + (size_t)p) * NUMEL, SG_F32);
  return st;
}

static sg_status train(int rank, sg_engine *e, const int *ids, const float *src) {
  sg_status st = SG_OK;
  for (int step = 0; step < STEPS && !st; step++) {
    const int slow = g_stall && step == SLOW_STEP, next = g_stall && step == SLOW_STEP + 1;
    st = grads(e, ids, src, step);
    if (slow) all_at(rank, stall_on);
    if (next) all_at(rank, count_release);
    if (!st) st = sg_step(e, NULL);
    if (slow) all_at(rank, count_from);
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
  for (int s = 0; s < STEPS && !st; s++)
    for (int p = 0; p < NPARAM; p++)
      for (int i = 0; i < NUMEL; i++)
        src[((size_t)s * NPARAM + (size_t)p) * NUMEL + (size_t)i] = grad_val(rank, s, p, i);
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
  /* each node's ranks: one reduce-scatter per bucket, over PER_NODE ranks */
  CHECK(g_rs_done == (long long)NODES * NPARAM,
        "with a group's sum across the nodes stalled, the next step's reduce-scatters completed "
        "on every node: %lld of %d",
        g_rs_done, NODES * NPARAM);
  for (int r = 0; r < W; r++)
    CHECK(memcmp(g_params[1][r], g_params[0][r], sizeof g_params[0][r]) == 0,
          "rank %d: the parameters after the slow link == without it", r);
  sg_cudamock_drain();
  return sg_test_summary("");
}
