/* CPU loops over the element math of kernels/sg_elem.h.
 *
 * Shape of every loop: the dtype is chosen once per call (or per tile), and the inner loop is
 * a plain indexed loop over restrict pointers that gcc vectorizes. Conversions between dtypes
 * go through a small fp32 tile that stays in L1. Large calls are split across OpenMP threads
 * (sg__cpu_threads: OMP_NUM_THREADS capped by the affinity mask); each element's result depends
 * only on its own inputs, and the reductions (sumsq, sumsq_gpu) sum fixed blocks and combine
 * them in block order, so no result depends on the thread count or on which thread took which
 * block (AdamW and sumsq_gpu hand blocks out dynamically, so that a preempted thread on a busy
 * host delays nobody). */
/* Build note: gcc vectorizes the AdamW loop only with -fno-math-errno (otherwise every sqrtf
 * may be a libm call that sets errno), and the flag must come after any -fno-fast-math, which
 * turns errno back on. It changes no result: the sqrt instruction is correctly rounded either
 * way and the library never reads errno. It is not fast-math. Measured (bench/adamw, 64M
 * params, 2 threads): 0.65 of the STREAM triad without it, 1.5 with it. A pragma or function
 * attribute does not do it in gcc 12; it has to be on the command line. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "sg_cpu_kernels.h"

#include <stdlib.h> /* malloc, free: sumsq_gpu partials */
#include <string.h> /* memcpy, memset */
#if defined(__SSE2__)
#include <emmintrin.h> /* _mm_stream_ps, _mm_sfence */
#endif
#ifdef __linux__
#include <sched.h> /* sched_getaffinity */
#endif

#include "../cuda/sg_cuda_kernels.h" /* SG__CUDA_SUMSQ_CHUNK: the partition sumsq_gpu copies */
#include "../sg_adamw_args.h"        /* AdamW's states, scalars and element constants */
#include "../sg_elem.h"              /* element math and conversions */

/* OpenMP threads only for large calls (a parallel region costs a few microseconds). TSan does
 * not see libgomp's internal synchronisation, so sanitizer builds run the loops on one thread
 * rather than report races that are not there. */
#if defined(__SANITIZE_THREAD__)
#define SG_CPU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) /* clang spells it this way */
#define SG_CPU_TSAN 1
#endif
#endif
#if defined(_OPENMP) && !defined(SG_CPU_TSAN)
#include <omp.h>
#include <pthread.h>     /* pthread_atfork, pthread_once: fork safety */
#include <stdatomic.h>   /* the forked mark */
#define SG_CPU_OMP 1
#endif
#define SG_CPU_PAR_MIN ((size_t)65536)
#define SG_CPU_TILE ((size_t)2048)        /* fp32 tile of the conversion loops: 8 KiB */
#define SG_CPU_SUMSQ_BLOCK ((size_t)16384) /* fixed partition of sumsq */
#define SG_CPU_SUMSQ_GROUP 256            /* blocks whose partials are held at once */
#define SG_CPU_LANES 8                    /* independent accumulators inside a sumsq block */
/* sumsq_gpu: the CUDA kernel's block sizes (kSumsqThreads, kCombineThreads of
 * kernels/cuda/sg_cuda_kernels.cu); tests/test_host_step.c checks the bits on the mock. */
#define SG_CPU_GPU_LANES 256
#define SG_CPU_GPU_COMBINE 1024
#define SG_CPU_GPU_GROUP 256            /* chunks whose partials are held on the stack */
#define SG_CPU_GPU_GROUP_MAX ((size_t)1 << 16) /* ... or on the heap (512 Mi elements) */
/* Folds from this many elements on stream their first (write-only) fp32 results past the
 * caches: such an accumulator is read again only at the step, after the rest of the backward
 * pass went through the caches; a smaller one may still be there. */
#define SG_CPU_STREAM_MIN ((size_t)1 << 20)
#define SG_CPU_ADAMW_BLOCK ((size_t)16384) /* elements an AdamW thread takes at a time */

/* Threads of a parallel loop over n elements: 1 below SG_CPU_PAR_MIN, else sg__cpu_threads(). */
#define SG_CPU_NT(n) ((n) >= SG_CPU_PAR_MIN ? sg__cpu_threads() : 1)

/* The hot loops are compiled three times, for AVX-512 (x86-64-v4), AVX2 (v3) and the baseline,
 * and the loader picks the widest the CPU has (an ifunc). Same bits from each: every vector
 * instruction used rounds as IEEE says (add, mul, div, sqrt), lanes keep their order, and
 * -ffp-contract=off keeps FMA out even where the ISA has it. Fewer instructions per element
 * matter when the cores are shared (measured on 2 busy cores, 16M parameters: AdamW 1.9x and
 * sumsq 2.6x faster than SSE2). */
