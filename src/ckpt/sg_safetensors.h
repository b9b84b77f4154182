/* Reading safetensors headers (sg_import, the fuzz target, the tests): a small JSON parser for
 * exactly what the format needs, safe on any input. */
#ifndef SG_SAFETENSORS_H
#define SG_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h" /* sg_status */

#define SG_ST_MAX_HEADER ((uint64_t)100000000) /* the reference reader's limit (bytes) */

typedef struct sg__st_entry {
  char *name;          /* decoded UTF-8 */
  int dtype;           /* SG_F32, SG_BF16, SG_F16, or -1 for the format's other dtypes */
  uint32_t elem_bits;  /* bits per element of the dtype (4 for F4, 6 for F6_*) */
  char dtype_name[16]; /* as written (truncated) */
  uint64_t numel;      /* product of the shape */
  uint64_t begin, end; /* data_offsets, relative to the start of the data */
} sg__st_entry;

/* Parses the JSON header (n bytes, no terminator needed), with the reference reader's rules
 * (sg_safetensors_read.c): UTF-8, "__metadata__" null or strings only, every tensor with a known
 * "dtype", a "shape" and "data_offsets" [begin <= end] holding exactly the shape's bytes; names
 * unique. Entries are sorted by name. SG_ERR_CORRUPT naming `what` and the reason, or
 * SG_ERR_OUT_OF_MEMORY. */
sg_status sg__st_parse_header(const char *json, size_t n, const char *what, sg__st_entry **out,
                              size_t *count);
/* The tensors' data tile [0, data_bytes) exactly (no overlap, no gap, nothing after the last):
 * SG_ERR_CORRUPT naming the tensors otherwise. */
sg_status sg__st_check_layout(const sg__st_entry *ent, size_t n, uint64_t data_bytes,
                              const char *what);
const sg__st_entry *sg__st_find(const sg__st_entry *ent, size_t n, const char *name);
void sg__st_entries_free(sg__st_entry *ent, size_t n);

#endif /* SG_SAFETENSORS_H */
