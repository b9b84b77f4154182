/* The shard planner (DESIGN.md section 2): a pure function from (parameters, world, dtype sizes,
 * bucket size) to an immutable layout identical on every rank. Depends on src/core only. */
#ifndef SG_PLAN_H
#define SG_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h" /* sg_status */

#define SG_PLAN_ALIGN 64 /* elements: every parameter starts at a multiple of this */

typedef struct sg__plan_input {
  const char *name; /* may be NULL for estimates; hashed when present */
  size_t numel;     /* >= 1 */
  uint32_t flags;
} sg__plan_input;

/* A piece of one parameter owned by one rank. */
typedef struct sg__fragment {
  int bucket;           /* bucket holding it */
  size_t param_offset;  /* element offset inside the parameter */
  size_t shard_offset;  /* element offset inside the owning rank's shard */
  size_t length;        /* elements */
} sg__fragment;

typedef struct sg__bucket {
  size_t start;         /* element offset in the flat buffer; multiple of align*W */
  size_t numel;         /* padded length; multiple of align*W */
  size_t shard_offset;  /* offset of this bucket's slice inside every rank's shard (numel/W each) */
  int first_param;      /* params of this bucket, as plan order indices [first, first+count) */
  int param_count;
} sg__bucket;

typedef struct sg__plan_param {
  size_t offset;        /* element offset in the flat buffer; multiple of align */
  size_t numel;
  uint32_t flags;
  int bucket;
  int order;            /* position in plan order (reverse registration order) */
} sg__plan_param;

typedef struct sg__plan {
  int world;
  size_t align;         /* elements: parameter starts and slice boundaries are multiples */
  int nparams;
  int nbuckets;
  size_t total_numel;   /* flat buffer length (sum of bucket numels) */
  size_t shard_numel;   /* = total_numel / world */
  size_t max_bucket_numel;
  size_t bucket_elems;  /* target bucket length in elements */
  sg__plan_param *params;   /* [nparams], indexed by registration id */
  int *order;               /* [nparams]: order[k] = id of the k-th param in plan order */
  sg__bucket *buckets;      /* [nbuckets], in plan (launch) order */
  /* Fragments: for param id and rank r, frags[frag_index[id*world + r] .. frag_index[id*world+r+1]) */
  size_t *frag_index;       /* [nparams*world + 1] */
  sg__fragment *frags;
  uint64_t hash;            /* of everything that must agree across ranks */
  uint64_t *param_hash;     /* [nparams]: name, numel, flags of each param (registration order) */
} sg__plan;

/* Builds the plan. bucket_bytes / elem_bytes gives the target bucket length (>= 64 elements).
 * cfg_hash is mixed into plan->hash (strategy, dtypes, ...). Returns SG_ERR_INVALID_ARGUMENT
 * for bad inputs, SG_ERR_OUT_OF_MEMORY when the tables cannot be allocated. */
sg_status sg__plan_build(const sg__plan_input *params, int nparams, int world, size_t elem_bytes,
                         size_t bucket_bytes, uint64_t cfg_hash, sg__plan **out);
/* The same with every parameter starting at a multiple of `align` elements inside its bucket
 * and every bucket padded to a multiple of align*W (align: SG_PLAN_ALIGN times a power of two,
 * at most 2^20), so that rank slices begin at multiples of align too: a block of align
 * elements from a tensor's start then never straddles two tensors or two ranks' slices
 * (8-bit optimizer state, DESIGN.md section 10). sg__plan_build is align SG_PLAN_ALIGN. */
sg_status sg__plan_build_aligned(const sg__plan_input *params, int nparams, int world,
                                 size_t elem_bytes, size_t bucket_bytes, uint64_t cfg_hash,
                                 size_t align, sg__plan **out);
void sg__plan_free(sg__plan *p);

/* Slice of bucket b owned by rank r: [start + r*numel/W, start + (r+1)*numel/W). */
static inline size_t sg__plan_slice_start(const sg__plan *p, int b, int r) {
  return p->buckets[b].start + (size_t)r * (p->buckets[b].numel / (size_t)p->world);
}
static inline size_t sg__plan_slice_numel(const sg__plan *p, int b) {
  return p->buckets[b].numel / (size_t)p->world;
}
/* The largest slice of any bucket (the size of a buffer that holds one rank's slice of each). */
static inline size_t sg__plan_max_slice_numel(const sg__plan *p) {
  size_t m = 0;
  for (int b = 0; b < p->nbuckets; b++)
    if (sg__plan_slice_numel(p, b) > m) m = sg__plan_slice_numel(p, b);
  return m;
}

#endif /* SG_PLAN_H */