/* Not in sanitizer builds: the loader runs an ifunc's resolver before the sanitizer runtime is
 * set up, and an instrumented resolver crashes there (gcc's TSan: SIGSEGV before main). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__gnu_linux__) && \
    !defined(SG_CPU_TSAN) && !defined(__SANITIZE_ADDRESS__)
#define SG_CPU_HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SG_CPU_HOT
#endif

#if defined(__GNUC__)
#define SG_CPU_INLINE static inline __attribute__((always_inline))
#else
#define SG_CPU_INLINE static inline
#endif

/* ---- threads ----------------------------------------------------------------------------- */

#ifdef SG_CPU_OMP
/* Fork safety. libgomp's worker threads are not copied by fork(), but its pool records them,
 * so a forked child's first parallel region waits for them forever (a child that saves a
 * checkpoint, a multiprocessing or DataLoader worker). A child handler marks the process, and
 * from then on every loop runs on the calling thread alone (the `if (nt > 1)` of each region:
 * a region with one thread never touches the pool). Same bits: no result depends on the thread
 * count. Registered when the library is loaded, and again (once) at the first loop, for
 * toolchains without constructors. */
static atomic_int g_forked;
static pthread_once_t g_fork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) { atomic_store_explicit(&g_forked, 1, memory_order_relaxed); }
static void register_fork_handler(void) { (void)pthread_atfork(NULL, NULL, on_fork_child); }
#if defined(__GNUC__)
__attribute__((constructor)) static void fork_handler_at_load(void) {
  pthread_once(&g_fork_once, register_fork_handler);
}
#endif
#endif

/* OpenMP's own count (OMP_NUM_THREADS, omp_set_num_threads, or the CPUs it saw at start-up),
 * capped by the CPUs the calling thread may run on now: a launcher (mpirun, taskset, a
 * framework) may narrow the mask after OpenMP started, and a memory-bound loop split over
 * more threads than CPUs only waits for its slowest share. 1 in a forked child (above). */
int sg__cpu_threads(void) {
#ifdef SG_CPU_OMP
  pthread_once(&g_fork_once, register_fork_handler);
  if (atomic_load_explicit(&g_forked, memory_order_relaxed)) return 1;
  int n = omp_get_max_threads();
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int allowed = CPU_COUNT(&set);
    if (allowed >= 1 && allowed < n) n = allowed;
  }
#endif
  return n < 1 ? 1 : n;
#else
  return 1;
#endif
}

/* ---- tiles: one dtype <-> fp32 ----------------------------------------------------------- */

static void load_tile(float *restrict t, const void *src, int dtype, size_t off, size_t n) {
  if (dtype == 1) {
    const uint16_t *restrict s = (const uint16_t *)src + off;
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_bf16_to_f32(s[i]);
  } else if (dtype == 2) {
    const uint16_t *restrict s = (const uint16_t *)src + off;
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_f16_to_f32(s[i]);
  } else {
    memcpy(t, (const float *)src + off, n * sizeof(float));
  }
}

static void store_tile(void *dst, int dtype, size_t off, const float *restrict t, size_t n) {
  if (dtype == 1) {
    uint16_t *restrict d = (uint16_t *)dst + off;
    for (size_t i = 0; i < n; i++) d[i] = sg_elem_f32_to_bf16(t[i]);
  } else if (dtype == 2) {
    uint16_t *restrict d = (uint16_t *)dst + off;
    for (size_t i = 0; i < n; i++) d[i] = sg_elem_f32_to_f16(t[i]);
  } else {
    memcpy((float *)dst + off, t, n * sizeof(float));
  }
}

/* t[i] += src[off+i] in fp32 */
static void add_tile(float *restrict t, const void *src, int dtype, size_t off, size_t n) {
  if (dtype == 1) {
    const uint16_t *restrict s = (const uint16_t *)src + off;
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_accumulate(t[i], sg_elem_bf16_to_f32(s[i]));
  } else if (dtype == 2) {
    const uint16_t *restrict s = (const uint16_t *)src + off;
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_accumulate(t[i], sg_elem_f16_to_f32(s[i]));
  } else {
    const float *restrict s = (const float *)src + off;
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_accumulate(t[i], s[i]);
  }
}

static size_t ntiles(size_t n) { return (n + SG_CPU_TILE - 1) / SG_CPU_TILE; }
static size_t tile_len(size_t n, size_t k) {
  size_t left = n - k * SG_CPU_TILE;
  return left < SG_CPU_TILE ? left : SG_CPU_TILE;
}

/* ---- cast ---------------------------------------------------------------------------------- */

SG_CPU_HOT static void cast_tile(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n,
                      size_t k) {
  float t[SG_CPU_TILE];
  size_t off = k * SG_CPU_TILE, len = tile_len(n, k);
  load_tile(t, src, src_dtype, off, len);
  store_tile(dst, dst_dtype, off, t, len);
}

/* Large copies and fills split over the threads like the loops (one core's memcpy reaches a
 * fraction of the memory bandwidth the step's other passes get): blocks of 64 KiB. */
