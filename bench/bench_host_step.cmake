# sg_bench_host_step: the host side of an offloaded optimizer step (src/offload/sg_host_step.c)
# beside a STREAM triad and torch.optim.AdamW on CPU (bench/adamw_torch.py --serve), interleaved
# in the same run (see bench/bench_host_step.c); --device cuda in a CUDA build (tests/gpu/run.sh).
#   build/bench/sg_bench_host_step [--size 16] [--reps 9] [--python /path/to/python-with-torch]
sg_add_bench(sg_bench_host_step SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_host_step.c)
target_compile_definitions(sg_bench_host_step PRIVATE SG_BENCH_SOURCE_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
if(SG_WITH_CUDA)
  target_compile_definitions(sg_bench_host_step PRIVATE SG_HAVE_CUDA)
endif()
if(OpenMP_C_FOUND)
  target_link_libraries(sg_bench_host_step PRIVATE OpenMP::OpenMP_C)
endif()
