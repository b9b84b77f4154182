# sg_bench_comm: our MPI communicator's reduce-scatter / all-gather / all-reduce beside
# MPI_Reduce_scatter_block / MPI_Allgather / MPI_Allreduce (see bench/bench_comm.c). MPI builds only.
#   mpirun -np 2 build/bench/sg_bench_comm      (as root add --allow-run-as-root; -np 4 on 2
#                                              cores: --oversubscribe)
if(SG_WITH_MPI)
  sg_add_bench(sg_bench_comm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_comm.c)
endif()
