# Replica codecs (cfg.replica_codec, src/engine/policy/sg_replica_codec.c): int8 and 4-bit codes
# with error feedback on hybrid engines of threads (2x2, 3x2, 3x1), against the test's own
# implementation of the scheme, bitwise.
sg_add_test(test_replica_codec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_replica_codec.c
  ARGS --local LABELS local TIMEOUT 120)
