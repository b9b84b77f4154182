/* sg_bench_cluster: time per optimizer step and bytes on the node links for training the example
 * MLP with gradient accumulation across nodes, one rank per process under MPI. Driven by
 * bench/cluster.sh on the simulated cluster (scripts/cluster.sh), which runs it once per
 * configuration and prints the table; it runs under any mpirun too.
 *
 *   --mode flat      the engine over all W ranks (sg_engine_create on MPI_COMM_WORLD)
 *   --mode hybrid    sharded inside a node, replicated across nodes: sg_comm_split_nodes
 *                    (--ranks-per-node K, or 0: the ranks sharing a host) and
 *                    sg_engine_create_hybrid, told the micro-batches per step
 *                    (sg_set_microbatches), so each bucket's all-reduce across nodes starts in
 *                    the last backward pass; --wire f32|bf16: replica_reduce_dtype;
 *                    --codec none|int8|int4: replica_codec; --outer H: outer_every (outer
 *                    steps every H steps: time the steps in multiples of H, and read
 *                    step_mean_ms, the mean, which counts the outer steps' share); --stream 1:
 *                    outer_streaming (a group of buckets synced every step)
 *   --mode compute   the model alone, no library and no communication: each rank's forward
 *                    and backward passes, its gradients written into a buffer of its own (as
 *                    they are into the engine's), no optimizer: the least a step can take on
 *                    these cores, whatever the link
 *   --sync every     every micro-batch's gradients are reduce-scattered (the engine's default)
 *   --sync last      sg_set_sync(0) before all but the last micro-batch (no_sync: local fp32
 *                    accumulation, one reduction per optimizer step)
 *
 * Per optimizer step: M micro-batches (forward, backward, gradient hand-off) and sg_step. Steps
 * start together (barrier); the time of a step is the slowest rank's; reported is the median over
 * the timed steps (step_max_ms: the longest; rank 0 also prints a STEPS line, every timed step in
 * order, so that one long step shows where it fell). Link bytes: the first rank of every node reads its node's interface counters
 * (/sys/class/net/IFACE/statistics, eth0 inside a cluster.sh node) before the first and after
 * the last timed step; "sent" is the sum over nodes of bytes each node put on its link (TCP/IP
 * headers included), "max node" the most one node sent, both divided by the timed steps. Prints one RESULT line (key=value) on rank 0.
 *
 *   --profile        also one PROFILE line: per timed step, mean over ranks / largest, where
 *                    the caller's thread spent the step (forward + backward with the gradient
 *                    hand-off, sg_backward_end, sg_step), spans from the engine's trace
 *                    (on its communication thread: reductions inside the engine's
 *                    communicator, all-reduces across replicas, all-gathers; the norm + AdamW
 *                    span) and the CPU time of the process (all threads) and its caller. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlp_cli.h" /* mlp_cli_now_s, integer flags */
#include "mlp_model.h"
#include "shardgrad.h"

typedef struct options {
  const char *mode, *iface;
  int sync_last, micro, steps, warmup, batch, hidden, layers, ranks_per_node, profile;
  sg_dtype dtype, wire;
  sg_codec codec;
  int outer, stream;
  double bucket_mb;
} options;

static int rank, world;

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* ---- link counters ---------------------------------------------------------------------- */

/* Bytes sent and received so far on this node's interface; -1 when unreadable. */
static long long read_counter(const char *iface, const char *which) {
  char path[256];
  snprintf(path, sizeof path, "/sys/class/net/%s/statistics/%s", iface, which);
  FILE *f = fopen(path, "r");
  long long v = -1;
  if (!f) return -1;
  if (fscanf(f, "%lld", &v) != 1) v = -1;
  fclose(f);
  return v;
}

/* This node's bytes since `start` (its first rank reads; others report 0): the sum and the
 * largest over nodes. A node that cannot read its counters makes both -1. */
typedef struct link_bytes {
  long long tx, rx;
} link_bytes;

static link_bytes read_link(MPI_Comm node, const char *iface) {
  int nrank = 0;
  MPI_Comm_rank(node, &nrank);
  link_bytes b = {0, 0};
  if (nrank == 0) b = (link_bytes){read_counter(iface, "tx_bytes"), read_counter(iface, "rx_bytes")};
  return b;
}

