/* Fork after training (issue 30, item 1). The CPU kernels' OpenMP thread pool does not survive
 * fork(): libgomp's workers are not in the child, and its first parallel region would wait for
 * them forever. The parent here trains (parallel regions: a parameter above the threshold of
 * SG_CPU_PAR_MIN) and saves; then forked children, each under a deadline (a hang fails the test
 * instead of stalling it), create an engine (W=1, and W=2 as threads), load the parent's
 * checkpoint, train on, save and exit. The parent then loads each child's checkpoint and
 * compares it bit for bit with its own continuation of the same training. A grandchild (fork
 * of a fork) does the same once more. */
#define _GNU_SOURCE /* mkdtemp, fork */

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_ckpt_util.h"

int sg__cpu_threads(void); /* kernels/cpu: the threads a parallel loop takes here */

#define DEADLINE_S 30
#define STEPS 2

static char g_root[256];
/* 3 parameters, the last one large enough for the kernels' parallel loops */
static const model_cfg k_m = {3, {100, 37, 200000}, SG_SHARD_GRAD_OP, SG_F32, 1 << 20, 0, NULL};

static void rm_rf(const char *p) {
  char cmd[800];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
  if (system(cmd) != 0) printf("could not remove %s\n", p);
}

/* ---------------------------------------------------------------------------------------- */
/* the child's work: load `from`, train STEPS more, save into `to` (at world W, threads)      */

typedef struct {
  const char *from, *to;
  int from_step;
  sg_status st[2];
} cont_arg;

static void cont_rank(int rank, int world, sg_comm *comm, void *arg) {
  cont_arg *a = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &k_m, &e, ids);
  if (!st) st = sg_load(e, a->from);
  if (!st) st = train(e, &k_m, ids, a->from_step, a->from_step + STEPS);
  if (!st) st = sg_save(e, a->to);
  if (st) printf("  rank %d of %d in pid %ld: %s\n", rank, world, (long)getpid(), sg_last_error());
  a->st[rank] = st;
  sg_engine_destroy(e);
}

/* 0 when every rank continued and saved. W=1 runs on the calling thread: libgomp's pool is
 * the thread's own, and the forking thread's is the one the child inherits broken. */
static int continue_at(int world, const char *from, int from_step, const char *to) {
  cont_arg a = {from, to, from_step, {SG_OK, SG_OK}};
  if (world == 1) {
    sg_comm *c = NULL;
    if (sg_comm_create_local(1, &c) != SG_OK) return 1;
    cont_rank(0, 1, c, &a);
    sg_comm_destroy(c);
  } else {
    run_ranks(world, cont_rank, &a);
  }
  return a.st[0] != SG_OK || (world > 1 && a.st[1] != SG_OK);
}

/* Waits for pid with a deadline; its exit code, or -1 when it hung (then it is killed) or died
 * of a signal. */
static int wait_deadline(pid_t pid) {
  int status = 0;
  for (int ms = 0; ms < DEADLINE_S * 1000; ms += 10) {
    if (waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  printf("  child %ld still running after %d s: killed\n", (long)pid, DEADLINE_S);
  return -1;
}

/* In a forked child: continue at `world`, and with `grandchild` fork once more and have the
 * grandchild continue from the child's checkpoint. Exits; never returns. */
static void child_main(int world, const char *from, const char *to, int grandchild) {
  alarm(DEADLINE_S); /* belt and braces: a hang ends the child even if the parent is gone */
  int bad = continue_at(world, from, STEPS, to);
  if (!bad && grandchild) {
    char to2[400];
    snprintf(to2, sizeof to2, "%s.grand", to);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(DEADLINE_S);
      _exit(continue_at(world, to, 2 * STEPS, to2) ? 3 : 0);
    }
    bad = pid < 0 ? 4 : wait_deadline(pid) == 0 ? 0 : 5;
  }
  fflush(stdout);
  _exit(bad);
}

/* ---------------------------------------------------------------------------------------- */
/* the parent                                                                                */

static sg_status snap_of(const char *dir, snap *s) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  memset(s, 0, sizeof *s);
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, &k_m, &e, ids);
  if (!st) st = sg_load(e, dir);
  if (!st) st = take_snap(e, &k_m, ids, s);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return st;
}

static void check_child_result(const char *what, const char *dir, const snap *want) {
  snap got;
  const sg_status st = snap_of(dir, &got);
  CHECK(st == SG_OK && same_snap(what, &k_m, &got, want),
        "%s: its checkpoint is bitwise the parent's own continuation: %s", what,
        st ? sg_last_error() : "ok");
  if (got.ok) free_snap(&got);
}

#if defined(__SANITIZE_THREAD__)
#define SG_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SG_TEST_UNDER_TSAN 1
#endif
#endif

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
#ifdef SG_TEST_UNDER_TSAN
  /* TSan's runtime kills a child that starts a thread after a multi-threaded fork, which is
   * what this test is about; the Release, clang and ASan builds run it. */
  puts("skip: ThreadSanitizer does not support threads started after a multi-threaded fork");
  return 77;
#endif
  const char *t = getenv("TMPDIR");
  snprintf(g_root, sizeof g_root, "%s/sg_fork_XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(g_root)) return 1;
  char base[300], d1[300], d2[300];
  snprintf(base, sizeof base, "%s/base", g_root);
  snprintf(d1, sizeof d1, "%s/w1", g_root);
  snprintf(d2, sizeof d2, "%s/w2", g_root);

  /* the parent trains with parallel regions, saves, and keeps training: the reference */
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  snap want1, want2;
  memset(&want1, 0, sizeof want1);
  memset(&want2, 0, sizeof want2);
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, &k_m, &e, ids);
  if (!st) st = train(e, &k_m, ids, 0, STEPS);
  if (!st) st = sg_save(e, base);
  CHECK(st == SG_OK, "parent: trained %d steps and saved: %s", STEPS, sg_last_error());
  printf("  parent: %d CPU threads for the kernels' loops\n", sg__cpu_threads());

  /* forked while the parent's engine is alive (its pool of OpenMP workers up) */
  pid_t p1 = fork();
  if (p1 == 0) child_main(1, base, d1, 1);
  pid_t p2 = fork();
  if (p2 == 0) child_main(2, base, d2, 0);
  const int r1 = p1 > 0 ? wait_deadline(p1) : -1, r2 = p2 > 0 ? wait_deadline(p2) : -1;
  CHECK(r1 == 0, "child at W=1 (and its own forked child): engine, load, %d steps, save, exit "
        "within %d s (exit %d)", STEPS, DEADLINE_S, r1);
  CHECK(r2 == 0, "child at W=2 (threads): engine, load, %d steps, save, exit within %d s "
        "(exit %d)", STEPS, DEADLINE_S, r2);

  if (!st) st = train(e, &k_m, ids, STEPS, 2 * STEPS);
  if (!st) st = take_snap(e, &k_m, ids, &want1);
  if (!st) st = train(e, &k_m, ids, 2 * STEPS, 3 * STEPS);
  if (!st) st = take_snap(e, &k_m, ids, &want2);
  CHECK(st == SG_OK, "parent: trains on after the forks: %s", sg_last_error());
  if (r1 == 0) check_child_result("child W=1", d1, &want1);
  if (r2 == 0) check_child_result("child W=2", d2, &want1);
  if (r1 == 0) {
    char g[400];
    snprintf(g, sizeof g, "%s.grand", d1);
    check_child_result("grandchild W=1", g, &want2);
  }
  if (want1.ok) free_snap(&want1);
  if (want2.ok) free_snap(&want2);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  rm_rf(g_root);
  return finish();
}
