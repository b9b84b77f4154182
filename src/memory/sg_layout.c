/* Memory layout and arenas (DESIGN.md section 3). The layout is computed from the plan and the
 * config alone, so sg_estimate_memory and sg_memory give the same numbers. */
#include <stdint.h>
#include <string.h>

#include "../comm/sg_comm.h" /* sg__comm_scratch_bytes */
#include "sg_memory.h"

/* The step's tiny all-reduce of (sum of squares, non-finite count) gets its own piece of the
 * comm arena: the ring all-reduce uses the scratch for its own receives. */
#define SG__SMALL_BYTES 256

#define SG__ARENA_MAX SG_MEM_ARENA_MAX

static size_t align_up(size_t x) { return (x + SG_MEM_ALIGN - 1) / SG_MEM_ALIGN * SG_MEM_ALIGN; }

static size_t mul_sat(size_t a, size_t b) { return sg__mem_mul_sat(a, b); }
static size_t sat_add(size_t a, size_t b) {
  return a > SG__ARENA_MAX || b > SG__ARENA_MAX - a ? SIZE_MAX : a + b;
}

/* Appends a piece of `bytes` to arena `kind`, returns its offset. An arena that would pass
 * SG__ARENA_MAX is marked SIZE_MAX (sg__layout_compute refuses it). */
static size_t carve(sg__layout *l, sg__mem_kind kind, size_t bytes) {
  size_t off = l->bytes[kind];
  if (off > SG__ARENA_MAX || bytes > SG__ARENA_MAX - off) {
    l->bytes[kind] = SIZE_MAX;
    return off;
  }
  l->bytes[kind] = align_up(off + bytes);
  return off;
}

static sg_status check_fits(const sg__layout *l) {
  static const char *names[SG_MEM_KINDS] = {"params", "grads", "master", "optim", "comm"};
  if (l->host_bytes > SG__ARENA_MAX)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "the model is too large: its offloaded optimizer "
                   "state exceeds %zu bytes of host memory per rank", (size_t)SG__ARENA_MAX);
  for (int k = 0; k < SG_MEM_KINDS; k++)
    if (l->bytes[k] > SG__ARENA_MAX)
      return sg__err(SG_ERR_INVALID_ARGUMENT,
                     "the model is too large: its %s memory exceeds %zu bytes per rank", names[k],
                     (size_t)SG__ARENA_MAX);
  return SG_OK;
}

/* 8-bit state in host memory (sg_state_q8.c, sg__state_q8_make_host): per state array its
 * codes, scales and fp32 blocks, then the block map, each allocated on its own. */
static size_t q8_host_bytes(const sg__layout *l, const sg__layout_shape *sh) {
  const size_t per = sat_add(sat_add(l->opt_numel, mul_sat(sh->q8_blocks, 4)),
                             mul_sat(mul_sat(sh->q8_f32_blocks, SG__Q8_BLOCK), 4));
  return sat_add(mul_sat(per, (size_t)sh->nstates), mul_sat(sh->q8_blocks, 4));
}

/* Optimizer offload: the accumulator, the master (not for f32 params) and the state arrays in
 * pinned host memory (fp32, or 8-bit blocks where q8_blocks), each allocated on its own (no
 * arena alignment), plus the strategy's pipeline buffers. Saturates like the arenas. */
static void host_arrays(sg__layout *l, const sg__layout_shape *sh, size_t P, size_t A) {
  const size_t per = A + (P < 4 ? 4 : 0) + (sh->q8_blocks ? 0 : 4 * (size_t)sh->nstates);
  size_t arrays = mul_sat(l->opt_numel, per);
  if (sh->q8_blocks) {
    l->q8_blocks = sh->q8_blocks;
    l->q8_f32_blocks = sh->q8_f32_blocks;
    arrays = sat_add(arrays, q8_host_bytes(l, sh));
    for (int k = 0; k < sh->nstates; k++) l->q8_code_off[k] = l->q8_scale_off[k] = SIZE_MAX;
    l->q8_map_off = SIZE_MAX;
  }
  l->host_state = 1;
  l->accum_off = l->master_off = SIZE_MAX;
  for (int k = 0; k < sh->nstates; k++) l->state_off[k] = SIZE_MAX;
  l->host_bytes = arrays > SG__ARENA_MAX - sh->host_extra ? SIZE_MAX : arrays + sh->host_extra;
}

