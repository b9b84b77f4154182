/* test_comm_split_nodes: sg_comm_split_nodes with ranks as threads (every W and ranks_per_node
 * of the table below; local communicators, or with --xport the caller's transport over an
 * in-process mailbox) and one rank per process (--mpi, under mpirun).
 *
 * For each layout every rank checks both communicators it gets: its rank and size, and the old
 * ranks of their members in new-rank order (all-gathered over the new communicator), against the
 * layout computed here: shard = the K consecutive ranks of its node, replica = the ranks with its
 * index, one per node, in node order. Nodes of different sizes, ranks that pass different
 * ranks_per_node and one rank's bad argument fail on every rank (SG_ERR_MISMATCH, the bad rank
 * SG_ERR_INVALID_ARGUMENT), with both outputs NULL, and the communicator splits fine afterwards.
 * ranks_per_node 0 groups the ranks by host: all threads are one node; under MPI, --per-host K
 * says how many consecutive ranks share a host (scripts/cluster.sh places them so; plain mpirun
 * on one machine: all of them). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/comm/sg_comm.h" /* ops, to gather the members of a new communicator */
#include "sg_test_check.h"
#include "sg_test_ranks.h" /* ranks as threads or processes */
#include "shardgrad.h"

enum { MAXW = 16 };

/* The old ranks of nc's members, in nc's rank order, against want[0..n). */
static void check_members(sg_comm *nc, int old_rank, const int *want, int n, const char *what) {
  int got[MAXW] = {0};
  const int me = sg_comm_rank(nc);
  if (!CHECK(sg_comm_size(nc) == n && me >= 0 && me < n, "%s: size %d (want %d)", what,
             sg_comm_size(nc), n))
    return;
  got[me] = old_rank;
  const sg_status st = nc->ops->all_gather(nc, got, sizeof *got, sg__deadline(60000));
  int same = st == SG_OK;
  for (int i = 0; i < n; i++) same = same && got[i] == want[i];
  CHECK(same && want[me] == old_rank, "%s: members %d,%d,... in order (want %d,%d,...)", what,
        got[0], n > 1 ? got[1] : -1, want[0], n > 1 ? want[1] : -1);
}

/* Nodes of k consecutive ranks: both communicators of `rank` against that layout. */
static void good(sg_comm *c, int rpn, int k) {
  const int world = sg_comm_size(c), rank = sg_comm_rank(c), nodes = world / k;
  char what[96];
  snprintf(what, sizeof what, "W=%d ranks_per_node %d (%d x %d)", world, rpn, nodes, k);
  sg_comm *shard = (sg_comm *)&shard, *replica = (sg_comm *)&replica;
  const sg_status st = sg_comm_split_nodes(c, rpn, &shard, &replica);
  if (!CHECK(st == SG_OK && shard && replica, "%s: SG_OK (%s)", what, sg_status_string(st))) return;
  int want[MAXW];
  for (int i = 0; i < k; i++) want[i] = rank / k * k + i;
  CHECK(sg_comm_rank(shard) == rank % k, "%s: shard rank %d (want %d)", what, sg_comm_rank(shard),
        rank % k);
  check_members(shard, rank, want, k, what);
  for (int j = 0; j < nodes; j++) want[j] = j * k + rank % k;
  CHECK(sg_comm_rank(replica) == rank / k, "%s: replica rank %d (want %d, its node)", what,
        sg_comm_rank(replica), rank / k);
  check_members(replica, rank, want, nodes, what);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
}

/* Every rank fails with `want` (the ranks in `bad_ranks` with SG_ERR_INVALID_ARGUMENT), both
 * outputs NULL; c stays usable. */
static void fails(sg_comm *c, int rpn, int null_shard, int want, const char *what) {
  sg_comm *shard = (sg_comm *)&shard, *replica = (sg_comm *)&replica;
  const sg_status st = sg_comm_split_nodes(c, rpn, null_shard ? NULL : &shard, &replica);
  CHECK(st == (sg_status)want && replica == NULL && (null_shard || shard == NULL),
        "%s: %s, outputs NULL (got %s: %s)", what, sg_status_string((sg_status)want),
        sg_status_string(st), sg_last_error());
}

