/* sg_estimate_step (docs/planner.md): the model's collectives are what the engine really issues,
 * and its times add up.
 *
 * 1. Bytes and collectives per step: engines on threads (flat over W, hybrid N x L through
 *    sg_comm_split, every strategy, dtypes, bucket sizes, micro-batch counts, the replica
 *    codecs and outer steps) run a step, and
 *    the difference of sg_comm_stats across it equals the estimate's shard_* and replica_*
 *    fields, for every rank.
 * 2. Times: the parts sum to the step; a single-bucket flat step computed by hand from the
 *    alpha-beta formulas; slower links never make a step faster; hybrid puts fewer bytes on
 *    the node link than flat.
 * 3. Arguments: every bad input is refused with a message. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_test_check.h"
#include "sg_test_ranks.h"

#define NP 7
static const size_t k_sizes[NP] = {300, 17, 4096, 1000, 64, 2500, 129};

typedef struct layout_case {
  int strategy, world, shard_ranks; /* shard_ranks 0: flat */
  sg_dtype param, reduce, replica;
  size_t bucket_bytes;
  int micro, overlap;
  int codec, outer; /* cfg.replica_codec, cfg.outer_every (the measured step is the period's
                       last: it syncs) */
  int stream;       /* cfg.outer_streaming: the measured step syncs group H - 1 (its sum runs
                       into the next step: measured from the sg_grad_norm that merges the last
                       step's sum to the next one's) */
} layout_case;

static void config_of(const layout_case *k, sg_config *cfg) {
  sg_config_init(cfg, sizeof *cfg);
  cfg->strategy = (sg_strategy)k->strategy;
  cfg->param_dtype = k->param;
  cfg->grad_dtype = k->param;
  cfg->reduce_dtype = k->reduce;
  cfg->replica_reduce_dtype = k->replica;
  cfg->bucket_bytes = k->bucket_bytes;
  cfg->overlap_param_gather = k->overlap;
  cfg->shard_ranks = k->shard_ranks;
  cfg->replica_codec = (sg_codec)k->codec;
  cfg->outer_every = k->outer;
  cfg->outer_streaming = k->stream;
}

typedef struct traffic {
  sg_comm_traffic shard, replica;
} traffic;

static void read_traffic(sg_comm *shard, sg_comm *replica, traffic *t) {
  t->shard.struct_size = t->replica.struct_size = sizeof(sg_comm_traffic);
  sg_comm_stats(shard, &t->shard);
  memset(&t->replica.bytes_sent, 0, sizeof t->replica - sizeof t->replica.struct_size);
  if (replica) sg_comm_stats(replica, &t->replica);
}

/* The communicators of this rank's layout (hybrid: splits of the world; flat: the world). */
static sg_status split_layout(const layout_case *k, sg_comm *world, sg_comm **shard,
                              sg_comm **replica) {
  *shard = *replica = NULL;
  if (!k->shard_ranks) return SG_OK;
  const int r = sg_comm_rank(world), L = k->shard_ranks;
  sg_status st = sg_comm_split(world, r / L, r, shard);
  if (st == SG_OK) st = sg_comm_split(world, r % L, r, replica);
  return st;
}

/* A step's k->micro micro-batches, every gradient added through sg_grad_add (streaming: then
 * sg_grad_norm, which merges the sum the last step began). */
static sg_status run_grads(const layout_case *k, sg_engine *e) {
  float *g = calloc(4096, sizeof *g);
  sg_status st = g ? SG_OK : SG_ERR_OUT_OF_MEMORY;
  for (size_t i = 0; g && i < 4096; i++) g[i] = (float)(i % 5) - 2;
  if (!st && k->shard_ranks) st = sg_set_microbatches(e, k->micro);
  for (int m = 0; m < k->micro && !st; m++) {
    for (int p = NP - 1; p >= 0 && !st; p--) st = sg_grad_add(e, p, g, SG_F32);
    if (!st) st = sg_backward_end(e);
  }
  float norm = 0;
  if (!st && k->stream) st = sg_grad_norm(e, &norm);
  free(g);
  return st;
}

static sg_status run_step(const layout_case *k, sg_engine *e) {
  sg_status st = run_grads(k, e);
  if (!st) st = sg_step(e, NULL);
  if (!st && k->overlap) st = sg_param_wait(e, -1);
  return st;
}

