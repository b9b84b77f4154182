/* Optimizer offload, the host side (issue 12): a shard's optimizer state in pinned host memory,
 * updated by the CPU kernels, with the copies between host and device memory in chunks that
 * overlap the host work. Written against the device vtable alone, so that it runs on the CPU
 * device, on the CUDA device and on the mock CUDA runtime alike.
 *
 * The update pipeline over a ring of SG__HOST_PIPE_NBUF pinned chunk buffers (reduced
 * gradients arrive through sg_offload.c's landing buffers):
 *   update: the fused optimizer update of a set of segments on the host (master, the state
 *           arrays, grad in host memory), each chunk's new working values written to a pinned buffer and copied H2D
 *           into the device's working-parameter buffer on the comm queue while the host updates
 *           the next chunk. Comm jobs issued afterwards (the bucket's all-gather) are ordered
 *           after those copies.
 * The host work is the only pass over each array: no staging copy of master or state, and the
 * working values go from the update's registers to the pinned buffer the DMA reads. */
#ifndef SG_HOST_STEP_H
#define SG_HOST_STEP_H

#include <stddef.h>
#include <stdint.h>

#include "../device/sg_device.h"   /* sg__device, sg__update_args */
#include "../optim/sg_optimizer.h" /* sg__optim_desc: the CPU update */

#define SG__HOST_PIPE_NBUF 3
#define SG__HOST_PIPE_CHUNK ((size_t)2 << 20) /* default elements per chunk */

/* One copy on the comm queue; owned by its buffer, reused after its ticket completed. */
typedef struct sg__host_copy {
  sg__device *dev;
  void *dst;
  const void *src;
  size_t bytes;
  sg__copy_kind kind;
} sg__host_copy;

typedef struct sg__host_pipe {
  sg__device *dev;
  size_t chunk;                      /* elements per chunk */
  size_t out_esize;                  /* bytes per element of the out buffers */
  void *out[SG__HOST_PIPE_NBUF];     /* pinned: new working values of one chunk */
  uint64_t out_ticket[SG__HOST_PIPE_NBUF];
  sg__host_copy out_job[SG__HOST_PIPE_NBUF];
  sg__seg *cseg; /* one chunk's segments, rebased to the out buffer */
  int cseg_cap;
  size_t host_bytes; /* pinned bytes held (the buffers) */
} sg__host_pipe;

/* chunk elements per buffer (0: SG__HOST_PIPE_CHUNK); out_esize: bytes of a working value
 * (2 or 4). On failure nothing stays allocated. */
sg_status sg__host_pipe_init(sg__host_pipe *p, sg__device *d, size_t chunk, size_t out_esize);
/* Waits for the copies in flight (bounded by deadline_ms) and frees the buffers; NULL or
 * zeroed p: nothing. */
void sg__host_pipe_free(sg__host_pipe *p, int64_t deadline_ms);
/* Host waits until every copy issued by the pipe completed. */
sg_status sg__host_pipe_drain(sg__host_pipe *p, int64_t deadline_ms);

/* Optimizer od's update (its cpu_update) of a->segs[0..a->nsegs) on the host: a's master,
 * state arrays and grad are host memory in shard
 * coordinates, a->param is ignored; the new working values (a->param_dtype) go to dev_param,
 * the device's working-parameter buffer indexed by flat_off. Segments must be in increasing,
 * non-overlapping flat order; the elements between two segments of one chunk (layout padding)
 * are written as zero, the value the layout's padding holds. With a->master NULL (f32 params:
 * the working values are the master, and the host keeps no copy) each chunk is first copied
 * D2H into its buffer (the next chunk's while this one updates), updated there and copied back,
 * gaps included as they were. *last (if not NULL): the ticket of
 * the last copy job (0 when none was issued). */
sg_status sg__host_pipe_update(sg__host_pipe *p, const sg__optim_desc *od,
                               const sg__update_args *a, void *dev_param, int64_t deadline_ms,
                               uint64_t *last);

#endif /* SG_HOST_STEP_H */
