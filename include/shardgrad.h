/*
 * shardgrad.h - sharded data-parallel training (ZeRO stage 2 / FSDP SHARD_GRAD_OP) for C.
 *
 * The whole public API. C11, no CUDA, NCCL or MPI types, so that it can be used from any C or
 * C++ program and from Python through ctypes.
 *
 * Conventions
 *  - Every fallible call returns sg_status; SG_OK is 0. On failure sg_last_error() returns a
 *    thread-local text naming the function, the argument and the value.
 *  - Outputs go through pointers in the last arguments. Structs crossing the API start with
 *    `struct_size`. Handles are opaque; every *_destroy accepts NULL.
 *  - "Collective" calls must be made by every rank of the communicator, in the same order.
 *  - One engine is driven by one thread at a time; separate engines are independent. A call on
 *    an engine from a second thread while another thread is inside a call on it fails with
 *    SG_ERR_INVALID_STATE and does nothing (sg_engine_destroy then leaves the engine alone).
 *  - A failed call changes nothing, unless its message says which state it left.
 *  - The library never calls exit() or abort(), and nothing in it prints except through the
 *    logger (SG_LOG=warn|info|debug, SG_LOG_FILE=path, %r in the path becomes the rank).
 */
#ifndef SHARDGRAD_H
#define SHARDGRAD_H

#include <stddef.h> /* size_t */
#include <stdint.h> /* uint32_t, uint64_t */

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define SG_API
#elif defined(__GNUC__)
#define SG_API __attribute__((visibility("default")))
#else
#define SG_API
#endif

/* The one place of the version: CMakeLists.txt, the pyproject.toml files and the Python package
 * (shardgrad.__version__) read these three lines. */
#define SG_VERSION_MAJOR 0
#define SG_VERSION_MINOR 2
#define SG_VERSION_PATCH 0

/* ---------------------------------------------------------------------------------------- */
/* Status                                                                                    */
/* ---------------------------------------------------------------------------------------- */

typedef enum {
  SG_OK = 0,
  SG_ERR_INVALID_ARGUMENT = 1, /* NULL, out of range, unknown id, wrong dtype */
  SG_ERR_INVALID_STATE = 2,    /* call made in the wrong order (e.g. sg_step before finalize) */
  SG_ERR_OUT_OF_MEMORY = 3,    /* an allocation failed; the engine is unchanged */
  SG_ERR_UNSUPPORTED = 4,      /* backend or feature not compiled in / not available */
  SG_ERR_MISMATCH = 5,         /* ranks disagree (parameters, config) */
  SG_ERR_COMM = 6,             /* a collective failed; the communicator is broken */
  SG_ERR_TIMEOUT = 7,          /* a wait passed its deadline (timeout_ms); the comm is broken */
  SG_ERR_IO = 8,               /* file missing or unreadable */
  SG_ERR_CORRUPT = 9,          /* file present but damaged */
  SG_ERR_CUDA = 10,            /* a CUDA call failed */
  SG_ERR_INTERNAL = 11         /* a bug in shardgrad: please report with sg_last_error() */
} sg_status;

/* Short static name of a status ("SG_ERR_TIMEOUT"), never NULL. */
SG_API const char *sg_status_string(sg_status s);
/* This thread's last failure with detail; "" when none. Valid until the next failing call. */
SG_API const char *sg_last_error(void);
/* major*10000 + minor*100 + patch */
SG_API int sg_version(void);
/* 1 when the backend is compiled in: "local", "mpi", "cuda", "nccl"; 0 otherwise or NULL. */
SG_API int sg_has_backend(const char *name);

/* ---------------------------------------------------------------------------------------- */
/* Types                                                                                     */
/* ---------------------------------------------------------------------------------------- */

/* SG_DTYPE_AUTO (config only): grad_dtype = param_dtype, reduce_dtype = grad_dtype. */
/* SG_Q8 (cfg.optim_state_dtype only): blockwise 8-bit optimizer state. */
typedef enum { SG_DTYPE_AUTO = -1, SG_F32 = 0, SG_BF16 = 1, SG_F16 = 2, SG_Q8 = 3 } sg_dtype;
typedef enum { SG_DEVICE_CPU = 0, SG_DEVICE_CUDA = 1 } sg_device;
typedef enum {
  SG_NO_SHARD = 0,     /* plain data parallel: everything replicated, all-reduce */
  SG_SHARD_OPT = 1,    /* ZeRO-1: master weights and moments sharded */
  SG_SHARD_GRAD_OP = 2 /* ZeRO-2: gradients too (only staging buckets are full size) */
} sg_strategy;
/* sg_config.replica_codec: how a hybrid engine's per-step sum across replicas goes on the wire
 * (docs/slow-links.md). */
typedef enum {
  SG_CODEC_NONE = 0, /* exact: replica_reduce_dtype (f32 or bf16) */
  SG_CODEC_INT8 = 1, /* blockwise-scaled int8 with error feedback (~0.25x the bytes of f32) */
  SG_CODEC_INT4 = 2  /* blockwise-scaled 4-bit with error feedback (~0.13x) */
} sg_codec;

/* sg_add_param flags */
#define SG_PARAM_NO_DECAY 1u /* weight_decay does not apply (biases, norms) */

/* ---------------------------------------------------------------------------------------- */
/* Communicators                                                                             */
/* ---------------------------------------------------------------------------------------- */

typedef struct sg_comm sg_comm;

/* `world` ranks as threads of one process. Fills comms[0..world-1]; comms[r] must be driven by
 * its own thread. Each is destroyed separately (the shared state goes with the last one).
 * SG_ERR_INVALID_ARGUMENT: comms NULL or world outside 1..4096. */
SG_API sg_status sg_comm_create_local(int world, sg_comm **comms);

/* One rank per process over MPI. `mpi_comm` points to an MPI_Comm (NULL: MPI_COMM_WORLD); the
 * library duplicates it. Initializes MPI (MPI_THREAD_MULTIPLE requested) when the caller has not;
 * then the last sg_comm_destroy finalizes it. After a communication failure it does so only if
 * every peer reaches that point within 10 s (MPI_Finalize would wait for a peer that is gone);
 * otherwise it is left out with a warning and the process can exit with its error. Collective
 * over the MPI communicator.
 * SG_ERR_UNSUPPORTED when built without MPI. */
SG_API sg_status sg_comm_create_mpi(const void *mpi_comm, sg_comm **out);

/* "Bring your own transport": a communicator whose bytes travel through the caller's
 * point-to-point messages (torch.distributed's gloo process group, a custom fabric), under the
 * library's collective algorithms (the ones the MPI communicator uses; fp32 sums, fixed order).
 * Host memory only: an engine on a GPU gets SG_ERR_UNSUPPORTED (use an NCCL communicator).
 *
 * The library starts transfers with isend/irecv and learns of their completion only through
 * sg_xport_done(token, ...), which the transport calls exactly once per started transfer, from
 * any thread; callbacks should return at once (start the transfer, not wait for it). Every wait is the library's, with the engine's
 * deadline (timeout_ms): a peer that never answers gives SG_ERR_TIMEOUT, after which the
 * library cancels what is pending. Ranks call collectives in the same order (channels: tags
 * differ per engine and per call, so messages of different engines or calls never match). */
