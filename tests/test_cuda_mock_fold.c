/* Optimizer offload with gradient accumulation (issue 28, defect 7), on the mock CUDA runtime and
 * the mock NCCL: two ranks (threads), SG_SHARD_GRAD_OP with offload_optimizer, f32, one
 * parameter per bucket, as many staging buckets (and so landing buffers) as buckets, two
 * micro-batches per step. A step's first micro-batch goes D2H straight into the host
 * accumulator; the second one's slices land in pinned buffers and are added on the host (the
 * fold). In the measured step every device-to-host copy is slow: the mock stalls each stream at
 * its first copy-out (sg_cudamock_stall_d2h) from the first micro-batch on. The second
 * micro-batch's sg_grad_add calls must still return, without error: before, each bucket's
 * arrival waited on the caller's thread for the first micro-batch's copy (until the engine's
 * deadline, TIMEOUT_MS here, then SG_ERR_TIMEOUT) and folded there. In every step the calling
 * thread's host syncs inside sg_grad_add are counted (sg_cudamock_thread_calls): none, since
 * the folds and their waits run on the offload state's fold worker. And the copies go out on a
 * stream of their own (defect 2's other half): with them stalled, every reduce-scatter of the
 * first micro-batch still completes (before, they sat on the comm stream behind the first
 * stalled copy: none did); the second micro-batch's then wait on the device for the copies of
 * the staging slots they reuse. Released, the step ends as the same run without the stall
 * does, bit for bit, on both ranks. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h> /* the mock's: sg_cudamock_stall_d2h, _thread_calls, cudaMalloc */
#include <nccl.h>         /* the mock's: sg_ncclmock_done */

#include "shardgrad.h"
#include "sg_test_params.h" /* sg_test_ramp_params, sg_test_fill_grads */
#include "sg_test_check.h" /* CHECK, sg_test_summary */

#define W 2
#define NPARAM 4 /* = buckets = staging buckets = landing buffers */
#define NUMEL 512
#define STEPS 3
#define MB 2
#define SLOW_STEP 1
#define TIMEOUT_MS 5000

static pthread_barrier_t g_bar;
static unsigned char g_id[128];
static int g_stall;                 /* this run stalls the copy-outs in SLOW_STEP */
static sg_status g_slow_st[W];      /* the first failure of the slow micro-batches' grad_adds */
static long long g_syncs[2][W];     /* [stalled run][rank]: host syncs inside sg_grad_add */
static float g_params[2][W][NPARAM * NUMEL];
static long long g_rs_done = -1;    /* reduce-scatters completed while the copy-outs stalled */

static sg_status setup(sg_comm *c, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.device = SG_DEVICE_CUDA;
  cfg.offload_optimizer = 1;
  cfg.bucket_bytes = NUMEL * 4; /* one parameter per bucket */
  cfg.staging_buckets = NPARAM;
  cfg.lr = 0.01f;
  cfg.timeout_ms = TIMEOUT_MS;
  if ((st = sg_engine_create(c, &cfg, e))) return st;
  return sg_test_ramp_params(*e, NPARAM, NUMEL, 0, ids);
}

/* One micro-batch's gradients, the caller's host syncs inside the calls added to *syncs. */
static sg_status microbatch(sg_engine *e, const int *ids, const float *src, long long *syncs) {
  sg_status st = SG_OK;
  for (int p = NPARAM - 1; p >= 0 && !st; p--) { /* reverse order: buckets in plan order */
    const long long before = sg_cudamock_thread_calls("host_sync");
    st = sg_grad_add(e, ids[p], src + (size_t)p * NUMEL, SG_F32);
    *syncs += sg_cudamock_thread_calls("host_sync") - before;
  }
  return st;
}

