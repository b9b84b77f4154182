sg_add_test(test_core SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_core.c LABELS unit TIMEOUT 60)
# sg_config's published layouts: a 0.1-sized and a 0.2-sized config both work end to end.
sg_add_test(test_config_layout SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_config_layout.c
  LABELS unit TIMEOUT 60)
