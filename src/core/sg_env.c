/* The library's environment settings, in one table (NCCL-style): every SG_* variable it reads,
 * with its type, default and one line of doc. docs/environment.md is generated from this table
 * (scripts/gen_env_doc.py; ctest test_env_doc fails when the two differ), so a new variable is a
 * row here and nowhere else.
 *
 * A variable is read once per process (the row says so) or at each use (an engine's or a
 * communicator's creation: a process may change it in between), always with one rule per type: a boolean is 1/0, true/false,
 * yes/no or on/off (any case); a number is a decimal integer within the row's range; a choice is
 * one of the row's words (any case); text is taken as it is. A value that does not parse counts as
 * unset (the default), and sg__env_report says so at WARN, as it says every value set to
 * something other than its default at INFO, once per process (at the first engine). A row may name an old spelling
 * (alias) that still works; the new name wins when both are set. The rows marked wire change
 * what ranks send each other: they are part of what the ranks agree on (sg__env_wire_words). */
#define _POSIX_C_SOURCE 200809L /* pthread_once under -std=c11 */

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h> /* getenv, strtol */
#include <string.h>

#include "sg_core.h"

typedef enum { SG__ENV_BOOL, SG__ENV_INT, SG__ENV_CHOICE, SG__ENV_TEXT } sg__env_type;

typedef struct sg__env_def {
  const char *name;
  const char *alias;   /* an old name that still works, or NULL */
  sg__env_type type;
  const char *def;     /* the default as the docs say it */
  const char *choices; /* CHOICE: "a|b|c" (the index is the value); INT: "min..max" */
  int wire;            /* 1: changes what ranks send each other */
  int once;            /* 1: read once per process; 0: at each use (an engine's or a
                          communicator's creation), so a process may change it in between */
  const char *doc;
} sg__env_def;

/* The table. Order = enum sg__env_id (sg_core.h); gen_env_doc.py reads the rows. */
static const sg__env_def sg__env_defs[SG__ENV_COUNT] = {
    [SG_ENV_LOG] = {"SG_LOG", NULL, SG__ENV_CHOICE, "warn", "off|warn|info|debug|none|0|trace", 0, 1,
                    "log level of the library's messages (stderr unless SG_LOG_FILE)"},
    [SG_ENV_LOG_FILE] = {"SG_LOG_FILE", NULL, SG__ENV_TEXT, "(stderr)", NULL, 0, 1,
                         "file the log goes to; %r in it becomes the rank, one file per rank"},
    [SG_ENV_TRACE] = {"SG_TRACE", NULL, SG__ENV_TEXT, "(none)", NULL, 0, 0,
                      "trace every engine from sg_finalize to this Chrome-trace JSON file (%r: rank)"},
    [SG_ENV_CPU_HUGEPAGES] = {"SG_CPU_HUGEPAGES", NULL, SG__ENV_BOOL, "1", NULL, 0, 1,
                              "CPU device: ask for transparent huge pages on ranges of 16 MiB and more"},
    /* not wire: a folding rank sends what a plain one does (DESIGN.md section 6) */
    [SG_ENV_COMM_FOLD] = {"SG_COMM_FOLD", NULL, SG__ENV_BOOL, "1", NULL, 0, 1,
                          "CPU engine: the channel folds its reduce-scatter sums into the accumulator"},
    [SG_ENV_COMM_RX_RELEASE] = {"SG_COMM_RX_RELEASE", NULL, SG__ENV_BOOL, "(transport's)", NULL, 0, 0,
                                "point-to-point collectives: give receive buffers' pages back between calls"},
    [SG_ENV_COLL_ALLGATHER] = {"SG_COLL_ALLGATHER", "SG_MPI_ALLGATHER", SG__ENV_CHOICE, "direct",
                               "direct|ring|mpi", 1, 0,
                               "all-gather algorithm of the point-to-point collectives (MPI, the caller's transport); mpi: the transport's own"},
    [SG_ENV_COLL_REDUCE_SCATTER] = {"SG_COLL_REDUCE_SCATTER", "SG_MPI_REDUCE_SCATTER", SG__ENV_CHOICE,
                                    "(ring at 2 ranks, else direct)", "direct|ring", 1, 0,
                                    "reduce-scatter (and all-reduce) algorithm of the point-to-point collectives"},
    [SG_ENV_COMM_WAIT] = {"SG_COMM_WAIT", NULL, SG__ENV_CHOICE, "sleep", "sleep|yield", 0, 0,
                          "how a rank waits for its peers in the point-to-point collectives"},
    [SG_ENV_NCCL_INIT_TIMEOUT_MS] = {"SG_NCCL_INIT_TIMEOUT_MS", NULL, SG__ENV_INT, "600000",
                                     "1..2147483647", 0, 0,
                                     "NCCL: how long creating a communicator may wait for the other ranks"},
    [SG_ENV_NCCL_ID_FILE] = {"SG_NCCL_ID_FILE", NULL, SG__ENV_TEXT, "(none)", NULL, 0, 0,
                             "NCCL without MPI: the file through which rank 0 hands out the unique id"},
    [SG_ENV_NCCL_LIBRARY] = {"SG_NCCL_LIBRARY", NULL, SG__ENV_TEXT, "(libnccl.so.2, libnccl.so)", NULL, 0, 0,
                             "the NCCL library to load at run time"},
};

typedef struct sg__env_val {
  const char *raw; /* the environment's text (the name's, else the alias's), NULL: unset */
  int from_alias;
  int bad;         /* set but not understood */
  long num;        /* BOOL 0/1, INT the number, CHOICE the index */
} sg__env_val;