typedef struct sg_xport {
  size_t struct_size; /* sizeof(sg_xport) */
  const char *name;   /* in messages ("torch"); copied, at most 31 characters; NULL: "xport" */
  void *user;         /* passed to every callback */
  int threaded;       /* 1: the callbacks may be called from any thread (the engine's comm worker
                         overlaps reductions with backward); 0: only from the threads that call
                         the library (collectives then run inside sg_grad_ready, sg_step...) */
  /* Start sending `bytes` (>= 1) from buf to rank `peer` (0..world-1, never this rank) under
   * `tag` (0 <= tag < 2^31); messages from one rank to another with the same tag are received in
   * the order they were sent. buf stays valid and unchanged until the transfer completes or is
   * cancelled. Return 0 (then call sg_xport_done(token, ...) once it completes or fails), or
   * nonzero with a NUL-terminated message in msg[msg_cap] (then never call it). */
  int (*isend)(void *user, const void *buf, size_t bytes, int peer, int tag, void *token,
               char *msg, size_t msg_cap);
  /* Start receiving exactly `bytes` into buf from `peer` under `tag`; as isend. */
  int (*irecv)(void *user, void *buf, size_t bytes, int peer, int tag, void *token, char *msg,
               size_t msg_cap);
  /* After a failure or a passed deadline the library gives up a started transfer whose
   * completion it has not seen. After cancel returns, the transport never calls sg_xport_done
   * with that token. Return 0 when the transfer will not touch its buffer any more, 1 when it
   * may (the library then never frees a receive buffer of its own that was involved). */
  int (*cancel)(void *user, void *token);
  /* Called once, when the communicator is destroyed (after every engine on it): nothing will
   * call the transport again and user may be freed. NULL: nothing to do. */
  void (*release)(void *user);
} sg_xport;

/* A communicator of `world` ranks (1..65536) in which this process is rank `rank`, over the
 * transport *t (copied; isend, irecv and cancel must be set). Not collective.
 * sg_comm_split and sg_comm_split_nodes of it (and of its splits) make communicators over the
 * same transport: their messages go to the transport's ranks (`peer` is always a rank of this
 * first communicator) under tags of their own, so one transport serves a hybrid layout. The
 * transport is released (t->release) once, when the last of these communicators on this process
 * is destroyed, in whatever order they are. At most 64 of them may be alive on a process (a
 * split beyond: SG_ERR_UNSUPPORTED on every rank), and a process splits them one at a time (a
 * split while another of the same transport runs on another thread of a rank: SG_ERR_INVALID_STATE
 * on every rank of that split; the communicators stay usable). */
SG_API sg_status sg_comm_create_xport(const sg_xport *t, int rank, int world, sg_comm **out);

/* The transfer of `token` has completed (error = 0; for a receive, bytes = the bytes received)
 * or failed (error != 0, msg: why, may be NULL). Exactly once per started transfer, never
 * after cancel; may be called from any thread, also from inside isend/irecv. A token completed
 * twice gives SG_ERR_INVALID_STATE; NULL SG_ERR_INVALID_ARGUMENT. */
SG_API sg_status sg_xport_done(void *token, int error, size_t bytes, const char *msg);

/* Rank and size, or -1 for NULL. */
SG_API int sg_comm_rank(const sg_comm *c);
SG_API int sg_comm_size(const sg_comm *c);
/* NULL is fine. Engines and their communicators may be destroyed in either order: a
 * communicator that engines still use is freed with the last of them (sg_engine_destroy; for
 * MPI that is where the library's MPI_Finalize then happens). The handle is dead for the
 * caller from this call on: a new engine or split on it is SG_ERR_INVALID_STATE. */
SG_API void sg_comm_destroy(sg_comm *c);

/* Collective over c, like MPI_Comm_split: the ranks passing the same color >= 0 form a new
 * communicator *out, ranked by (key, rank in c); color < 0 takes part and gets *out = NULL.
 * The new communicator is independent of c (either may be destroyed first) and of c's engines;
 * every rank calls it in the same order relative to its other collective calls on c (engine
 * creation included), from one thread per rank. Local: a group of threads of its own; MPI:
 * MPI_Comm_split; the caller's transport (sg_comm_create_xport): the same transport, with a rank
 * map; NCCL: ncclCommSplit (on the same GPU), or with an NCCL before 2.18 a fresh
 * unique id per part handed out over c, which works only as the first use of c (no engine on it
 * before: later engines and splits of c then need ncclCommSplit, SG_ERR_UNSUPPORTED). Waits at
 * most 10 minutes for every rank of c (SG_ERR_TIMEOUT, c broken). */
SG_API sg_status sg_comm_split(sg_comm *c, int color, int key, sg_comm **out);

/* Collective over c: the two communicators of a hybrid layout (sg_engine_create_hybrid), N
 * nodes of L ranks each. *shard holds the ranks of this rank's node (ranked as in c); *replica
 * the ranks with this rank's index in their node, one per node (ranked by node, nodes ordered
 * by their lowest rank in c). ranks_per_node > 0: nodes are blocks of that many consecutive
 * ranks of c; 0: the ranks sharing a host (MPI: MPI_COMM_TYPE_SHARED; otherwise the host name;
 * local thread communicators: all ranks are one node). Both are independent of c, as with
 * sg_comm_split, and made in one rendezvous (same rules and 10-minute bound).
 * SG_ERR_MISMATCH on every rank, c still usable, when the nodes would differ in size (world not
 * a multiple of ranks_per_node, hosts with different numbers of ranks) or the ranks pass
 * different ranks_per_node; a rank's bad argument (NULL shard or replica, ranks_per_node < 0)
 * is SG_ERR_INVALID_ARGUMENT there and SG_ERR_MISMATCH on the others. On failure both are NULL. */
SG_API sg_status sg_comm_split_nodes(sg_comm *c, int ranks_per_node, sg_comm **shard,
                                     sg_comm **replica);

/* What this rank moved over a communicator since it was made: every collective of every engine
 * on it (and of sg_comm_split), in the bytes a bandwidth-optimal algorithm moves, as nccl-tests'
 * bus bandwidth counts them: an all-reduce of S bytes over W ranks sends and receives
 * 2(W-1)/W x S, a reduce-scatter or all-gather of a buffer of S bytes (all W slices) (W-1)/W x S,
 * a broadcast S (sent by the root, received by the others); S in the wire dtype. Rounded down
 * per collective. Fields are only ever appended. */
typedef struct sg_comm_traffic {
  size_t struct_size;      /* sizeof(sg_comm_traffic), set by the caller */
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t collectives;    /* collectives this rank issued */
} sg_comm_traffic;
/* Not collective; may be called while engines use c. */
SG_API sg_status sg_comm_stats(const sg_comm *c, sg_comm_traffic *out);

/* ---------------------------------------------------------------------------------------- */
/* Configuration                                                                             */
/* ---------------------------------------------------------------------------------------- */

