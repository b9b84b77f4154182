/* Checkpoints (issue 5): CRC-32C; train 6 steps straight against train 3, save at W=4, load at
 * W = 1, 2, 3, 4 with other bucket sizes and strategies, train 3 more: bitwise equal (f32,
 * bf16, f16 with a dynamic loss scale); the statuses of every failure and that a failed load
 * changes nothing; directory hygiene across saves; safetensors export read back by a reader
 * written here, and import. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, dirent, unlink */

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/sg_ckpt.h" /* sg__crc32c, sg__ckpt_set_chunk_bytes */
#include "test_ckpt_util.h"

static char g_root[256];

static void path_in(char *buf, size_t n, const char *name) {
  snprintf(buf, n, "%s/%s", g_root, name);
}

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C                                                                                   */

static void test_crc(void) {
  CHECK(sg__crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value: %08x",
        sg__crc32c(0, "123456789", 9));
  CHECK(sg__crc32c_sw(0, "123456789", 9) == 0xE3069283u, "crc32c (software) check value");
  uint8_t zeros[32] = {0};
  static uint8_t buf[3 * 4096 * 3 + 77]; /* the hardware path works in 3 x 4 KiB blocks */
  CHECK(sg__crc32c(0, zeros, 32) == 0x8A9136AAu, "crc32c of 32 zero bytes (RFC 3720): %08x",
        sg__crc32c(0, zeros, 32));
  CHECK(sg__crc32c(0, "", 0) == 0, "crc32c of nothing");
  for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)sg_test_mix(i);
  int same = 1, chain = 1;
  for (size_t off = 0; off < 8; off++)
    for (size_t n = 0; n + off <= sizeof buf; n += 1 + n / 5) {
      const uint32_t a = sg__crc32c(0, buf + off, n), b = sg__crc32c_sw(0, buf + off, n);
      same &= a == b;
      const size_t h = n / 3;
      chain &= sg__crc32c(sg__crc32c(0, buf + off, h), buf + off + h, n - h) == a;
    }
  CHECK(same, "crc32c: hardware and slicing-by-8 paths agree for every length and alignment");
  CHECK(chain, "crc32c: chaining two pieces gives the checksum of the whole");
}

/* ---------------------------------------------------------------------------------------- */
/* runs                                                                                      */

typedef struct {
  model_cfg m;
  const char *dir;
  int load;     /* sg_load(dir) first */
  int from, to; /* optimizer steps trained: [from, to) */
  int save_at;  /* save after this many steps (-1: never) */
  const snap *want_loaded, *want_end;
  snap mid[8], end[8];
  sg_status load_st[8];
  char load_err[8][512];
  int ok[8];
  char err[8][512];
} run_spec;

static void fail_rank(run_spec *s, int rank, sg_status st) {
  snprintf(s->err[rank], sizeof s->err[rank], "%s: %s", sg_status_string(st), sg_last_error());
}

static void run_rank(int rank, int world, sg_comm *comm, void *arg) {
  run_spec *s = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &s->m, &e, ids);
  if (!st && s->load) {
    st = sg_load(e, s->dir);
    s->load_st[rank] = st;
    if (st) snprintf(s->load_err[rank], sizeof s->load_err[rank], "%s", sg_last_error());
    if (!st) st = take_snap(e, &s->m, ids, &s->mid[rank]);
  }
  if (!st && s->save_at >= 0) {
    st = train(e, &s->m, ids, s->from, s->save_at);
    if (!st) st = take_snap(e, &s->m, ids, &s->mid[rank]);
    if (!st) st = sg_save(e, s->dir);
    if (!st) st = train(e, &s->m, ids, s->save_at, s->to);
  } else if (!st) {
    st = train(e, &s->m, ids, s->from, s->to);
  }
  if (!st) st = take_snap(e, &s->m, ids, &s->end[rank]);
  s->ok[rank] = st == SG_OK;
  if (st) fail_rank(s, rank, st);
  sg_engine_destroy(e);
}

static void free_spec(run_spec *s) {
  for (int r = 0; r < 8; r++) {
    free_snap(&s->mid[r]);
    free_snap(&s->end[r]);
  }
}

static const char *sname(sg_strategy s) {
  return s == SG_NO_SHARD ? "NO_SHARD" : s == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP";
}
static const char *dname(sg_dtype d) { return d == SG_F32 ? "f32" : d == SG_BF16 ? "bf16" : "f16"; }

