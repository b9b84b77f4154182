# Engine at W ranks against one rank on the combined batch (local threads and MPI).
sg_add_test(test_engine_w2 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine.c ARGS --local 2 LABELS local TIMEOUT 600)
foreach(w 3 4)
  add_test(NAME test_engine_w${w} COMMAND test_engine_w2 --local ${w})
  set_tests_properties(test_engine_w${w} PROPERTIES TIMEOUT 600 LABELS local)
endforeach()
foreach(np 2 3 4)
  sg_add_mpi_test(test_engine_mpi_np${np} EXE test_engine_w2 NP ${np} ARGS --mpi --quick TIMEOUT 600)
endforeach()
# The same without the channel's fold into the accumulator (SG_COMM_FOLD=0): the two passes it
# replaces stay covered. Label nofold: the Release stage of scripts/test.sh runs it; the
# sanitizer stages leave it out (the threads and buffers are the same either way).
add_test(NAME test_engine_w2_nofold COMMAND test_engine_w2 --local 2)
set_tests_properties(test_engine_w2_nofold PROPERTIES TIMEOUT 600 LABELS nofold ENVIRONMENT SG_COMM_FOLD=0)
# sg_memory == sg_estimate_memory == the DESIGN.md section 3 formulas
sg_add_test(test_memory SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_memory.c LABELS local TIMEOUT 300)
# Which gradient slots give their pages back: staging reused in the same micro-batch is zeroed
sg_add_test(test_slot_release SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_slot_release.c LABELS local TIMEOUT 120)
