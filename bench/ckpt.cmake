# bench_ckpt: checkpoint save/load throughput beside cp and cat of the same bytes (bench/ckpt.c).
sg_add_bench(bench_ckpt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/ckpt.c)
