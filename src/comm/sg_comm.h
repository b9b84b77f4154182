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

/* Channels. An engine never calls the communicator the user made: it binds it
 * (sg__comm_bind) and gets a channel, an sg_comm of the same backend whose collectives never
 * mix with those of any other channel of that communicator (MPI: a duplicate MPI
 * communicator; local: a group of its own; NCCL: the communicator itself for the first channel,
 * a split of it for later ones), so that several engines (a GAN's two models, teacher and
 * student) share one communicator and their collectives may interleave. Channel k of a rank
 * meets channel k of every other rank: engines bind in the same order on every rank, as they
 * issue collectives. The channel is bound to one device (its buffers live there; NULL: host
 * memory) and attached to that device's comm queue (sg__device_ops.comm_attach) at bind time,
 * so the device knows how to run its jobs before the first one. The engine gives it scratch
 * (sg__comm_set_scratch) and unbinds it (sg__comm_unbind) once its comm queue is drained and
 * before the device goes away. sg_comm_destroy of a communicator with channels alive marks it
 * destroyed (nothing new binds or splits it) and the last unbind frees it. */
/* Where reduce_scatter_fold puts this rank's reduced slice: folded into the accumulator acc
 * (host memory, acc_dtype) as the engine's fold of a reduced bucket does, a copy when first
 * (sg__cpu_cast's bits), else acc + slice (sg__cpu_accumulate's). */
typedef struct sg__fold {
  void *acc;
  int acc_dtype;
  int first;
} sg__fold;

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
  /* Channel `index` (0, 1, 2... per communicator, the same on every rank) for buffers on dev
   * (NULL: host memory): allocates it, attaches it to dev. May be collective over c (MPI
   * duplicates its communicator, NCCL splits) within timeout_ms (<= 0: none), which also bounds
   * the device's own waits (sg__comm_attach.timeout_ms). On failure nothing is left attached or
   * allocated. */
  sg_status (*bind)(sg_comm *c, uint64_t index, sg__device *dev, int timeout_ms, sg_comm **chan);
  /* Detaches the channel from its device, frees what it allocated there and itself. */
  void (*unbind)(sg_comm *chan);
  void (*destroy)(sg_comm *c);
  /* sg_comm_split's backend part, called on a fresh host channel of the communicator being
   * split once every rank has arrived: color/key of every rank in rank order (colors[r] < 0:
   * rank r takes no part). Makes this rank's new communicator (NULL for a negative color).
   * Collective over the channel. A failure that every rank of the channel reaches alike (from
   * what they all gathered) leaves chan unbroken, and c stays usable; any other failure marks
   * chan broken (sg__comm_fail), which breaks c. NULL: the backend cannot split. */
  sg_status (*split)(sg_comm *chan, const int *colors, const int *keys, int64_t deadline_ms,
                     sg_comm **out);
  /* sg_comm_split_nodes with ranks_per_node 0, on the same kind of channel once every rank has
   * arrived: *leader = the lowest rank of the channel on this rank's node (MPI: the ranks that
   * share memory). Collective over the channel. NULL: nodes by host name. */
  sg_status (*node_leader)(sg_comm *chan, int64_t deadline_ms, int *leader);
  /* Optional (NULL: not offered): reduce_scatter of buf (f32/bf16/f16) on a channel of host
   * memory, whose slice for this rank is folded into f->acc (acc[i] = the slice rounded to
   * acc_dtype, or acc + it) instead of being written into buf: the same bits as
   * reduce_scatter followed by that fold, without a pass that writes the slice and one that
   * reads it again. buf's contents afterwards are unspecified. Counted as a reduce_scatter. */
  sg_status (*reduce_scatter_fold)(sg_comm *c, void *buf, size_t count, int dtype,
                                   const sg__fold *f, int64_t deadline_ms);
  /* Optional (NULL: not offered): host memory (and device memory where all_to_all_device says
   * so; NCCL: either, host memory through its staging); send and recv hold world*bytes each and
   * do not overlap. Afterwards recv[k*bytes .. +bytes) holds rank k's
   * send[rank*bytes .. +bytes): the exchange of a compressed reduce-scatter
   * (src/engine/policy/sg_replica_codec.c). Counted as an all-gather of world*bytes (what each
   * rank sends and receives is the same). */
  sg_status (*all_to_all)(sg_comm *c, const void *send, void *recv, size_t bytes,
                          int64_t deadline_ms);
  /* Optional (NULL: not offered): reduce_scatter out of place, on a channel whose buffers are
   * device memory (stream-ordered): recv[count] becomes the sum over ranks of
   * send[rank*count .. +count), the same bits as reduce_scatter of send followed by a copy of
   * this rank's slice; send is left as it was; send and recv do not overlap. Counted as a
   * reduce_scatter. The engine's first micro-batch reduces straight into the accumulator. */
  sg_status (*reduce_scatter_to)(sg_comm *c, const void *send, void *recv, size_t count,
                                 int dtype, int64_t deadline_ms);
  /* Declared: all_to_all also takes the device memory of a channel bound to a CUDA device
   * (local: the device's copies; NCCL; MPI: pinned staging, sg_stage.h) */
  int all_to_all_device;
} sg__comm_ops;