/* Fields are only ever appended. Fill with sg_config_init(&cfg, sizeof cfg), then change. */
typedef struct sg_config {
  size_t struct_size;
  sg_strategy strategy;   /* SG_SHARD_GRAD_OP */
  sg_device device;       /* SG_DEVICE_CPU */
  int cuda_device;        /* -1: current device */
  sg_dtype param_dtype;   /* SG_F32: dtype of the working parameters */
  sg_dtype grad_dtype;    /* SG_DTYPE_AUTO (= param_dtype): dtype of the gradients written */
  sg_dtype reduce_dtype;  /* SG_DTYPE_AUTO (= grad_dtype): dtype on the wire; sums in fp32
                             (NCCL: in this dtype). Another dtype than grad_dtype casts each
                             bucket into a comm buffer of the largest bucket in this dtype. */
  sg_dtype accum_dtype;   /* SG_F32 (or SG_BF16): the sharded gradient accumulator */
  size_t bucket_bytes;    /* 32 MiB, in grad_dtype bytes; >= 64 elements */
  int staging_buckets;    /* 2 (SHARD_GRAD_OP): full-size gradient buckets in flight, >= 1 */
  float lr;               /* 1e-3 */
  float beta1;            /* 0.9 */
  float beta2;            /* 0.999 */
  float eps;              /* 1e-8 */
  float weight_decay;     /* 0.01, decoupled (AdamW) */
  float max_grad_norm;    /* 0: no clipping */
  int grad_average;       /* 1: reduced gradient = sum over ranks / world; 0: plain sum */
  float loss_scale;       /* 0: dynamic for f16 params, 1 otherwise; > 0: static */
  float init_loss_scale;  /* 65536 (dynamic) */
  int scale_window;       /* 2000 clean steps before the scale doubles */
  float min_loss_scale;   /* 1 */
  int skip_nonfinite;     /* 1: skip the step on every rank when any gradient is inf/NaN */
  int stochastic_rounding;/* 0: bf16 working params rounded to nearest even; 1: stochastic */
  uint64_t seed;          /* 0: seed for stochastic rounding */
  int timeout_ms;         /* 600000: deadline of every blocking wait; <= 0: wait forever */
  /* --- appended in 0.2 --- */
  int overlap_param_gather; /* 0: sg_step returns with every working parameter gathered.
                               1: sg_step returns once the all-gathers are queued, last bucket
                               (the first registered parameters) first, so they overlap the next
                               forward pass; call sg_param_wait before reading a parameter. */
  uint64_t reserved_0_2;    /* 0 (must stay 0). Ends the 0.2 block on an 8-byte boundary: 0.2's
                               overlap_param_gather took 0.1's tail padding, so 0.2's sizeof
                               would equal 0.1's without it. */
  /* --- appended in 0.3 --- */
  int offload_optimizer;    /* 0. 1 (CUDA device, SG_SHARD_GRAD_OP or SG_SHARD_OPT): the fp32
                               master, the optimizer state and the shard accumulator live in
                               pinned host memory and AdamW runs on the CPU; working parameters
                               and staging stay on the GPU. Results, checkpoints and every
                               accessor are bitwise those of the run without it. SG_NO_SHARD on
                               CUDA: SG_ERR_UNSUPPORTED. On the CPU device it is accepted and
                               changes nothing (the state is host memory already). */
  sg_dtype replica_reduce_dtype; /* SG_F32 (or SG_BF16): hybrid engines (sg_engine_create_hybrid)
                               only: the dtype of the once-per-step all-reduce across replicas;
                               sums in fp32 in a fixed order. Flat engines ignore it. */
  int shard_ranks;          /* 0: sg_estimate_memory only: ranks one shard group spans (hybrid
                               layout: ranks per node); 0 = all `world` ranks (flat). Engines take
                               the layout from their communicators and require 0 or that size. */
  int reserved_0_3;         /* 0 (must stay 0): ends the 0.3 block on an 8-byte boundary */
  /* --- 0.4 --- */
  sg_codec replica_codec;   /* SG_CODEC_NONE (default): hybrid engines only: the per-step sum of
                               each rank's gradient slice across replicas compressed (blocks of
                               256 with an fp32 scale) with error feedback: each rank keeps what
                               its codes missed (a residual of its slice, fp32) and adds it to
                               the next step's. Two stages, so every replica ends with the same
                               bits: each replica's codes of chunk k go to replica k, which sums
                               them decoded in replica order, encodes the sum (with a residual
                               of its own) and sends it to all. Needs an f32 accumulator; on
                               the CPU device a host communicator (threads, MPI, caller's
                               transport) for replicas; on the CUDA device (the same bits as
                               the CPU's) any pair of NCCL, threads and MPI communicators (NCCL
                               inside with threads or MPI across: the sums at the step), also with
                               offload_optimizer (its residuals on the host); a flat engine
                               refuses it. Checkpoints
                               hold every replica's residuals (sg_load at another node count:
                               docs/slow-links.md); one without them loads with them zero. */
  int outer_every;          /* 0 (default): off. H >= 1: hybrid engines only: DiLoCo-style outer
                               steps. The step's gradient is summed inside the node only (each
                               replica runs its own AdamW steps, averaged over its L ranks), and
                               after every H-th sg_step (skipped ones count) the replicas agree:
                               the pseudo-gradient (the parameters at the last outer step minus
                               now, fp32, averaged over the replicas in replica_reduce_dtype on
                               the wire) takes a Nesterov momentum SGD step of the outer
                               parameters, which become every replica's parameters. The outer
                               state (parameters and momentum, fp32) is sharded like the
                               master. CPU device; CUDA device (the same bits as the CPU's)
                               with any pair of NCCL, threads and MPI communicators, also with
                               offload_optimizer (its outer state on the host). With
                               replica_codec SG_CODEC_INT8 (and its communicators) the
                               pseudo-gradient crosses as int8 codes with error feedback
                               (SG_CODEC_INT4: refused). Checkpoints hold the outer state and
                               the position in the period; sg_load of one without them begins
                               a new period at the loaded parameters (replica 0's) with zero
                               momentum. */
  double outer_lr;          /* 0.7 (DiLoCo's): the outer step's learning rate, > 0 */
  double outer_momentum;    /* 0.9 (DiLoCo's): its Nesterov momentum, in [0, 1) */
  sg_dtype optim_state_dtype; /* SG_F32: the optimizer's state arrays (AdamW's m and v) in fp32.
                               SG_Q8: in blocks of 256 elements, one byte per element and an fp32
                               scale per block (docs/optim-state-8bit.md): 2 bytes per parameter
                               instead of 8, results close to fp32's but not its bits. Blocks
                               start at each tensor's first element and never straddle two
                               tensors or two ranks (the planner aligns shards to them), so the
                               state of an element has the same bits at any world size. With
                               offload_optimizer the blocks live in pinned host memory. */
  int optim_state_min_numel;  /* 4096: with SG_Q8, tensors of fewer elements (their numel, never a
                               shard's part) keep fp32 state; 0 codes every tensor */
  uint64_t magic;           /* written by sg_config_init (and copied with the struct); never set
                               it. A config of this layout or a later one whose magic is not the
                               library's was never initialised: every call that takes it refuses
                               it (SG_ERR_INVALID_ARGUMENT, "call sg_config_init"). Configs of the
                               older layouts (0.1-0.3) end before it and are told by struct_size
                               alone. */
  /* --- 0.5 --- */
  int outer_streaming;      /* 0 (default). 1: with outer_every = H, streaming outer steps: the
                               buckets are split into H groups (bucket b in group b mod H); the
                               k-th sg_step of each period (k = 1..H) begins group k - 1's sum
                               of pseudo-gradients across replicas in the background, and the
                               next step, before its update, takes that group's outer step
                               (Nesterov step, new parameters gathered in the node) and applies
                               its own gradient on top: the sum overlaps the next step's
                               compute, and every step sends about 1/H of an outer step's bytes
                               instead of all of them every H-th step. H larger than the number
                               of buckets: the steps whose group has no bucket send nothing.
                               sg_save merges the sum in flight first (docs/slow-links.md).
                               Needs outer_every >= 1; with offload_optimizer on the CUDA device
                               a host replica communicator (threads, MPI, a caller's), else
                               SG_ERR_UNSUPPORTED at create. Threads or MPI inside with NCCL
                               across run the sums before the next step's reductions, not
                               beside them (docs/slow-links.md). */
  int reserved_0_5;         /* 0 (must stay 0): ends the 0.5 block on an 8-byte boundary */
  /* Appending: each release adds its fields here as one block that ends on an 8-byte boundary
   * (no tail padding, so every published layout has its own sizeof), and records its size in
   * src/core/sg_config.c (layouts) and python/shardgrad/_structs.py (SgConfig). */
} sg_config;