static sg_status make_engine(const layout_case *k, sg_comm *world, sg_comm *shard,
                             sg_comm *replica, sg_engine **e) {
  sg_config cfg;
  config_of(k, &cfg);
  cfg.shard_ranks = 0; /* engines take the layout from their communicators */
  sg_status st = replica ? sg_engine_create_hybrid(shard, replica, &cfg, e)
                         : sg_engine_create(world, &cfg, e);
  for (int p = 0; p < NP && !st; p++) {
    char name[16];
    int id = 0;
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(*e, name, k_sizes[p], 0, &id);
  }
  if (!st) st = sg_finalize(*e);
  return st;
}

static void check_counts(const layout_case *k, const traffic *a, const traffic *b, int rank) {
  sg_config cfg;
  config_of(k, &cfg);
  sg_hardware hw;
  sg_hardware_init(&hw, sizeof hw);
  hw.ranks_per_node = k->shard_ranks ? k->shard_ranks : 1;
  sg_step_estimate est = {.struct_size = sizeof est};
  if (!CHECK(sg_estimate_step(&cfg, k_sizes, NP, k->world, k->micro, &hw, &est) == SG_OK,
             "rank %d: estimate", rank))
    return;
  CHECK(b->shard.bytes_sent - a->shard.bytes_sent == est.shard_bytes &&
            b->shard.bytes_received - a->shard.bytes_received == est.shard_bytes,
        "rank %d: shard bytes %llu == estimate %llu", rank,
        (unsigned long long)(b->shard.bytes_sent - a->shard.bytes_sent),
        (unsigned long long)est.shard_bytes);
  CHECK(b->shard.collectives - a->shard.collectives == est.shard_collectives,
        "rank %d: shard collectives %llu == estimate %llu", rank,
        (unsigned long long)(b->shard.collectives - a->shard.collectives),
        (unsigned long long)est.shard_collectives);
  CHECK(b->replica.bytes_sent - a->replica.bytes_sent == est.replica_bytes &&
            b->replica.collectives - a->replica.collectives == est.replica_collectives,
        "rank %d: replica bytes %llu / %llu collectives == estimate %llu / %llu", rank,
        (unsigned long long)(b->replica.bytes_sent - a->replica.bytes_sent),
        (unsigned long long)(b->replica.collectives - a->replica.collectives),
        (unsigned long long)est.replica_bytes, (unsigned long long)est.replica_collectives);
}

/* Per rank: the layout's engine, warm-up steps (one, or H - 1 for H > 2: the measured step ends
 * the outer period), then a step between two readings. */
static void traffic_rank(sg_comm *world, void *arg) {
  const layout_case *k = arg;
  const int rank = sg_comm_rank(world);
  sg_test_quiet = rank != 0;
  sg_comm *shard = NULL, *replica = NULL;
  sg_engine *e = NULL;
  sg_status st = split_layout(k, world, &shard, &replica);
  if (!st) st = make_engine(k, world, shard, replica, &e);
  for (int w = 0; w < (k->outer > 2 ? k->outer - 1 : 1) && !st; w++) st = run_step(k, e);
  traffic a, b;
  if (!st && k->stream) st = run_grads(k, e); /* the step's gradients, the last sum merged */
  if (!st) read_traffic(replica ? shard : world, replica, &a);
  if (!st) st = k->stream ? sg_step(e, NULL) : run_step(k, e);
  if (!st && k->stream) st = run_grads(k, e); /* the next step's: its sum merged */
  if (CHECK(st == SG_OK, "rank %d: engine steps", rank)) {
    read_traffic(replica ? shard : world, replica, &b);
    check_counts(k, &a, &b, rank);
  }
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
}

static void run_case(const layout_case *k) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "s%d W%d L%d p%d r%d x%d b%zu m%d o%d c%d H%d S%d",
           k->strategy, k->world, k->shard_ranks, k->param, k->reduce, k->replica,
           k->bucket_bytes, k->micro, k->overlap, k->codec, k->outer, k->stream);
  CHECK(sg_test_run_threads(k->world, traffic_rank, (void *)k) == SG_OK, "threads");
}