static pthread_once_t sg__env_once = PTHREAD_ONCE_INIT;
static sg__env_val sg__env_vals[SG__ENV_COUNT]; /* the rows read once */
static atomic_int sg__env_reported;

static int ieq(const char *a, const char *b) {
  for (; *a && *b; a++, b++) {
    const char ca = (*a >= 'A' && *a <= 'Z') ? (char)(*a - 'A' + 'a') : *a;
    if (ca != *b) return 0;
  }
  return *a == *b;
}

static int parse_bool(const char *s, long *out) {
  static const char *const on[] = {"1", "true", "yes", "on"}, *const off[] = {"0", "false", "no", "off"};
  for (int k = 0; k < 4; k++) {
    if (ieq(s, on[k])) return *out = 1, 1;
    if (ieq(s, off[k])) return *out = 0, 1;
  }
  return 0;
}

static int parse_int(const char *s, const char *range, long *out) {
  char *end = NULL;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (end == s || *end != '\0' || errno) return 0;
  const long lo = strtol(range, &end, 10), hi = strtol(end + 2, NULL, 10);
  if (v < lo || v > hi) return 0;
  *out = v;
  return 1;
}

/* The index of s among the words of "a|b|c" (any case). */
static int parse_choice(const char *s, const char *choices, long *out) {
  long k = 0;
  for (const char *w = choices; *w; k++) {
    const char *bar = strchr(w, '|');
    const size_t n = bar ? (size_t)(bar - w) : strlen(w);
    char word[32];
    if (n < sizeof word) {
      memcpy(word, w, n);
      word[n] = '\0';
      if (ieq(s, word)) return *out = k, 1;
    }
    if (!bar) break;
    w = bar + 1;
  }
  return 0;
}

static void parse_one(const sg__env_def *d, sg__env_val *v) {
  v->raw = getenv(d->name);
  if ((!v->raw || !v->raw[0]) && d->alias && (v->raw = getenv(d->alias)) && v->raw[0])
    v->from_alias = 1;
  if (!v->raw || !v->raw[0]) {
    v->raw = NULL;
    return;
  }
  switch (d->type) {
    case SG__ENV_BOOL: v->bad = !parse_bool(v->raw, &v->num); break;
    case SG__ENV_INT: v->bad = !parse_int(v->raw, d->choices, &v->num); break;
    case SG__ENV_CHOICE: v->bad = !parse_choice(v->raw, d->choices, &v->num); break;
    case SG__ENV_TEXT: break;
  }
}

static void parse_once(void) {
  for (int i = 0; i < SG__ENV_COUNT; i++)
    if (sg__env_defs[i].once) parse_one(&sg__env_defs[i], &sg__env_vals[i]);
}

/* A row read once: its value from the first use; any other: read now. */
static sg__env_val val(sg__env_id id) {
  if (sg__env_defs[id].once) {
    pthread_once(&sg__env_once, parse_once);
    return sg__env_vals[id];
  }
  sg__env_val v = {0};
  parse_one(&sg__env_defs[id], &v);
  return v;
}

const char *sg__env_name(sg__env_id id) { return sg__env_defs[id].name; }

const char *sg__env_text(sg__env_id id) { return val(id).raw; }

long sg__env_value(sg__env_id id, long if_unset) {
  const sg__env_val v = val(id);
  return v.raw && !v.bad ? v.num : if_unset;
}

/* The row's default as a value (BOOL, INT, CHOICE), where its doc text is one. */
static int default_num(const sg__env_def *d, long *out) {
  switch (d->type) {
    case SG__ENV_BOOL: return parse_bool(d->def, out);
    case SG__ENV_INT: return parse_int(d->def, d->choices, out);
    case SG__ENV_CHOICE: return parse_choice(d->def, d->choices, out);
    case SG__ENV_TEXT: return 0;
  }
  return 0;
}

static int is_default(const sg__env_def *d, const sg__env_val *v) {
  long n = 0;
  return default_num(d, &n) ? n == v->num : strcmp(v->raw, d->def) == 0;
}

void sg__env_report(int rank) {
  if (atomic_exchange(&sg__env_reported, 1)) return;
  for (int i = 0; i < SG__ENV_COUNT; i++) {
    const sg__env_def *d = &sg__env_defs[i];
    const sg__env_val vv = val((sg__env_id)i), *v = &vv;
    if (!v->raw) continue;
    const char *name = v->from_alias ? d->alias : d->name;
    if (v->bad)
      SG_LOG(SG_LOG_WARN, rank, "%s=%s is not understood (%s%s); using the default, %s", name,
             v->raw, d->type == SG__ENV_BOOL ? "1/0, true/false, yes/no or on/off" : "expected ",
             d->type == SG__ENV_BOOL ? "" : d->choices, d->def);
    else if (v->from_alias)
      SG_LOG(SG_LOG_INFO, rank, "%s=%s (the old name of %s)", d->alias, v->raw, d->name);
    else if (!is_default(d, v))
      SG_LOG(SG_LOG_INFO, rank, "%s=%s", d->name, v->raw);
  }
}

int sg__env_wire_words(uint64_t *out, int n, const char **names) {
  int k = 0;
  for (int i = 0; i < SG__ENV_COUNT; i++) {
    if (!sg__env_defs[i].wire) continue;
    if (k < n) {
      /* unset and set to its default are different words: the default may depend on the rank
       * count, which the ranks agree on elsewhere */
      out[k] = (uint64_t)(sg__env_value((sg__env_id)i, -1) + 1);
      if (names) names[k] = sg__env_defs[i].name;
    }
    k++;
  }
  return k;
}