/* 8-bit state: per state array its fp32 blocks, codes and scales, then the block map. */
static void q8_arrays(sg__layout *l, const sg__layout_shape *sh) {
  l->q8_blocks = sh->q8_blocks;
  l->q8_f32_blocks = sh->q8_f32_blocks;
  for (int k = 0; k < sh->nstates; k++) {
    l->state_off[k] = carve(l, SG_MEM_OPTIM, mul_sat(mul_sat(sh->q8_f32_blocks, SG__Q8_BLOCK), 4));
    l->q8_code_off[k] = carve(l, SG_MEM_OPTIM, l->opt_numel);
    l->q8_scale_off[k] = carve(l, SG_MEM_OPTIM, mul_sat(sh->q8_blocks, 4));
  }
  l->q8_map_off = carve(l, SG_MEM_OPTIM, mul_sat(sh->q8_blocks, 4));
}

sg_status sg__layout_compute(const sg__plan *p, const sg_config *cfg, const sg__layout_shape *sh,
                             sg__layout *l) {
  memset(l, 0, sizeof *l);
  if (sh->nstates < 0 || sh->nstates > SG__OPTIM_MAX_STATES)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "optimizer with %d state arrays (at most %d)",
                   sh->nstates, SG__OPTIM_MAX_STATES);
  const size_t P = sg__dtype_size(cfg->param_dtype), A = sg__dtype_size(cfg->accum_dtype);
  l->opt_numel = sh->opt_numel;
  l->params_off = carve(l, SG_MEM_PARAMS, mul_sat(p->total_numel, P));
  l->nstaging = sh->nstaging;
  l->staging_numel = sh->staging_numel;
  l->slots_bytes = sh->slots_bytes;
  l->slots_off = carve(l, SG_MEM_GRADS, l->slots_bytes);
  l->accum_numel = l->opt_numel;
  l->nstates = sh->nstates;
  if (sh->host_state) {
    host_arrays(l, sh, P, A);
  } else {
    l->accum_off = carve(l, SG_MEM_GRADS, mul_sat(l->accum_numel, A));
    l->master_off = SIZE_MAX;
    if (P < 4) l->master_off = carve(l, SG_MEM_MASTER, mul_sat(l->opt_numel, 4));
    if (sh->q8_blocks)
      q8_arrays(l, sh);
    else
      for (int k = 0; k < sh->nstates; k++)
        l->state_off[k] = carve(l, SG_MEM_OPTIM, mul_sat(l->opt_numel, 4));
  }
  /* the collective scratch with the small piece right after it, in one carve */
  l->comm_scratch_bytes = sg__comm_scratch_bytes(sh->max_wire);
  l->comm_off = carve(l, SG_MEM_COMM, l->comm_scratch_bytes + SG__SMALL_BYTES);
  l->small_off = l->comm_off + l->comm_scratch_bytes;
  /* A reduce_dtype other than grad_dtype puts each bucket on the wire through one buffer in
   * reduce_dtype (sg_grads.c, reduce_bucket): buckets are reduced one at a time. */
  l->reduce_off = SIZE_MAX;
  if (cfg->reduce_dtype != cfg->grad_dtype)
    l->reduce_off =
        carve(l, SG_MEM_COMM, mul_sat(p->max_bucket_numel, sg__dtype_size(cfg->reduce_dtype)));
  l->replica_off = SIZE_MAX;
  l->replica_bytes = sh->replica_bytes;
  /* offloaded: the accumulator is on the host, so is the wire its slices are cast into */
  if (sh->replica_bytes && sh->host_state) {
    l->replica_host_bytes = sh->replica_bytes;
    l->host_bytes = l->host_bytes > SG__ARENA_MAX - sh->replica_bytes ? SIZE_MAX
                                                                      : l->host_bytes + sh->replica_bytes;
  } else if (sh->replica_bytes) {
    l->replica_off = carve(l, SG_MEM_COMM, sh->replica_bytes);
  }
  return check_fits(l);
}