static void test_traffic(void) {
  const size_t buckets[] = {256, 4096, 20000, 1 << 20};
  const int worlds[] = {1, 2, 3, 4};
  const int strategies[] = {SG_NO_SHARD, SG_SHARD_OPT, SG_SHARD_GRAD_OP};
  for (int s = 0; s < 3; s++)
    for (int w = 0; w < 4; w++)
      for (int b = 0; b < 4; b++) {
        const layout_case k = {strategies[s], worlds[w], 0, b % 2 ? SG_BF16 : SG_F32,
                               b == 2 ? SG_F32 : SG_DTYPE_AUTO, SG_F32, buckets[b],
                               1 + (b + w) % 3, b == 1, 0, 0, 0};
        run_case(&k);
      }
  /* hybrid: N x L with both wire dtypes */
  const int NL[][2] = {{2, 2}, {2, 3}, {3, 2}, {4, 1}, {1, 4}};
  for (int i = 0; i < 5; i++)
    for (int b = 0; b < 3; b++) {
      const layout_case k = {b == 2 ? SG_SHARD_OPT : SG_SHARD_GRAD_OP, NL[i][0] * NL[i][1],
                             NL[i][1], b == 1 ? SG_BF16 : SG_F32, SG_DTYPE_AUTO,
                             b == 0 ? SG_F32 : SG_BF16, buckets[b], 1 + (i + b) % 3, i == 2,
                             0, 0, 0};
      run_case(&k);
    }
  /* the slow-links modes: codecs (int8, int4), outer steps and outer steps with int8 codes
   * (the measured step is the second: with H = 1 or 2 it is the one that syncs); engines
   * refuse them with one replica */
  for (int i = 0; i < 5; i++)
    for (int v = 0; v < 5 && NL[i][0] > 1; v++) {
      const int codec = v == 0 || v == 4 ? SG_CODEC_INT8 : v == 1 ? SG_CODEC_INT4 : SG_CODEC_NONE;
      const layout_case k = {v == 3 ? SG_SHARD_OPT : SG_SHARD_GRAD_OP, NL[i][0] * NL[i][1],
                             NL[i][1], v == 2 ? SG_BF16 : SG_F32, SG_DTYPE_AUTO,
                             v == 3 ? SG_BF16 : SG_F32, buckets[v % 3], 1 + (i + v) % 3,
                             v == 2, codec, v < 2 ? 0 : v == 4 ? 2 : v - 1, 0};
      run_case(&k);
    }
  /* streaming outer steps: the period's last step syncs group H - 1 (f32 wire, H = 2, many
   * buckets; int8 codes, H = 3; bf16 wire, H = 3 over one bucket: that step sends nothing) */
  for (int i = 0; i < 5; i++)
    for (int v = 0; v < 3 && NL[i][0] > 1; v++) {
      const layout_case k = {SG_SHARD_GRAD_OP, NL[i][0] * NL[i][1], NL[i][1], SG_F32,
                             SG_DTYPE_AUTO, v == 2 ? SG_BF16 : SG_F32,
                             v == 0 ? buckets[0] : v == 1 ? buckets[1] : buckets[3],
                             1 + (i + v) % 3, 0, v == 1 ? SG_CODEC_INT8 : SG_CODEC_NONE,
                             v == 0 ? 2 : 3, 1};
      run_case(&k);
    }
}

/* ---------------------------------------------------------------------------------------- */

static double parts_sum(const sg_step_estimate *e) {
  return e->compute_s + e->exposed_s[0] + e->exposed_s[1] + e->optim_s + e->copy_s +
         e->handover_s;
}

static sg_hardware some_hw(double net_bps, double compute) {
  sg_hardware hw;
  sg_hardware_init(&hw, sizeof hw);
  hw.ranks_per_node = 2;
  hw.link_bytes_per_s[SG_LEVEL_NODE] = 2e9;
  hw.link_bytes_per_s[SG_LEVEL_NET] = net_bps;
  hw.link_latency_s[SG_LEVEL_NET] = 100e-6;
  hw.link_latency_s[SG_LEVEL_NODE] = 5e-6;
  hw.compute_s = compute;
  hw.optim_params_per_s = 2e8;
  return hw;
}

