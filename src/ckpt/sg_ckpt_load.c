/* sg_load: at any world size, bucket size or strategy. Each rank intersects the pieces its new
 * shard holds with the manifest's fragments, reads just those ranges (whole checksum chunks
 * around them, each verified) into host staging, and only when every rank has succeeded does
 * any rank copy the staging into the engine and all-gather the working parameters. With
 * sg_load_options.convert_optim_state, optimizer state in the other format than the engine's
 * is read as it is and converted in the staging (sg_ckpt_convert.c). */
#define _DEFAULT_SOURCE /* close, madvise */

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sg_ckpt_engine.h"

#define SG_CK_MANIFEST_MAX ((size_t)1 << 31)

/* Elements [elem, elem+n) of rank file `file` go to staging element `dst` (shard coords). */
typedef struct {
  uint32_t file;
  uint64_t elem, n, dst;
} req_t;

/* The checkpoint's optimizer state against the engine's: the same format, fp32 into an 8-bit
 * engine, 8-bit into an fp32 engine. */
enum { CONV_NONE = 0, CONV_FROM_F32 = 1, CONV_FROM_Q8 = 2 };

typedef struct {
  const char *dir;
  int convert; /* sg_load_options.convert_optim_state */
  int conv;    /* CONV_* */
  size_t nheads; /* CONV_FROM_Q8: block heads read after the staging's opt_numel elements */
  sg__ck_manifest m;
  int *map; /* engine id -> manifest parameter */
  req_t *reqs;
  size_t nreq, cap;
  uint32_t nkinds, kinds[SG_CK_KINDS], esz[SG_CK_KINDS];
  uint32_t nbase;    /* kinds[0..nbase): the parameters' and the optimizer's; then the replica
                        sections this engine loads */
  uint32_t nfile;    /* sections of every rank file: nbase + the manifest's replica sections */
  uint8_t *stage[SG_CK_KINDS]; /* by section index: staging in shard coordinates */
  const char *kind_name[SG_CK_KINDS]; /* by section index: the section's name in messages */
  size_t opt_numel;
} load_ctx;

static void ctx_free(load_ctx *c) {
  sg__ck_manifest_free(&c->m);
  free(c->map);
  free(c->reqs);
  for (int k = 0; k < SG_CK_KINDS; k++) free(c->stage[k]);
}

#define SG__HUGE ((size_t)2 << 20)

/* Zeroed host staging. Large ones are 2 MiB aligned and offered to transparent huge pages: a
 * first touch of hundreds of MiB then takes 512 times fewer page faults. */
static uint8_t *stage_alloc(size_t bytes) {
  if (bytes < 8 * SG__HUGE) return calloc(bytes ? bytes : 1, 1);
  const size_t n = (bytes + SG__HUGE - 1) / SG__HUGE * SG__HUGE;
  uint8_t *p = aligned_alloc(SG__HUGE, n);
  if (!p) return NULL;
#ifdef MADV_HUGEPAGE
  (void)madvise(p, n, MADV_HUGEPAGE);
#endif
  memset(p, 0, bytes);
  return p;
}

/* ---------------------------------------------------------------------------------------- */
/* matching the engine's parameters with the manifest's                                      */

static size_t name_hash(const char *n, size_t mask) {
  return (size_t)sg__hash_bytes(SG__HASH_INIT, n, strlen(n)) & mask;
}

