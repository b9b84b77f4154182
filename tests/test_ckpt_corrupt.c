/* Damaged checkpoints are refused, never crash, and never change the engine (issue 5).
 *
 * A W=3 bf16 checkpoint with 128-byte checksum chunks (so that small files have many chunks) is
 * loaded at W=1 after: a flip of every byte of every file (a random non-zero XOR, every byte
 * when the file is small, else a sample that covers every header byte), a truncation at every
 * length, an extension, a missing file: SG_ERR_CORRUPT or SG_ERR_IO every time, the engine's
 * memory and step untouched. Then the structural validators are driven past the checksums: a
 * flipped manifest with its checksum recomputed, flipped rank-file headers with theirs, and the
 * safetensors import with a damaged header: any status but never a crash (these run under ASan
 * in CI). SG_CKPT_FULL=1 tests every byte of large files too. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, truncate */

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/sg_ckpt.h"              /* chunk size hook, header/manifest parsers, CRC */
#include "engine/sg_engine_internal.h" /* the loading engine's raw memory (CPU device) */
#include "test_ckpt_util.h"

#define SAVE_WORLD 3 /* ranks of the damaged checkpoint: every byte of each of its files */

static char g_root[256], g_dir[300];
static const model_cfg k_m = {6,   {1, 63, 64, 65, 300, 700}, SG_SHARD_GRAD_OP, SG_BF16, 1024, 0,
                              NULL};
static uint64_t g_rng = 0x1234567;

static uint64_t rnd(void) {
  return g_rng = sg_test_mix(g_rng + 0x9E3779B97F4A7C15ull);
}

/* ---------------------------------------------------------------------------------------- */
/* files                                                                                     */

typedef struct {
  uint8_t *p;
  size_t n;
} blob;

static blob read_blob(const char *path) {
  blob b = {NULL, 0};
  FILE *f = fopen(path, "rb");
  if (!f) return b;
  fseek(f, 0, SEEK_END);
  b.n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  b.p = malloc(b.n + 1);
  if (fread(b.p, 1, b.n, f) != b.n) b.n = 0;
  fclose(f);
  return b;
}

/* Bytes [off, off+n) of the file replaced in place (no truncation: rewriting a truncated file
 * makes some file systems flush it on close, which is slow). */
static void patch(const char *path, size_t off, const uint8_t *p, size_t n) {
  const int fd = open(path, O_WRONLY);
  if (fd < 0) return;
  if (pwrite(fd, p, n, (off_t)off) != (ssize_t)n) printf("pwrite %s failed\n", path);
  close(fd);
}

/* ---------------------------------------------------------------------------------------- */
/* the loading engine and its raw state                                                      */

typedef struct {
  sg_comm *comm;
  sg_engine *e;
  int ids[MAXP];
  uint8_t *copy[4];
  size_t bytes[4];
  uint64_t step;
  float scale, lr;
} loader;

static void raw_ptrs(const sg_engine *e, void *p[4], size_t b[4]) {
  const size_t P = sg__dtype_size(e->cfg.param_dtype);
  p[0] = e->params;
  b[0] = e->plan->total_numel * P;
  p[1] = e->opt.master;
  b[1] = e->opt.master ? e->lay.opt_numel * 4 : 0;
  p[2] = e->opt.state[0];
  b[2] = e->lay.opt_numel * 4;
  p[3] = e->opt.state[1];
  b[3] = e->lay.opt_numel * 4;
}

static void raw_take(loader *L) {
  void *p[4];
  raw_ptrs(L->e, p, L->bytes);
  for (int k = 0; k < 4; k++) {
    free(L->copy[k]);
    L->copy[k] = malloc(L->bytes[k] + 1);
    if (L->bytes[k]) memcpy(L->copy[k], p[k], L->bytes[k]);
  }
  L->step = L->e->opt.step;
  L->scale = L->e->sc.loss_scale;
  L->lr = L->e->opt.lr[0];
}