/* The parts add up to the step, whatever the layout and rates. */
static void test_parts(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "parts");
  int bad = 0, n = 0;
  for (int shard = 0; shard <= 2; shard += 2)
    for (int micro = 1; micro <= 8; micro *= 8)
      for (int r = 0; r < 4; r++) {
        sg_config cfg;
        sg_config_init(&cfg, sizeof cfg);
        cfg.shard_ranks = shard;
        cfg.bucket_bytes = 4096u << r;
        cfg.overlap_param_gather = r % 2;
        sg_hardware hw = some_hw(1.25e6 * pow(10, r), 0.002 * r);
        hw.overlap[SG_LEVEL_NODE] = 0.25 * r;
        hw.overlap[SG_LEVEL_NET] = 1 - 0.25 * r;
        hw.handover_s_per_byte = 1e-10 * r;
        sg_step_estimate e = {.struct_size = sizeof e};
        if (sg_estimate_step(&cfg, k_sizes, NP, 4, micro, &hw, &e) != SG_OK) bad++;
        if (fabs(parts_sum(&e) - e.step_s) > 1e-9 * e.step_s) bad++;
        n++;
      }
  CHECK(bad == 0, "compute + exposed + optim + copy == step in %d layouts (%d off)", n, bad);
}

/* One bucket (one parameter), flat over 2 nodes x 1 rank, 1 micro-batch, by hand: forward and
 * backward, then the reduce-scatter (nothing to hide it behind: the bucket is ready at the end
 * of backward), the norm's all-reduce of 24 bytes (two passes; the third double is the absent
 * flag, DESIGN.md section 4), the update of the shard, the
 * all-gather. Every pass sends half the buffer. */
static void test_by_hand(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "by hand");
  const size_t n[1] = {1 << 16}; /* a multiple of 64 x 2: no padding */
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  sg_hardware hw = some_hw(1e8, 0.01);
  hw.ranks_per_node = 1;
  sg_step_estimate e = {.struct_size = sizeof e};
  if (!CHECK(sg_estimate_step(&cfg, n, 1, 2, 1, &hw, &e) == SG_OK, "estimate")) return;
  const double a = hw.link_latency_s[SG_LEVEL_NET], B = hw.link_bytes_per_s[SG_LEVEL_NET];
  const double S = 4.0 * n[0];
  const double rs = a + S / 2 / B, norm = 2 * (a + 12 / B), ag = a + S / 2 / B;
  const double upd = n[0] / 2.0 / hw.optim_params_per_s;
  const double want = hw.compute_s + rs + norm + upd + ag;
  CHECK(fabs(e.step_s - want) < 1e-12, "step %.9f s == %.9f s", e.step_s, want);
  CHECK(fabs(e.exposed_s[SG_LEVEL_NET] - (rs + norm + ag)) < 1e-12 && e.exposed_s[0] == 0,
        "all of it exposed on the net: %.9f", e.exposed_s[SG_LEVEL_NET]);
  CHECK(e.link_bytes[SG_LEVEL_NET] == (uint64_t)(S / 2) * 2 + 24, "link bytes %llu",
        (unsigned long long)e.link_bytes[SG_LEVEL_NET]);
  /* with a long backward the same reduce-scatter cannot hide: one bucket is the last one */
  hw.compute_s = 10;
  CHECK(sg_estimate_step(&cfg, n, 1, 2, 1, &hw, &e) == SG_OK &&
            fabs(e.exposed_s[SG_LEVEL_NET] - (rs + norm + ag)) < 1e-9,
        "one bucket: its reduction stays exposed behind a long backward");
}

/* Many buckets and a long backward: everything but the last bucket's reduction hides, and
 * overlap_param_gather hides the gathers behind the forward pass. */
