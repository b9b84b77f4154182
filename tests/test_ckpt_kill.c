/* kill -9 during saves (issue 5): the checkpoint in the directory always loads and verifies.
 *
 * Each round starts a child process (this program, re-executed with --child) that loads the
 * directory's checkpoint at W=1 or W=2 (threads), then trains one step and saves, over and
 * over, reporting each finished save's step through a pipe. The parent kills it with SIGKILL
 * at a random moment: before its first save, or a random fraction of a save interval after its
 * 1st..3rd save (the interval is measured, so the kills land inside saves whatever the speed
 * of the machine or the sanitizer). Then it loads the directory itself, which must succeed at
 * the step of the last reported save or the one after (a save that committed its manifest but
 * was killed before reporting), with master, m, v and working params bitwise equal to a
 * reference engine trained to that step without interruption. SG_CKPT_KILL_ROUNDS sets the
 * number of rounds (default 40). */
#define _POSIX_C_SOURCE 200809L /* fork, execv, pipe, poll, kill, mkdtemp, nanosleep */

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/sg_engine_internal.h" /* the loaded step counter */
#include "test_ckpt_util.h"

static const model_cfg k_m = {4,   {1000, 65, 200000, 4097}, SG_SHARD_GRAD_OP, SG_BF16, 65536, 0,
                              NULL};

/* ---------------------------------------------------------------------------------------- */
/* child                                                                                     */

typedef struct {
  const char *dir;
  int fd;
} child_arg;

static void child_rank(int rank, int world, sg_comm *comm, void *arg) {
  const child_arg *a = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &k_m, &e, ids);
  if (!st) st = sg_load(e, a->dir);
  if (st) {
    fprintf(stderr, "child rank %d: %s: %s\n", rank, sg_status_string(st), sg_last_error());
    _exit(3);
  }
  for (;;) {
    const int s = (int)e->opt.step;
    st = train(e, &k_m, ids, s, s + 1);
    if (!st) st = sg_save(e, a->dir);
    if (st) {
      fprintf(stderr, "child rank %d: %s: %s\n", rank, sg_status_string(st), sg_last_error());
      _exit(4);
    }
    const uint64_t done = e->opt.step;
    if (rank == 0 && write(a->fd, &done, sizeof done) != (ssize_t)sizeof done) _exit(5);
  }
}

static int child_main(const char *dir, int world, int fd) {
  child_arg a = {dir, fd};
  run_ranks(world, child_rank, &a);
  return 6; /* not reached */
}

/* ---------------------------------------------------------------------------------------- */
/* parent                                                                                    */

static uint64_t g_rng = 0xC0FFEE;
static uint64_t rnd(void) {
  return g_rng = sg_test_mix(g_rng + 0x9E3779B97F4A7C15ull);
}

static int64_t now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static void sleep_us(int64_t us) {
  struct timespec t = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {
  }
}

typedef struct {
  int64_t last; /* last reported step, -1 none */
  int count;
  int64_t t_first, t_last; /* times of the first and last report (us) */
} reports;

/* Reads reports until `want` have arrived or timeout_us passes. 0 when the child ended. */
static int read_reports(int fd, reports *r, int want, int64_t timeout_us) {
  const int64_t end = now_us() + timeout_us;
  while (r->count < want) {
    const int64_t left = end - now_us();
    if (left <= 0) return 1;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, (int)(left / 1000) + 1) <= 0) continue;
    uint64_t v = 0;
    const ssize_t n = read(fd, &v, sizeof v);
    if (n != (ssize_t)sizeof v) return 0;
    r->last = (int64_t)v;
    r->count++;
    r->t_last = now_us();
    if (r->count == 1) r->t_first = r->t_last;
  }
  return 1;
}

static void drain(int fd, reports *r) {
  uint64_t v = 0;
  while (read(fd, &v, sizeof v) == (ssize_t)sizeof v) {
    r->last = (int64_t)v;
    r->count++;
  }
}

typedef struct {
  sg_comm *comm;
  sg_engine *e;
  int ids[MAXP];
} eng;

static int eng_init(eng *x, const model_cfg *m) {
  memset(x, 0, sizeof *x);
  return sg_comm_create_local(1, &x->comm) == SG_OK &&
         make_engine(x->comm, m, &x->e, x->ids) == SG_OK;
}

static void eng_free(eng *x) {
  sg_engine_destroy(x->e);
  sg_comm_destroy(x->comm);
}

/* Our leftovers of an interrupted save: temporaries, or files of two generations. */
static int interrupted(const char *dir) {
  DIR *d = opendir(dir);
  int tmp = 0, gens = 0;
  unsigned long g0 = 0, g = 0;
  for (struct dirent *de; d && (de = readdir(d)) != NULL;) {
    if (strstr(de->d_name, ".tmp"))
      tmp = 1;
    else if (sscanf(de->d_name, "g%lu.", &g) == 1 && g != g0) {
      gens++;
      g0 = g;
    }
  }
  if (d) closedir(d);
  return tmp || gens > 1;
}

