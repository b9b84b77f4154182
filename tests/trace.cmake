# Tracing: event counts, causality between the queues, bounds, the Chrome trace file, SG_TRACE.
sg_add_test(test_trace SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_trace.c LABELS local TIMEOUT 300)
