// Host emulation of the small CUDA subset that sg_cuda_kernels.cu uses, so that its kernels can
// run on a machine without a GPU (tests/test_cuda_emu.cpp compiles the .cu as C++ with
// SG_CUDA_EMULATE). It checks the kernels' own logic: grid-stride loops, groups of 4 and their
// vector paths, segment lookup, the sumsq partition and combine, launch-shape independence.
// It cannot check what only hardware does (device code generation, -fmad=false, memory model).
//
// A launch runs its blocks one after the other, all on the calling thread. Kernels without
// __syncthreads (SG_LAUNCH) run their threads one after the other; kernels with it
// (SG_LAUNCH_SYNC) run the threads of a block as fibers that hand over at every __syncthreads.
// Either way __shared__ arrays can be function-local statics: one block uses them at a time.
#ifndef SG_CUDA_EMU_H
#define SG_CUDA_EMU_H

#include <cstdint>     // uint64_t
#include <cstdio>      // fprintf
#include <cstring>     // memmove
#include <exception>   // std::terminate
#include <functional>  // the fibers' body
#include <vector>

#include <ucontext.h>  // fibers for the threads of a block

// ThreadSanitizer follows one stack per thread: every switch between fibers is announced to it,
// or it loses track of the thread (and crashes) at the first lock taken on a fiber's stack.
#if defined(__SANITIZE_THREAD__)
#define SG_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SG_EMU_TSAN 1
#endif
#endif
#ifdef SG_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#include "sg_cuda_emu_hook.h"  // sg_emu_enqueue: a mock runtime's streams

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

typedef void *cudaStream_t;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };

struct dim3 {
  unsigned x, y, z;
};
// Aligned as CUDA's own (__align__(16), __align__(8)): a vector access needs that alignment on
// the GPU, so the emulation checks it (sg_emu_check_vector) instead of letting x86 forgive it.
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
// The cache-global store intrinsic (one wide STG on the GPU): a plain store here.
template <typename V>
inline void __stcg(V *p, V v) {
  *p = v;
}

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

// Kernels with __syncthreads run the threads of a block as fibers (ucontext) on the calling
// thread: each runs until its next __syncthreads, then hands over to the next one, round robin.
// Every thread of a correct kernel reaches the same barriers, so when the last thread arrives,
// the first one continues past the barrier. Cheap enough for 1024-thread blocks on 2 cores,
// where OS threads meeting at a barrier were not.
struct sg_emu_fibers {
  std::vector<ucontext_t> ctx;
  std::vector<std::vector<char>> stacks;
  ucontext_t main;
  unsigned n = 0;
  const std::function<void()> *body = nullptr;
  std::vector<void *> tsan;  // ThreadSanitizer's fiber per thread (SG_EMU_TSAN), main last
};

inline sg_emu_fibers *sg_emu_current_fibers;

// Tells ThreadSanitizer that fiber `to` (n: the launching thread's own stack) runs next.
inline void sg_emu_tsan_enter(sg_emu_fibers *f, unsigned to) {
#ifdef SG_EMU_TSAN
  __tsan_switch_to_fiber(f->tsan[to], 0);
#else
  (void)f;
  (void)to;
#endif
}

inline void sg_emu_tsan_fibers(sg_emu_fibers *f, int create) {
#ifdef SG_EMU_TSAN
  if (create) {
    f->tsan.resize(f->n + 1);
    for (unsigned t = 0; t < f->n; t++) f->tsan[t] = __tsan_create_fiber(0);
    f->tsan[f->n] = __tsan_get_current_fiber();
  } else {
    for (unsigned t = 0; t < f->n; t++) __tsan_destroy_fiber(f->tsan[t]);
  }
#else
  (void)f;
  (void)create;
#endif
}

inline void sg_emu_switch(unsigned from, unsigned to) {
  threadIdx = dim3{to, 0, 0};
  sg_emu_tsan_enter(sg_emu_current_fibers, to);
  swapcontext(&sg_emu_current_fibers->ctx[from], &sg_emu_current_fibers->ctx[to]);
}

// A kernel launched with SG_LAUNCH (not SG_LAUNCH_SYNC) must not get here: its threads run one
// after the other.
inline void __syncthreads() {
  sg_emu_fibers *f = sg_emu_current_fibers;
  if (!f) {
    fprintf(stderr, "sg_cuda_emu: __syncthreads in a kernel launched without SG_LAUNCH_SYNC\n");
    std::terminate();
  }
  const unsigned me = threadIdx.x;
  sg_emu_switch(me, (me + 1) % f->n);
}

// Fiber entry: run the kernel for this thread, then pass on (the last one returns to main).
inline void sg_emu_fiber_main() {
  sg_emu_fibers *f = sg_emu_current_fibers;
  const unsigned me = threadIdx.x;
  (*f->body)();
  if (me + 1 < f->n) {
    threadIdx = dim3{me + 1, 0, 0};
    sg_emu_tsan_enter(f, me + 1);
    setcontext(&f->ctx[me + 1]);
  }
  sg_emu_tsan_enter(f, f->n);
  setcontext(&f->main);
}

