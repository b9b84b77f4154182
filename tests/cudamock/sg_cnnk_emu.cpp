// examples/cnn_cudnn's kernel (cnn_cudnn_kernels.cu) compiled for the host, its launches queued
// on the mock runtime's streams (sg_cuda_emu.h), for test_cnn_cudnn_cudamock.
#define CNNK_EMULATE 1
#include "cnn_cudnn_kernels.cu"