static int raw_same(const loader *L) {
  void *p[4];
  size_t b[4];
  raw_ptrs(L->e, p, b);
  for (int k = 0; k < 4; k++)
    if (b[k] != L->bytes[k] || (b[k] && memcmp(p[k], L->copy[k], b[k]) != 0)) return 0;
  return L->e->opt.step == L->step && L->e->sc.loss_scale == L->scale && L->e->opt.lr[0] == L->lr;
}

static int loader_init(loader *L) {
  memset(L, 0, sizeof *L);
  if (sg_comm_create_local(1, &L->comm) != SG_OK) return 0;
  if (make_engine(L->comm, &k_m, &L->e, L->ids) != SG_OK) return 0;
  raw_take(L);
  return 1;
}

static void loader_free(loader *L) {
  sg_engine_destroy(L->e);
  sg_comm_destroy(L->comm);
  for (int k = 0; k < 4; k++) free(L->copy[k]);
}

/* ---------------------------------------------------------------------------------------- */
/* the checkpoint                                                                            */

static void save_rank(int rank, int world, sg_comm *comm, void *arg) {
  sg_engine *e = NULL;
  int ids[MAXP];
  sg_status st = make_engine(comm, &k_m, &e, ids);
  if (!st) st = train(e, &k_m, ids, 0, 2);
  if (!st) st = sg_save(e, g_dir);
  if (rank == 0) CHECK(st == SG_OK, "W=%d save: %s", world, sg_last_error());
  sg_engine_destroy(e);
}

/* ---------------------------------------------------------------------------------------- */
/* sweeps                                                                                    */

typedef struct {
  int tried, refused, unchanged, crashed_open; /* counts */
  long first_bad;                              /* offset of the first wrong outcome, -1 none */
  sg_status first_st;
} tally;

static void outcome(loader *L, tally *t, long off, sg_status st) {
  t->tried++;
  const int ok = st == SG_ERR_CORRUPT || st == SG_ERR_IO;
  t->refused += ok;
  const int same = raw_same(L);
  t->unchanged += same;
  if ((!ok || !same) && t->first_bad < 0) {
    t->first_bad = off;
    t->first_st = st;
  }
}

/* Offsets to damage: every byte of small files; else every header byte (the first `head`)
 * and a random sample of the rest. */
static int want_offset(size_t off, size_t n, size_t head, int full) {
  if (full || n <= 65536 || off < head) return 1;
  return rnd() % (n / 3000) == 0;
}

static void sweep_flips(loader *L, const char *path, size_t head, int full) {
  blob b = read_blob(path);
  tally t = {0, 0, 0, 0, -1, SG_OK};
  for (size_t off = 0; off < b.n; off++) {
    if (!want_offset(off, b.n, head, full)) continue;
    const uint8_t x = (uint8_t)(1 + rnd() % 255);
    b.p[off] ^= x;
    patch(path, off, b.p + off, 1);
    outcome(L, &t, (long)off, sg_load(L->e, g_dir));
    b.p[off] ^= x;
    patch(path, off, b.p + off, 1);
  }
  CHECK(t.refused == t.tried && t.tried > 0,
        "%s: %d of %d byte flips refused with "
        "SG_ERR_CORRUPT/IO (first exception at byte %ld: %s)",
        path, t.refused, t.tried, t.first_bad, sg_status_string(t.first_st));
  CHECK(t.unchanged == t.tried, "%s: the engine is unchanged after every refused load (%d/%d)",
        path, t.unchanged, t.tried);
  printf("%s (%zu bytes): %d flips refused\n", path, b.n, t.refused);
  free(b.p);
}

