/* The safetensors header parser: JSON objects, arrays, strings (escapes and \u surrogate pairs
 * decoded to UTF-8), non-negative integers; other values are skipped, nesting is bounded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_safetensors.h"

#define SG_ST_MAX_DEPTH 64

typedef struct {
  const char *p, *end, *start;
} jp;

static int peek(jp *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
  return j->p < j->end ? (unsigned char)*j->p : -1;
}

static int eat(jp *j, char c) {
  if (peek(j) != (unsigned char)c) return 0;
  j->p++;
  return 1;
}

static int hex4(jp *j, uint32_t *v) {
  if (j->end - j->p < 4) return 0;
  uint32_t x = 0;
  for (int i = 0; i < 4; i++) {
    const char c = *j->p++;
    x <<= 4;
    if (c >= '0' && c <= '9')
      x |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f')
      x |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      x |= (uint32_t)(c - 'A' + 10);
    else
      return 0;
  }
  *v = x;
  return 1;
}

/* Appends code point cp as UTF-8 at out[*n] (out has room: escapes are longer than their
 * encodings). */
static void put_utf8(char *out, size_t *n, uint32_t cp) {
  if (cp < 0x80) {
    out[(*n)++] = (char)cp;
  } else if (cp < 0x800) {
    out[(*n)++] = (char)(0xC0 | (cp >> 6));
    out[(*n)++] = (char)(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out[(*n)++] = (char)(0xE0 | (cp >> 12));
    out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[(*n)++] = (char)(0x80 | (cp & 0x3F));
  } else {
    out[(*n)++] = (char)(0xF0 | (cp >> 18));
    out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[(*n)++] = (char)(0x80 | (cp & 0x3F));
  }
}

/* One \u escape (the "\u" already read), a surrogate pair when there is one. */
static int unicode_escape(jp *j, uint32_t *cp) {
  uint32_t hi = 0, lo = 0;
  if (!hex4(j, &hi)) return 0;
  if (hi >= 0xDC00 && hi <= 0xDFFF) return 0;
  if (hi < 0xD800 || hi > 0xDBFF) {
    *cp = hi;
    return hi != 0; /* names never hold NUL */
  }
  if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u') return 0;
  j->p += 2;
  if (!hex4(j, &lo) || lo < 0xDC00 || lo > 0xDFFF) return 0;
  *cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
  return 1;
}

/* A string; *out (malloc'd, NUL-terminated) when out is not NULL. 0 on malformed input or
 * out of memory (*oom set). */
static int jstring(jp *j, char **out, int *oom) {
  if (!eat(j, '"')) return 0;
  const char *s = j->p;
  while (s < j->end && *s != '"') s += (*s == '\\' && s + 1 < j->end) ? 2 : 1;
  if (s >= j->end) return 0;
  char *buf = out ? malloc((size_t)(s - j->p) + 1) : NULL;
  if (out && !buf) {
    *oom = 1;
    return 0;
  }
  size_t n = 0;
  int ok = 1;
  while (ok && *j->p != '"') {
    const unsigned char c = (unsigned char)*j->p++;
    uint32_t cp = c;
    if (c < 0x20)
      ok = 0;
    else if (c == '\\') {
      const char e = *j->p++;
      switch (e) {
        case '"':
        case '\\':
        case '/':
          cp = (uint32_t)e;
          break;
        case 'b':
          cp = '\b';
          break;
        case 'f':
          cp = '\f';
          break;
        case 'n':
          cp = '\n';
          break;
        case 'r':
          cp = '\r';
          break;
        case 't':
          cp = '\t';
          break;
        case 'u':
          ok = unicode_escape(j, &cp);
          break;
        default:
          ok = 0;
      }
      if (ok && buf) put_utf8(buf, &n, cp);
      continue;
    }
    if (buf) buf[n++] = (char)c;
  }
  if (!ok || j->p >= j->end) {
    free(buf);
    return 0;
  }
  j->p++; /* closing quote */
  if (buf) {
    buf[n] = 0;
    *out = buf;
  }
  return 1;
}

/* A non-negative integer without fraction or exponent. */
static int juint(jp *j, uint64_t *v) {
  if (peek(j) < '0' || peek(j) > '9') return 0;
  uint64_t x = 0;
  const char *s = j->p;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    const uint64_t d = (uint64_t)(*j->p++ - '0');
    if (x > (UINT64_MAX - d) / 10) return 0;
    x = x * 10 + d;
  }
  if (j->p - s > 1 && *s == '0') return 0;
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E')) return 0;
  *v = x;
  return 1;
}

static int jskip(jp *j, int depth);

static int skip_container(jp *j, char close, int depth, int keyed) {
  if (eat(j, close)) return 1;
  for (;;) {
    int oom = 0;
    if (keyed && (!jstring(j, NULL, &oom) || !eat(j, ':'))) return 0;
    if (!jskip(j, depth + 1)) return 0;
    if (eat(j, close)) return 1;
    if (!eat(j, ',')) return 0;
  }
}

static int skip_number(jp *j) {
  const char *s = j->p;
  if (j->p < j->end && *j->p == '-') j->p++;
  while (j->p < j->end && strchr("0123456789.eE+-", *j->p)) j->p++;
  return j->p > s;
}

static int skip_word(jp *j, const char *w) {
  const size_t n = strlen(w);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, w, n) != 0) return 0;
  j->p += n;
  return 1;
}

static int jskip(jp *j, int depth) {
  if (depth > SG_ST_MAX_DEPTH) return 0;
  int oom = 0;
  switch (peek(j)) {
    case '"':
      return jstring(j, NULL, &oom);
    case '{':
      j->p++;
      return skip_container(j, '}', depth, 1);
    case '[':
      j->p++;
      return skip_container(j, ']', depth, 0);
    case 't':
      return skip_word(j, "true");
    case 'f':
      return skip_word(j, "false");
    case 'n':
      return skip_word(j, "null");
    default:
      return skip_number(j);
  }
}