static void test_overlap(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "overlap");
  size_t n[16];
  for (int i = 0; i < 16; i++) n[i] = 1 << 16;
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.bucket_bytes = 4u << 16; /* one parameter per bucket */
  sg_hardware hw = some_hw(1e8, 1.0);
  hw.ranks_per_node = 1;
  sg_step_estimate e = {.struct_size = sizeof e}, o = {.struct_size = sizeof o};
  sg_estimate_step(&cfg, n, 16, 2, 1, &hw, &e);
  const double a = hw.link_latency_s[SG_LEVEL_NET], B = hw.link_bytes_per_s[SG_LEVEL_NET];
  const double rs = a + 4.0 * n[0] / 2 / B, norm = 2 * (a + 12 / B);
  const double gathers = 16 * rs; /* an all-gather moves what a reduce-scatter does */
  const double upd = n[0] / 2.0 / hw.optim_params_per_s;
  /* the gathers queue behind the updates; the last one ends one gather after the last update */
  const double want = rs + norm + (gathers + upd > 16 * upd ? gathers + upd - 16 * upd : 0);
  CHECK(fabs(e.exposed_s[SG_LEVEL_NET] - want) < 1e-9, "exposed %.6f == %.6f",
        e.exposed_s[SG_LEVEL_NET], want);
  cfg.overlap_param_gather = 1;
  sg_estimate_step(&cfg, n, 16, 2, 1, &hw, &o);
  CHECK(fabs(o.exposed_s[SG_LEVEL_NET] - (rs + norm)) < 1e-9,
        "overlap_param_gather: the gathers (%.3f s) hide behind a 1/3 s forward",
        gathers);
}

/* overlap 0: every second of communication costs a second of the step, hidden or not (one
 * node: every collective is at the node level, where comm_s is the comm queue's busy time). */
static void test_contention(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "contention");
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.bucket_bytes = 8192;
  sg_hardware hw = some_hw(1e8, 0.5);
  hw.ranks_per_node = 4;
  hw.link_bytes_per_s[SG_LEVEL_NODE] = 1e7;
  sg_step_estimate a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 4, &hw, &a) == SG_OK, "overlap 1");
  hw.overlap[SG_LEVEL_NODE] = 0;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 4, &hw, &b) == SG_OK, "overlap 0");
  const double want = b.compute_s + b.optim_s + b.comm_s[SG_LEVEL_NODE];
  CHECK(a.exposed_s[SG_LEVEL_NODE] < a.comm_s[SG_LEVEL_NODE] && fabs(b.step_s - want) < 1e-9,
        "overlap 0: step %.6f == compute + optim + all comm %.6f (overlap 1: %.6f)", b.step_s,
        want, a.step_s);
  hw.overlap[SG_LEVEL_NET] = 1.5;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 4, &hw, &b) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "overlap"), "overlap 1.5 refused");
}

/* What a collective takes from the cores (overlap < 1) slows the compute beside it, and so the
 * step only where the compute is on the critical path: two buckets, flat over 2 nodes, the
 * first bucket's reduce-scatter beside the second bucket's backward (1/3 of compute_s). A fast
 * link: the reduction ends within that backward, which runs (1 - overlap) x the reduction's
 * time longer, and so does the step. A slow link: the step waits for the reduction anyway, and
 * the slower backward costs nothing. */
static void test_contention_path(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "contention path");
  const size_t n[2] = {1 << 16, 1 << 16};
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.bucket_bytes = 4u << 16; /* one parameter per bucket */
  for (int slow = 0; slow <= 1; slow++) {
    sg_hardware hw = some_hw(slow ? 1e5 : 1e9, 0.3);
    hw.ranks_per_node = 1;
    hw.optim_params_per_s = 1e15; /* the updates take no time: nothing else runs beside */
    sg_step_estimate a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
    sg_estimate_step(&cfg, n, 2, 2, 1, &hw, &a);
    hw.overlap[SG_LEVEL_NET] = 0.5;
    sg_estimate_step(&cfg, n, 2, 2, 1, &hw, &b);
    const double rs = hw.link_latency_s[SG_LEVEL_NET] + 4.0 * n[0] / 2 / hw.link_bytes_per_s[1];
    const double want = slow ? 0 : 0.5 * rs;
    CHECK(fabs(b.step_s - a.step_s - want) < 1e-9 && fabs(parts_sum(&b) - b.step_s) < 1e-9,
          "%s link: overlap 0.5 adds %.6f s to the step (want %.6f)", slow ? "slow" : "fast",
          b.step_s - a.step_s, want);
  }
}