static void sweep_truncations(loader *L, const char *path, int full) {
  blob b = read_blob(path);
  tally t = {0, 0, 0, 0, -1, SG_OK};
  for (size_t len = b.n; len-- > 0;) { /* shrinking, then restored in place */
    if (!want_offset(len, b.n, 400, full)) continue;
    if (truncate(path, (off_t)len) != 0) printf("truncate %s failed\n", path);
    outcome(L, &t, (long)len, sg_load(L->e, g_dir));
    patch(path, len, b.p + len, b.n - len);
  }
  b.p[b.n] = 0; /* one byte too many */
  patch(path, b.n, b.p + b.n, 1);
  outcome(L, &t, (long)b.n, sg_load(L->e, g_dir));
  if (truncate(path, (off_t)b.n) != 0) printf("truncate %s failed\n", path);
  char moved[1300];
  if (snprintf(moved, sizeof moved, "%s.away", path) >= (int)sizeof moved) return;
  rename(path, moved);
  outcome(L, &t, -2, sg_load(L->e, g_dir));
  rename(moved, path);
  CHECK(t.refused == t.tried,
        "%s: %d of %d truncations, an extension and removal refused "
        "(first exception at length %ld: %s)",
        path, t.refused, t.tried, t.first_bad, sg_status_string(t.first_st));
  CHECK(t.unchanged == t.tried, "%s: the engine is unchanged after every refused load", path);
  printf("%s: %d truncations refused\n", path, t.refused);
  free(b.p);
}

/* Past the checksums: manifest bytes flipped, then its checksum recomputed. Any status but a
 * crash; a load that succeeds must still be internally consistent (it can only differ in
 * fields like the step). */
static void sweep_manifest_structure(loader *L, const char *path) {
  blob b = read_blob(path);
  int tried = 0, refused = 0, ok = 0, other = 0;
  for (size_t off = 0; off + 4 < b.n; off++) {
    const uint8_t x = (uint8_t)(1 + rnd() % 255);
    b.p[off] ^= x;
    const uint32_t c = sg__crc32c(0, b.p, b.n - 4);
    uint8_t save[4];
    memcpy(save, b.p + b.n - 4, 4);
    for (int i = 0; i < 4; i++) b.p[b.n - 4 + i] = (uint8_t)(c >> (8 * i));
    patch(path, 0, b.p, b.n);
    const sg_status st = sg_load(L->e, g_dir);
    tried++;
    refused += st == SG_ERR_CORRUPT || st == SG_ERR_IO || st == SG_ERR_MISMATCH;
    ok += st == SG_OK;
    other += st != SG_OK && st != SG_ERR_CORRUPT && st != SG_ERR_IO && st != SG_ERR_MISMATCH;
    memcpy(b.p + b.n - 4, save, 4);
    b.p[off] ^= x;
  }
  patch(path, 0, b.p, b.n);
  CHECK(other == 0 && tried == refused + ok,
        "manifest with recomputed checksum: %d flips, %d "
        "refused (CORRUPT/IO/MISMATCH), %d accepted, %d other statuses",
        tried, refused, ok, other);
  printf("manifest structure: %d flips past the checksum: %d refused, %d accepted\n", tried,
         refused, ok);
  free(b.p);
}

/* Rank-file headers flipped with their checksum recomputed, straight into the parser. */
static void sweep_header_structure(const char *path) {
  blob b = read_blob(path);
  uint32_t hb = 0;
  sg_status st = sg__ck_header_size(b.p, b.n, b.n, path, &hb);
  CHECK(st == SG_OK, "header size of %s: %s", path, sg_last_error());
  if (st != SG_OK) {
    free(b.p);
    return;
  }
  int tried = 0, parsed = 0, refused = 0;
  for (size_t off = 0; off + 4 < hb; off++)
    for (int bit = 0; bit < 8; bit++) {
      b.p[off] ^= (uint8_t)(1u << bit);
      const uint32_t c = sg__crc32c(0, b.p, hb - 4);
      uint8_t save[4];
      memcpy(save, b.p + hb - 4, 4);
      for (int i = 0; i < 4; i++) b.p[hb - 4 + i] = (uint8_t)(c >> (8 * i));
      sg__ck_header h;
      uint32_t hb2 = 0;
      st = sg__ck_header_size(b.p, hb, b.n, path, &hb2);
      if (st == SG_OK) st = sg__ck_header_parse(b.p, hb2 <= hb ? hb2 : hb, path, &h);
      tried++;
      parsed += st == SG_OK;
      refused += st == SG_ERR_CORRUPT;
      if (st == SG_OK) sg__ck_header_free(&h);
      memcpy(b.p + hb - 4, save, 4);
      b.p[off] ^= (uint8_t)(1u << bit);
    }
  CHECK(parsed + refused == tried,
        "rank file header with recomputed checksum: %d bit flips, "
        "%d refused with SG_ERR_CORRUPT, %d parsed",
        tried, refused, parsed);
  free(b.p);
}

