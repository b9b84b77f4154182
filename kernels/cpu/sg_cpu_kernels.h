/* CPU loops over the element math of kernels/sg_elem.h. Vectorizable inner loops, OpenMP
 * across cores for large n; results do not depend on the thread count except where noted. */
#ifndef SG_CPU_KERNELS_H
#define SG_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "../sg_adamw_args.h" /* sg__update_args; sg__adamw_args and AdamW's indices */

/* dtypes are sg_dtype values (0 f32, 1 bf16, 2 f16); 3 = f64 where stated */
/* AdamW (kernels/sg_adamw_args.h: state 0 m, 1 v, and its scalars) over a->segs */
void sg__cpu_adamw(const sg__update_args *a);
/* The same over 8-bit blockwise state (a->q8_*, kernels/sg_kernel_args.h; sg_cpu_q8.c): every
 * segment one block's run from its start, m and v decoded and coded again in one pass. */
void sg__cpu_adamw_q8(const sg__update_args *a);
/* One state array of 8-bit blocks [0, nblocks) decoded into dst (nblocks * SG__Q8_BLOCK
 * floats): coded blocks from code and scale (is_m: m's signed code; else v's), fp32 blocks
 * (map[j] != SG__Q8_CODED) copied from the pool. */
void sg__cpu_q8_decode(float *dst, const uint8_t *code, const float *scale, const float *pool,
                       const uint32_t *map, size_t nblocks, int is_m);
/* The value of one element's code under its block's scale (is_m as above): what
 * sg__cpu_q8_decode gives, for a reader that holds the element but not its whole block. */
float sg__cpu_q8_value(uint8_t code, float scale, int is_m);
/* One block's n <= SG__Q8_BLOCK fp32 values x (m, or v whose square root is coded) coded as
 * the update codes its new moments: the block's maximum into *scale, the codes into code, the
 * random bits of the step's key (sg_elem_q8_key) and the elements' counters sr_index + i. */
void sg__cpu_q8_encode(const float *x, size_t n, int is_m, uint64_t key, uint64_t sr_index,
                       uint8_t *code, float *scale);
/* d[0..n) = x[0..n) rounded to bf16 with sg_elem_f32_to_bf16's bits by the CPU's conversion
 * instruction (sg_cpu_bf16hw.c): 1 if done; 0 where the CPU has none, n is not a multiple of
 * 32, or an x is subnormal (d may have been written: the caller rounds them all again). */
int sg__cpu_bf16_block_hw(uint16_t *d, const float *x, size_t n);
/* A cursor into the concatenation of segs[0..nsegs): segment *s begins at element *pos
 * (0, 0 to start). Moves it, back or forward, to the first segment holding element lo
 * (*s = nsegs, *pos = the total when lo is past the end). sg__cpu_adamw's threads each keep
 * one; their blocks may come in any order. */
void sg__cpu_seg_seek(const sg__seg *segs, int nsegs, size_t lo, int *s, size_t *pos);
/* acc[i] += src[i]; acc_dtype f32 or bf16 (fp32 math, rounded once) */
void sg__cpu_accumulate(void *acc, int acc_dtype, const void *src, int src_dtype, size_t n);
void sg__cpu_cast(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n);
/* dst[0..bytes) = 0 (threads as the loops) */
void sg__cpu_zero(void *dst, size_t bytes);
/* one pass: sum of squares in double and count of non-finite values. Deterministic: fixed
 * block partition independent of the thread count, partials combined in block order. */
void sg__cpu_sumsq(const void *x, int dtype, size_t n, double *sumsq, double *nonfinite);
/* The same two results in the order of the CUDA sumsq kernel (kernels/cuda: fixed chunks of
 * SG__CUDA_SUMSQ_CHUNK, 256 strided lanes and a pairwise tree per chunk, 1024 strided lanes
 * and a tree over the chunks): bit for bit what the CUDA device returns for the same data, so
 * that a host-side step (optimizer offload) decides and clips exactly as the device would. Also
 * independent of the thread count. */
