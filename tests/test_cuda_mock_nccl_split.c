/* sg_comm_split and sg_comm_split_nodes on NCCL communicators, over the mock CUDA runtime and
 * mock NCCL of tests/cudamock (4 ranks as threads, one mock GPU):
 *  - with ncclCommSplit: by node, by index with reversed keys, one rank left out (NULL), and
 *    sg_comm_split_nodes as 2 x 2 and by host (one host: 1 x 4); each new communicator's ranks
 *    and members (an all-reduce of the old ranks over it, host buffers staged through the mock
 *    GPU); an engine on the CUDA device trains on a node communicator and gives the bits of the
 *    same training on a local (CPU) communicator of 2;
 *  - without ncclCommSplit (the loaded table's entry cleared, as an NCCL before 2.18 has it):
 *    the first split of a fresh communicator hands out new ids over it and works the same; a
 *    second one on that communicator is SG_ERR_UNSUPPORTED naming ncclCommSplit, on every rank,
 *    and leaves it usable.
 * The mock NCCL splits and initializes as NCCL >= 2.18 does in non-blocking mode (ncclInProgress,
 * the handle NULL until its background thread writes it, the parent in progress meanwhile): the
 * splits must wait for the parent, then the child, and leave the parent usable (issue 28,
 * defect 1: the wait ended at once and every split failed with "operation in progress"). */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <nccl.h> /* the mock's controls */

#include "comm/sg_comm.h"    /* collectives through the vtable */
#include "comm/backend/sg_nccl_dl.h" /* the loaded NCCL's table */
#include "sg_test_check.h"
#include "sg_test_ranks.h" /* the CPU reference's threads, sg_test_train_small */
#include "shardgrad.h"

enum { W = 4, NUMEL = SG_TEST_SMALL_NUMEL };

/* nc has `size` ranks, this one `want`, and its members' old ranks sum to `sum`. */
static void check_comm(sg_comm *nc, int old_rank, int want, int size, float sum, const char *what) {
  if (!CHECK(nc && sg_comm_rank(nc) == want && sg_comm_size(nc) == size,
             "%s: rank %d of %d (want %d of %d)", what, sg_comm_rank(nc), sg_comm_size(nc), want,
             size))
    return;
  float v[1] = {(float)old_rank};
  const sg_status st = nc->ops->all_reduce(nc, v, 1, SG_F32, sg__deadline(60000));
  CHECK(st == SG_OK && v[0] == sum, "%s: members' old ranks sum to %g (want %g)", what,
        (double)v[0], (double)sum);
}

static void splits(sg_comm *c) {
  const int r = sg_comm_rank(c);
  sg_comm *a = NULL, *b = NULL;
  CHECK(sg_comm_split(c, r / 2, r, &a) == SG_OK, "split by node");
  check_comm(a, r, r % 2, 2, r < 2 ? 1.0f : 5.0f, "by node");
  sg_comm_destroy(a);
  CHECK(sg_comm_split(c, r % 2, -r, &a) == SG_OK, "split by index, reversed keys");
  check_comm(a, r, r < 2 ? 1 : 0, 2, r % 2 ? 4.0f : 2.0f, "by index");
  sg_comm_destroy(a);
  a = (sg_comm *)&a;
  CHECK(sg_comm_split(c, r == 3 ? -1 : 5, r, &a) == SG_OK, "split with rank 3 left out");
  if (r == 3)
    CHECK(a == NULL, "rank 3 (color -1) gets NULL");
  else
    check_comm(a, r, r, 3, 3.0f, "three of four");
  if (r != 3) sg_comm_destroy(a);
  CHECK(sg_comm_split_nodes(c, 2, &a, &b) == SG_OK, "sg_comm_split_nodes(2)");
  check_comm(a, r, r % 2, 2, r < 2 ? 1.0f : 5.0f, "split_nodes 2 x 2: shard");
  check_comm(b, r, r / 2, 2, r % 2 ? 4.0f : 2.0f, "split_nodes 2 x 2: replica");
  sg_comm_destroy(a);
  sg_comm_destroy(b);
  CHECK(sg_comm_split_nodes(c, 0, &a, &b) == SG_OK, "sg_comm_split_nodes(0): by host");
  check_comm(a, r, r, 4, 6.0f, "by host (one host): shard");
  check_comm(b, r, 0, 1, (float)r, "by host (one host): replica");
  sg_comm_destroy(a);
  sg_comm_destroy(b);
  check_comm(c, r, r, 4, 6.0f, "the parent after its splits");
}

