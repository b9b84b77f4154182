/* Checkpoints under attack (issue 14, items 2, 3, 7 and the adversarial ENOSPC cases):
 *   fifo      sg_load with dir/manifest a FIFO, sg_import of a FIFO, sg_save with a FIFO under
 *             the manifest's temporary name: each fails with SG_ERR_IO at once (a child
 *             process with a deadline, so that a hang fails the test instead of stalling it)
 *   lock      a live lock refuses sg_save (SG_ERR_IO naming the holder) and leaves the
 *             checkpoint alone; a dead owner's lock on this host is removed; a lock from
 *             another host or one that is not a lock file is never removed; no lock stays
 *             behind after a save, failed or not
 *   race      two processes saving into one directory at the same moment, many trials: the
 *             directory always loads, bitwise equal to one of the savers, and a refused saver
 *             was refused because of the lock
 *   missing   a manifest naming a file that is not there never loads, at any world size
 *   efbig     the manifest cannot be written (RLIMIT_FSIZE makes its write fail, in a child):
 *             sg_save fails, the new generation's files are gone, the old checkpoint loads
 *   enospc    a real full disk (a small tmpfs, where this process may mount one): during the
 *             shard writes and during the manifest write; nothing of the failed save stays,
 *             the old checkpoint loads, and once space is back the next save works
 * SG_HARDEN_TRIALS sets the race trials (default 60). */
#define _GNU_SOURCE /* mkdtemp, mkfifo, fork, execv, mount, setrlimit */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_ckpt_util.h"

static char g_root[256], g_self[512];
static const model_cfg k_m = {3, {100, 37, 300}, SG_SHARD_GRAD_OP, SG_F32, 1024, 0, NULL};

/* ---------------------------------------------------------------------------------------- */
/* helpers                                                                                   */

static void path_in(char *buf, size_t n, const char *name) {
  snprintf(buf, n, "%s/%s", g_root, name);
}

static int exists(const char *dir, const char *name) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  struct stat s;
  return stat(p, &s) == 0;
}

/* Names in dir (other than . and ..), space separated, sorted by readdir order. */
static void listing(const char *dir, char *out, size_t n) {
  out[0] = 0;
  DIR *d = opendir(dir);
  if (!d) return;
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    if (de->d_name[0] == '.') continue;
    const size_t k = strlen(out);
    snprintf(out + k, n - k, "%s%s", k ? " " : "", de->d_name);
  }
  closedir(d);
}

/* Any file of generation g (name g<g>.r...) in dir. */
static int has_generation(const char *dir, int g) {
  char pre[32];
  snprintf(pre, sizeof pre, "g%d.", g);
  DIR *d = opendir(dir);
  if (!d) return 0;
  int found = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;) found |= !strncmp(de->d_name, pre, strlen(pre));
  closedir(d);
  return found;
}

static void rm_rf(const char *p) {
  char cmd[800];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
  if (system(cmd) != 0) printf("could not remove %s\n", p);
}

/* An engine of model m at W=1 trained `steps` steps, saved into dir. */
static sg_status save_w1(const model_cfg *m, const char *dir, int steps) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, m, &e, ids);
  if (!st) st = train(e, m, ids, 0, steps);
  if (!st) st = sg_save(e, dir);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return st;
}

/* Loads dir at W=1 into a fresh engine of model m; *s its state when it loaded. */
static sg_status load_w1(const model_cfg *m, const char *dir, snap *s) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  memset(s, 0, sizeof *s);
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, m, &e, ids);
  if (!st) st = sg_load(e, dir);
  if (!st) st = take_snap(e, m, ids, s);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return st;
}

