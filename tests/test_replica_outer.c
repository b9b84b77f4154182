/* Outer steps (cfg.outer_every = H, DiLoCo) on hybrid engines of N replicas x L shard ranks,
 * ranks as threads, against a reference built from independent parts: per node a flat ZeRO-2
 * engine over that node's L ranks fed the same gradients (the inner steps: each replica trains
 * on its node's gradient, averaged over L), and the test's own outer step every H-th step (the
 * pseudo-gradient po - theta of every replica, summed in replica order in fp32 (through bf16
 * for a bf16 wire, as the all-reduce rounds it; with the int8 codec through the test's own
 * two-stage scheme, sg_test_codec_ref.h, over each bucket's slices with residuals carried from
 * one outer step to the next), divided by N, a Nesterov momentum step of po, written back into
 * every flat engine with sg_set_param). Checked, bit for bit:
 *  - after every step each rank's parameters are its node's flat engine's;
 *  - after every outer step every rank of every node holds the same parameters, and between
 *    outer steps the nodes differ (nothing is summed across them);
 *  - sg_memory agrees with sg_estimate_memory and counts the outer state (2 x shard fp32);
 *  - sg_save, new engines and sg_load, at an outer step or between (and through engines of
 *    another node count and size that load and save again): the run goes on bit for bit with
 *    the outer parameters, momentum and position in the period kept, from replica 0's inner
 *    state (its parameters and AdamW moments on every replica, as the reference does);
 *  - a checkpoint without the outer state (of an engine without outer steps): a new period
 *    from the loaded parameters with zero momentum;
 *  - streaming outer steps (cfg.outer_streaming: step k of each period begins the sum of the
 *    buckets b with b mod H = k - 1, and step k + 1 merges it before its update: the reference
 *    takes the outer step of those elements at step k and writes the new outer parameters into
 *    its flat engines before their step k + 1), also with the int8 codes, a bf16 wire, H = 1, H
 *    above the number of buckets and a save/load in the middle of a period (sg_save merges the
 *    sum in flight first; so does the reference): bit for bit, also at the merge itself (read
 *    after sg_grad_norm, which merges, before sg_step), where every rank holds the same bits in
 *    the merged group;
 *  - bad settings fail at create with a clear message.
 * Usage: test_replica_outer --local */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/sg_elem.h"       /* bf16 rounding of the reference's wire */
#include "engine/sg_engine_internal.h" /* e->plan: the slices the codec's blocks follow */
#include "shardgrad.h"

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"
#include "sg_test_codec_ref.h" /* ref_reduce: the codec's scheme */
#include "sg_test_state.h"     /* sg_test_mix */

static const size_t k_sizes[] = {700, 4097, 65};
#define NP ((int)(sizeof k_sizes / sizeof k_sizes[0]))
#define TOTAL (700 + 4097 + 65)
#define MAXW 8
#define MAXS 8

typedef struct {
  const char *name;
  int n, l, h, steps;
  sg_dtype wire;
  double lr, mu;
  int reload; /* > 0: sg_save of the hybrid engines before this step, new engines, sg_load */
  int via_l;  /* > 0: between those, engines of N L / via_l replicas x via_l ranks load and save */
  int fresh;  /* 1: the new engines load node 0's flat checkpoint instead (no outer state) */
  sg_codec codec; /* SG_CODEC_INT8: the pseudo-gradient through the int8 codec */
  int stream;     /* 1: streaming outer steps (cfg.outer_streaming): step k of a period syncs
                     the buckets b with b mod H = k - 1 */
} tcase;

typedef struct {
  float param[MAXS][TOTAL]; /* the hybrid engine's after each step */
  float ref[MAXS][TOTAL];   /* the reference's */
  float merged[MAXS][TOTAL];     /* streaming: the hybrid engine's after sg_grad_norm, before
                                    the step (the last step's group merged) */
  float ref_merged[MAXS][TOTAL]; /* the reference's before its step */
  sg_memory_stats mem;
  int ok;
  char err[400];
} result;

/* What the threads share: each node's reference parameters at an outer step. */
typedef struct {
  const tcase *tc;
  char dir[64];
  pthread_barrier_t bar;
  float node[MAXW][TOTAL];
} shared;

