/* libFuzzer target over the checkpoint readers (issue 5). The first input byte picks the mode:
 *   0  manifest parser on the raw bytes
 *   1  manifest parser with the length field and checksum made right, so that the structural
 *      checks behind them are what gets fuzzed
 *   2  rank-file header parser, header size and checksum made right
 *   3  safetensors header (JSON) parser
 *   4  the whole sg_load: the bytes, with length and checksum made right, become the manifest
 *      of a real checkpoint (whose rank file is intact) loaded by an engine at W=1
 * Built by tests/ckpt.cmake with SG_FUZZ=ON and clang; scripts/fuzz_ckpt.sh builds and runs it.
 * With SG_FUZZ_WRITE_SEEDS=DIR, initialization writes one seed per mode from a real checkpoint
 * into DIR. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/sg_ckpt.h"        /* parsers, CRC */
#include "ckpt/sg_safetensors.h" /* JSON header parser */
#include "shardgrad.h"

static sg_comm *g_comm;
static sg_engine *g_eng;
static char g_dir[300], g_manifest[340];

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A manifest's length field and trailing checksum made consistent with its bytes. */
static void fix_manifest(uint8_t *b, size_t n) {
  if (n >= 24) put64(b + 16, n);
  if (n >= 4) put32(b + n - 4, sg__crc32c(0, b, n - 4));
}

static void fix_header(uint8_t *b, size_t n) {
  if (n >= 16) put32(b + 12, (uint32_t)n);
  if (n >= 4) put32(b + n - 4, sg__crc32c(0, b, n - 4));
}

static void write_file(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return;
  if (n) fwrite(p, 1, n, f);
  fclose(f);
}

static uint8_t *read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *b = malloc(*n + 1);
  if (b && fread(b, 1, *n, f) != *n) *n = 0;
  fclose(f);
  return b;
}

static void write_seed(const char *dir, int mode, const uint8_t *p, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/seed%d", dir, mode);
  uint8_t *b = malloc(n + 1);
  if (!b) return;
  b[0] = (uint8_t)mode;
  memcpy(b + 1, p, n);
  write_file(path, b, n + 1);
  free(b);
}

static void write_seeds(const char *dir) {
  size_t n = 0;
  uint8_t *m = read_file(g_manifest, &n);
  if (m) {
    write_seed(dir, 0, m, n);
    write_seed(dir, 1, m, n);
    write_seed(dir, 4, m, n);
    free(m);
  }
  char path[400];
  snprintf(path, sizeof path, "%s/g1.r0.shard", g_dir);
  uint8_t *s = read_file(path, &n);
  uint32_t hb = 0;
  if (s && sg__ck_header_size(s, n, n, path, &hb) == SG_OK) write_seed(dir, 2, s, hb);
  free(s);
  snprintf(path, sizeof path, "%s/x.safetensors", g_dir);
  if (sg_export(g_eng, path) == SG_OK && (s = read_file(path, &n)) != NULL && n > 8) {
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = (h << 8) | s[i];
    if (h <= n - 8) write_seed(dir, 3, s + 8, (size_t)h);
  }
  free(s);
}

/* An engine at W=1 and a checkpoint of it in a temporary directory (tmpfs when there is one:
 * the manifest is rewritten for every input). */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(g_dir, sizeof g_dir, "%s/sg_fuzz_XXXXXX", base);
  if (!mkdtemp(g_dir)) return 0;
  snprintf(g_manifest, sizeof g_manifest, "%s/manifest", g_dir);
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.param_dtype = cfg.grad_dtype = cfg.reduce_dtype = SG_BF16;
  cfg.bucket_bytes = 512;
  const size_t sizes[5] = {1, 63, 65, 300, 700};
  int id = 0;
  if (sg_comm_create_local(1, &g_comm) || sg_engine_create(g_comm, &cfg, &g_eng)) return 0;
  for (int p = 0; p < 5; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    if (sg_add_param(g_eng, name, sizes[p], 0, &id)) return 0;
  }
  sg__ckpt_set_chunk_bytes(256);
  if (sg_finalize(g_eng) || sg_save(g_eng, g_dir)) {
    fprintf(stderr, "fuzz_ckpt: setup failed: %s\n", sg_last_error());
    return 0;
  }
  const char *seeds = getenv("SG_FUZZ_WRITE_SEEDS");
  if (seeds && *seeds) write_seeds(seeds);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > (1u << 20)) return 0;
  const int mode = data[0] % 5;
  const size_t n = size - 1;
  uint8_t *b = malloc(n + 1);
  if (!b) return 0;
  memcpy(b, data + 1, n);
  if (mode == 0 || mode == 1) {
    if (mode == 1) fix_manifest(b, n);
    sg__ck_manifest m;
    if (sg__ck_manifest_parse(b, n, "fuzz", &m) == SG_OK) sg__ck_manifest_free(&m);
  } else if (mode == 2) {
    fix_header(b, n);
    sg__ck_header h;
    if (sg__ck_header_parse(b, n, "fuzz", &h) == SG_OK) sg__ck_header_free(&h);
  } else if (mode == 3) {
    sg__st_entry *ent = NULL;
    size_t cnt = 0;
    if (sg__st_parse_header((const char *)b, n, "fuzz", &ent, &cnt) == SG_OK) {
      if (cnt) (void)sg__st_find(ent, cnt, ent[cnt / 2].name);
      (void)sg__st_check_layout(ent, cnt, n, "fuzz"); /* as if the header's bytes were the data */
      sg__st_entries_free(ent, cnt);
    }
  } else if (g_eng) {
    fix_manifest(b, n);
    write_file(g_manifest, b, n);
    const sg_status st = sg_load(g_eng, g_dir);
    if (st != SG_OK && st != SG_ERR_CORRUPT && st != SG_ERR_IO && st != SG_ERR_MISMATCH &&
        st != SG_ERR_OUT_OF_MEMORY) {
      fprintf(stderr, "fuzz_ckpt: sg_load returned %s: %s\n", sg_status_string(st),
              sg_last_error());
      abort();
    }
  }
  free(b);
  return 0;
}