#define SG_CPU_BLOCK ((size_t)64 << 10)

static void copy_bytes(void *dst, const void *src, size_t bytes) {
  const size_t blocks = (bytes + SG_CPU_BLOCK - 1) / SG_CPU_BLOCK;
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(bytes / 4);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (size_t k = 0; k < blocks; k++) {
    const size_t off = k * SG_CPU_BLOCK, len = bytes - off < SG_CPU_BLOCK ? bytes - off : SG_CPU_BLOCK;
    if (src)
      memcpy((char *)dst + off, (const char *)src + off, len);
    else
      memset((char *)dst + off, 0, len);
  }
}

void sg__cpu_zero(void *dst, size_t bytes) {
  if (dst && bytes) copy_bytes(dst, NULL, bytes);
}

void sg__cpu_cast(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n) {
  if (!dst || !src || n == 0) return;
  if (dst_dtype == src_dtype) {
    copy_bytes(dst, src, n * (dst_dtype == 0 ? 4u : 2u));
    return;
  }
  const size_t tiles = ntiles(n);
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (size_t k = 0; k < tiles; k++) cast_tile(dst, dst_dtype, src, src_dtype, n, k);
}

/* ---- accumulate ------------------------------------------------------------------------- */

static void accumulate_f32_f32(float *restrict acc, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) acc[i] = sg_elem_accumulate(acc[i], src[i]);
}

SG_CPU_HOT static void accumulate_tile(void *acc, int acc_dtype, const void *src, int src_dtype, size_t n,
                            size_t k) {
  size_t off = k * SG_CPU_TILE, len = tile_len(n, k);
  if (acc_dtype == 0 && src_dtype == 0) {
    accumulate_f32_f32((float *)acc + off, (const float *)src + off, len);
    return;
  }
  float t[SG_CPU_TILE];
  load_tile(t, acc, acc_dtype, off, len);
  add_tile(t, src, src_dtype, off, len);
  store_tile(acc, acc_dtype, off, t, len);
}

void sg__cpu_accumulate(void *acc, int acc_dtype, const void *src, int src_dtype, size_t n) {
  if (!acc || !src || n == 0) return;
  const size_t tiles = ntiles(n);
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (size_t k = 0; k < tiles; k++) accumulate_tile(acc, acc_dtype, src, src_dtype, n, k);
}

/* ---- reduce_sum / reduce_add ------------------------------------------------------------- */

/* The whole tile is read from every source before dst is written, so dst may be any src. */
SG_CPU_HOT static void reduce_tile_f32(void *dst, const void *const *srcs, int nsrc, int dtype, size_t n,
                            size_t k) {
  float t[SG_CPU_TILE];
  size_t off = k * SG_CPU_TILE, len = tile_len(n, k);
  load_tile(t, srcs[0], dtype, off, len);
  for (int s = 1; s < nsrc; s++) add_tile(t, srcs[s], dtype, off, len);
  store_tile(dst, dtype, off, t, len);
}

static void reduce_tile_f64(double *dst, const void *const *srcs, int nsrc, size_t n, size_t k) {
  double t[SG_CPU_TILE];
  size_t off = k * SG_CPU_TILE, len = tile_len(n, k);
  memcpy(t, (const double *)srcs[0] + off, len * sizeof(double));
  for (int s = 1; s < nsrc; s++) {
    const double *restrict x = (const double *)srcs[s] + off;
    for (size_t i = 0; i < len; i++) t[i] = t[i] + x[i];
  }
  memcpy(dst + off, t, len * sizeof(double));
}

void sg__cpu_reduce_sum(void *dst, const void *const *srcs, int nsrc, int dtype, size_t n) {
  if (!dst || n == 0) return;
  const size_t esize = dtype == 3 ? 8u : dtype == 0 ? 4u : 2u;
  if (!srcs || nsrc <= 0) { /* the empty sum */
    memset(dst, 0, n * esize);
    return;
  }
  const size_t tiles = ntiles(n);
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (size_t k = 0; k < tiles; k++) {
    if (dtype == 3)
      reduce_tile_f64((double *)dst, srcs, nsrc, n, k);
    else
      reduce_tile_f32(dst, srcs, nsrc, dtype, n, k);
  }
}

void sg__cpu_reduce_add(void *dst, const void *src, int dtype, size_t n) {
  const void *srcs[2] = {dst, src};
  if (!dst || !src) return;
  sg__cpu_reduce_sum(dst, srcs, 2, dtype, n);
}

/* ---- reduce_fold ------------------------------------------------------------------------- */

/* t[i] rounded to dtype and widened again: what storing the sum and loading it gives */
static void round_tile(float *restrict t, int dtype, size_t n) {
  if (dtype == 1)
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_bf16_to_f32(sg_elem_f32_to_bf16(t[i]));
  else if (dtype == 2)
    for (size_t i = 0; i < n; i++) t[i] = sg_elem_f16_to_f32(sg_elem_f32_to_f16(t[i]));
}

