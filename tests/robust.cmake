# Robustness tests: the misuse matrix (every public function with bad arguments and in the wrong
# order, allocation failures, broken communicators), dynamic loss scaling with injected
# non-finite gradients, and ranks that disagree at sg_finalize. Ranks are threads (label local);
# test_mismatch also runs one rank per process under mpirun (label mpi).
sg_add_test(test_misuse SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_misuse.c LABELS local TIMEOUT 300)
sg_add_test(test_fp16_scale SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_fp16_scale.c LABELS local TIMEOUT 300)
