# Robustness tests: the misuse matrix (every public function with bad arguments and in the wrong
# order, allocation failures, broken communicators), dynamic loss scaling with injected
# non-finite gradients, and ranks that disagree at sg_finalize. Ranks are threads (label local);
# test_mismatch also runs one rank per process under mpirun (label mpi).
sg_add_test(test_misuse SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_misuse.c LABELS local TIMEOUT 300)
sg_add_test(test_fp16_scale SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_fp16_scale.c LABELS local TIMEOUT 300)
sg_add_test(test_mismatch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_mismatch.c LABELS local TIMEOUT 300)
sg_add_mpi_test(test_mismatch_mpi_np2 EXE test_mismatch NP 2 ARGS --mpi TIMEOUT 300)
sg_add_mpi_test(test_mismatch_mpi_np3 EXE test_mismatch NP 3 ARGS --mpi TIMEOUT 300)