/* acc = t rounded (first) or acc + t, for tile k */
static void fold_into(void *acc, int acc_dtype, float *restrict t, int first, size_t off,
                      size_t n) {
  if (first) {
    store_tile(acc, acc_dtype, off, t, n);
  } else if (acc_dtype == 0) {
    float *restrict a = (float *)acc + off;
    for (size_t i = 0; i < n; i++) a[i] = sg_elem_accumulate(a[i], t[i]);
  } else {
    float u[SG_CPU_TILE];
    load_tile(u, acc, acc_dtype, off, n);
    for (size_t i = 0; i < n; i++) u[i] = sg_elem_accumulate(u[i], t[i]);
    store_tile(acc, acc_dtype, off, u, n);
  }
}

/* Two f32 sources into an f32 accumulator, the shape of a two-rank reduction: no tile. */
static void fold2_f32(float *restrict acc, const float *restrict a, const float *restrict b,
                      int first, size_t n) {
  if (first)
    for (size_t i = 0; i < n; i++) acc[i] = a[i] + b[i];
  else
    for (size_t i = 0; i < n; i++) acc[i] = sg_elem_accumulate(acc[i], a[i] + b[i]);
}

SG_CPU_HOT static void fold_tile(void *acc, int acc_dtype, const void *const *srcs,
                                 const int *dtypes, int nsrc, int sum_dtype, int first, size_t n,
                                 size_t k) {
  const size_t off = k * SG_CPU_TILE, len = tile_len(n, k);
  const int d0 = dtypes ? dtypes[0] : sum_dtype, d1 = dtypes && nsrc > 1 ? dtypes[1] : sum_dtype;
  if (nsrc == 2 && acc_dtype == 0 && sum_dtype == 0 && d0 == 0 && d1 == 0) {
    fold2_f32((float *)acc + off, (const float *)srcs[0] + off, (const float *)srcs[1] + off,
              first, len);
    return;
  }
  float t[SG_CPU_TILE];
  load_tile(t, srcs[0], d0, off, len);
  for (int s = 1; s < nsrc; s++) add_tile(t, srcs[s], dtypes ? dtypes[s] : sum_dtype, off, len);
  round_tile(t, sum_dtype, len);
  fold_into(acc, acc_dtype, t, first, off, len);
}

void sg__cpu_reduce_fold(void *acc, int acc_dtype, const void *const *srcs, const int *dtypes,
                         int nsrc, int sum_dtype, size_t n, int first) {
  if (!acc || !srcs || nsrc <= 0 || n == 0) return;
  const size_t tiles = ntiles(n);
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
  for (size_t k = 0; k < tiles; k++)
    fold_tile(acc, acc_dtype, srcs, dtypes, nsrc, sum_dtype, first, n, k);
}

/* ---- sumsq --------------------------------------------------------------------------------- */

/* Lane j of the block sums elements j, j+8, j+16...; lanes are added in a fixed tree. Each
 * lane's sum is a fixed sequence of double additions, so the vectorized loop gives the same
 * bits as the scalar definition. A square of a float is exact in double. */
