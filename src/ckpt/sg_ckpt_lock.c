/* The save lock: one sg_save at a time per checkpoint directory.
 *
 * Two savers in one directory would each delete the other's files as "older generations" and
 * could leave a manifest naming a deleted file. So rank 0 of a save holds `save.lock` in the
 * directory from before it picks the generation until the save has finished or failed.
 *
 * The lock file is created atomically complete (written under a private name, then hard-linked
 * to `save.lock`, which fails if it exists) and names its owner: pid, host name, PID namespace,
 * boot id, the process's start time, and a random token. A lock is stale, and is removed by the
 * next saver, only when its owner provably is gone:
 *   - same host, same boot, same PID namespace: the pid no longer exists, or now belongs to a
 *     process that started at another time (the pid was reused);
 *   - same host, another boot id: the machine rebooted since.
 * A lock held from another host (or another PID namespace of this host) is never broken:
 * nothing here can tell whether that process still runs. The save then fails with SG_ERR_IO
 * naming the owner; delete the file by hand once that save is known to be over.
 * Breaking a stale lock renames it away and checks that what was moved is the stale lock that
 * was read (and puts it back otherwise), so two savers that both find the same stale lock do
 * not take the lock together. */
#define _DEFAULT_SOURCE /* gethostname, kill, link */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sg_ckpt.h"

#define LOCK_MAX 1024 /* bytes of a lock file we read */

typedef struct {
  long pid;
  char host[256], boot[64];
  uint64_t pidns, start, since;
  char token[40];
} owner;

/* ---------------------------------------------------------------------------------------- */
/* who we are                                                                                */

/* From /proc/<pid>/stat: field 3 (state letter) into *state, and field 22 (start time in clock
 * ticks after boot) returned; 0 when unknown. */
static uint64_t proc_start(long pid, char *state) {
  char path[64], buf[1024];
  if (state) *state = 0;
  snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  const size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
  if (!p || p[1] != ' ') return 0;
  if (state) *state = p[2];
  int field = 2;
  for (; *p && field < 22; p++)
    if (*p == ' ') field++;
  return field == 22 ? strtoull(p, NULL, 10) : 0;
}

static void read_line(const char *path, char *out, size_t n) {
  out[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = 0;
  fclose(f);
}

static uint64_t pid_namespace(void) {
  struct stat s;
  return stat("/proc/self/ns/pid", &s) == 0 ? (uint64_t)s.st_ino : 0;
}

static void random_token(char *out, size_t n) {
  uint64_t r[2] = {0, 0};
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    r[0] = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 20) ^ (uint64_t)getpid();
    r[1] = (uint64_t)(uintptr_t)&t;
  }
  if (fd >= 0) close(fd);
  snprintf(out, n, "%016" PRIx64 "%016" PRIx64, r[0], r[1]);
}

static void me(owner *o) {
  memset(o, 0, sizeof *o);
  o->pid = (long)getpid();
  if (gethostname(o->host, sizeof o->host - 1) != 0) snprintf(o->host, sizeof o->host, "?");
  read_line("/proc/sys/kernel/random/boot_id", o->boot, sizeof o->boot);
  o->pidns = pid_namespace();
  o->start = proc_start(o->pid, NULL);
  o->since = (uint64_t)time(NULL);
  random_token(o->token, sizeof o->token);
}

static int format_owner(const owner *o, char *buf, size_t n) {
  return snprintf(buf, n,
                  "shardgrad save lock\npid %ld\nhost %s\nboot %s\npidns %" PRIu64
                  "\nstart %" PRIu64 "\nsince %" PRIu64 "\ntoken %s\n",
                  o->pid, o->host, o->boot[0] ? o->boot : "-", o->pidns, o->start, o->since,
                  o->token);
}

/* 1 when buf is a complete lock file. */
static int parse_owner(const char *buf, owner *o) {
  memset(o, 0, sizeof *o);
  char boot[64] = "";
  const int k = sscanf(buf,
                       "shardgrad save lock\npid %ld\nhost %255s\nboot %63s\npidns %" SCNu64
                       "\nstart %" SCNu64 "\nsince %" SCNu64 "\ntoken %39s",
                       &o->pid, o->host, boot, &o->pidns, &o->start, &o->since, o->token);
  if (k != 7 || o->pid <= 0) return 0;
  if (strcmp(boot, "-") != 0) snprintf(o->boot, sizeof o->boot, "%s", boot);
  return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* staleness                                                                                 */

/* 1 when the owner is provably gone (see the file comment); 0 when alive or unknowable. */
static int owner_gone(const owner *o, const owner *self) {
  if (strcmp(o->host, self->host) != 0) return 0;
  if (o->boot[0] && self->boot[0] && strcmp(o->boot, self->boot) != 0) return 1; /* rebooted */
  if (o->pidns != self->pidns) return 0;
  if (kill((pid_t)o->pid, 0) != 0 && errno == ESRCH) return 1;
  char state = 0;
  const uint64_t now = proc_start(o->pid, &state);
  if (state == 'Z' || state == 'X') return 1; /* killed, not yet reaped by its parent */
  return o->start != 0 && now != 0 && now != o->start; /* the pid was reused */
}

/* ---------------------------------------------------------------------------------------- */
/* files                                                                                     */

/* The lock file's text (NUL-terminated) into buf: 1, or 0 when it does not exist (any more),
 * or -1 with errno when it cannot be read. Sets no error text (release must keep a failed
 * save's message). */
static int read_lock(const char *path, char *buf, size_t n) {
  /* O_NOFOLLOW: a link planted as the lock must not show another file's text in our message */
  const int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 0 : -1;
  struct stat s;
  ssize_t len = -1;
  if (fstat(fd, &s) != 0)
    len = -1;
  else if (!S_ISREG(s.st_mode))
    errno = EINVAL;
  else
    len = read(fd, buf, n - 1);
  const int err = errno;
  close(fd);
  if (len < 0) {
    errno = err;
    return -1;
  }
  buf[len] = 0;
  return 1;
}

/* Writes text under a private name, then links it to `lock`: EEXIST when the lock is held.
 * File systems without hard links get an O_EXCL create of the lock itself. */
static int create_lock(const char *lock, const char *text, const owner *self) {
  const size_t n = strlen(text);
  char *tmp = malloc(strlen(lock) + 64);
  if (!tmp) return ENOMEM;
  sprintf(tmp, "%s.%ld.%.8s", lock, self->pid, self->token);
  int err = 0;
  const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, text, n) != (ssize_t)n) err = errno ? errno : EIO;
  if (fd >= 0) close(fd);
  if (!err && link(tmp, lock) != 0) err = errno;
  if (fd >= 0) unlink(tmp);
  free(tmp);
  if (err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == EXDEV || err == EMLINK) {
    const int fd2 = open(lock, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd2 < 0) return errno;
    err = write(fd2, text, n) == (ssize_t)n ? 0 : (errno ? errno : EIO);
    close(fd2);
    if (err) unlink(lock);
  }
  return err;
}

