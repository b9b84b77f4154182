/* NCCL loaded at run time (src/comm/sg_nccl_dl.c), for src/comm/nccl.c.
 *
 * libshardgrad does not link NCCL: a process holds one library per soname, so a linked
 * libnccl.so.2 would be the one that a later `import torch` gets too, and torch needs its own
 * (newer) NCCL. NCCL is therefore opened with dlopen when the first NCCL communicator or id is
 * made, preferring an NCCL the process has already loaded, so that shardgrad and torch share one.
 * The other way round, an NCCL loaded here is the one that a later `import torch` gets: import
 * torch first, or point SG_NCCL_LIBRARY at torch's libnccl.so.2.
 *
 * The table's members have the types of the prototypes in <nccl.h>, so that a signature this
 * file gets wrong is a compile error. */
#ifndef SG_NCCL_DL_H
#define SG_NCCL_DL_H

#ifdef SG_HAVE_NCCL

#include <nccl.h> /* types and prototypes only; no symbol of it is linked */

#include "../../core/sg_core.h" /* sg_status */

/* Every NCCL function that nccl.c calls. */
typedef struct sg__nccl_lib {
  __typeof__(ncclGetVersion) *GetVersion;
  __typeof__(ncclGetErrorString) *GetErrorString;
  __typeof__(ncclGetLastError) *GetLastError;
  __typeof__(ncclGetUniqueId) *GetUniqueId;
  __typeof__(ncclCommInitRankConfig) *CommInitRankConfig;
  __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
  __typeof__(ncclCommFinalize) *CommFinalize;
  __typeof__(ncclCommDestroy) *CommDestroy;
  __typeof__(ncclCommAbort) *CommAbort;
  __typeof__(ncclGroupStart) *GroupStart;
  __typeof__(ncclGroupEnd) *GroupEnd;
  __typeof__(ncclAllReduce) *AllReduce;
  __typeof__(ncclReduceScatter) *ReduceScatter;
  __typeof__(ncclAllGather) *AllGather;
  __typeof__(ncclBroadcast) *Broadcast;
  __typeof__(ncclSend) *Send; /* the all-to-all: a group of sends and receives */
  __typeof__(ncclRecv) *Recv;
  /* Optional (NCCL >= 2.18; NULL before): a second engine on one communicator splits it. Not
   * __typeof__: older headers do not declare it. */
  ncclResult_t (*CommSplit)(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                            ncclConfig_t *config);
  int version; /* ncclGetVersion's code, e.g. 22809 for 2.28.9 */
} sg__nccl_lib;

/* Loads NCCL once per process (thread-safe); every later call returns the first call's result.
 * The library is looked for, in order:
 *   1. an NCCL already in the process: a loaded libnccl.so.2 (dlopen RTLD_NOLOAD; e.g. torch's),
 *      else NCCL in the global symbol scope (a program that links NCCL into itself and exports
 *      it, or loaded it RTLD_GLOBAL under another name);
 *   2. the file named by SG_NCCL_LIBRARY (a path; when set, it is the only file tried);
 *   3. libnccl.so.2, then libnccl.so (the dynamic loader's search: LD_LIBRARY_PATH, ldconfig);
 *   4. the NCCL that the build found (SG_NCCL_BUILD_LIBRARY), when there was one.
 * The first library that opens is checked (every function present, same major version as the
 * <nccl.h> of the build) and used, or the load fails; it is never unloaded. On failure returns
 * SG_ERR_UNSUPPORTED, the text "fn: ..." saying what was tried and why each failed.
 * On success *lib is the table, valid until the process ends. */
sg_status sg__nccl_lib_load(const char *fn, const sg__nccl_lib **lib);

#endif /* SG_HAVE_NCCL */

#endif /* SG_NCCL_DL_H */