static void mismatches(sg_comm *c) {
  const int world = sg_comm_size(c), rank = sg_comm_rank(c);
  char what[96];
  if (world >= 2) {
    const int rpn = world + 1; /* never divides */
    snprintf(what, sizeof what, "W=%d ranks_per_node %d", world, rpn);
    fails(c, rpn, 0, SG_ERR_MISMATCH, what);
    CHECK(strstr(sg_last_error(), "same number of ranks") != NULL,
          "%s: the message says nodes must be the same size (%s)", what, sg_last_error());
  }
  if (world >= 3 && world % 2 == 1) fails(c, 2, 0, SG_ERR_MISMATCH, "odd world, nodes of 2");
  if (world >= 2) {
    fails(c, rank == world - 1 ? 1 : world, 0, SG_ERR_MISMATCH, "last rank passes another ranks_per_node");
    CHECK(strstr(sg_last_error(), "ranks disagree") != NULL, "which names the disagreement (%s)",
          sg_last_error());
    fails(c, rank == 1 ? -1 : 1, 0, rank == 1 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_MISMATCH,
          "rank 1 passes ranks_per_node -1");
    if (rank == 1)
      CHECK(strstr(sg_last_error(), "ranks_per_node must be >= 0") != NULL,
            "which its message names (%s)", sg_last_error());
    fails(c, 1, rank == 0, rank == 0 ? SG_ERR_INVALID_ARGUMENT : SG_ERR_MISMATCH,
          "rank 0 passes shard = NULL");
    if (rank == 0)
      CHECK(strstr(sg_last_error(), "shard is NULL") != NULL, "which its message names (%s)",
            sg_last_error());
  }
  good(c, 1, 1); /* still usable after every failure above */
}

static void errors(sg_comm *c) {
  sg_comm *a = (sg_comm *)&a, *b = (sg_comm *)&b;
  CHECK(sg_comm_split_nodes(NULL, 1, &a, &b) == SG_ERR_INVALID_ARGUMENT && !a && !b,
        "NULL communicator: SG_ERR_INVALID_ARGUMENT, outputs NULL");
  if (sg_comm_size(c) == 1) {
    CHECK(sg_comm_split_nodes(c, 1, &a, &a) == SG_ERR_INVALID_ARGUMENT &&
              strstr(sg_last_error(), "same place") != NULL,
          "shard == replica: SG_ERR_INVALID_ARGUMENT (%s)", sg_last_error());
    CHECK(sg_comm_split_nodes(c, 1, &a, NULL) == SG_ERR_INVALID_ARGUMENT &&
              strstr(sg_last_error(), "replica is NULL") != NULL && a == NULL,
          "replica NULL: SG_ERR_INVALID_ARGUMENT (%s)", sg_last_error());
  }
}

/* Every case on one rank; per_host: ranks sharing a host, for ranks_per_node 0. */
static void run_rank(sg_comm *c, int per_host) {
  const int world = sg_comm_size(c), rank = sg_comm_rank(c);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[W=%d rank %d]", world, rank);
  sg_test_quiet = rank != 0;
  for (int k = 1; k <= world; k++)
    if (world % k == 0) good(c, k, k);
  good(c, 0, per_host);
  mismatches(c);
  errors(c);
}

/* ---- threads -------------------------------------------------------------------------------- */

static void thread_main(sg_comm *c, void *unused) {
  run_rank(c, sg_comm_size(c)); /* threads share the host */
}

static void run_threads(int w, int xport) {
  const sg_status st = xport ? sg_test_run_threads_xport(w, thread_main, NULL)
                             : sg_test_run_threads(w, thread_main, NULL);
  CHECK(st == SG_OK, "%d %s ranks, each transport released once", w, xport ? "xport" : "local");
}

/* ---- MPI ------------------------------------------------------------------------------------ */

static void run_mpi(int per_host) {
#ifdef SG_HAVE_MPI
  int world = 0;
  sg_test_mpi_init(&world, NULL);
  sg_comm *c = NULL;
  if (CHECK(world <= MAXW && sg_comm_create_mpi(NULL, &c) == SG_OK, "sg_comm_create_mpi"))
    run_rank(c, per_host > 0 ? per_host : world);
  sg_comm_destroy(c);
  sg_test_mpi_finalize();
#else
  (void)per_host;
  CHECK(0, "built without MPI");
#endif
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "--mpi")) {
    run_mpi(argc >= 4 && !strcmp(argv[2], "--per-host") ? atoi(argv[3]) : 0);
  } else {
    const int xport = argc >= 2 && !strcmp(argv[1], "--xport");
    const int sizes[] = {1, 2, 3, 4, 5, 6, 8};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) run_threads(sizes[i], xport);
  }
  return sg_test_summary("");
}