typedef struct {
  shared *sh;
  sg_comm *world;
  int rank;
  result *res;
  float po[TOTAL], m[TOTAL]; /* the reference's outer state (every rank computes it whole) */
  /* with a codec: the hybrid engine's plan (the slices), flat index -> index into TOTAL (-1:
   * padding), and every replica's residuals by flat index (r2: from each slice's start) */
  const sg__plan *plan;
  int *fmap;
  float *r1[MAXW], *r2[MAXW];
  int group[TOTAL]; /* streaming: the group of each element's bucket (bucket mod H) */
  int pend;         /* streaming: the group whose new outer parameters the reference's next
                       step takes first (-1: none) */
} run_arg;

static float grad_val(int rank, int step, int p, size_t i) {
  const uint64_t h = sg_test_mix(((uint64_t)rank << 56) ^ ((uint64_t)step << 48) ^
                                 ((uint64_t)p << 32) ^ i);
  return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0) * 0.1f;
}

static float init_val(int p, size_t i) { return (float)sin(0.3 * (double)i + p) * 0.5f; }

static void fill_config(const tcase *tc, sg_config *cfg, int outer) {
  sg_config_init(cfg, sizeof *cfg);
  cfg->bucket_bytes = tc->stream ? 2048 : 8192; /* streaming: a bucket per parameter */
  cfg->lr = 0.01f;
  cfg->timeout_ms = 60000;
  cfg->max_grad_norm = 1.0f; /* each replica clips by its own node's norm */
  cfg->replica_reduce_dtype = tc->wire;
  if (!outer) return;
  cfg->outer_every = tc->h;
  cfg->replica_codec = tc->codec;
  cfg->outer_lr = tc->lr;
  cfg->outer_momentum = tc->mu;
  cfg->outer_streaming = tc->stream;
}

static sg_status setup(sg_engine *e, int *ids) {
  sg_status st = SG_OK;
  for (int p = 0; p < NP && !st; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, k_sizes[p], p == 2 ? SG_PARAM_NO_DECAY : 0, &ids[p]);
  }
  if (!st) st = sg_finalize(e);
  float buf[4097];
  for (int p = 0; p < NP && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = init_val(p, i);
    st = sg_set_param(e, ids[p], buf, SG_F32);
  }
  return st;
}

static sg_status feed(sg_engine *e, const int *ids, int rank, int s) {
  sg_status st = SG_OK;
  for (int p = NP - 1; p >= 0 && !st; p--) {
    float *g = NULL;
    st = sg_grad_ptr(e, ids[p], (void **)&g);
    for (size_t i = 0; !st && i < k_sizes[p]; i++) g[i] = grad_val(rank, s, p, i);
    if (!st) st = sg_grad_ready(e, ids[p]);
  }
  return st ? st : sg_backward_end(e);
}

static sg_status feed_and_step(sg_engine *e, const int *ids, int rank, int s) {
  const sg_status st = feed(e, ids, rank, s);
  return st ? st : sg_step(e, NULL);
}

static sg_status read_all(sg_engine *e, const int *ids, float *out) {
  sg_status st = SG_OK;
  for (int p = 0, off = 0; p < NP && !st; off += (int)k_sizes[p], p++)
    st = sg_get_param(e, ids[p], out + off, SG_F32);
  return st;
}

static sg_status write_all(sg_engine *e, const int *ids, const float *in) {
  sg_status st = SG_OK;
  for (int p = 0, off = 0; p < NP && !st; off += (int)k_sizes[p], p++)
    st = sg_set_param(e, ids[p], in + off, SG_F32);
  return st;
}

static float wire_round(const tcase *tc, float x) {
  return tc->wire == SG_BF16 ? sg_elem_bf16_to_f32(sg_elem_f32_to_bf16(x)) : x;
}

/* The codec's sum of every node's pseudo-gradient, slice by slice of every shard rank j and
 * bucket b (padding: 0), into sum (TOTAL). */
