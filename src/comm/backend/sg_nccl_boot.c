/* How the ranks of an NCCL communicator learn its unique id before NCCL can run: through a
 * file on a shared file system (SG_NCCL_ID_FILE, read and written here for nccl.c) or through
 * MPI (sg_comm_create_nccl_mpi). Apart from the MPI bootstrap of the id, nothing in the library
 * outside src/comm/backend/mpi.c includes <mpi.h>: this file is that one exception. Without
 * NCCL it is empty (sg_nccl_stub.c has the public functions). */
#ifdef SG_HAVE_NCCL

#define _POSIX_C_SOURCE 200809L /* fsync, nanosleep, O_CLOEXEC under -std=c11 */

#include <errno.h>  /* errno, ENOENT, EINTR, EEXIST */
#include <fcntl.h>  /* open */
#include <stdio.h>  /* snprintf, rename */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcpy, memcmp, memset, strerror, strlen */
#include <time.h>   /* nanosleep */
#include <unistd.h> /* read, write, close, fsync, unlink, getpid */
#ifdef SG_HAVE_MPI
#include <mpi.h> /* MPI_Bcast of the id, MPI_Comm_split_type for the local GPU */
#endif

#include "../../device/sg_device_cuda.h" /* sg__device_cuda_count */
#include "../sg_comm.h"                  /* sg__err, sg_comm_create_nccl */
#include "sg_nccl_dl.h"                  /* sg__nccl_lib_load: every rank loads NCCL */
#include "sg_nccl_internal.h"            /* what this file defines */

#define SG__NCCL_DEFAULT_TIMEOUT_MS 600000

static int sg__nccl_expired(int64_t deadline_ms) {
  return deadline_ms != INT64_MAX && sg__now_ms() > deadline_ms;
}

int sg__nccl_init_timeout_ms(void) {
  /* a value that is not a positive number: the default (sg__env_report warns) */
  return (int)sg__env_value(SG_ENV_NCCL_INIT_TIMEOUT_MS, SG__NCCL_DEFAULT_TIMEOUT_MS);
}

/* ---- the id file ------------------------------------------------------------------------- */

/* "SGNCCLID", version, world (little-endian u32), the id. */
#define SG__NCCL_ID_MAGIC "SGNCCLID"
#define SG__NCCL_ID_VERSION 1u
#define SG__NCCL_ID_FILE_BYTES (8 + 4 + 4 + SG__NCCL_ID_BYTES)

static void sg__nccl_put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t sg__nccl_get_u32(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}

static int sg__nccl_write_all(int fd, const unsigned char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* The temporary file is written and synced in full before the rename, so a reader sees either
 * no file or a complete one (rename is atomic on POSIX file systems, NFS included). */
sg_status sg__nccl_id_file_write(const char *path, const void *id128, int world) {
  static const char fn[] = "sg__nccl_id_file_write";
  if (!path || !*path || !id128 || world < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad argument (path %s, world %d)", fn,
                   path ? path : "NULL", world);
  unsigned char rec[SG__NCCL_ID_FILE_BYTES];
  memcpy(rec, SG__NCCL_ID_MAGIC, 8);
  sg__nccl_put_u32(rec + 8, SG__NCCL_ID_VERSION);
  sg__nccl_put_u32(rec + 12, (uint32_t)world);
  memcpy(rec + 16, id128, SG__NCCL_ID_BYTES);
  size_t tlen = strlen(path) + 32;
  char *tmp = (char *)malloc(tlen);
  if (!tmp) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: path buffer", fn);
  snprintf(tmp, tlen, "%s.tmp.%ld", path, (long)getpid());
  sg_status st = SG_OK;
  /* A new file: never written through a link planted on the shared file system. */
  int fd = -1;
  const int cerr = sg__file_create(tmp, 0600, &fd, NULL);
  if (cerr) {
    st = sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot create %s: %s", fn, tmp,
                    cerr == EEXIST ? sg__file_exists_why(tmp) : strerror(cerr));
    goto done;
  }
  int bad = sg__nccl_write_all(fd, rec, sizeof rec) != 0 || fsync(fd) != 0;
  int err = errno;
  if (close(fd) != 0 && !bad) {
    bad = 1;
    err = errno;
  }
  if (!bad && rename(tmp, path) != 0) {
    bad = 1;
    err = errno;
  }
  if (bad) {
    (void)unlink(tmp);
    st = sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot write %s: %s", fn, path,
                    strerror(err));
  }
done:
  free(tmp);
  return st;
}

static sg_status sg__nccl_id_parse(const unsigned char *rec, ssize_t got, const char *path,
                                   int world, void *id128) {
  static const char fn[] = "sg__nccl_id_file_read";
  if (got != SG__NCCL_ID_FILE_BYTES || memcmp(rec, SG__NCCL_ID_MAGIC, 8) != 0 ||
      sg__nccl_get_u32(rec + 8) != SG__NCCL_ID_VERSION)
    return sg__err(SG_ERR_CORRUPT, "%s: %s is not a shardgrad NCCL id file (%zd bytes)", fn, path,
                   got);
  uint32_t w = sg__nccl_get_u32(rec + 12);
  if (w != (uint32_t)world)
    return sg__err(SG_ERR_MISMATCH, "%s: %s was written for world %u, this rank has world %d", fn,
                   path, (unsigned)w, world);
  memcpy(id128, rec + 16, SG__NCCL_ID_BYTES);
  return SG_OK;
}

