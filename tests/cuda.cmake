# CUDA builds only. ctest gets test_cuda_device, which passes with or without a GPU (without
# one it checks that creating the CUDA device or an NCCL communicator fails with SG_ERR_CUDA,
# "no CUDA device found"). GPU-only programs are built on request (EXCLUDE_FROM_ALL) and never
# registered, since CI has no GPU: tests/gpu/run.sh builds and runs them on a GPU machine.
if(SG_WITH_CUDA)
  set(_sg_cuda_defs SG_HAVE_CUDA)
  if(SG_HAVE_NCCL_H)
    list(APPEND _sg_cuda_defs SG_HAVE_NCCL)
  endif()

  sg_add_test(test_cuda_device SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_device.c
    LABELS cuda TIMEOUT 120)
  target_compile_definitions(test_cuda_device PRIVATE ${_sg_cuda_defs})

  # The AdamW kernels' machine code loads and stores fp32 state 128 bits at a time
  # (sass_wide_stores.sh, cuobjdump); also run after each build where cuobjdump was found at
  # configure time (cuda_sass.cmake); skipped (exit 77) where no cuobjdump is found.
  add_test(NAME test_sass_wide_stores COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/sass_wide_stores.sh
    $<TARGET_FILE:shardgrad_static> ${CUDAToolkit_BIN_DIR})
  set_tests_properties(test_sass_wide_stores PROPERTIES TIMEOUT 120 LABELS cuda
    SKIP_RETURN_CODE 77)

  # tests/gpu/run.sh's plan on a simulated clock (--dry-run: nothing built or run): the quick
  # profile fits its budget, also when any one step hangs for its whole limit (every later step
  # still gets its estimate).
  add_test(NAME test_gpu_run_dry COMMAND bash -c
    "for h in none configure build bench_adamw_cuda timeline_nccl_solo test_cuda_device test_cuda_kernels test_cuda_queues test_cuda_engine hybrid_cuda hybrid_cuda_offload; do OUT=\"$1/out\" SG_GPU_BUILD=\"$1/build\" SG_GPU_DRY_HANG=$h bash \"$0\" --quick --dry-run | tail -1 | grep -q 'every step got' || { echo \"budget broken with a hang in $h\"; exit 1; }; done; echo 'dry runs: the quick plan holds with any one step hung'"
    ${CMAKE_CURRENT_SOURCE_DIR}/gpu/run.sh ${CMAKE_CURRENT_BINARY_DIR}/gpu_dry)
  set_tests_properties(test_gpu_run_dry PROPERTIES TIMEOUT 60 LABELS cuda)

  # The CUDA kernels on the host (kernels/cuda/sg_cuda_emu.h) against the CPU kernels: their
  # indexing, vector paths, segment lookup and reduction order, checked without a GPU.
  include(CheckLanguage)
  check_language(CXX)
  if(CMAKE_CXX_COMPILER)
    enable_language(CXX)
    sg_add_test(test_cuda_emu SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_emu.cpp
      LABELS cuda TIMEOUT 300)
    set_target_properties(test_cuda_emu PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)

    # The whole library on a mock CUDA runtime and a mock NCCL (tests/cudamock: lazy streams
    # over host memory, the emulated kernels, ranks as threads), so that src/device/cuda.c,
    # src/comm/backend/nccl.c and the engine on the CUDA device run without a GPU. Tests link it
    # instead of shardgrad_internal.
    # The library's own C sources (cuda.c and nccl.c included), the kernels as host C++.
    set(_sg_mock_sources ${SG_SOURCES})
    list(FILTER _sg_mock_sources EXCLUDE REGEX "\\.cu$")
    list(APPEND _sg_mock_sources ${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_cudamock.cpp
      ${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_ncclmock.cpp
      ${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_cudamock_kernels.cpp)
    add_library(shardgrad_cudamock STATIC EXCLUDE_FROM_ALL ${_sg_mock_sources})
    # BEFORE: <cuda_runtime.h> must be the mock's
    target_include_directories(shardgrad_cudamock BEFORE PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/cudamock)
    target_include_directories(shardgrad_cudamock PUBLIC ${PROJECT_SOURCE_DIR}/include
      ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/kernels)
    target_compile_definitions(shardgrad_cudamock PUBLIC SG_HAVE_CUDA SG_HAVE_NCCL
      PRIVATE SG_BUILDING_LIBRARY)
    target_compile_options(shardgrad_cudamock PRIVATE $<$<COMPILE_LANGUAGE:C>:${SG_C_FLAGS}>)
    set_target_properties(shardgrad_cudamock PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON)
    target_link_libraries(shardgrad_cudamock PUBLIC Threads::Threads m ${CMAKE_DL_LIBS})
    # nccl.c finds NCCL at run time (src/comm/backend/sg_nccl_dl.h). The mock NCCL is linked into each
    # test program and exported from it (nccl* only), so the loader finds it in the global
    # symbol scope, as it would an NCCL that a program links itself; -u links it even into
    # programs that call none of its test controls.
    target_link_options(shardgrad_cudamock INTERFACE
      "LINKER:--dynamic-list=${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_ncclmock.dynlist"
      "LINKER:-u,ncclGetVersion")
    if(OpenMP_C_FOUND)
      target_link_libraries(shardgrad_cudamock PUBLIC OpenMP::OpenMP_C)
    endif()
    if(SG_WITH_MPI)
      target_compile_definitions(shardgrad_cudamock PUBLIC SG_HAVE_MPI)
      target_link_libraries(shardgrad_cudamock PUBLIC MPI::MPI_C)
    endif()

    # Two engines on one NCCL communicator (the second a split), engines on the CUDA device.
    add_executable(test_two_engines_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_two_engines.c)
    target_link_libraries(test_two_engines_cudamock PRIVATE shardgrad_cudamock)
    target_compile_definitions(test_two_engines_cudamock PRIVATE SG_TEST_NCCL)
    target_compile_options(test_two_engines_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter)
    add_test(NAME test_two_engines_cudamock COMMAND test_two_engines_cudamock --nccl 2)
    set_tests_properties(test_two_engines_cudamock PROPERTIES TIMEOUT 300 LABELS cuda)

    # test_cuda_mock_lean: host syncs and kernel launches of one step, counted by the mock.
    # test_cuda_mock_unkind: what the mocks hid while kinder than CUDA >= 12 and NCCL >= 2.18
    # (contexts created by a restore, an abort under a call in flight, cudaFree's device sync).
    # test_cuda_mock_lanes: a stalled cross-node link does not hold up the next reduce-scatter.
    # test_cuda_mock_fold: a stalled copy-out does not hold up sg_grad_add under offload.
    # test_cuda_mock_stream: a streaming outer sum that cannot finish does not hold up the next
    # step's reduce-scatters (NCCL: the replica lane; threads: the device's twin).
    foreach(t test_cuda_mock test_cuda_mock_engine test_cuda_mock_nccl test_cuda_mock_nccl_split
              test_cuda_mock_waits test_cuda_mock_lean test_cuda_mock_unkind test_cuda_mock_lanes
              test_cuda_mock_fold test_cuda_mock_stream)
      add_executable(${t} ${CMAKE_CURRENT_SOURCE_DIR}/${t}.c)
      target_link_libraries(${t} PRIVATE shardgrad_cudamock)
      target_compile_options(${t} PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
      add_test(NAME ${t} COMMAND ${t})
      set_tests_properties(${t} PROPERTIES TIMEOUT 300 LABELS cuda)
    endforeach()
    # Its matrix runs every sharded case offloaded too; under TSan (SG_TEST_QUICK) it is cut down
    # but still slow.
    set_tests_properties(test_cuda_mock_engine PROPERTIES TIMEOUT 900)

    # The engine's main test (tests/test_engine.c, test_engine_w2 in engine.cmake) and the loss
    # scaling test (test_fp16_scale.c, robust.cmake) with the engines under test on the mock
    # CUDA device (SG_TEST_DEVICE=cuda) and their references on the CPU device: W ranks with the
    # local communicator, and W = 1 with the mock NCCL (--nccl), bitwise against the CPU engine.
    # test_trace on the mock: marks are events timed when the mock stream runs them.
    foreach(t test_engine test_fp16_scale test_trace)
      add_executable(${t}_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/${t}.c)
      target_link_libraries(${t}_cudamock PRIVATE shardgrad_cudamock)
      target_compile_options(${t}_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
        -ffp-contract=off)
    endforeach()
    # name|arguments; the full matrix at W = 2 and with NCCL, the quick one at W = 3 and 4
    # (Release on 2 cores: about 11, 7, 10 and 10 s; test_fp16_scale about 2 s).
    foreach(run "test_engine_cudamock_w2|test_engine_cudamock;--local;2"
                "test_engine_cudamock_w3|test_engine_cudamock;--local;3;--quick"
                "test_engine_cudamock_w4|test_engine_cudamock;--local;4;--quick"
                "test_engine_cudamock_nccl|test_engine_cudamock;--nccl"
                "test_fp16_scale_cudamock|test_fp16_scale_cudamock"
                "test_trace_cudamock|test_trace_cudamock")
      string(REPLACE "|" ";" run "${run}")
      list(POP_FRONT run name)
      add_test(NAME ${name} COMMAND ${run})
      set_tests_properties(${name} PROPERTIES TIMEOUT 300 LABELS cuda
        ENVIRONMENT "SG_TEST_DEVICE=cuda")
    endforeach()
    # The GPU kernel test (tests/gpu/test_cuda_kernels.c, --quick) on the mock: its lazy streams
    # turn a missing wait between streams into wrong data (a comm-queue update read before it
    # ran, a segment table uploaded on the legacy stream).
    add_executable(test_cuda_kernels_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_cuda_kernels.c)
    target_link_libraries(test_cuda_kernels_cudamock PRIVATE shardgrad_cudamock)
    target_compile_options(test_cuda_kernels_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
      -ffp-contract=off)
    add_test(NAME test_cuda_kernels_cudamock COMMAND test_cuda_kernels_cudamock --quick)
    set_tests_properties(test_cuda_kernels_cudamock PROPERTIES TIMEOUT 300 LABELS cuda)
    # examples/cnn_cudnn end to end on the mock runtime, with a mock cuDNN and cuBLAS
    # (cudamock/cudnn.h, cublas_v2.h, sg_cudnnmock.cpp: cuDNN's and BLAS's semantics on the
    # host, queued on the streams, refusing shapes that do not fit, host pointers, short
    # workspaces and TF32 algorithms) and its kernel emulated: descriptors, GEMM layouts,
    # gradient slots and stream order; --check holds the first steps to the CPU reference and
    # the loss must halve (here 5.1x and 3.2x lower in 80 steps; the mocks are deterministic).
    # Ranks as threads (local communicator) and one rank over mock NCCL.
    add_executable(test_cnn_cudnn_cudamock ${PROJECT_SOURCE_DIR}/examples/cnn_cudnn/cnn_cudnn.c
      ${PROJECT_SOURCE_DIR}/examples/cnn_cudnn/cnn_model.c
      ${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_cudnnmock.cpp
      ${CMAKE_CURRENT_SOURCE_DIR}/cudamock/sg_cnnk_emu.cpp)
    target_include_directories(test_cnn_cudnn_cudamock PRIVATE
      ${PROJECT_SOURCE_DIR}/examples/cnn_cudnn ${PROJECT_SOURCE_DIR}/examples/mlp)
    target_link_libraries(test_cnn_cudnn_cudamock PRIVATE shardgrad_cudamock)
    target_compile_options(test_cnn_cudnn_cudamock PRIVATE -Wall -Wextra -ffp-contract=off)
    set_target_properties(test_cnn_cudnn_cudamock PROPERTIES CXX_STANDARD 17
      CXX_STANDARD_REQUIRED ON)
    foreach(run "test_cnn_cudnn_cudamock|--ranks;2"
                "test_cnn_cudnn_cudamock_nccl|--nccl-solo")
      string(REPLACE "|" ";" run "${run}")
      list(POP_FRONT run name)
      add_test(NAME ${name} COMMAND test_cnn_cudnn_cudamock ${run} --steps 80 --batch 16
        --channels 4 --log-every 50 --check)
      set_tests_properties(${name} PROPERTIES TIMEOUT 300 LABELS cuda
        PASS_REGULAR_EXPRESSION "check: the first 3 steps match the CPU reference")
    endforeach()
    # Hybrid engines (tests/test_hybrid.c --cuda) on the mock CUDA device against the CPU's
    # hybrid, flat and one-rank engines: NCCL shard and replica (both on the comm stream),
    # threads for both (host-driven), threads inside the node with NCCL across replicas, NCCL
    # inside with threads across (staged through pinned host memory), and an offloaded
    # accumulator summed on the host over threads or NCCL (also against the same hybrid engine
    # without offload). Under SG_TEST_QUICK (the sanitizer stages) a subset of each; the TSan stage
    # runs only the --smoke ones (two 2x2 cases and a traffic check: the worker threads).
    add_executable(test_hybrid_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_hybrid.c)
    target_link_libraries(test_hybrid_cudamock PRIVATE shardgrad_cudamock)
    target_compile_options(test_hybrid_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
      -ffp-contract=off)
    foreach(run "test_hybrid_cudamock_nccl|--cuda;nccl;nccl"
                "test_hybrid_cudamock_local|--cuda;local;local"
                "test_hybrid_cudamock_mixed|--cuda;local;nccl"
                "test_hybrid_cudamock_staged|--cuda;nccl;local"
                "test_hybrid_cudamock_offload|--cuda;nccl;local;--offload"
                "test_hybrid_cudamock_offload_nccl|--cuda;nccl;nccl;--offload;--quick"
                "test_hybrid_cudamock_smoke_local|--cuda;local;local;--smoke"
                "test_hybrid_cudamock_smoke_staged|--cuda;nccl;local;--smoke")
      string(REPLACE "|" ";" run "${run}")
      list(POP_FRONT run name)
      add_test(NAME ${name} COMMAND test_hybrid_cudamock ${run})
      set_tests_properties(${name} PROPERTIES TIMEOUT 600 LABELS cuda SKIP_RETURN_CODE 77)
    endforeach()
    # Outer steps (cfg.outer_every) of hybrid engines on the mock CUDA device against the same
    # engines on the CPU device, bitwise (tests/test_replica_dev.c): 2x2, threads or NCCL for
    # both communicators, or mixed (NCCL inside with threads across, and the reverse); MPI for
    # both (the codecs through its pinned staging); and what CUDA still refuses at create.
    add_executable(test_replica_dev_cudamock ${CMAKE_CURRENT_SOURCE_DIR}/test_replica_dev.c)
    target_link_libraries(test_replica_dev_cudamock PRIVATE shardgrad_cudamock)
    target_compile_options(test_replica_dev_cudamock PRIVATE -Wall -Wextra -Wno-unused-parameter
      -ffp-contract=off)
    foreach(kind local nccl mixed)
      add_test(NAME test_replica_dev_cudamock_${kind}
        COMMAND test_replica_dev_cudamock --cuda ${kind})
      set_tests_properties(test_replica_dev_cudamock_${kind} PROPERTIES TIMEOUT 300 LABELS cuda
        SKIP_RETURN_CODE 77)
    endforeach()
    sg_add_mpi_test(test_replica_dev_cudamock_mpi_np4 EXE test_replica_dev_cudamock NP 4
      ARGS --mpi --cuda local TIMEOUT 300)
    # MPI's all-to-all on (mock) device memory through its pinned staging.
    add_executable(test_cuda_mock_mpi_stage ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_mock_mpi_stage.c)
    target_link_libraries(test_cuda_mock_mpi_stage PRIVATE shardgrad_cudamock)
    target_compile_options(test_cuda_mock_mpi_stage PRIVATE -Wall -Wextra -Wno-unused-parameter)
    sg_add_mpi_test(test_cuda_mock_mpi_stage_np3 EXE test_cuda_mock_mpi_stage NP 3 TIMEOUT 120)
    if(TEST test_cuda_mock_mpi_stage_np3)
      set_tests_properties(test_cuda_mock_mpi_stage_np3 PROPERTIES SKIP_RETURN_CODE 77)
    endif()
    # MPI inside and across the nodes of a hybrid engine on the (mock) GPU (both channels
    # host-driven, pinned staging), 2x2 against the CPU's flat and one-rank engines.
    sg_add_mpi_test(test_hybrid_cudamock_mpi_np4 EXE test_hybrid_cudamock NP 4
      ARGS --mpi --cuda local local TIMEOUT 300)
    # The MPI communicator with buffers on the (mock) GPU: pinned host staging around the host
    # algorithms, bitwise against the CPU reference.
    foreach(np 2 3)
      sg_add_mpi_test(test_engine_cudamock_mpi_np${np} EXE test_engine_cudamock NP ${np}
        ARGS --mpi --quick --device cuda)
    endforeach()
  else()
    message(STATUS "shardgrad: no C++ compiler, test_cuda_emu not built")
  endif()

  # GPU only (tests/gpu/run.sh): test_cuda_kernels checks every CUDA kernel against the CPU
  # kernels on the same inputs; test_cuda_queues the device's queues and the NCCL communicator.
  foreach(t test_cuda_kernels test_cuda_queues)
    add_executable(${t} EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/gpu/${t}.c)
    target_link_libraries(${t} PRIVATE shardgrad_internal) # CUDA runtime: static, through it
    target_compile_options(${t} PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
    target_compile_definitions(${t} PRIVATE ${_sg_cuda_defs})
  endforeach()
  # The engine on the GPU against the CPU device: test_cuda_mock_engine.c, built for real CUDA.
  add_executable(test_cuda_engine EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/test_cuda_mock_engine.c)
  target_link_libraries(test_cuda_engine PRIVATE shardgrad_internal)
  target_compile_options(test_cuda_engine PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
  target_compile_definitions(test_cuda_engine PRIVATE ${_sg_cuda_defs} SG_TEST_REAL_GPU)
  # Hybrid engines on the GPU against the CPU (test_hybrid.c --cuda local local [--offload]:
  # ranks as threads on one GPU; the NCCL pairs need a GPU per rank).
  add_executable(test_hybrid_cuda EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/test_hybrid.c)
  target_link_libraries(test_hybrid_cuda PRIVATE shardgrad_internal)
  target_compile_options(test_hybrid_cuda PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
  target_compile_definitions(test_hybrid_cuda PRIVATE ${_sg_cuda_defs})
  # Outer steps on the GPU against the CPU (test_replica_dev.c --cuda local: ranks as threads on
  # one GPU; --cuda nccl needs a GPU per rank).
  add_executable(test_replica_dev_cuda EXCLUDE_FROM_ALL
    ${CMAKE_CURRENT_SOURCE_DIR}/test_replica_dev.c)
  target_link_libraries(test_replica_dev_cuda PRIVATE shardgrad_internal)
  target_compile_options(test_replica_dev_cuda PRIVATE -Wall -Wextra -Wno-unused-parameter
    -ffp-contract=off)
  target_compile_definitions(test_replica_dev_cuda PRIVATE ${_sg_cuda_defs})
  # The same tests with their engines under test on the GPU (SG_TEST_DEVICE=cuda, --nccl).
  foreach(t test_engine test_fp16_scale test_trace test_groups)
    add_executable(${t}_cuda EXCLUDE_FROM_ALL ${CMAKE_CURRENT_SOURCE_DIR}/${t}.c)
    target_link_libraries(${t}_cuda PRIVATE shardgrad_internal)
    target_compile_options(${t}_cuda PRIVATE -Wall -Wextra -Wno-unused-parameter -ffp-contract=off)
  endforeach()
endif()
