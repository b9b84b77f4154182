/* Parameter names: validity rules and an O(1) index (linear probing, at most half full). */
#include "sg_names.h"

#include <stdlib.h>
#include <string.h>

#include "../core/sg_utf8.h" /* sg__utf8_invalid_at */

#define SG__NAMES_RESERVED "__metadata__" /* safetensors' metadata key */

sg_status sg__name_check(const char *name, const char *fn) {
  const size_t len = strlen(name);
  if (len == 0 || len > SG__MAX_NAME)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: name must be 1..%d bytes (got %zu)", fn,
                   SG__MAX_NAME, len);
  const size_t bad = sg__utf8_invalid_at(name, len);
  if (bad < len)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: name is not valid UTF-8 (byte 0x%02x at offset %zu); safetensors files "
                   "(sg_export) can hold only UTF-8 names",
                   fn, (unsigned)(unsigned char)name[bad], bad);
  if (strcmp(name, SG__NAMES_RESERVED) == 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: the name '%s' is reserved (safetensors' metadata key)", fn, name);
  return SG_OK;
}

static uint64_t name_hash(const char *name) {
  return sg__hash_bytes(SG__HASH_INIT, name, strlen(name));
}

/* Slot holding `name`, or the empty slot where it would go. */
static size_t probe(const sg__names *t, char *const *names, const char *name, uint64_t h) {
  size_t i = (size_t)h & (t->cap - 1);
  while (t->slot[i] >= 0 &&
         (t->hash[i] != (uint32_t)h || strcmp(names[t->slot[i]], name) != 0))
    i = (i + 1) & (t->cap - 1);
  return i;
}

int sg__names_find(const sg__names *t, char *const *names, const char *name) {
  if (t->cap == 0) return -1;
  const size_t i = probe(t, names, name, name_hash(name));
  return t->slot[i];
}

/* The stored 32-bit hashes place the entries again: cap never exceeds 2^32 (ids are ints). */
static sg_status grow(sg__names *t) {
  const size_t cap = t->cap ? 2 * t->cap : 64;
  int32_t *slot = malloc(cap * sizeof *slot);
  uint32_t *hash = malloc(cap * sizeof *hash);
  if (!slot || !hash) {
    free(slot);
    free(hash);
    return SG_ERR_OUT_OF_MEMORY;
  }
  for (size_t i = 0; i < cap; i++) slot[i] = -1;
  for (size_t i = 0; i < t->cap; i++) {
    if (t->slot[i] < 0) continue;
    size_t j = (size_t)t->hash[i] & (cap - 1);
    while (slot[j] >= 0) j = (j + 1) & (cap - 1);
    slot[j] = t->slot[i];
    hash[j] = t->hash[i];
  }
  free(t->slot);
  free(t->hash);
  t->slot = slot;
  t->hash = hash;
  t->cap = cap;
  return SG_OK;
}

sg_status sg__names_add(sg__names *t, char *const *names, int id) {
  if (2 * (t->count + 1) > t->cap) SG_TRY(grow(t));
  const uint64_t h = name_hash(names[id]);
  const size_t i = probe(t, names, names[id], h);
  t->slot[i] = id;
  t->hash[i] = (uint32_t)h;
  t->count++;
  return SG_OK;
}

void sg__names_free(sg__names *t) {
  free(t->slot);
  free(t->hash);
  memset(t, 0, sizeof *t);
}
