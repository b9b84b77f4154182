# The ctypes binding's own tests (python/tests/test_binding.py) under ctest, so that a plain
# `ctest` catches drift between include/shardgrad.h and the Python prototypes and struct
# layouts. The whole Python suite (torch, mpirun, memory) runs with
# `python3 -m pytest python/tests` (scripts/test.sh). Not in sanitizer builds: an instrumented
# library cannot be loaded into an uninstrumented python3.
if(NOT SG_SANITIZE)
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(Python3_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import numpy, pytest"
      RESULT_VARIABLE _sg_py_rc OUTPUT_QUIET ERROR_QUIET)
    if(_sg_py_rc EQUAL 0)
      add_test(NAME python_binding
        COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider
                ${CMAKE_SOURCE_DIR}/python/tests/test_binding.py)
      set_tests_properties(python_binding PROPERTIES TIMEOUT 300 LABELS python
        ENVIRONMENT "SHARDGRAD_LIBRARY=$<TARGET_FILE:shardgrad>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python")
      # multiprocessing (fork) after training: children must not hang in OpenMP (issue 30)
      add_test(NAME python_fork
        COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider
                ${CMAKE_SOURCE_DIR}/python/tests/test_fork.py)
      set_tests_properties(python_fork PROPERTIES TIMEOUT 180 LABELS python
        ENVIRONMENT "SHARDGRAD_LIBRARY=$<TARGET_FILE:shardgrad>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python")
      # the package's layers: no import circle, no torch below shardgrad/torch/ (issue 25)
      add_test(NAME python_layers
        COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider
                ${CMAKE_SOURCE_DIR}/python/tests/test_layers.py)
      set_tests_properties(python_layers PROPERTIES TIMEOUT 120 LABELS python
        ENVIRONMENT "SHARDGRAD_LIBRARY=$<TARGET_FILE:shardgrad>;PYTHONPATH=${CMAKE_SOURCE_DIR}/python")
    else()
      message(STATUS "python_binding test skipped: python3 lacks numpy or pytest")
    endif()
  endif()
endif()
