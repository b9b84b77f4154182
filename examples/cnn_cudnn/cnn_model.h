/* The convolutional network of examples/cnn_cudnn, its generated images, its initial values, and
 * a plain C reference of its forward and backward pass (double precision), against which
 * cnn_cudnn --check compares the cuDNN/cuBLAS one and tests/test_cnn_model.c checks finite
 * differences. No CUDA here.
 *
 * The network (NCHW, f32 parameters):
 *   x [N,1,16,16] -> conv1 3x3 pad 1 (C channels) + bias -> ReLU -> max pool 2x2
 *     -> conv2 3x3 pad 1 (2C channels) + bias -> ReLU -> max pool 2x2 -> [N, 2C*4*4]
 *     -> linear (10 classes) + bias -> softmax cross-entropy, mean over the batch.
 * Parameters, in registration order: conv1.weight [C,1,3,3], conv1.bias [C],
 * conv2.weight [2C,C,3,3], conv2.bias [2C], fc.weight [10, 2C*16], fc.bias [10].
 *
 * The data: each image shows a bright bar through the middle (shifted by up to 2 pixels) at
 * one of 10 angles, 18 degrees apart, plus Gaussian noise; the label is the angle's index. */
#ifndef CNN_MODEL_H
#define CNN_MODEL_H
#include <stddef.h> /* size_t */
#include <stdint.h> /* uint64_t */

#define CNN_IMG 16 /* input height and width */
#define CNN_CLASSES 10
#define CNN_NPARAMS 6

typedef struct cnn_dims {
  int batch; /* images per micro-batch */
  int c1;    /* conv1 output channels (conv2 has 2 * c1) */
  int c2;
  int feat;                  /* c2 * 4 * 4: the linear layer's inputs */
  size_t numel[CNN_NPARAMS]; /* per parameter */
  const char *names[CNN_NPARAMS];
} cnn_dims;

/* Shapes for `batch` images and `c1` conv1 channels (1 <= c1 <= 256); -1 when out of range. */
int cnn_dims_init(cnn_dims *d, int batch, int c1);

/* The images first..first+batch-1 of the stream of `seed`: x [batch,1,16,16], labels [batch]. */
void cnn_make_batch(const cnn_dims *d, uint64_t seed, uint64_t first, float *x, int *labels);

/* Initial values of parameter p (numel[p] floats): He-uniform convolutions, Glorot-uniform
 * linear weights, zero biases. */
void cnn_init_param(const cnn_dims *d, uint64_t seed, int p, float *out);

/* The reference pass: from params[p] (numel[p] floats each) and a batch, the mean loss, and in
 * grads[p] the gradients of scale * (mean loss). Buffers are allocated inside; -1 when out of
 * memory (else 0). */
int cnn_ref_step(const cnn_dims *d, const float *const params[CNN_NPARAMS], const float *x,
                 const int *labels, double scale, double *loss, double *const grads[CNN_NPARAMS]);

/* The mean loss alone, in double, from double parameters (for finite differences). */
int cnn_ref_loss(const cnn_dims *d, const double *const params[CNN_NPARAMS], const float *x,
                 const int *labels, double *loss);

#endif
