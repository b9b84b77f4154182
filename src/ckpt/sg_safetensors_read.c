/* The safetensors header parser: JSON objects, arrays, strings (escapes and \u surrogate pairs
 * decoded to UTF-8), non-negative integers; other values are skipped, nesting is bounded.
 *
 * What it accepts follows the reference reader (the `safetensors` Rust crate, which the Python
 * package wraps): the header is UTF-8; "__metadata__", if present, is null or an object of
 * string values, once; every tensor has a known dtype, a shape of non-negative integers and
 * data_offsets [begin, end] with begin <= end and end - begin the bytes its shape needs; and
 * (sg__st_check_layout) the tensors' data, sorted by offset, tile the data area exactly: no
 * overlap, no gap, nothing after the last tensor. Two differences, both refusals the reference
 * does not make: a tensor name given twice (the reference keeps the last) and a name holding
 * U+0000. Failures that are not plain syntax say what is wrong, not "malformed JSON". */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/sg_utf8.h" /* sg__utf8_invalid_at */
#include "sg_safetensors.h"

#define SG_ST_MAX_DEPTH 64

typedef struct {
  const char *p, *end, *start;
  char why[256]; /* set when the input is well-formed JSON that breaks a format rule */
} jp;

/* Records the rule broken (the first one wins) and returns 0, so that parsers can
 * `return refuse(j, ...)`. */
static int refuse(jp *j, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static int refuse(jp *j, const char *fmt, ...) {
  if (j->why[0]) return 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->why, sizeof j->why, fmt, ap);
  va_end(ap);
  if (!j->why[0]) snprintf(j->why, sizeof j->why, "invalid header");
  return 0;
}

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

/* The reference's dtypes and their element sizes in bits (F4 and F6 pack several elements
 * into a byte); the engine reads F32, BF16 and F16. */
static const struct {
  const char *name;
  uint32_t bits;
  int sg; /* sg_dtype, or -1 */
} dtypes[] = {{"BOOL", 8, -1},         {"F4", 4, -1},          {"F6_E2M3", 6, -1},
              {"F6_E3M2", 6, -1},      {"U8", 8, -1},          {"I8", 8, -1},
              {"F8_E5M2", 8, -1},      {"F8_E4M3", 8, -1},     {"F8_E8M0", 8, -1},
              {"F8_E4M3FNUZ", 8, -1},  {"F8_E5M2FNUZ", 8, -1}, {"I16", 16, -1},
              {"U16", 16, -1},         {"F16", 16, SG_F16},    {"BF16", 16, SG_BF16},
              {"I32", 32, -1},         {"U32", 32, -1},        {"F32", 32, SG_F32},
              {"C64", 64, -1},         {"F64", 64, -1},        {"I64", 64, -1},
              {"U64", 64, -1}};

/* The dtype named s into t; 0 (and the reason) for a name the format does not define. */
static int set_dtype(jp *j, sg__st_entry *t, const char *s) {
  snprintf(t->dtype_name, sizeof t->dtype_name, "%s", s);
  for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++)
    if (strcmp(s, dtypes[k].name) == 0) {
      t->dtype = dtypes[k].sg;
      t->elem_bits = dtypes[k].bits;
      return 1;
    }
  return refuse(j, "tensor '%s' has dtype '%.40s', which safetensors does not define", t->name, s);
}

static int parse_shape(jp *j, const sg__st_entry *t, uint64_t *numel) {
  uint64_t n = 1, d = 0;
  if (!eat(j, '[')) return 0;
  if (eat(j, ']')) {
    *numel = 1;
    return 1;
  }
  for (;;) {
    if (!juint(j, &d)) return 0;
    if (d != 0 && n > UINT64_MAX / d)
      return refuse(j, "tensor '%s': the product of its shape overflows 64 bits", t->name);
    n *= d;
    if (eat(j, ']')) break;
    if (!eat(j, ',')) return 0;
  }
  *numel = n;
  return 1;
}

