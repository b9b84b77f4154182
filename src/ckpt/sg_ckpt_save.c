/* sg_save: every rank writes the fragments it owns to a new rank file; rank 0 then writes the
 * manifest (the commit point) and deletes older generations.
 *
 * Crash safety. A save never writes a name that the current manifest refers to: rank files get
 * a new generation number (one above every generation found in the directory), go to a
 * temporary name, are fsynced, renamed and the directory fsynced; only when every rank has done
 * so does rank 0 replace the manifest the same way. Until that rename the old manifest and its
 * files are intact; after it the new ones are complete. Files of older generations are deleted
 * last, after the new manifest is durable, so a crash at any point leaves a loadable
 * checkpoint in the directory. */
#define _POSIX_C_SOURCE 200809L /* dirent, unlink, open flags */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sg_ckpt_engine.h"

#define SG_CK_IO_BUF (4u << 20) /* host staging between the device and the file */

/* ---------------------------------------------------------------------------------------- */
/* rank 0: directory and generation                                                          */

/* The generation of the manifest now in dir, 0 if none is readable. */
static uint64_t manifest_generation(const char *dir) {
  char *path = sg__ck_path(dir, SG_CK_MANIFEST_NAME);
  if (!path) return 0;
  uint8_t buf[32];
  uint64_t gen = 0, bytes = 0;
  int fd = -1;
  if (sg__ck_open_read(path, 0, &fd, &bytes) == SG_OK) {
    if (bytes >= sizeof buf && sg__ck_read_at(fd, buf, sizeof buf, 0, path) == SG_OK)
      gen = sg__ck_manifest_peek_generation(buf, sizeof buf);
    close(fd);
  }
  sg__err_clear();
  free(path);
  return gen;
}

/* Creates dir if needed, takes the save lock (sg_ckpt_lock.c) and picks a generation above
 * every one present, so that no file the current manifest (or an interrupted save) wrote is
 * ever overwritten. */
static sg_status prepare_dir(const char *dir, uint64_t *gen, sg__ck_lock *lock) {
  SG_TRY(sg__ck_make_dir(dir));
  SG_TRY(sg__ck_lock_acquire(dir, lock));
  DIR *d = opendir(dir);
  char eb[128];
  if (!d)
    return sg__err(SG_ERR_IO, "cannot list directory '%s': %s", dir,
                   sg__ck_errstr(errno, eb, sizeof eb));
  uint64_t max = manifest_generation(dir), g = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;)
    if (sg__ck_parse_name(de->d_name, &g) && g > max) max = g;
  closedir(d);
  if (max >= UINT64_MAX / 2) return sg__err(SG_ERR_IO, "generation counter exhausted in '%s'", dir);
  *gen = max + 1;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* every rank: its file                                                                      */

typedef struct {
  int fd;
  const char *path;
  sg__ck_header *h;
  uint8_t *buf;
  size_t cap, fill;  /* buffer holds whole chunks; fill bytes pending */
  uint64_t sec_done; /* bytes of the current section already written */
  uint64_t crc_next; /* index of the next chunk checksum */
  const sg__ck_section *sec;
} writer;

/* Checksums the buffered chunks and writes them at their place in the section. */
static sg_status flush(writer *w) {
  const size_t cb = w->h->chunk_bytes;
  for (size_t o = 0; o < w->fill; o += cb) {
    const size_t n = w->fill - o < cb ? w->fill - o : cb;
    w->h->crcs[w->crc_next++] = sg__crc32c(0, w->buf + o, n);
  }
  SG_TRY(sg__ck_write_at(w->fd, w->buf, w->fill, w->sec->offset + w->sec_done, w->path));
  w->sec_done += w->fill;
  w->fill = 0;
  return SG_OK;
}

