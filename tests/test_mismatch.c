/* Ranks that disagree at sg_finalize (DESIGN.md section 2: "sg_finalize compares it across
 * ranks and fails with SG_ERR_MISMATCH on every rank, naming the first differing parameter").
 *
 * One rank (the last, the first or a middle one, varying by case) registers different
 * parameters (another name at one position, another numel, other flags, one extra parameter at
 * the end or in the middle, one missing, two swapped) or uses another config value
 * (bucket_bytes, lr, strategy, param dtype, weight_decay, scale_window, seed). Every rank must
 * get SG_ERR_MISMATCH from sg_finalize (timeout_ms = 10000 is only a backstop against a hang:
 * SG_ERR_TIMEOUT fails the check), with a message from sg_finalize naming the first differing
 * parameter ("#k") or config field; the engines stay unfinalized (SG_ERR_INVALID_STATE from
 * sg_memory and sg_step) and are destroyed cleanly. Also:
 *  - after an extra parameter on one rank, the other ranks may register it too and the next
 *    sg_finalize succeeds everywhere;
 *  - a rank with no parameters gets SG_ERR_INVALID_STATE, the others SG_ERR_MISMATCH;
 *  - settings that are local to a rank (staging_buckets, timeout_ms) may differ;
 *  - the communicators are reused for every case and still work at the end.
 *
 * Ranks are threads (W = 2 and 3), or with --mpi one rank per process under mpirun. */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/sg_core.h" /* sg__err_clear */
#include "shardgrad.h"

#define SG_TEST_DEFAULT_TAG "[main]"
#include "sg_test_check.h"

#define NP 5
static const char *k_names[NP] = {"embed.weight", "embed.bias", "block.weight", "block.norm",
                                  "head.weight"};
static const size_t k_numel[NP] = {1000, 10, 300, 64, 257};
static const uint32_t k_flags[NP] = {0, SG_PARAM_NO_DECAY, 0, SG_PARAM_NO_DECAY, 0};

enum {
  K_MATCH,
  K_NAME,
  K_NUMEL,
  K_FLAGS,
  K_EXTRA_END,
  K_EXTRA_MID,
  K_MISSING,
  K_SWAP,
  K_BUCKET,
  K_LR,
  K_STRATEGY,
  K_DTYPE,
  K_WD,
  K_WINDOW,
  K_SEED,
  K_NO_PARAMS,
  K_LOCAL_ONLY,
  K_COUNT
};

typedef struct mcase {
  int kind;
  const char *label;
  int odd_sel;        /* which rank differs: 0 the last, 1 rank 0, 2 rank 1 */
  const char *needle; /* the error text of every rank contains this */
} mcase;

static const mcase k_cases[K_COUNT] = {
    {K_MATCH, "every rank agrees", 0, NULL},
    {K_NAME, "another name for parameter #2", 0, "#2"},
    {K_NUMEL, "another numel for parameter #1", 1, "#1"},
    {K_FLAGS, "other flags for parameter #3", 2, "#3"},
    {K_EXTRA_END, "one extra parameter at the end", 0, "#5"},
    {K_EXTRA_MID, "one extra parameter at position 2", 1, "#2"},
    {K_MISSING, "the last parameter missing", 2, "#4"},
    {K_SWAP, "parameters #0 and #1 swapped", 0, "#0"},
    {K_BUCKET, "another bucket_bytes", 0, "bucket_bytes"},
    {K_LR, "another lr", 2, "field lr "},
    {K_STRATEGY, "another strategy", 1, "strategy"},
    {K_DTYPE, "bf16 instead of f32 parameters", 0, "param_dtype"},
    {K_WD, "another weight_decay", 2, "weight_decay"},
    {K_WINDOW, "another scale_window", 0, "scale_window"},
    {K_SEED, "another seed", 1, "seed"},
    {K_NO_PARAMS, "no parameters on one rank", 0, NULL},
    {K_LOCAL_ONLY, "different staging_buckets and timeout_ms (rank-local)", 1, NULL},
};

static int odd_rank(const mcase *mc, int world) {
  switch (mc->odd_sel) {
    case 1: return 0;
    case 2: return world > 2 ? 1 : world - 1;
    default: return world - 1;
  }
}

