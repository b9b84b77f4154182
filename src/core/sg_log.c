/* The logger behind SG_LOG: level and destination come from the environment, read once.
 * SG_LOG=off|warn|info|debug (default warn), SG_LOG_FILE=path where %r
 * becomes the rank, so that every rank writes its own file. */
#define _POSIX_C_SOURCE 200809L /* POSIX declarations (pthread) under -std=c11 */

#include <pthread.h> /* pthread_once, pthread_mutex */
#include <stdio.h>   /* FILE, fopen, fprintf, vsnprintf */
#include <stdlib.h>  /* malloc, realloc, free */
#include <string.h>  /* strlen, strrchr, memcpy */

#include "sg_core.h" /* sg__log_level */

#define SG__LOG_LINE 2048
#define SG__LOG_PATH 4096

/* An opened (or failed) destination for one rank; ranks < 0 share slot "x". */
typedef struct sg__log_dest {
  int rank;
  FILE *f; /* NULL: open failed, use stderr */
} sg__log_dest;

static pthread_once_t sg__log_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t sg__log_mu = PTHREAD_MUTEX_INITIALIZER;
static int sg__log_level_cur = SG_LOG_WARN; /* written once under pthread_once, then read-only */
static char sg__log_pattern[SG__LOG_PATH];  /* "" when SG_LOG_FILE is unset: stderr */
static int sg__log_per_rank;                /* pattern contains %r */
static sg__log_dest *sg__log_dests;         /* guarded by sg__log_mu */
static size_t sg__log_ndests, sg__log_capdests;

/* fork() while another thread writes a line: the child gets the mutex locked by a thread it
 * does not have. Held across the fork, released on both sides. */
static void sg__log_fork_lock(void) { pthread_mutex_lock(&sg__log_mu); }
static void sg__log_fork_unlock(void) { pthread_mutex_unlock(&sg__log_mu); }

/* SG_LOG's words (sg_env.c: off|warn|info|debug, and the synonyms none, 0, trace) as levels;
 * unset or not understood: warn. */
static void sg__log_init(void) {
  (void)pthread_atfork(sg__log_fork_lock, sg__log_fork_unlock, sg__log_fork_unlock);
  static const int level[] = {0, SG_LOG_WARN, SG_LOG_INFO, SG_LOG_DEBUG, 0, 0, SG_LOG_DEBUG};
  sg__log_level_cur = level[sg__env_value(SG_ENV_LOG, 1)];
  const char *path = sg__env_text(SG_ENV_LOG_FILE);
  if (path && path[0] && strlen(path) < sizeof sg__log_pattern) {
    memcpy(sg__log_pattern, path, strlen(path) + 1);
    sg__log_per_rank = strstr(path, "%r") != NULL;
  }
}

int sg__log_enabled(sg__log_level lvl) {
  pthread_once(&sg__log_once, sg__log_init);
  return (int)lvl <= sg__log_level_cur;
}

/* Destination for rank; called with sg__log_mu held. Files are opened on first use, in append
 * mode, and kept open for the life of the process. */
static FILE *sg__log_stream(int rank) {
  if (!sg__log_pattern[0]) return stderr;
  int key = sg__log_per_rank ? (rank >= 0 ? rank : -1) : 0;
  for (size_t i = 0; i < sg__log_ndests; i++)
    if (sg__log_dests[i].rank == key) return sg__log_dests[i].f ? sg__log_dests[i].f : stderr;
  if (sg__log_ndests == sg__log_capdests) {
    size_t cap = sg__log_capdests ? 2 * sg__log_capdests : 8;
    sg__log_dest *d = realloc(sg__log_dests, cap * sizeof *d);
    if (!d) return stderr;
    sg__log_dests = d;
    sg__log_capdests = cap;
  }
  char path[SG__LOG_PATH + 32];
  FILE *f = sg__path_for_rank(sg__log_pattern, key, path, sizeof path) ? fopen(path, "a") : NULL;
  sg__log_dests[sg__log_ndests].rank = key;
  sg__log_dests[sg__log_ndests].f = f; /* a failed open is remembered: no retry per line */
  sg__log_ndests++;
  return f ? f : stderr;
}

static const char *sg__log_level_name(sg__log_level lvl) {
  switch (lvl) {
    case SG_LOG_WARN: return "WARN";
    case SG_LOG_INFO: return "INFO";
    case SG_LOG_DEBUG: return "DEBUG";
  }
  return "?";
}

static const char *sg__log_basename(const char *file) {
  if (!file) return "?";
  const char *s = strrchr(file, '/');
  return s ? s + 1 : file;
}

void sg__log(sg__log_level lvl, int rank, const char *file, int line, const char *fmt, ...) {
  if (!fmt || !sg__log_enabled(lvl)) return;
  char msg[SG__LOG_LINE];
  va_list ap;
  va_start(ap, fmt);
  if (vsnprintf(msg, sizeof msg, fmt, ap) < 0) msg[0] = '\0';
  va_end(ap);
  char rs[16];
  if (rank >= 0)
    snprintf(rs, sizeof rs, "%d", rank);
  else
    snprintf(rs, sizeof rs, "-");
  /* One fprintf per line under the mutex: lines of concurrent ranks never interleave. */
  pthread_mutex_lock(&sg__log_mu);
  FILE *f = sg__log_stream(rank);
  fprintf(f, "shardgrad[%s] %s %s:%d: %s\n", rs, sg__log_level_name(lvl), sg__log_basename(file),
          line, msg);
  fflush(f);
  pthread_mutex_unlock(&sg__log_mu);
}
