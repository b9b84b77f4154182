/* On-disk formats of the checkpoint: the manifest and the rank file header. Pure functions over
 * byte buffers (no I/O), so that the fuzz target drives exactly the code sg_load runs. Every
 * reader of untrusted bytes checks each length before it reads or allocates. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sg_ckpt.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shardgrad checkpoints are written on little-endian hosts only"
#endif

static const char k_manifest_magic[8] = {'S', 'G', 'C', 'K', 'M', 'A', 'N', 'F'};
static const char k_shard_magic[8] = {'S', 'G', 'C', 'K', 'S', 'H', 'R', 'D'};

static uint32_t g_chunk_bytes = SG_CK_CHUNK_DEFAULT;

void sg__ckpt_set_chunk_bytes(uint32_t bytes) {
  if (bytes == 0) bytes = SG_CK_CHUNK_DEFAULT;
  if (bytes < SG_CK_CHUNK_MIN) bytes = SG_CK_CHUNK_MIN;
  if (bytes > SG_CK_CHUNK_MAX) bytes = SG_CK_CHUNK_MAX;
  __atomic_store_n(&g_chunk_bytes, bytes, __ATOMIC_RELAXED);
}

uint32_t sg__ckpt_chunk_bytes(void) { return __atomic_load_n(&g_chunk_bytes, __ATOMIC_RELAXED); }

/* ---------------------------------------------------------------------------------------- */
/* little-endian writer and bounds-checked reader                                            */

void sg__ck_buf_add(sg__ck_buf *b, const void *src, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n + 1) cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, src, n);
  b->len += n;
  b->p[b->len] = 0;
}

static void put_le(uint8_t *dst, uint64_t v, int n) {
  for (int i = 0; i < n; i++) dst[i] = (uint8_t)(v >> (8 * i));
}
static void wb_uint(sg__ck_buf *b, uint64_t v, int n) {
  uint8_t t[8];
  put_le(t, v, n);
  sg__ck_buf_add(b, t, (size_t)n);
}
static void wb_u16(sg__ck_buf *b, uint64_t v) { wb_uint(b, v, 2); }
static void wb_u32(sg__ck_buf *b, uint64_t v) { wb_uint(b, v, 4); }
static void wb_u64(sg__ck_buf *b, uint64_t v) { wb_uint(b, v, 8); }
static void wb_name(sg__ck_buf *b, const char *s) {
  const size_t n = strlen(s);
  wb_u16(b, n);
  sg__ck_buf_add(b, s, n);
}

typedef struct {
  const uint8_t *p;
  size_t len, pos;
  int bad; /* read past the end */
} rbuf;

static uint64_t get_le(const uint8_t *src, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = (v << 8) | src[i];
  return v;
}
static uint64_t rb_uint(rbuf *r, int n) {
  if (r->bad || r->len - r->pos < (size_t)n) {
    r->bad = 1;
    return 0;
  }
  uint64_t v = get_le(r->p + r->pos, n);
  r->pos += (size_t)n;
  return v;
}
static uint32_t rb_u16(rbuf *r) { return (uint32_t)rb_uint(r, 2); }
static uint32_t rb_u32(rbuf *r) { return (uint32_t)rb_uint(r, 4); }
static uint64_t rb_u64(rbuf *r) { return rb_uint(r, 8); }
static size_t rb_left(const rbuf *r) { return r->bad ? 0 : r->len - r->pos; }

static float f_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* ---------------------------------------------------------------------------------------- */
/* manifest: encode                                                                          */

static int has_rep(const sg__ck_manifest *m) {
  for (int k = 0; k < SG_CK_REP_STATES; k++)
    if (m->rep_esz[k]) return 1;
  return 0;
}