static const char *kind_name(int k) {
  static const char *names[SG_MEM_KINDS] = {"params", "grads", "master", "optim", "comm"};
  return names[k];
}

sg_status sg__arenas_alloc(sg__arenas *a, sg__device *dev, const sg__layout *l) {
  memset(a, 0, sizeof *a);
  a->dev = dev;
  for (int k = 0; k < SG_MEM_KINDS; k++) {
    if (l->bytes[k] == 0) continue;
    sg_status st = sg__device_alloc_zeroed(dev, l->bytes[k], &a->base[k]);
    if (st != SG_OK) {
      sg__arenas_free(a);
      if (st == SG_ERR_OUT_OF_MEMORY)
        return sg__err(st, "out of memory allocating the %s arena (%zu bytes)", kind_name(k),
                       l->bytes[k]);
      return st;
    }
    a->bytes[k] = l->bytes[k];
  }
  sg__arenas_note(a);
  return SG_OK;
}

void sg__arenas_free(sg__arenas *a) {
  if (!a || !a->dev) return;
  for (int k = 0; k < SG_MEM_KINDS; k++) {
    if (a->base[k]) a->dev->ops->free(a->dev, a->base[k]);
    a->base[k] = NULL;
    a->bytes[k] = 0;
  }
}

size_t sg__arenas_total(const sg__arenas *a) {
  size_t t = a->extra_grads;
  for (int k = 0; k < SG_MEM_KINDS; k++) t += a->bytes[k];
  return t;
}

void sg__arenas_note(sg__arenas *a) {
  size_t t = sg__arenas_total(a);
  if (t > a->peak) a->peak = t;
}

void sg__arenas_extra_grads(sg__arenas *a, long long bytes) {
  a->extra_grads = (size_t)((long long)a->extra_grads + bytes);
  sg__arenas_note(a);
}

sg_status sg__arenas_extra_alloc(sg__arenas *a, size_t bytes, void **out) {
  void *p = NULL;
  SG_TRY(sg__device_alloc_zeroed(a->dev, bytes, &p));
  *out = p;
  sg__arenas_extra_grads(a, (long long)bytes);
  return SG_OK;
}

void sg__arenas_extra_free(sg__arenas *a, void *p, size_t bytes) {
  if (!p) return;
  a->dev->ops->free(a->dev, p);
  sg__arenas_extra_grads(a, -(long long)bytes);
}

void sg__memory_stats_fill(const sg__plan *p, const sg__layout *l, size_t extra_grads,
                           size_t peak, sg_memory_stats *s) {
  s->params_bytes = l->bytes[SG_MEM_PARAMS];
  s->grads_bytes = l->bytes[SG_MEM_GRADS] + extra_grads;
  s->master_bytes = l->bytes[SG_MEM_MASTER];
  s->optim_bytes = l->bytes[SG_MEM_OPTIM];
  s->comm_bytes = l->bytes[SG_MEM_COMM];
  s->total_bytes = s->params_bytes + s->grads_bytes + s->master_bytes + s->optim_bytes +
                   s->comm_bytes;
  s->peak_bytes = peak > s->total_bytes ? peak : s->total_bytes;
  s->numel = p->total_numel;
  s->shard_numel = l->opt_numel;
  s->host_bytes = l->host_bytes;
}