static const model_cfg k_model = {
    7, {1, 63, 64, 65, 1000, 4097, 20011}, SG_SHARD_GRAD_OP, SG_F32, 4096, 0, NULL};

typedef struct {
  int world;
  sg_strategy strategy;
  size_t bucket_bytes;
} target;

/* Save at W=4 after 3 steps, continue to 6; the same straight; load at each target, train 3. */
static void test_resume(sg_dtype dt, int dynamic, uint32_t chunk) {
  char dir[300];
  path_in(dir, sizeof dir,
          dt == SG_F32    ? "resume_f32"
          : dt == SG_BF16 ? "resume_bf16"
                          : "resume_f16");
  sg__ckpt_set_chunk_bytes(chunk);
  model_cfg m = k_model;
  m.dtype = dt;
  m.dynamic = dynamic;
  run_spec *a = calloc(1, sizeof *a);
  *a = (run_spec){.m = m, .dir = dir, .from = 0, .to = 6, .save_at = 3};
  run_ranks(4, run_rank, a);
  int ok = 1;
  for (int r = 0; r < 4; r++) ok &= a->ok[r];
  CHECK(ok, "%s: W=4 run with a save after step 3: %s", dname(dt),
        a->err[0][0] ? a->err[0] : a->err[1]);
  if (!ok) goto done;
  for (int r = 1; r < 4; r++)
    CHECK(same_snap("ranks agree", &m, &a->end[0], &a->end[r]),
          "%s: rank %d's state differs "
          "from rank 0's",
          dname(dt), r);
  printf("%s%s: saved at W=4 SHARD_GRAD_OP bucket 4 KiB, chunk %u bytes\n", dname(dt),
         dynamic ? " (dynamic loss scale)" : "", sg__ckpt_chunk_bytes());

  run_spec *b = calloc(1, sizeof *b);
  *b = (run_spec){.m = m, .dir = dir, .from = 0, .to = 6, .save_at = -1};
  run_ranks(4, run_rank, b);
  CHECK(b->ok[0] && same_snap("straight", &m, &b->end[0], &a->end[0]),
        "%s: 6 steps straight equal 3 + save + 3 (saving changes nothing)", dname(dt));
  free_spec(b);
  free(b);

  const target tg[] = {{2, SG_SHARD_GRAD_OP, 65536}, {1, SG_SHARD_GRAD_OP, 4096},
                       {3, SG_SHARD_OPT, 1024},      {1, SG_NO_SHARD, 1 << 20},
                       {3, SG_SHARD_GRAD_OP, 12288}, {2, SG_NO_SHARD, 2048},
                       {4, SG_SHARD_OPT, 1 << 20}};
  for (size_t t = 0; t < sizeof tg / sizeof tg[0]; t++) {
    run_spec *c = calloc(1, sizeof *c);
    model_cfg mc = m;
    mc.strategy = tg[t].strategy;
    mc.bucket_bytes = tg[t].bucket_bytes;
    *c = (run_spec){.m = mc, .dir = dir, .load = 1, .from = 3, .to = 6, .save_at = -1};
    run_ranks(tg[t].world, run_rank, c);
    for (int r = 0; r < tg[t].world; r++) {
      CHECK(c->ok[r], "%s: load at W=%d %s bucket %zu, rank %d: %s", dname(dt), tg[t].world,
            sname(tg[t].strategy), tg[t].bucket_bytes, r, c->err[r]);
      if (!c->ok[r]) continue;
      CHECK(same_snap("after load", &m, &c->mid[r], &a->mid[0]),
            "%s: W=4 -> W=%d %s bucket %zu rank %d: state after load equals the saved state",
            dname(dt), tg[t].world, sname(tg[t].strategy), tg[t].bucket_bytes, r);
      CHECK(same_snap("after 3 more steps", &m, &c->end[r], &a->end[0]),
            "%s: W=4 -> W=%d %s bucket %zu rank %d: 3 steps after the load equal the "
            "uninterrupted run",
            dname(dt), tg[t].world, sname(tg[t].strategy), tg[t].bucket_bytes, r);
    }
    printf("%s: resumed at W=%d %s bucket %zu: bitwise equal\n", dname(dt), tg[t].world,
           sname(tg[t].strategy), tg[t].bucket_bytes);
    free_spec(c);
    free(c);
  }
done:
  free_spec(a);
  free(a);
  sg__ckpt_set_chunk_bytes(0);
}

