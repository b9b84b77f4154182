/* CUDA device and NCCL communicator: what can be checked on any machine of a CUDA build.
 * Without a GPU: creating the device or an NCCL communicator fails with SG_ERR_CUDA and says
 * that no device was found (with file:line). With a GPU: both can be created, and a small
 * copy round trip works. Everywhere: argument checks, the public NCCL functions, and the NCCL
 * id file bootstrap (atomic write, polling read, timeout, damaged and mismatched files). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, nanosleep, setenv */

#include <dirent.h>  /* opendir: no temporary file left behind */
#include <pthread.h> /* a late writer for the polling reader */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm/sg_comm.h"          /* sg_comm */
#include "comm/backend/sg_nccl_internal.h" /* id file helpers */
#include "device/sg_device.h"      /* sg__device_cuda_create */
#include "sg_test_check.h"         /* CHECK */

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

static int says(const char *needle) { return strstr(sg_last_error(), needle) != NULL; }

/* ---- device ---------------------------------------------------------------------------- */

static void test_device_args(void) {
  sg__device *d = (sg__device *)&d; /* not NULL: must be cleared */
  check(sg__device_cuda_create(0, 0, NULL) == SG_ERR_INVALID_ARGUMENT, "create: out NULL");
  check(sg__device_cuda_create(0, -2, &d) == SG_ERR_INVALID_ARGUMENT && d == NULL,
        "create: cuda_device -2 rejected, out cleared");
  check(sg__device_cuda_create(-1, 0, &d) == SG_ERR_INVALID_ARGUMENT, "create: rank -1");
}

/* On a GPU machine: a round trip through device memory on both queues. */
static void test_device_present(sg__device *d) {
  const sg__device_ops *o = d->ops;
  float host[64], back[64];
  for (int i = 0; i < 64; i++) host[i] = (float)i * 0.5f;
  void *p = NULL, *q = NULL;
  check(o->alloc(d, sizeof host, &p) == SG_OK && p != NULL, "gpu: alloc");
  check(o->alloc(d, sizeof host, &q) == SG_OK && q != NULL, "gpu: alloc 2");
  check(o->copy(d, SG_Q_COMPUTE, p, host, sizeof host, SG_COPY_H2D) == SG_OK, "gpu: H2D");
  check(o->copy(d, SG_Q_COMM, q, p, sizeof host, SG_COPY_D2D) == SG_OK, "gpu: D2D on comm");
  check(o->sync(d, sg__deadline(10000)) == SG_OK, "gpu: sync");
  memset(back, 0, sizeof back);
  check(o->copy(d, SG_Q_COMPUTE, back, p, sizeof back, SG_COPY_D2H) == SG_OK &&
            memcmp(back, host, sizeof host) == 0,
        "gpu: D2H round trip");
  check(o->zero(d, SG_Q_COMPUTE, p, sizeof host) == SG_OK &&
            o->copy(d, SG_Q_COMPUTE, back, p, sizeof back, SG_COPY_D2H) == SG_OK &&
            back[1] == 0.0f && back[63] == 0.0f,
        "gpu: zero");
  check(o->set_stream(d, NULL) == SG_OK, "gpu: set_stream(NULL) keeps the own stream");
  o->free(d, p);
  o->free(d, q);
}

static void test_device(void) {
  sg__device *d = NULL;
  sg_status st = sg__device_cuda_create(0, -1, &d);
  if (st == SG_OK) {
    printf("note: a CUDA device is present\n");
    check(d != NULL && d->kind == SG_DEVICE_CUDA, "create: CUDA device");
    test_device_present(d);
    d->ops->destroy(d);
    return;
  }
  printf("note: no CUDA device (%s)\n", sg_last_error());
  check(st == SG_ERR_CUDA, "create without GPU: SG_ERR_CUDA");
  check(says("sg__device_cuda_create") && says("no CUDA device found"),
        "create without GPU: message says no CUDA device found");
  check(says("cuda.c:"), "create without GPU: message has file:line");
  check(d == NULL, "create without GPU: out stays NULL");
  /* an explicit ordinal fails the same way (not as an out-of-range argument) */
  check(sg__device_cuda_create(0, 0, &d) == SG_ERR_CUDA && says("no CUDA device found"),
        "create(cuda_device 0) without GPU: no CUDA device found");
}

/* ---- NCCL public functions ---------------------------------------------------------------- */

