/* Registration under attack (issue 14, items 6, 8 and 9):
 *   names     names that are not well-formed UTF-8 (stray continuation bytes, overlong forms,
 *             surrogates, code points past U+10FFFF, truncated sequences) and the reserved
 *             "__metadata__" are refused by sg_add_param with SG_ERR_INVALID_ARGUMENT and a
 *             message; the engine is unchanged and keeps working; every other UTF-8 name
 *             (accents, CJK, emoji, control characters, quotes) registers and round-trips
 *             through sg_export/sg_import
 *   sizes     sg_estimate_memory with numel 2^60 (and other totals past 2^61 bytes per arena)
 *             is SG_ERR_INVALID_ARGUMENT, never SG_OK with a wrapped total; sg_finalize of
 *             parameters whose total overflows is refused and the engine can be destroyed
 *   million   10^6 parameters registered (each name checked against all before it) and
 *             finalized: linear work. The quadratic duplicate scan this replaces took 28 s for
 *             10^5 names and would need hours for 10^6: the ctest TIMEOUT catches it. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sg_test_check.h"

static sg_engine *new_engine(sg_comm **c) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  sg_engine *e = NULL;
  if (sg_comm_create_local(1, c) != SG_OK || sg_engine_create(*c, &cfg, &e) != SG_OK) return NULL;
  return e;
}

/* ---------------------------------------------------------------------------------------- */

static void test_names(const char *tmpdir) {
  static const struct {
    const char *name, *what;
  } bad[] = {
      {"w\xff", "a 0xFF byte"},
      {"\x80w", "a stray continuation byte"},
      {"a\xc0\xafz", "an overlong '/' (C0 AF)"},
      {"a\xe0\x80\xafz", "an overlong '/' in three bytes"},
      {"\xed\xa0\x80", "a UTF-16 surrogate (U+D800)"},
      {"\xed\xbf\xbf", "a UTF-16 surrogate (U+DFFF)"},
      {"\xf4\x90\x80\x80", "a code point past U+10FFFF"},
      {"\xf5\x80\x80\x80", "a byte F5"},
      {"layer.\xe2\x82", "a sequence cut short at the end"},
      {"a\xe2\x82z", "a sequence cut short in the middle"},
      {"\xc3", "a lone lead byte"},
      {"__metadata__", "safetensors' reserved key"},
  };
  static const char *const good[] = {
      "caf\xc3\xa9.weight",              /* é */
      "\xe6\x97\xa5\xe6\x9c\xac.bias",   /* 日本 */
      "emoji\xf0\x9f\x98\x80",           /* U+1F600 */
      "\xf4\x8f\xbf\xbf",                /* U+10FFFF, the last code point */
      "\xef\xbf\xbd",                    /* U+FFFD */
      "tab\there",                       /* control characters are escaped in JSON */
      "quote\"back\\slash",
      "__metadata__x",
  };
  sg_comm *c = NULL;
  sg_engine *e = new_engine(&c);
  if (!CHECK(e != NULL, "engine: %s", sg_last_error())) return;
  int id = -1, n = 0;
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    const sg_status st = sg_add_param(e, bad[k].name, 8, 0, &id);
    const char *err = sg_last_error();
    CHECK(st == SG_ERR_INVALID_ARGUMENT && strstr(err, "sg_add_param") &&
              (strstr(err, "UTF-8") || strstr(err, "reserved")),
          "name with %s refused: %s \"%s\"", bad[k].what, sg_status_string(st), err);
  }
  for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
    const sg_status st = sg_add_param(e, good[k], 8 + k, 0, &id);
    CHECK(st == SG_OK && id == n, "UTF-8 name #%zu registers as id %d: %s", k, id,
          sg_last_error());
    n += st == SG_OK;
  }
  CHECK(sg_add_param(e, good[0], 3, 0, &id) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "already registered (id 0)"),
        "a duplicate is still refused, naming the first id: \"%s\"", sg_last_error());
  CHECK(sg_finalize(e) == SG_OK, "finalize after the refusals: %s", sg_last_error());
  float v[16];
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < 16; j++) v[j] = (float)(i * 16 + j) * 0.5f;
    sg_set_param(e, i, v, SG_F32);
  }
  char path[400];
  snprintf(path, sizeof path, "%s/names.safetensors", tmpdir);
  CHECK(sg_export(e, path) == SG_OK, "export with UTF-8 names: %s", sg_last_error());
  for (int i = 0; i < n; i++) sg_set_param(e, i, (float[16]){0}, SG_F32);
  CHECK(sg_import(e, path) == SG_OK, "import of that export: %s", sg_last_error());
  int same = 1;
  for (int i = 0; i < n; i++) {
    float got[16];
    sg_get_param(e, i, got, SG_F32);
    for (size_t j = 0; j < 8 + (size_t)i; j++) same &= got[j] == (float)(i * 16 + (int)j) * 0.5f;
  }
  CHECK(same, "every UTF-8-named parameter round-trips through safetensors");
  unlink(path);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

/* ---------------------------------------------------------------------------------------- */

