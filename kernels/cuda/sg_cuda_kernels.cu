// CUDA kernels over the element math of kernels/sg_elem.h, and their extern "C" launchers
// (declared in sg_cuda_kernels.h, called by src/device/cuda.c).
//
// Every elementwise kernel is a grid-stride loop over groups of 4 consecutive elements: a group
// is loaded and stored with one 128-bit (f32) or 64-bit (bf16/f16) access when its address is
// aligned, element by element otherwise. Each element goes through the same sg_elem_* calls,
// in the same order, as in kernels/cpu, and the build uses -fmad=false (no contraction) with
// IEEE division and square root, so results match the CPU loops bit for bit and do not depend
// on the launch shape.
//
// The one reduction (sumsq) partitions the input into fixed chunks of SG__CUDA_SUMSQ_CHUNK
// elements, each summed by one block of a fixed size in a fixed order, and combines the chunk
// partials in one block, again in a fixed order: the result depends on n alone.

#include <stdint.h>  // uint16_t, uint64_t, uintptr_t
#include <string.h>  // memset

#ifdef SG_CUDA_EMULATE
#include "sg_cuda_emu.h"  // host emulation for tests without a GPU (tests/test_cuda_emu.cpp)
#define SG_LAUNCH(k, grid, block, stream, ...) \
  sg_emu_launch((stream), (k), (grid), (block), __VA_ARGS__)
#define SG_LAUNCH_SYNC(k, grid, block, stream, ...) \
  sg_emu_launch_sync((stream), (k), (grid), (block), __VA_ARGS__)
#else
#include <cuda_runtime.h>  // launches, cudaMemcpyAsync
// k is a pointer to a kernel (so that template arguments do not split the macro's arguments).
// SG_LAUNCH_SYNC marks kernels that use __syncthreads (the host emulation needs to know).
#define SG_LAUNCH(k, grid, block, stream, ...) (k)<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#define SG_LAUNCH_SYNC SG_LAUNCH
#endif

#include "../sg_adamw_args.h"  // AdamW's states, scalars and element constants
#include "../sg_elem.h"       // element math: conversions, accumulate, AdamW, hash
#include "sg_cuda_kernels.h"  // launcher declarations, sg__cuda_launch