static void encode_body(const sg__ck_manifest *m, sg__ck_buf *b) {
  const uint32_t version = m->version ? m->version : m->param_steps ? 4u : has_rep(m) ? 3u : 2u;
  sg__ck_buf_add(b, k_manifest_magic, 8);
  wb_u32(b, version);
  wb_u32(b, 0);
  wb_u64(b, 0); /* total bytes, patched at the end */
  wb_u64(b, m->generation);
  wb_u32(b, m->world);
  wb_u32(b, m->strategy);
  wb_u32(b, m->param_dtype);
  wb_u32(b, m->has_master);
  wb_u64(b, m->plan_hash);
  wb_u64(b, m->step);
  wb_u32(b, bits_of(m->loss_scale));
  wb_u32(b, m->clean_steps);
  wb_u32(b, m->dynamic_scale);
  wb_u32(b, bits_of(m->lr));
  wb_u32(b, SG_CK_NCFG);
  for (int k = 0; k < SG_CK_NCFG; k++) wb_u64(b, m->cfg[k]);
  wb_u32(b, m->nparams);
  for (uint32_t r = 0; r < m->world; r++) {
    wb_name(b, m->files[r].name);
    wb_u64(b, m->files[r].bytes);
    wb_u64(b, m->files[r].numel);
    wb_u32(b, m->files[r].header_crc);
  }
  for (uint32_t i = 0; i < m->nparams; i++) {
    const sg__ck_param *p = &m->params[i];
    wb_name(b, p->name);
    wb_u64(b, p->numel);
    wb_u32(b, p->flags);
    wb_u32(b, p->dtype);
    wb_u32(b, p->nfrags);
    for (uint32_t k = 0; k < p->nfrags; k++) {
      wb_u32(b, p->frags[k].rank);
      wb_u64(b, p->frags[k].param_off);
      wb_u64(b, p->frags[k].len);
      wb_u64(b, p->frags[k].elem_off);
    }
  }
  if (version < 2) return;
  const uint32_t ng = m->ngroups < (uint32_t)SG_MAX_GROUPS ? m->ngroups : (uint32_t)SG_MAX_GROUPS;
  wb_u32(b, ng);
  for (uint32_t g = 0; g < ng; g++) {
    wb_u32(b, bits_of(m->group_lr[g]));
    wb_u32(b, bits_of(m->group_wd[g]));
  }
  if (version < 3) return;
  for (int k = 0; k < SG_CK_REP_STATES; k++) wb_u32(b, m->rep_esz[k]);
  wb_u64(b, m->rep_position);
  if (version < 4) return;
  for (uint32_t i = 0; i < m->nparams; i++) wb_u64(b, m->param_steps ? m->param_steps[i] : m->step);
}

sg_status sg__ck_manifest_encode(const sg__ck_manifest *m, uint8_t **out, size_t *len) {
  sg__ck_buf b = {0};
  encode_body(m, &b);
  wb_u32(&b, 0); /* checksum slot */
  if (b.oom) {
    free(b.p);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory encoding the manifest");
  }
  put_le(b.p + 16, b.len, 8);
  put_le(b.p + b.len - 4, sg__crc32c(0, b.p, b.len - 4), 4);
  *out = b.p;
  *len = b.len;
  return SG_OK;
}

uint64_t sg__ck_manifest_peek_generation(const uint8_t *buf, size_t len) {
  if (len < 32 || memcmp(buf, k_manifest_magic, 8) != 0) return 0;
  return get_le(buf + 24, 8);
}

/* ---------------------------------------------------------------------------------------- */
/* manifest: parse                                                                           */

void sg__ck_manifest_free(sg__ck_manifest *m) {
  if (!m) return;
  if (m->params)
    for (uint32_t i = 0; i < m->nparams; i++) {
      free(m->params[i].name);
      free(m->params[i].frags);
    }
  if (m->files)
    for (uint32_t r = 0; r < m->world; r++) free(m->files[r].name);
  free(m->params);
  free(m->files);
  free(m->param_steps);
  memset(m, 0, sizeof *m);
}

#define CORRUPT(...) sg__err(SG_ERR_CORRUPT, __VA_ARGS__)

/* A length-prefixed name: 1..255 bytes, no NUL; file names also no '/' and no leading '.'. */
static sg_status read_name(rbuf *r, int file_name, const char *what, char **out) {
  const uint32_t n = rb_u16(r);
  if (r->bad) return CORRUPT("%s: truncated", what);
  if (n == 0 || n > SG_CK_MAX_NAME || n > rb_left(r))
    return CORRUPT("%s: bad name length %u at byte %zu", what, n, r->pos);
  const char *s = (const char *)r->p + r->pos;
  if (memchr(s, 0, n) || (file_name && (memchr(s, '/', n) || s[0] == '.')))
    return CORRUPT("%s: bad name at byte %zu", what, r->pos);
  char *c = malloc(n + 1);
  if (!c) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  memcpy(c, s, n);
  c[n] = 0;
  r->pos += n;
  *out = c;
  return SG_OK;
}