/* ---------------------------------------------------------------------------------------- */
/* tensors                                                                                   */

static int dtype_of(const char *s) {
  if (strcmp(s, "F32") == 0) return SG_F32;
  if (strcmp(s, "BF16") == 0) return SG_BF16;
  if (strcmp(s, "F16") == 0) return SG_F16;
  return -1;
}

static int parse_shape(jp *j, uint64_t *numel) {
  uint64_t n = 1, d = 0;
  if (!eat(j, '[')) return 0;
  if (eat(j, ']')) {
    *numel = 1;
    return 1;
  }
  for (;;) {
    if (!juint(j, &d)) return 0;
    if (d != 0 && n > UINT64_MAX / d) return 0;
    n *= d;
    if (eat(j, ']')) break;
    if (!eat(j, ',')) return 0;
  }
  *numel = n;
  return 1;
}

static int parse_offsets(jp *j, sg__st_entry *t) {
  return eat(j, '[') && juint(j, &t->begin) && eat(j, ',') && juint(j, &t->end) && eat(j, ']') &&
         t->begin <= t->end;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e], ...} */
static int parse_tensor(jp *j, sg__st_entry *t, int *oom) {
  int have = 0;
  if (!eat(j, '{')) return 0;
  if (eat(j, '}')) return 0;
  for (;;) {
    char *key = NULL;
    if (!jstring(j, &key, oom) || !eat(j, ':')) {
      free(key);
      return 0;
    }
    int ok = 1;
    if (strcmp(key, "dtype") == 0) {
      char *dt = NULL;
      ok = jstring(j, &dt, oom);
      if (ok) {
        snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dt);
        t->dtype = dtype_of(dt);
        have |= 1;
      }
      free(dt);
    } else if (strcmp(key, "shape") == 0) {
      ok = parse_shape(j, &t->numel);
      have |= 2;
    } else if (strcmp(key, "data_offsets") == 0) {
      ok = parse_offsets(j, t);
      have |= 4;
    } else {
      ok = jskip(j, 1);
    }
    free(key);
    if (!ok) return 0;
    if (eat(j, '}')) break;
    if (!eat(j, ',')) return 0;
  }
  return have == 7;
}

static int entry_cmp(const void *a, const void *b) {
  return strcmp(((const sg__st_entry *)a)->name, ((const sg__st_entry *)b)->name);
}

void sg__st_entries_free(sg__st_entry *ent, size_t n) {
  if (!ent) return;
  for (size_t i = 0; i < n; i++) free(ent[i].name);
  free(ent);
}

const sg__st_entry *sg__st_find(const sg__st_entry *ent, size_t n, const char *name) {
  const sg__st_entry key = {.name = (char *)name};
  return n ? bsearch(&key, ent, n, sizeof *ent, entry_cmp) : NULL;
}

/* One "name": value member of the top-level object; *t filled for tensors (skip = metadata). */
static int parse_member(jp *j, sg__st_entry *t, int *skip, int *oom) {
  memset(t, 0, sizeof *t);
  if (!jstring(j, &t->name, oom) || !eat(j, ':')) return 0;
  *skip = strcmp(t->name, "__metadata__") == 0;
  if (*skip) return jskip(j, 1);
  return parse_tensor(j, t, oom);
}

static sg_status parse_members(jp *j, const char *what, sg__st_entry *ent, size_t cap,
                               size_t *count) {
  size_t n = 0;
  if (eat(j, '}')) goto end;
  for (;;) {
    int skip = 0, oom = 0;
    if (n == cap) return sg__err(SG_ERR_CORRUPT, "%s: too many tensors for the header", what);
    const int ok = parse_member(j, &ent[n], &skip, &oom);
    if (oom) {
      free(ent[n].name);
      *count = n;
      return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
    }
    if (!ok || skip) free(ent[n].name);
    if (!ok) {
      *count = n;
      return sg__err(SG_ERR_CORRUPT, "%s: malformed header JSON near byte %zu", what,
                     (size_t)(j->p - j->start));
    }
    if (!skip) n++;
    if (eat(j, '}')) break;
    if (!eat(j, ',')) {
      *count = n;
      return sg__err(SG_ERR_CORRUPT, "%s: malformed header JSON (expected ',' or '}')", what);
    }
  }
end:
  *count = n;
  if (peek(j) != -1) return sg__err(SG_ERR_CORRUPT, "%s: bytes after the header JSON", what);
  return SG_OK;
}

sg_status sg__st_parse_header(const char *json, size_t len, const char *what, sg__st_entry **out,
                              size_t *count) {
  *out = NULL;
  *count = 0;
  jp j = {json, json + len, json};
  if (!eat(&j, '{')) return sg__err(SG_ERR_CORRUPT, "%s: the header is not a JSON object", what);
  const size_t cap = len / 8 + 1; /* every tensor takes far more than 8 bytes */
  sg__st_entry *ent = calloc(cap, sizeof *ent);
  if (!ent) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  size_t n = 0;
  sg_status st = parse_members(&j, what, ent, cap, &n);
  if (st == SG_OK) {
    qsort(ent, n, sizeof *ent, entry_cmp);
    for (size_t i = 1; i < n && st == SG_OK; i++)
      if (strcmp(ent[i - 1].name, ent[i].name) == 0)
        st = sg__err(SG_ERR_CORRUPT, "%s: tensor '%s' appears twice", what, ent[i].name);
  }
  if (st != SG_OK) {
    sg__st_entries_free(ent, n);
    return st;
  }
  *out = ent;
  *count = n;
  return SG_OK;
}
