/* Checkpoints with one rank per process (MPI, run under mpirun -np N): save at W=N after 3
 * steps and train to 6; rank 0 alone loads at W=1 (threads backend, NO_SHARD) and every rank
 * loads at W=N with another strategy and bucket size: both bitwise equal to the uninterrupted
 * run. A damaged rank file makes every process fail with SG_ERR_CORRUPT, engines unchanged. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_ckpt_util.h"

static void flip(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  if (!f) return;
  fseek(f, off, SEEK_SET);
  const int c = fgetc(f);
  fseek(f, off, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

/* Loads `dir` into a fresh engine of configuration m on comm; compares with s3, trains to 6,
 * compares with s6. */
static void resume(sg_comm *comm, const model_cfg *m, const char *dir, const snap *s3,
                   const snap *s6, const char *label) {
  sg_engine *e = NULL;
  int ids[MAXP];
  snap a, b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  sg_status st = make_engine(comm, m, &e, ids);
  if (!st) st = sg_load(e, dir);
  CHECK(st == SG_OK, "%s: load: %s", label, sg_last_error());
  if (!st) st = take_snap(e, m, ids, &a);
  if (!st) CHECK(same_snap(label, m, &a, s3), "%s: the loaded state equals the saved one", label);
  if (!st) st = train(e, m, ids, 3, 6);
  if (!st) st = take_snap(e, m, ids, &b);
  if (!st)
    CHECK(same_snap(label, m, &b, s6),
          "%s: 3 steps later it equals the uninterrupted "
          "run",
          label);
  CHECK(st == SG_OK, "%s: %s", label, sg_last_error());
  free_snap(&a);
  free_snap(&b);
  sg_engine_destroy(e);
}

static void rank_zero_alone(int rank, int world, sg_comm *comm, void *arg) {
  void **a = arg;
  model_cfg m = *(const model_cfg *)a[0];
  m.strategy = SG_NO_SHARD;
  resume(comm, &m, a[1], a[2], a[3], "rank 0 alone at W=1 NO_SHARD");
}

int main(void) {
  sg_comm *comm = NULL;
  if (sg_comm_create_mpi(NULL, &comm) != SG_OK) {
    printf("sg_comm_create_mpi: %s\n", sg_last_error());
    return 1;
  }
  const int rank = sg_comm_rank(comm), world = sg_comm_size(comm);
  char dir[256] = "";
  if (rank == 0) {
    snprintf(dir, sizeof dir, "/tmp/sg_ckptm_XXXXXX");
    if (!mkdtemp(dir)) dir[0] = 0;
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  model_cfg m = {7, {1, 63, 64, 65, 1000, 4097, 20011}, SG_SHARD_GRAD_OP, SG_BF16, 4096, 0, NULL};
  sg_engine *e = NULL;
  int ids[MAXP];
  snap s3, s6;
  memset(&s3, 0, sizeof s3);
  memset(&s6, 0, sizeof s6);
  sg_status st = make_engine(comm, &m, &e, ids);
  if (!st) st = train(e, &m, ids, 0, 3);
  if (!st) st = take_snap(e, &m, ids, &s3);
  if (!st) st = sg_save(e, dir);
  if (!st) st = train(e, &m, ids, 3, 6);
  if (!st) st = take_snap(e, &m, ids, &s6);
  CHECK(st == SG_OK, "rank %d: train 3, save at W=%d, train 3: %s", rank, world, sg_last_error());
  sg_engine_destroy(e);
  if (st == SG_OK) {
    if (rank == 0) {
      void *a[4] = {&m, dir, &s3, &s6};
      run_ranks(1, rank_zero_alone, a);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    model_cfg m2 = m;
    m2.strategy = SG_SHARD_OPT;
    m2.bucket_bytes = 65536;
    resume(comm, &m2, dir, &s3, &s6, "every process at W=N SHARD_OPT bucket 64 KiB");
    /* a damaged rank file: every process refuses, naming it */
    char path[400];
    snprintf(path, sizeof path, "%s/g1.r%d.shard", dir, world - 1);
    if (rank == 0) flip(path, 1000);
    MPI_Barrier(MPI_COMM_WORLD);
    st = make_engine(comm, &m, &e, ids);
    snap before, after;
    memset(&before, 0, sizeof before);
    memset(&after, 0, sizeof after);
    if (!st) st = take_snap(e, &m, ids, &before);
    const sg_status lst = st ? st : sg_load(e, dir);
    CHECK(lst == SG_ERR_CORRUPT && strstr(sg_last_error(), path) != NULL,
          "rank %d: a damaged rank file: %s \"%s\"", rank, sg_status_string(lst), sg_last_error());
    if (!st) st = take_snap(e, &m, ids, &after);
    CHECK(st == SG_OK && same_snap("after the refused load", &m, &before, &after),
          "rank %d: the engine is unchanged after the refused load", rank);
    free_snap(&before);
    free_snap(&after);
    sg_engine_destroy(e);
  }
  free_snap(&s3);
  free_snap(&s6);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0 && dir[0]) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("could not remove %s\n", dir);
  }
  int fails = sg_test_failures(), all = 0;
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0 || fails) sg_test_summary("");
  sg_comm_destroy(comm);
  return all != 0;
}
