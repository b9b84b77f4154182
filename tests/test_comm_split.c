/* test_comm_split: sg_comm_split with ranks as threads (local communicators), one rank per
 * process (--mpi, under mpirun), and ranks as threads over the caller's transport (--xport:
 * sg_comm_create_xport over an in-process mailbox; the engine reference stays on threads, whose
 * bits a transport's splits give).
 *
 * For each world size, every rank splits its communicator three ways: by node (blocks of L
 * consecutive ranks, key = rank), by index within a node (key = -rank, so the order reverses)
 * and with one rank left out (color -1). Each rank checks its new rank and size against a
 * reference computed here, then sums its old rank over the new communicator: the sum must be
 * that of exactly the ranks of its color. An engine then trains on the node communicators and
 * must give the bits of an engine on a communicator of the same size made directly. Splitting
 * while an engine is using the communicator works (the split has a channel of its own), and
 * bad arguments fail with SG_ERR_INVALID_ARGUMENT. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/comm/sg_comm.h" /* ops, for a sum over the new communicator */
#include "sg_test_check.h"
#include "sg_test_ranks.h" /* ranks as threads or processes, sg_test_train_small */
#include "shardgrad.h"

enum { NUMEL = SG_TEST_SMALL_NUMEL };

/* Reference: new rank of `rank` among ranks of the same color ordered by (key, rank). */
static int ref_rank(const int *colors, const int *keys, int world, int rank, int *size) {
  int n = 0, below = 0;
  for (int s = 0; s < world; s++)
    if (colors[s] == colors[rank]) {
      n++;
      below += keys[s] < keys[rank] || (keys[s] == keys[rank] && s < rank);
    }
  *size = n;
  return colors[rank] < 0 ? -1 : below;
}

/* Sum of the old ranks over the new communicator, against the reference. */
static void check_members(sg_comm *nc, const int *colors, int world, int rank, const char *what) {
  float v[1] = {(float)rank};
  const sg_status st = nc->ops->all_reduce(nc, v, 1, SG_F32, sg__deadline(60000));
  float want = 0.0f;
  for (int s = 0; s < world; s++)
    if (colors[s] == colors[rank]) want += (float)s;
  CHECK(st == SG_OK && v[0] == want, "%s: sum of old ranks over the new communicator %g (want %g)",
        what, (double)v[0], (double)want);
}

static void one_split(sg_comm *c, const int *colors, const int *keys, const char *what) {
  const int world = sg_comm_size(c), rank = sg_comm_rank(c);
  sg_comm *nc = (sg_comm *)&nc; /* must be overwritten */
  const sg_status st = sg_comm_split(c, colors[rank], keys[rank], &nc);
  int size = 0;
  const int want = ref_rank(colors, keys, world, rank, &size);
  if (!CHECK(st == SG_OK, "%s: sg_comm_split returns SG_OK (%s)", what, sg_status_string(st)))
    return;
  if (want < 0) {
    CHECK(nc == NULL, "%s: color < 0 gives NULL", what);
    return;
  }
  CHECK(sg_comm_rank(nc) == want && sg_comm_size(nc) == size, "%s: rank %d of %d (want %d of %d)",
        what, sg_comm_rank(nc), sg_comm_size(nc), want, size);
  check_members(nc, colors, world, rank, what);
  sg_comm_destroy(nc);
}

/* W = L * N ranks: node communicators of L, then an engine on each, against one made directly
 * with sg_comm_create_local (threads) or the same split's reference (rank order) under MPI. */
static void engine_on_split(sg_comm *c, int l, const float *direct) {
  const int rank = sg_comm_rank(c);
  sg_comm *node = NULL;
  if (!CHECK(sg_comm_split(c, rank / l, rank, &node) == SG_OK, "node split for the engine")) return;
  float got[NUMEL];
  const sg_status st = sg_test_train_small(node, SG_DEVICE_CPU, sg_comm_rank(node), got);
  CHECK(st == SG_OK && memcmp(got, direct, sizeof got) == 0,
        "engine on a split communicator of %d ranks: the bits of a direct one (%s)", l,
        sg_status_string(st));
  sg_comm_destroy(node);
}