static sg_status map_params(sg_engine *e, load_ctx *c, const char *mpath) {
  const sg__ck_manifest *m = &c->m;
  size_t cap = 16;
  while (cap < 2 * (size_t)m->nparams) cap *= 2;
  int64_t *slot = malloc(cap * sizeof *slot);
  uint8_t *used = calloc(m->nparams, 1);
  c->map = malloc((size_t)e->reg.nparams * sizeof *c->map);
  sg_status st = SG_OK;
  if (!slot || !used || !c->map) {
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
    goto done;
  }
  for (size_t k = 0; k < cap; k++) slot[k] = -1;
  for (uint32_t i = 0; i < m->nparams; i++) {
    size_t h = name_hash(m->params[i].name, cap - 1);
    while (slot[h] >= 0) h = (h + 1) & (cap - 1);
    slot[h] = i;
  }
  for (int id = 0; id < e->reg.nparams && st == SG_OK; id++) {
    int64_t found = -1;
    for (size_t h = name_hash(e->reg.names[id], cap - 1); slot[h] >= 0 && found < 0;
         h = (h + 1) & (cap - 1))
      if (strcmp(m->params[slot[h]].name, e->reg.names[id]) == 0) found = slot[h];
    if (found < 0) {
      st = sg__err(SG_ERR_MISMATCH, "parameter '%s' is not in the checkpoint '%s'", e->reg.names[id],
                   mpath);
      break;
    }
    const sg__ck_param *p = &m->params[found];
    if (p->numel != e->reg.numels[id]) {
      st = sg__err(SG_ERR_MISMATCH, "parameter '%s' has %zu elements, %" PRIu64 " in '%s'",
                   e->reg.names[id], e->reg.numels[id], p->numel, mpath);
      break;
    }
    if (p->flags != e->reg.flags[id])
      SG_LOG(SG_LOG_WARN, e->rank, "sg_load: parameter '%s' has flags %u, %u in '%s'", e->reg.names[id],
             (unsigned)e->reg.flags[id], (unsigned)p->flags, mpath);
    c->map[id] = (int)found;
    used[found] = 1;
  }
  for (uint32_t i = 0; i < m->nparams && st == SG_OK; i++)
    if (!used[i])
      st = sg__err(SG_ERR_MISMATCH, "'%s' holds parameter '%s', which the engine does not have",
                   mpath, m->params[i].name);
done:
  free(slot);
  free(used);
  return st;
}

static sg_status check_manifest(sg_engine *e, load_ctx *c, const char *mpath) {
  if (c->m.param_dtype != (uint32_t)e->cfg.param_dtype)
    return sg__err(SG_ERR_MISMATCH, "'%s' holds %s parameters, the engine's are %s", mpath,
                   sg__dtype_name((sg_dtype)c->m.param_dtype), sg__dtype_name(e->cfg.param_dtype));
  return map_params(e, c, mpath);
}

/* ---------------------------------------------------------------------------------------- */
/* what this rank reads                                                                      */

static sg_status add_req(load_ctx *c, req_t r) {
  if (c->nreq == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 256;
    req_t *n = realloc(c->reqs, cap * sizeof *n);
    if (!n) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
    c->reqs = n;
    c->cap = cap;
  }
  c->reqs[c->nreq++] = r;
  return SG_OK;
}

typedef struct {
  load_ctx *c;
  int id;
} piece_arg;

/* A piece of the new shard against the saved fragments of the same parameter. */
static sg_status add_piece(sg_engine *e, const sg__piece *pc, void *arg) {
  const piece_arg *a = arg;
  const sg__ck_param *p = &a->c->m.params[a->c->map[a->id]];
  const uint64_t lo = pc->param_off, hi = pc->param_off + pc->len;
  for (uint32_t k = 0; k < p->nfrags; k++) {
    const sg__ck_frag *f = &p->frags[k];
    const uint64_t x0 = lo > f->param_off ? lo : f->param_off;
    const uint64_t x1 = hi < f->param_off + f->len ? hi : f->param_off + f->len;
    if (x0 >= x1) continue;
    SG_TRY(add_req(a->c, (req_t){f->rank, f->elem_off + (x0 - f->param_off), x1 - x0,
                                 pc->opt_off + (x0 - lo)}));
  }
  return SG_OK;
}

static int req_cmp(const void *x, const void *y) {
  const req_t *a = x, *b = y;
  if (a->file != b->file) return a->file < b->file ? -1 : 1;
  return a->elem < b->elem ? -1 : a->elem > b->elem;
}

/* The replica transport's sections: those of the checkpoint that this engine keeps are read;
 * the others are said once (INFO): a state the checkpoint lacks begins afresh (a checkpoint
 * of a library before them, or of an engine without that mode), one the engine does not keep
 * is left. */
static void plan_replica_reads(sg_engine *e, load_ctx *c) {
  sg__rep_ck mine;
  sg__replicas_ck_describe(e, &mine);
  uint32_t want[SG_CK_REP_STATES] = {0};
  for (int k = 0; k < SG_CK_REP_STATES; k++) {
    const int in_file = c->m.rep_esz[k] != 0, kept = mine.esz[k] != 0;
    if (in_file && kept) want[k] = c->m.rep_esz[k];
    if (in_file != kept && sg__ck_lead(e))
      SG_LOG(SG_LOG_INFO, e->rank, "sg_load: '%s' %s %s%s", c->dir, in_file ? "holds" : "has no",
             sg__ck_rep_name(k), in_file ? ", which this engine does not keep: not loaded"
                                         : ": it begins afresh (docs/slow-links.md)");
  }
  c->nkinds += sg__ck_rep_kinds(want, c->kinds + c->nkinds, c->esz + c->nkinds);
}