/* Fills the defaults above and the magic. struct_size must be the sizeof of a published layout
 * (0.1: the struct up to timeout_ms, 0.2 and later: this header's) and no larger than this
 * library's (SG_ERR_INVALID_ARGUMENT otherwise). A 0.1-sized config gets the defaults of every
 * later field, whatever its padding holds. A config that is right-sized but was never passed
 * through sg_config_init (stack garbage, memset 0) is refused by every call that takes it. */
SG_API sg_status sg_config_init(sg_config *cfg, size_t struct_size);

/* ---------------------------------------------------------------------------------------- */
/* Engine                                                                                    */
/* ---------------------------------------------------------------------------------------- */

typedef struct sg_engine sg_engine;

/* One engine per model replica per rank. The engine uses `comm` until destroyed. Several engines
 * may use one communicator (two models, teacher and student): each gets a channel of its own, so
 * their collectives may interleave; create them in the same order on every rank. The first
 * engine on a communicator is not collective; later ones (also one created after an earlier
 * engine was destroyed) are, for MPI (a duplicate communicator) and NCCL (ncclCommSplit,
 * SG_ERR_UNSUPPORTED before NCCL 2.18), within cfg->timeout_ms. The config is copied.
 * SG_ERR_UNSUPPORTED for a device that is not compiled in. */
SG_API sg_status sg_engine_create(sg_comm *comm, const sg_config *cfg, sg_engine **out);

/* Hybrid sharding, for nodes joined by a slower network: the engine shards gradients and
 * optimizer state L ways over `shard` (the L ranks of one node) and is replicated over the N
 * ranks of `replica` (this rank's counterparts on the other nodes, the ranks with its index in
 * `shard`), so it trains data-parallel over W = N x L ranks. Each micro-batch's buckets are
 * reduce-scattered inside `shard` only; once per optimizer step each bucket's shard of the
 * summed gradient is all-reduced over `replica` (in cfg->replica_reduce_dtype on the wire,
 * summed in fp32 in a fixed order, so every replica holds the same bits), right after that
 * bucket's reduction in the last micro-batch when sg_set_microbatches said which one that is,
 * else by sg_step before the norm. Averaging (grad_average) is over all W ranks; the norm,
 * clipping, loss scale and skip decision are identical on all W ranks; AdamW runs on the shard
 * and the all-gathers stay inside `shard`: no parameter bytes cross `replica`. With f32 on the
 * wire the result equals that of sg_engine_create over all W ranks (bitwise for exactly
 * summable gradients). Memory per rank is that of a flat engine over L ranks.
 * SG_SHARD_GRAD_OP or SG_SHARD_OPT (SG_NO_SHARD has nothing to shard: SG_ERR_INVALID_ARGUMENT);
 * SG_DEVICE_CPU in this build (CUDA: SG_ERR_UNSUPPORTED). cfg->shard_ranks must be 0 or L.
 * Global rank (sg_broadcast_params' root): replica rank x L + shard rank. sg_finalize checks
 * the layout on every rank: every shard communicator of the same size, every rank of a
 * replica communicator with the same index in its shard, every rank of a shard communicator in
 * the same replica position (SG_ERR_MISMATCH on every rank otherwise). sg_save writes one copy
 * (the ranks of replica 0; every rank votes), which sg_load reads into any layout, flat or
 * hybrid; the directory must be visible to every node. The engine uses both communicators until
 * destroyed. */
SG_API sg_status sg_engine_create_hybrid(sg_comm *shard, sg_comm *replica, const sg_config *cfg,
                                         sg_engine **out);

/* Registers a parameter before sg_finalize. Names are unique, 1..255 bytes; numel >= 1.
 * *id receives the dense id 0..n-1 in registration order. Each parameter starts at a multiple
 * of 64 elements in the flat buffers, so one of n elements costs what ceil(n/64)*64 do in every
 * buffer (a one-element parameter as much as 64: 10^6 of them take ~1.1 GB at W=1, f32, where
 * 10^6 elements in one parameter take 24 MB); sg_estimate_memory counts it. Concatenate many
 * tiny tensors into one parameter where that matters. */
SG_API sg_status sg_add_param(sg_engine *e, const char *name, size_t numel, uint32_t flags,
                              int *id);

/* Collective. Builds the plan, checks that every rank registered the same parameters and
 * config (SG_ERR_MISMATCH on every rank, naming the first difference), and allocates all
 * memory. Working params, master weights and moments start at zero. */
SG_API sg_status sg_finalize(sg_engine *e);

/* Working parameter `id`, full replica, param_dtype, on the engine's device. Valid until the
 * engine is destroyed; updated in place by sg_step. The step computes from the fp32 master (for
 * bf16/f16 params; f32 params are their own master): a caller that writes the working values
 * through this pointer must then give them to sg_set_param (same values on every rank), or the
 * next sg_step overwrites the write with the master's update. */
SG_API sg_status sg_param_ptr(sg_engine *e, int id, void **ptr);

/* With overlap_param_gather = 1: orders the caller's work after the all-gather, started by the
 * last sg_step, of the bucket holding parameter `id` (CUDA: the caller's stream waits, the host
 * does not; CPU: the host waits). Call it before the forward pass first reads the parameter,
 * e.g. in a forward pre-hook; id -1 waits for every bucket. Buckets are gathered in the order a
 * forward pass in registration order needs them, so waiting for the parameters in that order
 * stalls only where the communication is behind. Returns at once when nothing is pending (and
 * always when overlap_param_gather = 0). Reading a parameter before waiting reads a mix of old
 * and new values. Calls that touch parameters themselves (sg_step, sg_set_param, sg_get_param,
 * sg_save, ...) wait for every pending gather first. A failed gather is reported here, or by
 * the next call that waits (SG_ERR_COMM / SG_ERR_TIMEOUT; the engine is then broken). */
SG_API sg_status sg_param_wait(sg_engine *e, int id);

/* Sets parameter `id` (working copy and this rank's master fragments) from host memory in
 * src_dtype. Call with the same values on every rank, or use sg_broadcast_params. */
SG_API sg_status sg_set_param(sg_engine *e, int id, const void *host_src, sg_dtype src_dtype);
/* Copies working parameter `id` to host memory, converted to dst_dtype. */
SG_API sg_status sg_get_param(sg_engine *e, int id, void *host_dst, sg_dtype dst_dtype);

/* Collective. Working parameters of every rank become those of `root`; master weights are
 * rebuilt from them (exact for f32 params; the bf16/f16 value otherwise). */
SG_API sg_status sg_broadcast_params(sg_engine *e, int root);

/* Collective. Full fp32 master weights of parameter `id` (numel floats) on every rank. For f32
 * params the master is the working parameter. */
SG_API sg_status sg_get_master(sg_engine *e, int id, float *host_dst);
/* Collective. AdamW state of `id`: which = 0 for m (first moment), 1 for v (second). */
SG_API sg_status sg_get_optim_state(sg_engine *e, int id, int which, float *host_dst);

