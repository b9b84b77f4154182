# The memory tables of README.md and docs/memory.md against sg_estimate_memory:
# scripts/gen_memory_tables.py --check regenerates them through the Python binding and fails
# (with a diff) when a file differs.
# Needs python3 with numpy, as the binding does; not in sanitizer builds (see python.cmake).
if(NOT SG_SANITIZE)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy"
      RESULT_VARIABLE _sg_docs_rc OUTPUT_QUIET ERROR_QUIET)
    if(_sg_docs_rc EQUAL 0)
      add_test(NAME test_docs_memory
        COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/scripts/gen_memory_tables.py --check
                --library $<TARGET_FILE:shardgrad>)
      set_tests_properties(test_docs_memory PROPERTIES TIMEOUT 120 LABELS unit)
    else()
      message(STATUS "test_docs_memory skipped: python3 lacks numpy")
    endif()
  endif()
endif()
