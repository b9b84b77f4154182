# sg_bench_cluster: time per optimizer step and bytes on the node links with gradient
# accumulation across nodes (see bench/bench_cluster.c); driven by bench/cluster.sh on the
# simulated cluster of scripts/cluster.sh. MPI builds only.
if(SG_WITH_MPI)
  sg_add_bench(sg_bench_cluster
    SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_cluster.c ${PROJECT_SOURCE_DIR}/examples/mlp/mlp_model.c
    INCLUDES ${PROJECT_SOURCE_DIR}/examples/mlp)
endif()