static double sumsq_lanes(const float *restrict x, size_t n) {
  double acc[SG_CPU_LANES] = {0};
  size_t i = 0;
  for (; i + SG_CPU_LANES <= n; i += SG_CPU_LANES)
    for (int j = 0; j < SG_CPU_LANES; j++) {
      double d = (double)x[i + j];
      acc[j] = acc[j] + d * d;
    }
  for (int j = 0; i < n; i++, j++) {
    double d = (double)x[i];
    acc[j] = acc[j] + d * d;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static double count_nonfinite(const float *restrict x, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; i++) c += !sg_elem_isfinite(x[i]);
  return (double)c;
}

/* One block. The squares of finite floats sum to a finite double, so only a block whose sum
 * is not finite can hold inf/NaN: that block is counted again (rare, and still in cache). */
SG_CPU_HOT static void sumsq_block(const void *x, int dtype, size_t n, size_t b, double *ss, double *nf) {
  size_t off = b * SG_CPU_SUMSQ_BLOCK;
  size_t len = n - off < SG_CPU_SUMSQ_BLOCK ? n - off : SG_CPU_SUMSQ_BLOCK;
  double s = 0.0, bad = 0.0;
  if (dtype == 0) {
    const float *f = (const float *)x + off;
    s = sumsq_lanes(f, len);
    if (s - s != 0.0) bad = count_nonfinite(f, len);
  } else {
    for (size_t t = 0; t < len; t += SG_CPU_TILE) {
      float tile[SG_CPU_TILE];
      size_t tl = len - t < SG_CPU_TILE ? len - t : SG_CPU_TILE;
      load_tile(tile, x, dtype, off + t, tl);
      double part = sumsq_lanes(tile, tl);
      s = s + part;
      if (part - part != 0.0) bad = bad + count_nonfinite(tile, tl);
    }
  }
  *ss = s;
  *nf = bad;
}

void sg__cpu_sumsq(const void *x, int dtype, size_t n, double *sumsq, double *nonfinite) {
  double total = 0.0, bad = 0.0;
  const size_t nb = (n + SG_CPU_SUMSQ_BLOCK - 1) / SG_CPU_SUMSQ_BLOCK;
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#endif
  for (size_t g = 0; x && g < nb; g += SG_CPU_SUMSQ_GROUP) {
    double ss[SG_CPU_SUMSQ_GROUP], nf[SG_CPU_SUMSQ_GROUP];
    const size_t ng = nb - g < SG_CPU_SUMSQ_GROUP ? nb - g : SG_CPU_SUMSQ_GROUP;
#ifdef SG_CPU_OMP
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
#endif
    for (size_t b = 0; b < ng; b++) sumsq_block(x, dtype, n, g + b, &ss[b], &nf[b]);
    for (size_t b = 0; b < ng; b++) { /* block order: the same sum for any thread count */
      total = total + ss[b];
      bad = bad + nf[b];
    }
  }
  if (sumsq) *sumsq = total;
  if (nonfinite) *nonfinite = bad;
}

/* ---- sumsq in the CUDA kernel's order ---------------------------------------------------- */

/* The CUDA kernel's fixed pairwise tree over T values: at width w, value t (< w) adds value
 * t + w, widths T/2 down to 1. In increasing t, no value is read after it changed. */
static double tree_sum(double *s, int T) {
  for (int w = T / 2; w > 0; w >>= 1)
    for (int t = 0; t < w; t++) s[t] = s[t] + s[t + w];
  return s[0];
}

/* Lane j sums the squares of x[j], x[j + 256], ... in order, as CUDA thread j of the chunk's
 * block does; n <= SG_CPU_TILE and a multiple of 256 except at the chunk's end. */
static void gpu_lanes(double *restrict lane, const float *restrict x, size_t n) {
  size_t r = 0;
  for (; r + SG_CPU_GPU_LANES <= n; r += SG_CPU_GPU_LANES)
    for (int j = 0; j < SG_CPU_GPU_LANES; j++) {
      double d = (double)x[r + (size_t)j];
      lane[j] = lane[j] + d * d;
    }
  for (size_t j = 0; r + j < n; j++) {
    double d = (double)x[r + j];
    lane[j] = lane[j] + d * d;
  }
}

/* A chunk's partial from its lanes (the fixed tree), and its non-finite count: only a chunk
 * whose sum is not finite can hold inf/NaN (as in sumsq_block), so only that chunk of x is
 * counted again (a count is an exact integer, so its order does not matter). */
static void gpu_chunk_end(double *lane, const void *x, int dtype, size_t lo, size_t len,
                          double *ss, double *nf) {
  const double s = tree_sum(lane, SG_CPU_GPU_LANES);
  double bad = 0.0;
  for (size_t t = 0; s - s != 0.0 && t < len; t += SG_CPU_TILE) {
    const size_t tl = len - t < SG_CPU_TILE ? len - t : SG_CPU_TILE;
    float tile[SG_CPU_TILE];
    load_tile(tile, x, dtype, lo + t, tl);
    bad = bad + count_nonfinite(tile, tl);
  }
  *ss = s;
  *nf = bad;
}

/* Chunk q: its partial sum, and its non-finite count. */
SG_CPU_HOT static void gpu_chunk(const void *x, int dtype, size_t n, size_t q, double *ss, double *nf) {
  const size_t lo = q * SG__CUDA_SUMSQ_CHUNK;
  const size_t len = n - lo < SG__CUDA_SUMSQ_CHUNK ? n - lo : SG__CUDA_SUMSQ_CHUNK;
  double lane[SG_CPU_GPU_LANES] = {0};
  for (size_t t = 0; t < len; t += SG_CPU_TILE) {
    const size_t tl = len - t < SG_CPU_TILE ? len - t : SG_CPU_TILE;
    float tile[SG_CPU_TILE];
    const float *f = (const float *)x + lo + t;
    if (dtype != 0) {
      load_tile(tile, x, dtype, lo + t, tl);
      f = tile;
    }
    gpu_lanes(lane, f, tl); /* SG_CPU_TILE is a multiple of the lane count: lanes stay aligned */
  }
  gpu_chunk_end(lane, x, dtype, lo, len, ss, nf);
}

/* Chunks [q0, q0 + nq): partials into ss/nf, spread over threads as they get free. */
static void gpu_chunks(const void *x, int dtype, size_t n, size_t q0, size_t nq, double *ss,
                       double *nf) {
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(nq * SG__CUDA_SUMSQ_CHUNK);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt) if (nt > 1)
#endif
  for (size_t b = 0; b < nq; b++) gpu_chunk(x, dtype, n, q0 + b, &ss[b], &nf[b]);
}

/* The combine block's thread t sums partials t, t + 1024, ... in chunk order: partials of
 * chunks [q0, q0 + nq) added into its accumulators comb. */