static int parse_offsets(jp *j, sg__st_entry *t) {
  if (!(eat(j, '[') && juint(j, &t->begin) && eat(j, ',') && juint(j, &t->end) && eat(j, ']')))
    return 0;
  if (t->begin > t->end)
    return refuse(j,
                  "tensor '%s' has data_offsets [%" PRIu64 ", %" PRIu64
                  "]: its data would end before it begins",
                  t->name, t->begin, t->end);
  return 1;
}

/* Shape, dtype and offsets agree: end - begin is exactly the bytes of numel elements. */
static int check_size(jp *j, const sg__st_entry *t) {
  if (t->numel > UINT64_MAX / t->elem_bits)
    return refuse(j, "tensor '%s': %" PRIu64 " elements of %s overflow 64 bits", t->name, t->numel,
                  t->dtype_name);
  const uint64_t bits = t->numel * t->elem_bits;
  if (bits % 8 != 0 || bits / 8 != t->end - t->begin)
    return refuse(j,
                  "tensor '%s': %" PRIu64 " elements of %s need %" PRIu64 "%s bytes, its "
                  "data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64,
                  t->name, t->numel, t->dtype_name, bits / 8, bits % 8 ? " and a fraction of" : "",
                  t->begin, t->end, t->end - t->begin);
  return 1;
}

/* The members of an object, its '{' and the check for an empty one already done: each
 * "key": value through member (which parses the value), up to the closing '}'. 0 on a failure. */
typedef int (*jmember_fn)(jp *j, const char *key, void *ctx, int *oom);

static int jmembers(jp *j, jmember_fn member, void *ctx, int *oom) {
  for (;;) {
    char *key = NULL;
    if (!jstring(j, &key, oom) || !eat(j, ':')) {
      free(key);
      return 0;
    }
    const int ok = member(j, key, ctx, oom);
    free(key);
    if (!ok) return 0;
    if (eat(j, '}')) return 1;
    if (!eat(j, ',')) return 0;
  }
}

typedef struct tensor_ctx {
  sg__st_entry *t;
  int have; /* bits: 1 dtype, 2 shape, 4 data_offsets */
} tensor_ctx;

