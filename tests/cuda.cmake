# CUDA builds only. ctest gets test_cuda_device, which passes with or without a GPU (without
# one it checks that creating the CUDA device or an NCCL communicator fails with SG_ERR_CUDA,
# "no CUDA device found"). GPU-only programs are built on request (EXCLUDE_FROM_ALL) and never
# registered, since CI has no GPU: tests/gpu/run.sh builds and runs them on a GPU machine.
if(SG_WITH_CUDA)
  set(_sg_cuda_defs SG_HAVE_CUDA)
  if(SG_NCCL_LIBRARY)
    list(APPEND _sg_cuda_defs SG_HAVE_NCCL)
  endif()

  sg_add_test(test_cuda_device SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_device.c
    LABELS cuda TIMEOUT 120)
  target_compile_definitions(test_cuda_device PRIVATE ${_sg_cuda_defs})

  # The CUDA kernels on the host (kernels/cuda/sg_cuda_emu.h) against the CPU kernels: their
  # indexing, vector paths, segment lookup and reduction order, checked without a GPU.
  include(CheckLanguage)
  check_language(CXX)
  if(CMAKE_CXX_COMPILER)
    enable_language(CXX)
    sg_add_test(test_cuda_emu SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_emu.cpp
      LABELS cuda TIMEOUT 300)
    set_target_properties(test_cuda_emu PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
  else()
    message(STATUS "shardgrad: no C++ compiler, test_cuda_emu not built")
  endif()

  # GPU only (tests/gpu/run.sh): test_cuda_kernels checks every CUDA kernel against the CPU
  # kernels on the same inputs; test_cuda_queues the device's queues and the NCCL communicator.
  foreach(t test_cuda_kernels test_cuda_queues)
    add_executable(${t} EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/gpu/${t}.c)
    target_link_libraries(${t} PRIVATE shardgrad_internal CUDA::cudart)
    target_compile_options(${t} PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
    target_compile_definitions(${t} PRIVATE ${_sg_cuda_defs})
  endforeach()
endif()