namespace {

constexpr int kThreads = 256;          // block size of every grid-stride kernel
constexpr int kSumsqThreads = 256;     // block size of sumsq's first pass (part of its result)
constexpr int kCombineThreads = 1024;  // the single block of sumsq's second pass

// ---- launch shape ---------------------------------------------------------------------------

unsigned grid_for(uint64_t work, int max_blocks) {
  uint64_t b = (work + kThreads - 1) / kThreads;
  uint64_t cap = max_blocks > 0 ? (uint64_t)max_blocks : 1u;
  if (b > cap) b = cap;
  return b < 1 ? 1u : (unsigned)b;
}

__host__ __device__ __forceinline__ uint64_t groups_of(size_t n) { return ((uint64_t)n + 3u) / 4u; }

int launch_result() { return (int)cudaGetLastError(); }

// ---- groups of 4: loads and stores -----------------------------------------------------------

__device__ __forceinline__ bool aligned(const void *p, unsigned bytes) {
  return ((uintptr_t)p & (uintptr_t)(bytes - 1u)) == 0;
}

// Every vector access goes through these two, so that the host emulation can check its
// alignment (a misaligned one faults on the GPU but not on x86).
template <typename V>
__device__ __forceinline__ V vload(const void *p) {
#ifdef SG_CUDA_EMULATE
  sg_emu_check_vector<V>(p);
#endif
  return *(const V *)p;
}

// __stcg, not `*(V *)p = v`: nvcc splits the plain vector store into 32-bit STG.E (the scalar
// tail path of the same group shares it), while __stcg stays one STG.E.128 / STG.E.64
// (tests/sass_wide_stores.sh checks every AdamW variant's SASS for it after each build where
// cuobjdump is found, tests/cuda_sass.cmake; else ctest's test_sass_wide_stores).
template <typename V>
__device__ __forceinline__ void vstore(void *p, V v) {
#ifdef SG_CUDA_EMULATE
  sg_emu_check_vector<V>(p);
#endif
  __stcg((V *)p, v);
}

// Elements i..i+cnt-1 (cnt <= 4) of a DT array as fp32.
template <int DT>
__device__ __forceinline__ void load4(const void *base, size_t i, int cnt, float (&o)[4]) {
  if (DT == 0) {
    const float *p = (const float *)base + i;
    if (cnt == 4 && aligned(p, 16)) {
      const float4 q = vload<float4>(p);
      o[0] = q.x, o[1] = q.y, o[2] = q.z, o[3] = q.w;
      return;
    }
  } else {
    const uint16_t *p = (const uint16_t *)base + i;
    if (cnt == 4 && aligned(p, 8)) {
      const uint2 q = vload<uint2>(p);
      const uint16_t h[4] = {(uint16_t)(q.x & 0xffffu), (uint16_t)(q.x >> 16),
                             (uint16_t)(q.y & 0xffffu), (uint16_t)(q.y >> 16)};
      for (int j = 0; j < 4; j++)
        o[j] = DT == 1 ? sg_elem_bf16_to_f32(h[j]) : sg_elem_f16_to_f32(h[j]);
      return;
    }
  }
  for (int j = 0; j < cnt; j++) o[j] = sg_elem_load(base, DT, i + j);
}

// Raw 16-bit values, already rounded.
__device__ __forceinline__ void store4_u16(void *base, size_t i, int cnt, const uint16_t (&h)[4]) {
  uint16_t *p = (uint16_t *)base + i;
  if (cnt == 4 && aligned(p, 8)) {
    uint2 q;
    q.x = (uint32_t)h[0] | ((uint32_t)h[1] << 16);
    q.y = (uint32_t)h[2] | ((uint32_t)h[3] << 16);
    vstore<uint2>(p, q);
    return;
  }
  for (int j = 0; j < cnt; j++) p[j] = h[j];
}

// fp32 values rounded to DT (round to nearest even).
template <int DT>
__device__ __forceinline__ void store4(void *base, size_t i, int cnt, const float (&x)[4]) {
  if (DT == 0) {
    float *p = (float *)base + i;
    if (cnt == 4 && aligned(p, 16)) {
      vstore<float4>(p, make_float4(x[0], x[1], x[2], x[3]));
      return;
    }
    for (int j = 0; j < cnt; j++) p[j] = x[j];
    return;
  }
  uint16_t h[4] = {0, 0, 0, 0};
  for (int j = 0; j < cnt; j++)
    h[j] = DT == 1 ? sg_elem_f32_to_bf16(x[j]) : sg_elem_f32_to_f16(x[j]);
  store4_u16(base, i, cnt, h);
}

// The group g of an n-element array: first element and count.
__device__ __forceinline__ int group_span(uint64_t g, size_t n, size_t *i0) {
  *i0 = (size_t)(g * 4u);
  size_t left = n - *i0;
  return left < 4 ? (int)left : 4;
}

__device__ __forceinline__ uint64_t global_thread() {
  return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ uint64_t grid_threads() { return (uint64_t)gridDim.x * blockDim.x; }

// ---- accumulate, cast, fill ----------------------------------------------------------------

template <int ADT, int SDT>
__global__ void accumulate_kernel(void *acc, const void *src, size_t n) {
  const uint64_t ng = groups_of(n);
  for (uint64_t g = global_thread(); g < ng; g += grid_threads()) {
    size_t i0;
    const int cnt = group_span(g, n, &i0);
    float a[4], s[4];
    load4<ADT>(acc, i0, cnt, a);
    load4<SDT>(src, i0, cnt, s);
    for (int j = 0; j < cnt; j++) a[j] = sg_elem_accumulate(a[j], s[j]);
    store4<ADT>(acc, i0, cnt, a);
  }
}

template <int DDT, int SDT>
__global__ void cast_kernel(void *dst, const void *src, size_t n) {
  const uint64_t ng = groups_of(n);
  for (uint64_t g = global_thread(); g < ng; g += grid_threads()) {
    size_t i0;
    const int cnt = group_span(g, n, &i0);
    float x[4];
    load4<SDT>(src, i0, cnt, x);
    store4<DDT>(dst, i0, cnt, x);
  }
}

template <typename T>
__global__ void fill_kernel(T *dst, T value, size_t n) {
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) dst[i] = value;
}

// ---- outer steps (DiLoCo) ------------------------------------------------------------------

// d = po - theta, groups of 4 as the elementwise kernels above.
__global__ void outer_delta_kernel(float *d, const float *po, const float *theta, size_t n) {
  const uint64_t ng = groups_of(n);
  for (uint64_t g = global_thread(); g < ng; g += grid_threads()) {
    size_t i0;
    const int cnt = group_span(g, n, &i0);
    float p[4], t[4];
    load4<0>(po, i0, cnt, p);
    load4<0>(theta, i0, cnt, t);
    for (int j = 0; j < cnt; j++) p[j] = sg_elem_outer_delta(p[j], t[j]);
    store4<0>(d, i0, cnt, p);
  }
}

// The Nesterov step of po and m from the replicas' sum dsum; theta takes the new po.
__global__ void outer_step_kernel(float *po, float *m, float *theta, const float *dsum, size_t n,
                                  float nrep, float lr, float mu) {
  const uint64_t ng = groups_of(n);
  for (uint64_t g = global_thread(); g < ng; g += grid_threads()) {
    size_t i0;
    const int cnt = group_span(g, n, &i0);
    float p[4], mm[4], s[4];
    load4<0>(po, i0, cnt, p);
    load4<0>(m, i0, cnt, mm);
    load4<0>(dsum, i0, cnt, s);
    for (int j = 0; j < cnt; j++)
      p[j] = sg_elem_outer_nesterov(p[j], sg_elem_outer_mean(s[j], nrep), &mm[j], lr, mu);
    store4<0>(po, i0, cnt, p);
    store4<0>(m, i0, cnt, mm);
    store4<0>(theta, i0, cnt, p);
  }
}

// ---- blockwise codes (the replica codecs) --------------------------------------------------

constexpr unsigned kCodeBlock = SG_ELEM_CODE_BLOCK;  // one block of threads per code block

// One thread block per code block of n fp32 values (grid-stride over the code blocks): x = src +
// resid, the block's largest magnitude (a tree over sg_elem_code_amax: its result, NaN absorbing
// and otherwise the maximum, does not depend on the order), the scale, each value's code and
// what it missed into resid. Layout of kernels/cpu/sg_cpu_codec.c: the scales, then the codes
// (4 bits: two per byte, low nibble first; a short last block's tail zero).
template <int BITS>
__global__ void __launch_bounds__(kCodeBlock)
    code_encode_kernel(uint8_t *out, const float *src, float *resid, size_t n) {
  __shared__ float amax[kCodeBlock];
  __shared__ int codes_sh[kCodeBlock];
  const size_t nb = (n + kCodeBlock - 1) / kCodeBlock, cb = (size_t)kCodeBlock * BITS / 8;
  const float qmax = BITS == 4 ? 7.0f : 127.0f;
  uint8_t *codes = out + 4u * nb;
  const unsigned t = threadIdx.x;
  for (size_t k = blockIdx.x; k < nb; k += gridDim.x) {
    const size_t o = k * kCodeBlock, m = n - o < kCodeBlock ? n - o : kCodeBlock;
    const bool live = t < m;
    const float x = live ? src[o + t] + resid[o + t] : 0.0f;
    amax[t] = live ? sg_elem_code_amax(0.0f, x) : 0.0f;
    __syncthreads();
    for (unsigned h = kCodeBlock / 2; h > 0; h >>= 1) {
      if (t < h) amax[t] = sg_elem_code_amax(amax[t], amax[t + h]);
      __syncthreads();
    }
    const float sc = sg_elem_code_scale(amax[0], qmax);
    const int q = live ? sg_elem_code(x, sc, qmax) : 0;
    if (live) resid[o + t] = sg_elem_code_residual(x, sg_elem_decode(q, sc));
    if (BITS == 8) {
      codes[k * cb + t] = (uint8_t)(int8_t)q;
    } else {
      codes_sh[t] = q;
      __syncthreads();
      if (t < kCodeBlock / 2)
        codes[k * cb + t] = (uint8_t)(((unsigned)codes_sh[2 * t] & 0xfu) |
                                      (((unsigned)codes_sh[2 * t + 1] & 0xfu) << 4));
    }
    if (t == 0) memcpy(out + 4u * k, &sc, sizeof sc);
    __syncthreads();  // the shared arrays are the next code block's
  }
}

// dst[i] = (add ? dst[i] + : ) the decoded value i (grid-stride over the elements).
template <int BITS>
__global__ void code_decode_kernel(float *dst, const uint8_t *in, size_t n, int add) {
  const size_t nb = (n + kCodeBlock - 1) / kCodeBlock, cb = (size_t)kCodeBlock * BITS / 8;
  const uint8_t *codes = in + 4u * nb;
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) {
    const size_t k = (size_t)i / kCodeBlock, t = (size_t)i % kCodeBlock;
    float sc;
    memcpy(&sc, in + 4u * k, sizeof sc);
    int q;
    if (BITS == 8) {
      q = (int)(int8_t)codes[k * cb + t];
    } else {
      const unsigned nib = (codes[k * cb + t / 2] >> (t % 2 ? 4 : 0)) & 0xfu;
      q = nib >= 8u ? (int)nib - 16 : (int)nib;  // 4-bit two's complement
    }
    const float d = sg_elem_decode(q, sc);
    dst[i] = add ? sg_elem_accumulate(dst[i], d) : d;
  }
}