/* The record of the block a piece begins inside, after the staging's elements. */
static sg_status add_head(sg_engine *e, const sg__piece *pc, void *arg) {
  piece_arg *a = arg;
  size_t head = 0;
  if (!sg__ck_piece_head(pc, &head)) return SG_OK;
  const sg__piece h = {head, a->c->opt_numel + a->c->nheads++, 1};
  return add_piece(e, &h, arg);
}

static sg_status read_header(int fd, uint64_t bytes, const char *path, sg__ck_header *h);

/* *q8: 1 when rank file 0's last optimizer section (before any replica section) is 8-bit
 * optimizer state. */
static sg_status file_is_q8(const load_ctx *c, int *q8) {
  char *path = sg__ck_path(c->dir, c->m.files[0].name);
  if (!path) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  int fd = -1;
  uint64_t bytes = 0;
  sg__ck_header h = {0};
  sg_status st = sg__ck_open_read(path, 0, &fd, &bytes);
  if (st == SG_OK) st = read_header(fd, bytes, path, &h);
  if (st == SG_OK && h.nsections < c->nbase)
    st = sg__err(SG_ERR_CORRUPT, "'%s': %u sections, expected at least %u", path, h.nsections,
                 c->nbase);
  if (st == SG_OK) *q8 = sg__ck_kind_q8(h.sec[c->nbase - 1].kind) >= 0;
  if (fd >= 0) close(fd);
  sg__ck_header_free(&h);
  free(path);
  return st;
}

/* An optimizer state section's kind in the other format (fp32 <-> 8-bit records), its element
 * size into *esz. */
static uint32_t other_kind(uint32_t kind, uint32_t *esz) {
  const int q = sg__ck_kind_q8(kind);
  *esz = q >= 0 ? 4 : SG_CK_Q8_RECORD;
  return q >= 0 ? SG_CK_STATE0 + (uint32_t)q : SG_CK_Q8_STATE0 + (kind - SG_CK_STATE0);
}

/* The format of the checkpoint's optimizer state, from rank file 0's header (check_header then
 * holds every file read to the same sections): the engine's, or with convert_optim_state the
 * other one, whose sections this load reads (and converts after reading). */
static sg_status match_format(load_ctx *c) {
  int file_q8 = 0;
  SG_TRY(file_is_q8(c, &file_q8));
  const int mine_q8 = sg__ck_kind_q8(c->kinds[c->nbase - 1]) >= 0;
  if (file_q8 == mine_q8) return SG_OK;
  if (!c->convert)
    return sg__err(SG_ERR_MISMATCH, "'%s' holds %s optimizer state, this engine keeps it in %s "
                   "(cfg->optim_state_dtype); sg_load_ex with sg_load_options.convert_optim_state "
                   "= 1 converts it", c->dir, file_q8 ? "8-bit" : "fp32",
                   mine_q8 ? "8 bits" : "fp32");
  for (uint32_t s = 0; s < c->nbase; s++)
    if (c->kinds[s] >= SG_CK_STATE0) c->kinds[s] = other_kind(c->kinds[s], &c->esz[s]);
  c->conv = file_q8 ? CONV_FROM_Q8 : CONV_FROM_F32;
  return SG_OK;
}

static sg_status plan_reads(sg_engine *e, load_ctx *c) {
  c->nkinds = c->nbase = sg__ck_kinds(e, c->kinds, c->esz);
  c->opt_numel = e->lay.opt_numel;
  SG_TRY(match_format(c));
  uint32_t fk[SG_CK_KINDS], fe[SG_CK_KINDS];
  c->nfile = c->nbase + sg__ck_rep_kinds(c->m.rep_esz, fk, fe);
  plan_replica_reads(e, c);
  for (int id = 0; id < e->reg.nparams; id++) {
    piece_arg a = {c, id};
    SG_TRY(sg__engine_for_pieces(e, id, add_piece, &a));
    if (c->conv == CONV_FROM_Q8) SG_TRY(sg__engine_for_pieces(e, id, add_head, &a));
  }
  if (c->nreq > 1) qsort(c->reqs, c->nreq, sizeof *c->reqs, req_cmp);
  for (uint32_t s = 0; s < c->nkinds; s++) {
    c->kind_name[s] = sg__ck_kind_name(e, c->kinds[s]);
    c->stage[s] = stage_alloc((c->opt_numel + c->nheads) * c->esz[s]);
    if (!c->stage[s])
      return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory for the staging of %zu elements",
                     c->opt_numel);
  }
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* reading one rank file                                                                     */

