# sg_bench_adamw_cuda: the fused AdamW step on the GPU (sg__cuda_adamw) over 1M-256M params, f32
# and bf16, beside a device-to-device copy in the same run (see bench/bench_adamw_cuda.cu), with an
# untimed bitwise check against sg__cpu_adamw. CUDA builds only. Not sg_add_bench: its C flags
# do not suit nvcc.
#   build/bench/sg_bench_adamw_cuda [--sizes 1,4,16,64,256] [--reps 20]
#   python3 bench/adamw_torch.py    (torch.optim.AdamW(fused=True) on the same sizes)
if(SG_WITH_CUDA)
  add_executable(sg_bench_adamw_cuda ${CMAKE_CURRENT_SOURCE_DIR}/bench_adamw_cuda.cu)
  target_link_libraries(sg_bench_adamw_cuda PRIVATE shardgrad_internal Threads::Threads m)
  target_compile_options(sg_bench_adamw_cuda PRIVATE -Xcompiler=-Wall,-Wextra,-Wno-unused-parameter)
  if(SG_WITH_MPI)
    target_link_libraries(sg_bench_adamw_cuda PRIVATE MPI::MPI_C)
  endif()
endif()