/* Ranks that own no element at all (a one-element model at W=4) write rank files without
 * data; loads at W=1 and W=3 still restore everything. */
static void test_empty_ranks(void) {
  char dir[300];
  path_in(dir, sizeof dir, "tiny");
  const model_cfg m = {2, {1, 3}, SG_SHARD_GRAD_OP, SG_BF16, 256, 0, NULL};
  run_spec *a = calloc(1, sizeof *a);
  *a = (run_spec){.m = m, .dir = dir, .from = 0, .to = 4, .save_at = 2};
  run_ranks(4, run_rank, a);
  CHECK(a->ok[0] && a->ok[3], "tiny model: save at W=4 where ranks 1-3 own nothing: %s",
        a->err[0][0] ? a->err[0] : a->err[3]);
  for (int w = 1; w <= 3 && a->ok[0]; w += 2) {
    run_spec *c = calloc(1, sizeof *c);
    *c = (run_spec){.m = m, .dir = dir, .load = 1, .from = 2, .to = 4, .save_at = -1};
    run_ranks(w, run_rank, c);
    CHECK(c->ok[0] && same_snap("tiny", &m, &c->mid[0], &a->mid[0]) &&
              same_snap("tiny", &m, &c->end[0], &a->end[0]),
          "tiny model: W=4 -> W=%d load and 2 more steps bitwise equal: %s", w, c->err[0]);
    free_spec(c);
    free(c);
  }
  free_spec(a);
  free(a);
}

/* ---------------------------------------------------------------------------------------- */
/* failures                                                                                  */

typedef struct {
  model_cfg m; /* the loading engine */
  const char *dir;
  sg_status st[8];
  char err[8][512];
  int unchanged[8];
} fail_spec;

/* Loads into a trained engine that must come out unchanged when the load fails. */
static void fail_rank_fn(int rank, int world, sg_comm *comm, void *arg) {
  fail_spec *f = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  snap before, after;
  memset(&before, 0, sizeof before);
  memset(&after, 0, sizeof after);
  sg_status st = make_engine(comm, &f->m, &e, ids);
  if (!st) st = train(e, &f->m, ids, 0, 1);
  if (!st) st = take_snap(e, &f->m, ids, &before);
  if (st) {
    f->st[rank] = SG_ERR_INTERNAL;
    snprintf(f->err[rank], sizeof f->err[rank], "setup: %s", sg_last_error());
    sg_engine_destroy(e);
    return;
  }
  f->st[rank] = sg_load(e, f->dir);
  snprintf(f->err[rank], sizeof f->err[rank], "%s", sg_last_error());
  if (take_snap(e, &f->m, ids, &after) == SG_OK)
    f->unchanged[rank] = f->st[rank] == SG_OK || same_snap("failed load", &f->m, &before, &after);
  /* The engine still trains after a refused load. */
  if (f->st[rank] != SG_OK && train(e, &f->m, ids, 1, 2) != SG_OK) f->unchanged[rank] = 0;
  free_snap(&before);
  free_snap(&after);
  sg_engine_destroy(e);
}

/* Expects status `want` on every rank, with `needle` in every message, engine unchanged. */
static void expect_load_fail(const char *what, const model_cfg *m, int world, const char *dir,
                             sg_status want, const char *needle) {
  fail_spec *f = calloc(1, sizeof *f);
  f->m = *m;
  f->dir = dir;
  run_ranks(world, fail_rank_fn, f);
  for (int r = 0; r < world; r++) {
    CHECK(f->st[r] == want && contains(f->err[r], needle),
          "%s (W=%d rank %d): %s \"%s\", expected %s with '%s'", what, world, r,
          sg_status_string(f->st[r]), f->err[r], sg_status_string(want), needle);
    CHECK(f->unchanged[r], "%s (W=%d rank %d): the engine is unchanged and still trains", what,
          world, r);
  }
  printf("%s: %s \"%s\"\n", what, sg_status_string(f->st[0]), f->err[0]);
  free(f);
}