static void ref_coded_sum(run_arg *a, int g, float *sum) {
  const tcase *tc = a->sh->tc;
  const sg__plan *p = a->plan;
  float *in[MAXW], *r1[MAXW], *r2[MAXW];
  float *out = malloc(p->max_bucket_numel * sizeof(float));
  for (int k = 0; k < tc->n; k++) in[k] = malloc(p->max_bucket_numel * sizeof(float));
  for (int j = 0; j < p->world; j++)
    for (int b = 0; b < p->nbuckets; b++) {
      if (g >= 0 && b % tc->h != g) continue; /* streaming: the step's group only */
      const size_t n = sg__plan_slice_numel(p, b), f0 = sg__plan_slice_start(p, b, j);
      for (int k = 0; k < tc->n; k++) {
        for (size_t t = 0; t < n; t++) {
          const int i = a->fmap[f0 + t];
          in[k][t] = i < 0 ? 0.0f : a->po[i] - a->sh->node[k][i];
        }
        r1[k] = a->r1[k] + f0;
        r2[k] = a->r2[k] + f0;
      }
      ref_reduce(in, r1, r2, tc->n, n, 127.0f, out);
      for (size_t t = 0; t < n; t++)
        if (a->fmap[f0 + t] >= 0) sum[a->fmap[f0 + t]] = out[t];
    }
  for (int k = 0; k < tc->n; k++) free(in[k]);
  free(out);
}

/* The reference's outer step over every node's parameters (g >= 0: over the elements of group
 * g's buckets only); theta, unless NULL, receives the result. */
static void ref_outer(run_arg *a, int g, float *theta) {
  const tcase *tc = a->sh->tc;
  const float lr = (float)tc->lr, mu = (float)tc->mu;
  static _Thread_local float coded[TOTAL];
  if (tc->codec) ref_coded_sum(a, g, coded);
  for (size_t i = 0; i < TOTAL; i++) {
    if (g >= 0 && a->group[i] != g) continue;
    float sum = wire_round(tc, a->po[i] - a->sh->node[0][i]);
    for (int k = 1; k < tc->n; k++) sum += wire_round(tc, a->po[i] - a->sh->node[k][i]);
    if (tc->codec) sum = coded[i];
    const float d = wire_round(tc, sum) / (float)tc->n;
    a->m[i] = mu * a->m[i] + d;
    a->po[i] = a->po[i] - lr * (d + mu * a->m[i]);
    if (theta) theta[i] = a->po[i];
  }
}

/* Step s ends an outer period: H steps after the last outer step, the first one H steps
 * after the start, or after a load of a checkpoint without the outer state. */
static int outer_at(const tcase *tc, int s) {
  const int p0 = tc->fresh && s >= tc->reload ? tc->reload : 0;
  return (s + 1 - p0) % tc->h == 0;
}

/* Streaming: the group step s syncs (its position in the period). */
static int group_at(const tcase *tc, int s) {
  const int p0 = tc->fresh && s >= tc->reload ? tc->reload : 0;
  return (s - p0) % tc->h;
}

/* Streaming: the flat engine's parameters of the pending group become the outer parameters
 * (the merge the hybrid engine takes before its next update, or at sg_save). */
static sg_status ref_merge(run_arg *a, sg_engine *flat, const int *ids) {
  static _Thread_local float theta[TOTAL];
  if (a->pend < 0) return SG_OK;
  sg_status st = read_all(flat, ids, theta);
  for (size_t i = 0; i < TOTAL; i++)
    if (a->group[i] == a->pend) theta[i] = a->po[i];
  a->pend = -1;
  return st ? st : write_all(flat, ids, theta);
}

