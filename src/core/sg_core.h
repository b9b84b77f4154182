/* Internal core: error text, check macros, logging, dtype helpers. Included by every layer. */
#ifndef SG_CORE_H
#define SG_CORE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "shardgrad.h" /* sg_status, sg_dtype */

/* Records the failure text for sg_last_error() (thread-local) and returns st, so that a check
 * reads `return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_add_param: numel must be >= 1 ...")`. */
sg_status sg__err(sg_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Like sg__err, appending " (file:line)". For errors from CUDA, NCCL, MPI and the OS. */
sg_status sg__err_at(sg_status st, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* Prefixes the current error text with "fn: " (used when a lower layer already set it). */
sg_status sg__err_prefix(sg_status st, const char *fn);
void sg__err_clear(void);

/* Propagate a failure. The callee has already set the text. */
#define SG_TRY(expr)                                                                             \
  do {                                                                                           \
    sg_status sg__st_ = (expr);                                                                  \
    if (sg__st_ != SG_OK) return sg__st_;                                                        \
  } while (0)
#define SG_TRY_GOTO(expr, st, label)                                                             \
  do {                                                                                           \
    (st) = (expr);                                                                               \
    if ((st) != SG_OK) goto label;                                                               \
  } while (0)

/* Logging: SG_LOG=warn|info|debug (default warn), SG_LOG_FILE=path (%r -> rank). */
typedef enum { SG_LOG_WARN = 1, SG_LOG_INFO = 2, SG_LOG_DEBUG = 3 } sg__log_level;
int sg__log_enabled(sg__log_level lvl);
void sg__log(sg__log_level lvl, int rank, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;
/* rank < 0: not tied to a rank */
#define SG_LOG(lvl, rank, ...)                                                                   \
  do {                                                                                           \
    if (sg__log_enabled(lvl)) sg__log((lvl), (rank), __FILE__, __LINE__, __VA_ARGS__);           \
  } while (0)

/* dtype helpers */
static inline size_t sg__dtype_size(sg_dtype d) { return d == SG_F32 ? 4u : 2u; }
static inline int sg__dtype_valid(int d) { return d == SG_F32 || d == SG_BF16 || d == SG_F16; }
const char *sg__dtype_name(sg_dtype d);

/* Monotonic clock in milliseconds, and a deadline helper: timeout_ms <= 0 means none. */
int64_t sg__now_ms(void);
static inline int64_t sg__deadline(int timeout_ms) {
  return timeout_ms > 0 ? sg__now_ms() + timeout_ms : INT64_MAX;
}

/* Monotonic clock in microseconds (tracing on the CPU device). */
double sg__now_us(void);
/* The environment settings (sg_env.c: the one table of every SG_* variable, its type, default
 * and doc; docs/environment.md is generated from it). Read once, on first use. */
typedef enum sg__env_id {
  SG_ENV_LOG,
  SG_ENV_LOG_FILE,
  SG_ENV_TRACE,
  SG_ENV_CPU_HUGEPAGES,
  SG_ENV_COMM_FOLD,
  SG_ENV_COMM_RX_RELEASE,
  SG_ENV_COLL_ALLGATHER,
  SG_ENV_COLL_REDUCE_SCATTER,
  SG_ENV_COMM_WAIT,
  SG_ENV_NCCL_INIT_TIMEOUT_MS,
  SG_ENV_NCCL_ID_FILE,
  SG_ENV_NCCL_LIBRARY,
  SG__ENV_COUNT
} sg__env_id;
const char *sg__env_name(sg__env_id id);
/* The variable's text as set (NULL: unset or empty). */
const char *sg__env_text(sg__env_id id);
/* A boolean (0/1), a number, or a choice's index among the row's words; if_unset when it is
 * unset or not understood. */
long sg__env_value(sg__env_id id, long if_unset);
/* Once per process: every value not understood at WARN, every other value set at INFO. */
void sg__env_report(int rank);
/* The settings that change the wire protocol, one word each (0: unset), into out[0..n) with
 * their names; returns how many there are. Part of the ranks' agreement at sg_finalize. */
int sg__env_wire_words(uint64_t *out, int n, const char **names);

/* `pattern` with every "%r" replaced by the rank ("x" for rank < 0) into out[cap]; 0 when it
 * does not fit. File names of SG_LOG_FILE, SG_TRACE and sg_trace_write. */
int sg__path_for_rank(const char *pattern, int rank, char *out, size_t cap);

/* Creates path as a new regular file for writing (sg_file.c): never through a symbolic link
 * or onto anything that exists. A regular file already under the name (a crashed writer's
 * temporary) is removed first (*removed_stale = 1; may be NULL); anything else is refused.
 * 0 with *fd open, or an errno value: EEXIST when something other than a stale regular file
 * holds the name (sg__file_exists_why(path) says what). */
int sg__file_create(const char *path, int mode, int *fd, int *removed_stale);
const char *sg__file_exists_why(const char *path);

/* Hashing (FNV-1a 64) for plan and config agreement across ranks. */
uint64_t sg__hash_bytes(uint64_t h, const void *p, size_t n);
#define SG__HASH_INIT 0xcbf29ce484222325ull

/* The config with defaults for fields the caller's struct_size does not cover. */
sg_status sg__config_copy(const sg_config *in, sg_config *out, const char *fn);
/* Validates a complete config: ranges, dtypes, combinations. fn names the caller. */
sg_status sg__config_check(const sg_config *c, const char *fn);
/* The effective static/initial loss scale for the config (dynamic scaling for f16). */
int sg__config_dynamic_scale(const sg_config *c);
/* The config as 64-bit words (ints sign-extended, floats as their bits): the one list of what
 * every rank must agree on at sg_finalize (and what the plan hash covers). A checkpoint's
 * manifest records the first SG__CONFIG_CK_WORDS of them (its format fixes that count), so new
 * words are appended after those. Writes the first n words. */
#define SG__CONFIG_NWORDS 23
#define SG__CONFIG_CK_WORDS 21
void sg__config_words(const sg_config *c, uint64_t *w, int n);
/* The field name of word k, for messages. */
const char *sg__config_word_name(int k);

#endif /* SG_CORE_H */
