/* sg_config: defaults, versioned copy (struct_size and magic) and validation. */
#include <math.h>   /* isfinite */
#include <stddef.h> /* offsetof */
#include <string.h> /* memcpy, memset */

#include "sg_core.h" /* sg__config_copy, sg__config_check, sg__err */

/* Every published layout of sg_config: its sizeof (what a caller built against that header
 * passes as struct_size) and the end of its last field. The library reads a caller's fields up
 * to `end` and takes the defaults for the rest: the bytes between `end` and `size` are that
 * layout's tail padding and may hold anything (0.2's overlap_param_gather sits in 0.1's).
 * Appending fields: end the new block on an 8-byte boundary (the static assert below), add its
 * row here, and the same fields to python/shardgrad/_structs.py. */
#define SG__ROUND_UP(x, a) (((x) + (a) - 1) / (a) * (a))
#define SG__END_OF(field) (offsetof(sg_config, field) + sizeof(((sg_config *)0)->field))
typedef struct {
  const char *version;
  size_t size, end;
} sg__config_layout;
static const sg__config_layout layouts[] = {
    {"0.1", SG__ROUND_UP(SG__END_OF(timeout_ms), _Alignof(sg_config)), SG__END_OF(timeout_ms)},
    {"0.2", SG__END_OF(reserved_0_2), SG__END_OF(reserved_0_2)},
    {"0.3", SG__END_OF(reserved_0_3), SG__END_OF(reserved_0_3)},
    {"0.4", SG__END_OF(magic), SG__END_OF(magic)},
    {"0.5", SG__END_OF(reserved_0_5), SG__END_OF(reserved_0_5)},
};
#define SG__NLAYOUTS ((int)(sizeof layouts / sizeof layouts[0]))
#define SG__CONFIG_V1_SIZE (layouts[0].size)
_Static_assert(sizeof(sg_config) == SG__END_OF(reserved_0_5),
               "the newest sg_config block must end without tail padding (see layouts)");

/* The layout a caller's struct_size names; NULL for a size no release published. */
static const sg__config_layout *sg__config_layout_of(size_t n) {
  for (int k = 0; k < SG__NLAYOUTS; k++)
    if (layouts[k].size == n && n <= sizeof(sg_config)) return &layouts[k];
  return NULL;
}

static int sg__config_size_ok(size_t n) { return sg__config_layout_of(n) != NULL; }

/* What sg_config_init writes into `magic` ("SGconfig" in ASCII). struct_size tells which layout
 * a caller built against; the magic tells that its bytes came from sg_config_init (or a copy of
 * a config that did) and not from the stack: a right-sized config that was never initialised
 * would otherwise run with whatever its fields held. Layouts that end before `magic` (0.1-0.3:
 * callers built before it existed) cannot carry it and are told by struct_size alone. The value
 * stays private, so that no binding can fill a config without the library's defaults. */
#define SG__CONFIG_MAGIC UINT64_C(0x5347636f6e666967)

/* The one version check of every config the API takes: a published layout, initialised. */
static sg_status sg__config_version_ok(const sg_config *c, const char *fn) {
  if (!sg__config_size_ok(c->struct_size))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->struct_size must be the size of a published sg_config "
                   "(%zu for 0.1, %zu for this header) (got %zu); "
                   "fill it with sg_config_init(&cfg, sizeof cfg)",
                   fn, (size_t)SG__CONFIG_V1_SIZE, sizeof(sg_config), c->struct_size);
  if (c->struct_size >= SG__END_OF(magic) && c->magic != SG__CONFIG_MAGIC)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg was never initialised (cfg->magic is 0x%llx, not sg_config_init's): "
                   "call sg_config_init(&cfg, sizeof cfg) before setting its fields",
                   fn, (unsigned long long)c->magic);
  return SG_OK;
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
  c->reserved_0_2 = 0;
  c->offload_optimizer = 0;
  c->replica_reduce_dtype = SG_F32;
  c->shard_ranks = 0;
  c->reserved_0_3 = 0;
  c->replica_codec = SG_CODEC_NONE;
  c->outer_every = 0;
  c->outer_lr = 0.7;
  c->outer_momentum = 0.9;
  c->optim_state_dtype = SG_F32;
  c->optim_state_min_numel = 4096;
  c->magic = SG__CONFIG_MAGIC;
  c->outer_streaming = 0;
  c->reserved_0_5 = 0;
}

