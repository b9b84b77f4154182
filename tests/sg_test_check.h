/* sg_test_check.h — the check machinery shared by the C test programs.
 *
 * CHECK(cond, fmt, ...) counts one check as passed or failed and returns cond as 0/1, so it
 * can guard the rest of a test: `if (!CHECK(x, "...")) return;`. The counters sit behind one
 * mutex so worker threads may check concurrently; output lines are printed under the same
 * mutex so they never interleave. A failure prints
 *   FAIL file:line: [tag] message (cond; last error: "...")
 * with the stringified condition and, when set, the library's last error of this thread.
 *
 * Options (define before including):
 *   SG_TEST_PRINT_PASSES   1 (default): print "ok   [tag] message" for each passing check on a
 *                          thread whose sg_test_quiet is 0; 0: print failures only.
 *   SG_TEST_MAX_FAIL_LINES print at most this many FAIL lines (default 0 = no limit); every
 *                          failure is still counted.
 *   SG_TEST_DEFAULT_TAG    initial value of every thread's tag (default "").
 * End main with `return sg_test_summary("");`, which prints the `N passed, M failed` line. */
#ifndef SG_TEST_CHECK_H
#define SG_TEST_CHECK_H

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

#include "shardgrad.h" /* sg_last_error */

#ifndef SG_TEST_PRINT_PASSES
#define SG_TEST_PRINT_PASSES 1
#endif
#ifndef SG_TEST_MAX_FAIL_LINES
#define SG_TEST_MAX_FAIL_LINES 0
#endif
#ifndef SG_TEST_DEFAULT_TAG
#define SG_TEST_DEFAULT_TAG ""
#endif

static int sg_test_pass_, sg_test_fail_;
static pthread_mutex_t sg_test_lock_ = PTHREAD_MUTEX_INITIALIZER;
/* per thread: a prefix naming the case/rank, and whether to keep passing checks silent
 * (e.g. only rank 0 of a group prints them) */
static _Thread_local char sg_test_tag[96] = SG_TEST_DEFAULT_TAG;
static _Thread_local int sg_test_quiet;

static inline int sg_test_check_(int ok, const char *file, int line, const char *cond, const char *fmt, ...) {
  char what[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  const char *err = sg_last_error();
  const char *sp = sg_test_tag[0] ? " " : "";
  pthread_mutex_lock(&sg_test_lock_);
  if (ok) {
    sg_test_pass_++;
    if (SG_TEST_PRINT_PASSES && !sg_test_quiet) {
      printf("ok   %s%s%s\n", sg_test_tag, sp, what);
      fflush(stdout);
    }
  } else {
    sg_test_fail_++;
    if (SG_TEST_MAX_FAIL_LINES <= 0 || sg_test_fail_ <= SG_TEST_MAX_FAIL_LINES) {
      printf("FAIL %s:%d: %s%s%s (%s", file, line, sg_test_tag, sp, what, cond);
      if (err && err[0]) printf("; last error: \"%s\"", err);
      printf(")\n");
      fflush(stdout);
    }
  }
  pthread_mutex_unlock(&sg_test_lock_);
  return ok;
}

#define CHECK(cond, ...) sg_test_check_(!!(cond), __FILE__, __LINE__, #cond, __VA_ARGS__)

static inline int sg_test_failures(void) {
  pthread_mutex_lock(&sg_test_lock_);
  const int n = sg_test_fail_;
  pthread_mutex_unlock(&sg_test_lock_);
  return n;
}

/* Prints "<prefix>N passed, M failed"; returns the exit code: 0 when nothing failed, else 1. */
static inline int sg_test_summary(const char *prefix) {
  pthread_mutex_lock(&sg_test_lock_);
  const int pass = sg_test_pass_, fail = sg_test_fail_;
  pthread_mutex_unlock(&sg_test_lock_);
  printf("%s%d passed, %d failed\n", prefix, pass, fail);
  return fail ? 1 : 0;
}

#endif /* SG_TEST_CHECK_H */