/* The state of model m after `steps` steps, without any checkpoint. */
static void reference(const model_cfg *m, int steps, snap *s) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  memset(s, 0, sizeof *s);
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, m, &e, ids);
  if (!st) st = train(e, m, ids, 0, steps);
  if (!st) st = take_snap(e, m, ids, s);
  CHECK(st == SG_OK, "reference state after %d steps: %s", steps, sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

/* Runs this program again with args; returns its wait status, or -1 if it ran past
 * `deadline_s` (then it is killed). */
static int run_child(char *const args[], int deadline_s) {
  const pid_t pid = fork();
  if (pid == 0) {
    execv(g_self, args);
    _exit(127);
  }
  if (pid < 0) return -1;
  int status = 0;
  for (int ms = 0; ms < deadline_s * 1000; ms += 10) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

static int exit_code(int status) { return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

/* ---------------------------------------------------------------------------------------- */
/* fifo (item 3)                                                                             */

/* Child: every FIFO case, one failure bit each; exits with the bits. */
static int child_fifo(const char *dir) {
  int bad = 0;
  char p[400];
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  if (sg_comm_create_local(1, &c) || make_engine(c, &k_m, &e, ids)) return 64;
  /* dir/manifest a FIFO */
  snprintf(p, sizeof p, "%s/manifest", dir);
  if (mkfifo(p, 0644) != 0) return 65;
  sg_status st = sg_load(e, dir);
  if (st != SG_ERR_IO || !contains(sg_last_error(), "not a regular file")) bad |= 1;
  printf("  sg_load, manifest a FIFO: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  unlink(p);
  /* sg_import of a FIFO */
  snprintf(p, sizeof p, "%s/x.safetensors", dir);
  if (mkfifo(p, 0644) != 0) return 66;
  st = sg_import(e, p);
  if (st != SG_ERR_IO || !contains(sg_last_error(), "not a regular file")) bad |= 2;
  printf("  sg_import of a FIFO: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  /* sg_export onto a FIFO's temporary name */
  snprintf(p, sizeof p, "%s/y.safetensors.tmp", dir);
  if (mkfifo(p, 0644) != 0) return 67;
  snprintf(p, sizeof p, "%s/y.safetensors", dir);
  st = sg_export(e, p);
  if (st != SG_ERR_IO) bad |= 4;
  printf("  sg_export, its temporary a FIFO: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  /* sg_save with manifest.tmp a FIFO: fails, and the checkpoint already there still loads */
  snprintf(p, sizeof p, "%s/ck", dir);
  if (sg_save(e, p) != SG_OK) bad |= 8;
  snprintf(p, sizeof p, "%s/ck/manifest.tmp", dir);
  if (mkfifo(p, 0644) != 0) return 68;
  snprintf(p, sizeof p, "%s/ck", dir);
  st = sg_save(e, p);
  if (st != SG_ERR_IO) bad |= 16;
  printf("  sg_save, manifest.tmp a FIFO: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  if (sg_load(e, p) != SG_OK) bad |= 32;
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return bad;
}

static void test_fifo(void) {
  char dir[300];
  path_in(dir, sizeof dir, "fifo");
  mkdir(dir, 0755);
  char *args[] = {g_self, "--fifo", dir, NULL};
  const int status = run_child(args, 60);
  CHECK(status >= 0, "FIFOs: no call blocks (the child finished within 60 s)");
  const int bits = exit_code(status);
  CHECK(bits == 0, "FIFOs: sg_load (manifest), sg_import, sg_export and sg_save refuse them "
        "with SG_ERR_IO (failure bits 0x%x)", bits);
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* lock (item 2)                                                                             */

static void host_name(char *h, size_t n) {
  if (gethostname(h, n - 1) != 0) snprintf(h, n, "?");
  h[n - 1] = 0;
}

static void read_line(const char *path, char *out, size_t n) {
  out[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = 0;
  fclose(f);
}

/* A lock file as the library writes it, for pid on host (boot id and PID namespace of this
 * process). */
static void write_lock(const char *dir, long pid, const char *host, unsigned long long start) {
  char p[400], boot[64];
  struct stat ns;
  read_line("/proc/sys/kernel/random/boot_id", boot, sizeof boot);
  const unsigned long long pidns = stat("/proc/self/ns/pid", &ns) == 0 ? (unsigned long long)ns.st_ino : 0;
  snprintf(p, sizeof p, "%s/save.lock", dir);
  FILE *f = fopen(p, "w");
  if (!f) return;
  fprintf(f,
          "shardgrad save lock\npid %ld\nhost %s\nboot %s\npidns %llu\nstart %llu\nsince "
          "1700000000\ntoken 0123456789abcdef0123456789abcdef\n",
          pid, host, boot[0] ? boot : "-", pidns, start);
  fclose(f);
}

static long dead_pid(void) {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, NULL, 0);
  return (long)pid;
}

static void test_lock(void) {
  char dir[300], host[256], before[1000], after[1000];
  path_in(dir, sizeof dir, "lock");
  host_name(host, sizeof host);
  sg_status st = save_w1(&k_m, dir, 1);
  CHECK(st == SG_OK && !exists(dir, "save.lock"), "a save leaves no lock behind: %s",
        sg_last_error());
  /* held by a live process: this one */
  write_lock(dir, (long)getpid(), host, 0);
  listing(dir, before, sizeof before);
  st = save_w1(&k_m, dir, 2);
  listing(dir, after, sizeof after);
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "another save") &&
            contains(sg_last_error(), host),
        "a live lock refuses the save: %s \"%s\"", sg_status_string(st), sg_last_error());
  CHECK(strcmp(before, after) == 0 && exists(dir, "save.lock"),
        "the refused save touched nothing (before: %s; after: %s)", before, after);
  snap s, r1;
  reference(&k_m, 1, &r1);
  st = load_w1(&k_m, dir, &s);
  CHECK(st == SG_OK && same_snap("lock", &k_m, &s, &r1), "the checkpoint still loads: %s",
        sg_last_error());
  free_snap(&s);
  /* from another host: never broken */
  write_lock(dir, 1, "some-other-host.example", 0);
  st = save_w1(&k_m, dir, 2);
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "some-other-host.example") &&
            exists(dir, "save.lock"),
        "a lock from another host is kept and refuses the save: \"%s\"", sg_last_error());
  /* not a lock file */
  char p[400];
  snprintf(p, sizeof p, "%s/save.lock", dir);
  FILE *f = fopen(p, "w");
  if (f) {
    fputs("garbage", f);
    fclose(f);
  }
  st = save_w1(&k_m, dir, 2);
  CHECK(st == SG_ERR_IO && exists(dir, "save.lock"),
        "an unreadable lock refuses the save and stays: \"%s\"", sg_last_error());
  /* a dead owner on this host: removed, the save goes ahead */
  write_lock(dir, dead_pid(), host, 0);
  st = save_w1(&k_m, dir, 2);
  CHECK(st == SG_OK && !exists(dir, "save.lock"), "a dead saver's lock is removed: %s",
        sg_last_error());
  /* a live pid that started at another time than the lock says (pid reused) */
  write_lock(dir, (long)getpid(), host, 1);
  st = save_w1(&k_m, dir, 3);
  CHECK(st == SG_OK && !exists(dir, "save.lock"), "a lock whose pid was reused is removed: %s",
        sg_last_error());
  /* a save that fails (the directory is read-only... as root, make the manifest's temporary
   * a directory instead) releases the lock too */
  snprintf(p, sizeof p, "%s/manifest.tmp", dir);
  mkdir(p, 0755);
  st = save_w1(&k_m, dir, 4);
  CHECK(st != SG_OK && !exists(dir, "save.lock"), "a failed save releases the lock: %s \"%s\"",
        sg_status_string(st), sg_last_error());
  rmdir(p);
  snap r3;
  reference(&k_m, 3, &r3);
  st = load_w1(&k_m, dir, &s);
  CHECK(st == SG_OK && same_snap("lock", &k_m, &s, &r3), "step 3 loads: %s", sg_last_error());
  free_snap(&s);
  free_snap(&r1);
  free_snap(&r3);
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* two savers at once (item 2)                                                               */

/* Child: trains `steps` steps, waits until the parent closes the go pipe, saves. Exit 0 saved,
 * 10 refused by the lock, 11 other failure. */
static int child_saver(const char *dir, int steps, int go_fd) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = make_engine(c, &k_m, &e, ids);
  if (!st) st = train(e, &k_m, ids, 0, steps);
  if (st) return 12;
  if (write(1, "r", 1) != 1) return 13; /* ready */
  char b;
  while (read(go_fd, &b, 1) < 0 && errno == EINTR) {
  }
  st = sg_save(e, dir);
  const int locked = st == SG_ERR_IO && contains(sg_last_error(), "another save");
  if (st && !locked) fprintf(stderr, "saver: %s: %s\n", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return st == SG_OK ? 0 : locked ? 10 : 11;
}

/* same_snap without its report: 1 when bitwise equal. */
static int snap_eq(const model_cfg *m, const snap *a, const snap *b) {
  if (!a->ok || !b->ok) return 0;
  for (int k = 0; k < 4; k++)
    for (int p = 0; p < m->nparams; p++)
      if (memcmp(a->v[k][p], b->v[k][p], m->sizes[p] * 4) != 0) return 0;
  return 1;
}

static void test_race(void) {
  const char *env = getenv("SG_HARDEN_TRIALS");
  const int trials = env && atoi(env) > 0 ? atoi(env) : 60;
  char dir[300];
  path_in(dir, sizeof dir, "race");
  snap ref[3];
  for (int k = 1; k <= 2; k++) reference(&k_m, k, &ref[k]);
  int lost = 0, bad_exit = 0, refused = 0, both = 0;
  for (int t = 0; t < trials; t++) {
    rm_rf(dir);
    int go[2], ready[2];
    if (pipe(go) || pipe(ready)) break;
    pid_t pid[2];
    for (int k = 0; k < 2; k++) {
      pid[k] = fork();
      if (pid[k] == 0) {
        close(go[1]);
        close(ready[0]);
        dup2(ready[1], 1);
        char steps[8], fd[16];
        snprintf(steps, sizeof steps, "%d", k + 1);
        snprintf(fd, sizeof fd, "%d", go[0]);
        execv(g_self, (char *[]){g_self, "--saver", dir, steps, fd, NULL});
        _exit(127);
      }
    }
    close(go[0]);
    close(ready[1]);
    char b;
    int nready = 0;
    while (nready < 2 && read(ready[0], &b, 1) == 1) nready++;
    close(go[1]); /* both go */
    close(ready[0]);
    int code[2];
    for (int k = 0; k < 2; k++) {
      int status = 0;
      waitpid(pid[k], &status, 0);
      code[k] = exit_code(status);
    }
    bad_exit += (code[0] != 0 && code[0] != 10) || (code[1] != 0 && code[1] != 10);
    refused += (code[0] == 10) + (code[1] == 10);
    both += code[0] == 0 && code[1] == 0;
    snap s;
    const sg_status st = load_w1(&k_m, dir, &s);
    int match = 0;
    for (int k = 1; k <= 2 && st == SG_OK; k++)
      if (code[k - 1] == 0) match |= snap_eq(&k_m, &s, &ref[k]);
    if (st != SG_OK || !match) {
      lost++;
      if (lost <= 3)
        printf("  trial %d: savers exited %d and %d; load: %s \"%s\"\n", t, code[0], code[1],
               sg_status_string(st), sg_last_error());
    }
    free_snap(&s);
  }
  CHECK(lost == 0, "two concurrent savers, %d trials: the directory always loads as one of "
        "them (%d lost)", trials, lost);
  CHECK(bad_exit == 0, "each saver either saved or was refused by the lock (%d other failures)",
        bad_exit);
  printf("race: %d trials, %d saves refused by the lock, %d trials where both saved in turn\n",
         trials, refused, both);
  for (int k = 1; k <= 2; k++) free_snap(&ref[k]);
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* a manifest naming a missing file (item 2)                                                 */

typedef struct {
  const char *dir;
  sg_status st[4];
  char err[4][512];
} load_arg;

static void load_rank(int rank, int world, sg_comm *comm, void *arg) {
  load_arg *a = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &k_m, &e, ids);
  if (!st) st = sg_load(e, a->dir);
  a->st[rank] = st;
  snprintf(a->err[rank], sizeof a->err[rank], "%s", sg_last_error());
  sg_engine_destroy(e);
}

static void save_rank3(int rank, int world, sg_comm *comm, void *arg) {
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &k_m, &e, ids);
  if (!st) st = train(e, &k_m, ids, 0, 1);
  if (!st) st = sg_save(e, arg);
  if (rank == 0) CHECK(st == SG_OK, "W=3 save: %s", sg_last_error());
  sg_engine_destroy(e);
}

static void test_missing(void) {
  char dir[300], p[400], away[420];
  path_in(dir, sizeof dir, "missing");
  run_ranks(3, save_rank3, dir);
  for (int r = 0; r < 3; r++) {
    snprintf(p, sizeof p, "%s/g1.r%d.shard", dir, r);
    snprintf(away, sizeof away, "%s.away", p);
    rename(p, away);
    for (int w = 1; w <= 3; w++) {
      load_arg a = {dir, {SG_OK}, {""}};
      run_ranks(w, load_rank, &a);
      int all = 1;
      for (int k = 0; k < w; k++) all &= a.st[k] == SG_ERR_IO;
      char name[32];
      snprintf(name, sizeof name, "g1.r%d.shard", r);
      CHECK(all && contains(a.err[0], name),
            "file of rank %d missing, load at W=%d: refused on every rank (%s \"%s\")", r, w,
            sg_status_string(a.st[0]), a.err[0]);
    }
    rename(away, p);
  }
  load_arg a = {dir, {SG_OK}, {""}};
  run_ranks(2, load_rank, &a);
  CHECK(a.st[0] == SG_OK && a.st[1] == SG_OK, "with every file back it loads: %s", a.err[0]);
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* the manifest cannot be written (item 7)                                                   */

/* Many parameters with long names and one element each: a manifest far larger than the
 * rank files, so that a file size limit between the two fails just the manifest. */
#define LONG_N 400

static sg_status long_model(sg_comm *c, sg_engine **out, int steps) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 60000;
  sg_status st = sg_engine_create(c, &cfg, out);
  char name[256];
  int ids[LONG_N];
  for (int i = 0; i < LONG_N && !st; i++) {
    snprintf(name, sizeof name, "%0200d", i);
    st = sg_add_param(*out, name, 1, 0, &ids[i]);
  }
  if (!st) st = sg_finalize(*out);
  for (int s = 0; s < steps && !st; s++) {
    for (int i = LONG_N - 1; i >= 0 && !st; i--) {
      const float g = (float)((i + s) % 5) * 0.25f;
      st = sg_grad_add(*out, ids[i], &g, SG_F32);
    }
    if (!st) st = sg_step(*out, NULL);
  }
  return st;
}

typedef struct {
  const char *dir;
  int steps;
  sg_status st[2];
  char err[2][512];
} long_arg;

static void long_rank(int rank, int world, sg_comm *comm, void *arg) {
  long_arg *a = arg;
  sg_engine *e = NULL;
  sg_status st = long_model(comm, &e, a->steps);
  if (!st) st = sg_save(e, a->dir);
  a->st[rank] = st;
  snprintf(a->err[rank], sizeof a->err[rank], "%s", sg_last_error());
  sg_engine_destroy(e);
}

static sg_status long_save(const char *dir, int steps, char *err, size_t n) {
  long_arg a = {dir, steps, {SG_OK, SG_OK}, {"", ""}};
  run_ranks(2, long_rank, &a);
  snprintf(err, n, "%s", a.err[0]);
  return a.st[0] ? a.st[0] : a.st[1];
}

static sg_status long_load(const char *dir, uint64_t *step) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  sg_status st = sg_comm_create_local(1, &c);
  if (!st) st = long_model(c, &e, 0);
  if (!st) st = sg_load(e, dir);
  if (!st) st = sg_get_step(e, step);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return st;
}

static off_t file_size(const char *path) {
  struct stat s;
  return stat(path, &s) == 0 ? s.st_size : -1;
}

/* Child: with the files' size limit between the rank files' and the manifest's size, save
 * generation 2; exit 0 when the save failed and left nothing of generation 2. */
static int child_efbig(const char *dir, long limit) {
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit rl = {(rlim_t)limit, (rlim_t)limit};
  if (setrlimit(RLIMIT_FSIZE, &rl) != 0) return 70;
  char err[512], names[2000];
  const sg_status st = long_save(dir, 2, err, sizeof err);
  listing(dir, names, sizeof names);
  printf("  save with a %ld-byte file size limit: %s \"%s\"; left: %s\n", limit,
         sg_status_string(st), err, names);
  int bad = 0;
  if (st != SG_ERR_IO || !contains(err, "manifest")) bad |= 1;
  if (has_generation(dir, 2)) bad |= 2;
  if (exists(dir, "manifest.tmp") || exists(dir, "save.lock")) bad |= 4;
  return bad;
}

static void test_efbig(void) {
  char dir[300], err[512], p[400];
  path_in(dir, sizeof dir, "efbig");
  sg_status st = long_save(dir, 1, err, sizeof err);
  CHECK(st == SG_OK, "generation 1 of the long-named model: %s", err);
  snprintf(p, sizeof p, "%s/manifest", dir);
  const off_t mb = file_size(p);
  snprintf(p, sizeof p, "%s/g1.r0.shard", dir);
  const off_t sb = file_size(p);
  CHECK(sb > 0 && mb > 2 * sb, "the manifest (%lld bytes) is larger than a rank file (%lld)",
        (long long)mb, (long long)sb);
  char lim[32];
  snprintf(lim, sizeof lim, "%lld", (long long)(sb + (mb - sb) / 2));
  char *args[] = {g_self, "--efbig", dir, lim, NULL};
  const int bits = exit_code(run_child(args, 120));
  CHECK(bits == 0, "a failed manifest write: SG_ERR_IO, no file of the new generation, no "
        "manifest.tmp, no lock left (failure bits 0x%x)", bits);
  uint64_t step = 0;
  st = long_load(dir, &step);
  CHECK(st == SG_OK && step == 1, "the previous checkpoint (step 1) loads: %s (step %llu)",
        sg_last_error(), (unsigned long long)step);
  st = long_save(dir, 2, err, sizeof err);
  CHECK(st == SG_OK && !has_generation(dir, 1), "without the limit the next save works: %s", err);
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* a full disk (a tmpfs of our own)                                                          */

/* Fills the file system of dir until exactly `keep_blocks` blocks stay free. */
static int fill_to(const char *dir, unsigned long long keep_blocks) {
  struct statvfs v;
  if (statvfs(dir, &v) != 0) return 0;
  const unsigned long long bs = v.f_frsize ? v.f_frsize : v.f_bsize;
  if ((unsigned long long)v.f_bavail < keep_blocks) return 0;
  char p[400];
  snprintf(p, sizeof p, "%s/filler", dir);
  const int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return 0;
  static char zeros[1 << 16];
  unsigned long long left = ((unsigned long long)v.f_bavail - keep_blocks) * bs;
  while (left > 0) {
    const size_t n = left < sizeof zeros ? (size_t)left : sizeof zeros;
    const ssize_t w = write(fd, zeros, n);
    if (w <= 0) break;
    left -= (unsigned long long)w;
  }
  close(fd);
  return left == 0 && statvfs(dir, &v) == 0 && (unsigned long long)v.f_bavail == keep_blocks;
}

static void test_enospc(void) {
  char mnt[300], dir[320], err[512], p[400];
  path_in(mnt, sizeof mnt, "tmpfs");
  mkdir(mnt, 0755);
  if (mount("tmpfs", mnt, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m") != 0) {
    printf("(cannot mount a tmpfs here: %s; the ENOSPC cases are skipped)\n", strerror(errno));
    rmdir(mnt);
    return;
  }
  snprintf(dir, sizeof dir, "%s/ck", mnt);
  sg_status st = long_save(dir, 1, err, sizeof err);
  CHECK(st == SG_OK, "tmpfs: generation 1: %s", err);
  snprintf(p, sizeof p, "%s/manifest", dir);
  const unsigned long long mb = (unsigned long long)file_size(p);
  snprintf(p, sizeof p, "%s/g1.r0.shard", dir);
  const unsigned long long sb = (unsigned long long)file_size(p);
  struct statvfs v;
  statvfs(mnt, &v);
  const unsigned long long bs = v.f_frsize ? v.f_frsize : v.f_bsize;
  const unsigned long long bl_s = (sb + bs - 1) / bs, bl_m = (mb + bs - 1) / bs;
  /* 1: room for the lock (one block) and less than one rank file: the shard writes fail */
  snprintf(p, sizeof p, "%s/filler", mnt);
  CHECK(fill_to(mnt, 1 + bl_s - 1), "tmpfs: filled");
  st = long_save(dir, 2, err, sizeof err);
  char names[2000];
  listing(dir, names, sizeof names);
  CHECK(st == SG_ERR_IO && contains(err, "No space left") && !has_generation(dir, 2) &&
            !exists(dir, "save.lock"),
        "ENOSPC in the rank files: SG_ERR_IO, nothing of the save left (%s \"%s\"; left: %s)",
        sg_status_string(st), err, names);
  uint64_t step = 0;
  st = long_load(dir, &step);
  CHECK(st == SG_OK && step == 1, "tmpfs: generation 1 still loads: %s", sg_last_error());
  unlink(p);
  /* 2: room for both rank files, not for the manifest too */
  CHECK(fill_to(mnt, 1 + 2 * bl_s + bl_m - 1), "tmpfs: filled");
  st = long_save(dir, 2, err, sizeof err);
  listing(dir, names, sizeof names);
  CHECK(st == SG_ERR_IO && contains(err, "No space left") && contains(err, "manifest") &&
            !has_generation(dir, 2) && !exists(dir, "manifest.tmp") && !exists(dir, "save.lock"),
        "ENOSPC in the manifest: SG_ERR_IO, its rank files removed (%s \"%s\"; left: %s)",
        sg_status_string(st), err, names);
  st = long_load(dir, &step);
  CHECK(st == SG_OK && step == 1, "tmpfs: generation 1 still loads: %s", sg_last_error());
  unlink(p);
  st = long_save(dir, 2, err, sizeof err);
  st = st ? st : long_load(dir, &step);
  CHECK(st == SG_OK && step == 2 && !has_generation(dir, 1),
        "tmpfs: with space back the next save works and replaces generation 1: %s", err);
  if (umount2(mnt, MNT_DETACH) != 0) printf("umount %s: %s\n", mnt, strerror(errno));
  rmdir(mnt);
}

/* ---------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (readlink("/proc/self/exe", g_self, sizeof g_self - 1) <= 0)
    snprintf(g_self, sizeof g_self, "%s", argv[0]);
  if (argc >= 3 && strcmp(argv[1], "--fifo") == 0) return child_fifo(argv[2]);
  if (argc >= 5 && strcmp(argv[1], "--saver") == 0)
    return child_saver(argv[2], atoi(argv[3]), atoi(argv[4]));
  if (argc >= 4 && strcmp(argv[1], "--efbig") == 0) return child_efbig(argv[2], atol(argv[3]));
  const char *tmp = getenv("TMPDIR");
  snprintf(g_root, sizeof g_root, "%s/sg_harden_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_root)) return 1;
  test_fifo();
  test_lock();
  test_missing();
  test_efbig();
  test_enospc();
  test_race();
  rm_rf(g_root);
  return finish();
}