sg_status sg_config_init(sg_config *cfg, size_t struct_size) {
  if (!cfg) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_config_init: cfg is NULL");
  if (!sg__config_size_ok(struct_size))
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "sg_config_init: struct_size must be the size of a published sg_config "
                   "(%zu for 0.1, %zu for this header) (got %zu)",
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
  SG_TRY(sg__config_version_ok(in, fn));
  sg_config c;
  sg__config_defaults(&c);
  memcpy(&c, in, sg__config_layout_of(in->struct_size)->end); /* its fields, not its padding */
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
  if (c->reserved_0_2 != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->reserved_0_2 must be 0 (got %llu)", fn,
                   (unsigned long long)c->reserved_0_2);
  return SG_OK;
}

static sg_status sg__config_check_0_3(const sg_config *c, const char *fn) {
  SG_TRY(sg__check_bool(fn, "offload_optimizer", c->offload_optimizer));
  if (c->replica_reduce_dtype != SG_F32 && c->replica_reduce_dtype != SG_BF16)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->replica_reduce_dtype must be SG_F32 or SG_BF16 (got %d)", fn,
                   (int)c->replica_reduce_dtype);
  if (c->shard_ranks < 0 || c->shard_ranks > 4096)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->shard_ranks must be in 0..4096 (got %d)",
                   fn, c->shard_ranks);
  if (c->reserved_0_3 != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->reserved_0_3 must be 0 (got %d)", fn,
                   c->reserved_0_3);
  return SG_OK;
}

static sg_status sg__config_check_0_4(const sg_config *c, const char *fn) {
  if (c->replica_codec != SG_CODEC_NONE && c->replica_codec != SG_CODEC_INT8 &&
      c->replica_codec != SG_CODEC_INT4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->replica_codec must be SG_CODEC_NONE, "
                   "SG_CODEC_INT8 or SG_CODEC_INT4 (got %d)", fn, (int)c->replica_codec);
  if (c->replica_codec != SG_CODEC_NONE && c->accum_dtype != SG_F32)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->replica_codec needs cfg->accum_dtype "
                   "SG_F32 (its residuals and sums are fp32)", fn);
  if (c->outer_every < 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_every must be >= 1 (the inner steps "
                   "between outer steps), or 0 for none (got %d)", fn, c->outer_every);
  if (!(isfinite(c->outer_lr) && c->outer_lr > 0))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_lr must be finite and > 0 (got %g)",
                   fn, c->outer_lr);
  if (!(c->outer_momentum >= 0 && c->outer_momentum < 1))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_momentum must be in [0, 1) (got %g)",
                   fn, c->outer_momentum);
  if (c->outer_every > 0 && c->replica_codec == SG_CODEC_INT4)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: cfg->outer_every with cfg->replica_codec "
                   "SG_CODEC_INT4: the outer steps' pseudo-gradient takes the int8 codec only "
                   "(SG_CODEC_INT8)", fn);
  if (c->optim_state_dtype != SG_F32 && c->optim_state_dtype != SG_Q8)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->optim_state_dtype must be SG_F32 or SG_Q8 (got %d)", fn,
                   (int)c->optim_state_dtype);
  if (c->optim_state_min_numel < 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->optim_state_min_numel must be >= 0 (got %d)",
                   fn, c->optim_state_min_numel);
  return SG_OK;
}