/* A checkpoint of k_model (f32) at W=2 in `dir`. */
static void save_f32(const char *dir, int world) {
  run_spec *a = calloc(1, sizeof *a);
  *a = (run_spec){.m = k_model, .dir = dir, .from = 0, .to = 2, .save_at = 2};
  run_ranks(world, run_rank, a);
  CHECK(a->ok[0], "save for the failure tests: %s", a->err[0]);
  free_spec(a);
  free(a);
}

static void copy_file(const char *from, const char *to) {
  FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
  char buf[65536];
  size_t n;
  while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
  if (a) fclose(a);
  if (b) fclose(b);
}

static void flip_byte(const char *path, long off) {
  FILE *f = fopen(path, "r+b");
  if (!f) return;
  fseek(f, off, SEEK_SET);
  int c = fgetc(f);
  fseek(f, off, SEEK_SET);
  fputc(c ^ 0x40, f);
  fclose(f);
}

static void test_load_failures(void) {
  char dir[300], path[400], saved[400];
  path_in(dir, sizeof dir, "fail");
  save_f32(dir, 2);
  model_cfg m = k_model;
  expect_load_fail("no such directory", &m, 2, "/nonexistent/sg_ckpt", SG_ERR_IO,
                   "/nonexistent/sg_ckpt/manifest");
  m.rename = "other.weight";
  expect_load_fail("parameter not in the checkpoint", &m, 2, dir, SG_ERR_MISMATCH, "other.weight");
  m = k_model;
  m.sizes[4] = 1001;
  expect_load_fail("numel differs", &m, 3, dir, SG_ERR_MISMATCH, "layer4.bias");
  m = k_model;
  m.dtype = SG_BF16;
  expect_load_fail("dtype differs", &m, 2, dir, SG_ERR_MISMATCH, "f32");
  m = k_model;
  m.nparams = 6;
  expect_load_fail("checkpoint has a parameter the engine lacks", &m, 1, dir, SG_ERR_MISMATCH,
                   "layer6.weight");
  m = k_model;
  m.nparams = 8;
  m.sizes[7] = 10;
  expect_load_fail("engine has a parameter the checkpoint lacks", &m, 2, dir, SG_ERR_MISMATCH,
                   "layer7.bias");
  /* damaged files: the detailed sweep is test_ckpt_corrupt */
  path_in(path, sizeof path, "fail/g1.r1.shard");
  path_in(saved, sizeof saved, "saved.shard");
  copy_file(path, saved);
  unlink(path);
  expect_load_fail("rank file missing", &k_model, 2, dir, SG_ERR_IO, "g1.r1.shard");
  expect_load_fail("rank file missing (W=3)", &k_model, 3, dir, SG_ERR_IO, "g1.r1.shard");
  copy_file(saved, path);
  flip_byte(path, 5000);
  expect_load_fail("flipped data byte", &k_model, 4, dir, SG_ERR_CORRUPT, "checksum");
  copy_file(saved, path);
  truncate(path, 3000);
  expect_load_fail("truncated rank file", &k_model, 2, dir, SG_ERR_CORRUPT, "g1.r1.shard");
  copy_file(saved, path);
  path_in(path, sizeof path, "fail/manifest");
  flip_byte(path, 0);
  expect_load_fail("manifest with a bad magic", &k_model, 2, dir, SG_ERR_CORRUPT, "magic");
  flip_byte(path, 0);
  flip_byte(path, 8);
  expect_load_fail("manifest of another format version", &k_model, 2, dir, SG_ERR_CORRUPT,
                   "version");
  flip_byte(path, 8);
  unlink(saved);
}

/* ---------------------------------------------------------------------------------------- */
/* call order and arguments                                                                  */

