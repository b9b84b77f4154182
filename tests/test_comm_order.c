/* Destroying the communicator before its engines (issue 30, item 3.9). sg_comm_destroy of a
 * communicator that engines still use marks it destroyed and the last of those engines frees
 * it in sg_engine_destroy, so the order of the two destroys does not matter:
 *   local   W=2 threads: communicator destroyed after 2 steps, the engine trains 2 more,
 *           bitwise as the engine of the usual order; a new engine or split on the destroyed
 *           handle is SG_ERR_INVALID_STATE (while its engine keeps it alive)
 *   xport   the caller's transport (its release callback says when the communicator is
 *           really freed): two engines on one communicator, the communicator destroyed first:
 *           released only with the second engine's destroy
 *   --mpi   one rank per process (mpirun -np 2): sg_comm_create_mpi initializes MPI, the
 *           communicator is destroyed before the engine, and the engine's destroy finalizes
 *           MPI (MPI_Finalized says so; mpirun sees a normal exit) */
#define _GNU_SOURCE

#include "sg_test_mailbox.h" /* the caller's transport over an in-process mailbox */
#include "test_ckpt_util.h"
#ifdef SG_HAVE_MPI
#include <mpi.h>
#endif

static const model_cfg k_m = {3, {100, 37, 300}, SG_SHARD_GRAD_OP, SG_F32, 1024, 0, NULL};

/* ---------------------------------------------------------------------------------------- */
/* one rank                                                                                  */

typedef struct {
  int comm_first; /* destroy the communicator before the engine */
  snap s[2];      /* by rank: the state after 4 steps */
  sg_status st[2];
} order_arg;

static void order_rank(int rank, sg_comm *c, order_arg *a) {
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(c, &k_m, &e, ids);
  if (!st) st = train(e, &k_m, ids, 0, 2);
  if (!st && a->comm_first) {
    sg_comm_destroy(c);
    sg_config cfg;
    sg_config_init(&cfg, sizeof cfg);
    sg_engine *e2 = NULL;
    const sg_status again = sg_engine_create(c, &cfg, &e2);
    CHECK(again == SG_ERR_INVALID_STATE && contains(sg_last_error(), "destroyed"),
          "rank %d: sg_engine_create on the destroyed communicator: SG_ERR_INVALID_STATE (%s)",
          rank, sg_last_error());
    sg_comm *part = NULL;
    const sg_status sp = sg_comm_split(c, 0, rank, &part);
    CHECK(sp == SG_ERR_INVALID_STATE && part == NULL,
          "rank %d: sg_comm_split of the destroyed communicator: SG_ERR_INVALID_STATE", rank);
  }
  if (!st) st = train(e, &k_m, ids, 2, 4);
  if (!st) st = take_snap(e, &k_m, ids, &a->s[rank]);
  a->st[rank] = st;
  sg_engine_destroy(e);
  if (!a->comm_first) sg_comm_destroy(c);
}

typedef struct {
  int rank;
  sg_comm *c;
  order_arg *a;
} rank_th;

static void *order_main(void *p) {
  rank_th *t = p;
  order_rank(t->rank, t->c, t->a);
  return NULL;
}

