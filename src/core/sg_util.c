/* Small helpers shared by every layer: dtype names, the monotonic clock, FNV-1a hashing,
 * and the version / backend queries of the public API. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, CLOCK_MONOTONIC under -std=c11 */

#include <string.h> /* strcmp */
#include <time.h>   /* clock_gettime */

#include "sg_core.h" /* sg__dtype_name, sg__now_ms, sg__hash_bytes */

const char *sg__dtype_name(sg_dtype d) {
  switch (d) {
    case SG_F32: return "f32";
    case SG_BF16: return "bf16";
    case SG_F16: return "f16";
    case SG_DTYPE_AUTO: return "auto";
  }
  return "unknown";
}

int64_t sg__now_ms(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) return 0;
  return (int64_t)ts.tv_sec * 1000 + (int64_t)(ts.tv_nsec / 1000000);
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