static void test_misuse(void) {
  char dir[300];
  path_in(dir, sizeof dir, "misuse");
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[MAXP];
  CHECK(sg_save(NULL, dir) == SG_ERR_INVALID_ARGUMENT, "sg_save(NULL engine)");
  CHECK(sg_load(NULL, dir) == SG_ERR_INVALID_ARGUMENT, "sg_load(NULL engine)");
  CHECK(sg_export(NULL, dir) == SG_ERR_INVALID_ARGUMENT, "sg_export(NULL engine)");
  CHECK(sg_import(NULL, dir) == SG_ERR_INVALID_ARGUMENT, "sg_import(NULL engine)");
  if (sg_comm_create_local(1, &c) != SG_OK) return;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  sg_engine *raw = NULL;
  if (sg_engine_create(c, &cfg, &raw) == SG_OK) {
    CHECK(sg_save(raw, dir) == SG_ERR_INVALID_STATE, "sg_save before sg_finalize");
    CHECK(sg_load(raw, dir) == SG_ERR_INVALID_STATE, "sg_load before sg_finalize");
    sg_engine_destroy(raw);
  }
  if (make_engine(c, &k_model, &e, ids) != SG_OK) {
    CHECK(0, "make_engine: %s", sg_last_error());
    sg_comm_destroy(c);
    return;
  }
  CHECK(sg_save(e, NULL) == SG_ERR_INVALID_ARGUMENT, "sg_save(dir NULL)");
  CHECK(sg_save(e, "") == SG_ERR_INVALID_ARGUMENT, "sg_save(dir \"\")");
  CHECK(sg_load(e, NULL) == SG_ERR_INVALID_ARGUMENT, "sg_load(dir NULL)");
  CHECK(sg_export(e, "") == SG_ERR_INVALID_ARGUMENT, "sg_export(path \"\")");
  CHECK(sg_import(e, NULL) == SG_ERR_INVALID_ARGUMENT, "sg_import(path NULL)");
  void *g = NULL;
  CHECK(sg_grad_ptr(e, ids[6], &g) == SG_OK, "sg_grad_ptr");
  sg_status st = sg_save(e, dir);
  CHECK(st == SG_ERR_INVALID_STATE && contains(sg_last_error(), "micro-batch"),
        "sg_save during a micro-batch: %s \"%s\"", sg_status_string(st), sg_last_error());
  CHECK(sg_load(e, dir) == SG_ERR_INVALID_STATE, "sg_load during a micro-batch");
  CHECK(sg_export(e, dir) == SG_ERR_INVALID_STATE, "sg_export during a micro-batch");
  CHECK(sg_step(e, NULL) == SG_OK, "sg_step completes the micro-batch");
  CHECK(sg_save(e, dir) == SG_OK, "sg_save after the step: %s", sg_last_error());
  CHECK(sg_save(e, "/nonexistent/a/b") == SG_ERR_IO, "sg_save into a missing parent: %s",
        sg_last_error());
  char file[300];
  path_in(file, sizeof file, "misuse/manifest");
  st = sg_save(e, file);
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "not a directory"),
        "sg_save onto a regular file: %s \"%s\"", sg_status_string(st), sg_last_error());
  CHECK(sg_load(e, dir) == SG_OK, "the checkpoint is still loadable after the failed saves: %s",
        sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

/* ---------------------------------------------------------------------------------------- */
/* directory hygiene                                                                         */

typedef struct {
  int manifest, shards, other, stale;
  unsigned long gen;
} dir_count;

static dir_count count_dir(const char *dir) {
  dir_count c = {0, 0, 0, 0, 0};
  DIR *d = opendir(dir);
  for (struct dirent *de; d && (de = readdir(d)) != NULL;) {
    unsigned long g = 0;
    int r = 0;
    char tail[16];
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (!strcmp(de->d_name, "manifest"))
      c.manifest++;
    else if (sscanf(de->d_name, "g%lu.r%d.%15s", &g, &r, tail) == 3 && !strcmp(tail, "shard")) {
      c.shards++;
      if (c.gen && g != c.gen) c.stale++;
      c.gen = g;
    } else
      c.other++;
  }
  if (d) closedir(d);
  return c;
}

static void touch(const char *dir, const char *name) {
  char p[400];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  if (f) {
    fputs("x", f);
    fclose(f);
  }
}

static void test_hygiene(void) {
  char dir[300];
  path_in(dir, sizeof dir, "hygiene");
  save_f32(dir, 3);
  dir_count c = count_dir(dir);
  CHECK(c.manifest == 1 && c.shards == 3 && c.other == 0,
        "after a W=3 save: manifest + 3 rank "
        "files (%d, %d, %d others)",
        c.manifest, c.shards, c.other);
  touch(dir, "g7.r0.tmp"); /* an interrupted save's leftovers */
  touch(dir, "g7.r1.shard");
  touch(dir, "manifest.tmp");
  touch(dir, "notes.txt"); /* the user's */
  save_f32(dir, 2);
  c = count_dir(dir);
  CHECK(c.manifest == 1 && c.shards == 2 && c.stale == 0 && c.gen == 8 && c.other == 1,
        "after a W=2 save over leftovers: manifest + 2 rank files of generation 8, the user's file "
        "kept (%d, %d, stale %d, gen %lu, %d others)",
        c.manifest, c.shards, c.stale, c.gen, c.other);
  fail_spec *f = calloc(1, sizeof *f);
  f->m = k_model;
  f->dir = dir;
  run_ranks(2, fail_rank_fn, f);
  CHECK(f->st[0] == SG_OK && f->st[1] == SG_OK, "the last save loads: %s", f->err[0]);
  free(f);
}

/* ---------------------------------------------------------------------------------------- */
/* safetensors                                                                               */

/* The test's own reader: whole file, header length, JSON text, data. */
typedef struct {
  uint8_t *buf;
  size_t len;
  uint64_t n;
  char *json;
  const uint8_t *data;
} stfile;

static int st_open(const char *path, stfile *s) {
  memset(s, 0, sizeof *s);
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  fseek(f, 0, SEEK_END);
  s->len = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  s->buf = malloc(s->len + 1);
  const size_t got = fread(s->buf, 1, s->len, f);
  fclose(f);
  if (got != s->len || s->len < 8) return 0;
  for (int i = 7; i >= 0; i--) s->n = (s->n << 8) | s->buf[i];
  if (s->n > s->len - 8) return 0;
  s->json = malloc(s->n + 1);
  memcpy(s->json, s->buf + 8, s->n);
  s->json[s->n] = 0;
  s->data = s->buf + 8 + s->n;
  return 1;
}

static void st_close(stfile *s) {
  free(s->buf);
  free(s->json);
}

/* The entry of `key` (already JSON-escaped): F32, shape [numel], offsets inside the data. */
static const float *st_tensor(const stfile *s, const char *key, size_t numel) {
  char pat[512];
  snprintf(pat, sizeof pat, "\"%s\":{\"dtype\":\"F32\",\"shape\":[%zu],\"data_offsets\":[", key,
           numel);
  const char *p = strstr(s->json, pat);
  if (!p) return NULL;
  char *end = NULL;
  const unsigned long long b = strtoull(p + strlen(pat), &end, 10);
  if (*end != ',') return NULL;
  const unsigned long long e = strtoull(end + 1, &end, 10);
  if (*end != ']' || e - b != numel * 4 || e > s->len - 8 - s->n || b % 4) return NULL;
  return (const float *)(s->data + b);
}

typedef struct {
  model_cfg m;
  const char *path;
  int do_export;
  snap s[8];
  sg_status st[8];
  char err[8][512];
} st_spec;

static void st_rank(int rank, int world, sg_comm *comm, void *arg) {
  st_spec *x = arg;
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &x->m, &e, ids);
  if (!st && x->do_export) {
    st = train(e, &x->m, ids, 0, 3);
    if (!st) st = sg_export(e, x->path);
  } else if (!st) {
    st = sg_import(e, x->path);
  }
  x->st[rank] = st;
  snprintf(x->err[rank], sizeof x->err[rank], "%s", st ? sg_last_error() : "");
  if (!st) take_snap(e, &x->m, ids, &x->s[rank]);
  sg_engine_destroy(e);
}