static void make_config(const mcase *mc, int odd, sg_config *c) {
  sg_config_init(c, sizeof *c);
  c->bucket_bytes = 2048;
  c->timeout_ms = 10000; /* backstop only */
  if (!odd) return;
  switch (mc->kind) {
    case K_BUCKET: c->bucket_bytes = 4096; break;
    case K_LR: c->lr = 2e-3f; break;
    case K_STRATEGY: c->strategy = SG_SHARD_OPT; break;
    case K_DTYPE: c->param_dtype = c->grad_dtype = c->reduce_dtype = SG_BF16; break;
    case K_WD: c->weight_decay = 0.02f; break;
    case K_WINDOW: c->scale_window = 1000; break;
    case K_SEED: c->seed = 42; break;
    case K_LOCAL_ONLY:
      c->staging_buckets = 3;
      c->timeout_ms = 15000;
      break;
  }
}

static int add(sg_engine *e, const char *name, size_t n, uint32_t f) {
  int id = -1;
  return sg_add_param(e, name, n, f, &id) == SG_OK;
}

static int register_params(const mcase *mc, int odd, sg_engine *e) {
  int ok = 1;
  if (odd && mc->kind == K_NO_PARAMS) return 1;
  for (int i = 0; i < NP && ok; i++) {
    const char *name = k_names[i];
    size_t n = k_numel[i];
    uint32_t f = k_flags[i];
    if (odd) {
      if (mc->kind == K_NAME && i == 2) name = "block.weight2";
      if (mc->kind == K_NUMEL && i == 1) n = 11;
      if (mc->kind == K_FLAGS && i == 3) f = 0;
      if (mc->kind == K_EXTRA_MID && i == 2) ok = add(e, "inserted", 32, 0);
      if (mc->kind == K_MISSING && i == NP - 1) break;
      if (mc->kind == K_SWAP && i < 2) {
        name = k_names[1 - i];
        n = k_numel[1 - i];
        f = k_flags[1 - i];
      }
    }
    ok = ok && add(e, name, n, f);
  }
  if (odd && mc->kind == K_EXTRA_END) ok = ok && add(e, "extra.bias", 48, SG_PARAM_NO_DECAY);
  return ok;
}

/* A training step with every parameter's gradient, to show the engine works. */
static int one_step(sg_engine *e, int nparams) {
  static _Thread_local float g[1024];
  for (int i = 0; i < 1024; i++) g[i] = (float)(i % 5) / 8.0f;
  for (int id = nparams - 1; id >= 0; id--)
    if (sg_grad_add(e, id, g, SG_F32) != SG_OK) return 0;
  sg_step_info info;
  info.struct_size = sizeof info;
  return sg_step(e, &info) == SG_OK && info.step == 1 && info.skipped == 0;
}