// ---- the step's outcome ------------------------------------------------------------------

// One thread: the step's factor, norm and skip from the summed partials (sg_elem_step_outcome,
// the host's function), into device memory for AdamW and, where host_out is given, into pinned
// host memory, which the host reads without a wait: seq last, after a system-scope fence, so a
// host that sees this step's seq sees the rest.
__global__ void step_outcome_kernel(const double *ss, sg_elem_step_in in, sg_elem_step_out *out,
                                    sg_elem_step_out *host_out, uint64_t seq) {
  if (global_thread() != 0) return;
  sg_elem_step_out o = sg_elem_step_outcome(ss[0], ss[1], &in);
  o.seq = seq;
  *out = o;
  if (!host_out) return;
  host_out->factor = o.factor;
  host_out->norm = o.norm;
  host_out->clip = o.clip;
  host_out->overflow = o.overflow;
  host_out->skip = o.skip;
#ifdef SG_CUDA_EMULATE
  __atomic_store_n(&host_out->seq, seq, __ATOMIC_RELEASE);
#else
  __threadfence_system();
  *(volatile uint64_t *)&host_out->seq = seq;
#endif
}

// ---- reduce_sum ----------------------------------------------------------------------------

// The source pointers travel by value in the kernel's parameters (no device table to upload
// for every bucket). Two sizes: a small one for the usual rank counts, a large one up to the
// 32 KiB parameter limit of sm_70 and later.
template <int N>
struct src_table {
  const void *p[N];
};

// Sums in source order starting from the first source (as the CPU does), fp32, one rounding to
// DT at the end. Each thread reads all its sources before writing, so dst may be a source.
template <int DT, int N>
__global__ void reduce_sum_kernel(void *dst, src_table<N> srcs, int nsrc, size_t n) {
  const uint64_t ng = groups_of(n);
  for (uint64_t g = global_thread(); g < ng; g += grid_threads()) {
    size_t i0;
    const int cnt = group_span(g, n, &i0);
    float t[4], x[4];
    load4<DT>(srcs.p[0], i0, cnt, t);
    for (int k = 1; k < nsrc; k++) {
      load4<DT>(srcs.p[k], i0, cnt, x);
      for (int j = 0; j < cnt; j++) t[j] = sg_elem_accumulate(t[j], x[j]);
    }
    store4<DT>(dst, i0, cnt, t);
  }
}

template <int N>
__global__ void reduce_sum_f64_kernel(double *dst, src_table<N> srcs, int nsrc, size_t n) {
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) {
    double t = ((const double *)srcs.p[0])[i];
    for (int k = 1; k < nsrc; k++) t = t + ((const double *)srcs.p[k])[i];
    dst[i] = t;
  }
}

// ---- sumsq -----------------------------------------------------------------------------------

// Fixed pairwise tree over a block's shared values (size a power of two).
template <int T>
__device__ __forceinline__ void tree_sum(double *s, double *c) {
  for (int w = T / 2; w > 0; w >>= 1) {
    __syncthreads();
    if ((int)threadIdx.x < w) {
      s[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + w];
      c[threadIdx.x] = c[threadIdx.x] + c[threadIdx.x + w];
    }
  }
  __syncthreads();
}