static sg_status reference_step(run_arg *a, sg_engine *flat, const int *ids, int s) {
  const tcase *tc = a->sh->tc;
  const int node = a->rank / tc->l;
  float *ref = a->res->ref[s];
  sg_status st = tc->stream ? ref_merge(a, flat, ids) : SG_OK;
  if (!st && tc->stream) st = read_all(flat, ids, a->res->ref_merged[s]);
  if (!st) st = feed_and_step(flat, ids, a->rank, s);
  if (!st) st = read_all(flat, ids, ref);
  if (st) return st; /* the others then wait at the barrier: ctest's timeout ends the run */
  if (!tc->stream && !outer_at(tc, s)) return SG_OK;
  if (a->rank % tc->l == 0) memcpy(a->sh->node[node], ref, sizeof(float) * TOTAL);
  pthread_barrier_wait(&a->sh->bar);
  ref_outer(a, tc->stream ? group_at(tc, s) : -1, tc->stream ? NULL : ref);
  pthread_barrier_wait(&a->sh->bar); /* nobody publishes the next one before all read this */
  if (!tc->stream) return write_all(flat, ids, ref);
  a->pend = group_at(tc, s); /* merged before the next step */
  return SG_OK;
}

/* Streaming: the hybrid engine's step, its parameters read between sg_grad_norm (which merges
 * the last step's group) and sg_step. */
static sg_status stream_step(sg_engine *e, const int *ids, int rank, int s, float *merged) {
  float norm = 0;
  sg_status st = feed(e, ids, rank, s);
  if (!st) st = sg_grad_norm(e, &norm);
  if (!st) st = read_all(e, ids, merged);
  return st ? st : sg_step(e, NULL);
}

static sg_status make_hybrid(run_arg *a, int l, sg_comm **shard, sg_comm **rep, sg_engine **e,
                             int *ids) {
  sg_config cfg;
  fill_config(a->sh->tc, &cfg, 1);
  sg_status st = sg_comm_split(a->world, a->rank / l, a->rank, shard);
  if (!st) st = sg_comm_split(a->world, a->rank % l, a->rank, rep);
  if (!st) st = sg_engine_create_hybrid(*shard, *rep, &cfg, e);
  return st ? st : setup(*e, ids);
}

static void drop_hybrid(sg_engine **e, sg_comm **shard, sg_comm **rep) {
  sg_engine_destroy(*e);
  sg_comm_destroy(*shard);
  sg_comm_destroy(*rep);
  *e = NULL, *shard = NULL, *rep = NULL;
}

/* The hybrid engines save, and new ones load (tc->via_l: through engines of another layout
 * that load and save again): the checkpoint is replica 0's (its ranks write), so every replica
 * goes on with replica 0's parameters and AdamW moments, and with the outer state and position
 * saved. The reference does the same: node 0's flat engines save, every node's load that; its
 * outer state goes on (tc->fresh: the new engines load that flat checkpoint, and the
 * reference's outer period begins again there, from the loaded parameters, momentum 0). */
static sg_status reload(run_arg *a, sg_engine **e, sg_comm **shard, sg_comm **rep, int *ids,
                        sg_engine *flat, const int *fids) {
  const tcase *tc = a->sh->tc;
  char fdir[80];
  snprintf(fdir, sizeof fdir, "%s/flat", a->sh->dir);
  sg_status st = sg_save(*e, a->sh->dir);
  if (!st) st = ref_merge(a, flat, fids); /* sg_save merged the hybrid engine's */
  if (!st && a->rank < tc->l) st = sg_save(flat, fdir);
  pthread_barrier_wait(&a->sh->bar);
  drop_hybrid(e, shard, rep);
  if (!st && tc->via_l) {
    st = make_hybrid(a, tc->via_l, shard, rep, e, ids);
    if (!st) st = sg_load(*e, a->sh->dir);
    if (!st) st = sg_save(*e, a->sh->dir);
    drop_hybrid(e, shard, rep);
  }
  if (!st) st = make_hybrid(a, tc->l, shard, rep, e, ids);
  if (!st) st = sg_load(*e, tc->fresh ? fdir : a->sh->dir);
  if (!st) st = sg_load(flat, fdir);
  if (!st && tc->fresh) {
    memset(a->m, 0, sizeof a->m);
    st = read_all(flat, fids, a->po);
  }
  return st;
}