/* Slower links never make a step faster; hybrid sends less over the node link than flat. */
static void test_monotone(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "monotone");
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.bucket_bytes = 8192;
  int bad = 0;
  double prev = 0;
  for (int r = 6; r >= 0; r--) {
    sg_hardware hw = some_hw(1e4 * pow(10, r), 0.01);
    sg_step_estimate e = {.struct_size = sizeof e};
    sg_estimate_step(&cfg, k_sizes, NP, 4, 8, &hw, &e);
    if (e.step_s < prev) bad++;
    prev = e.step_s;
  }
  CHECK(bad == 0, "step time grows as the link slows");
  sg_hardware hw = some_hw(1e7, 0.01);
  sg_step_estimate flat = {.struct_size = sizeof flat}, hyb = {.struct_size = sizeof hyb};
  sg_estimate_step(&cfg, k_sizes, NP, 4, 8, &hw, &flat);
  cfg.shard_ranks = 2;
  sg_estimate_step(&cfg, k_sizes, NP, 4, 8, &hw, &hyb);
  CHECK(hyb.link_bytes[SG_LEVEL_NET] * 4 < flat.link_bytes[SG_LEVEL_NET] &&
            hyb.step_s < flat.step_s,
        "8 micro-batches: hybrid %llu node-link bytes, %.4f s < flat %llu, %.4f s",
        (unsigned long long)hyb.link_bytes[SG_LEVEL_NET], hyb.step_s,
        (unsigned long long)flat.link_bytes[SG_LEVEL_NET], flat.step_s);
}

/* replica_bytes_per_s: a hybrid step's sums across nodes behind the reductions run at it (0:
 * the link's rate); nothing else moves, and a flat step does not see it. One bucket of n f32
 * over 2 nodes x 2 ranks: each rank's slice is n/2 elements, its all-reduce puts 2 x n/2 x 4
 * bytes of each of the node's 2 ranks on the node's link, all of it exposed (the last bucket). */
static void test_replica_rate(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "replica rate");
  const size_t n[1] = {1 << 16};
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.shard_ranks = 2;
  sg_hardware hw = some_hw(1e7, 0.01);
  sg_step_estimate e0 = {.struct_size = sizeof e0}, e1 = e0, e2 = e0;
  sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e0);
  hw.replica_bytes_per_s = hw.link_bytes_per_s[SG_LEVEL_NET];
  sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e1);
  hw.replica_bytes_per_s = hw.link_bytes_per_s[SG_LEVEL_NET] / 2;
  if (!CHECK(sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e2) == SG_OK, "estimate")) return;
  const double extra = 4.0 * n[0] / hw.link_bytes_per_s[SG_LEVEL_NET];
  CHECK(e0.step_s == e1.step_s, "0 is the link's rate: %.9f == %.9f s", e0.step_s, e1.step_s);
  CHECK(fabs(e2.comm_s[SG_LEVEL_NET] - e0.comm_s[SG_LEVEL_NET] - extra) < 1e-12 &&
            fabs(e2.step_s - e0.step_s - extra) < 1e-12,
        "half the rate: the sum's %.0f node-link bytes take %.6f s more (comm %+.6f, step %+.6f)",
        4.0 * n[0], extra, e2.comm_s[SG_LEVEL_NET] - e0.comm_s[SG_LEVEL_NET],
        e2.step_s - e0.step_s);
  CHECK(e2.link_bytes[SG_LEVEL_NET] == e0.link_bytes[SG_LEVEL_NET] &&
            e2.exposed_s[SG_LEVEL_NODE] == e0.exposed_s[SG_LEVEL_NODE],
        "the bytes and the in-node part do not move");
  cfg.shard_ranks = 0;
  sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e2);
  hw.replica_bytes_per_s = 0;
  sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e1);
  CHECK(e1.step_s == e2.step_s, "a flat step does not see it");
  hw.replica_bytes_per_s = -1;
  CHECK(sg_estimate_step(&cfg, n, 1, 4, 1, &hw, &e1) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "replica_bytes_per_s"),
        "a negative rate is refused: %s", sg_last_error());
}

/* ---------------------------------------------------------------------------------------- */