/* Appends `bytes` of device memory (host: of host memory) to the current section. */
static sg_status append(sg_engine *e, writer *w, const char *src, size_t bytes, int host) {
  while (bytes > 0) {
    const size_t n = bytes < w->cap - w->fill ? bytes : w->cap - w->fill;
    if (host)
      memcpy(w->buf + w->fill, src, n);
    else
      SG_TRY(e->dev->ops->copy(e->dev, SG_Q_COMPUTE, w->buf + w->fill, src, n, SG_COPY_D2H));
    w->fill += n;
    src += n;
    bytes -= n;
    if (w->fill == w->cap) SG_TRY(flush(w));
  }
  return SG_OK;
}

/* This rank's fragments of every parameter, registration order; rec: the section's 8-bit
 * records in host memory (state coordinates), NULL for an array of the engine. */
static sg_status write_fragments(sg_engine *e, writer *w, int kind, size_t esize,
                                 const uint8_t *rec) {
  for (int id = 0; id < e->reg.nparams; id++)
    for (size_t k = sg__ck_frag_begin(e, id, e->rank); k < sg__ck_frag_end(e, id, e->rank); k++) {
      const sg__fragment *f = &e->plan->frags[k];
      const size_t opt = sg__strategy_state_index(e->strat, e->plan, e->rank, f->bucket,
                                                  e->plan->params[id].offset + f->param_offset);
      const char *src = rec ? (const char *)rec + opt * esize
                            : sg__ck_state_ptr(e, kind, id, f->param_offset, opt);
      SG_TRY(append(e, w, src, f->length * esize, rec != NULL));
    }
  return SG_OK;
}

static sg_status end_section(writer *w, int s) {
  if (w->fill > 0) SG_TRY(flush(w));
  if (w->sec_done != w->sec->bytes)
    return sg__err(SG_ERR_INTERNAL, "section %d: wrote %" PRIu64 " of %" PRIu64 " bytes", s,
                   w->sec_done, w->sec->bytes);
  return SG_OK;
}

static sg_status write_replica_section(sg_engine *e, writer *w, const void *rec, size_t esize) {
  if (!rec) return sg__err(SG_ERR_INTERNAL, "no records of the replica state");
  SG_TRY(write_fragments(e, w, 0, esize, rec));
  return end_section(w, (int)(w->sec - w->h->sec));
}

/* One section. 8-bit state: its records, made on the host first; replica state: the records
 * the transport made (ck). */
static sg_status write_section(sg_engine *e, writer *w, const sg__rep_ck *ck, int s) {
  const int kind = (int)w->h->sec[s].kind;
  const size_t esize = w->h->sec[s].elem_bytes;
  w->sec = &w->h->sec[s];
  w->sec_done = 0;
  w->fill = 0;
  w->crc_next = w->sec->crc_index;
  const int q8 = sg__ck_kind_q8((uint32_t)kind), rk = sg__ck_kind_rep((uint32_t)kind);
  if (rk >= 0) return write_replica_section(e, w, ck->rec[rk], esize);
  uint8_t *rec = NULL;
  if (q8 >= 0) {
    rec = malloc(e->lay.opt_numel * esize + 1);
    if (!rec) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (8-bit state records)");
    const sg_status st = e->strat->place->records(e, q8, rec, SG__REC_SAVE);
    if (st != SG_OK) {
      free(rec);
      return st;
    }
  }
  const sg_status st = write_fragments(e, w, kind, esize, rec);
  free(rec);
  SG_TRY(st);
  return end_section(w, s);
}

static size_t owned_numel(const sg_engine *e) {
  size_t n = 0;
  for (int id = 0; id < e->reg.nparams; id++)
    for (size_t k = sg__ck_frag_begin(e, id, e->rank); k < sg__ck_frag_end(e, id, e->rank); k++)
      n += e->plan->frags[k].length;
  return n;
}

typedef struct {
  uint64_t bytes, numel, header_crc;
} file_info;

