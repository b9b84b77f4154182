/* Small helpers shared by every layer: dtype names, the monotonic clock, FNV-1a hashing,
 * per-rank file names, and the version / backend queries of the public API. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, CLOCK_MONOTONIC under -std=c11 */

#include <stdio.h>  /* snprintf */
#include <stdlib.h>
#include <string.h> /* strcmp, strlen, memcpy */
#include <time.h>   /* clock_gettime */

#include "sg_core.h" /* sg__dtype_name, sg__now_ms, sg__hash_bytes */

const char *sg__dtype_name(sg_dtype d) {
  switch (d) {
    case SG_F32: return "f32";
    case SG_BF16: return "bf16";
    case SG_F16: return "f16";
    case SG_DTYPE_AUTO: return "auto";
    case SG_Q8: return "q8";
  }
  return "unknown";
}

int64_t sg__now_ms(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;
  return (int64_t)ts.tv_sec * 1000 + (int64_t)(ts.tv_nsec / 1000000);
}

double sg__now_us(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

int sg__path_for_rank(const char *pattern, int rank, char *out, size_t cap) {
  char rs[16];
  if (rank >= 0)
    snprintf(rs, sizeof rs, "%d", rank);
  else
    snprintf(rs, sizeof rs, "x");
  size_t n = 0;
  for (const char *p = pattern; *p; p++) {
    const char *piece = p;
    size_t len = 1;
    if (p[0] == '%' && p[1] == 'r') {
      piece = rs;
      len = strlen(rs);
      p++;
    }
    if (n + len >= cap) return 0;
    memcpy(out + n, piece, len);
    n += len;
  }
  out[n] = '\0';
  return 1;
}

uint64_t sg__hash_bytes(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  if (!b) return h;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 0x100000001b3ull; /* FNV-1a 64-bit prime */
  }
  return h;
}

int sg_version(void) {
  return SG_VERSION_MAJOR * 10000 + SG_VERSION_MINOR * 100 + SG_VERSION_PATCH;
}

int sg_has_backend(const char *name) {
  if (!name) return 0;
  if (strcmp(name, "local") == 0) return 1;
#ifdef SG_HAVE_MPI
  if (strcmp(name, "mpi") == 0) return 1;
#endif
#ifdef SG_HAVE_CUDA
  if (strcmp(name, "cuda") == 0) return 1;
#endif
#ifdef SG_HAVE_NCCL
  if (strcmp(name, "nccl") == 0) return 1;
#endif
  return 0;
}