typedef struct {
  int rounds, mid_save, after_commit, before_first;
} stats;

/* One child, killed at a random moment; returns its last reported step (or -1). */
static int64_t run_child(const char *self, const char *dir, int world, int64_t *interval_us,
                         stats *s) {
  int p[2];
  if (pipe(p) != 0) return -2;
  char wbuf[16], fbuf[16];
  snprintf(wbuf, sizeof wbuf, "%d", world);
  snprintf(fbuf, sizeof fbuf, "%d", p[1]);
  char *argv[] = {(char *)self, "--child", (char *)dir, wbuf, fbuf, NULL};
  const pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    execv(self, argv);
    _exit(127);
  }
  close(p[1]);
  reports r = {-1, 0, 0, 0};
  const int want = (int)(rnd() % 4); /* 0: kill before or during the first save */
  int alive = 1;
  if (want == 0) {
    sleep_us((int64_t)(rnd() % (uint64_t)(*interval_us * 3 + 1)));
  } else {
    alive = read_reports(p[0], &r, want, 20000000);
    if (alive && r.count >= 2)
      *interval_us = (*interval_us + (r.t_last - r.t_first) / (r.count - 1)) / 2;
    if (alive) sleep_us((int64_t)(rnd() % (uint64_t)(*interval_us + 1)));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  drain(p[0], &r);
  close(p[0]);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
        "child (W=%d) was running when killed (exit status %d)", world,
        WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  s->before_first += r.count == 0;
  s->mid_save += interrupted(dir);
  return r.last;
}

int main(int argc, char **argv) {
  if (argc == 5 && strcmp(argv[1], "--child") == 0)
    return child_main(argv[2], atoi(argv[3]), atoi(argv[4]));
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  const char *tmp = getenv("TMPDIR");
  char root[256], dir[300];
  snprintf(root, sizeof root, "%s/sg_ckptk_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(root)) return 1;
  snprintf(dir, sizeof dir, "%s/ck", root);
  const int rounds = getenv("SG_CKPT_KILL_ROUNDS") ? atoi(getenv("SG_CKPT_KILL_ROUNDS")) : 40;

  eng ref, ld;
  model_cfg mload = k_m;
  mload.strategy = SG_NO_SHARD; /* the parent loads with another strategy and bucket size */
  mload.bucket_bytes = 4096;
  if (!eng_init(&ref, &k_m) || !eng_init(&ld, &mload)) {
    CHECK(0, "engines: %s", sg_last_error());
    return finish();
  }
  CHECK(sg_save(ref.e, dir) == SG_OK, "initial save (step 0): %s", sg_last_error());
  int64_t prev = 0, interval = 20000;
  stats s = {0, 0, 0, 0};
  int ok_rounds = 0;
  for (int k = 0; k < rounds; k++) {
    const int world = 1 + (k % 2);
    const int64_t last = run_child(self, dir, world, &interval, &s);
    const sg_status st = sg_load(ld.e, dir);
    const int64_t got = (int64_t)ld.e->opt.step, base = last >= 0 ? last : prev;
    int ok = st == SG_OK && (got == base || got == base + 1) && got >= prev;
    if (!ok)
      printf("round %d: load %s (%s), step %lld, last reported %lld, previous %lld\n", k,
             sg_status_string(st), sg_last_error(), (long long)got, (long long)last,
             (long long)prev);
    s.after_commit += got == base + 1;
    if (ok && train(ref.e, &k_m, ref.ids, (int)ref.e->opt.step, (int)got) == SG_OK) {
      snap a, b;
      take_snap(ld.e, &k_m, ld.ids, &a);
      take_snap(ref.e, &k_m, ref.ids, &b);
      char label[64];
      snprintf(label, sizeof label, "round %d (step %lld)", k, (long long)got);
      ok = same_snap(label, &k_m, &a, &b);
      free_snap(&a);
      free_snap(&b);
    }
    ok_rounds += ok;
    prev = got;
  }
  CHECK(ok_rounds == rounds,
        "%d of %d kill -9 rounds left a checkpoint that loads at the last "
        "reported step (or the next) and equals the uninterrupted run bit for bit",
        ok_rounds, rounds);
  printf(
      "%d rounds, final step %lld: %d killed before their first save, %d left an "
      "interrupted save behind, %d committed a save they did not live to report\n",
      rounds, (long long)prev, s.before_first, s.mid_save, s.after_commit);
  CHECK(sg_save(ld.e, dir) == SG_OK, "a save after all that: %s", sg_last_error());
  CHECK(!interrupted(dir), "and the leftovers of interrupted saves are gone");
  eng_free(&ref);
  eng_free(&ld);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  if (system(cmd) != 0) printf("could not remove %s\n", root);
  return finish();
}
