# Issue 14: what an adversarial run broke. Checkpoints under concurrent savers, FIFOs, full
# disks and missing files (test_ckpt_hardening: forks and re-executes itself; mounts a small
# tmpfs where permitted, else skips that part), names and sizes at registration
# (test_params_hardening: 10^6 parameters, which the old quadratic duplicate check could not
# register within the timeout), and the safetensors reader against the reference's rules
# (test_safetensors_rules).
sg_add_test(test_ckpt_hardening SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_ckpt_hardening.c
            LABELS local TIMEOUT 300)
sg_add_test(test_params_hardening SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_params_hardening.c
            LABELS local TIMEOUT 240)
sg_add_test(test_safetensors_rules SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_safetensors_rules.c
            LABELS local TIMEOUT 60)
# kill -9 of one MPI rank mid-step: the launcher runs mpirun --enable-recovery itself.
if(SG_WITH_MPI AND MPIEXEC_EXECUTABLE)
  sg_add_test(test_mpi_rank_kill SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_mpi_rank_kill.c
              ARGS ${MPIEXEC_EXECUTABLE} LABELS mpi TIMEOUT 150)
endif()
# sg_grad_zero: every strategy, f32/bf16, W=1..3 threads, and one rank per process.
sg_add_test(test_grad_zero SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_grad_zero.c LABELS local
            TIMEOUT 300)
sg_add_mpi_test(test_grad_zero_mpi_np2 EXE test_grad_zero NP 2 ARGS --mpi TIMEOUT 300)
# sg_grad_scale (issue 24: p.grad.mul_ of ShardedAdamW's gradients): every strategy, f32/bf16,
# with and without clipping, W=1..3 threads, against gradients scaled before they were given.
sg_add_test(test_grad_scale SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_grad_scale.c LABELS local
            TIMEOUT 120)
sg_add_test(test_engine_guard SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_engine_guard.c
            LABELS local TIMEOUT 120)
# Every public engine function enters the guard first (a new one without it fails here).
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_FOUND)
  add_test(NAME test_engine_guard_coverage
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/check_guard.py
                   ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_engine_guard_coverage PROPERTIES TIMEOUT 60 LABELS unit)
endif()