static int tensor_member(jp *j, const char *key, void *ctx, int *oom) {
  tensor_ctx *c = ctx;
  if (strcmp(key, "dtype") == 0) {
    char *dt = NULL;
    const int ok = jstring(j, &dt, oom) && set_dtype(j, c->t, dt);
    c->have |= 1;
    free(dt);
    return ok;
  }
  if (strcmp(key, "shape") == 0) {
    c->have |= 2;
    return parse_shape(j, c->t, &c->t->numel);
  }
  if (strcmp(key, "data_offsets") == 0) {
    c->have |= 4;
    return parse_offsets(j, c->t);
  }
  return jskip(j, 1);
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e], ...} */
static int parse_tensor(jp *j, sg__st_entry *t, int *oom) {
  tensor_ctx c = {t, 0};
  if (!eat(j, '{')) return 0;
  if (eat(j, '}')) return 0;
  if (!jmembers(j, tensor_member, &c, oom)) return 0;
  if (c.have != 7)
    return refuse(j, "tensor '%s' lacks %s", t->name,
                  !(c.have & 1) ? "\"dtype\"" : !(c.have & 2) ? "\"shape\"" : "\"data_offsets\"");
  return check_size(j, t);
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

static int metadata_member(jp *j, const char *key, void *ctx, int *oom) {
  (void)ctx;
  if (peek(j) == '"') return jstring(j, NULL, oom);
  if (!jskip(j, 2)) return 0;
  return refuse(j, "\"__metadata__\" must map keys to strings (the value of '%.64s' is not a "
                "string)", key);
}

/* "__metadata__": null, or an object whose values are all strings (the reference reads it as
 * a map from string to string). */
static int parse_metadata(jp *j, int *oom) {
  if (peek(j) == 'n') return skip_word(j, "null");
  if (!eat(j, '{')) {
    if (!jskip(j, 1)) return 0;
    return refuse(j, "\"__metadata__\" must be an object of strings (or null)");
  }
  if (eat(j, '}')) return 1;
  return jmembers(j, metadata_member, NULL, oom);
}

/* One "name": value member of the top-level object; *t filled for tensors (skip = metadata). */
static int parse_member(jp *j, sg__st_entry *t, int *skip, int *seen_meta, int *oom) {
  memset(t, 0, sizeof *t);
  if (!jstring(j, &t->name, oom) || !eat(j, ':')) return 0;
  *skip = strcmp(t->name, "__metadata__") == 0;
  if (*skip) {
    if ((*seen_meta)++) return refuse(j, "\"__metadata__\" appears twice");
    return parse_metadata(j, oom);
  }
  return parse_tensor(j, t, oom);
}

static sg_status parse_members(jp *j, const char *what, sg__st_entry *ent, size_t cap,
                               size_t *count) {
  size_t n = 0;
  int seen_meta = 0;
  if (eat(j, '}')) goto end;
  for (;;) {
    int skip = 0, oom = 0;
    if (n == cap) return sg__err(SG_ERR_CORRUPT, "%s: too many tensors for the header", what);
    const int ok = parse_member(j, &ent[n], &skip, &seen_meta, &oom);
    if (oom) {
      free(ent[n].name);
      *count = n;
      return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
    }
    if (!ok || skip) free(ent[n].name);
    if (!ok) {
      *count = n;
      if (j->why[0]) return sg__err(SG_ERR_CORRUPT, "%s: %s", what, j->why);
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
  const size_t bad = sg__utf8_invalid_at(json, len);
  if (bad < len)
    return sg__err(SG_ERR_CORRUPT, "%s: the header is not valid UTF-8 (byte 0x%02x at offset %zu)",
                   what, (unsigned)(unsigned char)json[bad], bad);
  jp j = {json, json + len, json, ""};
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

/* ---------------------------------------------------------------------------------------- */
/* the data area                                                                             */

static int offset_cmp(const void *a, const void *b) {
  const sg__st_entry *x = *(const sg__st_entry *const *)a, *y = *(const sg__st_entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* Sorted by (begin, end), as the reference does: each tensor must start where the previous one
 * ended. */
static sg_status check_tiling(const sg__st_entry *const *by, size_t n, uint64_t data_bytes,
                              const char *what) {
  uint64_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const sg__st_entry *t = by[i];
    if (t->begin < at)
      return sg__err(SG_ERR_CORRUPT,
                     "%s: the data of tensors '%s' and '%s' overlap (data_offsets [%" PRIu64
                     ", %" PRIu64 "] begin before byte %" PRIu64 ", where '%s' ends)",
                     what, by[i - 1]->name, t->name, t->begin, t->end, at, by[i - 1]->name);
    if (t->begin > at)
      return sg__err(SG_ERR_CORRUPT,
                     "%s: bytes %" PRIu64 "..%" PRIu64 " of the data belong to no tensor (tensor "
                     "'%s' begins at %" PRIu64 ")",
                     what, at, t->begin, t->name, t->begin);
    at = t->end;
  }
  if (at > data_bytes)
    return sg__err(SG_ERR_CORRUPT,
                   "%s: tensor '%s' ends at byte %" PRIu64 " of the data, past the end of the file "
                   "(%" PRIu64 " data bytes)",
                   what, by[n - 1]->name, at, data_bytes);
  if (at < data_bytes)
    return sg__err(SG_ERR_CORRUPT,
                   "%s: %" PRIu64 " bytes after the last tensor's data (the tensors end at byte "
                   "%" PRIu64 " of %" PRIu64 " data bytes)",
                   what, data_bytes - at, at, data_bytes);
  return SG_OK;
}

sg_status sg__st_check_layout(const sg__st_entry *ent, size_t n, uint64_t data_bytes,
                              const char *what) {
  const sg__st_entry **by = malloc((n ? n : 1) * sizeof *by);
  if (!by) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (size_t i = 0; i < n; i++) by[i] = &ent[i];
  if (n > 1) qsort(by, n, sizeof *by, offset_cmp);
  const sg_status st = check_tiling(by, n, data_bytes, what);
  free(by);
  return st;
}