/* The reference codec's view of the hybrid engine's plan, and its residuals (zero). */
static int ref_codec_init(run_arg *a, const sg__plan *p) {
  a->plan = p;
  a->fmap = malloc(p->total_numel * sizeof *a->fmap);
  if (!a->fmap) return 0;
  for (size_t f = 0; f < p->total_numel; f++) a->fmap[f] = -1;
  for (int id = 0, off = 0; id < NP; off += (int)k_sizes[id], id++)
    for (size_t i = 0; i < k_sizes[id]; i++) {
      a->fmap[p->params[id].offset + i] = off + (int)i;
      a->group[off + i] = p->params[id].bucket % a->sh->tc->h;
    }
  for (int k = 0; k < a->sh->tc->n; k++) {
    a->r1[k] = calloc(p->total_numel, sizeof(float));
    a->r2[k] = calloc(p->total_numel, sizeof(float));
    if (!a->r1[k] || !a->r2[k]) return 0;
  }
  return 1;
}

static void ref_codec_free(run_arg *a) {
  free(a->fmap);
  for (int k = 0; k < MAXW; k++) free(a->r1[k]), free(a->r2[k]);
  memset(a->r1, 0, sizeof a->r1);
  memset(a->r2, 0, sizeof a->r2);
  a->fmap = NULL;
}

