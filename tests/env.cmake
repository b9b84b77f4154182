# The environment table (src/core/sg_env.c): its parsing rules and report (test_env), the
# ranks' agreement on the wire settings under mpirun (test_env_mismatch_mpi:
# SG_COLL_REDUCE_SCATTER set on one rank of two), and docs/environment.md against the table (test_env_doc).
sg_add_test(test_env SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_env.c LABELS unit TIMEOUT 60)
set_tests_properties(test_env PROPERTIES ENVIRONMENT
  "SG_COMM_FOLD=Off;SG_CPU_HUGEPAGES=maybe;SG_MPI_ALLGATHER=ring;SG_COLL_REDUCE_SCATTER=DIRECT;SG_COMM_WAIT=yield;SG_NCCL_INIT_TIMEOUT_MS=-5;SG_LOG=info;SG_LOG_FILE=${CMAKE_CURRENT_BINARY_DIR}/test_env.log")
if(SG_WITH_MPI)
  add_test(NAME test_env_mismatch_mpi COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe
    --allow-run-as-root --bind-to none -np 1 -x SG_COLL_REDUCE_SCATTER=direct $<TARGET_FILE:test_env> mismatch
    : -np 1 $<TARGET_FILE:test_env> mismatch)
  set_tests_properties(test_env_mismatch_mpi PROPERTIES TIMEOUT 120 LABELS "mpi"
    ENVIRONMENT "OMPI_MCA_rmaps_base_oversubscribe=1;OMP_NUM_THREADS=1")
endif()
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_FOUND)
  add_test(NAME test_env_doc COMMAND ${Python3_EXECUTABLE}
    ${PROJECT_SOURCE_DIR}/scripts/gen_env_doc.py --check)
  set_tests_properties(test_env_doc PROPERTIES TIMEOUT 60 LABELS unit)
endif()