// Pass 1: chunk q (grid-stride over chunks) -> partials[2q], partials[2q+1]. Thread t sums the
// elements t, t+256, ... of the chunk in order; then the fixed tree.
template <int DT>
__global__ void __launch_bounds__(kSumsqThreads)
    sumsq_chunks_kernel(const void *x, size_t n, double *partials) {
  __shared__ double s[kSumsqThreads];
  __shared__ double c[kSumsqThreads];
  const uint64_t nchunks = ((uint64_t)n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK;
  for (uint64_t q = blockIdx.x; q < nchunks; q += gridDim.x) {
    const size_t lo = (size_t)(q * SG__CUDA_SUMSQ_CHUNK);
    const size_t hi = n - lo < SG__CUDA_SUMSQ_CHUNK ? n : lo + SG__CUDA_SUMSQ_CHUNK;
    double acc = 0.0, bad = 0.0;
    for (size_t i = lo + threadIdx.x; i < hi; i += kSumsqThreads) {
      const float f = sg_elem_load(x, DT, i);
      const double d = (double)f;
      acc = acc + d * d;
      bad = bad + (sg_elem_isfinite(f) ? 0.0 : 1.0);
    }
    s[threadIdx.x] = acc;
    c[threadIdx.x] = bad;
    tree_sum<kSumsqThreads>(s, c);
    if (threadIdx.x == 0) {
      partials[2 * q] = s[0];
      partials[2 * q + 1] = c[0];
    }
    __syncthreads();  // s and c are reused by the next chunk
  }
}

// Pass 2, one block: thread t sums partials t, t+1024, ... in order; then the fixed tree.
__global__ void __launch_bounds__(kCombineThreads)
    sumsq_combine_kernel(const double *partials, uint64_t nchunks, double *result2) {
  __shared__ double s[kCombineThreads];
  __shared__ double c[kCombineThreads];
  double acc = 0.0, bad = 0.0;
  for (uint64_t q = threadIdx.x; q < nchunks; q += kCombineThreads) {
    acc = acc + partials[2 * q];
    bad = bad + partials[2 * q + 1];
  }
  s[threadIdx.x] = acc;
  c[threadIdx.x] = bad;
  tree_sum<kCombineThreads>(s, c);
  if (threadIdx.x == 0) {
    result2[0] = s[0];
    result2[1] = c[0];
  }
}

// ---- AdamW -----------------------------------------------------------------------------------

// One segment in the device table: `start` is its first group in the concatenated work.
struct seg_entry {
  uint64_t start;
  uint64_t shard_off;
  uint64_t flat_off;
  uint64_t len;
  uint64_t sr_index;
  uint32_t decay;
  uint32_t group;  // parameter group (read only when the call has more than one group)
};

// Everything the kernel reads besides the table, by value.
struct adamw_params {
  void *param;
  float *master;
  float *m;
  float *v;
  const void *grad;
  // k[g][0]: group g with decay; k[g][1]: without (decay_factor 1.0f: p * 1.0f == p, as torch
  // skips the mul_). Only groups below ngroups are filled.
  sg_elem_adamw_k k[SG_MAX_GROUPS][2];
  int ngroups;  // 1: every segment uses k[0] whatever its group
  float grad_scale;
  const sg_elem_step_out *outcome;  // NULL, or the step's factor and skip (step_outcome_kernel)
  int sr;  // stochastic rounding (bf16 params only)
  uint64_t seed;
  uint64_t step;
};

// The last segment whose first group is <= g (segments of length 0 share their start with the
// next one and are skipped by taking the last).
__device__ __forceinline__ int find_segment(const seg_entry *tab, int nsegs, uint64_t g) {
  int lo = 0, hi = nsegs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tab[mid].start <= g)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <int PDT, int GDT>
__global__ void adamw_kernel(const seg_entry *tab, int nsegs, uint64_t work, adamw_params a) {
  // The step's outcome, written by the step kernel earlier on this stream: no host wait. Into a
  // local, not into `a`: a written parameter struct is copied to local memory, and pointers read
  // from that copy lose their global address space (generic LD.E instead of LDG.E.128).
  float grad_scale = a.grad_scale;
  if (a.outcome) {
    if (a.outcome->skip) return;
    grad_scale = a.outcome->factor;
  }
  for (uint64_t g = global_thread(); g < work; g += grid_threads()) {
    const seg_entry s = tab[find_segment(tab, nsegs, g)];
    const size_t i0 = (size_t)((g - s.start) * 4u);
    const size_t left = (size_t)s.len - i0;
    const int cnt = left < 4 ? (int)left : 4;
    const size_t so = (size_t)s.shard_off + i0, fo = (size_t)s.flat_off + i0;
    float gr[4], p[4], m[4], v[4];
    load4<GDT>(a.grad, so, cnt, gr);
    if (a.master)
      load4<0>(a.master, so, cnt, p);
    else
      load4<PDT>(a.param, fo, cnt, p);
    load4<0>(a.m, so, cnt, m);
    load4<0>(a.v, so, cnt, v);
    const sg_elem_adamw_k k = a.k[a.ngroups > 1 ? s.group : 0u][s.decay ? 0 : 1];
    for (int j = 0; j < cnt; j++) p[j] = sg_elem_adamw(p[j], gr[j] * grad_scale, &m[j], &v[j], k);
    store4<0>(a.m, so, cnt, m);
    store4<0>(a.v, so, cnt, v);
    if (a.master) store4<0>(a.master, so, cnt, p);
    if (PDT == 1 && a.sr) {
      uint16_t h[4] = {0, 0, 0, 0};
      for (int j = 0; j < cnt; j++)
        h[j] = sg_elem_f32_to_bf16_sr(p[j], sg_elem_hash64(a.seed, a.step, s.sr_index + i0 + j));
      store4_u16(a.param, fo, cnt, h);
    } else {
      store4<PDT>(a.param, fo, cnt, p);
    }
  }
}

// ---- dispatch on dtypes --------------------------------------------------------------------

template <int ADT>
void launch_accumulate(unsigned grid, cudaStream_t s, void *acc, const void *src, int sdt,
                       size_t n) {
  void (*k)(void *, const void *, size_t) = sdt == 0   ? accumulate_kernel<ADT, 0>
                                            : sdt == 1 ? accumulate_kernel<ADT, 1>
                                                       : accumulate_kernel<ADT, 2>;
  SG_LAUNCH(k, grid, kThreads, s, acc, src, n);
}

template <int DDT>
void launch_cast(unsigned grid, cudaStream_t s, void *dst, const void *src, int sdt, size_t n) {
  void (*k)(void *, const void *, size_t) = sdt == 0   ? cast_kernel<DDT, 0>
                                            : sdt == 1 ? cast_kernel<DDT, 1>
                                                       : cast_kernel<DDT, 2>;
  SG_LAUNCH(k, grid, kThreads, s, dst, src, n);
}

template <int N>
int launch_reduce_sum(sg__cuda_launch L, void *dst, const void *const *srcs, int nsrc, int dtype,
                      size_t n) {
  src_table<N> t;
  for (int k = 0; k < N; k++) t.p[k] = k < nsrc ? srcs[k] : nullptr;
  cudaStream_t s = (cudaStream_t)L.stream;
  if (dtype == 3) {
    void (*k)(double *, src_table<N>, int, size_t) = reduce_sum_f64_kernel<N>;
    SG_LAUNCH(k, grid_for(n, L.max_blocks), kThreads, s, (double *)dst, t, nsrc, n);
    return launch_result();
  }
  void (*k)(void *, src_table<N>, int, size_t) = dtype == 0   ? reduce_sum_kernel<0, N>
                                                 : dtype == 1 ? reduce_sum_kernel<1, N>
                                                              : reduce_sum_kernel<2, N>;
  SG_LAUNCH(k, grid_for(groups_of(n), L.max_blocks), kThreads, s, dst, t, nsrc, n);
  return launch_result();
}

template <int PDT>
void launch_adamw(unsigned grid, cudaStream_t s, int gdt, const seg_entry *tab, int nsegs,
                  uint64_t work, const adamw_params &p) {
  void (*k)(const seg_entry *, int, uint64_t, adamw_params) = gdt == 0   ? adamw_kernel<PDT, 0>
                                                              : gdt == 1 ? adamw_kernel<PDT, 1>
                                                                         : adamw_kernel<PDT, 2>;
  SG_LAUNCH(k, grid, kThreads, s, tab, nsegs, work, p);
}

}  // namespace