/* Gradient slot of parameter `id` for the current micro-batch: numel elements of grad_dtype,
 * zeroed, on the engine's device. Write (or add) the gradient, then call sg_grad_ready. Under
 * SHARD_GRAD_OP slots live in recycled staging buckets, so this may wait for an earlier
 * bucket's reduction; gradients should arrive roughly in reverse registration order.
 * The pointer is valid until sg_grad_ready(id). */
SG_API sg_status sg_grad_ptr(sg_engine *e, int id, void **ptr);
/* Marks the gradient of `id` complete for this micro-batch. Twice in one micro-batch:
 * SG_ERR_INVALID_STATE. Completed buckets are reduced in the background. */
SG_API sg_status sg_grad_ready(sg_engine *e, int id);
/* Adds numel elements of src (host memory on CPU; device memory on CUDA) in src_dtype to the
 * slot of `id` and marks it ready. */
SG_API sg_status sg_grad_add(sg_engine *e, int id, const void *src, sg_dtype src_dtype);
/* Ends the micro-batch: parameters without a gradient count as zeros in its reductions.
 * Collective in effect (launches the remaining reductions). Called by sg_step when needed.
 * Completing a parameter here does not give it a gradient: see "Parameters without a
 * gradient" at sg_step. */
SG_API sg_status sg_backward_end(sg_engine *e);
/* enabled = 0: following micro-batches accumulate locally with no communication (like DDP's
 * no_sync), in a full-size fp32 buffer allocated on first use. Re-enable before the last
 * micro-batch of the step. Must be called between micro-batches, with the same value on every
 * rank. */
SG_API sg_status sg_set_sync(sg_engine *e, int enabled);
/* The number of micro-batches of each optimizer step (n >= 1; 0, the default: not said). A
 * hybrid engine then starts each bucket's all-reduce across replicas as soon as that bucket is
 * reduced in the n-th micro-batch since the last step, overlapping the rest of that backward
 * pass; without it sg_step (or sg_grad_norm) runs them. Once they have started, a further
 * micro-batch before sg_step is SG_ERR_INVALID_STATE. Call between micro-batches, with the same
 * value on every rank. Other engines check n and otherwise ignore it. */
SG_API sg_status sg_set_microbatches(sg_engine *e, int n);
/* Collective: drops every gradient accumulated since the last sg_step (or sg_load), so that a
 * training loop can recover from an exception in the middle of a backward pass. Completes the
 * micro-batch in progress, if any, as sg_backward_end does (what was written so far and zeros
 * for the rest: the reductions must match those of the other ranks), waits for every
 * reduction, then zeroes the accumulated gradients, including those kept locally with
 * sg_set_sync(e, 0). The next sg_step applies only gradients that come after this call.
 * Every rank calls it at the same point of the same micro-batch, as it would sg_backward_end.
 * Parameters, optimizer state and the step count are unchanged. */
SG_API sg_status sg_grad_zero(sg_engine *e);

typedef struct sg_step_info {
  size_t struct_size;
  uint64_t step;     /* optimizer steps taken so far (skipped steps do not count) */
  float grad_norm;   /* global L2 norm of the reduced, unscaled gradient (inf/NaN if not finite) */
  float clip_coef;   /* min(1, max_grad_norm / (grad_norm + 1e-6)); 1 without clipping */
  float loss_scale;  /* the loss scale used for this step's gradients */
  int skipped;       /* 1: non-finite gradients, nothing was updated */
} sg_step_info;

/* Collective. Waits for the reductions, computes the global norm, clips, updates the loss scale,
 * applies AdamW to this rank's shard and all-gathers the working parameters, bucket by bucket
 * (each bucket's all-gather overlaps the next bucket's AdamW). With overlap_param_gather it
 * returns once the all-gathers are queued: see sg_param_wait. info may be NULL.
 *
 * Parameters without a gradient (torch.optim.AdamW's rule for a .grad of None): a parameter
 * has a gradient in a step when some rank called sg_grad_ptr, sg_grad_add or sg_grad_ready for
 * it in some micro-batch since the last sg_step, sg_grad_zero or sg_load (sg_grad_ready alone
 * is a gradient of zeros: the parameter is updated). A parameter that no rank named is
 * skipped: its working value, master, optimizer state and its own step count (the t of its
 * bias correction) stay as they are; it counts as zeros in the norm. A step in which no
 * parameter has a gradient changes nothing: info->step does not advance and the loss scale
 * stays. The ranks agree on this with the norm's all-reduce (one more double) and, only in a
 * step where some rank missed a parameter, an all-gather of a bit per parameter. sg_save keeps
 * the per-parameter step counts. Not with offload_optimizer or 8-bit optimizer state: a step
 * that would skip some parameters but update others fails with SG_ERR_UNSUPPORTED on every
 * rank, nothing changed (give every parameter a gradient, sg_grad_ready marking zeros); a step
 * with no gradient at all changes nothing there too. Hybrid engines (replicas) update every parameter
 * as if its gradient were zeros, as before (docs/limits.md). */
SG_API sg_status sg_step(sg_engine *e, sg_step_info *info);
/* The info of the latest sg_step, as sg_step(e, &info) would have filled it, for a caller that
 * passed NULL there (a step with info asked for waits once for the device; one without it need
 * not wait at all: DESIGN.md section 4). Where the device decided that step, the first call
 * after it reads its outcome, waiting for the device if it has not written it yet; otherwise
 * nothing waits. Not collective. SG_ERR_INVALID_STATE before the first step. */
SG_API sg_status sg_last_step_info(sg_engine *e, sg_step_info *info);
SG_API sg_status sg_set_lr(sg_engine *e, float lr);
/* The learning rate in effect (config, sg_set_lr, or restored by sg_load). */
SG_API sg_status sg_get_lr(sg_engine *e, float *lr);
SG_API sg_status sg_get_loss_scale(sg_engine *e, float *scale);
/* The stream (a cudaStream_t) that the caller's kernels run on; the engine orders its own work
 * after it. NULL: an internal stream. CPU engines accept only NULL (SG_ERR_UNSUPPORTED). */
SG_API sg_status sg_set_stream(sg_engine *e, void *cuda_stream);

/* Parameter groups (like torch.optim param groups): each parameter belongs to one group
 * 0..SG_MAX_GROUPS-1 (default 0), and each group has its own lr and weight_decay. */
#define SG_MAX_GROUPS 16
/* Puts parameter `id` in `group`, before sg_finalize. Part of what the ranks must agree on: a
 * parameter in different groups on different ranks fails sg_finalize with SG_ERR_MISMATCH. */
SG_API sg_status sg_set_param_group(sg_engine *e, int id, int group);
/* Sets a group's lr and weight_decay (finite, >= 0), any time after create, between steps. A
 * group never set takes the config's lr and weight_decay. Group 0 is the config's: sg_set_lr
 * sets its lr, and sg_set_group(e, 0, ...) its lr and weight decay. Not checked across ranks
 * (like sg_set_lr). SG_PARAM_NO_DECAY parameters never decay, whatever their group. */
SG_API sg_status sg_set_group(sg_engine *e, int group, float lr, float weight_decay);
/* The lr and weight_decay group `group` uses in the next step. sg_save records every group's
 * values and sg_load restores them (a checkpoint written before groups existed gives every
 * group its lr and leaves the weight decays as they are). */
SG_API sg_status sg_get_group(sg_engine *e, int group, float *lr, float *weight_decay);