static void *run_thread(void *arg) {
  run_arg *a = arg;
  const tcase *tc = a->sh->tc;
  sg_comm *shard = NULL, *rep = NULL, *node = NULL;
  sg_engine *e = NULL, *flat = NULL;
  int ids[NP], fids[NP];
  sg_config fcfg;
  fill_config(tc, &fcfg, 0);
  sg_status st = make_hybrid(a, tc->l, &shard, &rep, &e, ids);
  if (!st && !ref_codec_init(a, e->plan)) st = SG_ERR_OUT_OF_MEMORY;
  if (!st) st = sg_comm_split(a->world, a->rank / tc->l, a->rank, &node);
  if (!st) st = sg_engine_create(node, &fcfg, &flat);
  if (!st) st = setup(flat, fids);
  for (size_t i = 0, p = 0, off = 0; i < TOTAL; i++) {
    if (i - off == k_sizes[p]) off += k_sizes[p++];
    a->po[i] = init_val((int)p, i - off);
    a->m[i] = 0;
  }
  a->pend = -1;
  a->res->mem.struct_size = sizeof a->res->mem;
  if (!st) st = sg_memory(e, &a->res->mem);
  for (int s = 0; s < tc->steps && !st; s++) {
    if (tc->reload && s == tc->reload) st = reload(a, &e, &shard, &rep, ids, flat, fids);
    if (!st) a->plan = e->plan; /* a new engine's after a reload: the same slices */
    if (!st)
      st = tc->stream ? stream_step(e, ids, a->rank, s, a->res->merged[s])
                      : feed_and_step(e, ids, a->rank, s);
    if (!st) st = read_all(e, ids, a->res->param[s]);
    if (!st) st = reference_step(a, flat, fids, s);
  }
  ref_codec_free(a);
  a->res->ok = st == SG_OK;
  if (st) snprintf(a->res->err, sizeof a->res->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  sg_engine_destroy(flat);
  sg_comm_destroy(shard);
  sg_comm_destroy(rep);
  sg_comm_destroy(node);
  return NULL;
}

static void check_memory(const tcase *tc, const result *res) {
  sg_config cfg;
  fill_config(tc, &cfg, 1);
  cfg.shard_ranks = tc->l;
  sg_memory_stats with = {.struct_size = sizeof with}, without = {.struct_size = sizeof without};
  sg_status s1 = sg_estimate_memory(&cfg, k_sizes, NP, tc->n * tc->l, &with);
  cfg.outer_every = 0;
  cfg.outer_streaming = 0;
  cfg.replica_codec = SG_CODEC_NONE;
  sg_status s2 = sg_estimate_memory(&cfg, k_sizes, NP, tc->n * tc->l, &without);
  CHECK(s1 == SG_OK && s2 == SG_OK && with.comm_bytes == res->mem.comm_bytes &&
            with.total_bytes == res->mem.total_bytes,
        "[%s] sg_memory agrees with sg_estimate_memory (%zu comm bytes)", tc->name,
        with.comm_bytes);
  const size_t outer = with.comm_bytes - without.comm_bytes;
  const size_t codec = tc->codec ? 4 * with.shard_numel : 0; /* at least the first residuals */
  /* r2 and the exchange buffers; streaming: a bf16 wire and its own comm scratch */
  const size_t slack = ((tc->codec ? 4 : 0) + (tc->stream ? 4 : 0)) * with.shard_numel;
  CHECK(outer >= 8 * with.shard_numel + codec &&
            outer <= 8 * with.shard_numel + 4 * with.shard_numel + codec + slack + 4096,
        "[%s] the outer state is counted: %zu comm bytes for a shard of %zu", tc->name, outer,
        with.shard_numel);
}

/* Streaming: at the merge before step s (s >= 1) every rank holds the same bits in the elements
 * of step s - 1's group, and every rank's parameters there are the reference's (a group without
 * buckets, H > nbuckets, merges nothing). */
static void check_merged(const tcase *tc, const result *res, const int *group, int w, int s) {
  for (int r = 0; r < w; r++)
    CHECK(!memcmp(res[r].merged[s], res[r].ref_merged[s], sizeof res[r].merged[s]),
          "[%s] rank %d: the parameters at the merge before step %d are the reference's",
          tc->name, r, s);
  if (s == 0) return;
  const int g = group_at(tc, s - 1);
  int n = 0, same = 1;
  for (size_t i = 0; i < TOTAL; i++) {
    if (group[i] != g) continue;
    n++;
    for (int r = 1; r < w; r++) same &= res[r].merged[s][i] == res[0].merged[s][i];
  }
  CHECK(same, "[%s] before step %d: every rank holds the same %d elements of group %d", tc->name,
        s, n, g);
}

static void run_case(const tcase *tc) {
  const int w = tc->n * tc->l;
  sg_comm *comms[MAXW];
  if (!CHECK(sg_comm_create_local(w, comms) == SG_OK, "local comm of %d", w)) return;
  static shared sh;
  static result res[MAXW];
  static run_arg a[MAXW];
  memset(res, 0, sizeof res);
  sh.tc = tc;
  snprintf(sh.dir, sizeof sh.dir, "/tmp/sg_outer_ckpt_XXXXXX");
  if (tc->reload && !CHECK(mkdtemp(sh.dir) != NULL, "temp dir")) return;
  pthread_barrier_init(&sh.bar, NULL, (unsigned)w);
  pthread_t th[MAXW];
  for (int r = 0; r < w; r++) {
    a[r].sh = &sh, a[r].world = comms[r], a[r].rank = r, a[r].res = &res[r];
    pthread_create(&th[r], NULL, run_thread, &a[r]);
  }
  int ok = 1;
  for (int r = 0; r < w; r++) {
    pthread_join(th[r], NULL);
    ok &= CHECK(res[r].ok, "[%s] rank %d ran: %s", tc->name, r, res[r].err);
  }
  pthread_barrier_destroy(&sh.bar);
  for (int r = 0; r < w && ok; r++)
    for (int s = 0; s < tc->steps; s++)
      CHECK(!memcmp(res[r].param[s], res[r].ref[s], sizeof res[r].ref[s]),
            "[%s] rank %d step %d: the parameters are the reference's%s", tc->name, r, s,
            outer_at(tc, s) ? " (an outer step)" : "");
  for (int s = 0; s < tc->steps && ok; s++) {
    int same = 1;
    for (int r = 1; r < w; r++) same &= !memcmp(res[r].param[s], res[0].param[s], sizeof res[0].param[s]);
    if (tc->stream) { /* after the step each node's update is on top of the merge */
      check_merged(tc, res, a[0].group, w, s);
      CHECK(!same, "[%s] step %d: the ranks hold their node's own parameters", tc->name, s);
      continue;
    }
    CHECK(same == outer_at(tc, s), "[%s] step %d: the ranks hold %s parameters", tc->name, s,
          outer_at(tc, s) ? "the same" : "their node's own");
  }
  if (ok) check_memory(tc, &res[0]);
  for (int r = 0; r < w; r++) sg_comm_destroy(comms[r]);
  if (tc->reload) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", sh.dir);
    CHECK(system(cmd) == 0, "removed %s", sh.dir);
  }
  printf("case %s: done\n", tc->name);
}