static sg_status parse_head(rbuf *r, const char *what, sg__ck_manifest *m) {
  if (r->len < 8 || memcmp(r->p, k_manifest_magic, 8) != 0)
    return CORRUPT("%s: not a shardgrad manifest (bad magic)", what);
  r->pos = 8;
  const uint32_t version = rb_u32(r);
  (void)rb_u32(r);
  const uint64_t total = rb_u64(r);
  if (r->bad) return CORRUPT("%s: truncated header", what);
  if (version < 1 || version > SG_CK_MANIFEST_VERSION)
    return CORRUPT("%s: format version %u, this library reads versions 1..%u", what, version,
                   SG_CK_MANIFEST_VERSION);
  m->version = version;
  if (total != r->len)
    return CORRUPT("%s: %zu bytes, the header says %" PRIu64 " (truncated or extended)", what,
                   r->len, total);
  const uint32_t want = (uint32_t)get_le(r->p + r->len - 4, 4);
  if (r->len < 36 || sg__crc32c(0, r->p, r->len - 4) != want)
    return CORRUPT("%s: checksum mismatch", what);
  r->len -= 4; /* the checksum is not part of the body */
  m->generation = rb_u64(r);
  m->world = rb_u32(r);
  m->strategy = rb_u32(r);
  m->param_dtype = rb_u32(r);
  m->has_master = rb_u32(r);
  m->plan_hash = rb_u64(r);
  m->step = rb_u64(r);
  m->loss_scale = f_of(rb_u32(r));
  m->clean_steps = rb_u32(r);
  m->dynamic_scale = rb_u32(r);
  m->lr = f_of(rb_u32(r));
  const uint32_t ncfg = rb_u32(r);
  if (r->bad) return CORRUPT("%s: truncated", what);
  if (ncfg != SG_CK_NCFG)
    return CORRUPT("%s: %u config words, expected %d", what, ncfg, SG_CK_NCFG);
  for (int k = 0; k < SG_CK_NCFG; k++) m->cfg[k] = rb_u64(r);
  m->nparams = rb_u32(r);
  if (r->bad) return CORRUPT("%s: truncated", what);
  if (m->world < 1 || m->world > SG_CK_MAX_WORLD) return CORRUPT("%s: world %u", what, m->world);
  if (!sg__strategy_known(m->strategy)) return CORRUPT("%s: strategy %u", what, m->strategy);
  if (!sg__dtype_valid((int)m->param_dtype) ||
      m->has_master != (m->param_dtype != SG_F32 ? 1u : 0u))
    return CORRUPT("%s: param dtype %u / master flag %u", what, m->param_dtype, m->has_master);
  if (!(m->loss_scale > 0) || isinf(m->loss_scale) || !(m->lr >= 0) || isinf(m->lr) ||
      m->dynamic_scale > 1)
    return CORRUPT("%s: bad optimizer state (loss scale %g, lr %g)", what, m->loss_scale, m->lr);
  /* every parameter takes at least 23 bytes: bounds the allocation for hostile counts */
  if (m->nparams < 1 || m->nparams > rb_left(r) / 23)
    return CORRUPT("%s: %u parameters do not fit in the file", what, m->nparams);
  return SG_OK;
}

static sg_status parse_files(rbuf *r, const char *what, sg__ck_manifest *m) {
  if (m->world > rb_left(r) / 23) return CORRUPT("%s: %u rank files do not fit", what, m->world);
  m->files = calloc(m->world, sizeof *m->files);
  if (!m->files) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (uint32_t k = 0; k < m->world; k++) {
    sg__ck_file *f = &m->files[k];
    SG_TRY(read_name(r, 1, what, &f->name));
    f->bytes = rb_u64(r);
    f->numel = rb_u64(r);
    f->header_crc = rb_u32(r);
    if (r->bad) return CORRUPT("%s: truncated rank file table", what);
    /* at least 12 bytes per element: working (f32) + m + v, or 2 + 4 + 4 + 4 */
    if (f->numel > f->bytes / 12)
      return CORRUPT("%s: rank file %u: %" PRIu64 " elements in %" PRIu64 " bytes", what, k,
                     f->numel, f->bytes);
  }
  return SG_OK;
}