// ---- launchers ---------------------------------------------------------------------------------

extern "C" int sg__cuda_accumulate(sg__cuda_launch L, void *acc, int acc_dtype, const void *src,
                                   int src_dtype, size_t n) {
  if (n == 0) return 0;
  if (!acc || !src || acc_dtype < 0 || acc_dtype > 2 || src_dtype < 0 || src_dtype > 2)
    return (int)cudaErrorInvalidValue;
  const unsigned grid = grid_for(groups_of(n), L.max_blocks);
  cudaStream_t s = (cudaStream_t)L.stream;
  if (acc_dtype == 0)
    launch_accumulate<0>(grid, s, acc, src, src_dtype, n);
  else if (acc_dtype == 1)
    launch_accumulate<1>(grid, s, acc, src, src_dtype, n);
  else  // f16 gradient slots (sg_grad_add)
    launch_accumulate<2>(grid, s, acc, src, src_dtype, n);
  return launch_result();
}

extern "C" int sg__cuda_cast(sg__cuda_launch L, void *dst, int dst_dtype, const void *src,
                             int src_dtype, size_t n) {
  if (n == 0) return 0;
  if (!dst || !src || dst_dtype < 0 || dst_dtype > 2 || src_dtype < 0 || src_dtype > 2)
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)L.stream;
  if (dst_dtype == src_dtype)  // a plain copy keeps every bit, signalling NaNs included (as CPU)
    return (int)cudaMemcpyAsync(dst, src, n * (dst_dtype == 0 ? 4u : 2u), cudaMemcpyDeviceToDevice,
                                s);
  const unsigned grid = grid_for(groups_of(n), L.max_blocks);
  switch (dst_dtype) {
    case 0: launch_cast<0>(grid, s, dst, src, src_dtype, n); break;
    case 1: launch_cast<1>(grid, s, dst, src, src_dtype, n); break;
    default: launch_cast<2>(grid, s, dst, src, src_dtype, n); break;
  }
  return launch_result();
}

extern "C" int sg__cuda_reduce_sum(sg__cuda_launch L, void *dst, const void *const *srcs, int nsrc,
                                   int dtype, size_t n) {
  if (n == 0) return 0;
  if (!dst || !srcs || nsrc < 1 || nsrc > SG__CUDA_MAX_SRCS || dtype < 0 || dtype > 3)
    return (int)cudaErrorInvalidValue;
  if (nsrc <= 32) return launch_reduce_sum<32>(L, dst, srcs, nsrc, dtype, n);
  return launch_reduce_sum<SG__CUDA_MAX_SRCS>(L, dst, srcs, nsrc, dtype, n);
}