static void link_totals(const link_bytes *start, const link_bytes *end, double *sent_sum,
                        double *sent_max) {
  const int bad = start->tx < 0 || end->tx < 0;
  long long mine[2] = {bad ? -1 : end->tx - start->tx, bad ? 1 : 0}, sum[2], max[2];
  MPI_Allreduce(mine, sum, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(mine, max, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  *sent_sum = sum[1] ? -1.0 : (double)sum[0];
  *sent_max = sum[1] ? -1.0 : (double)max[0];
}

/* ---- the engine per mode ------------------------------------------------------------------ */

static void fill_config(const options *o, sg_config *cfg) {
  cfg->strategy = SG_SHARD_GRAD_OP;
  cfg->param_dtype = cfg->grad_dtype = cfg->reduce_dtype = o->dtype;
  cfg->bucket_bytes = (size_t)(o->bucket_mb * 1024.0 * 1024.0);
  cfg->replica_reduce_dtype = o->wire;
  cfg->replica_codec = o->codec;
  cfg->outer_every = o->outer;
  cfg->outer_streaming = o->stream;
  cfg->lr = 1e-4f; /* 1e-3 makes the 30M-parameter MLP's loss rise in the first steps */
  cfg->timeout_ms = 600000;
}

/* The one place that differs between modes: which communicators the engine spans (hybrid:
 * *shard and *replica, the caller's to destroy after the engine). */
static sg_status create_engine(const options *o, sg_comm *world_comm, const sg_config *cfg,
                               sg_comm **shard, sg_comm **replica, sg_engine **e) {
  if (!strcmp(o->mode, "flat")) return sg_engine_create(world_comm, cfg, e);
  sg_status st = sg_comm_split_nodes(world_comm, o->ranks_per_node, shard, replica);
  if (st == SG_OK) st = sg_engine_create_hybrid(*shard, *replica, cfg, e);
  return st;
}

/* ---- the profile (--profile) ------------------------------------------------------------- */

/* Seconds per timed step on this rank: where the caller's thread spent the step, spans from the
 * engine's trace, and the CPU time of all its threads and of the caller's. */
enum {
  P_MICRO,   /* forward + backward + gradient hand-off (may wait for a staging bucket) */
  P_END,     /* sg_backward_end */
  P_STEP,    /* sg_step: the wait for the reductions, the norm, AdamW, the all-gather */
  P_RS,      /* trace: the buckets' reductions inside the engine's communicator */
  P_AR,      /* trace: the all-reduces across replicas (hybrid) */
  P_OPT,     /* trace: norm + AdamW on the shard */
  P_GATHER,  /* trace: the all-gathers */
  P_CPU,     /* CPU time of the process (every thread) */
  P_CPU_MAIN, /* of the caller's thread: the rest is the engine's communication thread's */
  P_COUNT
};
static const char *const phase_names[P_COUNT] = {"fwd_bwd", "backward_end", "sg_step",
                                                 "reduce_scatter", "replica_allreduce",
                                                 "adamw", "all_gather", "cpu", "cpu_main"};

static double cpu_s(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Adds the spans of the trace recorded since sg_trace_start to ph (seconds). */
static sg_status trace_phases(sg_engine *e, double *ph) {
  size_t n = 0;
  uint64_t dropped = 0;
  sg_status st = sg_trace_events(e, NULL, 0, &n, &dropped);
  sg_trace_event *ev = st == SG_OK ? calloc(n ? n : 1, sizeof *ev) : NULL;
  if (st == SG_OK && !ev) st = SG_ERR_OUT_OF_MEMORY;
  if (st == SG_OK) st = sg_trace_events(e, ev, n, &n, &dropped);
  for (size_t i = 0; st == SG_OK && i < n; i++) {
    const double len = 1e-6 * (ev[i].end_us - ev[i].start_us);
    if (ev[i].kind == SG_TRACE_REDUCE)
      ph[strstr(ev[i].label, "replica") ? P_AR : P_RS] += len;
    else if (ev[i].kind == SG_TRACE_STEP)
      ph[P_OPT] += len;
    else if (ev[i].kind == SG_TRACE_GATHER)
      ph[P_GATHER] += len;
  }
  if (st == SG_OK && dropped)
    fprintf(stderr, "sg_bench_cluster: rank %d: %llu trace events dropped\n", rank,
            (unsigned long long)dropped);
  free(ev);
  return st;
}

/* ---- the timed loop ----------------------------------------------------------------------- */

/* --mode compute: the parameters and a gradient buffer of the rank's own. */
typedef struct compute {
  float *params[2 * MLP_MAX_LAYERS];
  mlp_grads g;
} compute;

static int compute_init(compute *c, const mlp_model *m) {
  memset(c, 0, sizeof *c);
  for (int p = 0; p < 2 * m->layers; p++) {
    c->params[p] = malloc(m->numel[p] * sizeof(float));
    if (!c->params[p]) return -1;
    mlp_init_param(m, p, c->params[p]);
  }
  return mlp_grads_init(&c->g, m);
}

static void compute_free(compute *c) {
  for (int p = 0; p < 2 * MLP_MAX_LAYERS; p++) free(c->params[p]);
  mlp_grads_free(&c->g);
}

static void compute_step(const options *o, mlp_model *m, compute *c, int step, float *loss,
                         double *ph) {
  float sum = 0.0f;
  for (int mb = 0; mb < o->micro; mb++) {
    const uint64_t slot = ((uint64_t)step * (uint64_t)o->micro + (uint64_t)mb) * (uint64_t)world;
    mlp_make_batch(m, (slot + (uint64_t)rank) * (uint64_t)o->batch);
    const double t = mlp_cli_now_s();
    sum += mlp_forward(m, c->params);
    mlp_backward(m, c->params, 1.0f / (float)o->micro, mlp_grads_slot, mlp_grads_sink, &c->g);
    ph[P_MICRO] += mlp_cli_now_s() - t;
  }
  *loss = sum / (float)o->micro;
}

static sg_status one_step(const options *o, mlp_engine *me, int step, float *loss, double *ph) {
  float scale = 1.0f, sum = 0.0f;
  sg_status st = sg_get_loss_scale(me->e, &scale);
  for (int mb = 0; mb < o->micro && st == SG_OK; mb++) {
    if (o->sync_last && o->micro > 1) st = sg_set_sync(me->e, mb == o->micro - 1);
    const uint64_t slot = ((uint64_t)step * (uint64_t)o->micro + (uint64_t)mb) * (uint64_t)world;
    mlp_make_batch(me->m, (slot + (uint64_t)rank) * (uint64_t)o->batch);
    float l = 0.0f;
    double t = mlp_cli_now_s();
    if (st == SG_OK) st = mlp_engine_micro_batch(me, scale / (float)o->micro, &l);
    ph[P_MICRO] += mlp_cli_now_s() - t;
    t = mlp_cli_now_s();
    if (st == SG_OK) st = sg_backward_end(me->e);
    ph[P_END] += mlp_cli_now_s() - t;
    sum += l;
  }
  const double t = mlp_cli_now_s();
  if (st == SG_OK) st = sg_step(me->e, NULL);
  ph[P_STEP] += mlp_cli_now_s() - t;
  *loss = sum / (float)o->micro;
  return st;
}

/* Rank 0 prints each phase per step: the mean over ranks and the largest. */
static void print_profile(const options *o, const double *ph) {
  double sum[P_COUNT], max[P_COUNT];
  MPI_Allreduce(ph, sum, P_COUNT, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(ph, max, P_COUNT, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank != 0) return;
  printf("PROFILE mode=%s sync=%s micro=%d", o->mode, o->sync_last ? "last" : "every", o->micro);
  for (int k = 0; k < P_COUNT; k++)
    printf(" %s_ms=%.1f/%.1f", phase_names[k], 1e3 * sum[k] / world / o->steps,
           1e3 * max[k] / o->steps);
  printf("\n");
}

typedef struct result {
  double step_ms, step_mean_ms, step_max_ms; /* per timed step */
  double sent_per_step, sent_max_node;       /* bytes per timed step */
  float first_loss, last_loss;
  size_t params;
  int nodes;
} result;

static sg_status run(const options *o, sg_comm *comm, MPI_Comm node, result *r) {
  mlp_model m;
  mlp_engine me;
  memset(&me, 0, sizeof me);
  sg_engine *e = NULL;
  sg_comm *shard = NULL, *replica = NULL;
  double *times = calloc((size_t)o->steps, sizeof *times);
  if (!times || mlp_init(&m, o->layers, o->hidden, o->batch, 1) != 0) {
    free(times);
    return SG_ERR_OUT_OF_MEMORY;
  }
  r->params = m.total_numel;
  const int alone = !strcmp(o->mode, "compute");
  compute cs;
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (alone) {
    if (compute_init(&cs, &m) != 0) st = SG_ERR_OUT_OF_MEMORY;
  } else {
    if (st == SG_OK) fill_config(o, &cfg);
    if (st == SG_OK) st = create_engine(o, comm, &cfg, &shard, &replica, &e);
    if (st == SG_OK) st = mlp_engine_register(&me, &m, e, &cfg);
    if (st == SG_OK) st = sg_finalize(e);
    if (st == SG_OK && shard) st = sg_set_microbatches(e, o->micro);
    if (st == SG_OK) st = mlp_engine_init_params(&me);
  }
  link_bytes start = {0, 0};
  double ph[P_COUNT] = {0}, scratch[P_COUNT] = {0}, cpu0 = 0.0, main0 = 0.0;
  for (int s = 0; s < o->warmup + o->steps && st == SG_OK; s++) {
    if (s == o->warmup) {
      start = read_link(node, o->iface);
      if (o->profile && e) st = sg_trace_start(e, 0);
      cpu0 = cpu_s(CLOCK_PROCESS_CPUTIME_ID);
      main0 = cpu_s(CLOCK_THREAD_CPUTIME_ID);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = mlp_cli_now_s();
    float loss = 0.0f;
    if (alone)
      compute_step(o, &m, &cs, s, &loss, s >= o->warmup ? ph : scratch);
    else if (st == SG_OK)
      st = one_step(o, &me, s, &loss, s >= o->warmup ? ph : scratch);
    double dt = mlp_cli_now_s() - t0, slowest = 0.0;
    MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (s >= o->warmup) times[s - o->warmup] = slowest;
    if (s == 0) r->first_loss = loss;
    r->last_loss = loss;
  }
  ph[P_CPU] = cpu_s(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
  ph[P_CPU_MAIN] = cpu_s(CLOCK_THREAD_CPUTIME_ID) - main0;
  if (st == SG_OK && o->profile && e) st = trace_phases(e, ph);
  if (st == SG_OK && o->profile) print_profile(o, ph);
  if (st == SG_OK) {
    const link_bytes end = read_link(node, o->iface);
    double sum = 0.0, max = 0.0;
    link_totals(&start, &end, &sum, &max);
    r->sent_per_step = sum < 0 ? -1.0 : sum / o->steps;
    r->sent_max_node = max < 0 ? -1.0 : max / o->steps;
    double total = 0;
    for (int k = 0; k < o->steps; k++) total += times[k];
    r->step_mean_ms = 1e3 * total / o->steps;
    if (rank == 0) { /* each step in order: a long one stands out, and where it fell */
      printf("STEPS ms=");
      for (int k = 0; k < o->steps; k++) printf("%s%.0f", k ? "," : "", 1e3 * times[k]);
      printf("\n");
    }
    qsort(times, (size_t)o->steps, sizeof *times, cmp_double);
    r->step_max_ms = 1e3 * times[o->steps - 1];
    r->step_ms = 1e3 * (o->steps % 2 ? times[o->steps / 2]
                                     : 0.5 * (times[o->steps / 2 - 1] + times[o->steps / 2]));
  } else {
    fprintf(stderr, "sg_bench_cluster: rank %d: %s: %s\n", rank, sg_status_string(st),
            sg_last_error());
  }
  if (alone) compute_free(&cs);
  mlp_engine_free(&me);
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  mlp_free(&m);
  free(times);
  return st;
}

/* ---- main --------------------------------------------------------------------------------- */

static int usage(void) {
  fprintf(stderr,
          "usage: sg_bench_cluster [--mode flat|hybrid|compute] [--sync every|last] [--micro N] "
          "[--steps N] [--warmup N] [--batch N] [--hidden N] [--layers N] [--dtype f32|bf16] "
          "[--bucket-mb X] [--iface NAME] [--wire f32|bf16] [--codec none|int8|int4] [--outer H] [--stream 0|1] "
          "[--ranks-per-node K] "
          "[--profile]   "
          "(under mpirun)\n");
  return -1;
}

/* The flags with other than integer values: 1 for a bad value or an unknown flag, else 0. */
static int other_flag(options *o, const char *a, const char *v) {
  if (!strcmp(a, "--mode")) {
    o->mode = v;
    return strcmp(v, "flat") && strcmp(v, "hybrid") && strcmp(v, "compute");
  }
  if (!strcmp(a, "--sync")) {
    o->sync_last = !strcmp(v, "last");
    return !o->sync_last && strcmp(v, "every");
  }
  if (!strcmp(a, "--iface")) {
    o->iface = v;
    return 0;
  }
  if (!strcmp(a, "--bucket-mb")) return (o->bucket_mb = atof(v)) <= 0.0;
  if (!strcmp(a, "--codec")) {
    o->codec = !strcmp(v, "int8") ? SG_CODEC_INT8 : !strcmp(v, "int4") ? SG_CODEC_INT4 : SG_CODEC_NONE;
    return strcmp(v, "int8") && strcmp(v, "int4") && strcmp(v, "none");
  }
  sg_dtype *dt = !strcmp(a, "--dtype") ? &o->dtype : !strcmp(a, "--wire") ? &o->wire : NULL;
  if (!dt) return 1;
  *dt = !strcmp(v, "bf16") ? SG_BF16 : SG_F32;
  return strcmp(v, "bf16") && strcmp(v, "f32");
}

static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.mode = "flat", .iface = "eth0", .micro = 1, .steps = 3, .warmup = 1,
                 .batch = 2, .hidden = 2048, .layers = 9, .dtype = SG_F32, .wire = SG_F32,
                 .bucket_mb = 32.0};
  const mlp_cli_int_flag ints[] = {{"--micro", 1, 1 << 30, &o->micro},
                                 {"--steps", 1, 1 << 30, &o->steps},
                                 {"--warmup", 0, 1 << 30, &o->warmup},
                                 {"--batch", 1, 1 << 30, &o->batch},
                                 {"--hidden", 1, 1 << 30, &o->hidden},
                                 {"--layers", 1, MLP_MAX_LAYERS, &o->layers},
                                 {"--ranks-per-node", 0, 1 << 30, &o->ranks_per_node},
                                 {"--outer", 0, 1 << 30, &o->outer},
                                 {"--stream", 0, 1, &o->stream}};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    int bad = 0;
    if (!strcmp(a, "--profile")) {
      o->profile = 1;
      continue;
    }
    if (!mlp_cli_int_flags(ints, sizeof ints / sizeof *ints, a, v, &bad))
      bad = other_flag(o, a, v);
    if (bad) return usage();
    i++;
  }
  if (!strcmp(o->mode, "hybrid") && o->sync_last) {
    fprintf(stderr, "sg_bench_cluster: --mode hybrid reduces inside a node every micro-batch "
                    "and across nodes once per step already; --sync last is for flat\n");
    return -1;
  }
  return 0;
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) return 64;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int nrank = 0, leaders = 0;
  MPI_Comm_rank(node, &nrank);
  const int leader = nrank == 0;
  MPI_Allreduce(&leader, &leaders, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  sg_comm *comm = NULL;
  result r = {.nodes = leaders};
  sg_status st = sg_comm_create_mpi(NULL, &comm);
  if (st != SG_OK)
    fprintf(stderr, "sg_bench_cluster: sg_comm_create_mpi: %s\n", sg_last_error());
  else
    st = run(&o, comm, node, &r);
  if (st == SG_OK && rank == 0)
    printf("RESULT impl=shardgrad mode=%s sync=%s micro=%d W=%d nodes=%d params=%zu dtype=%s "
           "wire=%s codec=%d outer=%d stream=%d batch=%d steps=%d step_ms=%.1f step_mean_ms=%.1f "
           "step_max_ms=%.1f link_sent_per_step=%.0f "
           "link_sent_max_node=%.0f loss_first=%.6f loss_last=%.6f\n",
           o.mode, o.sync_last ? "last" : "every", o.micro, world, r.nodes, r.params,
           o.dtype == SG_BF16 ? "bf16" : "f32", o.wire == SG_BF16 ? "bf16" : "f32", (int)o.codec,
           o.outer, o.stream, o.batch, o.steps, r.step_ms, r.step_mean_ms, r.step_max_ms,
           r.sent_per_step, r.sent_max_node, (double)r.first_loss, (double)r.last_loss);
  sg_comm_destroy(comm);
  MPI_Comm_free(&node);
  MPI_Finalize();
  return st == SG_OK ? 0 : 1;
}
