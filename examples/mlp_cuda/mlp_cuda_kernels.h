/* Small CUDA kernels of examples/mlp_cuda (bias + tanh, MSE loss and its gradient, tanh'),
 * behind plain C launchers so that mlp_cuda.c stays C. Streams travel as void * (cudaStream_t);
 * each launcher returns a cudaError_t value (0 = success).
 *
 * Every f32 buffer may have a bf16 mirror ("lo"): when the model runs in bf16, the GEMMs read
 * the bf16 copies (cuBLAS wants A and B of one type) and the kernels write both. NULL: no
 * mirror. */
#ifndef MLP_CUDA_KERNELS_H
#define MLP_CUDA_KERNELS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[r][o] = act(out[r][o] + bias[o]) for rows x nout; bias is f32 (bf16 = 0) or bf16 (1);
 * act is tanh when use_tanh, else the identity. Writes out_lo (bf16) too when not NULL. */
int mlpc_bias_act(void *stream, float *out, void *out_lo, const void *bias, int bias_bf16,
                  int rows, int nout, int use_tanh);

/* delta[i] = k * (out[i] - target[i]) (and delta_lo), and loss_dst[0] = mean of squares, summed
 * in double in a fixed order by one block, so the loss does not depend on the launch. */
int mlpc_mse(void *stream, const float *out, const float *target, float *delta, void *delta_lo,
             int n, float k, float *loss_dst);

/* d[i] *= 1 - a[i]^2 (tanh' from the tanh output a); writes d_lo too when not NULL. */
int mlpc_tanh_grad(void *stream, float *d, void *d_lo, const float *a, size_t n);

/* dst[i] = bf16(src[i]) (round to nearest even). */
int mlpc_to_bf16(void *stream, void *dst, const float *src, size_t n);

/* dst[i] = value (f32, or bf16 when bf16). */
int mlpc_fill(void *stream, void *dst, int bf16, size_t n, float value);

#ifdef __cplusplus
}
#endif

#endif /* MLP_CUDA_KERNELS_H */