extern "C" int sg__cuda_fill(sg__cuda_launch L, void *dst, int dtype, size_t n, double value) {
  if (n == 0) return 0;
  if (!dst || dtype < 0 || dtype > 3) return (int)cudaErrorInvalidValue;
  const unsigned grid = grid_for(n, L.max_blocks);
  cudaStream_t s = (cudaStream_t)L.stream;
  const float f = (float)value;
  if (dtype == 0) {
    void (*k)(float *, float, size_t) = fill_kernel<float>;
    SG_LAUNCH(k, grid, kThreads, s, (float *)dst, f, n);
  } else if (dtype == 3) {
    void (*k)(double *, double, size_t) = fill_kernel<double>;
    SG_LAUNCH(k, grid, kThreads, s, (double *)dst, value, n);
  } else {
    void (*k)(uint16_t *, uint16_t, size_t) = fill_kernel<uint16_t>;
    const uint16_t h = dtype == 1 ? sg_elem_f32_to_bf16(f) : sg_elem_f32_to_f16(f);
    SG_LAUNCH(k, grid, kThreads, s, (uint16_t *)dst, h, n);
  }
  return launch_result();
}

extern "C" int sg__cuda_outer_delta(sg__cuda_launch L, float *d, const float *po,
                                    const float *theta, size_t n) {
  if (n == 0) return 0;
  if (!d || !po || !theta) return (int)cudaErrorInvalidValue;
  void (*k)(float *, const float *, const float *, size_t) = outer_delta_kernel;
  SG_LAUNCH(k, grid_for(groups_of(n), L.max_blocks), kThreads, (cudaStream_t)L.stream, d, po,
            theta, n);
  return launch_result();
}

extern "C" int sg__cuda_outer_step(sg__cuda_launch L, float *po, float *m, float *theta,
                                   const float *dsum, size_t n, int nrep, float lr, float mu) {
  if (n == 0) return 0;
  if (!po || !m || !theta || !dsum || nrep < 1) return (int)cudaErrorInvalidValue;
  void (*k)(float *, float *, float *, const float *, size_t, float, float, float) =
      outer_step_kernel;
  SG_LAUNCH(k, grid_for(groups_of(n), L.max_blocks), kThreads, (cudaStream_t)L.stream, po, m,
            theta, dsum, n, (float)nrep, lr, mu);
  return launch_result();
}

extern "C" int sg__cuda_code_encode(sg__cuda_launch L, void *out, const float *src, float *resid,
                                    size_t n, int bits) {
  if (n == 0) return 0;
  if (!out || !src || !resid || (bits != 8 && bits != 4)) return (int)cudaErrorInvalidValue;
  const size_t nb = (n + kCodeBlock - 1) / kCodeBlock;
  const unsigned grid = nb < (size_t)(L.max_blocks > 0 ? L.max_blocks : 1)
                            ? (unsigned)nb
                            : (unsigned)(L.max_blocks > 0 ? L.max_blocks : 1);
  void (*k)(uint8_t *, const float *, float *, size_t) =
      bits == 8 ? code_encode_kernel<8> : code_encode_kernel<4>;
  SG_LAUNCH_SYNC(k, grid, kCodeBlock, (cudaStream_t)L.stream, (uint8_t *)out, src, resid, n);
  return launch_result();
}

extern "C" int sg__cuda_code_decode(sg__cuda_launch L, float *dst, const void *in, size_t n,
                                    int bits, int add) {
  if (n == 0) return 0;
  if (!dst || !in || (bits != 8 && bits != 4)) return (int)cudaErrorInvalidValue;
  void (*k)(float *, const uint8_t *, size_t, int) =
      bits == 8 ? code_decode_kernel<8> : code_decode_kernel<4>;
  SG_LAUNCH(k, grid_for(n, L.max_blocks), kThreads, (cudaStream_t)L.stream, dst,
            (const uint8_t *)in, n, add);
  return launch_result();
}

extern "C" int sg__cuda_step_outcome(sg__cuda_launch L, const double *ss,
                                     const struct sg_elem_step_in *in, void *out, void *host_out,
                                     uint64_t seq) {
  if (!ss || !in || !out) return (int)cudaErrorInvalidValue;
  void (*k)(const double *, sg_elem_step_in, sg_elem_step_out *, sg_elem_step_out *, uint64_t) =
      step_outcome_kernel;
  SG_LAUNCH(k, 1, 32, (cudaStream_t)L.stream, ss, *in, (sg_elem_step_out *)out,
            (sg_elem_step_out *)host_out, seq);
  return launch_result();
}