static sg_status parse_frags(rbuf *r, const char *what, const sg__ck_manifest *m, sg__ck_param *p) {
  if (p->nfrags < 1 || p->nfrags > rb_left(r) / 28)
    return CORRUPT("%s: parameter '%s': %u fragments", what, p->name, p->nfrags);
  p->frags = calloc(p->nfrags, sizeof *p->frags);
  if (!p->frags) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  uint64_t next = 0;
  for (uint32_t k = 0; k < p->nfrags; k++) {
    sg__ck_frag *f = &p->frags[k];
    f->rank = rb_u32(r);
    f->param_off = rb_u64(r);
    f->len = rb_u64(r);
    f->elem_off = rb_u64(r);
    if (r->bad) return CORRUPT("%s: truncated fragment table", what);
    if (f->rank >= m->world || f->param_off != next || f->len < 1 || f->len > p->numel - next ||
        f->elem_off > m->files[f->rank].numel || f->len > m->files[f->rank].numel - f->elem_off)
      return CORRUPT("%s: parameter '%s': fragment %u out of place", what, p->name, k);
    next += f->len;
  }
  if (next != p->numel)
    return CORRUPT("%s: parameter '%s': fragments cover %" PRIu64 " of %" PRIu64 " elements", what,
                   p->name, next, p->numel);
  return SG_OK;
}

/* Version 2: the parameter groups' lr and weight decay (finite, >= 0). */
static sg_status parse_groups(rbuf *r, const char *what, sg__ck_manifest *m) {
  m->ngroups = 0;
  if (m->version < 2) return SG_OK;
  const uint32_t ng = rb_u32(r);
  if (r->bad) return CORRUPT("%s: truncated group table", what);
  if (ng > (uint32_t)SG_MAX_GROUPS) return CORRUPT("%s: %u parameter groups", what, ng);
  for (uint32_t g = 0; g < ng; g++) {
    const float lr = f_of(rb_u32(r)), wd = f_of(rb_u32(r));
    if (r->bad) return CORRUPT("%s: truncated group table", what);
    if (!(lr >= 0) || isinf(lr) || !(wd >= 0) || isinf(wd))
      return CORRUPT("%s: group %u: lr %g, weight decay %g", what, g, lr, wd);
    m->group_lr[g] = lr;
    m->group_wd[g] = wd;
  }
  m->ngroups = ng;
  return SG_OK;
}

/* A replica section's record bytes: fp32 (the outer state), or a codec's residuals (r2 and
 * at least two replicas' r1, at most SG_CK_MAX_WORLD). */
static int rep_esz_ok(int k, uint32_t esz) {
  if (esz == 0) return 1;
  if (k != SG_CK_REP_RESID && k != SG_CK_REP_OUTER_RESID) return esz == 4;
  return esz % 4 == 0 && esz >= 12 && esz <= 4 * (SG_CK_MAX_WORLD + 1);
}

/* Version 3: the replica sections' record bytes and the outer period's position. */
static sg_status parse_rep(rbuf *r, const char *what, sg__ck_manifest *m) {
  memset(m->rep_esz, 0, sizeof m->rep_esz);
  m->rep_position = 0;
  if (m->version < 3) return SG_OK;
  for (int k = 0; k < SG_CK_REP_STATES; k++) m->rep_esz[k] = rb_u32(r);
  m->rep_position = rb_u64(r);
  if (r->bad) return CORRUPT("%s: truncated replica state table", what);
  for (int k = 0; k < SG_CK_REP_STATES; k++)
    if (!rep_esz_ok(k, m->rep_esz[k]))
      return CORRUPT("%s: replica section %d of %u bytes per element", what, k, m->rep_esz[k]);
  if (m->rep_position > (uint64_t)INT32_MAX) return CORRUPT("%s: outer position %" PRIu64, what,
                                                            m->rep_position);
  return SG_OK;
}

/* Version 4: each parameter's own step count, at most the step. */
static sg_status parse_steps(rbuf *r, const char *what, sg__ck_manifest *m) {
  if (m->version < 4) return SG_OK;
  if (m->nparams > rb_left(r) / 8) return CORRUPT("%s: truncated step count table", what);
  m->param_steps = malloc((size_t)m->nparams * sizeof *m->param_steps);
  if (!m->param_steps) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (uint32_t i = 0; i < m->nparams; i++) {
    m->param_steps[i] = rb_u64(r);
    if (m->param_steps[i] > m->step)
      return CORRUPT("%s: parameter '%s': step count %" PRIu64 " above the step %" PRIu64, what,
                     m->params[i].name, m->param_steps[i], m->step);
  }
  return SG_OK;
}

