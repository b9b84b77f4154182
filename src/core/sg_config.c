/* sg_config: defaults, versioned copy (struct_size) and validation. */
#include <math.h>   /* isfinite */
#include <stddef.h> /* offsetof */
#include <string.h> /* memcpy, memset */

#include "sg_core.h" /* sg__config_copy, sg__config_check, sg__err */

/* The first published layout. Fields are only appended, so a caller compiled against an older
 * header passes a smaller struct_size; the bytes it does not cover take the defaults.
 * overlap_param_gather (0.2) took the tail padding after timeout_ms, so 0.1 callers pass this
 * same size, and the padding that sg_config_init zeroed reads as its default 0. */
#define SG__CONFIG_V1_SIZE sizeof(sg_config)

static int sg__config_size_ok(size_t n) {
  return n >= SG__CONFIG_V1_SIZE && n <= sizeof(sg_config);
}

static void sg__config_defaults(sg_config *c) {
  memset(c, 0, sizeof *c); /* padding too: configs are hashed and compared bytewise */
  c->struct_size = sizeof *c;
  c->strategy = SG_SHARD_GRAD_OP;
  c->device = SG_DEVICE_CPU;
  c->cuda_device = -1;
  c->param_dtype = SG_F32;
  c->grad_dtype = SG_DTYPE_AUTO;
  c->reduce_dtype = SG_DTYPE_AUTO;
  c->accum_dtype = SG_F32;
  c->bucket_bytes = (size_t)32 << 20;
  c->staging_buckets = 2;
  c->lr = 1e-3f;
  c->beta1 = 0.9f;
  c->beta2 = 0.999f;
  c->eps = 1e-8f;
  c->weight_decay = 0.01f;
  c->max_grad_norm = 0.0f;
  c->grad_average = 1;
  c->loss_scale = 0.0f;
  c->init_loss_scale = 65536.0f;
  c->scale_window = 2000;
  c->min_loss_scale = 1.0f;
  c->skip_nonfinite = 1;
  c->stochastic_rounding = 0;
  c->seed = 0;
  c->timeout_ms = 600000;
  c->overlap_param_gather = 0;
}

sg_status sg_config_init(sg_config *cfg, size_t struct_size) {
  if (!cfg) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_config_init: cfg is NULL");
  if (!sg__config_size_ok(struct_size))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "sg_config_init: struct_size must be in [%zu, %zu] (got %zu)",
                   (size_t)SG__CONFIG_V1_SIZE, sizeof(sg_config), struct_size);
  sg_config d;
  sg__config_defaults(&d);
  d.struct_size = struct_size;
  memcpy(cfg, &d, struct_size); /* never write past what the caller owns */
  return SG_OK;
}

sg_status sg__config_copy(const sg_config *in, sg_config *out, const char *fn) {
  if (!fn) fn = "sg__config_copy";
  if (!in) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: output config is NULL", fn);
  if (!sg__config_size_ok(in->struct_size))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->struct_size must be in [%zu, %zu] (got %zu); "
                   "fill it with sg_config_init(&cfg, sizeof cfg)",
                   fn, (size_t)SG__CONFIG_V1_SIZE, sizeof(sg_config), in->struct_size);
  sg_config c;
  sg__config_defaults(&c);
  memcpy(&c, in, in->struct_size);
  c.struct_size = sizeof c;
  /* AUTO resolves here, so that every later check, hash and comparison sees real dtypes. */
  if (c.grad_dtype == SG_DTYPE_AUTO) c.grad_dtype = c.param_dtype;
  if (c.reduce_dtype == SG_DTYPE_AUTO) c.reduce_dtype = c.grad_dtype;
  *out = c;
  return SG_OK;
}

/* Float range checks; NaN fails every comparison, so "!(x >= lo)" also rejects it. */
static sg_status sg__check_min(const char *fn, const char *field, float v, float lo, int strict) {
  int ok = isfinite(v) && (strict ? v > lo : v >= lo);
  if (ok) return SG_OK;
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->%s must be finite and %s %g (got %g)", fn,
                 field, strict ? ">" : ">=", (double)lo, (double)v);
}

static sg_status sg__check_beta(const char *fn, const char *field, float v) {
  if (v >= 0.0f && v < 1.0f) return SG_OK;
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->%s must be in [0, 1) (got %g)", fn, field,
                 (double)v);
}

static sg_status sg__check_bool(const char *fn, const char *field, int v) {
  if (v == 0 || v == 1) return SG_OK;
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->%s must be 0 or 1 (got %d)", fn, field, v);
}

static sg_status sg__check_dtype(const char *fn, const char *field, int v) {
  if (sg__dtype_valid(v)) return SG_OK;
  return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->%s must be SG_F32, SG_BF16 or SG_F16 (got %d)",
                 fn, field, v);
}