typedef struct {
  int fd;
  const char *path;
  const sg__ck_header *h;
  const sg__ck_section *sec;
  uint8_t *cache;  /* one verified chunk */
  uint64_t cached; /* its index + 1; 0: none */
  const char *sec_name; /* the section's name in messages */
} creader;

static sg_status bad_chunk(const creader *r, uint64_t k) {
  return sg__err(SG_ERR_CORRUPT,
                 "'%s': checksum mismatch in the %s section, chunk %" PRIu64 " (bytes %" PRIu64
                 "..)",
                 r->path, r->sec_name, k, r->sec->offset + k * r->h->chunk_bytes);
}

static sg_status verify(const creader *r, uint64_t k, const uint8_t *data, size_t n) {
  return sg__crc32c(0, data, n) == r->h->crcs[r->sec->crc_index + k] ? SG_OK : bad_chunk(r, k);
}

static sg_status load_chunk(creader *r, uint64_t k) {
  if (r->cached == k + 1) return SG_OK;
  const uint64_t cb = r->h->chunk_bytes, s = k * cb;
  const size_t n = (size_t)(r->sec->bytes - s < cb ? r->sec->bytes - s : cb);
  r->cached = 0;
  SG_TRY(sg__ck_read_at(r->fd, r->cache, n, r->sec->offset + s, r->path));
  SG_TRY(verify(r, k, r->cache, n));
  r->cached = k + 1;
  return SG_OK;
}

/* Bytes [b0, b1) of the section into dst: whole chunks straight into dst (one read for a run
 * of them), partial ones through the cache, every chunk verified. */
static sg_status read_range(creader *r, uint64_t b0, uint64_t b1, uint8_t *dst) {
  const uint64_t cb = r->h->chunk_bytes, end = r->sec->bytes;
  while (b0 < b1) {
    const uint64_t k = b0 / cb, cs = k * cb, ce = cs + cb < end ? cs + cb : end;
    if (b0 == cs && b1 >= ce) {
      uint64_t e = ce; /* extend over the following chunks that are wholly inside */
      while (e < b1) {
        const uint64_t ne = e + cb < end ? e + cb : end;
        if (ne > b1) break;
        e = ne;
      }
      SG_TRY(sg__ck_read_at(r->fd, dst, (size_t)(e - b0), r->sec->offset + b0, r->path));
      for (uint64_t o = b0; o < e; o += cb)
        SG_TRY(verify(r, o / cb, dst + (o - b0), (size_t)(e - o < cb ? e - o : cb)));
      dst += e - b0;
      b0 = e;
    } else {
      SG_TRY(load_chunk(r, k));
      const uint64_t n = (b1 < ce ? b1 : ce) - b0;
      memcpy(dst, r->cache + (b0 - cs), (size_t)n);
      dst += n;
      b0 += n;
    }
  }
  return SG_OK;
}

/* The file's header against the manifest's record of it and against this engine's sections. */
static sg_status check_header(const load_ctx *c, uint32_t r, const sg__ck_header *h, uint64_t bytes,
                              const char *path) {
  const sg__ck_file *f = &c->m.files[r];
  if (h->header_crc != f->header_crc || h->generation != c->m.generation || h->rank != r ||
      h->world != c->m.world || h->plan_hash != c->m.plan_hash || h->numel != f->numel)
    return sg__err(SG_ERR_CORRUPT,
                   "'%s' does not belong to this checkpoint (its header differs "
                   "from the manifest's record)",
                   path);
  if (h->nsections != c->nfile)
    return sg__err(SG_ERR_CORRUPT, "'%s': %u sections, expected %u", path, h->nsections, c->nfile);
  for (uint32_t s = 0; s < c->nbase; s++)
    if (h->sec[s].kind != c->kinds[s] || h->sec[s].elem_bytes != c->esz[s])
      return sg__err(SG_ERR_CORRUPT, "'%s': section %u is not the expected one", path, s);
  for (uint32_t s = c->nbase; s < c->nfile; s++) { /* the manifest's replica sections */
    const int k = sg__ck_kind_rep(h->sec[s].kind);
    if (k < 0 || h->sec[s].elem_bytes != c->m.rep_esz[k])
      return sg__err(SG_ERR_CORRUPT, "'%s': section %u is not the expected one", path, s);
  }
  const sg__ck_section *last = &h->sec[h->nsections - 1];
  if (last->offset + last->bytes != bytes)
    return sg__err(SG_ERR_CORRUPT, "'%s': %" PRIu64 " bytes, the header describes %" PRIu64, path,
                   bytes, last->offset + last->bytes);
  return SG_OK;
}

