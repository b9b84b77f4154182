/* The public NCCL functions of a build without NCCL (no CUDA, or no libnccl found): they exist,
 * so that every build exports the same API, and say SG_ERR_UNSUPPORTED. With NCCL this file is
 * empty and src/comm/nccl.c defines them. */
#include "../sg_comm.h" /* sg_comm, sg__err */

#ifndef SG_HAVE_NCCL
sg_status sg_nccl_unique_id(void *id128) {
  if (!id128) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_nccl_unique_id: id128 is NULL");
  return sg__err(SG_ERR_UNSUPPORTED, "sg_nccl_unique_id: built without NCCL");
}

sg_status sg_comm_create_nccl(int rank, int world, const void *id128, int cuda_device,
                              sg_comm **out) {
  (void)rank, (void)world, (void)id128, (void)cuda_device;
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_nccl: out is NULL");
  *out = NULL;
  return sg__err(SG_ERR_UNSUPPORTED, "sg_comm_create_nccl: built without NCCL");
}

sg_status sg_comm_create_nccl_mpi(const void *mpi_comm, sg_comm **out) {
  (void)mpi_comm;
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_nccl_mpi: out is NULL");
  *out = NULL;
  return sg__err(SG_ERR_UNSUPPORTED, "sg_comm_create_nccl_mpi: built without NCCL");
}
#else
typedef int sg__nccl_stub_unused; /* ISO C wants a translation unit to declare something */
#endif
