# The simulated cluster (scripts/cluster.sh): MPI at np 4 as 2 nodes x 2 ranks over 1 Gbit/s links
# between network namespaces: the layout, the MPI communicator, sg_comm_split_nodes by host and
# the hybrid engine (test_hybrid --mpi). Skipped (exit 77) where namespaces are not permitted; one at a time
# (RESOURCE_LOCK), since each brings up a cluster of the same name.
if(SG_WITH_MPI)
  add_executable(test_cluster_topo ${CMAKE_CURRENT_SOURCE_DIR}/test_cluster_topo.c)
  target_link_libraries(test_cluster_topo PRIVATE MPI::MPI_C)
  target_compile_options(test_cluster_topo PRIVATE -Wall -Wextra)
  add_test(NAME test_cluster COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/test_cluster.sh
    ${PROJECT_SOURCE_DIR}/scripts/cluster.sh $<TARGET_FILE:test_cluster_topo>
    $<TARGET_FILE:test_comm_local2> $<TARGET_FILE:test_comm_split_nodes>
    $<TARGET_FILE:test_hybrid>)
  set_tests_properties(test_cluster PROPERTIES TIMEOUT 240 LABELS cluster SKIP_RETURN_CODE 77
    RESOURCE_LOCK sg_cluster)
endif()
