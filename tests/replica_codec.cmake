# Replica codecs (cfg.replica_codec, src/engine/policy/sg_replica_codec.c): int8 and 4-bit codes
# with error feedback on hybrid engines of threads (2x2, 3x2, 3x1), against the test's own
# implementation of the scheme, bitwise.
sg_add_test(test_replica_codec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_replica_codec.c
  ARGS --local LABELS local TIMEOUT 120)
# Outer steps (cfg.outer_every, src/engine/policy/sg_replica_outer.c) against per-node flat
# engines and the test's own outer step, bitwise.
sg_add_test(test_replica_outer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_replica_outer.c
  ARGS --local LABELS local TIMEOUT 120)
sg_add_mpi_test(test_replica_codec_mpi_np4 EXE test_replica_codec NP 4 ARGS --mpi TIMEOUT 120)
