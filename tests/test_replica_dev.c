/* Outer steps (cfg.outer_every, DiLoCo) and replica codecs (cfg.replica_codec) of hybrid
 * engines on the CUDA device against the same hybrid engines on the CPU device, bit for bit:
 * 2 replicas x 2 shard ranks as threads, their shard and replica communicators split from a
 * world of threads (local) or of NCCL ranks (nccl); in CI the mock CUDA runtime and mock NCCL (tests/cudamock), on a GPU machine the real
 * ones. The CPU engine's modes are checked against independent references by test_replica_outer
 * and test_replica_codec; here the CUDA engine must give the CPU engine's bits:
 *  - every rank's parameters after every step, and its master, AdamW moments at the end;
 *  - after every outer step every rank holds the same parameters;
 *  - fp32 and bf16 wires, bf16 parameters with clipping, f16 with dynamic loss scaling and a
 *    non-finite gradient on one node (that node skips its inner step), and a sg_save / sg_load
 *    in the middle of a period and before the first step (the outer state through the host);
 *  - int8 and 4-bit codes, outer steps with int8 codes, and a save / load of the residuals;
 *  - streaming outer steps (one group of buckets per step, its sum overlapped with the next
 *    step: on NCCL's replica lane, or on the device's twin for threads and MPI) with f32 and
 *    bf16 wires, int8 codes, a non-finite skip on one node and a save / load mid-period
 *    (the sum in flight merged by the save, dropped by the load), every step's bits;
 *  - the same modes, streaming too, with offload_optimizer on the CUDA engine (its state and
 *    element work on the host), against the CPU engine without it: non-finite skips, saves and
 *    loads, also through engines of 4 replicas x 1 rank (a load and a save at another size),
 *    8-bit optimizer state (on both devices);
 *    nccl: both NCCL (host memory staged by NCCL), streaming: NCCL inside, threads across;
 *  - the combinations not done on CUDA fail at create with SG_ERR_UNSUPPORTED and a message
 *    naming the setting: streaming with an offloaded optimizer and NCCL across.
 * Usage: test_replica_dev --cuda local|nccl   (both communicators of that kind)
 *        test_replica_dev --cuda mixed   (NCCL inside with threads across, and the reverse)
 *        test_replica_dev --mpi --cuda local   (under mpirun -np 4: both communicators split from
 *                      MPI, each process one rank, its CPU engine first, then its CUDA engine;
 *                      the cases without a save and load, compared rank by rank: the codecs'
 *                      all-to-all through MPI's pinned staging) */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t, mkdtemp */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sg_engine_internal.h" /* e->dev: gradients through the device's copy */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_state.h" /* sg_test_mix, the engine's state read back */
#include "../kernels/sg_elem.h" /* sg_elem_store: gradients in the slots' dtype */

static const size_t k_sizes[] = {700, 4097, 65, 1000};
#define NP ((int)(sizeof k_sizes / sizeof k_sizes[0]))
#define TOTAL (700 + 4097 + 65 + 1000)
#define N 2 /* replicas */
#define L 2 /* shard ranks per replica */
#define W (N * L)
#define MAXS 8

enum { OFFLOAD = 1, THROUGH_4X1 = 2, Q8 = 4 }; /* tcase.offload */

typedef struct {
  const char *name;
  sg_dtype pdt, wire;
  int h, stream, steps;
  float clip;
  int inject; /* +inf in one gradient of rank W - 1 at step 1 (f16: dynamic loss scale) */
  int reload; /* >= 0: sg_save before this step, then sg_load of it into the same engines */
  sg_codec codec;
  int offload; /* OFFLOAD: the CUDA engine with offload_optimizer (the CPU engine: without);
                  | THROUGH_4X1: the checkpoint goes through engines of 4 replicas x 1 rank (both
                  devices) that load it and save it again, before the 2 x 2 engines load that;
                  | Q8: 8-bit optimizer state (both devices) */
} tcase;

typedef struct {
  float step_param[MAXS][TOTAL];
  float *param[NP], *master[NP], *m[NP], *v[NP];
  int skipped[MAXS];
  int ok;
  char err[400];
} result;

