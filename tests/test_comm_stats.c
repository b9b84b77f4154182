/* test_comm_stats: sg_comm_stats counts every collective with the bus-byte formula of the
 * header, on the communicator and summed over its channels (engines), with ranks as threads
 * (W = 1..4) and under mpirun (--mpi).
 *
 * Each rank issues one of each collective on its communicator directly (odd sizes, so the
 * rounding shows) and checks the counters against the formula computed here; then an engine on
 * the same communicator runs one ZeRO-2 step on one parameter, and the communicator's counters
 * must have grown by at least that step's reduce-scatter and all-gather of the padded
 * parameter, with every rank counting the same. Bad arguments: SG_ERR_INVALID_ARGUMENT. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/comm/sg_comm.h" /* ops, to issue collectives directly */
#include "sg_test_check.h"
#include "shardgrad.h"
#ifdef SG_HAVE_MPI
#include <mpi.h>
#endif

enum { N = 1001, NUMEL = 4096 };

static sg_comm_traffic stats(const sg_comm *c) {
  sg_comm_traffic t = {.struct_size = sizeof t};
  CHECK(sg_comm_stats(c, &t) == SG_OK, "sg_comm_stats");
  return t;
}

static void expect(const sg_comm *c, const sg_comm_traffic *before, uint64_t sent, uint64_t recv,
                   uint64_t colls, const char *what) {
  const sg_comm_traffic t = stats(c);
  CHECK(t.bytes_sent - before->bytes_sent == sent &&
            t.bytes_received - before->bytes_received == recv &&
            t.collectives - before->collectives == colls,
        "%s: sent %llu received %llu collectives %llu (want %llu %llu %llu)", what,
        (unsigned long long)(t.bytes_sent - before->bytes_sent),
        (unsigned long long)(t.bytes_received - before->bytes_received),
        (unsigned long long)(t.collectives - before->collectives), (unsigned long long)sent,
        (unsigned long long)recv, (unsigned long long)colls);
}

static void direct_collectives(sg_comm *c) {
  const uint64_t w = (uint64_t)sg_comm_size(c), r = (uint64_t)sg_comm_rank(c);
  float *buf = calloc(w * N, sizeof *buf);
  if (!CHECK(buf != NULL, "buffer")) return;
  const int64_t dl = sg__deadline(60000);
  sg_comm_traffic t0 = stats(c);
  CHECK(c->ops->all_reduce(c, buf, N, SG_F32, dl) == SG_OK, "all_reduce f32");
  expect(c, &t0, 2 * (w - 1) * N * 4 / w, 2 * (w - 1) * N * 4 / w, 1, "all_reduce of 1001 f32");
  t0 = stats(c);
  CHECK(c->ops->reduce_scatter(c, buf, N, SG_BF16, dl) == SG_OK, "reduce_scatter bf16");
  expect(c, &t0, (w - 1) * N * 2, (w - 1) * N * 2, 1, "reduce_scatter of 1001 bf16 per rank");
  if (c->ops->reduce_scatter_fold) { /* the same messages: counted alike */
    float acc[N];
    const sg__fold f = {acc, SG_F32, 1};
    t0 = stats(c);
    CHECK(c->ops->reduce_scatter_fold(c, buf, N, SG_BF16, &f, dl) == SG_OK, "reduce_scatter_fold");
    expect(c, &t0, (w - 1) * N * 2, (w - 1) * N * 2, 1, "reduce_scatter_fold of 1001 bf16 per rank");
  }
  t0 = stats(c);
  CHECK(c->ops->all_gather(c, buf, 333, dl) == SG_OK, "all_gather");
  expect(c, &t0, (w - 1) * 333, (w - 1) * 333, 1, "all_gather of 333 bytes per rank");
  t0 = stats(c);
  CHECK(c->ops->broadcast(c, buf, 777, 0, dl) == SG_OK, "broadcast");
  expect(c, &t0, w > 1 && r == 0 ? 777 : 0, w > 1 && r != 0 ? 777 : 0, 1,
         "broadcast of 777 bytes from rank 0");
  free(buf);
}

/* One ZeRO-2 step of one f32 parameter through an engine (its own channel of c). */
static void engine_step(sg_comm *c) {
  const uint64_t w = (uint64_t)sg_comm_size(c);
  const sg_comm_traffic t0 = stats(c);
  sg_config cfg;
  sg_engine *e = NULL;
  int id = -1;
  float g[NUMEL];
  for (int i = 0; i < NUMEL; i++) g[i] = 0.25f * (float)(i % 7);
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 60000;
  if (st == SG_OK) st = sg_engine_create(c, &cfg, &e);
  if (st == SG_OK) st = sg_add_param(e, "w", NUMEL, 0, &id);
  if (st == SG_OK) st = sg_finalize(e);
  if (st == SG_OK) st = sg_grad_add(e, id, g, SG_F32);
  if (st == SG_OK) st = sg_step(e, NULL);
  CHECK(st == SG_OK, "engine step (%s)", sg_status_string(st));
  sg_engine_destroy(e);
  const sg_comm_traffic t = stats(c);
  /* at least: the reduce-scatter and the all-gather of the gradient/parameter bytes */
  const uint64_t floor_bytes = 2 * (w - 1) * NUMEL * 4 / w;
  CHECK(t.bytes_sent - t0.bytes_sent >= floor_bytes && t.collectives > t0.collectives,
        "an engine's collectives count on its communicator: %llu bytes sent, >= %llu",
        (unsigned long long)(t.bytes_sent - t0.bytes_sent), (unsigned long long)floor_bytes);
}

static void errors(sg_comm *c) {
  sg_comm_traffic t = {.struct_size = sizeof t - 1};
  CHECK(sg_comm_stats(c, &t) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "struct_size") != NULL,
        "wrong struct_size: SG_ERR_INVALID_ARGUMENT");
  t.struct_size = sizeof t;
  CHECK(sg_comm_stats(NULL, &t) == SG_ERR_INVALID_ARGUMENT, "NULL comm");
  CHECK(sg_comm_stats(c, NULL) == SG_ERR_INVALID_ARGUMENT, "NULL out");
}

static void *rank_main(void *p) {
  sg_comm *c = p;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[W=%d rank %d]", sg_comm_size(c), sg_comm_rank(c));
  sg_test_quiet = sg_comm_rank(c) != 0;
  const sg_comm_traffic t = stats(c);
  CHECK(t.bytes_sent == 0 && t.bytes_received == 0 && t.collectives == 0, "a new communicator: zeros");
  direct_collectives(c);
  engine_step(c);
  errors(c);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "--mpi")) {
#ifdef SG_HAVE_MPI
    sg_comm *c = NULL;
    if (CHECK(sg_comm_create_mpi(NULL, &c) == SG_OK, "sg_comm_create_mpi")) rank_main(c);
    sg_comm_destroy(c);
#else
    CHECK(0, "built without MPI");
#endif
    return sg_test_summary("");
  }
  for (int w = 1; w <= 4; w++) {
    sg_comm *comms[4];
    pthread_t th[4];
    if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "sg_comm_create_local(%d)", w)) continue;
    for (int r = 0; r < w; r++) pthread_create(&th[r], NULL, rank_main, comms[r]);
    for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
  }
  return sg_test_summary("");
}