inline cudaError_t cudaGetLastError() {
  return sg_emu_last_error ? (cudaError_t)sg_emu_last_error() : cudaSuccess;
}

// A vector load or store at p: misaligned ones fault on the GPU ("misaligned address"), so here
// they stop the program with the kernel's position.
template <typename V>
inline void sg_emu_check_vector(const void *p) {
  if ((uintptr_t)p % alignof(V) == 0) return;
  fprintf(stderr, "sg_cuda_emu: misaligned %zu-byte vector access at %p (block %u, thread %u)\n",
          sizeof(V), p, blockIdx.x, threadIdx.x);
  std::terminate();
}

// What a real launch would refuse (cudaErrorInvalidConfiguration, or a kernel that does not
// compile): an empty grid or block, gridDim.x past 2^31-1, more than 1024 threads per block, or
// more than 32764 bytes of parameters (sm_70+ with CUDA 12.1+; 4 KiB before).
template <typename... P>
inline void sg_emu_check_launch(unsigned grid, unsigned block) {
  const size_t param_bytes = (sizeof(P) + ... + 0);
  if (grid >= 1 && grid <= 0x7fffffffu && block >= 1 && block <= 1024 && param_bytes <= 32764)
    return;
  fprintf(stderr, "sg_cuda_emu: invalid launch (grid %u, block %u, %zu parameter bytes)\n", grid,
          block, param_bytes);
  std::terminate();
}

// Work on a stream: queued when a mock runtime is attached and a stream is given, else now.
inline void sg_emu_submit(cudaStream_t s, std::function<void()> work) {
  if (sg_emu_enqueue && s)
    sg_emu_enqueue(s, std::move(work));
  else
    work();
}

inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t s) {
  if (sg_emu_counted) sg_emu_counted(0);
  sg_emu_submit(s, [=] { memmove(dst, src, bytes); });
  return cudaSuccess;
}

// Runs k<<<grid, block>>>(args...) to completion for a kernel without __syncthreads: block by
// block, thread by thread, on the calling thread.
template <typename... P, typename... A>
void sg_emu_run(void (*k)(P...), unsigned grid, unsigned block, A... args) {
  gridDim = dim3{grid, 1, 1};
  blockDim = dim3{block, 1, 1};
  for (unsigned b = 0; b < grid; b++)
    for (unsigned t = 0; t < block; t++) {
      blockIdx = dim3{b, 0, 0};
      threadIdx = dim3{t, 0, 0};
      k(args...);
    }
}

// Fiber t of the block starts at sg_emu_fiber_main on its own stack. A function of its own: a
// getcontext in the caller's loop would make the compiler fear for the loop counter.
inline void sg_emu_fiber_prepare(sg_emu_fibers &f, unsigned t, size_t stack_bytes) {
  getcontext(&f.ctx[t]);
  f.ctx[t].uc_stack.ss_sp = f.stacks[t].data();
  f.ctx[t].uc_stack.ss_size = stack_bytes;
  f.ctx[t].uc_link = nullptr;
  makecontext(&f.ctx[t], sg_emu_fiber_main, 0);
}

// The same for a kernel with __syncthreads, its threads as fibers. Not reentrant.
template <typename... P, typename... A>
void sg_emu_run_sync(void (*k)(P...), unsigned grid, unsigned block, A... args) {
  static sg_emu_fibers f;
  const size_t stack_bytes = 64 * 1024;
  gridDim = dim3{grid, 1, 1};
  blockDim = dim3{block, 1, 1};
  const std::function<void()> body = [&] { k(args...); };
  f.n = block;
  f.body = &body;
  f.ctx.resize(block);
  if (f.stacks.size() < block) f.stacks.resize(block, std::vector<char>(stack_bytes));
  sg_emu_current_fibers = &f;
  for (unsigned b = 0; b < grid; b++) {
    blockIdx = dim3{b, 0, 0};
    for (unsigned t = 0; t < block; t++) sg_emu_fiber_prepare(f, t, stack_bytes);
    threadIdx = dim3{0, 0, 0};
    sg_emu_tsan_fibers(&f, 1);
    sg_emu_tsan_enter(&f, 0);
    swapcontext(&f.main, &f.ctx[0]);  // back here when the block's last thread has finished
    sg_emu_tsan_fibers(&f, 0);
  }
  sg_emu_current_fibers = nullptr;
}

// k<<<grid, block, 0, s>>>(args...): the arguments are copied, as a real launch does.
template <typename... P, typename... A>
void sg_emu_launch(cudaStream_t s, void (*k)(P...), unsigned grid, unsigned block, A... args) {
  sg_emu_check_launch<P...>(grid, block);
  if (sg_emu_counted) sg_emu_counted(1);
  sg_emu_submit(s, [=] { sg_emu_run(k, grid, block, args...); });
}

template <typename... P, typename... A>
void sg_emu_launch_sync(cudaStream_t s, void (*k)(P...), unsigned grid, unsigned block, A... args) {
  sg_emu_check_launch<P...>(grid, block);
  if (sg_emu_counted) sg_emu_counted(1);
  sg_emu_submit(s, [=] { sg_emu_run_sync(k, grid, block, args...); });
}

#endif  // SG_CUDA_EMU_H
