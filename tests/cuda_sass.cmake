# Build-time SASS check (CUDA builds where cuobjdump is found at configure time): after every
# link of the static library (target sg_sass_check, in ALL), tests/sass_wide_stores.sh reads the AdamW update kernels' machine
# code and fails the build unless every variant's full-vector paths use 128-bit loads and
# stores (LDG.E.128 / STG.E.128 for the fp32 state, STG.E.64 for 16-bit parameters). cuobjdump:
# the toolkit's, PATH, or PyPI's nvidia-cuda-cuobjdump (site-packages/nvidia/cu*/bin; see
# scripts/test.sh install_cuda_extras). Without it, ctest's test_sass_wide_stores (tests/cuda.cmake)
# runs the same check and skips. -DSG_SASS_CHECK=OFF turns the build-time check off.
if(SG_WITH_CUDA)
  option(SG_SASS_CHECK "check the AdamW kernels' SASS for 128-bit accesses after each build" ON)
  set(_sg_cuo_hints)
  if(CUDAToolkit_BIN_DIR)
    list(APPEND _sg_cuo_hints ${CUDAToolkit_BIN_DIR})
  endif()
  find_package(Python3 QUIET COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c
      "import nvidia, glob; print(';'.join(d for p in nvidia.__path__ for d in glob.glob(p + '/*/bin')))"
      OUTPUT_VARIABLE _sg_cuo_py OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _sg_cuo_rc)
    if(_sg_cuo_rc EQUAL 0 AND _sg_cuo_py)
      list(APPEND _sg_cuo_hints ${_sg_cuo_py})
    endif()
  endif()
  find_program(SG_CUOBJDUMP cuobjdump HINTS ${_sg_cuo_hints})
  if(SG_SASS_CHECK AND SG_CUOBJDUMP)
    message(STATUS "shardgrad: SASS check after each build with ${SG_CUOBJDUMP}")
    # A stamp that depends on the library file: re-checked whenever the library is relinked,
    # part of ALL so that a narrow variant fails the build.
    set(_sg_sass_stamp ${CMAKE_CURRENT_BINARY_DIR}/sass_wide_stores.stamp)
    add_custom_command(OUTPUT ${_sg_sass_stamp}
      COMMAND ${CMAKE_COMMAND} -E env SG_CUOBJDUMP=${SG_CUOBJDUMP}
        bash ${CMAKE_CURRENT_SOURCE_DIR}/sass_wide_stores.sh $<TARGET_FILE:shardgrad_static>
      COMMAND ${CMAKE_COMMAND} -E touch ${_sg_sass_stamp}
      DEPENDS shardgrad_static ${CMAKE_CURRENT_SOURCE_DIR}/sass_wide_stores.sh
      COMMENT "SASS: 128-bit loads and stores in every AdamW variant (tests/sass_wide_stores.sh)"
      VERBATIM)
    add_custom_target(sg_sass_check ALL DEPENDS ${_sg_sass_stamp})
    set_tests_properties(test_sass_wide_stores PROPERTIES ENVIRONMENT "SG_CUOBJDUMP=${SG_CUOBJDUMP}")
  elseif(SG_SASS_CHECK)
    message(STATUS "shardgrad: no cuobjdump, the SASS check is left to ctest (skipped there)")
  endif()
endif()
