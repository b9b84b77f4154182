/* Streaming outer steps on the CUDA device (issue 26), on the mock CUDA runtime and mock NCCL: a
 * hybrid engine of 3 nodes x 2 ranks (threads), SG_SHARD_GRAD_OP, one parameter per bucket,
 * cfg.outer_every = 2 with cfg.outer_streaming = 1: every step ends by queueing the sum across
 * the nodes of one group of buckets (b mod 2), merged in the next step before its update. In
 * the measured step that sum cannot finish, and the next step's reduce-scatters inside the node
 * must still complete (queued behind the sum, or with the compute stream waiting for it, none
 * would):
 *  - NCCL (the replica lane): the mock stalls every stream that a collective over 3 ranks (the
 *    replica channel) is queued on, from before the sg_step that queues the sum until the next
 *    step's gradients are in; every node's reduce-scatters (2 ranks) count as done meanwhile;
 *  - threads (the device's twin): nodes 1 and 2 hold back their sg_step, so node 0's sum waits
 *    inside its all-reduce for them; node 0's ranks add the next step's gradients and their
 *    shard communicator issues every reduce-scatter (sg_comm_stats) before the others go on.
 * Released, the run ends as the same run without the stall does, bit for bit, on every rank. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t, nanosleep */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h> /* the mock's: sg_cudamock_drain, cudaMalloc */
#include <nccl.h>         /* the mock's: sg_ncclmock_stall_size, sg_ncclmock_done */

#include "shardgrad.h"
#include "sg_test_params.h" /* sg_test_ramp_params, sg_test_fill_grads */
#include "sg_test_check.h" /* CHECK, sg_test_summary */

#define W 6
#define PER_NODE 2
#define NODES (W / PER_NODE)
#define NPARAM 8 /* = buckets: 2 groups of 4 */
#define NUMEL 256
#define STEPS 5
#define SLOW_STEP 2 /* its sg_step queues the sum that cannot finish; the next step reduces */

static pthread_barrier_t g_bar;
static unsigned char g_id[128];
static sg_comm *g_world[W]; /* threads runs */
static int g_nccl;          /* this run's communicators: NCCL, or threads */
static int g_stall;         /* this run holds the measured sum */
static long long g_rs_done; /* NCCL: node reduce-scatters done while the sum was stalled */
static long long g_issued[W]; /* threads: node 0's shard collectives issued meanwhile */
static float g_params[2][2][W][NPARAM * NUMEL]; /* [nccl][stalled run][rank] */

