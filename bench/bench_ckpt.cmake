# bench_ckpt: checkpoint save/load throughput beside cp and cat of the same bytes (bench/bench_ckpt.c).
sg_add_bench(sg_bench_ckpt SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_ckpt.c)