static sg_status read_header(int fd, uint64_t bytes, const char *path, sg__ck_header *h) {
  uint8_t fixed[SG_CK_FIXED_HEADER];
  uint32_t hb = 0;
  if (bytes < sizeof fixed)
    return sg__err(SG_ERR_CORRUPT, "'%s' is truncated (%" PRIu64 " bytes)", path, bytes);
  SG_TRY(sg__ck_read_at(fd, fixed, sizeof fixed, 0, path));
  SG_TRY(sg__ck_header_size(fixed, sizeof fixed, bytes, path, &hb));
  uint8_t *buf = malloc(hb);
  if (!buf) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (%u bytes)", hb);
  sg_status st = sg__ck_read_at(fd, buf, hb, 0, path);
  if (st == SG_OK) st = sg__ck_header_parse(buf, hb, path, h);
  free(buf);
  return st;
}

/* Requests [q0, q1) of file r, section by section. */
/* The file's section of `kind` (check_header found every kind read there). */
static const sg__ck_section *section_of(const sg__ck_header *h, uint32_t kind) {
  for (uint32_t s = 0; s < h->nsections; s++)
    if (h->sec[s].kind == kind) return &h->sec[s];
  return &h->sec[0];
}

static sg_status read_sections(load_ctx *c, creader *rd, size_t q0, size_t q1) {
  for (uint32_t s = 0; s < c->nkinds; s++) {
    rd->sec = section_of(rd->h, c->kinds[s]);
    rd->cached = 0;
    rd->sec_name = c->kind_name[s];
    const uint64_t es = c->esz[s];
    for (size_t q = q0; q < q1; q++) {
      const req_t *rq = &c->reqs[q];
      SG_TRY(read_range(rd, rq->elem * es, (rq->elem + rq->n) * es, c->stage[s] + rq->dst * es));
    }
  }
  return SG_OK;
}

static sg_status read_rank_file(load_ctx *c, uint32_t r, size_t q0, size_t q1) {
  const sg__ck_file *f = &c->m.files[r];
  char *path = sg__ck_path(c->dir, f->name);
  if (!path) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  int fd = -1;
  uint64_t bytes = 0;
  sg__ck_header h = {0};
  creader rd = {-1, path, &h, NULL, NULL, 0, NULL};
  sg_status st;
  SG_TRY_GOTO(sg__ck_open_read(path, 0, &fd, &bytes), st, done);
  rd.fd = fd;
  if (bytes != f->bytes) {
    st =
        sg__err(SG_ERR_CORRUPT,
                "'%s' has %" PRIu64 " bytes, the manifest says %" PRIu64 " (truncated or replaced)",
                path, bytes, f->bytes);
    goto done;
  }
  SG_TRY_GOTO(read_header(fd, bytes, path, &h), st, done);
  SG_TRY_GOTO(check_header(c, r, &h, bytes, path), st, done);
  if (q0 < q1) {
    rd.cache = malloc(h.chunk_bytes);
    if (!rd.cache) {
      st = sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
      goto done;
    }
    st = read_sections(c, &rd, q0, q1);
  }
done:
  if (fd >= 0) close(fd);
  free(rd.cache);
  sg__ck_header_free(&h);
  free(path);
  return st;
}

/* Files this rank needs, plus (header only) the files r with r % world == rank, so that every
 * file of the checkpoint is checked by somebody even when nobody needs its data. */
static sg_status read_files(sg_engine *e, load_ctx *c) {
  size_t q = 0;
  for (uint32_t r = 0; r < c->m.world; r++) {
    const size_t q0 = q;
    while (q < c->nreq && c->reqs[q].file == r) q++;
    if (q > q0 || r % (uint32_t)e->world == (uint32_t)e->rank) SG_TRY(read_rank_file(c, r, q0, q));
  }
  return SG_OK;
}