static sg_status setup(sg_comm *shard, sg_comm *rep, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.device = SG_DEVICE_CUDA;
  cfg.bucket_bytes = NUMEL * 4; /* one parameter per bucket */
  cfg.lr = 0.01f;
  cfg.timeout_ms = 20000; /* a sum that held up the reduce-scatters ends the run, not hangs */
  cfg.outer_every = 2;
  cfg.outer_streaming = 1;
  if ((st = sg_engine_create_hybrid(shard, rep, &cfg, e))) return st;
  return sg_test_ramp_params(*e, NPARAM, NUMEL, 0, ids);
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

static uint64_t issued(const sg_comm *c) {
  sg_comm_traffic t = {.struct_size = sizeof t};
  return sg_comm_stats(c, &t) == SG_OK ? t.collectives : 0;
}

/* Threads, node 0: its shard communicator's collectives issued since `from`, once NPARAM more
 * (every reduce-scatter of the step) or after 10 s. */
static long long wait_issued(const sg_comm *shard, uint64_t from) {
  const struct timespec ms = {0, 1000000};
  for (int i = 0; i < 10000 && issued(shard) - from < NPARAM; i++) nanosleep(&ms, NULL);
  return (long long)(issued(shard) - from);
}

static sg_status train_nccl(int rank, sg_engine *e, const int *ids, const float *src) {
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

/* Every rank passes the barrier once in the measured steps, whatever fails. */
static sg_status train_threads(int rank, sg_engine *e, const int *ids, const float *src,
                               const sg_comm *shard) {
  sg_status st = SG_OK;
  const int node0 = rank / PER_NODE == 0;
  uint64_t from = 0;
  for (int step = 0; step < STEPS; step++) {
    const int slow = g_stall && step == SLOW_STEP, next = g_stall && step == SLOW_STEP + 1;
    if (!st) st = grads(e, ids, src, step);
    if (slow && !node0) pthread_barrier_wait(&g_bar); /* held back: node 0's sum waits */
    if (next && node0) {
      g_issued[rank] = st ? -1 : wait_issued(shard, from);
      pthread_barrier_wait(&g_bar);
    }
    if (!st) st = sg_step(e, NULL);
    if (slow && node0) from = issued(shard);
  }
  return st;
}

static void *rank_main(void *arg) {
  const int rank = (int)(intptr_t)arg;
  sg_comm *c = NULL, *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  int ids[NPARAM];
  float *src = NULL;
  sg_status st = g_nccl ? sg_comm_create_nccl(rank, W, g_id, 0, &c) : SG_OK;
  if (!st) st = sg_comm_split_nodes(g_nccl ? c : g_world[rank], PER_NODE, &shard, &rep);
  if (!st) st = setup(shard, rep, &e, ids);
  /* the gradients in (mock) device memory, one buffer per step: sg_grad_add's kernel reads them
   * when the compute stream gets there */
  const size_t n = (size_t)STEPS * NPARAM * NUMEL;
  if (!st && cudaMalloc((void **)&src, n * 4) != cudaSuccess) st = SG_ERR_OUT_OF_MEMORY;
  if (!st) sg_test_fill_grads(src, rank, STEPS, 1, NPARAM, NUMEL);
  if (g_nccl && !st) st = train_nccl(rank, e, ids, src);
  if (!g_nccl && (!st || g_stall)) st = train_threads(rank, e, ids, src, shard);
  for (int p = 0; p < NPARAM && !st; p++)
    st = sg_get_param(e, ids[p], g_params[g_nccl][g_stall][rank] + (size_t)p * NUMEL, SG_F32);
  CHECK(st == SG_OK, "%s rank %d, %s sum: %d steps (%s%s%s)", g_nccl ? "nccl" : "threads", rank,
        g_stall ? "a held" : "no held", STEPS, sg_status_string(st), st ? ": " : "",
        st ? sg_last_error() : "");
  sg_engine_destroy(e);
  if (src) cudaFree(src);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  sg_comm_destroy(c);
  return NULL;
}

static void run(int nccl, int stall) {
  pthread_t th[W];
  g_nccl = nccl;
  g_stall = stall;
  g_rs_done = -1;
  if (nccl && sg_nccl_unique_id(g_id) != SG_OK) {
    CHECK(0, "sg_nccl_unique_id");
    return;
  }
  if (!nccl && !CHECK(sg_comm_create_local(W, g_world) == SG_OK, "local world of %d", W)) return;
  pthread_barrier_init(&g_bar, NULL, W);
  for (int r = 0; r < W; r++) pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r);
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&g_bar);
  for (int r = 0; r < W && !nccl; r++) sg_comm_destroy(g_world[r]);
}

static void same_bits(int nccl) {
  for (int r = 0; r < W; r++)
    CHECK(memcmp(g_params[nccl][1][r], g_params[nccl][0][r], sizeof g_params[0][0][r]) == 0,
          "%s rank %d: the parameters after the held sum == without it", nccl ? "nccl" : "threads",
          r);
}

int main(void) {
  run(1, 0);
  run(1, 1);
  /* every node's ranks: one reduce-scatter per bucket, over PER_NODE ranks */
  CHECK(g_rs_done == (long long)NODES * NPARAM,
        "nccl: with a group's sum across the nodes stalled, the next step's reduce-scatters "
        "completed on every node: %lld of %d", g_rs_done, NODES * NPARAM);
  same_bits(1);
  run(0, 0);
  run(0, 1);
  for (int r = 0; r < PER_NODE; r++)
    CHECK(g_issued[r] >= NPARAM,
          "threads rank %d: with its group's sum waiting for the other nodes, the next step's "
          "reduce-scatters were issued: %lld of %d", r, g_issued[r], NPARAM);
  same_bits(0);
  sg_cudamock_drain();
  return sg_test_summary("");
}
