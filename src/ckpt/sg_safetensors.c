/* sg_export / sg_import: the full fp32 master parameters by name in the safetensors format
 * (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N
 * bytes of JSON {"name": {"dtype": "F32", "shape": [numel], "data_offsets": [begin, end]},
 * ..., "__metadata__": {...}}, then the data, offsets relative to the end of the header.
 * Shapes are 1-D: the engine knows element counts, not shapes; callers reshape. */
#define _POSIX_C_SOURCE 200809L /* close, unlink, open flags */

#include "sg_safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sg_ckpt_engine.h"

#define SG_ST_BLOCK (16u << 20) /* host bytes per device copy when writing */

/* ---------------------------------------------------------------------------------------- */
/* JSON text                                                                                 */

static void sb_str(sg__ck_buf *b, const char *s) { sg__ck_buf_add(b, s, strlen(s)); }

/* A JSON string literal: quotes, backslashes and control characters escaped. */
static void sb_json_string(sg__ck_buf *b, const char *s) {
  sg__ck_buf_add(b, "\"", 1);
  for (; *s; s++) {
    const unsigned char ch = (unsigned char)*s;
    char esc[8];
    if (ch == '"' || ch == '\\') {
      esc[0] = '\\';
      esc[1] = (char)ch;
      sg__ck_buf_add(b, esc, 2);
    } else if (ch < 0x20) {
      snprintf(esc, sizeof esc, "\\u%04x", ch);
      sg__ck_buf_add(b, esc, 6);
    } else {
      sg__ck_buf_add(b, s, 1);
    }
  }
  sg__ck_buf_add(b, "\"", 1);
}

/* Data offsets in plan order (the order the data are gathered and written). */
static sg_status export_header(const sg_engine *e, uint8_t **out, size_t *len) {
  const sg__plan *p = e->plan;
  uint64_t *begin = malloc((size_t)e->reg.nparams * sizeof *begin);
  if (!begin) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  uint64_t off = 0;
  for (int k = 0; k < e->reg.nparams; k++) {
    begin[p->order[k]] = off;
    off += (uint64_t)e->reg.numels[p->order[k]] * 4;
  }
  sg__ck_buf b = {0};
  sb_str(&b, "        {\"__metadata__\":{\"format\":\"pt\",\"producer\":\"shardgrad\",\"step\":\"");
  char num[96];
  snprintf(num, sizeof num, "%" PRIu64 "\"}", e->opt.step);
  sb_str(&b, num);
  for (int id = 0; id < e->reg.nparams; id++) {
    sb_str(&b, ",");
    sb_json_string(&b, e->reg.names[id]);
    snprintf(num, sizeof num,
             ":{\"dtype\":\"F32\",\"shape\":[%zu],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
             e->reg.numels[id], begin[id], begin[id] + (uint64_t)e->reg.numels[id] * 4);
    sb_str(&b, num);
  }
  sb_str(&b, "}");
  while (b.len % 8) sb_str(&b, " "); /* the data start 8-byte aligned */
  free(begin);
  if (b.oom) {
    free(b.p);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  for (int i = 0; i < 8; i++) b.p[i] = (uint8_t)((uint64_t)(b.len - 8) >> (8 * i));
  *out = b.p;
  *len = b.len;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* export                                                                                    */

typedef struct {
  int fd; /* rank 0's temporary file, -1 elsewhere */
  char *tmp;
  uint64_t pos;  /* next write offset */
  sg_status wst; /* rank 0's first write failure; gathering continues so ranks stay in step */
  uint8_t *host; /* SG_ST_BLOCK bytes */
  float *gbuf;   /* device: one bucket of master values (sharded bf16/f16 at W > 1) */
} exporter;

static int needs_gather(const sg_engine *e) {
  return e->opt.master && e->strat->shard->sharded && e->world > 1;
}

/* rank 0: numel f32 values of device memory to the file. */
static void write_values(sg_engine *e, exporter *x, const float *src, size_t numel) {
  for (size_t done = 0; done < numel && x->wst == SG_OK;) {
    const size_t n = numel - done < SG_ST_BLOCK / 4 ? numel - done : SG_ST_BLOCK / 4;
    x->wst = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, x->host, src + done, n * 4, SG_COPY_D2H);
    if (x->wst == SG_OK) x->wst = sg__ck_write_at(x->fd, x->host, n * 4, x->pos, x->tmp);
    x->pos += n * 4;
    done += n;
  }
}

/* Bucket b's master values in full, then rank 0 writes its parameters (plan order). */
static sg_status export_bucket(sg_engine *e, exporter *x, int b) {
  const sg__plan *p = e->plan;
  const sg__bucket *bk = &p->buckets[b];
  const float *base = NULL; /* element bk->start of the bucket */
  if (needs_gather(e)) {
    SG_TRY(e->strat->shard->gather_state(e, b, e->opt.master, x->gbuf));
    base = x->gbuf;
  } else {
    /* f32: the working params are the master (full on every rank); NO_SHARD or one rank: the
     * master is indexed by flat offset */
    base = (e->opt.master ? e->opt.master : (const float *)e->params) + bk->start;
  }
  if (!sg__ck_lead(e)) return SG_OK;
  for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
    const int id = p->order[k];
    write_values(e, x, base + (p->params[id].offset - bk->start), e->reg.numels[id]);
  }
  return SG_OK;
}

