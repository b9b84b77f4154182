# 8-bit optimizer state (cfg.optim_state_dtype SG_Q8, issue 27): the codes, the CPU kernel
# against an independent implementation, W = 1..4 bit for bit on threads, the small-tensor rule,
# memory, bad configs; under MPI W = np against one rank.
sg_add_test(test_q8 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_q8.c LABELS local TIMEOUT 300)
sg_add_mpi_test(test_q8_mpi_np3 EXE test_q8 NP 3 ARGS --mpi TIMEOUT 300)
# The same engines on the CUDA device of the mock runtime (its kernels emulated on the host):
# the segment tables of the 8-bit kernel, the state's copies, its checkpoints; with
# offload_optimizer, the host placement bit for bit the CPU device's 8-bit engine.
if(TARGET shardgrad_cudamock)
  add_executable(test_q8_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_q8.c)
  target_link_libraries(test_q8_cudamock PRIVATE shardgrad_cudamock)
  target_compile_options(test_q8_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
  add_test(NAME test_q8_cudamock COMMAND test_q8_cudamock)
  set_tests_properties(test_q8_cudamock PROPERTIES TIMEOUT 300 LABELS cuda
    ENVIRONMENT "SG_TEST_DEVICE=cuda")
endif()
