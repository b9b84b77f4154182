# The host side of optimizer offload (src/offload) and the CPU kernels it runs, on the CPU device;
# test_host_step_cudamock runs the same program on the mock CUDA device too (tests/cuda.cmake).
sg_add_test(test_host_step SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_host_step.c LABELS unit TIMEOUT 300)
if(SG_WITH_CUDA AND TARGET shardgrad_cudamock) # cuda.cmake (included before this file) made it
  add_executable(test_host_step_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_host_step.c)
  target_link_libraries(test_host_step_cudamock PRIVATE shardgrad_cudamock)
  target_compile_options(test_host_step_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
    -ffp-contract=off)
  add_test(NAME test_host_step_cudamock COMMAND test_host_step_cudamock)
  set_tests_properties(test_host_step_cudamock PROPERTIES TIMEOUT 300 LABELS cuda)
endif()
# The offloaded optimizer state (src/offload/sg_offload.c) against the device path, bitwise.
sg_add_test(test_offload SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_offload.c LABELS unit TIMEOUT 300)
if(SG_WITH_CUDA AND TARGET shardgrad_cudamock)
  add_executable(test_offload_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_offload.c)
  target_link_libraries(test_offload_cudamock PRIVATE shardgrad_cudamock)
  target_compile_options(test_offload_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
    -ffp-contract=off)
  add_test(NAME test_offload_cudamock COMMAND test_offload_cudamock)
  set_tests_properties(test_offload_cudamock PROPERTIES TIMEOUT 300 LABELS cuda)
endif()
# On a GPU (tests/gpu/run.sh): the same two programs with the real CUDA device, so that the host
# path is checked bit for bit against the GPU's own kernels.
if(SG_WITH_CUDA)
  foreach(t test_host_step test_offload)
    add_executable(${t}_cuda EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/${t}.c)
    target_link_libraries(${t}_cuda PRIVATE shardgrad_internal)
    target_compile_options(${t}_cuda PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
    target_compile_definitions(${t}_cuda PRIVATE SG_HAVE_CUDA)
  endforeach()
endif()
