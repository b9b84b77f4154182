/* A mock of the part of NCCL that src/comm/backend/nccl.c uses, for tests without a GPU
 * (tests/cudamock/sg_ncclmock.cpp): ranks are threads of one process, found through the unique
 * id; a collective is a gated item on each rank's mock CUDA stream that completes when every
 * rank's stream has reached it. Sums run in rank order in fp32 (f64 for f64) and are rounded
 * once, like the local communicator, so results can be compared bit for bit. Communicators are
 * non-blocking when asked: init and ncclGroupEnd return ncclInProgress, and
 * ncclCommGetAsyncError says when they are done. */
#ifndef SG_NCCLMOCK_H
#define SG_NCCLMOCK_H

#include <limits.h> /* INT_MIN */
#include <stddef.h>

#include "cuda_runtime.h" /* cudaStream_t (the mock's) */

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the real header this mock follows (ncclGetVersion says the same). */
#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_VERSION_CODE 22809

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
} ncclResult_t;

typedef struct ncclComm *ncclComm_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9
} ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;

typedef struct ncclConfig_v22800 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_INITIALIZER \
  { sizeof(ncclConfig_t), 0xcafebeef, 22809, NCCL_CONFIG_UNDEF_INT }

ncclResult_t ncclGetVersion(int *version);
const char *ncclGetErrorString(ncclResult_t r);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
/* As NCCL's: every rank of comm calls it (the k-th split of each rank meets); the ranks of one
 * color >= 0 form a communicator, ranked by (key, rank); NCCL_SPLIT_NOCOLOR gives NULL. On a
 * blocking parent the mock blocks until every rank has called (at most 60 s); on a non-blocking
 * one it returns ncclInProgress with *newcomm NULL, as NCCL >= 2.18 does: a background thread
 * writes *newcomm once every rank has split, and the parent says ncclInProgress (and refuses
 * collectives) until then. ncclCommInitRankConfig in non-blocking mode also returns with the
 * handle NULL and writes it from a thread a little later. */
#define NCCL_SPLIT_NOCOLOR -1
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t *config);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);

/* ---- controls for tests ----------------------------------------------------------------- */

/* The communicator reports `r` as its asynchronous error from now on (a peer died). */
void sg_ncclmock_fail(ncclComm_t comm, ncclResult_t r);
/* The same for every live communicator. */
void sg_ncclmock_fail_all(ncclResult_t r);
/* The same for every live communicator of `world` ranks. */
void sg_ncclmock_fail_world(int world, ncclResult_t r);
/* Communicators created and not destroyed or aborted. */
int sg_ncclmock_live(void);
/* Calls that passed the handle of a destroyed or aborted communicator (NCCL: use after free). */
long long sg_ncclmock_dead_calls(void);
/* From now on every collective call stays `ms` inside the mock before it looks at its
 * communicator (0: off), so that a test can act while a thread is inside NCCL. */
void sg_ncclmock_hold(int ms);
/* Collective calls now held inside the mock. */
int sg_ncclmock_inside(void);
/* Background threads of non-blocking init/split that have not written their handle yet. */
int sg_ncclmock_background(void);
/* A slow link: from now on every stream on which a communicator of `nranks` ranks queues a
 * collective is stalled right after it (sg_cudamock_stall), until sg_ncclmock_stall_size(0)
 * releases them all. */
void sg_ncclmock_stall_size(int nranks);
/* Collectives of communicators of `nranks` ranks computed so far (every rank's stream reached
 * its item), all threads. */
long long sg_ncclmock_done(int nranks);

#ifdef __cplusplus
}
#endif

#endif /* SG_NCCLMOCK_H */