static void test_nccl_public(void) {
  unsigned char id[128];
  sg_comm *c = (sg_comm *)&c;
  check(sg_nccl_unique_id(NULL) == SG_ERR_INVALID_ARGUMENT, "unique_id: NULL");
  check(sg_comm_create_nccl(0, 1, id, 0, NULL) == SG_ERR_INVALID_ARGUMENT, "create_nccl: out NULL");
  check(sg_comm_create_nccl(1, 1, id, 0, &c) == SG_ERR_INVALID_ARGUMENT && c == NULL,
        "create_nccl: rank >= world, out cleared");
  check(sg_comm_create_nccl(0, 0, id, 0, &c) == SG_ERR_INVALID_ARGUMENT, "create_nccl: world 0");
  check(sg_comm_create_nccl(0, 1, id, -2, &c) == SG_ERR_INVALID_ARGUMENT,
        "create_nccl: cuda_device -2");
  check(sg_comm_create_nccl_mpi(NULL, NULL) == SG_ERR_INVALID_ARGUMENT,
        "create_nccl_mpi: out NULL");
#ifdef SG_HAVE_NCCL
  check(sg_has_backend("nccl") == 1, "has_backend(nccl)");
  memset(id, 0, sizeof id);
  check(sg_nccl_unique_id(id) == SG_OK, "unique_id: works without a GPU");
  int nonzero = 0;
  for (int i = 0; i < 128; i++) nonzero |= id[i];
  check(nonzero != 0, "unique_id: not all zero");
  unsetenv("SG_NCCL_ID_FILE");
  check(
      sg_comm_create_nccl(0, 1, NULL, 0, &c) == SG_ERR_INVALID_ARGUMENT && says("SG_NCCL_ID_FILE"),
      "create_nccl: id NULL without SG_NCCL_ID_FILE");
  sg_status st = sg_comm_create_nccl(0, 1, id, -1, &c);
  if (st == SG_OK) {
    check(sg_comm_rank(c) == 0 && sg_comm_size(c) == 1, "create_nccl (GPU): world 1");
    sg_comm_destroy(c);
  } else {
    check(st == SG_ERR_CUDA && says("no CUDA device found") && c == NULL,
          "create_nccl without GPU: SG_ERR_CUDA, no CUDA device found");
  }
#ifdef SG_HAVE_MPI
  check(sg_comm_create_nccl_mpi(NULL, &c) == SG_ERR_INVALID_STATE && says("MPI"),
        "create_nccl_mpi: MPI not initialized");
#else
  check(sg_comm_create_nccl_mpi(NULL, &c) == SG_ERR_UNSUPPORTED, "create_nccl_mpi: no MPI");
#endif
#else
  check(sg_has_backend("nccl") == 0, "has_backend(nccl) == 0");
  check(sg_nccl_unique_id(id) == SG_ERR_UNSUPPORTED, "unique_id: unsupported");
  check(sg_comm_create_nccl(0, 1, id, 0, &c) == SG_ERR_UNSUPPORTED, "create_nccl: unsupported");
  check(sg_comm_create_nccl_mpi(NULL, &c) == SG_ERR_UNSUPPORTED, "create_nccl_mpi: unsupported");
#endif
}

/* ---- NCCL id file ------------------------------------------------------------------------- */

#ifdef SG_HAVE_NCCL
typedef struct late_writer {
  const char *path;
  const unsigned char *id;
  int delay_ms;
  sg_status st;
} late_writer;

static void *late_write(void *p) {
  late_writer *w = (late_writer *)p;
  struct timespec ts = {w->delay_ms / 1000, (long)(w->delay_ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
  w->st = sg__nccl_id_file_write(w->path, w->id, 3);
  return NULL;
}

static int dir_entries(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
  closedir(d);
  return n;
}

static void test_id_file(void) {
  char dir[] = "/tmp/sg_nccl_idXXXXXX";
  if (!mkdtemp(dir)) {
    check(0, "id file: mkdtemp");
    return;
  }
  char path[256];
  snprintf(path, sizeof path, "%s/id", dir);
  unsigned char id[128], got[128];
  for (int i = 0; i < 128; i++) id[i] = (unsigned char)(i * 7 + 3);

  check(sg__nccl_id_file_write(path, id, 3) == SG_OK, "id file: write");
  check(dir_entries(dir) == 1, "id file: only the final file remains (no temporary)");
  memset(got, 0, sizeof got);
  check(sg__nccl_id_file_read(path, 3, sg__deadline(1000), got) == SG_OK &&
            memcmp(got, id, sizeof id) == 0,
        "id file: read back the same id");
  check(sg__nccl_id_file_read(path, 4, sg__deadline(1000), got) == SG_ERR_MISMATCH,
        "id file: another world size is SG_ERR_MISMATCH");
  check(sg__nccl_id_file_write(NULL, id, 3) == SG_ERR_INVALID_ARGUMENT, "id file: NULL path");
  check(sg__nccl_id_file_write(path, id, 0) == SG_ERR_INVALID_ARGUMENT, "id file: world 0");

  FILE *f = fopen(path, "wb");
  if (f) {
    fputs("not an id", f);
    fclose(f);
  }
  check(sg__nccl_id_file_read(path, 3, sg__deadline(1000), got) == SG_ERR_CORRUPT,
        "id file: damaged file is SG_ERR_CORRUPT");
  unlink(path);

  check(sg__nccl_id_file_read(path, 3, sg__now_ms() + 50, got) == SG_ERR_TIMEOUT &&
            says("did not appear"),
        "id file: missing file times out");
  check(sg__nccl_id_file_write("/nonexistent_dir_sg/id", id, 3) == SG_ERR_IO,
        "id file: unwritable directory is SG_ERR_IO");

  /* the reader polls until a writer that starts late has renamed its file into place */
  late_writer w = {path, id, 150, SG_ERR_INTERNAL};
  pthread_t t;
  if (pthread_create(&t, NULL, late_write, &w) == 0) {
    memset(got, 0, sizeof got);
    sg_status st = sg__nccl_id_file_read(path, 3, sg__deadline(10000), got);
    pthread_join(t, NULL);
    check(w.st == SG_OK && st == SG_OK && memcmp(got, id, sizeof id) == 0,
          "id file: reader waits for a late writer");
  } else {
    check(0, "id file: pthread_create");
  }
  unlink(path);
  rmdir(dir);

  setenv("SG_NCCL_INIT_TIMEOUT_MS", "1234", 1);
  check(sg__nccl_init_timeout_ms() == 1234, "init timeout from SG_NCCL_INIT_TIMEOUT_MS");
  setenv("SG_NCCL_INIT_TIMEOUT_MS", "soon", 1);
  check(sg__nccl_init_timeout_ms() == 600000, "init timeout: bad value -> default 600000");
  unsetenv("SG_NCCL_INIT_TIMEOUT_MS");
}
#endif

int main(void) {
  check(sg_has_backend("cuda") == 1, "has_backend(cuda)");
  test_device_args();
  test_device();
  test_nccl_public();
#ifdef SG_HAVE_NCCL
  test_id_file();
#endif
  return sg_test_summary("");
}
