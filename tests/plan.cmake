sg_add_test(test_plan SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_plan.c LABELS unit TIMEOUT 120)
