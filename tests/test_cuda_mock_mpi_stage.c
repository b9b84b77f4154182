/* MPI's all-to-all on device memory (src/comm/coll/sg_stage.c, sg__stage_all_to_all) on the
 * mock CUDA runtime, under mpirun: an MPI channel bound to a CUDA device runs it from comm jobs
 * through its pinned staging (send copied down, the host algorithm between the two halves of
 * the stage, recv copied back), for sizes from 1 byte to past the stage's first 1 MiB (so it
 * grows) and back; every part of recv must be the matching part of its sender's send buffer,
 * send must be left as it was, and the channel must say it takes device memory
 * (all_to_all_device, which a replica codec on CUDA needs). A NULL receive buffer is refused.
 *
 * Usage: test_cuda_mock_mpi_stage   (under mpirun, any number of ranks) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h> /* the mock's: device buffers */

#include "comm/sg_comm.h"     /* collectives through the vtable */
#include "device/sg_device.h" /* the CUDA device to bind */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"

static unsigned char byte_of(int from, int to, size_t i) {
  return (unsigned char)(from * 31 + to * 7 + (int)(i % 251));
}

typedef struct {
  sg_comm *c;
  const void *send;
  void *recv;
  size_t bytes;
} a2a_job;

static sg_status a2a_run(void *arg) {
  const a2a_job *j = arg;
  return j->c->ops->all_to_all(j->c, j->send, j->recv, j->bytes, sg__deadline(20000));
}

/* One all-to-all of `bytes` per rank pair, submitted as a comm job and waited for. */
static sg_status a2a(sg__device *d, sg_comm *c, const void *send, void *recv, size_t bytes) {
  a2a_job j = {c, send, recv, bytes};
  uint64_t t = 0;
  sg_status st = d->ops->comm_submit(d, a2a_run, NULL, &j, &t);
  return st == SG_OK ? d->ops->comm_wait(d, t, sg__deadline(20000)) : st;
}

static void one_size(sg__device *d, sg_comm *c, size_t bytes) {
  const int w = c->world, r = c->rank;
  const size_t total = bytes * (size_t)w;
  /* pinned: the mock's uploads from pageable memory land later, on the legacy stream */
  unsigned char *h = NULL, *send = NULL, *recv = NULL;
  cudaMallocHost((void **)&h, total);
  cudaMalloc((void **)&send, total);
  cudaMalloc((void **)&recv, total);
  if (!CHECK(h && send && recv, "buffers of %zu bytes", total)) return;
  for (int k = 0; k < w; k++)
    for (size_t i = 0; i < bytes; i++) h[(size_t)k * bytes + i] = byte_of(r, k, i);
  cudaMemcpy(send, h, total, cudaMemcpyHostToDevice);
  memset(h, 0xee, total); /* nothing left in recv from before */
  cudaMemcpy(recv, h, total, cudaMemcpyHostToDevice);
  const sg_status st = a2a(d, c, send, recv, bytes);
  CHECK(st == SG_OK, "all_to_all of %zu bytes per rank on device memory: %s", bytes,
        sg_last_error());
  cudaMemcpy(h, recv, total, cudaMemcpyDeviceToHost);
  size_t bad = total;
  for (int q = 0; q < w && bad == total; q++)
    for (size_t i = 0; i < bytes; i++)
      if (h[(size_t)q * bytes + i] != byte_of(q, r, i)) {
        bad = (size_t)q * bytes + i;
        break;
      }
  CHECK(bad == total, "%zu bytes per rank: part q of recv is part %d of rank q's send (first "
        "difference at byte %zu)", bytes, r, bad);
  cudaMemcpy(h, send, total, cudaMemcpyDeviceToHost);
  int same = 1;
  for (int k = 0; k < w; k++)
    for (size_t i = 0; i < bytes; i++) same &= h[(size_t)k * bytes + i] == byte_of(r, k, i);
  CHECK(same, "%zu bytes per rank: send left as it was", bytes);
  cudaFree(send);
  cudaFree(recv);
  cudaFreeHost(h);
}

int main(void) {
  if (!sg_has_backend("mpi") || !sg_has_backend("cuda")) {
    printf("test_cuda_mock_mpi_stage: built without MPI or CUDA\n");
    return 77;
  }
  sg_comm *world = NULL, *c = NULL;
  sg__device *d = NULL;
  if (!CHECK(sg_comm_create_mpi(NULL, &world) == SG_OK, "MPI: %s", sg_last_error()))
    return sg_test_summary("test_cuda_mock_mpi_stage: ");
  const int rank = sg_comm_rank(world);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[rank %d]", rank);
  if (CHECK(sg__device_cuda_create(rank, 0, &d) == SG_OK, "CUDA device: %s", sg_last_error()) &&
      CHECK(sg__comm_bind(world, d, 20000, &c) == SG_OK, "bind: %s", sg_last_error())) {
    CHECK(c->ops->all_to_all && c->ops->all_to_all_device,
          "the MPI channel's all-to-all takes device memory");
    static const size_t sizes[] = {1, 1000, 3 << 20 /* past the first 1 MiB stage */, 4097};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) one_size(d, c, sizes[i]);
    void *send = NULL;
    cudaMalloc(&send, 64u * (size_t)c->world);
    a2a_job bad = {c, send, NULL, 64}; /* refused before anything is staged or sent */
    CHECK(a2a_run(&bad) == SG_ERR_INVALID_ARGUMENT &&
              strstr(sg_last_error(), "all_to_all"),
          "a NULL receive buffer is refused (%s)", sg_last_error());
    cudaFree(send);
    sg__comm_unbind(c);
  }
  if (d) d->ops->destroy(d);
  sg_comm_destroy(world);
  char prefix[64];
  snprintf(prefix, sizeof prefix, "test_cuda_mock_mpi_stage (rank %d): ", rank);
  return sg_test_summary(prefix);
}
