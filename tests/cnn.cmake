# The CPU reference of examples/cnn_cudnn (the network cnn_cudnn --check compares cuDNN with):
# gradients against finite differences, the loss scale, and that the task can be learned. Plain
# C, so it runs in every build, with or without CUDA.
set(SG_CNN_DIR ${PROJECT_SOURCE_DIR}/examples/cnn_cudnn)
sg_add_test(test_cnn_model SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cnn_model.c
  ${SG_CNN_DIR}/cnn_model.c LABELS unit TIMEOUT 300)
target_include_directories(test_cnn_model PRIVATE ${SG_CNN_DIR})