/* Data first (the checksums are known only then), the header last, then fsync. */
static sg_status write_file_body(sg_engine *e, writer *w, const sg__rep_ck *ck, file_info *info) {
  for (uint32_t s = 0; s < w->h->nsections; s++) SG_TRY(write_section(e, w, ck, (int)s));
  uint8_t *hb = malloc(w->h->header_bytes);
  if (!hb) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  sg__ck_header_encode(w->h, hb);
  sg_status st = sg__ck_write_at(w->fd, hb, w->h->header_bytes, 0, w->path);
  free(hb);
  if (st != SG_OK) return st;
  const sg__ck_section *last = &w->h->sec[w->h->nsections - 1];
  *info = (file_info){last->offset + last->bytes, w->h->numel, w->h->header_crc};
  return SG_OK;
}

static sg_status write_rank_file(sg_engine *e, const char *dir, uint64_t gen, const sg__rep_ck *ck,
                                 file_info *info) {
  char tmp_name[64], name[64];
  sg__ck_shard_name(tmp_name, sizeof tmp_name, gen, e->rank, 1);
  sg__ck_shard_name(name, sizeof name, gen, e->rank, 0);
  char *tmp = sg__ck_path(dir, tmp_name), *dst = sg__ck_path(dir, name);
  sg__ck_header h = {0};
  writer w = {-1, tmp, &h, NULL, 0, 0, 0, 0, NULL};
  uint32_t kinds[SG_CK_KINDS], esz[SG_CK_KINDS];
  sg_status st = SG_OK;
  if (!tmp || !dst) {
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
    goto done;
  }
  h = (sg__ck_header){.generation = gen,
                      .plan_hash = e->plan->hash,
                      .rank = (uint32_t)e->rank,
                      .world = (uint32_t)e->world,
                      .chunk_bytes = sg__ckpt_chunk_bytes(),
                      .numel = owned_numel(e)};
  uint32_t nk = sg__ck_kinds(e, kinds, esz);
  nk += sg__ck_rep_kinds(ck->esz, kinds + nk, esz + nk);
  SG_TRY_GOTO(sg__ck_header_layout(&h, kinds, esz, nk), st, done);
  w.cap = SG_CK_IO_BUF / h.chunk_bytes * h.chunk_bytes;
  if (w.cap == 0) w.cap = h.chunk_bytes;
  w.buf = malloc(w.cap);
  if (!w.buf) {
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (%zu bytes)", w.cap);
    goto done;
  }
  SG_TRY_GOTO(sg__ck_open_write(tmp, &w.fd), st, done);
  st = write_file_body(e, &w, ck, info);
  if (st == SG_OK)
    st = sg__ck_fsync_close(w.fd, tmp);
  else
    close(w.fd);
  if (st == SG_OK) st = sg__ck_rename(tmp, dst);
  if (st == SG_OK) st = sg__ck_fsync_dir(dir);
  if (st != SG_OK) unlink(tmp);
done:
  if (st != SG_OK) sg__err_prefix(st, "sg_save");
  sg__ck_header_free(&h);
  free(w.buf);
  free(tmp);
  free(dst);
  return st;
}

/* ---------------------------------------------------------------------------------------- */
/* rank 0: manifest                                                                          */

/* Every rank's fragments of every parameter, with their place in that rank's file: the order
 * write_section uses (registration order, then the plan's fragment order). */