extern "C" size_t sg__cuda_sumsq_scratch_bytes(size_t n) {
  const size_t nchunks = (n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK;
  return (2 + 2 * (nchunks > 0 ? nchunks : 1)) * sizeof(double);
}

extern "C" int sg__cuda_sumsq(sg__cuda_launch L, const void *x, int dtype, size_t n, void *scratch,
                              double *result2) {
  if (!scratch || !result2 || dtype < 0 || dtype > 2 || (n > 0 && !x))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)L.stream;
  double *partials = (double *)scratch + 2;
  const uint64_t nchunks = ((uint64_t)n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK;
  if (nchunks > 0) {
    const unsigned grid = (unsigned)(nchunks < (uint64_t)(L.max_blocks > 0 ? L.max_blocks : 1)
                                         ? nchunks
                                         : (uint64_t)(L.max_blocks > 0 ? L.max_blocks : 1));
    void (*k)(const void *, size_t, double *) = dtype == 0   ? sumsq_chunks_kernel<0>
                                                : dtype == 1 ? sumsq_chunks_kernel<1>
                                                             : sumsq_chunks_kernel<2>;
    SG_LAUNCH_SYNC(k, grid, kSumsqThreads, s, x, n, partials);
    const int rc = launch_result();
    if (rc != 0) return rc;
  }
  void (*combine)(const double *, uint64_t, double *) = sumsq_combine_kernel;
  SG_LAUNCH_SYNC(combine, 1u, kCombineThreads, s, (const double *)partials, nchunks, result2);
  return launch_result();
}

extern "C" size_t sg__cuda_seg_table_bytes(int nsegs) {
  return (size_t)(nsegs > 0 ? nsegs : 1) * sizeof(seg_entry);
}

extern "C" void sg__cuda_seg_table_build(void *host_table, const sg__seg *segs, int nsegs,
                                         uint64_t *work) {
  seg_entry *t = (seg_entry *)host_table;
  uint64_t g = 0;
  for (int k = 0; k < nsegs; k++) {
    t[k].start = g;
    t[k].shard_off = segs[k].shard_off;
    t[k].flat_off = segs[k].flat_off;
    t[k].len = segs[k].len;
    t[k].sr_index = segs[k].sr_index;
    t[k].decay = segs[k].decay != 0;
    t[k].group = (uint32_t)segs[k].group;
    g += groups_of(segs[k].len);
  }
  if (work) *work = g;
}

extern "C" int sg__cuda_adamw(sg__cuda_launch L, const sg__update_args *a, const void *dev_table,
                              uint64_t work) {
  if (!a || !dev_table || a->nsegs < 1 || a->param_dtype < 0 || a->param_dtype > 2 ||
      a->grad_dtype < 0 || a->grad_dtype > 2 || !sg__update_groups_ok(a))
    return (int)cudaErrorInvalidValue;
  if (work == 0) return 0;
  adamw_params p;
  p.param = a->param;
  p.master = a->master;
  p.m = a->state[SG__ADAMW_M];
  p.v = a->state[SG__ADAMW_V];
  p.grad = a->grad;
  p.ngroups = a->ngroups > 1 ? a->ngroups : 1;
  memset(p.k, 0, sizeof p.k);
  for (int g = 0; g < p.ngroups; g++) {
    p.k[g][0] = sg__adamw_consts(a, g, 1);
    p.k[g][1] = sg__adamw_consts(a, g, 0);
  }
  p.grad_scale = a->grad_scale;
  p.outcome = a->outcome;
  p.sr = a->stochastic_rounding && a->param_dtype == 1;
  p.seed = a->seed;
  p.step = a->step;
  const unsigned grid = grid_for(work, L.max_blocks);
  cudaStream_t s = (cudaStream_t)L.stream;
  const seg_entry *tab = (const seg_entry *)dev_table;
  switch (a->param_dtype) {
    case 0: launch_adamw<0>(grid, s, a->grad_dtype, tab, a->nsegs, work, p); break;
    case 1: launch_adamw<1>(grid, s, a->grad_dtype, tab, a->nsegs, work, p); break;
    default: launch_adamw<2>(grid, s, a->grad_dtype, tab, a->nsegs, work, p); break;
  }
  return launch_result();
}

// ---- AdamW over 8-bit blockwise state (kernels/sg_elem.h, cfg.optim_state_dtype SG_Q8) --------
//
// One block of kThreads (= SG__Q8_BLOCK) threads per segment, and every segment is one state
// block's run from its start (sg_state_q8.c splits them so): thread t updates element t, the
// block's maxima of |m| and sqrt(v) come from a tree over shared memory (the maximum of a set
// does not depend on the order, and NaN is never chosen, as in the CPU loop), then each
// thread codes its element with the same random bits as the CPU reference
// (kernels/cpu/sg_cpu_q8.c).

namespace {

static_assert(kThreads == SG__Q8_BLOCK, "one thread per element of a state block");

struct adamw_q8_params {
  void *param;
  float *master;
  const void *grad;
  uint8_t *cm, *cv;   // codes of m and v, by state index
  float *sm, *sv;     // their scales, by block
  float *fm, *fv;     // fp32 blocks (tensors below the threshold), by pool index
  const uint32_t *f32;
  sg_elem_adamw_k k[SG_MAX_GROUPS][2];
  int ngroups;
  float grad_scale;
  const sg_elem_step_out *outcome;  // as adamw_params'
  int sr;
  uint64_t seed;
  uint64_t step;
};

// The maximum of the threads' bits (sg_elem_q8_max_bits: non-negative, NaN as 0).
__device__ __forceinline__ float q8_block_max(uint32_t *sh, uint32_t x) {
  sh[threadIdx.x] = x;
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    __syncthreads();
    if ((int)threadIdx.x < w) {
      const uint32_t o = sh[threadIdx.x + w];
      if (o > sh[threadIdx.x]) sh[threadIdx.x] = o;
    }
  }
  __syncthreads();
  const float r = sg_elem_u2f(sh[0]);
  __syncthreads();  // sh is written again by the next maximum
  return r;
}

template <int PDT, int GDT>
__global__ void __launch_bounds__(kThreads)
    adamw_q8_kernel(const seg_entry *tab, int nsegs, adamw_q8_params a) {
  __shared__ uint32_t sh[kThreads];
  float grad_scale = a.grad_scale;  // a local, as in adamw_kernel
  if (a.outcome) {  // uniform over the grid: every thread leaves, or none
    if (a.outcome->skip) return;
    grad_scale = a.outcome->factor;
  }
  const uint64_t key = sg_elem_q8_key(a.seed, a.step);
  for (int b = (int)blockIdx.x; b < nsegs; b += (int)gridDim.x) {
    const seg_entry s = tab[b];
    const size_t i = threadIdx.x, j = (size_t)s.shard_off / SG__Q8_BLOCK;
    const bool live = i < (size_t)s.len;
    const size_t so = (size_t)s.shard_off + i, fo = (size_t)s.flat_off + i;
    const uint32_t f = a.f32[j];  // the same for every thread of the block
    const size_t at = (size_t)f * SG__Q8_BLOCK + i;
    float m = 0.0f, v = 0.0f, sq = 0.0f;
    if (live) {
      const sg_elem_adamw_k k = a.k[a.ngroups > 1 ? s.group : 0u][s.decay ? 0 : 1];
      const float g = sg_elem_load(a.grad, GDT, so) * grad_scale;
      float p = a.master ? a.master[so] : sg_elem_load(a.param, PDT, fo);
      if (f != SG__Q8_CODED) {  // fp32 state: torch's element, as sg_cpu_q8.c's f32_block
        m = a.fm[at];
        v = a.fv[at];
        p = sg_elem_adamw(p, g, &m, &v, k);
      } else {
        m = sg_elem_q8_decode_m(a.cm[so], sg_elem_q8_unit(a.sm[j], SG_ELEM_Q8_M_BITS));
        v = sg_elem_q8_decode_v(a.cv[so], sg_elem_q8_unit(a.sv[j], SG_ELEM_Q8_V_BITS));
        p = sg_elem_adamw_q8(p, g, &m, &v, &sq, k);
      }
      if (a.master) a.master[so] = p;
      if (PDT == 1 && a.sr)
        ((uint16_t *)a.param)[fo] =
            sg_elem_f32_to_bf16_sr(p, sg_elem_hash64(a.seed, a.step, s.sr_index + i));
      else
        sg_elem_store(a.param, PDT, fo, p);
      if (f != SG__Q8_CODED) {
        a.fm[at] = m;
        a.fv[at] = v;
      }
    }
    if (f != SG__Q8_CODED) continue;  // uniform: the whole block leaves or stays
    const float am = q8_block_max(sh, live ? sg_elem_q8_max_bits(m) : 0u);
    const float av = q8_block_max(sh, live ? sg_elem_q8_max_bits(sq) : 0u);
    if (live) {
      const uint32_t r = sg_elem_q8_rnd(key, s.sr_index + i);
      a.cm[so] = (uint8_t)sg_elem_q8_encode_m(m, sg_elem_q8_ratio(am, SG_ELEM_Q8_M_BITS),
                                              sg_elem_q8_rnd_m(r));
      a.cv[so] = (uint8_t)sg_elem_q8_encode_v(sq, sg_elem_q8_ratio(av, SG_ELEM_Q8_V_BITS),
                                              sg_elem_q8_rnd_v(r));
    }
    if (i == 0) {  // every thread read the old scales before the maxima's barriers
      a.sm[j] = am;
      a.sv[j] = av;
    }
  }
}

template <int PDT>
void launch_adamw_q8(unsigned grid, cudaStream_t s, int gdt, const seg_entry *tab, int nsegs,
                     const adamw_q8_params &p) {
  void (*k)(const seg_entry *, int, adamw_q8_params) = gdt == 0   ? adamw_q8_kernel<PDT, 0>
                                                       : gdt == 1 ? adamw_q8_kernel<PDT, 1>
                                                                  : adamw_q8_kernel<PDT, 2>;
  SG_LAUNCH_SYNC(k, grid, kThreads, s, tab, nsegs, p);
}

}  // namespace