static sg_status train(int rank, sg_engine *e, const int *ids, const float *src) {
  sg_status st = SG_OK;
  for (int step = 0; step < STEPS && !st; step++) {
    const int slow = g_stall && step == SLOW_STEP;
    long long before = 0;
    if (slow) {
      pthread_barrier_wait(&g_bar);
      if (rank == 0) {
        sg_cudamock_drain();
        before = sg_ncclmock_done(W);
        sg_cudamock_stall_d2h(1);
      }
      pthread_barrier_wait(&g_bar);
    }
    for (int mb = 0; mb < MB && !st; mb++)
      st = microbatch(e, ids, src + ((size_t)step * MB + (size_t)mb) * NPARAM * NUMEL,
                      &g_syncs[g_stall][rank]);
    if (slow) {
      g_slow_st[rank] = st;
      pthread_barrier_wait(&g_bar);
      if (rank == 0) {
        sg_cudamock_drain(); /* everything that can run has run */
        g_rs_done = sg_ncclmock_done(W) - before;
        sg_cudamock_stall_d2h(0); /* the copies go on */
      }
      pthread_barrier_wait(&g_bar);
    }
    if (!st) st = sg_step(e, NULL);
  }
  return st;
}

static void *rank_main(void *arg) {
  const int rank = (int)(intptr_t)arg;
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[NPARAM];
  float *src = NULL;
  sg_status st = sg_comm_create_nccl(rank, W, g_id, 0, &c);
  if (!st) st = setup(c, &e, ids);
  /* the gradients in (mock) device memory, one buffer per micro-batch: sg_grad_add's kernel
   * reads them when the compute stream gets there */
  const size_t n = (size_t)STEPS * MB * NPARAM * NUMEL;
  if (!st && cudaMalloc((void **)&src, n * 4) != cudaSuccess) st = SG_ERR_OUT_OF_MEMORY;
  if (!st) sg_test_fill_grads(src, rank, STEPS, MB, NPARAM, NUMEL);
  if (!st) {
    st = train(rank, e, ids, src);
  } else if (g_stall) { /* keep the barriers of the others */
    g_slow_st[rank] = st;
    for (int k = 0; k < 4; k++) pthread_barrier_wait(&g_bar);
  }
  for (int p = 0; p < NPARAM && !st; p++)
    st = sg_get_param(e, ids[p], g_params[g_stall][rank] + (size_t)p * NUMEL, SG_F32);
  CHECK(st == SG_OK, "rank %d, %s copy-out: %d steps of %d micro-batches (%s%s%s)", rank,
        g_stall ? "a slow" : "no slow", STEPS, MB, sg_status_string(st), st ? ": " : "",
        st ? sg_last_error() : "");
  sg_engine_destroy(e);
  if (src) cudaFree(src);
  sg_comm_destroy(c);
  return NULL;
}

static void run(int stall) {
  pthread_t th[W];
  g_stall = stall;
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
  printf("reduce-scatters completed while the copy-outs stalled: %lld of %d\n", g_rs_done,
         MB * NPARAM);
  CHECK(g_rs_done == NPARAM,
        "with every copy-out stalled, the first micro-batch's %d reduce-scatters completed: %lld",
        NPARAM, g_rs_done);
  for (int r = 0; r < W; r++) {
    printf("rank %d: host syncs inside sg_grad_add over %d steps x %d micro-batches: %lld "
           "(copy-out stalled in step %d: %lld)\n", r, STEPS, MB, g_syncs[0][r], SLOW_STEP,
           g_syncs[1][r]);
    CHECK(g_slow_st[r] == SG_OK,
          "rank %d: with every copy-out stalled, both micro-batches' sg_grad_add returned: %s",
          r, sg_status_string(g_slow_st[r]));
    CHECK(g_syncs[0][r] == 0 && g_syncs[1][r] == 0,
          "rank %d: no host sync on the caller's thread inside sg_grad_add (%lld, %lld)", r,
          g_syncs[0][r], g_syncs[1][r]);
    CHECK(memcmp(g_params[1][r], g_params[0][r], sizeof g_params[0][r]) == 0 &&
              memcmp(g_params[1][r], g_params[1][0], sizeof g_params[0][r]) == 0,
          "rank %d: the parameters after the slow copy-out == without it == rank 0's", r);
  }
  sg_cudamock_drain();
  return sg_test_summary("");
}