static sg_status fill_params(const sg_engine *e, sg__ck_manifest *m) {
  uint64_t *cursor = calloc((size_t)e->world, sizeof *cursor);
  m->params = calloc((size_t)e->reg.nparams, sizeof *m->params);
  if (!cursor || !m->params) {
    free(cursor);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  }
  sg_status st = SG_OK;
  for (int id = 0; id < e->reg.nparams && st == SG_OK; id++) {
    sg__ck_param *p = &m->params[id];
    const size_t k0 = sg__ck_frag_begin(e, id, 0), k1 = sg__ck_frag_end(e, id, e->world - 1);
    *p = (sg__ck_param){e->reg.names[id],        e->reg.numels[id],
                        e->reg.flags[id],        (uint32_t)e->cfg.param_dtype,
                        (uint32_t)(k1 - k0), calloc(k1 - k0, sizeof(sg__ck_frag))};
    if (!p->frags) {
      st = sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
      break;
    }
    uint32_t j = 0;
    for (int r = 0; r < e->world; r++)
      for (size_t k = sg__ck_frag_begin(e, id, r); k < sg__ck_frag_end(e, id, r); k++) {
        const sg__fragment *f = &e->plan->frags[k];
        p->frags[j++] = (sg__ck_frag){(uint32_t)r, f->param_offset, f->length, cursor[r]};
        cursor[r] += f->length;
      }
  }
  free(cursor);
  return st;
}

static sg_status fill_files(const sg_engine *e, uint64_t gen, const sg__ck_vote *all,
                            sg__ck_manifest *m) {
  m->files = calloc((size_t)e->world, sizeof *m->files);
  if (!m->files) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  for (int r = 0; r < e->world; r++) {
    char name[64];
    sg__ck_shard_name(name, sizeof name, gen, r, 0);
    m->files[r].name = malloc(strlen(name) + 1);
    if (!m->files[r].name) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
    memcpy(m->files[r].name, name, strlen(name) + 1);
    m->files[r].bytes = all[r].val[0];
    m->files[r].numel = all[r].val[1];
    m->files[r].header_crc = (uint32_t)all[r].val[2];
  }
  return SG_OK;
}

/* Each parameter's own step count, recorded only when some differs from the step (a parameter
 * skipped for want of a gradient): the manifest then has version 3, else 2 as before. */
static sg_status fill_steps(const sg_engine *e, sg__ck_manifest *m) {
  if (!sg__optim_steps_differ(e)) return SG_OK;
  m->param_steps = malloc((size_t)e->reg.nparams * sizeof *m->param_steps);
  if (!m->param_steps) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  for (int id = 0; id < e->reg.nparams; id++) m->param_steps[id] = sg__optim_param_step(e, id);
  return SG_OK;
}

static void free_manifest_tables(const sg_engine *e, sg__ck_manifest *m) {
  if (m->params)
    for (int id = 0; id < e->reg.nparams; id++) free(m->params[id].frags); /* names are the engine's */
  if (m->files)
    for (int r = 0; r < e->world; r++) free(m->files[r].name);
  free(m->params);
  free(m->files);
  free(m->param_steps);
}

static sg_status write_manifest(sg_engine *e, const char *dir, uint64_t gen,
                                const sg__ck_vote *all, const sg__rep_ck *ck) {
  sg__ck_manifest m = {.generation = gen,
                       .world = (uint32_t)e->world,
                       .strategy = (uint32_t)e->cfg.strategy,
                       .param_dtype = (uint32_t)e->cfg.param_dtype,
                       .has_master = e->opt.master != NULL,
                       .plan_hash = e->plan->hash,
                       .step = e->opt.step,
                       .loss_scale = e->sc.loss_scale,
                       .clean_steps = (uint32_t)e->sc.clean_steps,
                       .dynamic_scale = (uint32_t)e->sc.dynamic,
                       .lr = (float)e->opt.lr[0],
                       .rep_position = ck->position,
                       .nparams = (uint32_t)e->reg.nparams};
  memcpy(m.rep_esz, ck->esz, sizeof m.rep_esz);
  sg__config_words(&e->cfg, m.cfg, SG_CK_NCFG); /* informational: a load may change it */
  m.ngroups = SG_MAX_GROUPS;
  for (int g = 0; g < SG_MAX_GROUPS; g++) {
    m.group_lr[g] = (float)e->opt.lr[g];
    m.group_wd[g] = (float)e->opt.wd[g];
  }
  uint8_t *buf = NULL;
  size_t len = 0;
  sg_status st;
  SG_TRY_GOTO(fill_params(e, &m), st, done);
  SG_TRY_GOTO(fill_files(e, gen, all, &m), st, done);
  SG_TRY_GOTO(fill_steps(e, &m), st, done);
  SG_TRY_GOTO(sg__ck_manifest_encode(&m, &buf, &len), st, done);
  st = sg__ck_write_atomic(dir, SG_CK_MANIFEST_NAME, SG_CK_MANIFEST_TMP, buf, len);
done:
  if (st != SG_OK) sg__err_prefix(st, "sg_save");
  free(buf);
  free_manifest_tables(e, &m);
  return st;
}