static void test_sizes(void) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  sg_memory_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  const size_t huge[] = {(size_t)1 << 60};
  sg_status st = sg_estimate_memory(&cfg, huge, 1, 1, &s);
  CHECK(st == SG_ERR_INVALID_ARGUMENT && strstr(sg_last_error(), "sg_estimate_memory") &&
            strstr(sg_last_error(), "too large"),
        "estimate for numel 2^60: %s \"%s\" (total %zu)", sg_status_string(st), sg_last_error(),
        s.total_bytes);
  for (int world = 1; world <= 8; world *= 2) {
    const sg_strategy strat[3] = {SG_NO_SHARD, SG_SHARD_OPT, SG_SHARD_GRAD_OP};
    for (int k = 0; k < 3; k++) {
      cfg.strategy = strat[k];
      const size_t four[4] = {(size_t)1 << 58, (size_t)1 << 58, (size_t)1 << 58,
                              (size_t)1 << 58};
      st = sg_estimate_memory(&cfg, four, 4, world, &s);
      CHECK(st == SG_ERR_INVALID_ARGUMENT, "estimate for 4 x 2^58 at W=%d strategy %d: %s", world,
            k, sg_status_string(st));
    }
  }
  cfg.strategy = SG_SHARD_GRAD_OP;
  const size_t max[] = {SIZE_MAX, 1};
  st = sg_estimate_memory(&cfg, max, 2, 2, &s);
  CHECK(st == SG_ERR_INVALID_ARGUMENT, "estimate with numel SIZE_MAX: %s", sg_status_string(st));
  /* the largest accepted estimate has a total that adds up (no wrap) */
  const size_t big[] = {(size_t)1 << 56};
  st = sg_estimate_memory(&cfg, big, 1, 4, &s);
  CHECK(st == SG_OK && s.total_bytes == s.params_bytes + s.grads_bytes + s.master_bytes +
                                              s.optim_bytes + s.comm_bytes &&
            s.params_bytes >= ((size_t)1 << 58),
        "estimate for 2^56 f32 elements at W=4: %s, total %zu = the sum of its parts",
        sg_status_string(st), s.total_bytes);
  /* registration: each numel <= 2^48, but their sum past what an arena can hold */
  sg_comm *c = NULL;
  /* 2048 x 2^48 = 2^59 elements: a plan, but 2^61 bytes of parameters; 9000 x 2^48: no plan */
  const int counts[2] = {2048, 9000};
  for (int k = 0; k < 2; k++) {
    sg_engine *e = new_engine(&c);
    if (!CHECK(e != NULL, "engine: %s", sg_last_error())) return;
    int id = 0;
    st = SG_OK;
    for (int i = 0; i < counts[k] && st == SG_OK; i++) {
      char name[32];
      snprintf(name, sizeof name, "p%d", i);
      st = sg_add_param(e, name, (size_t)1 << 48, 0, &id);
    }
    CHECK(st == SG_OK, "%d parameters of 2^48 elements register: %s", counts[k],
          sg_last_error());
    st = sg_finalize(e);
    CHECK(st == SG_ERR_INVALID_ARGUMENT && strstr(sg_last_error(), "sg_finalize"),
          "their finalize is refused before allocating: %s \"%s\"", sg_status_string(st),
          sg_last_error());
    CHECK(sg_memory(e, &s) == SG_ERR_INVALID_STATE, "and the engine has no memory to report");
    sg_engine_destroy(e);
    sg_comm_destroy(c);
  }
}

/* ---------------------------------------------------------------------------------------- */

static void test_million(void) {
  /* SG_TEST_QUICK (the TSan stage): 10^5, whose plan a sanitizer's shadow memory can afford */
  const int N = getenv("SG_TEST_QUICK") && atoi(getenv("SG_TEST_QUICK")) > 0 ? 100000 : 1000000;
  sg_comm *c = NULL;
  sg_engine *e = new_engine(&c);
  if (!CHECK(e != NULL, "engine: %s", sg_last_error())) return;
  char name[64];
  int id = -1, bad = 0;
  for (int i = 0; i < N; i++) {
    snprintf(name, sizeof name, "model.layers.%d.mlp.weight", i);
    if (sg_add_param(e, name, 1 + (size_t)(i % 3), 0, &id) != SG_OK || id != i) bad++;
  }
  CHECK(bad == 0, "%d parameters register with ids 0..%d (%d failures)", N, N - 1, bad);
  snprintf(name, sizeof name, "model.layers.%d.mlp.weight", N > 777777 ? 777777 : 77777);
  CHECK(sg_add_param(e, name, 1, 0, &id) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), N > 777777 ? "(id 777777)" : "(id 77777)"),
        "a duplicate among %d is found: \"%s\"", N, sg_last_error());
  CHECK(sg_finalize(e) == SG_OK, "%d parameters finalize: %s", N, sg_last_error());
  sg_memory_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  CHECK(sg_memory(e, &s) == SG_OK && s.numel >= (size_t)N * 64,
        "their plan: %zu elements (each parameter 64-aligned)", s.numel);
  sg_engine_destroy(e);
  sg_comm_destroy(c);
}

int main(void) {
  const char *t = getenv("TMPDIR");
  char dir[300];
  snprintf(dir, sizeof dir, "%s/sg_params_XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(dir)) return 1;
  test_names(dir);
  test_sizes();
  test_million();
  rmdir(dir);
  return sg_test_summary("");
}
