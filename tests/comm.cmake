# Communicators: one program, run with the local backend (W threads) and under mpirun.
sg_add_test(test_comm_local2 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_comm.c ARGS --local 2
  LABELS local TIMEOUT 300)
foreach(w 1 3 4 8)
  add_test(NAME test_comm_local${w} COMMAND test_comm_local2 --local ${w})
  set_tests_properties(test_comm_local${w} PROPERTIES TIMEOUT 300 LABELS local)
endforeach()
# The caller's transport (sg_comm_create_xport) over an in-process mailbox: the MPI algorithms
# through the public callbacks, at W=2 (ring) and W=3 (direct), with its timeout and failures.
foreach(w 2 3)
  add_test(NAME test_comm_xport${w} COMMAND test_comm_local2 --xport ${w})
  set_tests_properties(test_comm_xport${w} PROPERTIES TIMEOUT 300 LABELS local)
endforeach()
# MPI: the default reduce-scatter, then each algorithm forced (SG_MPI_REDUCE_SCATTER); the test
# reads the same variable to know the summation order it must match bit for bit.
foreach(np 2 3 4)
  sg_add_mpi_test(test_comm_mpi_np${np} EXE test_comm_local2 NP ${np} ARGS --mpi TIMEOUT 300)
  foreach(algo ring direct)
    sg_add_mpi_test(test_comm_mpi_${algo}_np${np} EXE test_comm_local2 NP ${np} ARGS --mpi
      TIMEOUT 300)
    if(TEST test_comm_mpi_${algo}_np${np})
      set_tests_properties(test_comm_mpi_${algo}_np${np} PROPERTIES
        ENVIRONMENT "OMPI_MCA_rmaps_base_oversubscribe=1;OMP_NUM_THREADS=1;SG_MPI_REDUCE_SCATTER=${algo}")
    endif()
  endforeach()
endforeach()
# One rank skips a collective: the others time out, and every process still exits cleanly.
foreach(np 2 3)
  foreach(algo ring direct)
    sg_add_mpi_test(test_comm_mpi_timeout_${algo}_np${np} EXE test_comm_local2 NP ${np}
      ARGS --mpi --timeout TIMEOUT 120)
    if(TEST test_comm_mpi_timeout_${algo}_np${np})
      set_tests_properties(test_comm_mpi_timeout_${algo}_np${np} PROPERTIES
        ENVIRONMENT "OMPI_MCA_rmaps_base_oversubscribe=1;OMP_NUM_THREADS=1;SG_MPI_REDUCE_SCATTER=${algo}")
    endif()
  endforeach()
endforeach()
# Several engines on one communicator (issue 14): engines stepping alternately, their gradients
# interleaved, each bitwise equal to the same engine alone; threads and mpirun.
sg_add_test(test_two_engines SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_two_engines.c
  ARGS --local 2 LABELS local TIMEOUT 300)
add_test(NAME test_two_engines_w3 COMMAND test_two_engines --local 3)
set_tests_properties(test_two_engines_w3 PROPERTIES TIMEOUT 300 LABELS local)
sg_add_mpi_test(test_two_engines_mpi_np2 EXE test_two_engines NP 2 ARGS --mpi TIMEOUT 300)
# Comm jobs skipped after a failure give back their arguments (LeakSanitizer in the asan stage).
sg_add_test(test_skip_leak SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_skip_leak.c LABELS local
  TIMEOUT 60)