struct sg_comm {
  const sg__comm_ops *ops;
  int rank;
  int world;
  int broken;           /* set on the first failure; later calls return SG_ERR_COMM */
  int threaded;         /* 1: may be called from a worker thread (MPI: MPI_THREAD_MULTIPLE) */
  int stream_ordered;   /* 1: a channel bound to a CUDA device attaches stream-ordered: its
                           collectives are enqueued on the device's comm stream (NCCL); 0: it
                           attaches host-driven (local, MPI, a caller's transport) */
  sg_comm *parent;      /* a channel: the communicator it was bound from; NULL otherwise */
  int nbound;           /* a communicator: its channels alive (comm.c, under its lock) */
  int destroyed;        /* a communicator: sg_comm_destroy was called; freed when nbound is 0
                           (comm.c, under its lock) */
  uint64_t nbinds;      /* a communicator: channels made so far, the next channel's index */
  sg__device *dev;      /* a channel: its device; NULL: host buffers */
  void *scratch;        /* a channel: engine-provided scratch (device memory), scratch_bytes */
  size_t scratch_bytes;
  void *impl;
  /* a communicator: what this rank moved over it and all its channels (sg__comm_count), read
   * by sg_comm_stats; atomic adds: engines count from their comm workers */
  uint64_t sent, received, collectives;
};

/* A channel of c for buffers on dev (see "Channels" above); timeout_ms bounds a collective
 * bind (<= 0: none). SG_ERR_INVALID_ARGUMENT for a channel or NULL, SG_ERR_COMM when broken. */
sg_status sg__comm_bind(sg_comm *c, sg__device *dev, int timeout_ms, sg_comm **chan);
/* Frees a channel (NULL: nothing). Its device's comm queue must be drained. */
void sg__comm_unbind(sg_comm *chan);
/* The channel's scratch from now on (NULL, 0: none). */
void sg__comm_set_scratch(sg_comm *chan, void *scratch, size_t bytes);
/* Fills the fields every backend's channel copies from its communicator. */
void sg__comm_channel_init(sg_comm *chan, const sg_comm *c, const sg__comm_ops *ops,
                           sg__device *dev, void *impl);

/* The local backend's split (sg_split.c): a new group of threads per color. */
sg_status sg__comm_split_threads(sg_comm *chan, const int *colors, const int *keys,
                                 int64_t deadline_ms, sg_comm **out);
/* The rank that becomes rank 0 of `rank`'s color (colors[rank] >= 0). */
int sg__comm_split_leader(const int *colors, const int *keys, int world, int rank);
/* New rank of `rank` among the ranks of its color, ranked by (key, rank); -1 for a negative
 * color. *size receives the number of ranks of that color. */
int sg__comm_split_rank(const int *colors, const int *keys, int world, int rank, int *size);

/* Counts one collective on c (a channel: on its communicator) as sg_comm_stats defines it.
 * op: SG__COUNT_*; bytes: the buffer of the call in bytes (all-reduce: count elements;
 * reduce-scatter and all-gather: all world slices; broadcast: the message), root for a
 * broadcast. NULL: nothing. */
enum { SG__COUNT_ALL_REDUCE = 1, SG__COUNT_REDUCE_SCATTER, SG__COUNT_ALL_GATHER, SG__COUNT_BROADCAST };
void sg__comm_count(sg_comm *c, int op, size_t bytes, int root);
/* Bytes of one element of a wire dtype (sg_dtype or SG__F64). */
static inline size_t sg__comm_elem_bytes(int dtype) {
  return dtype == SG__F64 ? 8u : dtype == SG_F32 ? 4u : 2u;
}

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
/* reduce_scatter_fold's own arguments: f32/bf16/f16 values, an f32 or bf16 accumulator (SG_OK,
 * or SG_ERR_INVALID_ARGUMENT with the text set). */
sg_status sg__comm_fold_check(const char *fn, int dtype, size_t count, const sg__fold *f);

#endif /* SG_COMM_H */