static sg_status parse_params(rbuf *r, const char *what, sg__ck_manifest *m) {
  m->params = calloc(m->nparams, sizeof *m->params);
  if (!m->params) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (uint32_t i = 0; i < m->nparams; i++) {
    sg__ck_param *p = &m->params[i];
    SG_TRY(read_name(r, 0, what, &p->name));
    p->numel = rb_u64(r);
    p->flags = rb_u32(r);
    p->dtype = rb_u32(r);
    p->nfrags = rb_u32(r);
    if (r->bad) return CORRUPT("%s: truncated parameter table", what);
    if (p->numel < 1 || p->numel > ((uint64_t)1 << 48) || (p->flags & ~SG_PARAM_NO_DECAY) ||
        p->dtype != m->param_dtype)
      return CORRUPT("%s: parameter '%s': numel %" PRIu64 ", flags %u, dtype %u", what, p->name,
                     p->numel, p->flags, p->dtype);
    SG_TRY(parse_frags(r, what, m, p));
  }
  SG_TRY(parse_groups(r, what, m));
  SG_TRY(parse_rep(r, what, m));
  SG_TRY(parse_steps(r, what, m));
  if (rb_left(r) != 0) return CORRUPT("%s: %zu stray bytes after the tables", what, rb_left(r));
  return SG_OK;
}

/* Names are unique: open addressing over FNV hashes. */
static sg_status check_unique(const char *what, const sg__ck_manifest *m) {
  size_t cap = 16;
  while (cap < 2 * (size_t)m->nparams) cap *= 2;
  int64_t *slot = malloc(cap * sizeof *slot);
  if (!slot) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (size_t k = 0; k < cap; k++) slot[k] = -1;
  sg_status st = SG_OK;
  for (uint32_t i = 0; i < m->nparams && st == SG_OK; i++) {
    const char *n = m->params[i].name;
    size_t h = (size_t)sg__hash_bytes(SG__HASH_INIT, n, strlen(n)) & (cap - 1);
    for (; slot[h] >= 0; h = (h + 1) & (cap - 1))
      if (strcmp(m->params[slot[h]].name, n) == 0) {
        st = CORRUPT("%s: parameter '%s' appears twice", what, n);
        break;
      }
    slot[h] = i;
  }
  free(slot);
  return st;
}

typedef struct {
  uint32_t rank;
  uint64_t off, len;
} run_t;

static int run_cmp(const void *a, const void *b) {
  const run_t *x = a, *y = b;
  if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
  return x->off < y->off ? -1 : x->off > y->off;
}

/* The fragments of each rank file tile its elements exactly: every byte is somebody's. */
static sg_status check_tiling(const char *what, const sg__ck_manifest *m) {
  size_t n = 0;
  for (uint32_t i = 0; i < m->nparams; i++) n += m->params[i].nfrags;
  run_t *runs = malloc((n ? n : 1) * sizeof *runs);
  if (!runs) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  size_t k = 0;
  for (uint32_t i = 0; i < m->nparams; i++)
    for (uint32_t j = 0; j < m->params[i].nfrags; j++) {
      const sg__ck_frag *f = &m->params[i].frags[j];
      runs[k++] = (run_t){f->rank, f->elem_off, f->len};
    }
  qsort(runs, n, sizeof *runs, run_cmp);
  sg_status st = SG_OK;
  uint64_t next = 0;
  uint32_t rank = 0;
  for (size_t j = 0; j <= n && st == SG_OK; j++) {
    const uint32_t r = j < n ? runs[j].rank : m->world;
    for (; rank < r; rank++, next = 0)
      if (next != m->files[rank].numel)
        st = CORRUPT("%s: rank file %u: fragments cover %" PRIu64 " of %" PRIu64 " elements", what,
                     rank, next, m->files[rank].numel);
    if (j < n && st == SG_OK) {
      if (runs[j].off != next) st = CORRUPT("%s: rank file %u: fragments overlap", what, r);
      next = runs[j].off + runs[j].len;
    }
  }
  free(runs);
  return st;
}

