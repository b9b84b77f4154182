// The one link between the host emulation of the CUDA kernels (sg_cuda_emu.h) and a mock CUDA
// runtime (tests/cudamock): when the runtime sets sg_emu_enqueue, emulated kernels and copies
// launched on a stream are queued there (run when the stream is forced) instead of at once.
#ifndef SG_CUDA_EMU_HOOK_H
#define SG_CUDA_EMU_HOOK_H

#include <functional>  // std::function

inline void (*sg_emu_enqueue)(void *stream, std::function<void()> work) = nullptr;
// The runtime's cudaGetLastError (this thread's last error, reset), which the emulated
// launchers report as a real launch does; NULL: none (launches always succeed).
inline int (*sg_emu_last_error)(void) = nullptr;
// Told of every emulated kernel launch (kernel = 1) and copy (kernel = 0) as it is queued, so
// that a mock runtime can count the device operations of the calling thread; NULL: nobody.
inline void (*sg_emu_counted)(int kernel) = nullptr;

#endif  // SG_CUDA_EMU_HOOK_H