static void gpu_combine_add(double *comb, double *bad, const double *ss, const double *nf,
                            size_t q0, size_t nq) {
  for (size_t b = 0; b < nq; b++) {
    double *c = &comb[(q0 + b) % SG_CPU_GPU_COMBINE];
    *c = *c + ss[b];
    *bad = *bad + nf[b];
  }
}

void sg__cpu_sumsq_gpu_chunks(const void *x, int dtype, size_t n, size_t q0, size_t nq,
                              double *ss, double *nf) {
  if (x && ss && nf && nq) gpu_chunks(x, dtype, n, q0, nq, ss, nf);
}

void sg__cpu_sumsq_gpu_combine(const double *ss, const double *nf, size_t nq, double *sumsq,
                               double *nonfinite) {
  double comb[SG_CPU_GPU_COMBINE] = {0}, bad = 0.0;
  if (ss && nf) gpu_combine_add(comb, &bad, ss, nf, 0, nq);
  if (sumsq) *sumsq = tree_sum(comb, SG_CPU_GPU_COMBINE);
  if (nonfinite) *nonfinite = bad;
}

void sg__cpu_sumsq_gpu(const void *x, int dtype, size_t n, double *sumsq, double *nonfinite) {
  double comb[SG_CPU_GPU_COMBINE] = {0}, bad = 0.0;
  const size_t nq = x ? (n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK : 0;
  /* One parallel region for up to SG_CPU_GPU_GROUP_MAX chunks when the partials fit in a heap
   * block (each region's end waits for every thread); groups on the stack otherwise. */
  double stack[2 * SG_CPU_GPU_GROUP];
  size_t group = nq < SG_CPU_GPU_GROUP_MAX ? nq : SG_CPU_GPU_GROUP_MAX;
  double *part = group > SG_CPU_GPU_GROUP ? malloc(2 * group * sizeof *part) : NULL;
  if (!part) part = stack, group = SG_CPU_GPU_GROUP;
  for (size_t g = 0; g < nq; g += group) {
    const size_t ng = nq - g < group ? nq - g : group;
    gpu_chunks(x, dtype, n, g, ng, part, part + group);
    gpu_combine_add(comb, &bad, part, part + group, g, ng);
  }
  if (part != stack) free(part);
  if (sumsq) *sumsq = tree_sum(comb, SG_CPU_GPU_COMBINE);
  if (nonfinite) *nonfinite = bad;
}

/* ---- fold + sumsq partials in one pass ------------------------------------------------------ */

/* dst[0..n) = t[0..n) with non-temporal stores where the ISA has them and dst is 16-byte
 * aligned: the lines go to memory without being read first (an ordinary store of a line not in
 * cache reads it: 4 more bytes per parameter on the 6 of a bf16 gradient's first fold). The
 * caller fences before its results are read elsewhere (stream_fence). */
static void stream_tile_f32(float *dst, const float *restrict t, size_t n) {
#if defined(__SSE2__)
  if (((uintptr_t)dst & 15) == 0) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(t + i));
    for (; i < n; i++) dst[i] = t[i];
    return;
  }
#endif
  memcpy(dst, t, n * sizeof *dst);
}

