/* How the GPU examples (examples/mlp_cuda and examples/cnn_cudnn) start their ranks, beside
 * mlp_cli.h's threads: --nccl (one rank per process and GPU under mpirun, NCCL started over MPI)
 * and --nccl-solo (one rank over an NCCL communicator of world 1, no MPI), and the checks that a
 * launcher's processes make one training.
 *
 * Header-only (static inline), like mlp_cli.h. Include after mlp_cli.h and <cuda_runtime.h>;
 * define MLP_GPU_HAVE_MPI first where the program links MPI (then include <mpi.h> too). */
#ifndef MLP_GPU_H
#define MLP_GPU_H

#include "mlp_cli.h"

/* The launch flags: --nccl, --nccl-solo (switches), --gpu G. */
typedef struct mlp_gpu_flags {
  int nccl, nccl_solo, gpu;
} mlp_gpu_flags;

/* 1 when `flag` is one of the switches (set in f), else 0. */
static inline int mlp_gpu_switch_flag(mlp_gpu_flags *f, const char *flag) {
  if (!strcmp(flag, "--nccl"))
    f->nccl = 1;
  else if (!strcmp(flag, "--nccl-solo"))
    f->nccl_solo = 1;
  else
    return 0;
  return 1;
}

/* Under mpirun or srun only --nccl makes the processes one training. 0, or -1 with the reason
 * on stderr. */
static inline int mlp_gpu_check_launch(const char *prog, const mlp_gpu_flags *f,
                                       const mlp_cli *c) {
  int nprocs = 0;
  const char *launcher = mlp_cli_launcher(&nprocs);
  if (f->nccl && c->ranks_given) {
    fprintf(stderr, "%s: --ranks and --nccl conflict: with --nccl the ranks are the "
                    "processes (mpirun -np N %s --nccl)\n", prog, prog);
    return -1;
  }
  if (launcher && !f->nccl && nprocs != 1) {
    fprintf(stderr, "%s: started by %s (%d processes) without --nccl: each process "
                    "would train alone; add --nccl (one rank per process and GPU)\n",
            prog, launcher, nprocs);
    return -1;
  }
  return 0;
}

#ifdef MLP_GPU_HAVE_MPI
/* The GPU of this rank: (rank within its node) mod (GPUs on the node). */
static inline int mlp_gpu_node_local(void) {
  MPI_Comm node;
  int local = 0, count = 0;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
      MPI_SUCCESS) {
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
  }
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) count = 1;
  return local % count;
}

/* --nccl: this process is one rank of an NCCL communicator started over MPI, on its node-local
 * GPU; train(mlp_rank_run *) as mlp_cli_run_threads calls it. The exit code. */
static inline int mlp_gpu_run_nccl(const char *prog, const void *o, void *(*train)(void *)) {
  int provided = 0, rc = 1;
  if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    fprintf(stderr, "%s: MPI_Init_thread failed\n", prog);
    return 1;
  }
  mlp_rank_run run = {.o = o};
  const sg_status st = sg_comm_create_nccl_mpi(NULL, &run.comm);
  if (st != SG_OK) {
    rc = mlp_cli_failed(prog, -1, "sg_comm_create_nccl_mpi", st);
  } else {
    run.gpu = mlp_gpu_node_local();
    train(&run);
    rc = run.rc;
  }
  sg_comm_destroy(run.comm);
  MPI_Finalize(); /* we initialized MPI; the NCCL communicator used it only to start */
  return rc;
}
#else
static inline int mlp_gpu_run_nccl(const char *prog, const void *o, void *(*train)(void *)) {
  (void)o, (void)train;
  fprintf(stderr, "%s: --nccl needs MPI: this example was built without it\n", prog);
  return 1;
}
#endif

/* --nccl-solo: one rank on GPU `gpu` over an NCCL communicator of world 1, without MPI: the
 * engine's reductions are stream-ordered as they are on several GPUs, so --trace shows them
 * overlapping the backward pass (ranks as threads use the host-driven local communicator). */
static inline int mlp_gpu_run_nccl_solo(const char *prog, const void *o, int gpu,
                                        void *(*train)(void *)) {
  unsigned char id[128];
  mlp_rank_run run = {.o = o, .gpu = gpu};
  sg_status st = sg_nccl_unique_id(id);
  if (st == SG_OK) st = sg_comm_create_nccl(0, 1, id, gpu, &run.comm);
  if (st != SG_OK)
    run.rc = mlp_cli_failed(prog, 0, "sg_comm_create_nccl (world 1)", st);
  else
    train(&run);
  sg_comm_destroy(run.comm);
  return run.rc;
}

/* The ranks as the flags say: --nccl-solo, --nccl, or mlp_cli_run_threads' threads on GPU
 * f->gpu. The exit code. */
static inline int mlp_gpu_run(const char *prog, const void *o, const mlp_gpu_flags *f, int ranks,
                              void *(*train)(void *)) {
  if (f->nccl_solo) return mlp_gpu_run_nccl_solo(prog, o, f->gpu, train);
  return f->nccl ? mlp_gpu_run_nccl(prog, o, train) : mlp_cli_run_threads(prog, o, ranks, f->gpu,
                                                                         train);
}

#endif /* MLP_GPU_H */
