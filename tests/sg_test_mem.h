/* sg_test_mem.h — how much of a range is resident (mincore), for the tests of page release.
 * The including file defines _DEFAULT_SOURCE (mincore) before its first system header. */
#ifndef SG_TEST_MEM_H
#define SG_TEST_MEM_H

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h> /* mincore */
#include <unistd.h>   /* sysconf */

/* Resident pages of [p, p + bytes) (p page-aligned), by mincore; -1 when it fails. */
static inline long sg_test_resident_pages(void *p, size_t bytes, size_t page) {
  size_t n = (bytes + page - 1) / page;
  unsigned char *v = malloc(n ? n : 1);
  long k = 0;
  if (!v || mincore(p, bytes, v) != 0) k = -1;
  for (size_t i = 0; k >= 0 && i < n; i++) k += v[i] & 1;
  free(v);
  return k;
}

/* Resident pages among the whole pages inside [p, p + bytes) (0 when there are none). */
static inline long sg_test_resident_inside(const void *p, size_t bytes) {
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p;
  const uintptr_t lo = (a + page - 1) / page * page, hi = (a + bytes) / page * page;
  return hi > lo ? sg_test_resident_pages((void *)lo, hi - lo, page) : 0;
}

#endif /* SG_TEST_MEM_H */