sg_status sg__ck_manifest_parse(const uint8_t *buf, size_t len, const char *what,
                                sg__ck_manifest *m) {
  memset(m, 0, sizeof *m);
  rbuf r = {buf, len, 0, 0};
  sg_status st;
  SG_TRY_GOTO(parse_head(&r, what, m), st, fail);
  SG_TRY_GOTO(parse_files(&r, what, m), st, fail);
  SG_TRY_GOTO(parse_params(&r, what, m), st, fail);
  SG_TRY_GOTO(check_unique(what, m), st, fail);
  SG_TRY_GOTO(check_tiling(what, m), st, fail);
  return SG_OK;
fail:
  sg__ck_manifest_free(m);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* rank file header                                                                          */

static uint64_t div_up(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

sg_status sg__ck_header_layout(sg__ck_header *h, const uint32_t *kinds, const uint32_t *elem_bytes,
                               uint32_t nsections) {
  if (nsections < 1 || nsections > SG_CK_KINDS || h->chunk_bytes < SG_CK_CHUNK_MIN ||
      h->numel > ((uint64_t)1 << 56))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "checkpoint header: bad layout request");
  h->nsections = nsections;
  uint64_t nchunks = 0;
  for (uint32_t s = 0; s < nsections; s++) {
    h->sec[s] = (sg__ck_section){kinds[s], elem_bytes[s], 0, h->numel * elem_bytes[s], nchunks};
    nchunks += div_up(h->sec[s].bytes, h->chunk_bytes);
  }
  const uint64_t hb =
      SG_CK_FIXED_HEADER + (uint64_t)SG_CK_SECTION_BYTES * nsections + 4 * nchunks + 4;
  if (hb > UINT32_MAX)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "checkpoint header: %" PRIu64 " chunks are too many",
                   nchunks);
  h->nchunks = nchunks;
  h->header_bytes = (uint32_t)hb;
  uint64_t off = hb;
  for (uint32_t s = 0; s < nsections; s++) {
    h->sec[s].offset = off;
    off += h->sec[s].bytes;
  }
  h->crcs = calloc(nchunks ? nchunks : 1, sizeof *h->crcs);
  if (!h->crcs) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (checksum table)");
  return SG_OK;
}

void sg__ck_header_encode(sg__ck_header *h, uint8_t *buf) {
  memcpy(buf, k_shard_magic, 8);
  put_le(buf + 8, SG_CK_VERSION, 4);
  put_le(buf + 12, h->header_bytes, 4);
  put_le(buf + 16, h->generation, 8);
  put_le(buf + 24, h->plan_hash, 8);
  put_le(buf + 32, h->rank, 4);
  put_le(buf + 36, h->world, 4);
  put_le(buf + 40, h->nsections, 4);
  put_le(buf + 44, h->chunk_bytes, 4);
  put_le(buf + 48, h->numel, 8);
  put_le(buf + 56, h->nchunks, 8);
  uint8_t *p = buf + SG_CK_FIXED_HEADER;
  for (uint32_t s = 0; s < h->nsections; s++, p += SG_CK_SECTION_BYTES) {
    put_le(p, h->sec[s].kind, 4);
    put_le(p + 4, h->sec[s].elem_bytes, 4);
    put_le(p + 8, h->sec[s].offset, 8);
    put_le(p + 16, h->sec[s].bytes, 8);
    put_le(p + 24, h->sec[s].crc_index, 8);
  }
  for (uint64_t c = 0; c < h->nchunks; c++, p += 4) put_le(p, h->crcs[c], 4);
  h->header_crc = sg__crc32c(0, buf, h->header_bytes - 4);
  put_le(p, h->header_crc, 4);
}

sg_status sg__ck_header_size(const uint8_t *fixed, size_t fixed_len, uint64_t file_bytes,
                             const char *what, uint32_t *header_bytes) {
  if (fixed_len < SG_CK_FIXED_HEADER) return CORRUPT("%s: truncated header", what);
  if (memcmp(fixed, k_shard_magic, 8) != 0)
    return CORRUPT("%s: not a shardgrad rank file (bad magic)", what);
  const uint32_t version = (uint32_t)get_le(fixed + 8, 4);
  if (version != SG_CK_VERSION)
    return CORRUPT("%s: format version %u, this library reads version %u", what, version,
                   SG_CK_VERSION);
  const uint32_t hb = (uint32_t)get_le(fixed + 12, 4);
  if (hb < SG_CK_FIXED_HEADER + SG_CK_SECTION_BYTES + 4 || hb > file_bytes)
    return CORRUPT("%s: header size %u in a file of %" PRIu64 " bytes", what, hb, file_bytes);
  *header_bytes = hb;
  return SG_OK;
}