/* An engine holds c (its channel) while the rank splits c: the split has its own channel. */
static void split_beside_engine(sg_comm *c) {
  sg_config cfg;
  sg_engine *e = NULL;
  int id = -1;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st == SG_OK) st = sg_engine_create(c, &cfg, &e);
  if (st == SG_OK) st = sg_add_param(e, "p", 8, 0, &id);
  if (st == SG_OK) st = sg_finalize(e);
  sg_comm *half = NULL;
  const int rank = sg_comm_rank(c);
  if (st == SG_OK) st = sg_comm_split(c, rank % 2, 0, &half);
  CHECK(st == SG_OK && half != NULL, "split while an engine uses the communicator (%s)",
        sg_status_string(st));
  if (st == SG_OK) st = sg_step(e, NULL);
  CHECK(st == SG_OK, "the engine still steps after the split (%s)", sg_status_string(st));
  sg_comm_destroy(half);
  sg_engine_destroy(e);
}

static void errors(sg_comm *c) {
  sg_comm *nc = (sg_comm *)&nc;
  CHECK(sg_comm_split(NULL, 0, 0, &nc) == SG_ERR_INVALID_ARGUMENT && nc == NULL,
        "NULL communicator: SG_ERR_INVALID_ARGUMENT, *out = NULL");
  CHECK(sg_comm_split(c, 0, 0, NULL) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "sg_comm_split: out is NULL") != NULL,
        "NULL out: SG_ERR_INVALID_ARGUMENT naming it");
}

/* Every case on one rank of communicator c (of world W); direct: the engine reference. */
static void run_rank(sg_comm *c, const float *direct, int l) {
  const int world = sg_comm_size(c), rank = sg_comm_rank(c);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[W=%d rank %d]", world, rank);
  sg_test_quiet = rank != 0;
  int colors[64] = {0}, keys[64] = {0};
  for (int s = 0; s < world; s++) colors[s] = s / l, keys[s] = s;
  one_split(c, colors, keys, "by node");
  for (int s = 0; s < world; s++) colors[s] = s % l, keys[s] = -s;
  one_split(c, colors, keys, "by index in node, reversed keys");
  for (int s = 0; s < world; s++) colors[s] = s == world - 1 ? -1 : 7, keys[s] = s % 2;
  one_split(c, colors, keys, "last rank left out, keys with ties");
  if (world % l == 0) engine_on_split(c, l, direct);
  if (world >= 2) split_beside_engine(c);
  errors(c);
}

/* ---- threads -------------------------------------------------------------------------------- */

/* What the ranks of one world share: the engine reference (out of rank 0 of direct_main) and
 * the node size. */
typedef struct targ {
  float direct[NUMEL];
  int l;
} targ;

static void thread_main(sg_comm *c, void *p) {
  const targ *a = p;
  run_rank(c, a->direct, a->l);
}

static void direct_main(sg_comm *c, void *p) {
  targ *a = p;
  float out[NUMEL];
  CHECK(sg_test_train_small(c, SG_DEVICE_CPU, sg_comm_rank(c), out) == SG_OK,
        "direct engine reference");
  if (sg_comm_rank(c) == 0) memcpy(a->direct, out, sizeof out);
}

/* fn on w threads over fresh local communicators, or over the caller's transport (each
 * transport released once at the end). */
static void threads(int w, void (*fn)(sg_comm *, void *), targ *a, int xport) {
  const sg_status st = xport ? sg_test_run_threads_xport(w, fn, a) : sg_test_run_threads(w, fn, a);
  CHECK(st == SG_OK, "%d %s ranks, each transport released once", w, xport ? "xport" : "local");
}

static void run_threads(int w, int xport) {
  targ a = {.l = w % 2 == 0 ? 2 : 1};
  threads(a.l, direct_main, &a, 0);
  threads(w, thread_main, &a, xport);
}

/* ---- MPI ------------------------------------------------------------------------------------ */

static void run_mpi(void) {
#ifdef SG_HAVE_MPI
  int world = 0;
  sg_test_mpi_init(&world, NULL);
  /* the reference: threads of this process, a communicator of l ranks made directly */
  targ a = {.l = world % 2 == 0 ? 2 : 1};
  sg_test_quiet = 1;
  threads(a.l, direct_main, &a, 0);
  sg_comm *c = NULL;
  if (CHECK(sg_comm_create_mpi(NULL, &c) == SG_OK, "sg_comm_create_mpi"))
    run_rank(c, a.direct, a.l);
  sg_comm_destroy(c);
  sg_test_mpi_finalize();
#else
  CHECK(0, "built without MPI");
#endif
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "--mpi")) {
    run_mpi();
  } else {
    const int xport = argc >= 2 && !strcmp(argv[1], "--xport");
    const int sizes[] = {1, 2, 3, 4, 6};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) run_threads(sizes[i], xport);
  }
  return sg_test_summary("");
}