static st_spec *st_run(const model_cfg *m, int world, const char *path, int do_export) {
  st_spec *x = calloc(1, sizeof *x);
  x->m = *m;
  x->path = path;
  x->do_export = do_export;
  run_ranks(world, st_rank, x);
  return x;
}

static void st_free(st_spec *x) {
  for (int r = 0; r < 8; r++) free_snap(&x->s[r]);
  free(x);
}

static void check_export_file(const char *path, const model_cfg *m, const snap *s) {
  stfile f;
  const int opened = st_open(path, &f);
  CHECK(opened, "export: '%s' opens as safetensors (8-byte length, JSON header)", path);
  if (!opened) {
    st_close(&f);
    return;
  }
  CHECK((8 + f.n) % 8 == 0, "export: data start 8-byte aligned (header %llu bytes)",
        (unsigned long long)f.n);
  CHECK(f.json[0] == '{' && contains(f.json, "\"__metadata__\":{\"format\":\"pt\""),
        "export: JSON object with metadata format pt");
  size_t total = 0;
  int all = 1;
  for (int p = 0; p < m->nparams; p++) {
    char name[64];
    param_name(m, p, name, sizeof name);
    const float *v = st_tensor(&f, name, m->sizes[p]);
    all &= v && memcmp(v, s->v[1][p], m->sizes[p] * 4) == 0;
    total += m->sizes[p] * 4;
  }
  CHECK(all, "export: every parameter by name, F32, shape [numel], values = the fp32 master");
  CHECK(f.len == 8 + f.n + total, "export: data section holds exactly the tensors (%zu bytes)",
        f.len - 8 - (size_t)f.n);
  st_close(&f);
}