static char *parent_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  if (!slash) return sg__ck_path(".", "");
  const size_t n = slash == path ? 1 : (size_t)(slash - path);
  char *d = malloc(n + 1);
  if (d) {
    memcpy(d, path, n);
    d[n] = 0;
  }
  return d;
}

/* rank 0: temporary file with the header written. */
static sg_status export_open(sg_engine *e, const char *path, exporter *x) {
  x->tmp = malloc(strlen(path) + 5);
  x->host = malloc(SG_ST_BLOCK);
  if (!x->tmp || !x->host) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  snprintf(x->tmp, strlen(path) + 5, "%s.tmp", path);
  uint8_t *hdr = NULL;
  size_t len = 0;
  SG_TRY(export_header(e, &hdr, &len));
  sg_status st = sg__ck_open_write(x->tmp, &x->fd);
  if (st == SG_OK) {
    st = sg__ck_write_at(x->fd, hdr, len, 0, x->tmp);
    x->pos = len;
  }
  free(hdr);
  return st;
}

static sg_status export_close(exporter *x, const char *path) {
  sg_status st = x->wst;
  const int fd = x->fd;
  x->fd = -1;
  if (st == SG_OK)
    st = sg__ck_fsync_close(fd, x->tmp);
  else
    close(fd);
  if (st == SG_OK) st = sg__ck_rename(x->tmp, path);
  if (st == SG_OK) {
    char *dir = parent_dir(path);
    st = dir ? sg__ck_fsync_dir(dir) : sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
    free(dir);
  }
  if (st != SG_OK) unlink(x->tmp);
  return st;
}

static void export_free(sg_engine *e, exporter *x) {
  if (x->fd >= 0) {
    close(x->fd);
    unlink(x->tmp);
  }
  if (x->gbuf) e->dev->ops->free(e->dev, x->gbuf);
  free(x->tmp);
  free(x->host);
}