typedef struct {
  const tcase *tc;
  int cuda, nccl; /* NCCL (on CUDA only) for: 1 the shard, 2 the replica communicator */
  sg_comm *world; /* local runs: this rank's world of threads */
  const unsigned char *nccl_id;
  pthread_barrier_t *bar;
  const char *dir;
  int rank;
  result *res;
} run_arg;

static float grad_val(int rank, int step, int p, size_t i) {
  const uint64_t h = sg_test_mix(((uint64_t)rank << 56) ^ ((uint64_t)step << 48) ^
                                 ((uint64_t)p << 32) ^ i);
  return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0) * 0.1f;
}

static void fill_config(const run_arg *a, sg_config *cfg) {
  const tcase *tc = a->tc;
  sg_config_init(cfg, sizeof *cfg);
  cfg->device = a->cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg->param_dtype = cfg->grad_dtype = cfg->reduce_dtype = tc->pdt;
  cfg->bucket_bytes = tc->stream ? 2048 : 8192; /* streaming: several groups of buckets */
  cfg->lr = 0.01f;
  cfg->timeout_ms = 60000;
  cfg->max_grad_norm = tc->clip;
  cfg->loss_scale = tc->pdt == SG_F16 ? 0.0f : 1.0f; /* f16: dynamic */
  cfg->init_loss_scale = 8.0f;
  cfg->replica_reduce_dtype = tc->wire;
  cfg->replica_codec = tc->codec;
  if (tc->codec) cfg->accum_dtype = SG_F32; /* the codecs' */
  cfg->outer_every = tc->h;
  cfg->outer_lr = 0.7;
  cfg->outer_momentum = 0.9;
  cfg->outer_streaming = tc->stream;
  cfg->offload_optimizer = a->cuda && (tc->offload & OFFLOAD);
  if (tc->offload & Q8) {
    cfg->optim_state_dtype = SG_Q8;
    cfg->optim_state_min_numel = 0;
  }
}

/* This rank's shard and replica communicators (from the NCCL world where a->nccl). */
static sg_status split(const run_arg *a, int nccl_shard, int nccl_rep, sg_comm **shard,
                       sg_comm **rep) {
  sg_comm *nw = NULL; /* the NCCL world: its splits outlive it */
  sg_status st = SG_OK;
  if (nccl_shard || nccl_rep) st = sg_comm_create_nccl(a->rank, W, a->nccl_id, 0, &nw);
  if (!st) st = sg_comm_split(nccl_shard ? nw : a->world, a->rank / L, a->rank, shard);
  if (!st) st = sg_comm_split(nccl_rep ? nw : a->world, a->rank % L, a->rank, rep);
  sg_comm_destroy(nw);
  return st;
}

static sg_status setup(sg_engine *e, int *ids) {
  sg_status st = SG_OK;
  for (int p = 0; p < NP && !st; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, k_sizes[p], p == 2 ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st) st = sg_finalize(e);
  float buf[4097];
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = (float)sin(0.3 * (double)i + p) * 0.5f;
    st = sg_set_param(e, ids[p], buf, SG_F32);
  }
  return st;
}

/* n values into parameter id's gradient slot (dtype) through the device's copy (on CUDA the slot
 * is device memory), then sg_grad_ready. */
static sg_status put_grad(sg_engine *e, int id, sg_dtype dtype, const float *v, size_t n) {
  static _Thread_local float h[4097];
  void *g = NULL;
  sg_status st = sg_grad_ptr(e, id, &g);
  for (size_t i = 0; i < n; i++) sg_elem_store(h, dtype, i, v[i]);
  if (!st)
    st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, g, h, n * (dtype == SG_F32 ? 4u : 2u),
                           SG_COPY_H2D);
  return st ? st : sg_grad_ready(e, id);
}

static sg_status one_step(const run_arg *a, sg_engine *e, const int *ids, int s) {
  sg_status st = SG_OK;
  float buf[4097];
  for (int p = NP - 1; p >= 0 && !st; p--) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = grad_val(a->rank, s, p, i);
    if (a->tc->inject && a->rank == W - 1 && s == 1 && p == 0) buf[0] = INFINITY;
    st = put_grad(e, ids[p], a->tc->pdt, buf, k_sizes[p]);
  }
  if (!st) st = sg_backward_end(e);
  sg_step_info info = {.struct_size = sizeof info};
  if (!st) st = sg_step(e, &info);
  if (!st) a->res->skipped[s] = info.skipped;
  for (int p = 0, off = 0; p < NP && !st; off += (int)k_sizes[p], p++)
    st = sg_get_param(e, ids[p], a->res->step_param[s] + off, SG_F32);
  return st;
}