/* The safetensors import: damaged headers and truncations, any refusal but never a crash, and
 * never SG_OK for a truncated file. */
static void sweep_import(loader *L, const char *path) {
  CHECK(sg_export(L->e, path) == SG_OK, "export for the import sweep: %s", sg_last_error());
  blob b = read_blob(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0 && b.n >= 8; i--) n = (n << 8) | b.p[i];
  int tried = 0, fine = 0;
  for (size_t off = 0; off < 8 + n && off < b.n; off++) {
    const uint8_t x = (uint8_t)(1 + rnd() % 255);
    b.p[off] ^= x;
    patch(path, off, b.p + off, 1);
    const sg_status st = sg_import(L->e, path);
    tried++;
    fine += st == SG_OK || st == SG_ERR_CORRUPT || st == SG_ERR_MISMATCH || st == SG_ERR_IO;
    b.p[off] ^= x;
    patch(path, off, b.p + off, 1);
  }
  int trunc_refused = 0, truncs = 0;
  for (size_t len = b.n; len-- > 0;) {
    if (len > 8 + n && len % 97) continue;
    if (truncate(path, (off_t)len) != 0) printf("truncate %s failed\n", path);
    const sg_status st = sg_import(L->e, path);
    truncs++;
    trunc_refused += st == SG_ERR_CORRUPT || st == SG_ERR_IO || st == SG_ERR_MISMATCH;
    patch(path, len, b.p + len, b.n - len);
  }
  CHECK(fine == tried, "import: %d header byte flips, each OK or refused (%d)", tried, fine);
  CHECK(trunc_refused == truncs, "import: %d of %d truncations refused", trunc_refused, truncs);
  CHECK(sg_import(L->e, path) == SG_OK, "import of the intact export: %s", sg_last_error());
  printf("import: %d header flips and %d truncations handled\n", tried, truncs);
  free(b.p);
  remove(path);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  const int full = getenv("SG_CKPT_FULL") && atoi(getenv("SG_CKPT_FULL")) > 0;
  snprintf(g_root, sizeof g_root, "%s/sg_ckptc_XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_root)) return 1;
  snprintf(g_dir, sizeof g_dir, "%s/ck", g_root);
  sg__ckpt_set_chunk_bytes(128);
  run_ranks(SAVE_WORLD, save_rank, NULL);
  loader L;
  if (!loader_init(&L)) {
    CHECK(0, "loading engine: %s", sg_last_error());
    return finish();
  }
  CHECK(sg_load(L.e, g_dir) == SG_OK && L.e->opt.step == 2,
        "the intact checkpoint loads at W=1 "
        "(step %llu): %s",
        (unsigned long long)L.e->opt.step, sg_last_error());
  raw_take(&L);
  char files[1 + SAVE_WORLD][400];
  snprintf(files[0], sizeof files[0], "%s/manifest", g_dir);
  for (int r = 0; r < SAVE_WORLD; r++)
    snprintf(files[1 + r], sizeof files[1 + r], "%s/g1.r%d.shard", g_dir, r);
  for (int f = 0; f < 1 + SAVE_WORLD; f++) {
    sweep_flips(&L, files[f], f == 0 ? 1u << 30 : 1200, full);
    sweep_truncations(&L, files[f], full);
  }
  CHECK(sg_load(L.e, g_dir) == SG_OK && raw_same(&L),
        "the restored checkpoint loads again, "
        "same state: %s",
        sg_last_error());
  sweep_manifest_structure(&L, files[0]);
  for (int r = 0; r < SAVE_WORLD; r++) sweep_header_structure(files[1 + r]);
  char st_path[400];
  snprintf(st_path, sizeof st_path, "%s/x.safetensors", g_root);
  sweep_import(&L, st_path);
  loader_free(&L);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
  if (system(cmd) != 0) printf("could not remove %s\n", g_root);
  return finish();
}