static void check_errors(void) {
  sg_comm *one[2];
  sg_engine *e = NULL;
  if (!CHECK(sg_comm_create_local(1, one) == SG_OK, "comm")) return;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  CHECK(cfg.outer_every == 0 && cfg.outer_lr == 0.7 && cfg.outer_momentum == 0.9,
        "defaults: off, DiLoCo's outer lr 0.7 and momentum 0.9");
  cfg.outer_every = 4;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_every") && strstr(sg_last_error(), "hybrid"),
        "outer steps on a flat engine are refused: %s", sg_last_error());
  cfg.outer_every = -1;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_every must be >= 1"),
        "H < 0 is refused: %s", sg_last_error());
  cfg.outer_every = 4;
  cfg.outer_lr = 0;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_lr"), "outer_lr 0 is refused: %s", sg_last_error());
  cfg.outer_lr = 0.7;
  cfg.outer_momentum = 1.0;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_momentum"), "momentum 1 is refused: %s",
        sg_last_error());
  cfg.outer_momentum = 0.9;
  cfg.replica_codec = SG_CODEC_INT4;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_UNSUPPORTED &&
            strstr(sg_last_error(), "SG_CODEC_INT8"), "outer steps with the 4-bit codec: %s",
        sg_last_error());
  cfg.replica_codec = SG_CODEC_NONE;
  CHECK(cfg.outer_streaming == 0, "streaming is off by default");
  cfg.outer_streaming = 2;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_streaming must be 0 or 1"),
        "outer_streaming 2 is refused: %s", sg_last_error());
  cfg.outer_streaming = 1;
  cfg.outer_every = 0;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "outer_streaming needs outer steps"),
        "streaming without outer_every is refused: %s", sg_last_error());
  cfg.outer_every = 4;
  CHECK(sg_engine_create(one[0], &cfg, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "hybrid"),
        "streaming outer steps on a flat engine are refused: %s", sg_last_error());
  cfg.outer_streaming = 0;
  if (CHECK(sg_comm_create_local(1, &one[1]) == SG_OK, "comm")) {
    CHECK(sg_engine_create_hybrid(one[0], one[1], &cfg, &e) == SG_ERR_INVALID_ARGUMENT && !e &&
              strstr(sg_last_error(), "one replica"),
          "outer steps with one replica are refused: %s", sg_last_error());
    sg_engine_destroy(e); /* NULL unless the check failed */
    e = NULL;
    sg_comm_destroy(one[1]);
  }
  sg_comm_destroy(one[0]);
}

/* Two replicas of one rank each whose outer lr (or streaming) differ: both refused at
 * sg_finalize. */
typedef struct {
  sg_comm *shard, *replica;
  double lr;
  int stream;
  sg_status st;
  char msg[512];
} lr_arg;

static void *lr_thread(void *arg) {
  lr_arg *a = arg;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.outer_every = 2;
  cfg.outer_lr = a->lr;
  cfg.outer_streaming = a->stream;
  sg_engine *e = NULL;
  int id = 0;
  a->st = sg_engine_create_hybrid(a->shard, a->replica, &cfg, &e);
  if (a->st == SG_OK) a->st = sg_add_param(e, "w", 300, 0, &id);
  if (a->st == SG_OK) a->st = sg_finalize(e);
  snprintf(a->msg, sizeof a->msg, "%s", a->st ? sg_last_error() : "finalized (not refused)");
  sg_engine_destroy(e);
  return NULL;
}

static void check_outer_agreement(double lr1, int stream1, const char *field) {
  sg_comm *rep[2] = {NULL, NULL}, *sh[2] = {NULL, NULL};
  if (!CHECK(sg_comm_create_local(2, rep) == SG_OK && sg_comm_create_local(1, &sh[0]) == SG_OK &&
                 sg_comm_create_local(1, &sh[1]) == SG_OK,
             "comms"))
    return;
  lr_arg a[2] = {{sh[0], rep[0], 0.7, 0, SG_OK, ""}, {sh[1], rep[1], lr1, stream1, SG_OK, ""}};
  pthread_t t[2];
  for (int r = 0; r < 2; r++) pthread_create(&t[r], NULL, lr_thread, &a[r]);
  for (int r = 0; r < 2; r++) pthread_join(t[r], NULL);
  for (int r = 0; r < 2; r++)
    CHECK(a[r].st == SG_ERR_MISMATCH && strstr(a[r].msg, field),
          "replica %d: outer lr 0.7 against %g, streaming 0 against %d refused at finalize: %s",
          r, lr1, stream1, a[r].msg);
  for (int r = 0; r < 2; r++) {
    sg_comm_destroy(rep[r]);
    sg_comm_destroy(sh[r]);
  }
}

