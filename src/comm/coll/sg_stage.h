/* Device buffers for host collectives (DESIGN.md section 6): a communicator whose collectives
 * work on host memory (the MPI transport and the algorithms of sg_coll.h; MPI moves host memory
 * whatever it knows of CUDA) runs them on a GPU buffer through pinned host memory of the bound
 * device: the part of the buffer that is input is copied down, the host collective runs on the
 * copy, the part that is output is copied back. Copies go on the comm queue inside the engine's
 * comm job, where the device completes them before the call returns.
 *
 * `host` is the communicator's table of host-memory collectives; it is called with c, whose
 * scratch points at host scratch beside the copy for the duration of the call. */
#ifndef SG_STAGE_H
#define SG_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "../sg_comm.h" /* sg_comm, sg__comm_ops, sg__device */

/* Pinned staging of one channel, from c->dev. */
typedef struct sg__stage {
  unsigned char *buf;
  size_t cap;
  int lost; /* a collective on it was left pending: never freed */
} sg__stage;

/* The buffer lives on a device the host cannot address (not host memory, not a CPU device). */
int sg__stage_needed(const sg_comm *c);

sg_status sg__stage_all_reduce(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                               size_t count, int dtype, int64_t deadline_ms);
sg_status sg__stage_reduce_scatter(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                                   size_t count, int dtype, int64_t deadline_ms);
sg_status sg__stage_all_gather(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                               size_t bytes, int64_t deadline_ms);
sg_status sg__stage_broadcast(sg_comm *c, sg__stage *s, const sg__comm_ops *host, void *buf,
                              size_t bytes, int root, int64_t deadline_ms);
/* Out of place (sg__comm_ops.all_to_all): send and recv device memory, both staged. */
sg_status sg__stage_all_to_all(sg_comm *c, sg__stage *s, const sg__comm_ops *host,
                               const void *send, void *recv, size_t bytes, int64_t deadline_ms);

/* Gives the pinned memory back to c->dev (before the device goes away). */
void sg__stage_free(sg_comm *c, sg__stage *s);

#endif /* SG_STAGE_H */
