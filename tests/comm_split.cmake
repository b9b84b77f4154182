# sg_comm_split: threads (W = 1, 2, 3, 4, 6 in one run) and MPI at np 3 and 4.
sg_add_test(test_comm_split SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm_split.c LABELS local
  TIMEOUT 120)
# The same cases over the caller's transport (sg_comm_create_xport, an in-process mailbox).
add_test(NAME test_comm_split_xport COMMAND test_comm_split --xport)
set_tests_properties(test_comm_split_xport PROPERTIES TIMEOUT 120 LABELS local)
sg_add_mpi_test(test_comm_split_mpi_np3 EXE test_comm_split NP 3 ARGS --mpi TIMEOUT 120)
sg_add_mpi_test(test_comm_split_mpi_np4 EXE test_comm_split NP 4 ARGS --mpi TIMEOUT 120)
# sg_comm_stats: the bus-byte counts of every collective, threads W = 1..4 and MPI at np 2 and 3.
sg_add_test(test_comm_stats SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm_stats.c LABELS local
  TIMEOUT 120)
sg_add_mpi_test(test_comm_stats_mpi_np2 EXE test_comm_stats NP 2 ARGS --mpi TIMEOUT 120)
sg_add_mpi_test(test_comm_stats_mpi_np3 EXE test_comm_stats NP 3 ARGS --mpi TIMEOUT 120)
# sg_comm_split_nodes: threads (W = 1..6 and 8, every ranks_per_node dividing W, mismatches and
# argument errors) and MPI at np 4 (2 x 2, 4 x 1, 1 x 4; by host: one node under plain mpirun).
sg_add_test(test_comm_split_nodes SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm_split_nodes.c
  LABELS local TIMEOUT 120)
add_test(NAME test_comm_split_nodes_xport COMMAND test_comm_split_nodes --xport)
set_tests_properties(test_comm_split_nodes_xport PROPERTIES TIMEOUT 120 LABELS local)
sg_add_mpi_test(test_comm_split_nodes_mpi_np4 EXE test_comm_split_nodes NP 4 ARGS --mpi
  TIMEOUT 120)
# Splits of the caller's transport against the same splits of threads (bitwise), a hybrid
# engine on them, timeouts, callback failures, concurrent splits, contexts running out, and the
# parent destroyed first: W = 4 (2 x 2, and a split of a split) and W = 3 (2 + 1).
sg_add_test(test_comm_xport_split SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm_xport_split.c
  ARGS 4 LABELS local TIMEOUT 120)
add_test(NAME test_comm_xport_split_w3 COMMAND test_comm_xport_split 3)
set_tests_properties(test_comm_xport_split_w3 PROPERTIES TIMEOUT 120 LABELS local)
