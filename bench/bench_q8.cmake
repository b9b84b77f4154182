# sg_bench_q8: the AdamW step over 8-bit blockwise state (sg__cpu_adamw_q8) against the fp32-state
# step and a STREAM triad in the same run, bytes per parameter printed (see bench/bench_q8.c).
#   build/bench/sg_bench_q8 [--sizes 4,16] [--reps 10] [--cpu-time] [--in-cache 32]
sg_add_bench(sg_bench_q8 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_q8.c)