/* Three AdamW steps with exactly summable gradients; the final parameters. */
static sg_status train(sg_comm *c, sg_device dev, float *out) {
  return sg_test_train_small(c, dev, sg_comm_rank(c), out);
}

static float g_direct[NUMEL]; /* the CPU reference on a local communicator of 2 */

static void engine_on_node(sg_comm *c) {
  sg_comm *shard = NULL, *replica = NULL;
  if (!CHECK(sg_comm_split_nodes(c, 2, &shard, &replica) == SG_OK, "split for the engine")) return;
  float got[NUMEL];
  const sg_status st = train(shard, SG_DEVICE_CUDA, got);
  CHECK(st == SG_OK && memcmp(got, g_direct, sizeof got) == 0,
        "engine (CUDA device) on a split NCCL communicator of 2: the bits of the CPU engine (%s)",
        sg_status_string(st));
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
}

/* Without ncclCommSplit: the first split has the fresh communicator to itself. */
static void splits_by_ids(sg_comm *c) {
  const int r = sg_comm_rank(c);
  sg_comm *a = NULL, *b = NULL;
  CHECK(sg_comm_split_nodes(c, 2, &a, &b) == SG_OK, "no ncclCommSplit: sg_comm_split_nodes(2)");
  check_comm(a, r, r % 2, 2, r < 2 ? 1.0f : 5.0f, "no ncclCommSplit: shard");
  check_comm(b, r, r / 2, 2, r % 2 ? 4.0f : 2.0f, "no ncclCommSplit: replica");
  sg_comm_destroy(a);
  sg_comm_destroy(b);
  a = (sg_comm *)&a;
  CHECK(sg_comm_split(c, 0, r, &a) == SG_ERR_UNSUPPORTED && a == NULL &&
            strstr(sg_last_error(), "ncclCommSplit") != NULL,
        "no ncclCommSplit: a second split of the communicator is SG_ERR_UNSUPPORTED (%s)",
        sg_last_error());
  float v[1] = {1.0f};
  CHECK(c->ops->all_reduce(c, v, 1, SG_F32, sg__deadline(60000)) == SG_OK && v[0] == 4.0f,
        "no ncclCommSplit: the communicator still works");
}

typedef struct targ {
  int rank;
  const unsigned char *id;
  void (*body)(sg_comm *);
} targ;

static void *nccl_rank(void *p) {
  targ *a = p;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[rank %d]", a->rank);
  sg_test_quiet = a->rank != 0;
  sg_comm *c = NULL;
  if (CHECK(sg_comm_create_nccl(a->rank, W, a->id, 0, &c) == SG_OK, "sg_comm_create_nccl"))
    a->body(c);
  sg_comm_destroy(c);
  return NULL;
}

static void cpu_rank(sg_comm *local, void *unused) {
  CHECK(train(local, SG_DEVICE_CPU, sg_comm_rank(local) == 0 ? g_direct : (float[NUMEL]){0}) ==
            SG_OK,
        "CPU reference");
}

static void run(void (*body)(sg_comm *)) {
  unsigned char id[128];
  if (!CHECK(sg_nccl_unique_id(id) == SG_OK, "sg_nccl_unique_id")) return;
  pthread_t th[W];
  targ a[W];
  for (int r = 0; r < W; r++) {
    a[r] = (targ){r, id, body};
    pthread_create(&th[r], NULL, nccl_rank, &a[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
}

int main(void) {
  CHECK(sg_test_run_threads(2, cpu_rank, NULL) == SG_OK, "local communicator for the reference");
  run(splits);
  CHECK(sg_ncclmock_background() == 0, "no NCCL thread left to write a handle after the splits");
  CHECK(sg_ncclmock_dead_calls() == 0, "no call on a destroyed or aborted NCCL handle");
  run(engine_on_node);
  const sg__nccl_lib *lib = NULL;
  if (CHECK(sg__nccl_lib_load("test", &lib) == SG_OK && lib->CommSplit, "NCCL with ncclCommSplit")) {
    sg__nccl_lib *t = (sg__nccl_lib *)lib; /* the library's own table (not const) */
    __typeof__(t->CommSplit) saved = t->CommSplit;
    t->CommSplit = NULL; /* as an NCCL before 2.18 */
    run(splits_by_ids);
    t->CommSplit = saved;
  }
  return sg_test_summary("");
}