extern "C" int sg__cuda_adamw_q8(sg__cuda_launch L, const sg__update_args *a,
                                 const void *dev_table, uint64_t work) {
  if (!a || !dev_table || a->nsegs < 1 || a->param_dtype < 0 || a->param_dtype > 2 ||
      a->grad_dtype < 0 || a->grad_dtype > 2 || !sg__update_groups_ok(a) || !a->q8_f32 ||
      !a->q8_code[SG__ADAMW_M] || !a->q8_code[SG__ADAMW_V] || !a->q8_scale[SG__ADAMW_M] ||
      !a->q8_scale[SG__ADAMW_V] || !a->state[SG__ADAMW_M] || !a->state[SG__ADAMW_V])
    return (int)cudaErrorInvalidValue;
  if (work == 0) return 0;
  adamw_q8_params p;
  memset(&p, 0, sizeof p);
  p.param = a->param;
  p.master = a->master;
  p.grad = a->grad;
  p.cm = a->q8_code[SG__ADAMW_M];
  p.cv = a->q8_code[SG__ADAMW_V];
  p.sm = a->q8_scale[SG__ADAMW_M];
  p.sv = a->q8_scale[SG__ADAMW_V];
  p.fm = a->state[SG__ADAMW_M];
  p.fv = a->state[SG__ADAMW_V];
  p.f32 = a->q8_f32;
  p.ngroups = a->ngroups > 1 ? a->ngroups : 1;
  for (int g = 0; g < p.ngroups; g++) {
    p.k[g][0] = sg__adamw_consts(a, g, 1);
    p.k[g][1] = sg__adamw_consts(a, g, 0);
  }
  p.grad_scale = a->grad_scale;
  p.outcome = a->outcome;
  p.sr = a->stochastic_rounding && a->param_dtype == 1;
  p.seed = a->seed;
  p.step = a->step;
  const int cap = L.max_blocks > 0 ? L.max_blocks : 1;
  const unsigned grid = (unsigned)(a->nsegs < cap ? a->nsegs : cap);
  cudaStream_t s = (cudaStream_t)L.stream;
  const seg_entry *tab = (const seg_entry *)dev_table;
  switch (a->param_dtype) {
    case 0: launch_adamw_q8<0>(grid, s, a->grad_dtype, tab, a->nsegs, p); break;
    case 1: launch_adamw_q8<1>(grid, s, a->grad_dtype, tab, a->nsegs, p); break;
    default: launch_adamw_q8<2>(grid, s, a->grad_dtype, tab, a->nsegs, p); break;
  }
  return launch_result();
}