void sg__ck_header_free(sg__ck_header *h) {
  if (!h) return;
  free(h->crcs);
  h->crcs = NULL;
}

/* Working params and fp32 arrays: 2 or 4 bytes; 8-bit state: its records; replica state: as
 * the manifest's table. */
static int elem_bytes_ok(const sg__ck_section *c) {
  if (c->kind >= SG_CK_REP0)
    return c->elem_bytes > 0 && rep_esz_ok((int)(c->kind - SG_CK_REP0), c->elem_bytes);
  if (c->kind >= SG_CK_Q8_STATE0) return c->elem_bytes == SG_CK_Q8_RECORD;
  return c->elem_bytes == 2 || c->elem_bytes == 4;
}

/* Sections follow the header back to back, kinds ascending, chunk tables consecutive. */
static sg_status check_sections(const char *what, const sg__ck_header *h) {
  uint64_t off = h->header_bytes, chunks = 0;
  for (uint32_t s = 0; s < h->nsections; s++) {
    const sg__ck_section *c = &h->sec[s];
    if (c->kind >= SG_CK_KINDS || (s > 0 && c->kind <= h->sec[s - 1].kind) ||
        !elem_bytes_ok(c) || c->bytes != h->numel * c->elem_bytes ||
        c->offset != off || c->crc_index != chunks)
      return CORRUPT("%s: section %u out of place", what, s);
    off += c->bytes;
    chunks += div_up(c->bytes, h->chunk_bytes);
  }
  if (chunks != h->nchunks ||
      h->header_bytes != SG_CK_FIXED_HEADER + SG_CK_SECTION_BYTES * h->nsections + 4 * chunks + 4)
    return CORRUPT("%s: %" PRIu64 " chunk checksums for %" PRIu64 " chunks", what, h->nchunks,
                   chunks);
  return SG_OK;
}

sg_status sg__ck_header_parse(const uint8_t *buf, size_t len, const char *what, sg__ck_header *h) {
  memset(h, 0, sizeof *h);
  uint32_t hb = 0;
  SG_TRY(sg__ck_header_size(buf, len, len, what, &hb));
  if (hb != len) return CORRUPT("%s: header of %u bytes, %zu given", what, hb, len);
  h->header_crc = (uint32_t)get_le(buf + hb - 4, 4);
  if (sg__crc32c(0, buf, hb - 4) != h->header_crc)
    return CORRUPT("%s: header checksum mismatch", what);
  h->header_bytes = hb;
  h->generation = get_le(buf + 16, 8);
  h->plan_hash = get_le(buf + 24, 8);
  h->rank = (uint32_t)get_le(buf + 32, 4);
  h->world = (uint32_t)get_le(buf + 36, 4);
  h->nsections = (uint32_t)get_le(buf + 40, 4);
  h->chunk_bytes = (uint32_t)get_le(buf + 44, 4);
  h->numel = get_le(buf + 48, 8);
  h->nchunks = get_le(buf + 56, 8);
  if (h->nsections < 1 || h->nsections > SG_CK_KINDS || h->chunk_bytes < SG_CK_CHUNK_MIN ||
      h->chunk_bytes > SG_CK_CHUNK_MAX || h->numel > ((uint64_t)1 << 56) || h->world < 1 ||
      h->world > SG_CK_MAX_WORLD || h->rank >= h->world || h->nchunks > (uint64_t)hb / 4 ||
      hb < SG_CK_FIXED_HEADER + SG_CK_SECTION_BYTES * h->nsections + 4)
    return CORRUPT("%s: bad header fields", what);
  const uint8_t *p = buf + SG_CK_FIXED_HEADER;
  for (uint32_t s = 0; s < h->nsections; s++, p += SG_CK_SECTION_BYTES)
    h->sec[s] = (sg__ck_section){(uint32_t)get_le(p, 4), (uint32_t)get_le(p + 4, 4),
                                 get_le(p + 8, 8), get_le(p + 16, 8), get_le(p + 24, 8)};
  SG_TRY(check_sections(what, h));
  h->crcs = malloc((h->nchunks ? h->nchunks : 1) * sizeof *h->crcs);
  if (!h->crcs) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
  for (uint64_t c = 0; c < h->nchunks; c++, p += 4) h->crcs[c] = (uint32_t)get_le(p, 4);
  return SG_OK;
}