static const tcase k_cases[] = {
    {"2x2 H=3", 2, 2, 3, 7, SG_F32, 0.7, 0.9, 0, 0, 0, SG_CODEC_NONE, 0},
    {"3x1 H=2 bf16 wire", 3, 1, 2, 5, SG_BF16, 0.7, 0.9, 0, 0, 0, SG_CODEC_NONE, 0},
    {"3x2 H=1 lr 1 no momentum", 3, 2, 1, 3, SG_F32, 1.0, 0.0, 0, 0, 0, SG_CODEC_NONE, 0},
    {"2x2 H=2 save+load at step 4", 2, 2, 2, 7, SG_F32, 0.7, 0.9, 4, 0, 0, SG_CODEC_NONE, 0},
    {"2x2 H=3 save at step 4, load+save at 4x1, load", 2, 2, 3, 8, SG_F32, 0.7, 0.9, 4, 1, 0,
     SG_CODEC_NONE, 0},
    {"2x2 H=3 load at step 4 without outer state", 2, 2, 3, 8, SG_F32, 0.7, 0.9, 4, 0, 1,
     SG_CODEC_NONE, 0},
    {"2x2 H=2 int8", 2, 2, 2, 7, SG_F32, 0.7, 0.9, 0, 0, 0, SG_CODEC_INT8, 0},
    {"3x2 H=1 int8 lr 1 no momentum", 3, 2, 1, 4, SG_F32, 1.0, 0.0, 0, 0, 0, SG_CODEC_INT8, 0},
    {"2x2 H=2 int8 save at step 3, load+save at 4x1, load", 2, 2, 2, 8, SG_F32, 0.7, 0.9, 3, 1,
     0, SG_CODEC_INT8, 0},
    {"2x2 H=2 streaming", 2, 2, 2, 6, SG_F32, 0.7, 0.9, 0, 0, 0, SG_CODEC_NONE, 1},
    {"3x2 H=3 streaming", 3, 2, 3, 7, SG_F32, 0.7, 0.9, 0, 0, 0, SG_CODEC_NONE, 1},
    {"3x2 H=2 streaming bf16 wire", 3, 2, 2, 5, SG_BF16, 0.7, 0.9, 0, 0, 0, SG_CODEC_NONE, 1},
    {"2x2 H=3 streaming int8", 2, 2, 3, 7, SG_F32, 0.7, 0.9, 0, 0, 0, SG_CODEC_INT8, 1},
    {"3x2 H=1 streaming lr 1 no momentum", 3, 2, 1, 4, SG_F32, 1.0, 0.0, 0, 0, 0, SG_CODEC_NONE,
     1},
    {"2x2 H=5 streaming (more groups than buckets)", 2, 2, 5, 7, SG_F32, 0.7, 0.5, 0, 0, 0,
     SG_CODEC_NONE, 1},
    {"2x2 H=3 streaming save at step 4, load+save at 4x1, load", 2, 2, 3, 8, SG_F32, 0.7, 0.9, 4,
     1, 0, SG_CODEC_NONE, 1},
    {"3x2 H=2 streaming int8 save at step 3, load", 3, 2, 2, 6, SG_F32, 0.7, 0.9, 3, 0, 0,
     SG_CODEC_INT8, 1},
};

int main(void) {
  check_errors();
  check_outer_agreement(0.5, 0, "outer_lr");
  check_outer_agreement(0.7, 1, "outer_streaming");
  for (size_t k = 0; k < sizeof k_cases / sizeof k_cases[0]; k++) run_case(&k_cases[k]);
  return sg_test_summary("test_replica_outer");
}