/* Deletes our files of every other generation (and stray temporaries). Best effort: what
 * cannot be deleted is logged and removed by a later save. */
static void remove_old(const sg_engine *e, const char *dir, uint64_t gen) {
  DIR *d = opendir(dir);
  if (!d) return;
  uint64_t g = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    if (!sg__ck_parse_name(de->d_name, &g) || g == gen) continue;
    char *path = sg__ck_path(dir, de->d_name);
    char eb[128];
    if (path && unlink(path) != 0 && errno != ENOENT)
      SG_LOG(SG_LOG_WARN, e->rank, "sg_save: cannot delete old checkpoint file '%s': %s", path,
             sg__ck_errstr(errno, eb, sizeof eb));
    free(path);
  }
  closedir(d);
  (void)sg__ck_fsync_dir(dir);
  sg__err_clear();
}

/* rank 0, after writing the manifest failed (ENOSPC, ...): the files of generation gen are
 * named by no manifest, so they go, or the disk stays full and the next save fails too. Unless
 * the new manifest did land (a failure after its rename): then they are the checkpoint. */
static void drop_generation(const sg_engine *e, const char *dir, uint64_t gen) {
  char why[1024]; /* the failure's text, which the manifest check below would clear */
  snprintf(why, sizeof why, "%s", sg_last_error());
  DIR *d = manifest_generation(dir) == gen ? NULL : opendir(dir);
  sg__err(SG_OK, "%s", why);
  if (!d) return;
  uint64_t g = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    if (!sg__ck_parse_name(de->d_name, &g) || (g != gen && g != 0)) continue;
    char *path = sg__ck_path(dir, de->d_name);
    if (path && unlink(path) == 0)
      SG_LOG(SG_LOG_INFO, e->rank, "sg_save: removed '%s' of the failed save", path);
    free(path);
  }
  closedir(d);
  (void)sg__ck_fsync_dir(dir);
  sg__err(SG_OK, "%s", why);
}

/* ---------------------------------------------------------------------------------------- */

/* Round 1: the engine is idle everywhere, rank 0 has the lock, the directory and the
 * generation. */
static sg_status round_prepare(sg_engine *e, const char *dir, uint64_t *gen, sg__ck_lock *lock) {
  static const char *fn = "sg_save";
  /* A rank with a micro-batch in progress may have reductions queued: it must not join a
   * collective, so it fails alone, as sg_get_master does. */
  sg_status local = sg__grads_idle(e, fn);
  if (local != SG_OK) return local;
  uint64_t v[4] = {0, 0, 0, 0};
  if (sg__ck_lead(e)) {
    local = prepare_dir(dir, &v[0], lock);
    if (local != SG_OK) sg__err_prefix(local, fn);
  }
  sg__ck_vote *all = NULL;
  sg_status st = sg__ck_agree(e, fn, local, v, &all);
  if (all) *gen = all[0].val[0];
  free(all);
  return st;
}