static sg_status sg__config_check_enums(const sg_config *c, const char *fn) {
  if (c->strategy != SG_NO_SHARD && c->strategy != SG_SHARD_OPT && c->strategy != SG_SHARD_GRAD_OP)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->strategy must be SG_NO_SHARD, SG_SHARD_OPT or SG_SHARD_GRAD_OP "
                   "(got %d)",
                   fn, (int)c->strategy);
  if (c->device != SG_DEVICE_CPU && c->device != SG_DEVICE_CUDA)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->device must be SG_DEVICE_CPU or SG_DEVICE_CUDA (got %d)", fn,
                   (int)c->device);
  if (c->cuda_device < -1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->cuda_device must be >= -1 (got %d)", fn,
                   c->cuda_device);
  SG_TRY(sg__check_dtype(fn, "param_dtype", (int)c->param_dtype));
  if (c->grad_dtype != SG_DTYPE_AUTO) SG_TRY(sg__check_dtype(fn, "grad_dtype", (int)c->grad_dtype));
  if (c->reduce_dtype != SG_DTYPE_AUTO)
    SG_TRY(sg__check_dtype(fn, "reduce_dtype", (int)c->reduce_dtype));
  if (c->accum_dtype != SG_F32 && c->accum_dtype != SG_BF16)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->accum_dtype must be SG_F32 or SG_BF16 (got %d)", fn,
                   (int)c->accum_dtype);
  return SG_OK;
}

static sg_status sg__config_check_sizes(const sg_config *c, const char *fn) {
  const sg_dtype gdt = c->grad_dtype == SG_DTYPE_AUTO ? c->param_dtype : c->grad_dtype;
  size_t min_bytes = 64 * sg__dtype_size(gdt);
  if (c->bucket_bytes < min_bytes)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->bucket_bytes must be >= %zu (64 %s elements) (got %zu)", fn, min_bytes,
                   sg__dtype_name(gdt), c->bucket_bytes);
  if (c->staging_buckets < 1 || c->staging_buckets > 64)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->staging_buckets must be in 1..64 (got %d)",
                   fn, c->staging_buckets);
  if (c->scale_window < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->scale_window must be >= 1 (got %d)", fn,
                   c->scale_window);
  return SG_OK;
}

static sg_status sg__config_check_optim(const sg_config *c, const char *fn) {
  SG_TRY(sg__check_min(fn, "lr", c->lr, 0.0f, 0));
  SG_TRY(sg__check_beta(fn, "beta1", c->beta1));
  SG_TRY(sg__check_beta(fn, "beta2", c->beta2));
  SG_TRY(sg__check_min(fn, "eps", c->eps, 0.0f, 1));
  SG_TRY(sg__check_min(fn, "weight_decay", c->weight_decay, 0.0f, 0));
  SG_TRY(sg__check_min(fn, "max_grad_norm", c->max_grad_norm, 0.0f, 0));
  SG_TRY(sg__check_bool(fn, "grad_average", c->grad_average));
  SG_TRY(sg__check_bool(fn, "skip_nonfinite", c->skip_nonfinite));
  SG_TRY(sg__check_bool(fn, "stochastic_rounding", c->stochastic_rounding));
  SG_TRY(sg__check_bool(fn, "overlap_param_gather", c->overlap_param_gather));
  return SG_OK;
}

static sg_status sg__config_check_scale(const sg_config *c, const char *fn) {
  SG_TRY(sg__check_min(fn, "loss_scale", c->loss_scale, 0.0f, 0));
  SG_TRY(sg__check_min(fn, "init_loss_scale", c->init_loss_scale, 0.0f, 1));
  SG_TRY(sg__check_min(fn, "min_loss_scale", c->min_loss_scale, 0.0f, 1));
  /* Dynamic scaling starts at init and never goes below min: the pair must be ordered. */
  if (sg__config_dynamic_scale(c) && c->min_loss_scale > c->init_loss_scale)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->min_loss_scale (%g) must be <= cfg->init_loss_scale (%g)", fn,
                   (double)c->min_loss_scale, (double)c->init_loss_scale);
  return SG_OK;
}

sg_status sg__config_check(const sg_config *c, const char *fn) {
  if (!fn) fn = "sg__config_check";
  if (!c) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
  if (!sg__config_size_ok(c->struct_size))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->struct_size must be in [%zu, %zu] (got %zu)",
                   fn, (size_t)SG__CONFIG_V1_SIZE, sizeof(sg_config), c->struct_size);
  SG_TRY(sg__config_check_enums(c, fn));
  SG_TRY(sg__config_check_sizes(c, fn));
  SG_TRY(sg__config_check_optim(c, fn));
  SG_TRY(sg__config_check_scale(c, fn));
  return SG_OK;
}

int sg__config_dynamic_scale(const sg_config *c) {
  if (!c) return 0;
  return c->loss_scale == 0.0f && (c->param_dtype == SG_F16 || c->grad_dtype == SG_F16);
}