static void test_arguments(void) {
  snprintf(sg_test_tag, sizeof sg_test_tag, "arguments");
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  sg_hardware hw;
  CHECK(sg_hardware_init(NULL, sizeof hw) == SG_ERR_INVALID_ARGUMENT, "hw NULL");
  CHECK(sg_hardware_init(&hw, 8) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "struct_size"), "struct_size");
  CHECK(sg_hardware_init(&hw, sizeof hw) == SG_OK, "init");
  sg_step_estimate e = {.struct_size = sizeof e};
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_OK, "the defaults work");
  /* right-sized but never initialised: zeroed, or a valid-looking copy of another's fields */
  sg_hardware raw;
  memset(&raw, 0, sizeof raw);
  raw.struct_size = sizeof raw;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &raw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "call sg_hardware_init"),
        "an sg_hardware never initialised (memset 0) is refused: %s", sg_last_error());
  memset(&raw, 0xa5, sizeof raw);
  raw.struct_size = sizeof raw;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &raw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "call sg_hardware_init"),
        "an sg_hardware never initialised (garbage) is refused: %s", sg_last_error());
  struct {
    const char *what, *msg;
    sg_hardware h;
  } bad[8];
  for (int i = 0; i < 8; i++) bad[i].h = hw;
  bad[0].what = "net rate 0", bad[0].msg = "link_bytes_per_s", bad[0].h.link_bytes_per_s[1] = 0;
  bad[1].what = "NaN latency", bad[1].msg = "link_latency_s", bad[1].h.link_latency_s[0] = NAN;
  bad[2].what = "negative compute", bad[2].msg = "compute_s", bad[2].h.compute_s = -1;
  bad[3].what = "backward 0", bad[3].msg = "backward_fraction", bad[3].h.backward_fraction = 0;
  bad[4].what = "algorithm", bad[4].msg = "algorithm", bad[4].h.algorithm = 7;
  bad[5].what = "ranks per node", bad[5].msg = "ranks_per_node", bad[5].h.ranks_per_node = 3;
  bad[6].what = "no device rate", bad[6].msg = "device_bytes_per_s",
  bad[6].h.device_bytes_per_s = 0;
  bad[7].what = "struct_size", bad[7].msg = "struct_size", bad[7].h.struct_size = 4;
  for (int i = 0; i < 8; i++)
    CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &bad[i].h, &e) == SG_ERR_INVALID_ARGUMENT &&
              strstr(sg_last_error(), bad[i].msg),
          "%s refused: %s", bad[i].what, sg_last_error());
  CHECK(sg_estimate_step(NULL, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "cfg");
  CHECK(sg_estimate_step(&cfg, NULL, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "numels");
  CHECK(sg_estimate_step(&cfg, k_sizes, 0, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "nparams");
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 0, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "world");
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 0, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "micro");
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, NULL, &e) == SG_ERR_INVALID_ARGUMENT, "hw");
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, NULL) == SG_ERR_INVALID_ARGUMENT, "out");
  const size_t zero[2] = {5, 0};
  CHECK(sg_estimate_step(&cfg, zero, 2, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT, "numel 0");
  cfg.shard_ranks = 3;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "shard_ranks"), "shard_ranks 3 of 4");
  cfg.shard_ranks = 2;
  cfg.strategy = SG_NO_SHARD;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT,
        "hybrid NO_SHARD");
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.shard_ranks = 4;
  cfg.replica_codec = SG_CODEC_INT8;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "2 replicas"), "a codec over one replica");
  cfg.replica_codec = SG_CODEC_NONE;
  cfg.outer_every = 2;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "2 replicas"), "outer steps over one replica");
  cfg.shard_ranks = 2;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_OK, "outer steps, 2 x 2");
  cfg.outer_every = 0;
  sg_config_init(&cfg, sizeof cfg);
  cfg.device = SG_DEVICE_CUDA;
  cfg.offload_optimizer = 1;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_ERR_INVALID_ARGUMENT &&
            strstr(sg_last_error(), "pcie_bytes_per_s"), "offload without host rates");
  hw.host_optim_params_per_s = 1e8;
  hw.pcie_bytes_per_s = 1e10;
  CHECK(sg_estimate_step(&cfg, k_sizes, NP, 4, 1, &hw, &e) == SG_OK && e.copy_bytes > 0,
        "offload: %llu bytes copied", (unsigned long long)e.copy_bytes);
}

int main(void) {
  test_arguments();
  test_by_hand();
  test_overlap();
  test_parts();
  test_monotone();
  test_contention();
  test_contention_path();
  test_replica_rate();
  test_traffic();
  return sg_test_summary("");
}
