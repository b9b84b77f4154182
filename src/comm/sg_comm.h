/* Internal communicator interface (DESIGN.md section 6). local.c, mpi.c and nccl.c implement it;
 * comm.c holds the public sg_comm_* functions.
 *
 * Every collective is called by every rank in the same order, on one thread per rank at a time
 * (the engine's comm worker). Buffers live on the bound device (host memory when dev is NULL or
 * a CPU device). Sums are computed in fp32 whatever the wire dtype (f64 stays f64), in a fixed
 * order, and rounded once to the dtype where the backend allows. A failure or a passed deadline
 * marks the communicator broken: later calls fail at once with SG_ERR_COMM, on every rank that
 * can be told. */
#ifndef SG_COMM_H
#define SG_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h"     /* sg_status */
#include "../device/sg_device.h" /* sg__device */

/* Element types on the wire: sg_dtype values, plus f64 for the step's tiny norm reduction. */
#define SG__F64 3

typedef struct sg__comm_ops {
  const char *name;
  /* In place: buf[count] becomes the elementwise sum over ranks on every rank. */
  sg_status (*all_reduce)(sg_comm *c, void *buf, size_t count, int dtype, int64_t deadline_ms);
  /* In place: buf holds world*count elements; afterwards buf[rank*count .. +count) holds the sum
   * over ranks of that slice. Other slices are left unspecified. */
  sg_status (*reduce_scatter)(sg_comm *c, void *buf, size_t count, int dtype,
                              int64_t deadline_ms);
  /* In place: buf holds world*bytes; each rank contributes buf[rank*bytes .. +bytes). */
  sg_status (*all_gather)(sg_comm *c, void *buf, size_t bytes, int64_t deadline_ms);
  sg_status (*broadcast)(sg_comm *c, void *buf, size_t bytes, int root, int64_t deadline_ms);
  /* The bound device is about to be destroyed: free what was allocated through it (NULL: the
   * backend allocates nothing there). */
  void (*release)(sg_comm *c);
  void (*destroy)(sg_comm *c);
} sg__comm_ops;

struct sg_comm {
  const sg__comm_ops *ops;
  int rank;
  int world;
  int broken;           /* set on the first failure; later calls return SG_ERR_COMM */
  int in_use;           /* an engine holds it */
  int threaded;         /* 1: may be called from a worker thread (MPI: thread level allows it) */
  sg__device *dev;      /* bound by the engine; NULL: host buffers */
  void *scratch;        /* engine-provided scratch (device memory), scratch_bytes long */
  size_t scratch_bytes;
  void *impl;
};

/* Scratch the engine must provide (through sg_comm.scratch) for collectives of at most
 * max_count elements per rank: max_count * 4 bytes for every backend, so sg_memory and
 * sg_estimate_memory agree whatever the communicator. */
static inline size_t sg__comm_scratch_bytes(size_t max_count_per_rank) {
  return max_count_per_rank * 4u;
}

/* Shared helper: mark broken and set the error text. */
sg_status sg__comm_fail(sg_comm *c, sg_status st, const char *fn, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* Check run at the top of every collective: NULL, broken. */
sg_status sg__comm_usable(sg_comm *c, const char *fn);

#endif /* SG_COMM_H */
