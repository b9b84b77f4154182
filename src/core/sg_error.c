/* Thread-local last-error text (sg_last_error) and the status names (sg_status_string). */
#include <stdio.h>  /* vsnprintf, snprintf */
#include <string.h> /* strrchr, memmove, strlen */

#include "sg_core.h" /* sg__err, sg_status */

#define SG__ERR_CAP 1024

/* One buffer per thread so that concurrent engines (and local-comm rank threads) never see
 * each other's failures. */
static _Thread_local char sg__err_buf[SG__ERR_CAP];

/* Formats through a local buffer: callers may pass sg_last_error() itself as an argument. */
static void sg__err_vset(const char *fmt, va_list ap) {
  char tmp[SG__ERR_CAP];
  if (!fmt) {
    sg__err_buf[0] = '\0';
    return;
  }
  if (vsnprintf(tmp, sizeof tmp, fmt, ap) < 0) tmp[0] = '\0';
  memcpy(sg__err_buf, tmp, strlen(tmp) + 1);
}

sg_status sg__err(sg_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sg__err_vset(fmt, ap);
  va_end(ap);
  return st;
}

/* Only the basename: full build paths are noise in a message meant for users. */
static const char *sg__basename(const char *file) {
  if (!file) return "?";
  const char *s = strrchr(file, '/');
  const char *b = strrchr(file, '\\');
  if (b && (!s || b > s)) s = b;
  return s ? s + 1 : file;
}

sg_status sg__err_at(sg_status st, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  sg__err_vset(fmt, ap);
  va_end(ap);
  size_t n = strlen(sg__err_buf);
  if (n < sizeof sg__err_buf - 1)
    snprintf(sg__err_buf + n, sizeof sg__err_buf - n, " (%s:%d)", sg__basename(file), line);
  return st;
}

sg_status sg__err_prefix(sg_status st, const char *fn) {
  if (st == SG_OK || !fn || !fn[0]) return st;
  size_t plen = strlen(fn) + 2; /* "fn: " without the NUL is strlen+2 */
  size_t cap = sizeof sg__err_buf;
  /* already named by the layer below */
  if (strncmp(sg__err_buf, fn, plen - 2) == 0 && sg__err_buf[plen - 2] == ':') return st;
  if (plen >= cap - 1) return st;
  size_t n = strlen(sg__err_buf);
  if (n + plen > cap - 1) n = cap - 1 - plen; /* keep the prefix, truncate the tail */
  memmove(sg__err_buf + plen, sg__err_buf, n);
  memcpy(sg__err_buf, fn, plen - 2);
  sg__err_buf[plen - 2] = ':';
  sg__err_buf[plen - 1] = ' ';
  sg__err_buf[plen + n] = '\0';
  return st;
}

void sg__err_clear(void) { sg__err_buf[0] = '\0'; }

const char *sg_last_error(void) { return sg__err_buf; }

const char *sg_status_string(sg_status s) {
  switch (s) {
    case SG_OK: return "SG_OK";
    case SG_ERR_INVALID_ARGUMENT: return "SG_ERR_INVALID_ARGUMENT";
    case SG_ERR_INVALID_STATE: return "SG_ERR_INVALID_STATE";
    case SG_ERR_OUT_OF_MEMORY: return "SG_ERR_OUT_OF_MEMORY";
    case SG_ERR_UNSUPPORTED: return "SG_ERR_UNSUPPORTED";
    case SG_ERR_MISMATCH: return "SG_ERR_MISMATCH";
    case SG_ERR_COMM: return "SG_ERR_COMM";
    case SG_ERR_TIMEOUT: return "SG_ERR_TIMEOUT";
    case SG_ERR_IO: return "SG_ERR_IO";
    case SG_ERR_CORRUPT: return "SG_ERR_CORRUPT";
    case SG_ERR_CUDA: return "SG_ERR_CUDA";
    case SG_ERR_INTERNAL: return "SG_ERR_INTERNAL";
  }
  return "SG_ERR_UNKNOWN";
}
