# sg_bench_step: step time and memory per rank of the example MLP for the plain data-parallel loop
# and the three strategies (see bench/bench_step.c). Shares the model code with examples/mlp.
sg_add_bench(sg_bench_step
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/bench_step.c ${PROJECT_SOURCE_DIR}/examples/mlp/mlp_model.c
  INCLUDES ${PROJECT_SOURCE_DIR}/examples/mlp)
