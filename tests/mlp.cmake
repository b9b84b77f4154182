# Smoke tests of the MLP example: a short run whose loss must halve (--check), with 2 ranks as
# threads (label local) and under mpirun -np 2 (label mpi).
set(SG_MLP_DIR ${PROJECT_SOURCE_DIR}/examples/mlp)
sg_add_test(test_mlp SOURCES ${SG_MLP_DIR}/mlp.c ${SG_MLP_DIR}/mlp_model.c
  ARGS --ranks 2 --steps 40 --hidden 32 --layers 3 --batch 16 --micro-batches 2
       --bucket-mb 0.004 --lr 0.01 --log-every 10 --check
  LABELS local TIMEOUT 300)
target_include_directories(test_mlp PRIVATE ${SG_MLP_DIR})
sg_add_test(test_mlp_bf16_nosync SOURCES ${SG_MLP_DIR}/mlp.c ${SG_MLP_DIR}/mlp_model.c
  ARGS --ranks 3 --steps 40 --hidden 32 --layers 2 --batch 16 --micro-batches 3 --no-sync
       --dtype bf16 --strategy shard_opt --bucket-mb 0.004 --lr 0.01 --log-every 10 --check
  LABELS local TIMEOUT 300)
target_include_directories(test_mlp_bf16_nosync PRIVATE ${SG_MLP_DIR})
sg_add_mpi_test(test_mlp_mpi EXE test_mlp NP 2
  ARGS --mpi --steps 40 --hidden 32 --layers 3 --batch 16 --bucket-mb 0.004 --lr 0.01
       --log-every 10 --check)
# --hybrid: 4 ranks as 2 nodes x 2 (threads) and 3 x 2 under mpirun -np 6, sharded in a node,
# replicated across nodes: the loss must halve, and the first line names the layout.
add_test(NAME test_mlp_hybrid COMMAND test_mlp --ranks 4 --hybrid 2 --steps 40 --hidden 32
  --layers 3 --batch 16 --micro-batches 3 --bucket-mb 0.004 --lr 0.01 --log-every 10 --check)
set_tests_properties(test_mlp_hybrid PROPERTIES TIMEOUT 300 LABELS local
  PASS_REGULAR_EXPRESSION "hybrid: 2 nodes x 2 ranks" FAIL_REGULAR_EXPRESSION "failed")
sg_add_mpi_test(test_mlp_hybrid_mpi EXE test_mlp NP 6
  ARGS --mpi --hybrid 3 --steps 40 --hidden 32 --layers 3 --batch 16 --micro-batches 2
       --bucket-mb 0.004 --lr 0.01 --log-every 10 --check)
# --trace: the Chrome trace of steps 2.. per rank and the summary line (several buckets, so
# that there are reductions to hide behind the backward pass).
add_test(NAME test_mlp_trace COMMAND test_mlp --ranks 2 --steps 6 --hidden 32 --layers 3
  --batch 16 --bucket-mb 0.004 --log-every 10 --trace ${CMAKE_CURRENT_BINARY_DIR}/mlp_trace-%r.json)
set_tests_properties(test_mlp_trace PROPERTIES TIMEOUT 300 LABELS local
  PASS_REGULAR_EXPRESSION "trace: 5 steps, [0-9]+ reductions: .* 0 events dropped")
# --overlap-gather: every layer of the next forward pass waits for its own bucket's all-gather;
# the loss must still halve (bf16 params: the f32 copies are made after each layer's wait), and
# the trace summary reports the gathers and how long the forward pass waited for them.
add_test(NAME test_mlp_overlap COMMAND test_mlp --ranks 3 --steps 40 --hidden 32 --layers 3
  --batch 16 --micro-batches 2 --dtype bf16 --bucket-mb 0.004 --lr 0.01 --log-every 10 --check
  --overlap-gather --trace ${CMAKE_CURRENT_BINARY_DIR}/mlp_overlap-%r.json)
set_tests_properties(test_mlp_overlap PROPERTIES TIMEOUT 300 LABELS local
  PASS_REGULAR_EXPRESSION "trace: all-gather [0-9.]+ ms/step, [0-9]+% of it hidden behind AdamW and the forward pass"
  FAIL_REGULAR_EXPRESSION "failed")