static void stream_fence(void) {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/* Chunk q of acc[0..n): the cast (first) or the sum acc + src, tile by tile, and the chunk's
 * partials over the values stored (re-read while the tile is in L1 where acc rounds to bf16),
 * the lanes and tree of gpu_chunk: the bits of sg__cpu_cast/_accumulate then gpu_chunk. */
SG_CPU_HOT static void fold_chunk(void *acc, int acc_dtype, const void *src, int src_dtype,
                                  size_t n, int first, size_t q, double *ss, double *nf) {
  const size_t lo = q * SG__CUDA_SUMSQ_CHUNK;
  const size_t len = n - lo < SG__CUDA_SUMSQ_CHUNK ? n - lo : SG__CUDA_SUMSQ_CHUNK;
  const size_t es = acc_dtype == 0 ? 4u : 2u;
  double lane[SG_CPU_GPU_LANES] = {0};
  for (size_t t = 0; t < len; t += SG_CPU_TILE) {
    const size_t tl = len - t < SG_CPU_TILE ? len - t : SG_CPU_TILE, off = lo + t;
    float tile[SG_CPU_TILE];
    if (first && src_dtype == acc_dtype) { /* a copy, as sg__cpu_cast makes it: bits kept */
      memcpy((char *)acc + off * es, (const char *)src + off * es, tl * es);
      load_tile(tile, acc, acc_dtype, off, tl);
    } else if (first && acc_dtype == 0 && n >= SG_CPU_STREAM_MIN) { /* written only */
      load_tile(tile, src, src_dtype, off, tl);
      stream_tile_f32((float *)acc + off, tile, tl);
    } else {
      if (first)
        load_tile(tile, src, src_dtype, off, tl);
      else {
        load_tile(tile, acc, acc_dtype, off, tl);
        add_tile(tile, src, src_dtype, off, tl);
      }
      store_tile(acc, acc_dtype, off, tile, tl);
      if (acc_dtype != 0) load_tile(tile, acc, acc_dtype, off, tl);
    }
    gpu_lanes(lane, tile, tl);
  }
  stream_fence();
  gpu_chunk_end(lane, acc, acc_dtype, lo, len, ss, nf);
}

void sg__cpu_fold_sumsq_gpu(void *acc, int acc_dtype, const void *src, int src_dtype, size_t n,
                            int first, double *ss, double *nf) {
  if (!acc || !src || !ss || !nf || n == 0) return;
  const size_t nq = (n + SG__CUDA_SUMSQ_CHUNK - 1) / SG__CUDA_SUMSQ_CHUNK;
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(n);
#pragma omp parallel for schedule(dynamic, 4) num_threads(nt) if (nt > 1)
#endif
  for (size_t q = 0; q < nq; q++)
    fold_chunk(acc, acc_dtype, src, src_dtype, n, first, q, &ss[q], &nf[q]);
}

/* ---- AdamW --------------------------------------------------------------------------------- */

/* Everything one specialised AdamW loop needs besides the pointers. */
typedef struct adamw_ctx {
  sg_elem_adamw_k k;
  float grad_scale;
  uint64_t seed, step;
} adamw_ctx;

/* One run of n elements. Always inlined with constant dtype arguments, so each call site
 * below becomes its own loop without dtype tests inside; every branch on pdt/gdt/has_master/sr
 * folds away. The pointers are already offset to the run's first element. */
SG_CPU_INLINE void adamw_run(void *param, float *master, float *mom, float *var, const void *grad,
                             size_t n, uint64_t sr_base, adamw_ctx c, const int pdt,
                             const int gdt, const int has_master, const int sr) {
  float *restrict pf = (float *)param;
  uint16_t *restrict ph = (uint16_t *)param;
  float *restrict mst = master;
  float *restrict m = mom;
  float *restrict v = var;
  const float *restrict gf = (const float *)grad;
  const uint16_t *restrict gh = (const uint16_t *)grad;
  const sg_elem_adamw_k k = c.k;
  const float scale = c.grad_scale;
  for (size_t i = 0; i < n; i++) {
    float g = gdt == 0 ? gf[i] : gdt == 1 ? sg_elem_bf16_to_f32(gh[i]) : sg_elem_f16_to_f32(gh[i]);
    float p = has_master ? mst[i] : pf[i];
    float mi = m[i], vi = v[i];
    p = sg_elem_adamw(p, g * scale, &mi, &vi, k);
    m[i] = mi;
    v[i] = vi;
    if (has_master) mst[i] = p;
    if (pdt == 0)
      pf[i] = p;
    else if (pdt == 1 && sr)
      ph[i] = sg_elem_f32_to_bf16_sr(p, sg_elem_hash64(c.seed, c.step, sr_base + i));
    else if (pdt == 1)
      ph[i] = sg_elem_f32_to_bf16(p);
    else
      ph[i] = sg_elem_f32_to_f16(p);
  }
}

/* Picks the specialised loop for one run of a segment. The common cases (f32 or bf16 grads;
 * f32 params without master, bf16/f16 params with master) get their own loops; anything else
 * (f16 grads, f32 params with a separate master) takes the fully general one. */
SG_CPU_HOT static void adamw_span(const sg__update_args *a, size_t shard_off, size_t flat_off,
                       uint64_t sr_base, size_t n, adamw_ctx c) {
  const size_t pes = a->param_dtype == 0 ? 4u : 2u, ges = a->grad_dtype == 0 ? 4u : 2u;
  void *p = (char *)a->param + flat_off * pes;
  float *mst = a->master ? a->master + shard_off : NULL;
  float *m = a->state[SG__ADAMW_M] + shard_off, *v = a->state[SG__ADAMW_V] + shard_off;
  const void *g = (const char *)a->grad + shard_off * ges;
  const int sr = a->stochastic_rounding && a->param_dtype == 1;
  const int key = a->param_dtype * 100 + a->grad_dtype * 10 + (mst != NULL) * 2 + sr;
  switch (key) {
    case 0: adamw_run(p, mst, m, v, g, n, sr_base, c, 0, 0, 0, 0); break;    /* f32, f32 grad */
    case 10: adamw_run(p, mst, m, v, g, n, sr_base, c, 0, 1, 0, 0); break;   /* f32, bf16 grad */
    case 102: adamw_run(p, mst, m, v, g, n, sr_base, c, 1, 0, 1, 0); break;  /* bf16 */
    case 103: adamw_run(p, mst, m, v, g, n, sr_base, c, 1, 0, 1, 1); break;  /* bf16, SR */
    case 112: adamw_run(p, mst, m, v, g, n, sr_base, c, 1, 1, 1, 0); break;  /* bf16 everywhere */
    case 113: adamw_run(p, mst, m, v, g, n, sr_base, c, 1, 1, 1, 1); break;
    case 202: adamw_run(p, mst, m, v, g, n, sr_base, c, 2, 0, 1, 0); break;  /* f16 */
    case 212: adamw_run(p, mst, m, v, g, n, sr_base, c, 2, 1, 1, 0); break;
    default: {
      /* general: one element at a time through the dtype-dispatching helpers */
      for (size_t i = 0; i < n; i++) {
        float gi = sg_elem_load(g, a->grad_dtype, i) * c.grad_scale;
        float pi = mst ? mst[i] : sg_elem_load(p, a->param_dtype, i);
        pi = sg_elem_adamw(pi, gi, &m[i], &v[i], c.k);
        if (mst) mst[i] = pi;
        if (sr)
          ((uint16_t *)p)[i] =
              sg_elem_f32_to_bf16_sr(pi, sg_elem_hash64(c.seed, c.step, sr_base + i));
        else
          sg_elem_store(p, a->param_dtype, i, pi);
      }
    }
  }
}

/* Back while the cursor's segment begins after lo, then forward past the segments that end
 * at or before it: from any consistent cursor, the first segment that holds lo. */
void sg__cpu_seg_seek(const sg__seg *segs, int nsegs, size_t lo, int *s, size_t *pos) {
  while (*s > 0 && lo < *pos) *pos -= segs[--*s].len;
  while (*s < nsegs && *pos + segs[*s].len <= lo) *pos += segs[(*s)++].len;
}

/* The elements [lo, hi) of the concatenated segments, starting the segment walk at the cursor
 * (segment *s, which begins at element *pos), moved to lo first.
 * cs[2*g] is group g's context with decay, cs[2*g+1] without (decay factor 1). */
static void adamw_range(const sg__update_args *a, size_t lo, size_t hi, const adamw_ctx *cs, int *s,
                        size_t *pos) {
  sg__cpu_seg_seek(a->segs, a->nsegs, lo, s, pos);
  size_t at = *pos;
  for (int k = *s; k < a->nsegs && at < hi; k++) {
    const sg__seg *sg = &a->segs[k];
    size_t b = lo > at ? lo - at : 0;
    size_t e = hi - at < sg->len ? hi - at : sg->len;
    const int g = sg__update_group_of(a, sg);
    if (b < e)
      adamw_span(a, sg->shard_off + b, sg->flat_off + b, sg->sr_index + b, e - b,
                 cs[2 * g + (sg->decay ? 0 : 1)]);
    at += sg->len;
  }
}

void sg__cpu_adamw(const sg__update_args *a) {
  if (!a || !a->segs || a->nsegs <= 0 || !a->param || !a->state[SG__ADAMW_M] ||
      !a->state[SG__ADAMW_V] || !a->grad)
    return;
  if (!sg__update_groups_ok(a)) return;
  if (a->outcome && a->outcome->skip) return; /* the step's outcome: skipped */
  const int ng = a->ngroups > 1 ? a->ngroups : 1;
  adamw_ctx cs[2 * SG_MAX_GROUPS];
  for (int g = 0; g < ng; g++) {
    adamw_ctx c;
    c.grad_scale = a->outcome ? a->outcome->factor : a->grad_scale;
    c.seed = a->seed;
    c.step = a->step;
    c.k = sg__adamw_consts(a, g, 1);
    cs[2 * g] = c;
    c.k = sg__adamw_consts(a, g, 0);
    cs[2 * g + 1] = c;
  }
  size_t total = 0;
  for (int s = 0; s < a->nsegs; s++) total += a->segs[s].len;
  int s = 0;
  size_t pos = 0;
#ifdef SG_CPU_OMP
  const int nt = SG_CPU_NT(total);
  if (nt > 1) {
    /* One region for the whole shard, blocks handed out as threads get free: a thread that the
     * OS preempts (the host busy with other work) delays nobody. Elementwise: any schedule,
     * same bits. Each thread keeps its own segment cursor. monotonic: each thread's blocks
     * increase, so its cursor only moves forward (OpenMP 5's default for dynamic is
     * nonmonotonic, and libomp steals: a thread may get a block below its last one; the seek
     * handles that too, by walking back). */
    const size_t nb = (total + SG_CPU_ADAMW_BLOCK - 1) / SG_CPU_ADAMW_BLOCK;
#pragma omp parallel num_threads(nt) firstprivate(s, pos)
    {
#pragma omp for schedule(monotonic : dynamic, 1)
      for (size_t b = 0; b < nb; b++) {
        const size_t lo = b * SG_CPU_ADAMW_BLOCK;
        adamw_range(a, lo, total - lo < SG_CPU_ADAMW_BLOCK ? total : lo + SG_CPU_ADAMW_BLOCK, cs, &s,
                    &pos);
      }
    }
    return;
  }
#endif
  adamw_range(a, 0, total, cs, &s, &pos);
}