/* AdamW hyperparameters as doubles, for callers whose values are doubles (Python, and
 * torch.optim.AdamW, which forms 1 - beta2, lr * weight_decay and lr / (1 - beta1^t) in double
 * and rounds each to float once where its CPU kernels take them). The engine forms every per-step
 * scalar the same way from these values, so for the same Python values m, v and the parameters
 * follow torch's single-tensor AdamW; the float fields of sg_config (and sg_set_lr,
 * sg_set_group) give the doubles of their float values. Filled by sg_get_hparams, changed, and
 * given to sg_set_hparams. */
typedef struct sg_hparams {
  size_t struct_size;   /* sizeof(sg_hparams) */
  double lr;            /* the group's: finite, >= 0 */
  double weight_decay;  /* the group's: finite, >= 0 */
  double beta1, beta2;  /* every group's: in [0, 1) */
  double eps;           /* every group's: finite, > 0 */
  double max_grad_norm; /* every group's: finite, >= 0; 0: no clipping */
} sg_hparams;
/* Group `group`'s lr and weight_decay and the engine's betas, eps and max_grad_norm, as the next
 * step uses them. */
SG_API sg_status sg_get_hparams(sg_engine *e, int group, sg_hparams *out);
/* Sets group `group`'s lr and weight_decay and the engine's betas, eps and max_grad_norm (the
 * last four for every group), between steps; every value is checked before any is set. Not
 * checked across ranks (like sg_set_lr): give every rank the same values. */
SG_API sg_status sg_set_hparams(sg_engine *e, int group, const sg_hparams *h);
/* Collective, after the micro-batches of a step and before sg_step: the global L2 norm of the
 * reduced, unscaled gradient that the next sg_step clips with (what torch.nn.utils.clip_grad_norm_
 * returns: the norm before clipping; inf or NaN for non-finite gradients). sg_step reuses it
 * unless gradients arrive in between. */
SG_API sg_status sg_grad_norm(sg_engine *e, float *norm);
/* Multiplies the gradient of the coming sg_step by `factor` (finite; any sign; 0 allowed), as
 * torch's clip_grads_with_norm_ or grad.mul_(c) scale every .grad in place: sg_grad_norm after it
 * returns |product of the factors| x the norm, and sg_step clips (max_grad_norm) and updates with
 * the scaled gradient. Factors multiply until the accumulator is cleared (sg_step, skipped or
 * not, sg_grad_zero, sg_load). The factor applies to the step's whole gradient, micro-batches
 * added after the call included (a caller that wants torch's "only what is there now" adds no
 * gradient after it). Local: give every rank the same factors. */
SG_API sg_status sg_grad_scale(sg_engine *e, double factor);

typedef struct sg_memory_stats {
  size_t struct_size;
  size_t params_bytes; /* working parameters (full replica) */
  size_t grads_bytes;  /* gradient slots / staging + accumulators (+ no_sync buffer) */
  size_t master_bytes; /* fp32 master weights (0 for f32 params, whose slice is the master) */
  size_t optim_bytes;  /* AdamW m and v */
  size_t comm_bytes;   /* communication scratch */
  size_t total_bytes;  /* sum of the above */
  size_t peak_bytes;   /* highest total so far */
  size_t numel;        /* elements in the plan, padding included */
  size_t shard_numel;  /* elements owned by one rank */
  /* --- appended in 0.3 (a 0.2-sized struct_size is still accepted) --- */
  size_t host_bytes;   /* pinned host memory the engine holds (offload_optimizer on CUDA:
                          accumulator, master, m, v and the pipeline's buffers; then master and
                          optim are 0 and grads holds the staging only); not part of
                          total_bytes, which counts the device */
} sg_memory_stats;

/* Memory this engine holds, exactly as allocated (after sg_finalize). */
SG_API sg_status sg_memory(sg_engine *e, sg_memory_stats *out);
/* The same numbers without allocating, for parameters of the given sizes at `world` ranks. */
SG_API sg_status sg_estimate_memory(const sg_config *cfg, const size_t *numels, int nparams,
                                    int world, sg_memory_stats *out);

/* ---------------------------------------------------------------------------------------- */
/* Step-time model (docs/planner.md)                                                         */
/* ---------------------------------------------------------------------------------------- */

/* Link levels of a cluster: inside a node, and between nodes. */
#define SG_LEVEL_NODE 0
#define SG_LEVEL_NET 1
#define SG_LEVELS 2

/* How a collective moves its bytes over the ranks: SG_ALGO_HOST, the host communicators
 * (threads, MPI, the caller's transport: a ring at 2 ranks, every rank sending straight to every
 * other from 3, so each rank puts its share for every other node on its node's link);
 * SG_ALGO_RING, a ring over the ranks in node order (NCCL: a node's link carries what one rank
 * of a flat ring sends). */
#define SG_ALGO_HOST 0
#define SG_ALGO_RING 1

/* The machines a step runs on: what `python -m shardgrad.plan --probe` measures, or a
 * description. Fill with sg_hardware_init(&hw, sizeof hw), then set what is known. Fields are
 * only ever appended. */
typedef struct sg_hardware {
  size_t struct_size;
  int ranks_per_node;       /* 0: every rank its own node; else ranks sharing a node's link */
  int algorithm;            /* SG_ALGO_HOST */
  double link_bytes_per_s[SG_LEVELS]; /* NODE: the bus bytes per second one rank sends inside
                               its node; NET: bytes per second one node's link carries each way
                               (shared by the node's ranks). > 0 */
  double link_latency_s[SG_LEVELS]; /* cost of one message step of a collective at the level */
  double compute_s;         /* the caller's forward + backward time of one micro-batch, >= 0 */
  double backward_fraction; /* 2/3: the part of compute_s that is the backward pass, in (0, 1] */
  double optim_params_per_s;/* the device's norm + AdamW rate, elements of the shard per second
                               (0: device_bytes_per_s / the bytes AdamW moves per element) */
  double device_bytes_per_s;/* device memory bandwidth (read + written), used where the rate
                               above is 0 */
  double host_optim_params_per_s; /* optimizer offload: the host's norm + AdamW rate */
  double pcie_bytes_per_s;  /* optimizer offload: host<->device copy rate, each way */
  double overlap[SG_LEVELS];/* 1: communication at the level runs beside compute without
                               slowing it; 0: every second of it that the queues hide still
                               costs a second of compute (ranks and their comm threads sharing
                               cores); in [0, 1] */
  double handover_s_per_byte; /* 0: what the caller's thread spends per gradient byte of a
                               micro-batch handing it to the engine (writing into slots whose
                               pages were given back, the slot waits) beyond writing a buffer
                               of its own; >= 0 */
  double replica_bytes_per_s; /* 0: link_bytes_per_s[SG_LEVEL_NET]. Else what one node's link
                               carries each way while a hybrid engine sums its buckets across
                               nodes behind their reductions (every rank of the node its own
                               flow to its counterparts, the node's ranks meeting in the next
                               bucket's reduction): the rate of the exact and codec sums; the
                               sums at the step (offload, outer steps) keep the link rate. >= 0 */
  uint64_t magic;           /* written by sg_hardware_init; never set it (a description that was
                               never initialised is refused: "call sg_hardware_init") */
} sg_hardware;

/* Defaults: one node per rank, SG_ALGO_HOST, 1 Gbit/s links (0.125e9 B/s, 50 us), 10 GB/s
 * device memory, no compute, backward 2/3, no offload rates, overlap 1, and the magic.
 * struct_size must be sizeof. */
SG_API sg_status sg_hardware_init(sg_hardware *hw, size_t struct_size);