static void run_case(const mcase *mc, sg_comm *comm) {
  const int rank = sg_comm_rank(comm), world = sg_comm_size(comm);
  const int odd = rank == odd_rank(mc, world);
  sg_config c;
  make_config(mc, odd, &c);
  sg_engine *e = NULL;
  if (!CHECK(sg_engine_create(comm, &c, &e) == SG_OK, "%s: engine created", mc->label)) return;
  if (!CHECK(register_params(mc, odd, e), "%s: parameters registered", mc->label)) {
    sg_engine_destroy(e);
    return;
  }
  sg__err_clear();
  sg_status st = sg_finalize(e);
  const char *msg = sg_last_error();
  if (mc->kind == K_MATCH || mc->kind == K_LOCAL_ONLY) {
    CHECK(st == SG_OK, "%s: sg_finalize -> SG_OK (got %s: \"%s\")", mc->label,
          sg_status_string(st), msg);
    if (st == SG_OK) CHECK(one_step(e, NP), "%s: a training step works", mc->label);
  } else if (mc->kind == K_NO_PARAMS) {
    if (odd)
      CHECK(st == SG_ERR_INVALID_STATE && strstr(msg, "sg_finalize") && strstr(msg, "no param"),
            "%s: the rank without parameters gets SG_ERR_INVALID_STATE (got %s: \"%s\")",
            mc->label, sg_status_string(st), msg);
    else
      CHECK(st == SG_ERR_MISMATCH && strstr(msg, "sg_finalize") &&
                strstr(msg, "failed to finalize"),
            "%s: the other ranks get SG_ERR_MISMATCH naming the failed rank (got %s: \"%s\")",
            mc->label, sg_status_string(st), msg);
  } else {
    CHECK(st == SG_ERR_MISMATCH && strstr(msg, "sg_finalize") && strstr(msg, mc->needle),
          "%s (rank %d differs): sg_finalize -> SG_ERR_MISMATCH naming '%s' (got %s: \"%s\")",
          mc->label, odd_rank(mc, world), mc->needle, sg_status_string(st), msg);
  }
  if (st != SG_OK) {
    sg_memory_stats ms;
    ms.struct_size = sizeof ms;
    CHECK(sg_memory(e, &ms) == SG_ERR_INVALID_STATE && sg_step(e, NULL) == SG_ERR_INVALID_STATE,
          "%s: the engine stays unfinalized (sg_memory, sg_step: SG_ERR_INVALID_STATE)",
          mc->label);
  }
  if (mc->kind == K_EXTRA_END) {
    /* the engines are still registering: the others add the parameter and agree */
    CHECK(odd || add(e, "extra.bias", 48, SG_PARAM_NO_DECAY),
          "%s: the other ranks register the extra parameter too", mc->label);
    sg__err_clear();
    st = sg_finalize(e);
    CHECK(st == SG_OK, "%s: then sg_finalize -> SG_OK on every rank (got %s: \"%s\")",
          mc->label, sg_status_string(st), sg_last_error());
    if (st == SG_OK) CHECK(one_step(e, NP + 1), "%s: and a training step works", mc->label);
  }
  sg_engine_destroy(e);
  CHECK(1, "%s: engine destroyed", mc->label);
}

static void run_all(sg_comm *comm) {
  for (int k = 0; k < K_COUNT; k++) run_case(&k_cases[k], comm);
  /* the communicator is intact after all those failures */
  run_case(&k_cases[K_MATCH], comm);
}

typedef struct rank_arg {
  sg_comm *comm;
} rank_arg;

static void *rank_main(void *p) {
  sg_comm *comm = ((rank_arg *)p)->comm;
  snprintf(sg_test_tag, sizeof sg_test_tag, "[W=%d r%d]", sg_comm_size(comm), sg_comm_rank(comm));
  sg_test_quiet = sg_comm_rank(comm) != 0;
  run_all(comm);
  return NULL;
}

static int run_threads(void) {
  for (int W = 2; W <= 3; W++) {
    printf("== W=%d, ranks as threads ==\n", W);
    sg_comm *comms[3];
    if (!CHECK(sg_comm_create_local(W, comms) == SG_OK, "local group of %d", W)) continue;
    pthread_t th[3];
    rank_arg a[3];
    for (int r = 0; r < W; r++) {
      a[r].comm = comms[r];
      pthread_create(&th[r], NULL, rank_main, &a[r]);
    }
    for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < W; r++) sg_comm_destroy(comms[r]);
  }
  return 0;
}

static int run_mpi(void) {
  sg_comm *comm = NULL;
  sg_status st = sg_comm_create_mpi(NULL, &comm);
  if (st == SG_ERR_UNSUPPORTED) {
    printf("built without MPI: nothing to run (%s)\n", sg_last_error());
    CHECK(comm == NULL, "sg_comm_create_mpi without MPI -> SG_ERR_UNSUPPORTED, *out NULL");
    return 0;
  }
  if (!CHECK(st == SG_OK, "sg_comm_create_mpi (%s)", sg_last_error())) return 1;
  const int W = sg_comm_size(comm);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[mpi W=%d r%d]", W, sg_comm_rank(comm));
  sg_test_quiet = sg_comm_rank(comm) != 0;
  if (!sg_test_quiet) printf("== W=%d, one rank per MPI process ==\n", W);
  if (W >= 2) run_all(comm);
  else CHECK(1, "W=1: no rank can disagree; nothing to check");
  sg_comm_destroy(comm);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int mpi = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--mpi") == 0) {
      mpi = 1;
    } else {
      fprintf(stderr, "usage: %s [--mpi]\n", argv[0]);
      return 2;
    }
  }
  if (mpi)
    run_mpi();
  else
    run_threads();
  return sg_test_summary("");
}
