/* sg_test_ranks.h — how the communicator tests run their ranks, and the small training run that
 * every layout of a split must reproduce bit for bit.
 *
 *   sg_test_run_threads(w, fn, arg)   fn(comm, arg) on w threads, one per rank of a fresh local
 *                                     communicator of w ranks (destroyed afterwards);
 *   sg_test_run_threads_xport(...)    the same over w communicators of the caller's transport
 *                                     (sg_comm_create_xport over an in-process mailbox);
 *   sg_test_mpi_init / _finalize      one rank per process under mpirun (SG_HAVE_MPI builds):
 *                                     MPI with threads, and a failure on any process fails all;
 *   sg_test_train_small(c, dev, ...)  three AdamW steps on one parameter of SG_TEST_SMALL_NUMEL
 *                                     elements with exactly summable gradients.
 * Include after sg_test_check.h (sg_test_mpi_finalize reads its failure count). */
#ifndef SG_TEST_RANKS_H
#define SG_TEST_RANKS_H

#include <pthread.h>

#include "sg_test_mailbox.h" /* sg_test_run_threads_xport */
#include "shardgrad.h"
#ifdef SG_HAVE_MPI
#include <mpi.h>
#endif

#define SG_TEST_MAX_THREADS 64

typedef struct sg_test_thread_ {
  void (*fn)(sg_comm *, void *);
  sg_comm *c;
  void *arg;
} sg_test_thread_;

static inline void *sg_test_thread_main_(void *p) {
  const sg_test_thread_ *t = p;
  t->fn(t->c, t->arg);
  return NULL;
}

/* fn(comms[r], arg) on a thread per rank; returns once every thread has ended. */
static inline void sg_test_run_on_(int w, sg_comm **comms, void (*fn)(sg_comm *, void *),
                                   void *arg) {
  pthread_t th[SG_TEST_MAX_THREADS];
  sg_test_thread_ t[SG_TEST_MAX_THREADS];
  for (int r = 0; r < w; r++) {
    t[r] = (sg_test_thread_){fn, comms[r], arg};
    pthread_create(&th[r], NULL, sg_test_thread_main_, &t[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
}

/* fn(comm of rank r, arg) on a thread per rank of a new local communicator of w ranks; arg is
 * shared (fn tells the ranks apart by sg_comm_rank). Returns once every thread has ended and the
 * communicators are destroyed: SG_OK, or the status of sg_comm_create_local (nothing ran). */
static inline sg_status sg_test_run_threads(int w, void (*fn)(sg_comm *, void *), void *arg) {
  sg_comm *comms[SG_TEST_MAX_THREADS];
  if (w > SG_TEST_MAX_THREADS) return SG_ERR_INVALID_ARGUMENT;
  const sg_status st = sg_comm_create_local(w, comms);
  if (st != SG_OK) return st;
  sg_test_run_on_(w, comms, fn, arg);
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
  return SG_OK;
}

/* As sg_test_run_threads over w communicators of the caller's transport sharing one new
 * mailbox (fn's splits are communicators over the same transport). SG_OK once every rank's
 * transport was released exactly once by the destroys (its family's last communicator, fn's
 * splits included); SG_ERR_INTERNAL otherwise, or the status of sg_comm_create_xport. */
static inline sg_status sg_test_run_threads_xport(int w, void (*fn)(sg_comm *, void *),
                                                  void *arg) {
  sg_comm *comms[SG_TEST_MAX_THREADS];
  xuser us[SG_TEST_MAX_THREADS];
  mailbox mb;
  if (w > SG_TEST_MAX_THREADS) return SG_ERR_INVALID_ARGUMENT;
  mb_init(&mb);
  sg_status st = mb_group(&mb, us, w, comms);
  if (st == SG_OK) {
    sg_test_run_on_(w, comms, fn, arg);
    for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
    for (int r = 0; r < w; r++)
      if (__atomic_load_n(&us[r].released, __ATOMIC_SEQ_CST) != 1) st = SG_ERR_INTERNAL;
  }
  mb_free(&mb);
  return st;
}

#ifdef SG_HAVE_MPI
/* MPI_THREAD_MULTIPLE: the MPI communicator's worker threads call MPI beside the test's. The
 * size of MPI_COMM_WORLD into *world, and its rank into *rank unless rank is NULL. */
static inline void sg_test_mpi_init(int *world, int *rank) {
  int provided = 0;
  MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, world);
  if (rank) MPI_Comm_rank(MPI_COMM_WORLD, rank);
}

/* Sums the failures over the world, so that a process whose own checks passed still fails (one
 * counted failure) when another process's did not; then MPI_Finalize. */
static inline void sg_test_mpi_finalize(void) {
  int fails = sg_test_failures(), all = 0;
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  if (all && !fails) {
    pthread_mutex_lock(&sg_test_lock_);
    sg_test_fail_ = 1;
    pthread_mutex_unlock(&sg_test_lock_);
  }
}
#endif

enum { SG_TEST_SMALL_NUMEL = 40 };

/* Three AdamW steps on communicator c and device dev (GPU cuda_device); data_rank picks the
 * gradients (k/4, k in 0..4: their sums and averages over up to 4 ranks are exact). The final
 * parameter, in f32, into out[SG_TEST_SMALL_NUMEL]. */
static inline sg_status sg_test_train_small_on(sg_comm *c, sg_device dev, int cuda_device,
                                               int data_rank, float *out) {
  sg_config cfg;
  sg_engine *e = NULL;
  int id = -1;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.device = dev;
  cfg.cuda_device = cuda_device;
  cfg.timeout_ms = 60000;
  if (st == SG_OK) st = sg_engine_create(c, &cfg, &e);
  if (st == SG_OK) st = sg_add_param(e, "w", SG_TEST_SMALL_NUMEL, 0, &id);
  if (st == SG_OK) st = sg_finalize(e);
  /* Every step's gradients stay alive until the final read: on the (mock) CUDA device
   * sg_grad_add's kernel reads src when its stream gets there, and a step without a requested
   * result no longer waits for the device (the mock's device memory is host memory). */
  float g[3][SG_TEST_SMALL_NUMEL];
  for (int s = 0; s < 3 && st == SG_OK; s++) {
    for (int i = 0; i < SG_TEST_SMALL_NUMEL; i++)
      g[s][i] = (float)((i + s + data_rank) % 5) * 0.25f;
    st = sg_grad_add(e, id, g[s], SG_F32);
    if (st == SG_OK) st = sg_step(e, NULL);
  }
  if (st == SG_OK) st = sg_get_param(e, id, out, SG_F32);
  sg_engine_destroy(e);
  return st;
}

static inline sg_status sg_test_train_small(sg_comm *c, sg_device dev, int data_rank, float *out) {
  return sg_test_train_small_on(c, dev, 0, data_rank, out);
}

#endif /* SG_TEST_RANKS_H */
