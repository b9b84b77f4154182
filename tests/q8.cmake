# 8-bit optimizer state (cfg.optim_state_dtype SG_Q8, issue 27): the codes, the CPU kernel
# against an independent implementation, W = 1..4 bit for bit on threads, the small-tensor rule,
# memory, bad configs; under MPI W = np against one rank.
sg_add_test(test_q8 SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_q8.c LABELS local TIMEOUT 300)
sg_add_mpi_test(test_q8_mpi_np3 EXE test_q8 NP 3 ARGS --mpi TIMEOUT 300)
