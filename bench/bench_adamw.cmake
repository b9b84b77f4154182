# sg_bench_adamw: the one-rank fused AdamW step (sg__cpu_adamw) over 1M-64M parameters, f32 and
# bf16 params, beside a STREAM triad measured in the same run (see bench/bench_adamw.c).
#   build/bench/sg_bench_adamw [--sizes 1,4,16,64] [--reps 10]
sg_add_bench(sg_bench_adamw SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_adamw.c)
