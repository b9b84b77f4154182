# sg_estimate_step: the model's bytes against the comm counters of real engines on threads, and
# its times against hand-computed steps (tests/test_estimate_step.c)
sg_add_test(test_estimate_step SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_estimate_step.c
  LABELS unit TIMEOUT 300)
