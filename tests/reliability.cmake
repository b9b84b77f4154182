# Issue 30: planted symbolic links at every checkpoint file name (test_ckpt_links).
sg_add_test(test_ckpt_links SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_links.c LABELS local
            TIMEOUT 120)
# fork() after training: children create engines, train, save and exit under a deadline.
sg_add_test(test_fork SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_fork.c LABELS local TIMEOUT 180)
set_tests_properties(test_fork PROPERTIES SKIP_RETURN_CODE 77) # skipped under TSan
# A comm worker thread that cannot start: SG_ERR_OUT_OF_MEMORY at sg_finalize on that rank, the
# others told in the agreement (test hook; and a real RLIMIT_AS in a forked child).
sg_add_test(test_worker_start SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_worker_start.c
            LABELS local TIMEOUT 180)
# The communicator destroyed before its engines: freed with the last of them (threads, the
# caller's transport, and MPI finalized by the engine's destroy under mpirun).
sg_add_test(test_comm_order SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm_order.c LABELS local
            TIMEOUT 120)
sg_add_mpi_test(test_comm_order_mpi_np2 EXE test_comm_order NP 2 ARGS --mpi TIMEOUT 120)
# One rank of the fault matrix on the simulated cluster (tests/fault_matrix.sh runs it; not a
# ctest test: it needs root and takes minutes).
if(SG_WITH_MPI)
  add_executable(fault_run ${CMAKE_CURRENT_SOURCE_DIR}/fault_run.c)
  target_link_libraries(fault_run PRIVATE shardgrad_internal)
  target_compile_options(fault_run PRIVATE -Wall -Wextra -Wno-unused-parameter)
endif()
# Parameters with no gradient in a step are skipped (state and own step count untouched), at
# W = 1..3 against a host AdamW with per-parameter step counts, across a checkpoint at another
# world size (test_absent_grads); and on the mock CUDA device.
sg_add_test(test_absent_grads SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_absent_grads.c
            LABELS local TIMEOUT 120)
if(TARGET shardgrad_cudamock)
  add_executable(test_absent_grads_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_absent_grads.c)
  target_link_libraries(test_absent_grads_cudamock PRIVATE shardgrad_cudamock)
  target_compile_options(test_absent_grads_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
    -ffp-contract=off)
  add_test(NAME test_absent_grads_cudamock COMMAND test_absent_grads_cudamock)
  set_tests_properties(test_absent_grads_cudamock PROPERTIES TIMEOUT 120 LABELS cuda
    ENVIRONMENT "SG_TEST_DEVICE=cuda")
endif()
