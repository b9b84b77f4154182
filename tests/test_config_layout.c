/* sg_config's published layouts (include/shardgrad.h, src/core/sg_config.c): a caller built
 * against 0.1's header and one built against 0.2's both work, and struct_size tells them
 * apart. 0.1's struct ended with 4 bytes of tail padding after timeout_ms, where 0.2 put
 * overlap_param_gather: a 0.1-sized config gets overlap_param_gather = 0 whatever those bytes
 * hold. The 0.1 struct is spelled out here as its header had it, so that the size the library
 * expects is checked against the real old layout, not against itself. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "engine/sg_engine_internal.h" /* e->cfg: the config the engine runs with */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 1
#include "sg_test_check.h"

/* include/shardgrad.h of 0.1.0, field for field */
typedef struct sg_config_v0_1 {
  size_t struct_size;
  sg_strategy strategy;
  sg_device device;
  int cuda_device;
  sg_dtype param_dtype, grad_dtype, reduce_dtype, accum_dtype;
  size_t bucket_bytes;
  int staging_buckets;
  float lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  int grad_average;
  float loss_scale, init_loss_scale;
  int scale_window;
  float min_loss_scale;
  int skip_nonfinite, stochastic_rounding;
  uint64_t seed;
  int timeout_ms;
} sg_config_v0_1;

/* 0.2 ended with reserved_0_2; 0.3's block starts right after it. */
#define V0_2_SIZE (offsetof(sg_config, offload_optimizer))

/* The caller's bytes: a config of `size` bytes inside a buffer filled with `fill`. */
typedef union {
  sg_config cfg;
  unsigned char bytes[sizeof(sg_config) + 64];
} cfg_buf;

/* One engine on one rank with two parameters, two steps: the config works end to end. Returns
 * the overlap_param_gather the engine runs with (-1 on failure). */
static int run_engine(const sg_config *cfg, const char *what) {
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int overlap = -1;
  if (!CHECK(sg_comm_create_local(1, &c) == SG_OK, "%s: comm", what)) return -1;
  int ok = CHECK(sg_engine_create(c, cfg, &e) == SG_OK, "%s: sg_engine_create", what);
  int id[2] = {0, 0};
  ok = ok && sg_add_param(e, "w", 100, 0, &id[0]) == SG_OK &&
       sg_add_param(e, "b", 10, SG_PARAM_NO_DECAY, &id[1]) == SG_OK;
  ok = ok && CHECK(sg_finalize(e) == SG_OK, "%s: sg_finalize", what);
  for (int s = 0; ok && s < 2; s++) {
    for (int p = 0; ok && p < 2; p++) {
      float g[100];
      for (int i = 0; i < 100; i++) g[i] = 0.25f * (float)((i + p + s) % 5) - 0.5f;
      ok = sg_grad_add(e, id[p], g, SG_F32) == SG_OK;
    }
    sg_step_info info = {sizeof info, 0, 0, 0, 0, 0};
    ok = ok && sg_step(e, &info) == SG_OK && info.step == (uint64_t)s + 1;
  }
  if (CHECK(ok, "%s: two steps", what)) {
    float w[100];
    ok = sg_get_param(e, id[0], w, SG_F32) == SG_OK;
    int moved = 0;
    for (int i = 0; i < 100; i++) moved += w[i] != 0.0f;
    CHECK(ok && moved > 0, "%s: the parameters moved (%d of 100)", what, moved);
    overlap = e->cfg.overlap_param_gather;
  }
  sg_engine_destroy(e);
  sg_comm_destroy(c);
  return overlap;
}

static void test_sizes(void) {
  printf("published sizes ...\n");
  CHECK(sizeof(sg_config) > sizeof(sg_config_v0_1),
        "0.2's sizeof %zu differs from 0.1's %zu", sizeof(sg_config), sizeof(sg_config_v0_1));
  CHECK(offsetof(sg_config, overlap_param_gather) >= offsetof(sg_config_v0_1, timeout_ms) + 4 &&
            offsetof(sg_config, overlap_param_gather) < sizeof(sg_config_v0_1),
        "overlap_param_gather sits in 0.1's tail padding (offset %zu, 0.1 size %zu)",
        offsetof(sg_config, overlap_param_gather), sizeof(sg_config_v0_1));
  const size_t ok_sizes[] = {sizeof(sg_config_v0_1), V0_2_SIZE, sizeof(sg_config)};
  for (int k = 0; k < 3; k++) {
    cfg_buf b;
    memset(&b, 0xa5, sizeof b);
    CHECK(sg_config_init(&b.cfg, ok_sizes[k]) == SG_OK && b.cfg.struct_size == ok_sizes[k] &&
              b.bytes[ok_sizes[k]] == 0xa5,
          "sg_config_init(%zu) works and writes only %zu bytes", ok_sizes[k], ok_sizes[k]);
  }
  /* Sizes between the published ones name no layout. */
  const size_t bad[] = {sizeof(sg_config_v0_1) - 4, sizeof(sg_config_v0_1) + 4, V0_2_SIZE + 8,
                        sizeof(sg_config) - 4, sizeof(sg_config) + 8};
  for (int k = 0; k < 5; k++) {
    cfg_buf b;
    memset(&b, 0xa5, sizeof b);
    CHECK(sg_config_init(&b.cfg, bad[k]) == SG_ERR_INVALID_ARGUMENT && b.bytes[0] == 0xa5 &&
              strstr(sg_last_error(), "struct_size"),
          "sg_config_init(%zu) is rejected: '%s'", bad[k], sg_last_error());
  }
}

