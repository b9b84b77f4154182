# Checkpoints (issue 5): save/load at any world size, damaged files, kill -9 during saves,
# safetensors export/import. Ranks run as threads (label local).
sg_add_test(test_ckpt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt.c LABELS local TIMEOUT 300)
sg_add_test(test_ckpt_corrupt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_corrupt.c LABELS local TIMEOUT 300)
sg_add_test(test_ckpt_kill SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_kill.c LABELS local TIMEOUT 300)

# libFuzzer target over the checkpoint readers (clang only): scripts/fuzz_ckpt.sh builds it in
# build-fuzz/ with coverage and sanitizers and runs it for a bounded time.
option(SG_FUZZ "Build the libFuzzer target fuzz_ckpt (needs clang)" OFF)
if(SG_FUZZ)
  if(CMAKE_C_COMPILER_ID MATCHES "Clang")
    add_executable(fuzz_ckpt ${CMAKE_CURRENT_SOURCE_DIR}/fuzz_ckpt.c)
    target_link_libraries(fuzz_ckpt PRIVATE shardgrad_internal)
    target_compile_options(fuzz_ckpt PRIVATE -fsanitize=fuzzer)
    target_link_options(fuzz_ckpt PRIVATE -fsanitize=fuzzer)
  else()
    message(WARNING "SG_FUZZ=ON needs clang (CMAKE_C_COMPILER_ID is ${CMAKE_C_COMPILER_ID}): "
                    "fuzz_ckpt is not built")
  endif()
endif()

# The MLP example's --save/--save-every/--resume (runs tests/mlp.cmake's test_mlp binary).
if(EXISTS ${PROJECT_SOURCE_DIR}/examples/mlp/mlp.c)
  add_test(NAME test_ckpt_mlp COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_mlp.sh
           $<TARGET_FILE:test_mlp>)
  set_tests_properties(test_ckpt_mlp PROPERTIES TIMEOUT 120 LABELS local)
endif()

# One rank per process: save at W=3 under mpirun, load at W=1 (rank 0 alone) and at W=3.
if(SG_WITH_MPI)
  add_executable(test_ckpt_mpi ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_mpi.c)
  target_link_libraries(test_ckpt_mpi PRIVATE shardgrad_internal MPI::MPI_C)
  target_compile_options(test_ckpt_mpi PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
  sg_add_mpi_test(test_ckpt_mpi_np3 EXE test_ckpt_mpi NP 3 TIMEOUT 300)
endif()

# CUDA builds: test_ckpt again with every engine on SG_DEVICE_CUDA over tests/cudamock's mock
# runtime (target shardgrad_cudamock from tests/cuda.cmake), so that the checkpoint code's
# device copies run through src/device/cuda.c without a GPU.
if(SG_WITH_CUDA)
  include(CheckLanguage)
  check_language(CXX)
  if(CMAKE_CXX_COMPILER)
    add_executable(test_ckpt_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt.c)
    target_compile_definitions(test_ckpt_cudamock PRIVATE SG_TEST_CUDA_MOCK)
    target_link_libraries(test_ckpt_cudamock PRIVATE shardgrad_cudamock)
    target_compile_options(test_ckpt_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
                           -ffp-contract=off)
    add_test(NAME test_ckpt_cudamock COMMAND test_ckpt_cudamock)
    set_tests_properties(test_ckpt_cudamock PROPERTIES TIMEOUT 300 LABELS cuda)
  endif()
endif()
