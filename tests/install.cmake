# Installs the build into a temporary prefix and builds a small consumer against it, with
# find_package(shardgrad) (shared and static targets) and with pkg-config (shared and static).
add_test(NAME test_install
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install_check.sh ${PROJECT_BINARY_DIR}
          ${CMAKE_CURRENT_BINARY_DIR}/install_check ${CMAKE_C_COMPILER} ${PROJECT_VERSION})
set_tests_properties(test_install PROPERTIES LABELS install TIMEOUT 600)