/* Moves the stale lock `seen` out of the way. 1 when it was removed (try again), 0 when the
 * lock changed meanwhile (someone else broke it and took it: it was put back). */
static int break_lock(const char *lock, const char *seen, const owner *self) {
  char *moved = malloc(strlen(lock) + 64);
  if (!moved) return 0;
  sprintf(moved, "%s.stale.%ld.%.8s", lock, self->pid, self->token);
  int removed = 1;
  if (rename(lock, moved) == 0) {
    char now[LOCK_MAX];
    if (read_lock(moved, now, sizeof now) == 1 && strcmp(now, seen) != 0) {
      removed = 0;
      (void)link(moved, lock); /* fails only if a third saver holds it by now: theirs stands */
    }
    unlink(moved);
  }
  free(moved);
  return removed;
}

static sg_status busy(const char *lock, const char *text, const owner *o, int parsed) {
  if (!parsed)
    return sg__err(SG_ERR_IO,
                   "'%s' exists but is not a complete lock file, so the directory may be in use "
                   "by another save; remove it if no save is running (%.60s)",
                   lock, text);
  char when[64] = "?";
  const time_t t = (time_t)o->since;
  struct tm tm;
  if (gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return sg__err(SG_ERR_IO,
                 "another save is writing into this directory: '%s' is held by pid %ld on host "
                 "'%s' since %s; if that process is gone (a lock from another host is never "
                 "removed automatically), delete the file",
                 lock, o->pid, o->host, when);
}

/* ---------------------------------------------------------------------------------------- */

sg_status sg__ck_lock_acquire(const char *dir, sg__ck_lock *l) {
  memset(l, 0, sizeof *l);
  l->path = sg__ck_path(dir, SG_CK_LOCK_NAME);
  if (!l->path) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  owner self;
  me(&self);
  format_owner(&self, l->text, sizeof l->text);
  char eb[128], seen[LOCK_MAX];
  for (int attempt = 0; attempt < 8; attempt++) {
    const int err = create_lock(l->path, l->text, &self);
    if (err == 0) {
      l->held = 1;
      return SG_OK;
    }
    if (err != EEXIST)
      return sg__err(SG_ERR_IO, "cannot create the lock '%s': %s", l->path,
                     sg__ck_errstr(err, eb, sizeof eb));
    const int got = read_lock(l->path, seen, sizeof seen);
    if (got < 0)
      return sg__err(SG_ERR_IO, "cannot read the lock '%s': %s", l->path,
                     errno == ELOOP ? "it is a symbolic link (never followed); remove it"
                                    : sg__ck_errstr(errno, eb, sizeof eb));
    if (got == 0) continue; /* released meanwhile */
    owner o;
    const int parsed = parse_owner(seen, &o);
    if (!parsed || !owner_gone(&o, &self)) return busy(l->path, seen, &o, parsed);
    SG_LOG(SG_LOG_WARN, 0, "sg_save: removing the stale lock '%s' of pid %ld (no longer running)",
           l->path, o.pid);
    if (!break_lock(l->path, seen, &self) && read_lock(l->path, seen, sizeof seen) == 1 &&
        parse_owner(seen, &o))
      return busy(l->path, seen, &o, 1);
  }
  return sg__err(SG_ERR_IO, "cannot take the lock '%s': it keeps changing (other saves?)",
                 l->path);
}

void sg__ck_lock_release(sg__ck_lock *l) {
  if (l->held) {
    char now[LOCK_MAX];
    /* Only our own lock is removed: if somebody broke it by hand and another save holds it
     * now, that one stays. */
    if (read_lock(l->path, now, sizeof now) == 1 && strcmp(now, l->text) == 0)
      unlink(l->path);
    else
      SG_LOG(SG_LOG_WARN, 0, "sg_save: the lock '%s' was no longer ours at the end of the save",
             l->path);
  }
  free(l->path);
  memset(l, 0, sizeof *l);
}
