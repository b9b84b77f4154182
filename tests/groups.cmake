# Parameter groups (per-group lr and weight decay): bitwise against a host AdamW reference at
# W = 1..3 ranks as threads, and the cross-rank group agreement at sg_finalize.
sg_add_test(test_groups SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_groups.c LABELS local TIMEOUT 300)
# The same with the engines under test on the mock CUDA device (tests/cuda.cmake), bitwise
# against the host reference.
if(TARGET shardgrad_cudamock)
  add_executable(test_groups_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_groups.c)
  target_link_libraries(test_groups_cudamock PRIVATE shardgrad_cudamock)
  target_compile_options(test_groups_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
    -ffp-contract=off)
  add_test(NAME test_groups_cudamock COMMAND test_groups_cudamock)
  set_tests_properties(test_groups_cudamock PROPERTIES TIMEOUT 300 LABELS cuda
    ENVIRONMENT "SG_TEST_DEVICE=cuda")
endif()