static void test_v0_1_caller(void) {
  printf("a 0.1 caller ...\n");
  static const unsigned char fills[] = {0x00, 0x01, 0xff};
  for (int f = 0; f < 3; f++) {
    /* What a 0.1 program does: its own struct, the library's init, its own changes. Then the
     * padding holds whatever its stack held. */
    cfg_buf b;
    memset(&b, 0xa5, sizeof b);
    if (!CHECK(sg_config_init(&b.cfg, sizeof(sg_config_v0_1)) == SG_OK, "init 0.1")) return;
    sg_config_v0_1 *old = (sg_config_v0_1 *)(void *)b.bytes;
    old->lr = 0.01f;
    old->timeout_ms = 30000;
    memset(b.bytes + offsetof(sg_config_v0_1, timeout_ms) + 4, fills[f],
           sizeof(sg_config_v0_1) - offsetof(sg_config_v0_1, timeout_ms) - 4);
    sg_config copy;
    CHECK(sg__config_copy(&b.cfg, &copy, "t") == SG_OK && copy.overlap_param_gather == 0 &&
              copy.reserved_0_2 == 0 && copy.lr == 0.01f && copy.timeout_ms == 30000 &&
              copy.struct_size == sizeof copy,
          "padding 0x%02x: copied with overlap_param_gather 0 (got %d)", fills[f],
          copy.overlap_param_gather);
    char what[64];
    snprintf(what, sizeof what, "0.1-sized, padding 0x%02x", fills[f]);
    CHECK(run_engine(&b.cfg, what) == 0, "%s: engine runs with overlap_param_gather 0", what);
  }
}

static void test_v0_2_caller(void) {
  printf("a 0.2 caller ...\n");
  for (int ov = 0; ov <= 1; ov++) {
    cfg_buf b;
    memset(&b, 0xa5, sizeof b); /* a 0.2 caller owns only V0_2_SIZE bytes */
    if (!CHECK(sg_config_init(&b.cfg, V0_2_SIZE) == SG_OK, "init 0.2")) return;
    sg_config c = b.cfg;
    c.overlap_param_gather = ov;
    char what[64];
    snprintf(what, sizeof what, "0.2-sized, overlap_param_gather %d", ov);
    CHECK(run_engine(&c, what) == ov, "%s: the engine keeps it", what);
  }
  sg_config c;
  sg_config_init(&c, sizeof c);
  c.reserved_0_2 = 1;
  sg_comm *comm = NULL;
  sg_engine *e = NULL;
  sg_comm_create_local(1, &comm);
  CHECK(sg_engine_create(comm, &c, &e) == SG_ERR_INVALID_ARGUMENT && !e &&
            strstr(sg_last_error(), "reserved_0_2"),
        "reserved_0_2 != 0 is rejected: '%s'", sg_last_error());
  sg_comm_destroy(comm);
}

