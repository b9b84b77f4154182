/* A comm worker thread that cannot start (issue 30, item 3.8). The engine starts its comm
 * worker at the top of sg_finalize, before the agreement collective, so a rank whose thread
 * cannot start fails with SG_ERR_OUT_OF_MEMORY naming the thread, runs the agreement inline,
 * and every other rank learns it there at once (SG_ERR_MISMATCH naming the rank), instead of
 * waiting for the deadline. Then sg_finalize again works (the thread starts this time).
 *   hook    W=2 threads; the test hook fails the next worker start (one rank's)
 *   limit   a forked child under RLIMIT_AS just above what it maps already: a real
 *           pthread_create failure (EAGAIN: no room for the thread's stack); the limit
 *           lifted, the same engine finalizes and steps */
#define _GNU_SOURCE /* fork, setrlimit */

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_ckpt_util.h"

void sg__jobq_fail_start_after(int n); /* src/device/sg_jobq.h: the test hook */

static const model_cfg k_m = {3, {100, 37, 300}, SG_SHARD_GRAD_OP, SG_F32, 1024, 0, NULL};

/* An engine of k_m with its parameters registered, not finalized. */
static sg_status registered(sg_comm *c, sg_engine **out, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 60000; /* the hang this test guards against would be a timeout */
  cfg.bucket_bytes = k_m.bucket_bytes;
  if (!st) st = sg_engine_create(c, &cfg, out);
  for (int p = 0; p < k_m.nparams && !st; p++) {
    char name[64];
    param_name(&k_m, p, name, sizeof name);
    st = sg_add_param(*out, name, k_m.sizes[p], 0, &ids[p]);
  }
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* hook                                                                                      */

typedef struct {
  sg_status first[2], second[2], train[2];
  char err[2][512];
  pthread_barrier_t bar;
} hook_arg;

static void hook_rank(int rank, int world, sg_comm *comm, void *arg) {
  hook_arg *a = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = registered(comm, &e, ids);
  CHECK(st == SG_OK, "rank %d: engine and parameters: %s", rank, sg_last_error());
  if (rank == 0) sg__jobq_fail_start_after(0); /* one of the two starts below fails */
  pthread_barrier_wait(&a->bar);
  a->first[rank] = sg_finalize(e);
  snprintf(a->err[rank], sizeof a->err[rank], "%s", sg_last_error());
  pthread_barrier_wait(&a->bar);
  sg__jobq_fail_start_after(-1);
  a->second[rank] = sg_finalize(e);
  a->train[rank] = a->second[rank] ? a->second[rank] : train(e, &k_m, ids, 0, 2);
  sg_engine_destroy(e);
}

static void test_hook(void) {
  hook_arg a;
  memset(&a, 0, sizeof a);
  pthread_barrier_init(&a.bar, NULL, 2);
  run_ranks(2, hook_rank, &a);
  pthread_barrier_destroy(&a.bar);
  const int bad = a.first[0] == SG_ERR_OUT_OF_MEMORY ? 0 : 1, good = 1 - bad;
  printf("  rank %d: %s \"%s\"\n  rank %d: %s \"%s\"\n", bad, sg_status_string(a.first[bad]),
         a.err[bad], good, sg_status_string(a.first[good]), a.err[good]);
  CHECK(a.first[bad] == SG_ERR_OUT_OF_MEMORY && contains(a.err[bad], "comm worker thread"),
        "the rank whose worker cannot start: SG_ERR_OUT_OF_MEMORY naming the thread");
  char want[64];
  snprintf(want, sizeof want, "rank %d failed to finalize (SG_ERR_OUT_OF_MEMORY)", bad);
  CHECK(a.first[good] == SG_ERR_MISMATCH && contains(a.err[good], want),
        "the other rank learns it in the agreement (SG_ERR_MISMATCH naming rank %d), no "
        "timeout", bad);
  CHECK(a.second[0] == SG_OK && a.second[1] == SG_OK && a.train[0] == SG_OK &&
            a.train[1] == SG_OK,
        "sg_finalize again on both ranks: the worker starts, two steps train (%s, %s)",
        sg_status_string(a.train[0]), sg_status_string(a.train[1]));
}

/* ---------------------------------------------------------------------------------------- */
/* limit                                                                                     */

static unsigned long mapped_bytes(void) {
  unsigned long pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f) {
    if (fscanf(f, "%lu", &pages) != 1) pages = 0;
    fclose(f);
  }
  return pages * (unsigned long)sysconf(_SC_PAGESIZE);
}

/* Child: failure bits. */
static int child_limit(void) {
  alarm(60);
  int bad = 0;
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  if (sg_comm_create_local(1, &c) || registered(c, &e, ids)) return 64;
  struct rlimit old;
  if (getrlimit(RLIMIT_AS, &old) != 0) return 65;
  const unsigned long now = mapped_bytes();
  if (now == 0) return 66;
  /* room for the engine's small buffers, not for a thread's stack (8 MiB by default) */
  struct rlimit lim = {now + (2ul << 20), old.rlim_max};
  if (setrlimit(RLIMIT_AS, &lim) != 0) return 67;
  sg_status st = sg_finalize(e);
  printf("  under RLIMIT_AS: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  if (st != SG_ERR_OUT_OF_MEMORY || !contains(sg_last_error(), "comm worker thread")) bad |= 1;
  if (setrlimit(RLIMIT_AS, &old) != 0) return 68;
  st = sg_finalize(e);
  if (st == SG_OK) st = train(e, &k_m, ids, 0, 2);
  if (st != SG_OK) {
    printf("  after lifting the limit: %s\n", sg_last_error());
    bad |= 2;
  }
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return bad;
}

static void test_limit(void) {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) _exit(child_limit());
  int status = 0;
  for (int ms = 0; ms < 90000 && waitpid(pid, &status, WNOHANG) != pid; ms += 10)
    nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
  if (kill(pid, 0) == 0 && waitpid(pid, &status, WNOHANG) == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    status = -1;
  }
  const int code = status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  CHECK(code == 0, "RLIMIT_AS: sg_finalize fails with SG_ERR_OUT_OF_MEMORY naming the worker "
        "thread, and works once the limit is lifted (child exit %d)", code);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  test_limit(); /* first: forked before this process has threads of its own */
  test_hook();
  return finish();
}