static void run_local(order_arg *a) {
  sg_comm *comms[2];
  pthread_t th[2];
  rank_th t[2];
  if (sg_comm_create_local(2, comms) != SG_OK) {
    CHECK(0, "sg_comm_create_local: %s", sg_last_error());
    return;
  }
  for (int r = 0; r < 2; r++) {
    t[r] = (rank_th){r, comms[r], a};
    pthread_create(&th[r], NULL, order_main, &t[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
}

static void test_local(void) {
  order_arg usual, first;
  memset(&usual, 0, sizeof usual);
  memset(&first, 0, sizeof first);
  first.comm_first = 1;
  run_local(&usual);
  run_local(&first);
  for (int r = 0; r < 2; r++) {
    CHECK(usual.st[r] == SG_OK && first.st[r] == SG_OK,
          "rank %d: both orders train 4 steps (%s, %s)", r, sg_status_string(usual.st[r]),
          sg_status_string(first.st[r]));
    if (usual.s[r].ok && first.s[r].ok)
      CHECK(same_snap("order", &k_m, &first.s[r], &usual.s[r]),
            "rank %d: the engine whose communicator was destroyed first trains on bitwise", r);
    if (usual.s[r].ok) free_snap(&usual.s[r]);
    if (first.s[r].ok) free_snap(&first.s[r]);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* xport: when is the communicator really freed                                              */

typedef struct {
  sg_comm *c;
  xuser *u;
  int rank;
  int released[3]; /* after the comm destroy, after the first engine, after the second */
  sg_status st;
} xrank;

static void *xport_main(void *p) {
  xrank *x = p;
  sg_engine *e[2] = {NULL, NULL};
  int ids[2][MAXP];
  sg_status st = make_engine(x->c, &k_m, &e[0], ids[0]);
  if (!st) st = make_engine(x->c, &k_m, &e[1], ids[1]);
  if (!st) st = train(e[0], &k_m, ids[0], 0, 1);
  sg_comm_destroy(x->c);
  x->released[0] = __atomic_load_n(&x->u->released, __ATOMIC_SEQ_CST);
  if (!st) st = train(e[1], &k_m, ids[1], 0, 1);
  if (!st) st = train(e[0], &k_m, ids[0], 1, 2);
  sg_engine_destroy(e[0]);
  x->released[1] = __atomic_load_n(&x->u->released, __ATOMIC_SEQ_CST);
  if (!st) st = train(e[1], &k_m, ids[1], 1, 2);
  sg_engine_destroy(e[1]);
  x->released[2] = __atomic_load_n(&x->u->released, __ATOMIC_SEQ_CST);
  x->st = st;
  return NULL;
}

static void test_xport(void) {
  mailbox mb;
  xuser us[2];
  sg_comm *comms[2];
  mb_init(&mb);
  if (mb_group(&mb, us, 2, comms) != SG_OK) {
    CHECK(0, "xport communicators: %s", sg_last_error());
    mb_free(&mb);
    return;
  }
  xrank x[2];
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    x[r] = (xrank){comms[r], &us[r], r, {-1, -1, -1}, SG_OK};
    pthread_create(&th[r], NULL, xport_main, &x[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < 2; r++) {
    CHECK(x[r].st == SG_OK, "xport rank %d: two engines train on after sg_comm_destroy: %s", r,
          sg_status_string(x[r].st));
    CHECK(x[r].released[0] == 0 && x[r].released[1] == 0 && x[r].released[2] == 1,
          "xport rank %d: the transport is released once, with the last engine (after the "
          "comm destroy %d, first engine %d, second engine %d)",
          r, x[r].released[0], x[r].released[1], x[r].released[2]);
  }
  mb_free(&mb);
}

/* ---------------------------------------------------------------------------------------- */
/* MPI                                                                                       */

#ifdef SG_HAVE_MPI
static int run_mpi(void) {
  sg_comm *c = NULL;
  sg_status st = sg_comm_create_mpi(NULL, &c); /* initializes MPI: the last destroy finalizes */
  CHECK(st == SG_OK, "sg_comm_create_mpi: %s", sg_last_error());
  if (st) return finish();
  const int rank = sg_comm_rank(c);
  order_arg a;
  memset(&a, 0, sizeof a);
  a.comm_first = 1;
  order_rank(rank, c, &a); /* the communicator goes first, then the engine */
  CHECK(a.st[rank] == SG_OK, "rank %d: trains on after sg_comm_destroy: %s", rank,
        sg_status_string(a.st[rank]));
  if (a.s[rank].ok) free_snap(&a.s[rank]);
  int done = 0;
  MPI_Finalized(&done);
  CHECK(done, "rank %d: the engine's destroy freed the communicator and finalized MPI", rank);
  return finish();
}
#endif

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc > 1 && strcmp(argv[1], "--mpi") == 0) {
#ifdef SG_HAVE_MPI
    return run_mpi();
#else
    printf("built without MPI\n");
    return 1;
#endif
  }
  test_local();
  test_xport();
  return finish();
}
