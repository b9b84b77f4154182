// The CUDA kernels of kernels/cuda, compiled for the host (sg_cuda_emu.h), for the mock CUDA
// library: launches go to the mock runtime's streams through sg_emu_enqueue.
#define SG_CUDA_EMULATE 1
#include "cuda/sg_cuda_kernels.cu"