/* What one optimizer step costs on one rank, by part. Times in seconds; bytes per step. */
typedef struct sg_step_estimate {
  size_t struct_size;           /* sizeof(sg_step_estimate), set by the caller */
  double step_s;                /* predicted wall time of one optimizer step */
  double compute_s;             /* microbatches x forward + backward */
  double exposed_s[SG_LEVELS];  /* communication not hidden behind compute, by the level that
                                   bounds it, plus what the hidden part took from the compute
                                   beside it where that delayed the step (hw->overlap < 1) */
  double comm_s[SG_LEVELS];     /* all communication time per level, hidden or not */
  double optim_s;               /* norm + AdamW (device or host), on the step's critical path */
  double copy_s;                /* offload: host<->device copies not hidden */
  double handover_s;            /* microbatches x the gradients' bytes x handover_s_per_byte */
  /* What the engine's communicators count (sg_comm_stats) per step on this rank: the shard
   * communicator (the flat engine's only one) and the replica communicator (hybrid). */
  uint64_t shard_bytes;         /* bus bytes sent (= received) */
  uint64_t shard_collectives;
  uint64_t replica_bytes;
  uint64_t replica_collectives;
  uint64_t link_bytes[SG_LEVELS]; /* NODE: bytes this rank sends inside its node; NET: bytes
                                     its node sends over its link (all its ranks) */
  uint64_t optim_bytes;         /* bytes the update reads and writes on this rank */
  uint64_t copy_bytes;          /* offload: bytes copied host<->device on this rank */
} sg_step_estimate;

/* The time of one optimizer step of `microbatches` micro-batches (each reduced: sync on;
 * hybrid: sg_set_microbatches said how many) for parameters of the given sizes (registration
 * order) at `world` ranks, with cfg's layout (cfg->shard_ranks: hybrid, as for
 * sg_estimate_memory) on the hardware *hw. Simulates the engine's queues: the reductions on
 * the comm queue in plan order as the backward pass hands over each bucket (staging_buckets
 * in flight), the cross-node sums behind each bucket's reduction in the last micro-batch, the
 * norm, the update bucket by bucket with each bucket's all-gather behind it, and the gathers
 * behind the next forward pass with overlap_param_gather. Where ranks share cores, compute
 * beside a collective runs slower by (1 - hw->overlap) of the collective's time, which
 * delays the step where compute is on its critical path; step_s = compute_s + handover_s +
 * exposed_s[0] + exposed_s[1] + optim_s + copy_s. Replica codecs: the all-to-all and the
 * all-gather of each bucket's codes behind its reduction. Outer steps (cfg->outer_every = H):
 * the times are the mean over a period of H steps, the byte and collective counts those of the
 * period's last step (the one that syncs: the pseudo-gradient's all-reduce per bucket, with
 * replica_codec SG_CODEC_INT8 its codes' all-to-all and all-gather, then the node's
 * all-gathers). Streaming (cfg->outer_streaming): step k of the period syncs group k - 1; the
 * times are the mean over the period, the sums modelled as waited for at the step (not their
 * overlap with the next step's compute: an upper bound), the counts the period's last step's
 * (group H - 1's buckets; none when H exceeds the bucket count; its sum completes in the next
 * step). Not modelled: the codecs' and the outer
 * step's host arithmetic, sg_set_sync(0) steps, a hybrid engine not told its micro-batch
 * count (docs/planner.md). */
SG_API sg_status sg_estimate_step(const sg_config *cfg, const size_t *numels, int nparams,
                                  int world, int microbatches, const sg_hardware *hw,
                                  sg_step_estimate *out);

SG_API void sg_engine_destroy(sg_engine *e);

/* ---------------------------------------------------------------------------------------- */
/* CUDA / NCCL (section maintained with src/comm/nccl.c)                                     */
/* ---------------------------------------------------------------------------------------- */

/* NCCL communicators: one rank per GPU. NCCL is not linked: it is loaded on first use (an NCCL
 * already in the process, e.g. PyTorch's, else $SG_NCCL_LIBRARY, else libnccl.so.2), and
 * SG_ERR_UNSUPPORTED names what was tried when none loads. All return SG_ERR_UNSUPPORTED when the
 * library is built without NCCL (sg_has_backend("nccl") == 0), SG_ERR_CUDA ("no CUDA device found") on a machine
 * without a GPU, SG_ERR_TIMEOUT when the ranks do not all join within SG_NCCL_INIT_TIMEOUT_MS
 * (default 600000 ms), SG_ERR_COMM when NCCL fails. Collectives use the engine's CUDA device
 * (sg_config.device = SG_DEVICE_CUDA, cuda_device = the communicator's GPU). */

/* Writes a new NCCL unique id (128 bytes) to id128, to be sent to every rank by the caller
 * (rank 0 calls it once). */
SG_API sg_status sg_nccl_unique_id(void *id128);

/* Collective over `world` ranks: rank `rank` on GPU `cuda_device` (-1: the calling thread's
 * current device), joining with the 128-byte id from sg_nccl_unique_id. id128 may be NULL when
 * the environment variable SG_NCCL_ID_FILE names a path on a file system all ranks share: rank
 * 0 creates the id and writes it there atomically, the others wait for the file, and rank 0
 * removes it once everyone has joined. Use a fresh path for every job. */
SG_API sg_status sg_comm_create_nccl(int rank, int world, const void *id128, int cuda_device,
                                     sg_comm **out);

/* Collective over an MPI communicator (`mpi_comm` points to an MPI_Comm; NULL: MPI_COMM_WORLD),
 * which must already be initialized: rank 0's id is broadcast over MPI and each rank takes GPU
 * (rank within its node) mod (GPUs on the node). MPI is used only here, not for the
 * collectives. SG_ERR_UNSUPPORTED when built without MPI or without NCCL. */
SG_API sg_status sg_comm_create_nccl_mpi(const void *mpi_comm, sg_comm **out);

/* ---------------------------------------------------------------------------------------- */
/* Checkpoints                                                                               */
/* ---------------------------------------------------------------------------------------- */

/* Collective. Saves the engine's training state into directory `dir` (created if missing; it
 * must be on a file system every rank sees): each rank writes the fragments of the parameters
 * it owns (working values, fp32 master where the params are not f32, AdamW m and v, with a
 * CRC-32C per chunk); rank 0 then writes `dir/manifest` (world size, step, loss-scale state, lr,
 * config, every parameter's name, numel, flags and dtype, where each fragment is), which commits
 * the save. Every save writes new file names (a new generation), fsyncs them and the directory,
 * and deletes the previous generation only after the new manifest is durable: a crash at any
 * point leaves the previous checkpoint in `dir` loadable. Gradients are not saved: call it
 * between steps. Every rank returns the same status.
 * SG_ERR_INVALID_STATE: a micro-batch is in progress on this rank (it returns at once, without
 *   joining the collective). SG_ERR_IO: a file could not be created, written or synced (the
 *   previous checkpoint stays current). */
SG_API sg_status sg_save(sg_engine *e, const char *dir);

/* Collective. Restores a checkpoint written by sg_save at any world size, bucket size or
 * strategy: master weights, m, v and working parameters (bit for bit, so that training
 * continues exactly as it would have), the step counter, lr, and the dynamic loss scale with
 * its count of clean steps (when both the checkpoint and the engine scale dynamically).
 * Gradients accumulated since the last step are discarded. Each rank reads only the parts of
 * the files its shard needs, verifying every checksum, into host memory (the size of its
 * shard); nothing in the engine changes on any rank until every rank has succeeded.
 * Every rank returns the same status, with the file and the reason:
 * SG_ERR_IO: directory, manifest or a rank file missing or unreadable.
 * SG_ERR_CORRUPT: bad magic or format version, checksum mismatch, truncated file, a rank file
 *   that does not belong to the manifest.
 * SG_ERR_MISMATCH: a parameter of the engine is not in the checkpoint or the checkpoint has one
 *   the engine does not, numel or param dtype differ (the message names the parameter).
 * SG_ERR_INVALID_STATE: a micro-batch is in progress on this rank (as for sg_save). */