/* A 0.3 field set to a value the library cannot honour fails sg_engine_create by name. */
static void expect_rejected(sg_config c, const char *field, sg_status want) {
  sg_comm *comm = NULL;
  sg_engine *e = NULL;
  sg_comm_create_local(1, &comm);
  sg_status st = sg_engine_create(comm, &c, &e);
  CHECK(st == want && !e && strstr(sg_last_error(), field), "%s is rejected (%d): '%s'", field,
        (int)st, sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(comm);
}

static void test_v0_3_caller(void) {
  printf("a 0.3 caller ...\n");
  sg_config c;
  if (!CHECK(sg_config_init(&c, sizeof c) == SG_OK, "init 0.3")) return;
  CHECK(c.offload_optimizer == 0 && c.replica_reduce_dtype == SG_F32 && c.shard_ranks == 0 &&
            c.reserved_0_3 == 0,
        "0.3 defaults: no offload, f32 replica wire, flat layout");
  CHECK(run_engine(&c, "0.3-sized") == 0, "0.3-sized config runs");
  sg_config d = c;
  d.offload_optimizer = 1; /* the CPU device: accepted, changes nothing */
  CHECK(run_engine(&d, "0.3-sized, offload on the CPU device") == 0, "offload on CPU runs");
  d = c;
  d.shard_ranks = 1; /* one rank: the flat layout */
  CHECK(run_engine(&d, "0.3-sized, shard_ranks = world") == 0, "shard_ranks = world runs");
  d = c;
  d.offload_optimizer = 2;
  expect_rejected(d, "offload_optimizer", SG_ERR_INVALID_ARGUMENT);
  d = c;
  d.replica_reduce_dtype = SG_F16;
  expect_rejected(d, "replica_reduce_dtype", SG_ERR_INVALID_ARGUMENT);
  d = c;
  d.shard_ranks = 2;
  expect_rejected(d, "shard_ranks", SG_ERR_INVALID_ARGUMENT);
  d = c;
  d.reserved_0_3 = 1;
  expect_rejected(d, "reserved_0_3", SG_ERR_INVALID_ARGUMENT);
}

/* sg_memory_stats: 0.2's struct (no host_bytes) and 0.3's both work; nothing else does. */
static void test_memory_stats_sizes(void) {
  printf("sg_memory_stats sizes ...\n");
  sg_config c;
  sg_config_init(&c, sizeof c);
  size_t numel = 1000;
  union {
    sg_memory_stats s;
    unsigned char bytes[sizeof(sg_memory_stats) + 16];
  } b;
  const size_t old = offsetof(sg_memory_stats, host_bytes);
  memset(&b, 0xa5, sizeof b);
  b.s.struct_size = old;
  CHECK(sg_estimate_memory(&c, &numel, 1, 2, &b.s) == SG_OK && b.bytes[old] == 0xa5 &&
            b.s.numel >= 1000,
        "0.2-sized sg_memory_stats works and is written up to its size only");
  memset(&b, 0xa5, sizeof b);
  b.s.struct_size = sizeof(sg_memory_stats);
  CHECK(sg_estimate_memory(&c, &numel, 1, 2, &b.s) == SG_OK && b.s.host_bytes == 0,
        "0.3-sized sg_memory_stats: no host bytes without offload");
  b.s.struct_size = old + 4;
  CHECK(sg_estimate_memory(&c, &numel, 1, 2, &b.s) == SG_ERR_INVALID_ARGUMENT,
        "an unpublished sg_memory_stats size is rejected: '%s'", sg_last_error());
}

/* Every call that takes a config refuses `c` with a message that says to call sg_config_init. */
static void expect_uninitialised(const sg_config *c, const char *what) {
  sg_comm *comm = NULL;
  sg_engine *e = NULL;
  sg_comm_create_local(1, &comm);
  sg_status st = sg_engine_create(comm, c, &e);
  CHECK(st == SG_ERR_INVALID_ARGUMENT && !e && strstr(sg_last_error(), "call sg_config_init"),
        "%s: sg_engine_create refuses it (%d): '%s'", what, (int)st, sg_last_error());
  sg_engine_destroy(e);
  sg_comm_destroy(comm);
  size_t numel = 1000;
  sg_memory_stats ms;
  ms.struct_size = sizeof ms;
  st = sg_estimate_memory(c, &numel, 1, 1, &ms);
  CHECK(st == SG_ERR_INVALID_ARGUMENT && strstr(sg_last_error(), "call sg_config_init"),
        "%s: sg_estimate_memory refuses it (%d): '%s'", what, (int)st, sg_last_error());
}

/* A config of this header's size whose bytes never went through sg_config_init (zeroed, or
 * whatever the stack held) is refused by name; struct_size alone cannot tell it from a real
 * one. An initialised config, a copy of one and the older layouts (which end before the magic)
 * still run. */
static void test_uninitialised(void) {
  printf("configs never initialised ...\n");
  sg_config c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  expect_uninitialised(&c, "memset 0, struct_size set");
  static const unsigned char fills[] = {0x01, 0xa5, 0xff};
  for (int f = 0; f < 3; f++) {
    memset(&c, fills[f], sizeof c);
    c.struct_size = sizeof c;
    char what[64];
    snprintf(what, sizeof what, "garbage 0x%02x, struct_size set", fills[f]);
    expect_uninitialised(&c, what);
  }
  sg_config good;
  if (!CHECK(sg_config_init(&good, sizeof good) == SG_OK, "init")) return;
  CHECK(run_engine(&good, "initialised") == 0, "an initialised config runs");
  sg_config copy = good;
  copy.lr = 0.01f;
  CHECK(run_engine(&copy, "a copy of an initialised config") == 0, "a copy runs");
  cfg_buf b;
  memset(&b, 0xa5, sizeof b); /* a 0.3 caller owns only the bytes before 0.4's block */
  const size_t v0_3 = offsetof(sg_config, replica_codec);
  CHECK(sg_config_init(&b.cfg, v0_3) == SG_OK && run_engine(&b.cfg, "0.3-sized") == 0,
        "a 0.3-sized config (no magic in its layout) still runs");
}

int main(void) {
  test_sizes();
  test_v0_1_caller();
  test_v0_2_caller();
  test_v0_3_caller();
  test_memory_stats_sizes();
  test_uninitialised();
  return sg_test_summary("");
}