/* The optimizer state read in the other format converted into the engine's, in the staging. */
static sg_status convert_states(sg_engine *e, load_ctx *c) {
  for (uint32_t s = 1; c->conv != CONV_NONE && s < c->nbase; s++) {
    if (c->kinds[s] < SG_CK_STATE0) continue;
    const int q = sg__ck_kind_q8(c->kinds[s]);
    uint8_t *to = NULL;
    sg_status st;
    if (q >= 0)
      st = sg__ck_f32_of_records(e, q, c->stage[s], c->opt_numel, (float **)&to);
    else
      st = sg__ck_records_of_f32((const float *)c->stage[s], c->opt_numel, &to);
    free(c->stage[s]);
    c->stage[s] = to;
    SG_TRY(st);
    c->kinds[s] = other_kind(c->kinds[s], &c->esz[s]);
  }
  return SG_OK;
}

/* 8-bit state: the records read are of the classes this engine's blocks have (before any rank
 * applies anything; converted fp32 values fit any block). */
static sg_status check_records(sg_engine *e, const load_ctx *c) {
  for (uint32_t s = 1; c->conv == CONV_NONE && s < c->nbase; s++) {
    const int q8 = sg__ck_kind_q8(c->kinds[s]);
    if (q8 >= 0) SG_TRY(e->strat->place->records(e, q8, c->stage[s], SG__REC_CHECK));
  }
  return SG_OK;
}

static sg_status load_local(sg_engine *e, const char *dir, load_ctx *c) {
  c->dir = dir;
  char *mpath = sg__ck_path(dir, SG_CK_MANIFEST_NAME);
  if (!mpath) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_load: out of host memory");
  uint8_t *buf = NULL;
  size_t len = 0;
  sg_status st;
  SG_TRY_GOTO(sg__ck_read_file(mpath, SG_CK_MANIFEST_MAX, &buf, &len), st, done);
  SG_TRY_GOTO(sg__ck_manifest_parse(buf, len, mpath, &c->m), st, done);
  SG_TRY_GOTO(check_manifest(e, c, mpath), st, done);
  SG_TRY_GOTO(plan_reads(e, c), st, done);
  SG_TRY_GOTO(read_files(e, c), st, done);
  SG_TRY_GOTO(convert_states(e, c), st, done);
  st = check_records(e, c);
done:
  if (st != SG_OK) sg__err_prefix(st, "sg_load");
  free(buf);
  free(mpath);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* applying (every rank succeeded)                                                           */

static sg_status h2d(sg_engine *e, void *dst, const void *src, size_t bytes) {
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, dst, src, bytes, SG_COPY_H2D);
}

/* State arrays whole (staging is zero where the engine keeps padding); working params: the
 * part of every bucket this rank owns (the gathers fill the rest). */
static sg_status apply_arrays(sg_engine *e, const load_ctx *c) {
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  for (uint32_t s = 1; s < c->nbase; s++) {
    const int q8 = sg__ck_kind_q8(c->kinds[s]);
    if (q8 >= 0)
      SG_TRY(e->strat->place->records(e, q8, c->stage[s],
                                      c->conv == CONV_FROM_F32 ? SG__REC_CODE : SG__REC_LOAD));
    else
      SG_TRY(h2d(e, sg__ck_state_array(e, c->kinds[s]), c->stage[s], c->opt_numel * 4));
  }
  for (int b = 0; b < e->plan->nbuckets; b++) {
    sg__owned o;
    e->strat->owned(e->plan, e->rank, b, &o);
    SG_TRY(h2d(e, e->params + o.flat0 * P, c->stage[0] + o.state0 * P, o.n * P));
  }
  return SG_OK;
}