/* The checkpoint in a->dir loaded by an engine of this rank in 4 replicas x 1 rank (the same
 * device and config) and saved again into dir/n4; returns that directory in out. */
static sg_status through_other_size(const run_arg *a, char *out, size_t cap) {
  sg_comm *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  int ids[NP];
  sg_config cfg;
  fill_config(a, &cfg);
  snprintf(out, cap, "%s/n4", a->dir);
  sg_status st = sg_comm_split(a->world, a->rank, 0, &shard);
  if (!st) st = sg_comm_split(a->world, 0, a->rank, &rep);
  if (!st) st = sg_engine_create_hybrid(shard, rep, &cfg, &e);
  if (!st) st = setup(e, ids);
  if (!st) st = sg_load(e, a->dir);
  if (!st) st = sg_save(e, out);
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  return st;
}

static sg_status train(run_arg *a, sg_engine *e, const int *ids) {
  sg_status st = SG_OK;
  for (int s = 0; s < a->tc->steps && !st; s++) {
    if (s == a->tc->reload) {
      char other[96];
      const char *dir = a->dir;
      st = sg_save(e, a->dir);
      pthread_barrier_wait(a->bar); /* every rank file written before any load */
      if (!st && (a->tc->offload & THROUGH_4X1)) {
        st = through_other_size(a, other, sizeof other);
        dir = other;
        pthread_barrier_wait(a->bar);
      }
      if (!st) st = sg_load(e, dir);
    }
    if (!st) st = one_step(a, e, ids, s);
  }
  return st;
}

/* With offload the modes' state is pinned host memory and their element work on the host (a
 * device of their own), and sg_memory's host bytes, which count it, are sg_estimate_memory's. */
static sg_status check_offload(sg_engine *e, const sg_config *cfg) {
  if (!cfg->offload_optimizer) return SG_OK;
  sg_memory_stats got = {.struct_size = sizeof got}, est = {.struct_size = sizeof est};
  sg_config c = *cfg;
  c.shard_ranks = L;
  sg_status st = sg_memory(e, &got);
  if (!st) st = sg_estimate_memory(&c, k_sizes, NP, W, &est);
  if (st) return st;
  if (e->rep.elem_dev == e->dev || e->lay.replica_host_bytes == 0 ||
      got.host_bytes != est.host_bytes || got.comm_bytes != est.comm_bytes) {
    fprintf(stderr, "transport %s, replica host bytes %zu, host bytes %zu (estimated %zu)\n",
            e->rep.ops->name, e->lay.replica_host_bytes, got.host_bytes, est.host_bytes);
    return SG_ERR_INTERNAL;
  }
  return SG_OK;
}