sg_status sg__nccl_id_file_read(const char *path, int world, int64_t deadline_ms, void *id128) {
  static const char fn[] = "sg__nccl_id_file_read";
  if (!path || !*path || !id128 || world < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: bad argument (path %s, world %d)", fn,
                   path ? path : "NULL", world);
  int fd;
  for (unsigned iter = 0;; iter++) {
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) break;
    if (errno != ENOENT)
      return sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot open %s: %s", fn, path,
                        strerror(errno));
    if (sg__nccl_expired(deadline_ms))
      return sg__err_at(SG_ERR_TIMEOUT, __FILE__, __LINE__,
                        "%s: %s did not appear before the deadline (is rank 0 running?)", fn, path);
    struct timespec ts = {0, (iter < 10 ? 1 : 20) * 1000000L};
    nanosleep(&ts, NULL);
  }
  unsigned char rec[SG__NCCL_ID_FILE_BYTES + 1];
  ssize_t got = 0, r;
  while ((r = read(fd, rec + got, sizeof rec - (size_t)got)) != 0) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int err = errno;
      close(fd);
      return sg__err_at(SG_ERR_IO, __FILE__, __LINE__, "%s: cannot read %s: %s", fn, path,
                        strerror(err));
    }
    got += r;
    if ((size_t)got == sizeof rec) break;
  }
  close(fd);
  return sg__nccl_id_parse(rec, got, path, world, id128);
}

/* ---- MPI bootstrap -------------------------------------------------------------------------- */

#ifdef SG_HAVE_MPI
/* Rank within the node (MPI_COMM_TYPE_SHARED), which picks the GPU. */
static int sg__nccl_local_rank(MPI_Comm mc, int rank, int *local) {
  MPI_Comm node;
  if (MPI_Comm_split_type(mc, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) != MPI_SUCCESS)
    return -1;
  int rc = MPI_Comm_rank(node, local);
  MPI_Comm_free(&node);
  return rc == MPI_SUCCESS ? 0 : -1;
}

/* Collective over mpi_comm. Every rank learns whether all could pick a GPU and whether rank 0
 * got an id before anyone goes on, so that one rank's failure fails all of them instead of
 * leaving the others in NCCL's initialization until the timeout. */
sg_status sg_comm_create_nccl_mpi(const void *mpi_comm, sg_comm **out) {
  static const char fn[] = "sg_comm_create_nccl_mpi";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized)
    return sg__err(SG_ERR_INVALID_STATE, "%s: MPI is not initialized (call MPI_Init first)", fn);
  MPI_Comm mc = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
  int rank = 0, world = 0, local = 0;
  if (MPI_Comm_rank(mc, &rank) != MPI_SUCCESS || MPI_Comm_size(mc, &world) != MPI_SUCCESS ||
      sg__nccl_local_rank(mc, rank, &local) != 0)
    return sg__err_at(SG_ERR_COMM, __FILE__, __LINE__, "%s: MPI rank queries failed", fn);
  sg_status st = SG_OK;
  const int ndev = sg__device_cuda_count();
  if (ndev <= 0)
    st =
        sg__err_at(SG_ERR_CUDA, __FILE__, __LINE__, "%s: no CUDA device found (rank %d)", fn, rank);
  /* Every rank loads NCCL here, so that one without it fails all of them in the round below. */
  const sg__nccl_lib *nc = NULL;
  if (st == SG_OK) st = sg__nccl_lib_load(fn, &nc);
  /* Rank 0's id and everyone's readiness in one round: [ok flag, id]. */
  unsigned char msg[1 + SG__NCCL_ID_BYTES];
  memset(msg, 0, sizeof msg);
  if (rank == 0 && st == SG_OK) st = sg__err_prefix(sg_nccl_unique_id(msg + 1), fn);
  msg[0] = st == SG_OK;
  int ok = st == SG_OK, all_ok = 0;
  if (MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, mc) != MPI_SUCCESS ||
      MPI_Bcast(msg, (int)sizeof msg, MPI_BYTE, 0, mc) != MPI_SUCCESS)
    return sg__err_at(SG_ERR_COMM, __FILE__, __LINE__, "%s: MPI bootstrap failed", fn);
  if (st != SG_OK) return st;
  if (!all_ok || !msg[0])
    return sg__err(SG_ERR_COMM,
                   "%s: another rank failed to set up its GPU, load NCCL or make the NCCL id", fn);
  return sg_comm_create_nccl(rank, world, msg + 1, local % ndev, out);
}
#else
sg_status sg_comm_create_nccl_mpi(const void *mpi_comm, sg_comm **out) {
  (void)mpi_comm;
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_nccl_mpi: out is NULL");
  *out = NULL;
  return sg__err(SG_ERR_UNSUPPORTED, "sg_comm_create_nccl_mpi: built without MPI");
}
#endif /* SG_HAVE_MPI */

#else  /* !SG_HAVE_NCCL */
typedef int sg__nccl_boot_not_built; /* ISO C wants a translation unit to declare something */
#endif /* SG_HAVE_NCCL */