sg_status sg_export(sg_engine *e, const char *path) {
  SG_ENGINE_GUARD(e, "sg_export");
  static const char *fn = "sg_export";
  SG_TRY(sg__ck_check_call(e, path, "path", 1, fn));
  exporter x = {-1, NULL, 0, SG_OK, NULL, NULL};
  /* Round 1: everybody has its gather buffer and rank 0 its file, or nobody gathers. */
  sg_status local = SG_OK;
  if (needs_gather(e))
    local = e->dev->ops->alloc(e->dev, e->plan->max_bucket_numel * 4, (void **)&x.gbuf);
  if (local == SG_OK && sg__ck_lead(e)) local = export_open(e, path, &x);
  if (local != SG_OK) sg__err_prefix(local, fn);
  sg__ck_vote *all = NULL;
  sg_status st = sg__ck_agree(e, fn, local, NULL, &all);
  free(all);
  for (int b = 0; st == SG_OK && b < e->plan->nbuckets; b++) st = export_bucket(e, &x, b);
  if (st != SG_OK) { /* a device or comm failure: the engine says which */
    export_free(e, &x);
    return sg__err_prefix(st, fn);
  }
  /* Round 2: rank 0's file is durable under its name. */
  local = sg__ck_lead(e) ? export_close(&x, path) : SG_OK;
  if (local != SG_OK) sg__err_prefix(local, fn);
  st = sg__ck_agree(e, fn, local, NULL, &all);
  free(all);
  export_free(e, &x);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* import                                                                                    */

typedef struct {
  int fd;
  const char *path;
  uint64_t data_off, data_bytes;
  sg__st_entry *ent;
  size_t nent;
  int *map; /* engine id -> entry */
} importer;

static void import_free(importer *im) {
  if (im->fd >= 0) close(im->fd);
  sg__st_entries_free(im->ent, im->nent);
  free(im->map);
}

static sg_status import_header(importer *im) {
  uint64_t bytes = 0;
  SG_TRY(sg__ck_open_read(im->path, 1, &im->fd, &bytes));
  uint8_t n8[8];
  if (bytes < 8) return sg__err(SG_ERR_CORRUPT, "'%s' is too short for safetensors", im->path);
  SG_TRY(sg__ck_read_at(im->fd, n8, 8, 0, im->path));
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | n8[i];
  if (n > SG_ST_MAX_HEADER)
    return sg__err(SG_ERR_CORRUPT,
                   "'%s': header length %" PRIu64 " is above the format's limit of %" PRIu64
                   " bytes",
                   im->path, n, SG_ST_MAX_HEADER);
  if (n > bytes - 8)
    return sg__err(SG_ERR_CORRUPT,
                   "'%s': header length %" PRIu64 " exceeds the file (%" PRIu64 " bytes)",
                   im->path, n, bytes);
  char *hdr = malloc((size_t)n + 1);
  if (!hdr) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  sg_status st = sg__ck_read_at(im->fd, hdr, (size_t)n, 8, im->path);
  if (st == SG_OK) st = sg__st_parse_header(hdr, (size_t)n, im->path, &im->ent, &im->nent);
  free(hdr);
  im->data_off = 8 + n;
  im->data_bytes = bytes - 8 - n;
  if (st == SG_OK) st = sg__st_check_layout(im->ent, im->nent, im->data_bytes, im->path);
  return st;
}

static sg_status match_entry(sg_engine *e, importer *im, int id) {
  const sg__st_entry *t = sg__st_find(im->ent, im->nent, e->reg.names[id]);
  if (!t) return sg__err(SG_ERR_MISMATCH, "parameter '%s' is not in '%s'", e->reg.names[id], im->path);
  if (t->dtype < 0)
    return sg__err(SG_ERR_MISMATCH, "tensor '%s' in '%s' has dtype %s; F32, BF16 or F16 needed",
                   t->name, im->path, t->dtype_name);
  if (t->numel != e->reg.numels[id])
    return sg__err(SG_ERR_MISMATCH,
                   "tensor '%s' in '%s' has %" PRIu64
                   " elements, the "
                   "parameter %zu",
                   t->name, im->path, t->numel, e->reg.numels[id]);
  if (t->end > im->data_bytes || t->end - t->begin != t->numel * sg__dtype_size(t->dtype))
    return sg__err(SG_ERR_CORRUPT,
                   "'%s': tensor '%s' has data offsets [%" PRIu64 ", %" PRIu64 "] for %" PRIu64
                   " elements in %" PRIu64 " data bytes",
                   im->path, t->name, t->begin, t->end, t->numel, im->data_bytes);
  im->map[id] = (int)(t - im->ent);
  return SG_OK;
}

static sg_status import_check(sg_engine *e, importer *im) {
  SG_TRY(import_header(im));
  im->map = malloc((size_t)e->reg.nparams * sizeof *im->map);
  if (!im->map) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  for (int id = 0; id < e->reg.nparams; id++) SG_TRY(match_entry(e, im, id));
  return SG_OK;
}

static sg_status import_values(sg_engine *e, importer *im) {
  for (int id = 0; id < e->reg.nparams; id++) {
    const sg__st_entry *t = &im->ent[im->map[id]];
    void *buf = malloc(t->end - t->begin ? (size_t)(t->end - t->begin) : 1);
    if (!buf) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (tensor '%s')", t->name);
    sg_status st =
        sg__ck_read_at(im->fd, buf, (size_t)(t->end - t->begin), im->data_off + t->begin, im->path);
    if (st == SG_OK) st = sg_set_param(e, id, buf, (sg_dtype)t->dtype);
    free(buf);
    if (st != SG_OK) {
      char why[512];
      snprintf(why, sizeof why, "%s", sg_last_error());
      return sg__err(st, "%s (parameters before '%s' are imported, the rest are not)", why,
                     e->reg.names[id]);
    }
  }
  return SG_OK;
}

sg_status sg_import(sg_engine *e, const char *path) {
  SG_ENGINE_GUARD(e, "sg_import");
  static const char *fn = "sg_import";
  SG_TRY(sg__ck_check_call(e, path, "path", 1, fn));
  importer im = {-1, path, 0, 0, NULL, 0, NULL};
  /* Round 1: every rank found every parameter, with the right size, inside the file. */
  sg_status local = import_check(e, &im);
  if (local != SG_OK) sg__err_prefix(local, fn);
  sg__ck_vote *all = NULL;
  sg_status st = sg__ck_agree(e, fn, local, NULL, &all);
  free(all);
  if (st == SG_OK) {
    /* Round 2: only a read error can fail now; every rank reports the same outcome. */
    local = import_values(e, &im);
    if (local != SG_OK) sg__err_prefix(local, fn);
    st = sg__ck_agree(e, fn, local, NULL, &all);
    free(all);
  }
  import_free(&im);
  return st;
}