static sg_status write_rounds(sg_engine *e, const char *dir, uint64_t gen, const sg__rep_ck *ck,
                              sg_status local) {
  static const char *fn = "sg_save";
  /* Round 2: every rank's file is durable; rank 0 learns their sizes and header checksums. */
  file_info info = {0, 0, 0};
  /* one copy: the ranks of replica 0 write, the other replicas vote */
  const int writer = sg__replicas_writer(e);
  if (local == SG_OK && writer) local = write_rank_file(e, dir, gen, ck, &info);
  const uint64_t v[4] = {info.bytes, info.numel, info.header_crc, 0};
  sg__ck_vote *all = NULL;
  sg_status st = sg__ck_agree(e, fn, local, v, &all);
  if (st != SG_OK) {
    /* No manifest names this generation: drop our file (the old checkpoint stays current). */
    char name[64];
    sg__ck_shard_name(name, sizeof name, gen, e->rank, 0);
    char *path = writer ? sg__ck_path(dir, name) : NULL;
    if (path) unlink(path);
    free(path);
    free(all);
    return st;
  }
  /* Round 3: the manifest, the commit point. */
  local = sg__ck_lead(e) ? write_manifest(e, dir, gen, all, ck) : SG_OK;
  if (local != SG_OK) drop_generation(e, dir, gen);
  free(all);
  st = sg__ck_agree(e, fn, local, NULL, &all);
  free(all);
  if (st != SG_OK) return st;
  if (sg__ck_lead(e)) remove_old(e, dir, gen);
  SG_LOG(SG_LOG_INFO, e->rank, "saved step %" PRIu64 " to '%s' (generation %" PRIu64 ")", e->opt.step,
         dir, gen);
  return SG_OK;
}

/* The replica transport's state (a codec's residuals, the outer state): its records on the
 * writers, made through a collective over the replicas that every rank joins. Returns this
 * rank's own failure (out of memory: it joins the collective without records, and votes it);
 * *coll the collective's (the engine is then broken). */
static sg_status collect_replica_state(sg_engine *e, sg__rep_ck *ck, sg_status *coll) {
  sg__replicas_ck_describe(e, ck);
  sg_status st = SG_OK;
  for (int k = 0; k < SG__REP_STATES && sg__replicas_writer(e); k++) {
    if (!ck->esz[k] || st != SG_OK) continue;
    ck->rec[k] = calloc(e->lay.opt_numel ? e->lay.opt_numel : 1, ck->esz[k]);
    if (!ck->rec[k]) st = sg__err(SG_ERR_OUT_OF_MEMORY, "sg_save: out of host memory (%s "
                                  "records)", sg__ck_rep_name(k));
  }
  if (st != SG_OK)
    for (int k = 0; k < SG__REP_STATES; k++) free(ck->rec[k]), ck->rec[k] = NULL;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", st != SG_OK ? sg_last_error() : "");
  *coll = sg__engine_broken(e, sg__replicas_ck_save(e, ck));
  return *coll == SG_OK && st != SG_OK ? sg__err(st, "%s", msg) : st;
}

static void free_replica_state(sg__rep_ck *ck) {
  for (int k = 0; k < SG__REP_STATES; k++) free(ck->rec[k]);
}

static sg_status save_rounds(sg_engine *e, const char *dir, sg__ck_lock *lock) {
  uint64_t gen = 0;
  SG_TRY(round_prepare(e, dir, &gen, lock));
  sg__rep_ck ck;
  sg_status coll = SG_OK;
  sg_status st = collect_replica_state(e, &ck, &coll);
  if (coll == SG_OK) st = write_rounds(e, dir, gen, &ck, st);
  free_replica_state(&ck);
  return coll != SG_OK ? coll : st;
}

sg_status sg_save(sg_engine *e, const char *dir) {
  SG_ENGINE_GUARD(e, "sg_save");
  static const char *fn = "sg_save";
  SG_TRY(sg__ck_check_call(e, dir, "dir", 0, fn));
  sg__ck_lock lock;
  memset(&lock, 0, sizeof lock);
  const sg_status st = save_rounds(e, dir, &lock);
  sg__ck_lock_release(&lock); /* rank 0's, after every round, whatever the outcome */
  return st;
}
