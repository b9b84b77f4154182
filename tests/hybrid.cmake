# Hybrid sharding (sg_engine_create_hybrid): threads (2x2, 3x2, 2x3, 4x1, 1x4 against flat W and
# one rank; traffic, memory, errors, checkpoints) and MPI at np 4 as 2x2.
sg_add_test(test_hybrid SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_hybrid.c ARGS --local
  LABELS local TIMEOUT 300)
sg_add_mpi_test(test_hybrid_mpi_np4 EXE test_hybrid NP 4 ARGS --mpi TIMEOUT 300)
# Without the channel's fold into the accumulator (SG_COMM_FOLD=0), as in engine.cmake.
add_test(NAME test_hybrid_nofold COMMAND test_hybrid --local)
set_tests_properties(test_hybrid_nofold PROPERTIES TIMEOUT 300 LABELS nofold ENVIRONMENT SG_COMM_FOLD=0)
