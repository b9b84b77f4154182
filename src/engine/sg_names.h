/* Parameter names: the rules a name must follow and the index that finds a registered name in
 * O(1), so that registering n parameters costs O(n) (sg_add_param). */
#ifndef SG_NAMES_H
#define SG_NAMES_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h" /* sg_status */

#define SG__MAX_NAME 255 /* bytes, as the checkpoint format records them (u16 length, <= 255) */

/* Open-addressing hash index over an engine's names array: slot[i] is an id, or -1. */
typedef struct sg__names {
  int32_t *slot;
  uint32_t *hash; /* low 32 bits of each slot's name hash: most probes skip the strcmp */
  size_t cap;     /* power of two, or 0 before the first insert */
  size_t count;
} sg__names;

/* SG_ERR_INVALID_ARGUMENT with a message unless name is 1..SG__MAX_NAME bytes of well-formed
 * UTF-8 and not "__metadata__": names become JSON strings in safetensors headers (sg_export),
 * whose readers refuse ill-formed UTF-8 and reserve that key. */
sg_status sg__name_check(const char *name, const char *fn);

/* The id whose names[id] equals name, or -1. */
int sg__names_find(const sg__names *t, char *const *names, const char *name);
/* Indexes names[id] (not already present); SG_ERR_OUT_OF_MEMORY leaves the index unchanged. */
sg_status sg__names_add(sg__names *t, char *const *names, int id);
void sg__names_free(sg__names *t);

#endif /* SG_NAMES_H */
