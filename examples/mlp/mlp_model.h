/* A small multi-layer perceptron in plain C (f32 math), shared by examples/mlp/mlp.c and
 * bench/bench_step.c. The task is regression on data from a fixed random teacher network with MSE
 * loss, so that the loss has a known floor (near zero) and its decrease is easy to check.
 *
 * Parameters, in registration order: W0, b0, W1, b1, ... (Wl is dims[l+1] x dims[l], row-major;
 * bl has dims[l+1] elements). Hidden layers use tanh; the output layer is linear.
 *
 * The model part (mlp_*) knows nothing about shardgrad; the engine glue (mlp_engine_*) at the end
 * registers the parameters with an engine, reads the working parameters through sg_param_ptr
 * and writes gradients through sg_grad_ptr / sg_grad_ready in backward order. */
#ifndef MLP_MODEL_H
#define MLP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "shardgrad.h" /* sg_engine, sg_dtype */

#define MLP_IN 32             /* input features */
#define MLP_OUT 8             /* regression targets */
#define MLP_TEACHER_HIDDEN 64 /* teacher: MLP_IN -> 64 (tanh) -> MLP_OUT */
#define MLP_MAX_LAYERS 16

typedef struct mlp_model {
  int layers;                   /* linear layers, 1..MLP_MAX_LAYERS */
  int dims[MLP_MAX_LAYERS + 1]; /* dims[0] = MLP_IN, dims[layers] = MLP_OUT */
  int batch;                    /* rows per micro-batch */
  int nparams;                  /* 2 * layers */
  size_t numel[2 * MLP_MAX_LAYERS];
  size_t total_numel;
  uint64_t seed;
  float *act[MLP_MAX_LAYERS + 1]; /* act[0] = inputs, act[l+1] = output of layer l */
  float *target;                  /* batch x MLP_OUT */
  float *delta, *delta_prev;      /* batch x widest layer: dLoss/d(pre-activation) */
  float *grad;                    /* widest parameter: gradient being produced */
  float *row;                     /* widest layer: a row of it before conversion to a slot */
  float *teacher[4];              /* W1, b1, W2, b2 of the teacher */
} mlp_model;

/* Allocates the workspace for `layers` linear layers of width `hidden`; 0 on success. */
int mlp_init(mlp_model *m, int layers, int hidden, int batch, uint64_t seed);
void mlp_free(mlp_model *m);

/* Deterministic initial value of parameter p (same on every rank for the same seed). */
void mlp_init_param(const mlp_model *m, int p, float *dst);

/* Fills the inputs and targets with samples first_sample .. first_sample+batch-1 of the
 * infinite data stream (a pure function of the seed and the sample index). */
void mlp_make_batch(mlp_model *m, uint64_t first_sample);

/* Forward over the current batch with f32 parameters params[p]; returns the MSE loss
 * (mean over batch and outputs). */
float mlp_forward(mlp_model *m, float *const *params);
/* The same, calling before_layer(ctx, l) before layer l reads its parameters (non-zero: stop,
 * returning NAN): where the engine glue waits for the layer's all-gather. */
typedef int (*mlp_layer_hook)(void *ctx, int layer);
float mlp_forward_hooked(mlp_model *m, float *const *params, mlp_layer_hook before_layer,
                         void *ctx);

/* Optional: where the backward pass writes the gradient of parameter p, *dst = n elements of
 * *dtype (SG_F32, SG_BF16 or SG_F16: converted row by row as they are produced), or *dst =
 * NULL (the default) for the model's f32 buffer. Non-zero stops the backward pass. */
typedef int (*mlp_grad_slot)(void *ctx, int p, size_t n, void **dst, sg_dtype *dtype);
/* Receives the gradient of parameter p once it is complete: grad = the n floats in the model's
 * buffer (valid only during the call), or NULL when it was written to the slot. Non-zero stops
 * the backward pass and is returned by mlp_backward. */
typedef int (*mlp_grad_sink)(void *ctx, int p, const float *grad, size_t n);

/* Backward of mlp_forward's loss times `scale`, emitting gradients last layer first (b then W
 * of each layer, which is reverse registration order); slot may be NULL. Uses the same params
 * as the forward. Each weight matrix is read once per call (its gradient and the backward of
 * the layer's input in one pass), whatever the batch. */
int mlp_backward(mlp_model *m, float *const *params, float scale, mlp_grad_slot slot,
                 mlp_grad_sink sink, void *ctx);

/* All of a model's gradients in one zeroed f32 buffer (one all-reduce covers them), for loops
 * without the engine: the backward pass writes each into its place, with mlp_grads_slot and
 * mlp_grads_sink as its callbacks and the mlp_grads as ctx. */
typedef struct mlp_grads {
  float *grad;
  size_t off[2 * MLP_MAX_LAYERS]; /* offset of each parameter's gradient in grad */
} mlp_grads;
int mlp_grads_init(mlp_grads *g, const mlp_model *m); /* 0 on success */
void mlp_grads_free(mlp_grads *g);
int mlp_grads_slot(void *ctx, int p, size_t n, void **dst, sg_dtype *dtype);
int mlp_grads_sink(void *ctx, int p, const float *grad, size_t n);

/* Software dtype conversion, round-to-nearest-even. */
void mlp_to_f32(const void *src, sg_dtype dtype, float *dst, size_t n);
void mlp_from_f32(const float *src, sg_dtype dtype, void *dst, size_t n);

/* ---- engine glue ----------------------------------------------------------------------- */

typedef struct mlp_engine {
  sg_engine *e;
  mlp_model *m;
  sg_dtype param_dtype, grad_dtype;
  int ids[2 * MLP_MAX_LAYERS];
  float *view[2 * MLP_MAX_LAYERS]; /* f32 parameters used by forward/backward */
  float *conv[2 * MLP_MAX_LAYERS]; /* f32 copies when param_dtype is not f32 */
  sg_status status;                /* of the last sg_ call made while emitting gradients */
} mlp_engine;

/* The glue returns SG_OK or the status of the sg_ call that failed (sg_last_error() says why;
 * SG_ERR_OUT_OF_MEMORY also when the example's own malloc failed). */

/* Registers the parameters with `e` (biases with SG_PARAM_NO_DECAY). Before sg_finalize. */
sg_status mlp_engine_register(mlp_engine *me, mlp_model *m, sg_engine *e, const sg_config *cfg);
/* After sg_finalize: sets the initial parameters (same values on every rank). */
sg_status mlp_engine_init_params(mlp_engine *me);
/* One micro-batch: forward and backward on the current batch, gradients scaled by `scale`
 * (1/micro-batches times the loss scale) written to the engine. *loss receives the loss. */
sg_status mlp_engine_micro_batch(mlp_engine *me, float scale, float *loss);
void mlp_engine_free(mlp_engine *me);

#endif /* MLP_MODEL_H */
