# The include rules of DESIGN.md section 1 (scripts/check_deps.sh), and the script's own check
# that it catches planted violations.
add_test(NAME test_deps COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/check_deps.sh
  ${PROJECT_SOURCE_DIR})
set_tests_properties(test_deps PROPERTIES TIMEOUT 120 LABELS unit)
add_test(NAME test_deps_selftest COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/check_deps.sh
  --selftest)
set_tests_properties(test_deps_selftest PROPERTIES TIMEOUT 120 LABELS unit)