void sg__cpu_sumsq_gpu(const void *x, int dtype, size_t n, double *sumsq, double *nonfinite);
/* The same in two halves, so that a caller can compute chunks when their data is final and
 * combine at the end: the partials of chunks [q0, q0 + nq) of x[0..n) into ss/nf[0..nq), and
 * the combination of the partials of chunks 0..nq-1 (all of an array's, in chunk order). */
void sg__cpu_sumsq_gpu_chunks(const void *x, int dtype, size_t n, size_t q0, size_t nq,
                              double *ss, double *nf);
void sg__cpu_sumsq_gpu_combine(const double *ss, const double *nf, size_t nq, double *sumsq,
                               double *nonfinite);
/* acc[0..n) = src rounded to acc_dtype (first: sg__cpu_cast's bits) or acc + src
 * (sg__cpu_accumulate's), and in the same pass the partials of acc's chunks as
 * sg__cpu_sumsq_gpu_chunks(acc, acc_dtype, n, 0, nq) would give afterwards (nq = n / chunk,
 * rounded up): the fold of a gradient that also yields its norm's share. */
void sg__cpu_fold_sumsq_gpu(void *acc, int acc_dtype, const void *src, int src_dtype, size_t n,
                            int first, double *ss, double *nf);
/* Threads of the parallel loops: OpenMP's count (OMP_NUM_THREADS, omp_set_num_threads) capped
 * by the CPUs in the calling thread's affinity mask; 1 without OpenMP and in a forked child. */
int sg__cpu_threads(void);
/* dst[i] = round(sum_k srcs[k][i]) with fp32 sums in k order (f64 dtype 3: double sums);
 * dst may alias any src */
void sg__cpu_reduce_sum(void *dst, const void *const *srcs, int nsrc, int dtype, size_t n);
/* dst[i] = round(dst[i] + src[i]) in dtype, fp32 math (f64 dtype 3: double) */
void sg__cpu_reduce_add(void *dst, const void *src, int dtype, size_t n);
/* A reduction folded straight into an accumulator, in one pass: per element the fp32 sum of
 * srcs[0..nsrc) in k order (source k in dtypes[k], f32/bf16/f16; dtypes NULL: all in
 * sum_dtype), rounded once to sum_dtype,
 * then acc = that value rounded to acc_dtype (first) or acc + it. The bits of
 * sg__cpu_reduce_sum into a buffer followed by sg__cpu_cast (first) or sg__cpu_accumulate,
 * without writing and reading that buffer. acc aliases no source. */
void sg__cpu_reduce_fold(void *acc, int acc_dtype, const void *const *srcs, const int *dtypes,
                         int nsrc, int sum_dtype, size_t n, int first);

/* Blockwise codes (kernels/cpu/sg_cpu_codec.c; bits 8 or 4): the bytes of n values encoded
 * (per block of SG_ELEM_CODE_BLOCK: a 4-byte scale and its codes, a short last block padded);
 * the encoding of src + resid into out (scales first, then the codes), resid becoming what
 * the codes missed; and the decoding of n values into dst (add: dst + them, fp32). */
size_t sg__cpu_code_bytes(size_t n, int bits);
void sg__cpu_code_encode(void *out, const float *src, float *resid, size_t n, int bits);
void sg__cpu_code_decode(float *dst, const void *in, size_t n, int bits, int add);

/* Outer steps (kernels/cpu/sg_cpu_outer.c): d = po - theta (the pseudo-gradient); and the step
 * from the replicas' sum dsum of it: d = dsum / nrep, po and m by sg_elem_outer_nesterov,
 * theta = po. */
void sg__cpu_outer_delta(float *d, const float *po, const float *theta, size_t n);
void sg__cpu_outer_step(float *po, float *m, float *theta, const float *dsum, size_t n, int nrep,
                        float lr, float mu);

#endif /* SG_CPU_KERNELS_H */