static void write_bytes(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (f) {
    fwrite(p, 1, n, f);
    fclose(f);
  }
}

/* A hand-made file: BF16 and F16 tensors with 2-D shapes, escaped names, extra tensors. */
static void test_import_foreign(void) {
  char path[300];
  path_in(path, sizeof path, "foreign.safetensors");
  model_cfg m = {2, {6, 4}, SG_SHARD_GRAD_OP, SG_F32, 4096, 0, "we\"ird\\name\xc3\xa9"};
  const char *json =
      "{\"__metadata__\":{\"a\":\"b\"},\"extra\":{\"dtype\":\"I64\",\"shape\":[1],"
      "\"data_offsets\":[0,8]},\"layer1.bias\":{\"shape\":[2,2],\"dtype\":\"F16\","
      "\"data_offsets\":[20,28]},\"we\\\"ird\\\\name\\u00e9\":{\"dtype\":\"BF16\","
      "\"shape\":[2,3],\"data_offsets\":[8,20]}}";
  const size_t n = strlen(json);
  uint8_t buf[512] = {0};
  for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)n >> (8 * i));
  memcpy(buf + 8, json, n);
  uint8_t *d = buf + 8 + n;
  const uint16_t bf[6] = {0x3f80, 0x4000, 0xbf80, 0x3e00, 0x0000, 0x4040}; /* 1 2 -1 .125 0 3 */
  const uint16_t hf[4] = {0x3c00, 0xc000, 0x3800, 0x0000};                 /* 1 -2 .5 0 */
  memcpy(d + 8, bf, sizeof bf);
  memcpy(d + 20, hf, sizeof hf);
  write_bytes(path, buf, 8 + n + 28);
  st_spec *x = st_run(&m, 2, path, 0);
  const float want0[6] = {1, 2, -1, 0.125f, 0, 3}, want1[4] = {1, -2, 0.5f, 0};
  CHECK(x->st[0] == SG_OK && x->st[1] == SG_OK,
        "import of BF16/F16 2-D tensors with escaped "
        "names and extra tensors: %s",
        x->err[0]);
  if (x->st[0] == SG_OK)
    CHECK(!memcmp(x->s[1].v[1][0], want0, sizeof want0) &&
              !memcmp(x->s[1].v[1][1], want1, sizeof want1),
          "import: values converted to fp32");
  st_free(x);
  /* the same file with the escaped name broken: the parameter is missing */
  m.rename = "weird";
  x = st_run(&m, 2, path, 0);
  CHECK(x->st[0] == SG_ERR_MISMATCH && x->st[1] == SG_ERR_MISMATCH && contains(x->err[1], "weird"),
        "import: parameter not in the file: %s \"%s\"", sg_status_string(x->st[0]), x->err[0]);
  st_free(x);
  m.rename = "we\"ird\\name\xc3\xa9";
  m.sizes[1] = 5;
  x = st_run(&m, 1, path, 0);
  CHECK(x->st[0] == SG_ERR_MISMATCH && contains(x->err[0], "layer1.bias"),
        "import: element count differs: \"%s\"", x->err[0]);
  st_free(x);
  m.sizes[1] = 4;
  write_bytes(path, buf, 8 + n + 20); /* data cut short */
  x = st_run(&m, 2, path, 0);
  CHECK(x->st[0] == SG_ERR_CORRUPT && x->st[1] == SG_ERR_CORRUPT,
        "import: data offsets beyond "
        "the file: %s \"%s\"",
        sg_status_string(x->st[0]), x->err[0]);
  st_free(x);
  buf[8 + 20] = 'X'; /* break the JSON */
  write_bytes(path, buf, 8 + n + 28);
  x = st_run(&m, 2, path, 0);
  CHECK(x->st[0] == SG_ERR_CORRUPT, "import: malformed JSON: %s \"%s\"", sg_status_string(x->st[0]),
        x->err[0]);
  st_free(x);
  unlink(path);
  path_in(path, sizeof path, "missing.safetensors");
  x = st_run(&m, 2, path, 0);
  CHECK(x->st[0] == SG_ERR_IO && contains(x->err[0], "missing.safetensors"),
        "import: missing file: %s \"%s\"", sg_status_string(x->st[0]), x->err[0]);
  st_free(x);
}