SG_API sg_status sg_load(sg_engine *e, const char *dir);

/* Options of sg_load_ex. Fill with sg_load_options_init(&o, sizeof o), then change. Fields are
 * only ever appended. */
typedef struct sg_load_options {
  size_t struct_size;
  int convert_optim_state; /* 0: a checkpoint whose optimizer state is in the other format
                              (cfg.optim_state_dtype: fp32 or 8-bit) is refused with
                              SG_ERR_MISMATCH. 1: converted while loading: fp32 moments are
                              coded into this engine's 8-bit blocks (the update's rules, its
                              stochastic rounding with the random bits of the checkpoint's step
                              and each element's index: the same bits at any world size; tensors
                              below optim_state_min_numel keep their fp32 values), or 8-bit
                              state decoded to fp32 (the values sg_get_optim_state reported
                              before the save). A checkpoint in the engine's own format loads as
                              with 0. */
  int reserved;            /* 0 (must stay 0): ends the struct on an 8-byte boundary */
} sg_load_options;

/* Defaults above. struct_size must be sizeof(sg_load_options) (SG_ERR_INVALID_ARGUMENT). */
SG_API sg_status sg_load_options_init(sg_load_options *opt, size_t struct_size);

/* sg_load with options (NULL: sg_load's behaviour). SG_ERR_INVALID_ARGUMENT: a struct_size or
 * a reserved field that sg_load_options_init did not set. */
SG_API sg_status sg_load_ex(sg_engine *e, const char *dir, const sg_load_options *opt);

/* Collective; rank 0 writes. The full fp32 master weights of every parameter, by name, as a
 * safetensors file at `path` (1-D tensors of numel elements, dtype F32; metadata "format": "pt"
 * and the step), written to path.tmp, fsynced and renamed. Readable by the Python
 * `safetensors` package, PyTorch and the Hugging Face tools. Every rank returns the same status
 * (SG_ERR_IO when rank 0 cannot write). */
SG_API sg_status sg_export(sg_engine *e, const char *path);

/* Collective; every rank reads `path`. Sets every parameter (working copy and fp32 master) from
 * the safetensors tensor of the same name (F32, BF16 or F16; any shape with numel elements);
 * tensors without a matching parameter are ignored. Optimizer state and step are unchanged
 * (a fresh engine starts training from the file). Every rank checks the whole header before any
 * parameter changes: SG_ERR_IO (missing, unreadable), SG_ERR_CORRUPT (malformed header, data
 * offsets outside the file), SG_ERR_MISMATCH (a parameter missing, numel differs, another
 * dtype). A read error after that point names the parameters already set. */
SG_API sg_status sg_import(sg_engine *e, const char *path);

/* Optimizer steps taken so far (skipped steps do not count), as sg_step_info.step reports it;
 * restored by sg_load, so that a resumed training loop knows where it is. */
SG_API sg_status sg_get_step(sg_engine *e, uint64_t *step);
/* Parameter id's own step count: the steps that updated it, the t of its bias correction
 * (torch.optim.AdamW's state['step']). sg_get_step's value less the steps in which no rank gave
 * it a gradient (see sg_step); restored by sg_load. */
SG_API sg_status sg_get_param_step(sg_engine *e, int id, uint64_t *step);

/* ---------------------------------------------------------------------------------------- */
/* Tracing: when the bucket reductions ran, against the caller's backward pass               */
/* ---------------------------------------------------------------------------------------- */

/* Every time is taken on the queue the work runs on: the caller's stream (CUDA) or thread (CPU)
 * for SG_TRACE_GRAD_READY, SG_TRACE_STEP and SG_TRACE_MARK, the engine's communication stream
 * (CUDA) or thread (CPU) for SG_TRACE_REDUCE and SG_TRACE_GATHER. So on a GPU a GRAD_READY
 * event is the moment the caller's kernels before sg_grad_ready finished, not the moment the
 * host called it, and a REDUCE that starts before the last GRAD_READY of its micro-batch ran
 * while the backward pass was still computing. */
typedef enum {
  SG_TRACE_GRAD_READY = 0, /* instant: a gradient became ready (sg_grad_ready, sg_grad_add);
                              id = parameter id, label = its name */
  SG_TRACE_REDUCE = 1,     /* span: one bucket's reduce-scatter (all-reduce under NO_SHARD)
                              and its accumulation; id = bucket index in reduction order */
  SG_TRACE_STEP = 2,       /* span: the step's gradient norm and AdamW on this rank's shard */
  SG_TRACE_GATHER = 3,     /* span: the all-gather of one bucket's working parameters after the
                              step; id = bucket index */
  SG_TRACE_MARK = 4,       /* instant: sg_trace_mark; label = its label */
  SG_TRACE_WAIT = 5        /* span: the caller's queue waited for all-gathers (sg_param_wait,
                              or the end of sg_step without overlap_param_gather); id = the
                              last bucket waited for. Its length is gather time not hidden. */
} sg_trace_kind;

typedef struct sg_trace_event {
  int32_t kind;      /* sg_trace_kind */
  int32_t id;        /* parameter or bucket index; -1 where none applies */
  uint64_t step;     /* optimizer steps taken when the event was issued (sg_get_step) */
  double start_us;   /* microseconds since sg_trace_start, on the queue's clock */
  double end_us;     /* == start_us for instants */
  char label[48];    /* NUL-terminated, truncated */
} sg_trace_event;

/* Starts recording (after sg_finalize) into room for `max_events` events (0: 16384; at most
 * 4194304); events beyond it are counted as dropped, not recorded. Not collective. Already
 * recording: SG_ERR_INVALID_STATE. Recording also starts by itself at sg_finalize when the
 * environment variable SG_TRACE names a file (%r becomes the rank); sg_engine_destroy then
 * writes the trace there. */
SG_API sg_status sg_trace_start(sg_engine *e, size_t max_events);
/* Stops recording; the events stay readable until the next sg_trace_start. */
SG_API sg_status sg_trace_stop(sg_engine *e);
/* An instant on the caller's queue, e.g. "backward" where the backward pass begins. */
SG_API sg_status sg_trace_mark(sg_engine *e, const char *label);
/* Copies up to `cap` recorded events, in the order they were issued, to `out` (may be NULL when
 * cap is 0); *count receives the number recorded (may exceed cap), *dropped (may be NULL) the
 * number that did not fit. Waits for the engine's queued work to finish, since times are known
 * only then. */
SG_API sg_status sg_trace_events(sg_engine *e, sg_trace_event *out, size_t cap, size_t *count,
                                 uint64_t *dropped);
/* Writes the recorded events as a Chrome trace (JSON; chrome://tracing, https://ui.perfetto.dev)
 * to `path` (%r becomes the rank): pid = rank, one track for the caller's queue and one for the
 * communication queue. Waits like sg_trace_events. SG_ERR_IO when the file cannot be written. */
SG_API sg_status sg_trace_write(sg_engine *e, const char *path);

#ifdef __cplusplus
}
#endif
#endif /* SHARDGRAD_H */