static void *run_thread(void *arg) {
  run_arg *a = arg;
  sg_comm *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  int ids[NP];
  sg_config cfg;
  fill_config(a, &cfg);
  /* streaming with offload: its sums run on a host queue (threads across an NCCL shard) */
  const int nccl_rep = (a->nccl & 2) && !(a->tc->offload && a->tc->stream);
  sg_status st = split(a, a->nccl & 1, nccl_rep, &shard, &rep);
  if (!st) st = sg_engine_create_hybrid(shard, rep, &cfg, &e);
  if (!st) st = setup(e, ids);
  if (!st) st = check_offload(e, &cfg);
  if (!st) st = train(a, e, ids);
  if (!st) st = sg_test_read_state(e, ids, k_sizes, NP, SG_TEST_STATE_OF(a->res));
  a->res->ok = st == SG_OK;
  if (st)
    snprintf(a->res->err, sizeof a->res->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  return NULL;
}

/* One run of the case on the device (cuda 0/1), every rank's result in res[W]. */
static void run_on(const tcase *tc, int cuda, int nccl, result *res) {
  sg_comm *world[W] = {NULL};
  unsigned char id[128];
  char dir[64] = "/tmp/sg_replica_dev_XXXXXX";
  if (!CHECK(sg_comm_create_local(W, world) == SG_OK, "local world of %d", W)) return;
  if (nccl && !CHECK(sg_nccl_unique_id(id) == SG_OK, "NCCL id: %s", sg_last_error())) return;
  if (tc->reload >= 0 && !CHECK(mkdtemp(dir) != NULL, "temp dir")) return;
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, W);
  run_arg a[W];
  pthread_t th[W];
  for (int r = 0; r < W; r++) {
    a[r] = (run_arg){tc, cuda, cuda ? nccl : 0, world[r], id, &bar, dir, r, &res[r]};
    pthread_create(&th[r], NULL, run_thread, &a[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    CHECK(res[r].ok, "[%s] %s rank %d ran (%s)", tc->name, cuda ? "cuda" : "cpu", r, res[r].err);
    sg_comm_destroy(world[r]);
  }
  pthread_barrier_destroy(&bar);
  if (tc->reload >= 0) {
    char cmd[96];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  }
}

static void compare(const tcase *tc, const result *got, const result *ref, int r) {
  if (!got->ok || !ref->ok) return;
  for (int s = 0; s < tc->steps; s++) {
    const size_t i = sg_test_first_diff(got->step_param[s], ref->step_param[s], TOTAL);
    CHECK(i == TOTAL && got->skipped[s] == ref->skipped[s],
          "[%s] rank %d step %d: cuda's parameters are the cpu's (first difference at %zu), "
          "skipped %d/%d", tc->name, r, s, i, got->skipped[s], ref->skipped[s]);
  }
  const char *names[4] = {"param", "master", "m", "v"};
  for (int p = 0; p < NP; p++) {
    float *const g4[4] = {got->param[p], got->master[p], got->m[p], got->v[p]};
    float *const r4[4] = {ref->param[p], ref->master[p], ref->m[p], ref->v[p]};
    for (int k = 0; k < 4; k++)
      CHECK(sg_test_first_diff(g4[k], r4[k], k_sizes[p]) == k_sizes[p],
            "[%s] rank %d: %s of param %d bitwise at the end", tc->name, r, names[k], p);
  }
}

/* After every outer step (not streaming; codes alone: every step) every rank holds the same
 * parameters. */
static void check_agree(const tcase *tc, const result *res) {
  const int every = tc->h > 0 ? tc->h : 1;
  for (int s = every - 1; !tc->stream && res[0].ok && s < tc->steps; s += every) {
    int same = 1;
    for (int r = 1; r < W; r++)
      same &= res[r].ok && memcmp(res[r].step_param[s], res[0].step_param[s],
                                  sizeof res[0].step_param[s]) == 0;
    CHECK(same, "[%s] step %d (a synchronising step): every rank holds the same parameters",
          tc->name, s);
  }
}

static void run_case(const tcase *tc, int nccl) {
  static result cpu[W], gpu[W];
  memset(cpu, 0, sizeof cpu);
  memset(gpu, 0, sizeof gpu);
  const int before = sg_test_failures();
  run_on(tc, 0, 0, cpu);
  run_on(tc, 1, nccl, gpu);
  for (int r = 0; r < W; r++) compare(tc, &gpu[r], &cpu[r], r);
  check_agree(tc, gpu);
  if (tc->inject && gpu[0].ok && tc->h > 0)
    CHECK(gpu[W - 1].skipped[1] && !gpu[0].skipped[1],
          "[%s] the node with the non-finite gradient skips its inner step, the other does not",
          tc->name);
  if (tc->inject && gpu[0].ok && tc->h == 0) /* codes: the sum is every replica's */
    CHECK(gpu[W - 1].skipped[1] && gpu[0].skipped[1], "[%s] every replica skips the step",
          tc->name);
  for (int r = 0; r < W; r++) {
    sg_test_free_state(NP, SG_TEST_STATE_OF(&cpu[r]));
    sg_test_free_state(NP, SG_TEST_STATE_OF(&gpu[r]));
  }
  static const char *const pairs[] = {"threads", "NCCL inside, threads across",
                                      "threads inside, NCCL across", "nccl"};
  const int pair = tc->offload && tc->stream && nccl == 3 ? 1 : nccl;
  printf("%s  %s (%s)\n", sg_test_failures() == before ? "ok  " : "FAIL", tc->name, pairs[pair]);
  fflush(stdout);
}

static const tcase k_cases[] = {
    {"f32, f32 wire, H=2", SG_F32, SG_F32, 2, 0, 6, 0.0f, 0, -1, SG_CODEC_NONE, 0},
    {"bf16 params, bf16 wire, clip, H=3", SG_BF16, SG_BF16, 3, 0, 6, 1.0f, 0, -1,
     SG_CODEC_NONE, 0},
    {"f16 dynamic scale, inf on one node, H=2", SG_F16, SG_F32, 2, 0, 4, 0.0f, 1, -1,
     SG_CODEC_NONE, 0},
    {"save and load mid-period, H=3", SG_F32, SG_F32, 3, 0, 6, 0.0f, 0, 4, SG_CODEC_NONE, 0},
    {"save before the first step, H=2", SG_BF16, SG_F32, 2, 0, 4, 0.0f, 0, 0, SG_CODEC_NONE, 0},
    {"int8 codes", SG_F32, SG_F32, 0, 0, 4, 0.0f, 0, -1, SG_CODEC_INT8, 0},
    {"4-bit codes, bf16 params, clip", SG_BF16, SG_F32, 0, 0, 4, 1.0f, 0, -1, SG_CODEC_INT4, 0},
    {"int8 codes, save and load", SG_F32, SG_F32, 0, 0, 4, 0.0f, 0, 2, SG_CODEC_INT8, 0},
    {"outer steps with int8 codes, H=2", SG_F32, SG_F32, 2, 0, 6, 0.0f, 0, -1, SG_CODEC_INT8, 0},
    {"outer steps with int8 codes, save and load, H=3", SG_BF16, SG_F32, 3, 0, 6, 0.0f, 0, 4,
     SG_CODEC_INT8, 0},
    /* offload_optimizer on the CUDA engine (streaming: not with NCCL across) */
    {"offload: f32, f32 wire, H=2", SG_F32, SG_F32, 2, 0, 6, 0.0f, 0, -1, SG_CODEC_NONE, OFFLOAD},
    {"offload: bf16 params, bf16 wire, clip, H=3", SG_BF16, SG_BF16, 3, 0, 6, 1.0f, 0, -1,
     SG_CODEC_NONE, OFFLOAD},
    {"offload: f16 dynamic scale, inf on one node, H=2", SG_F16, SG_F32, 2, 0, 4, 0.0f, 1, -1,
     SG_CODEC_NONE, OFFLOAD},
    {"offload: save, 4 x 1, load mid-period, H=3", SG_F32, SG_F32, 3, 0, 6, 0.0f, 0, 4,
     SG_CODEC_NONE, OFFLOAD | THROUGH_4X1},
    {"offload: save before the first step, bf16 params, H=2", SG_BF16, SG_F32, 2, 0, 4, 0.0f, 0,
     0, SG_CODEC_NONE, OFFLOAD},
    {"offload: int8 codes, inf on one node", SG_F32, SG_F32, 0, 0, 4, 0.0f, 1, -1, SG_CODEC_INT8,
     OFFLOAD},
    {"offload: 4-bit codes, bf16 params, clip", SG_BF16, SG_F32, 0, 0, 4, 1.0f, 0, -1,
     SG_CODEC_INT4, OFFLOAD},
    {"offload: int8 codes, save, 4 x 1, load", SG_F32, SG_F32, 0, 0, 4, 0.0f, 0, 2, SG_CODEC_INT8,
     OFFLOAD | THROUGH_4X1},
    {"offload: outer steps with int8 codes, H=2", SG_F32, SG_F32, 2, 0, 6, 0.0f, 0, -1,
     SG_CODEC_INT8, OFFLOAD},
    {"offload: outer steps with int8 codes, save, 4 x 1, load, H=3", SG_BF16, SG_F32, 3, 0, 6,
     0.0f, 0, 4, SG_CODEC_INT8, OFFLOAD | THROUGH_4X1},
    {"offload: streaming, f32, H=2", SG_F32, SG_F32, 2, 1, 6, 0.0f, 0, -1, SG_CODEC_NONE, OFFLOAD},
    {"offload: streaming, bf16 params, bf16 wire, save, 4 x 1, load, H=3", SG_BF16, SG_BF16, 3,
     1, 7, 0.0f, 0, 4, SG_CODEC_NONE, OFFLOAD | THROUGH_4X1},
    {"offload: streaming with int8 codes, f16, inf on one node, H=2", SG_F16, SG_F32, 2, 1, 5,
     0.0f, 1, -1, SG_CODEC_INT8, OFFLOAD},
    {"offload, 8-bit state: int8 codes", SG_F32, SG_F32, 0, 0, 4, 0.0f, 0, -1, SG_CODEC_INT8,
     OFFLOAD | Q8},
    {"offload, 8-bit state: outer steps, bf16 params, H=2", SG_BF16, SG_F32, 2, 0, 5, 0.0f, 0,
     -1, SG_CODEC_NONE, OFFLOAD | Q8},
    {"streaming, f32 wire, H=2", SG_F32, SG_F32, 2, 1, 6, 0.0f, 0, -1, SG_CODEC_NONE, 0},
    {"streaming, bf16 params, bf16 wire, clip, H=3", SG_BF16, SG_BF16, 3, 1, 7, 1.0f, 0, -1,
     SG_CODEC_NONE, 0},
    {"streaming, f16 dynamic scale, inf on one node, H=2", SG_F16, SG_F32, 2, 1, 5, 0.0f, 1, -1,
     SG_CODEC_NONE, 0},
    {"streaming, save and load mid-period, H=3", SG_F32, SG_F32, 3, 1, 7, 0.0f, 0, 4,
     SG_CODEC_NONE, 0},
    {"streaming with int8 codes, H=2", SG_F32, SG_F32, 2, 1, 6, 0.0f, 0, -1, SG_CODEC_INT8, 0},
    {"streaming with int8 codes, save and load, H=3", SG_BF16, SG_F32, 3, 1, 7, 0.0f, 0, 5,
     SG_CODEC_INT8, 0},
};
#define NCASES ((int)(sizeof k_cases / sizeof k_cases[0]))

/* ---- what CUDA refuses at create ----------------------------------------------------------- */

typedef struct {
  run_arg a;
  int nccl_shard, nccl_rep, offload;
  sg_codec codec;
  int outer, stream;
  sg_status st;
  char msg[400];
} refuse_arg;

static void *refuse_thread(void *arg) {
  refuse_arg *ra = arg;
  sg_comm *shard = NULL, *rep = NULL;
  sg_engine *e = NULL;
  sg_config cfg;
  fill_config(&ra->a, &cfg);
  cfg.outer_every = ra->outer;
  cfg.outer_streaming = ra->stream;
  cfg.replica_codec = ra->codec;
  cfg.offload_optimizer = ra->offload;
  ra->st = split(&ra->a, ra->nccl_shard, ra->nccl_rep, &shard, &rep);
  if (!ra->st) ra->st = sg_engine_create_hybrid(shard, rep, &cfg, &e);
  snprintf(ra->msg, sizeof ra->msg, "%s", sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  return NULL;
}

static void refuse(const char *what, int nccl_shard, int nccl_rep, int offload, sg_codec codec,
                   int outer, int stream, const char *needle) {
  static const tcase tc = {"refused", SG_F32, SG_F32, 2, 0, 1, 0.0f, 0, -1, SG_CODEC_NONE, 0};
  sg_comm *world[W] = {NULL};
  unsigned char id[128];
  if (!CHECK(sg_comm_create_local(W, world) == SG_OK, "local world")) return;
  if ((nccl_shard || nccl_rep) && !CHECK(sg_nccl_unique_id(id) == SG_OK, "NCCL id")) return;
  refuse_arg ra[W];
  pthread_t th[W];
  for (int r = 0; r < W; r++) {
    memset(&ra[r], 0, sizeof ra[r]);
    ra[r].a = (run_arg){&tc, 1, 0, world[r], id, NULL, NULL, r, NULL};
    ra[r].nccl_shard = nccl_shard, ra[r].nccl_rep = nccl_rep, ra[r].offload = offload;
    ra[r].codec = codec, ra[r].outer = outer, ra[r].stream = stream;
    pthread_create(&th[r], NULL, refuse_thread, &ra[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < W; r++) {
    CHECK(ra[r].st == SG_ERR_UNSUPPORTED && strstr(ra[r].msg, needle),
          "%s: refused at create on rank %d (%s: %s)", what, r, sg_status_string(ra[r].st),
          ra[r].msg);
    sg_comm_destroy(world[r]);
  }
}

/* --mpi: this process's rank of every case without a save and load,
 * on the CPU device and then on the CUDA device, over communicators split from MPI. */
static int run_mpi(void) {
  sg_comm *world = NULL;
  if (!CHECK(sg_comm_create_mpi(NULL, &world) == SG_OK, "MPI communicator: %s", sg_last_error()))
    return sg_test_summary("test_replica_dev (mpi): ");
  const int rank = sg_comm_rank(world);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[rank %d]", rank);
  if (CHECK(sg_comm_size(world) == W, "run under mpirun -np %d (got %d ranks)", W,
            sg_comm_size(world))) {
    for (int c = 0; c < NCASES; c++) {
      const tcase *tc = &k_cases[c];
      if (tc->reload >= 0) continue;
      static result cpu, gpu;
      memset(&cpu, 0, sizeof cpu);
      memset(&gpu, 0, sizeof gpu);
      run_arg a = {tc, 0, 0, world, NULL, NULL, NULL, rank, &cpu};
      run_thread(&a);
      a.cuda = 1, a.res = &gpu;
      run_thread(&a);
      const int before = sg_test_failures();
      CHECK(cpu.ok && gpu.ok, "[%s] both ran (cpu: %s; cuda: %s)", tc->name, cpu.err, gpu.err);
      compare(tc, &gpu, &cpu, rank);
      sg_test_free_state(NP, SG_TEST_STATE_OF(&cpu));
      sg_test_free_state(NP, SG_TEST_STATE_OF(&gpu));
      if (rank == 0)
        printf("%s  %s (mpi)\n", sg_test_failures() == before ? "ok  " : "FAIL", tc->name);
    }
  }
  sg_comm_destroy(world);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "test_replica_dev (mpi rank %d): ", rank);
  return sg_test_summary(prefix);
}

/* --cuda mixed: NCCL inside the node with threads across (the sums through a pinned stage on a
 * host queue of their own; streaming: on the device's twin), threads inside with NCCL across
 * (unbound; streaming: on the engine's worker): every case but the offloaded ones. */
static int run_mixed(void) {
  for (int pair = 1; pair <= 2; pair++) /* the offloaded cases: --cuda local|nccl, --mpi */
    for (int c = 0; c < NCASES; c++)
      if (!k_cases[c].offload) run_case(&k_cases[c], pair);
  return sg_test_summary("test_replica_dev (mixed): ");
}

int main(int argc, char **argv) {
  int nccl = -1, mpi = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--mpi")) mpi = 1;
    if (!strcmp(argv[i], "--cuda") && i + 1 < argc)
      nccl = !strcmp(argv[i + 1], "nccl")    ? 3
             : !strcmp(argv[i + 1], "mixed") ? 4
             : !strcmp(argv[i + 1], "local") ? 0
                                             : -1;
  }
  if (nccl < 0 || (mpi && nccl)) {
    fprintf(stderr, "usage: test_replica_dev [--mpi] --cuda local|nccl|mixed (--mpi: local "
            "only)\n");
    return 2;
  }
  if (!sg_has_backend("cuda") || (mpi && !sg_has_backend("mpi"))) {
    printf("test_replica_dev: built without CUDA or MPI\n");
    return 77;
  }
  if (mpi) return run_mpi();
  if (!sg_has_backend("cuda") || (nccl && !sg_has_backend("nccl"))) {
    printf("test_replica_dev: built without CUDA or NCCL\n");
    return 77;
  }
  if (nccl == 4) return run_mixed();
  for (int c = 0; c < NCASES; c++) run_case(&k_cases[c], nccl);
  if (nccl) /* its sums run on a host queue of their own */
    refuse("streaming outer steps with offload", 1, 1, 1, SG_CODEC_NONE, 2, 1,
           "host replica communicator");
  return sg_test_summary("test_replica_dev: ");
}