# Command-line errors: one line on stderr, nothing on stdout, exit 64 (tests/cli_error_check.sh).
foreach(case
    "steps_no_value|--steps needs a value \\(an integer in 1\\.\\.100000000\\)|--steps"
    "steps_bad|bad value for --steps: 'x' \\(expected an integer|--steps;x"
    "steps_zero|bad value for --steps: '0'|--steps;0"
    "dtype_fp32|bad value for --dtype: 'fp32' \\(expected f32, bf16 or f16\\)|--dtype;fp32"
    "unknown|unknown argument '--bogus'. mlp --help lists the flags|--bogus"
    "ranks_mpi|--ranks and --mpi conflict|--ranks;3;--mpi"
    "save_every|--save-every needs --save DIR|--save-every;5"
    "launched_ranks|started by mpirun \\(Open MPI\\), and --ranks 2 asks for threads|--ranks;2"
    "offload_no_shard|--offload needs --strategy shard_grad_op or shard_opt|--offload;--strategy;no_shard"
    "hybrid_zero|bad value for --hybrid: '0' \\(expected a number of nodes in 1\\.\\.4096\\)|--hybrid;0"
    "hybrid_uneven|--hybrid 2: --ranks 3 is not a multiple of the 2 nodes|--hybrid;2;--ranks;3"
    "hybrid_no_shard|--hybrid shards inside a node: it needs --strategy shard_grad_op|--hybrid;2;--strategy;no_shard")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 name)
  list(GET parts 1 pattern)
  list(SUBLIST parts 2 -1 args)
  add_test(NAME test_mlp_cli_${name}
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_error_check.sh "${pattern}" $<TARGET_FILE:test_mlp> ${args})
  set_tests_properties(test_mlp_cli_${name} PROPERTIES TIMEOUT 60 LABELS unit)
endforeach()
# as mpirun would start it (its environment variable), without a real launch
set_tests_properties(test_mlp_cli_launched_ranks PROPERTIES ENVIRONMENT "OMPI_COMM_WORLD_SIZE=2")
# --offload on the CPU device: accepted, trains as without it (the state is host memory already)
add_test(NAME test_mlp_offload COMMAND test_mlp --ranks 2 --steps 40 --hidden 32 --layers 3
  --batch 16 --bucket-mb 0.004 --lr 0.01 --log-every 10 --check --offload)
set_tests_properties(test_mlp_offload PROPERTIES TIMEOUT 300 LABELS local
  FAIL_REGULAR_EXPRESSION "pinned host memory")
# --help: every flag with its default, on stdout, exit 0
add_test(NAME test_mlp_help COMMAND test_mlp --help)
set_tests_properties(test_mlp_help PROPERTIES TIMEOUT 60 LABELS unit
  PASS_REGULAR_EXPRESSION "--steps N +optimizer steps \\(default 200\\).*--offload .*--hybrid N.*--resume DIR")
# mpirun -np 2 without --mpi: one training of 2 ranks over MPI, not two of 2 threads each
sg_add_mpi_test(test_mlp_mpi_auto EXE test_mlp NP 2
  ARGS --steps 40 --hidden 32 --layers 3 --batch 16 --bucket-mb 0.004 --lr 0.01 --log-every 10
       --check)
if(SG_WITH_MPI)
  set_tests_properties(test_mlp_mpi_auto PROPERTIES PASS_REGULAR_EXPRESSION "W=2 \\(MPI\\)")
  # A launcher's processes that MPI makes worlds of one (another MPI's mpiexec, here only its
  # environment variable): each would train alone as "rank 0"; mlp says so and exits non-zero.
  add_test(NAME test_mlp_cli_launcher_mismatch
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_error_check.sh
            "started 2 processes, but MPI made this one a world of 1: libshardgrad's MPI is not the launcher's"
            $<TARGET_FILE:test_mlp> --steps 2)
  set_tests_properties(test_mlp_cli_launcher_mismatch PROPERTIES TIMEOUT 60 LABELS unit
    ENVIRONMENT "PMI_SIZE=2")
endif()
# --plot: a PNG the example writes itself (no library); tests/png_check.py checks its chunks,
# CRCs, zlib stream and that the loss curve was drawn (>= 520 pixels: 2 px thick over 520).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_FOUND)
  add_test(NAME test_mlp_plot COMMAND bash -c "rm -f mlp_plot.png && \"$0\" --ranks 2 --steps 30 --hidden 32 --layers 2 --batch 16 --log-every 10 --plot mlp_plot.png && \"$1\" '${CMAKE_CURRENT_SOURCE_DIR}/png_check.py' mlp_plot.png 520"
    $<TARGET_FILE:test_mlp> ${Python3_EXECUTABLE})
  set_tests_properties(test_mlp_plot PROPERTIES TIMEOUT 120 LABELS local
    WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
endif()
add_test(NAME test_mlp_cli_plot_dir COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli_error_check.sh
  "^mlp: --plot /nonexistent-dir/p.png: its directory does not exist" $<TARGET_FILE:test_mlp> --steps 3
  --log-every 10 --plot /nonexistent-dir/p.png)
set_tests_properties(test_mlp_cli_plot_dir PROPERTIES TIMEOUT 60 LABELS unit)