static void test_safetensors(void) {
  char path[300];
  path_in(path, sizeof path, "export.safetensors");
  model_cfg m = k_model;
  m.dtype = SG_BF16;
  st_spec *x = st_run(&m, 2, path, 1);
  CHECK(x->st[0] == SG_OK && x->st[1] == SG_OK, "export at W=2 bf16: %s", x->err[0]);
  if (x->st[0] != SG_OK) {
    st_free(x);
    return;
  }
  check_export_file(path, &m, &x->s[0]);
  /* import into a bf16 engine at W=3: master = exported fp32, working = its bf16 rounding */
  st_spec *y = st_run(&m, 3, path, 0);
  CHECK(y->st[0] == SG_OK, "import at W=3 bf16: %s", y->err[0]);
  if (y->st[0] == SG_OK) {
    int ok = 1;
    for (int p = 0; p < m.nparams; p++)
      ok &= !memcmp(y->s[2].v[1][p], x->s[0].v[1][p], m.sizes[p] * 4) &&
            !memcmp(y->s[2].v[0][p], x->s[0].v[0][p], m.sizes[p] * 4);
    CHECK(ok,
          "import at W=3 bf16: masters equal the exported values, working params their "
          "rounding");
  }
  st_free(y);
  /* into an f32 engine (NO_SHARD, W=1): the params are the exported values */
  model_cfg m32 = k_model;
  m32.strategy = SG_NO_SHARD;
  y = st_run(&m32, 1, path, 0);
  CHECK(y->st[0] == SG_OK, "import at W=1 f32 NO_SHARD: %s", y->err[0]);
  if (y->st[0] == SG_OK) {
    int ok = 1;
    for (int p = 0; p < m.nparams; p++)
      ok &= !memcmp(y->s[0].v[0][p], x->s[0].v[1][p], m.sizes[p] * 4);
    CHECK(ok, "import into f32: params equal the exported masters");
  }
  st_free(y);
  /* f32 export at W=3 (the working params are the master) */
  st_free(x);
  x = st_run(&k_model, 3, path, 1);
  CHECK(x->st[0] == SG_OK, "export at W=3 f32: %s", x->err[0]);
  if (x->st[0] == SG_OK) check_export_file(path, &k_model, &x->s[0]);
  st_free(x);
  x = st_run(&k_model, 2, "/nonexistent/dir/x.safetensors", 1);
  CHECK(x->st[0] == SG_ERR_IO && x->st[1] == SG_ERR_IO,
        "export into a missing directory: %s on "
        "rank 0, %s on rank 1",
        sg_status_string(x->st[0]), sg_status_string(x->st[1]));
  st_free(x);
  /* optional: the Python safetensors package reads the file too */
  char cmd[600];
  snprintf(cmd, sizeof cmd,
           "python3 -c 'import safetensors' >/dev/null 2>&1 && python3 -c '"
           "from safetensors.numpy import load_file; d = load_file(\"%s\"); "
           "assert d[\"layer6.weight\"].shape == (20011,) and str(d[\"layer0.weight\"].dtype) == "
           "\"float32\"'",
           path);
  if (system("python3 -c 'import safetensors' >/dev/null 2>&1") == 0)
    CHECK(system(cmd) == 0, "the Python safetensors package reads the export");
  else
    printf("(python safetensors not installed: skipped its reading of the export)\n");
  unlink(path);
  test_import_foreign();
}

/* ---------------------------------------------------------------------------------------- */

static void rm_tree(const char *dir) {
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) printf("could not remove %s\n", dir);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_root, sizeof g_root, "%s/sg_ckpt_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_root)) {
    printf("mkdtemp failed\n");
    return 1;
  }
  test_crc();
  test_resume(SG_F32, 0, 0);
  test_resume(SG_BF16, 0, 256);
  test_resume(SG_F16, 1, 4096);
  test_empty_ranks();
  test_load_failures();
  test_misuse();
  test_hygiene();
  test_safetensors();
  rm_tree(g_root);
  return finish();
}