static sg_status sg__config_check_0_5(const sg_config *c, const char *fn) {
  if (c->outer_streaming != 0 && c->outer_streaming != 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_streaming must be 0 or 1 (got %d)",
                   fn, c->outer_streaming);
  if (c->outer_streaming && c->outer_every < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_streaming needs outer steps "
                   "(cfg->outer_every = H >= 1: the period its groups are spread over)", fn);
  if (c->reserved_0_5 != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->reserved_0_5 must be 0 (got %d)", fn,
                   c->reserved_0_5);
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
  SG_TRY(sg__config_version_ok(c, fn));
  SG_TRY(sg__config_check_enums(c, fn));
  SG_TRY(sg__config_check_sizes(c, fn));
  SG_TRY(sg__config_check_optim(c, fn));
  SG_TRY(sg__config_check_scale(c, fn));
  SG_TRY(sg__config_check_0_3(c, fn));
  SG_TRY(sg__config_check_0_4(c, fn));
  SG_TRY(sg__config_check_0_5(c, fn));
  return SG_OK;
}

int sg__config_dynamic_scale(const sg_config *c) {
  if (!c) return 0;
  return c->loss_scale == 0.0f && (c->param_dtype == SG_F16 || c->grad_dtype == SG_F16);
}

/* ---------------------------------------------------------------------------------------- */
/* config words                                                                              */

typedef enum { SG__W_INT, SG__W_FLOAT, SG__W_SIZE, SG__W_U64 } sg__word_kind;
typedef struct {
  const char *name;
  sg__word_kind kind;
  size_t off;
} sg__config_word;

#define SG__W(field, kind) {#field, kind, offsetof(sg_config, field)}
/* Order is part of the checkpoint format (the first SG__CONFIG_CK_WORDS are recorded): only
 * append. */
static const sg__config_word words[] = {
    SG__W(strategy, SG__W_INT),         SG__W(device, SG__W_INT),
    SG__W(param_dtype, SG__W_INT),      SG__W(grad_dtype, SG__W_INT),
    SG__W(reduce_dtype, SG__W_INT),     SG__W(accum_dtype, SG__W_INT),
    SG__W(bucket_bytes, SG__W_SIZE),    SG__W(lr, SG__W_FLOAT),
    SG__W(beta1, SG__W_FLOAT),          SG__W(beta2, SG__W_FLOAT),
    SG__W(eps, SG__W_FLOAT),            SG__W(weight_decay, SG__W_FLOAT),
    SG__W(max_grad_norm, SG__W_FLOAT),  SG__W(grad_average, SG__W_INT),
    SG__W(loss_scale, SG__W_FLOAT),     SG__W(init_loss_scale, SG__W_FLOAT),
    SG__W(scale_window, SG__W_INT),     SG__W(min_loss_scale, SG__W_FLOAT),
    SG__W(skip_nonfinite, SG__W_INT),   SG__W(stochastic_rounding, SG__W_INT),
    SG__W(seed, SG__W_U64),             SG__W(optim_state_dtype, SG__W_INT),
    SG__W(optim_state_min_numel, SG__W_INT),
};
_Static_assert(sizeof words / sizeof words[0] == SG__CONFIG_NWORDS, "SG__CONFIG_NWORDS");
_Static_assert(SG__CONFIG_CK_WORDS <= SG__CONFIG_NWORDS, "SG__CONFIG_CK_WORDS");
_Static_assert(sizeof(sg_strategy) == sizeof(int) && sizeof(sg_dtype) == sizeof(int) &&
                   sizeof(sg_device) == sizeof(int),
               "enum config fields are read as int");

static uint64_t word_of(const sg_config *c, const sg__config_word *w) {
  const char *p = (const char *)c + w->off;
  int i;
  uint32_t f;
  size_t z;
  uint64_t u;
  switch (w->kind) {
  case SG__W_INT: memcpy(&i, p, sizeof i); return (uint64_t)(int64_t)i;
  case SG__W_FLOAT: memcpy(&f, p, sizeof f); return f; /* the bits */
  case SG__W_SIZE: memcpy(&z, p, sizeof z); return (uint64_t)z;
  default: memcpy(&u, p, sizeof u); return u;
  }
}

void sg__config_words(const sg_config *c, uint64_t *w, int n) {
  for (int k = 0; k < n && k < SG__CONFIG_NWORDS; k++) w[k] = word_of(c, &words[k]);
}

const char *sg__config_word_name(int k) {
  return k >= 0 && k < SG__CONFIG_NWORDS ? words[k].name : "?";
}