static sg_status apply(sg_engine *e, const load_ctx *c) {
  /* Parameter groups (manifest version 2); an older checkpoint gives every group its lr. The
   * step first: converted fp32 state is coded with the loaded step's random bits. */
  sg__optim_restore(e, c->m.step, c->m.lr, c->m.ngroups, c->m.group_lr, c->m.group_wd);
  SG_TRY(apply_arrays(e, c));
  /* Gradients accumulated before the load belong to the old state. */
  SG_TRY(sg__grads_clear(e));
  SG_TRY(sg__ck_gather_params(e));
  /* a codec's residuals, the outer state and period: the checkpoint's, or afresh */
  sg__rep_ck ck = {.position = c->m.rep_position};
  for (uint32_t s = c->nbase; s < c->nkinds; s++) {
    const int k = sg__ck_kind_rep(c->kinds[s]);
    ck.esz[k] = c->esz[s];
    ck.rec[k] = c->stage[s];
  }
  sg__replicas_restore(e, &ck);
  /* Per-parameter step counts (version 4, by name; sg__optim_restore above gave every one the
   * step): a manifest without them keeps that. A state that cannot skip parameters (offload,
   * 8-bit) could never step with unequal counts: every parameter takes the step there, said in a
   * warning (docs/limits.md). */
  if (c->m.param_steps && !e->strat->place->skips)
    SG_LOG(SG_LOG_WARN, e->rank, "sg_load: the checkpoint's per-parameter step counts differ "
           "(parameters skipped for want of a gradient); this optimizer state ('%s') cannot keep "
           "them: every parameter continues from step %" PRIu64, e->strat->place->name, c->m.step);
  for (int id = 0; c->m.param_steps && e->strat->place->skips && id < e->reg.nparams; id++)
    sg__optim_restore_param_step(e, id, c->m.param_steps[c->map[id]]);
  sg__scale_restore(e, (int)c->m.dynamic_scale, c->m.loss_scale, c->m.clean_steps);
  return SG_OK;
}

sg_status sg_load_options_init(sg_load_options *opt, size_t struct_size) {
  if (!opt) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_load_options_init: opt is NULL");
  if (struct_size != sizeof *opt)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_load_options_init: struct_size %zu, expected %zu",
                   struct_size, sizeof *opt);
  memset(opt, 0, sizeof *opt);
  opt->struct_size = sizeof *opt;
  return SG_OK;
}

static sg_status check_options(const sg_load_options *o, const char *fn) {
  if (!o) return SG_OK;
  if (o->struct_size != sizeof *o)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: opt->struct_size %zu, expected %zu (fill it "
                   "with sg_load_options_init)", fn, o->struct_size, sizeof *o);
  if (o->convert_optim_state != 0 && o->convert_optim_state != 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: opt->convert_optim_state must be 0 or 1 (is %d)",
                   fn, o->convert_optim_state);
  if (o->reserved != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: opt->reserved must be 0 (is %d)", fn, o->reserved);
  return SG_OK;
}

/* sg_load and sg_load_ex, inside their guard. */
static sg_status load(sg_engine *e, const char *dir, const sg_load_options *opt, const char *fn) {
  /* As in sg_save: a rank in the middle of a micro-batch (or with bad options) fails alone. */
  SG_TRY(check_options(opt, fn));
  SG_TRY(sg__ck_check_call(e, dir, "dir", 1, fn));
  load_ctx c;
  memset(&c, 0, sizeof c);
  c.convert = opt ? opt->convert_optim_state : 0;
  const sg_status local = load_local(e, dir, &c);
  const uint64_t v[4] = {c.m.generation, c.m.step, 0, 0};
  sg__ck_vote *all = NULL;
  sg_status st = sg__ck_agree(e, fn, local, v, &all);
  for (int r = 1; st == SG_OK && r < sg__replicas_world(e); r++)
    if (all[r].val[0] != all[0].val[0])
      st = sg__err(SG_ERR_MISMATCH,
                   "%s: ranks read different checkpoints from '%s' (generation "
                   "%" PRIu64 " on rank 0, %" PRIu64 " on rank %d)",
                   fn, dir, all[0].val[0], all[r].val[0], r);
  free(all);
  if (st == SG_OK) {
    st = apply(e, &c);
    if (st != SG_OK) {
      sg__err_prefix(st, fn);
      sg__engine_broken(e, st);
    }
  }
  if (st == SG_OK)
    SG_LOG(SG_LOG_INFO, e->rank, "loaded step %" PRIu64 " from '%s' (saved at world %u)", c.m.step,
           dir, c.m.world);
  ctx_free(&c);
  return st;
}

sg_status sg_load(sg_engine *e, const char *dir) {
  SG_ENGINE_GUARD(e, "sg_load");
  return load(e, dir, NULL, "sg_load");
}

sg_status sg_load_ex(sg_engine *e, const char *dir, const sg_load_options *opt) {
  SG_ENGINE_GUARD(e, "sg_load_ex");
  return load(e, dir, opt, "sg_load_ex");
}
