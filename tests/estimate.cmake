# sg_estimate_step: the model's bytes against the comm counters of real engines on threads, and
# its times against hand-computed steps (tests/test_estimate_step.c)
sg_add_test(test_estimate_step SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_estimate_step.c
  LABELS unit TIMEOUT 300)
# the C example runs and prints its three layouts
if(SG_BUILD_EXAMPLES) # examples/ is configured after tests/
  add_test(NAME example_plan_step COMMAND $<TARGET_FILE:example_plan_step> 1024 4 2 2 1 8 0.1)
  set_tests_properties(example_plan_step PROPERTIES TIMEOUT 60 LABELS unit
    PASS_REGULAR_EXPRESSION "hybrid, bf16 wire")
endif()
