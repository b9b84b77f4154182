/* sg_bench_step: time of one training step of the example MLP and memory per rank, at W ranks
 * (default 2 threads; or one rank per process under mpirun with --mpi), for
 *
 *   plain   a plain data-parallel loop written here: one all-reduce of the full f32 gradient
 *           (MPI_Allreduce under MPI; a naive locked sum across threads otherwise), then a
 *           plain, non-fused AdamW over every parameter (one pass per update line)
 *   SG_NO_SHARD, SG_SHARD_OPT, SG_SHARD_GRAD_OP   the shardgrad engine
 *
 * all measured in the same run on the same model and data. A step is forward + backward +
 * gradient reduction + optimizer (+ all-gather); the batch is generated before the clock starts.
 * Reported: median step time over the timed steps, ratio to the plain loop, memory per rank
 * (sg_memory for the engine; what the loop allocates for plain) beside DESIGN.md section 3's
 * formula. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_barrier */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlp_cli.h" /* mlp_cli_now_s, integer flags */
#include "mlp_model.h"
#include "shardgrad.h"
#ifdef SG_HAVE_MPI
#include <mpi.h>
#endif

enum { V_PLAIN = 0, V_NO_SHARD, V_SHARD_OPT, V_SHARD_GRAD_OP, V_OVERLAP, V_COUNT };
static const char *const variant_names[V_COUNT] = {
    "plain DP (all-reduce + AdamW)", "SG_NO_SHARD", "SG_SHARD_OPT", "SG_SHARD_GRAD_OP",
    "SG_SHARD_GRAD_OP + overlap"};
/* V_OVERLAP: overlap_param_gather, each layer of the forward pass waits for its own gather */

typedef struct options {
  int ranks, mpi, steps, warmup, batch, hidden, layers;
  sg_dtype dtype;
  double bucket_mb;
  float lr;
} options;

/* What rank 0 reports for one variant. */
typedef struct result {
  double median_ms;
  size_t bytes, comm_bytes; /* measured per rank (comm scratch included in bytes) */
  double formula_bytes;     /* DESIGN.md section 3 */
  sg_memory_stats mem;      /* the engine's breakdown */
  float first_loss, final_loss;
  int ok;
} result;

/* Shared by the threads of one process: the naive locked sum of the plain loop. */
typedef struct shared {
  pthread_mutex_t mu;
  pthread_barrier_t bar;
  float *sum;
  size_t n;
} shared;

typedef struct rank_ctx {
  const options *o;
  sg_comm *comm;
  shared *sh;
  int rank, world;
  result res[V_COUNT]; /* filled on rank 0 */
  int rc;
} rank_ctx;

static double now_ms(void) { return 1e3 * mlp_cli_now_s(); }

static double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void barrier(rank_ctx *c) {
#ifdef SG_HAVE_MPI
  if (c->o->mpi) {
    MPI_Barrier(MPI_COMM_WORLD);
    return;
  }
#endif
  pthread_barrier_wait(&c->sh->bar);
}

static void make_batch(mlp_model *m, const rank_ctx *c, int step) {
  mlp_make_batch(m, ((uint64_t)step * (uint64_t)c->world + (uint64_t)c->rank) * (uint64_t)m->batch);
}

/* ---- the plain data-parallel loop ---------------------------------------------------------- */

typedef struct plain {
  mlp_model *m;
  float *params[2 * MLP_MAX_LAYERS], *m1[2 * MLP_MAX_LAYERS], *m2[2 * MLP_MAX_LAYERS];
  mlp_grads g; /* all gradients, contiguous: one all-reduce */
  size_t bytes;
} plain;

static void *xcalloc(plain *pl, size_t n) {
  pl->bytes += n * sizeof(float);
  return calloc(n, sizeof(float));
}

static int plain_init(plain *pl, mlp_model *m) {
  memset(pl, 0, sizeof *pl);
  pl->m = m;
  /* the model writes each gradient straight into its place (as the engine glue into slots) */
  int ok = mlp_grads_init(&pl->g, m) == 0;
  pl->bytes += m->total_numel * sizeof(float);
  for (int p = 0; p < m->nparams; p++) {
    ok &= (pl->params[p] = xcalloc(pl, m->numel[p])) != NULL;
    ok &= (pl->m1[p] = xcalloc(pl, m->numel[p])) != NULL;
    ok &= (pl->m2[p] = xcalloc(pl, m->numel[p])) != NULL;
    if (ok) mlp_init_param(m, p, pl->params[p]);
  }
  return ok ? 0 : -1;
}

static void plain_free(plain *pl) {
  for (int p = 0; p < 2 * MLP_MAX_LAYERS; p++) {
    free(pl->params[p]);
    free(pl->m1[p]);
    free(pl->m2[p]);
  }
  mlp_grads_free(&pl->g);
}

/* Naive all-reduce across threads: every thread adds its gradient into one shared buffer under a
 * lock, then copies the sum back. */
static void locked_sum(rank_ctx *c, float *g, size_t n) {
  shared *sh = c->sh;
  pthread_mutex_lock(&sh->mu);
  for (size_t i = 0; i < n; i++) sh->sum[i] += g[i];
  pthread_mutex_unlock(&sh->mu);
  pthread_barrier_wait(&sh->bar);
  memcpy(g, sh->sum, n * sizeof(float));
  pthread_barrier_wait(&sh->bar);
  if (c->rank == 0) memset(sh->sum, 0, n * sizeof(float));
  pthread_barrier_wait(&sh->bar);
}

static int all_reduce(rank_ctx *c, float *g, size_t n) {
#ifdef SG_HAVE_MPI
  if (c->o->mpi)
    return MPI_Allreduce(MPI_IN_PLACE, g, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS
               ? 0
               : -1;
#endif
  locked_sum(c, g, n);
  return 0;
}

/* AdamW as torch's single-tensor loop, one pass per update line (not fused). */
static void plain_adamw(plain *pl, float lr, uint64_t t) {
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  const double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
  const float step = (float)(lr / bc1), bc2_sqrt = (float)sqrt(bc2);
  for (int p = 0; p < pl->m->nparams; p++) {
    const size_t n = pl->m->numel[p];
    float *w = pl->params[p], *m = pl->m1[p], *v = pl->m2[p];
    const float *g = pl->g.grad + pl->g.off[p];
    if (p % 2 == 0)
      for (size_t i = 0; i < n; i++) w[i] *= 1.0f - lr * wd;
    for (size_t i = 0; i < n; i++) m[i] += (g[i] - m[i]) * (1.0f - b1);
    for (size_t i = 0; i < n; i++) v[i] = v[i] * b2 + (1.0f - b2) * g[i] * g[i];
    for (size_t i = 0; i < n; i++) w[i] -= step * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
  }
}

static void plain_average(plain *pl, int world) {
  const float inv = 1.0f / (float)world;
  for (size_t i = 0; i < pl->m->total_numel; i++) pl->g.grad[i] *= inv;
}

/* The mean loss of the first and of the last LOSS_MEAN steps (a batch of a few rows is noisy). */
#define LOSS_MEAN 5
static void loss_track(int s, int total, float l, float *first, float *last) {
  const int k = total < LOSS_MEAN ? total : LOSS_MEAN;
  if (s == 0) *first = 0.0f;
  if (s == total - k) *last = 0.0f;
  if (s < k) *first += l / (float)k;
  if (s >= total - k) *last += l / (float)k;
}

static int run_plain(rank_ctx *c, mlp_model *m, double *times, float *first, float *loss) {
  plain pl;
  int rc = -1;
  if (plain_init(&pl, m) != 0) goto done;
  const int total = c->o->warmup + c->o->steps;
  for (int s = 0; s < total; s++) {
    make_batch(m, c, s);
    const double t0 = now_ms();
    const float l = mlp_forward(m, pl.params);
    loss_track(s, total, l, first, loss);
    mlp_backward(m, pl.params, 1.0f, mlp_grads_slot, mlp_grads_sink, &pl.g);
    if (all_reduce(c, pl.g.grad, m->total_numel) != 0) goto done;
    plain_average(&pl, c->world);
    plain_adamw(&pl, c->o->lr, (uint64_t)s + 1);
    if (s >= c->o->warmup) times[s - c->o->warmup] = now_ms() - t0;
  }
  if (c->rank == 0) {
    result *r = &c->res[V_PLAIN];
    r->bytes = pl.bytes;
    r->formula_bytes = 16.0 * (double)m->total_numel; /* 4 param + 4 grad + 8 moments */
  }
  rc = 0;
done:
  plain_free(&pl);
  return rc;
}

/* ---- the engine ---------------------------------------------------------------------------- */

/* DESIGN.md section 3, from the plan's element counts. */
static double formula(const sg_config *cfg, const sg_memory_stats *s, size_t max_numel) {
  const double P = cfg->param_dtype == SG_F32 ? 4 : 2, G = cfg->grad_dtype == SG_F32 ? 4 : 2;
  const double psi = (double)s->numel, shard = (double)s->shard_numel;
  const double A = cfg->accum_dtype == SG_F32 ? 4 : 2;
  double bucket = (double)cfg->bucket_bytes;
  if (bucket > G * psi) bucket = G * psi; /* a bucket never holds more than the model */
  if (bucket < G * (double)max_numel) bucket = G * (double)max_numel; /* a larger param gets
                                                                          a bucket of its own */
  const int lowp = P < 4;
  switch (cfg->strategy) {
    /* NO_SHARD and SHARD_OPT also keep the accumulator that sums micro-batches
     * (docs/memory.md): A*psi replicated, A*psi/W sharded. */
    case SG_NO_SHARD:
      return P * psi + G * psi + A * psi + (lowp ? 4 * psi : 0) + 8 * psi;
    case SG_SHARD_OPT:
      return P * psi + G * psi + A * shard + (lowp ? 4 * shard : 0) + 8 * shard;
    default:
      return P * psi + cfg->staging_buckets * bucket + A * shard + (lowp ? 4 * shard : 0) +
             8 * shard;
  }
}

static sg_status engine_steps(rank_ctx *c, mlp_engine *me, double *times, float *first,
                              float *loss) {
  const int total = c->o->warmup + c->o->steps;
  for (int s = 0; s < total; s++) {
    make_batch(me->m, c, s);
    const double t0 = now_ms();
    float scale = 1.0f;
    sg_status st = sg_get_loss_scale(me->e, &scale);
    float l = 0.0f;
    if (st == SG_OK) st = mlp_engine_micro_batch(me, scale, &l);
    loss_track(s, total, l, first, loss);
    if (st == SG_OK) st = sg_step(me->e, NULL);
    if (st != SG_OK) return st;
    if (s >= c->o->warmup) times[s - c->o->warmup] = now_ms() - t0;
  }
  return SG_OK;
}

static int run_engine(rank_ctx *c, mlp_model *m, int variant, double *times, float *first,
                      float *loss) {
  const sg_strategy strategy =
      variant == V_OVERLAP ? SG_SHARD_GRAD_OP : (sg_strategy)(variant - V_NO_SHARD);
  sg_engine *e = NULL;
  mlp_engine me;
  memset(&me, 0, sizeof me);
  sg_config cfg;
  sg_memory_stats mem = {.struct_size = sizeof mem};
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.strategy = strategy;
  cfg.param_dtype = cfg.grad_dtype = cfg.reduce_dtype = c->o->dtype;
  cfg.bucket_bytes = (size_t)(c->o->bucket_mb * 1024.0 * 1024.0);
  cfg.lr = c->o->lr;
  cfg.timeout_ms = 120000;
  cfg.overlap_param_gather = variant == V_OVERLAP;
  if (st == SG_OK) st = sg_engine_create(c->comm, &cfg, &e);
  if (st == SG_OK) st = mlp_engine_register(&me, m, e, &cfg);
  if (st == SG_OK) st = sg_finalize(e);
  if (st == SG_OK) st = mlp_engine_init_params(&me);
  if (st == SG_OK) st = engine_steps(c, &me, times, first, loss);
  if (st == SG_OK) st = sg_memory(e, &mem);
  if (st != SG_OK)
    fprintf(stderr, "sg_bench_step: rank %d: %s: %s: %s\n", c->rank, variant_names[variant],
            sg_status_string(st), sg_last_error());
  else if (c->rank == 0) {
    result *r = &c->res[variant];
    r->bytes = mem.total_bytes;
    r->comm_bytes = mem.comm_bytes;
    r->mem = mem;
    size_t max_numel = 0;
    for (int i = 0; i < 2 * m->layers; i++)
      if (m->numel[i] > max_numel) max_numel = m->numel[i];
    r->formula_bytes = formula(&cfg, &mem, max_numel);
  }
  mlp_engine_free(&me);
  sg_engine_destroy(e);
  return st == SG_OK ? 0 : -1;
}

static void *rank_main(void *arg) {
  rank_ctx *c = arg;
  mlp_model m;
  double *times = calloc((size_t)c->o->steps, sizeof *times);
  if (!times || mlp_init(&m, c->o->layers, c->o->hidden, c->o->batch, 1) != 0) {
    fprintf(stderr, "sg_bench_step: out of memory\n");
    free(times);
    c->rc = 1;
    return NULL;
  }
  for (int v = 0; v < V_COUNT; v++) {
    float first = 0.0f, loss = 0.0f;
    barrier(c);
    const int rc = v == V_PLAIN ? run_plain(c, &m, times, &first, &loss)
                                : run_engine(c, &m, v, times, &first, &loss);
    if (rc != 0) { /* go on, so that every rank meets the same barriers */
      c->rc = 1;
      continue;
    }
    if (c->rank == 0) {
      c->res[v].median_ms = median(times, c->o->steps);
      c->res[v].first_loss = first;
      c->res[v].final_loss = loss;
      c->res[v].ok = 1;
    }
  }
  free(times);
  mlp_free(&m);
  return NULL;
}

/* ---- report -------------------------------------------------------------------------------- */

static void print_table(const options *o, const rank_ctx *c0) {
  mlp_model m;
  if (mlp_init(&m, o->layers, o->hidden, 1, 1) != 0) return;
  printf(
      "sg_bench_step: MLP %d layers x %d hidden, %zu params, batch %d per rank, %s engine "
      "params, W=%d (%s), bucket %.3g MiB, %d warm-up + %d timed steps\n",
      o->layers, o->hidden, m.total_numel, o->batch,
      o->dtype == SG_F32    ? "f32"
      : o->dtype == SG_BF16 ? "bf16"
                            : "f16",
      c0->world, o->mpi ? "MPI" : "threads", o->bucket_mb, o->warmup, o->steps);
  printf("%-30s %12s %9s %11s %12s %9s %19s\n", "variant", "step ms", "vs plain", "MiB/rank",
         "formula MiB", "comm MiB", "loss first -> last");
  /* loss: rank 0's, the mean of the first and of the last 5 steps (warm-up included) */
  const double base = c0->res[V_PLAIN].median_ms;
  for (int v = 0; v < V_COUNT; v++) {
    const result *r = &c0->res[v];
    if (!r->ok) {
      printf("%-30s %12s\n", variant_names[v], "FAILED");
      continue;
    }
    printf("%-30s %12.3f %8.2fx %11.3f %12.3f %9.3f %8.5f -> %7.5f\n", variant_names[v],
           r->median_ms, r->median_ms / base, mib((double)r->bytes), mib(r->formula_bytes),
           mib((double)r->comm_bytes), (double)r->first_loss, (double)r->final_loss);
  }
  printf("engine memory per rank by category (MiB):\n%-30s %9s %9s %9s %9s %9s\n", "", "params",
         "grads", "master", "optim", "comm");
  for (int v = V_NO_SHARD; v < V_COUNT; v++) {
    const sg_memory_stats *s = &c0->res[v].mem;
    if (c0->res[v].ok)
      printf("%-30s %9.3f %9.3f %9.3f %9.3f %9.3f\n", variant_names[v],
             mib((double)s->params_bytes), mib((double)s->grads_bytes),
             mib((double)s->master_bytes), mib((double)s->optim_bytes), mib((double)s->comm_bytes));
  }
  printf(
      "step ms: median; vs plain: step time / plain loop's (lower is faster). MiB/rank: "
      "measured (sg_memory total, comm scratch included; plain: its own allocations, f32).\n"
      "formula: DESIGN.md section 3 (with docs/memory.md's accumulator for NO_SHARD/SHARD_OPT) on "
      "the padded plan size, without comm scratch, staging S*B with B at least "
      "the largest parameter (which gets a bucket of its own) and at most the model.%s\n",
      o->mpi ? "" : " The threads' shared sum buffer of the plain loop is not counted.");
  mlp_free(&m);
}

/* ---- main ---------------------------------------------------------------------------------- */

/* The flags with other than integer values: 0, or -1 for a bad value or an unknown flag. */
static int other_flag(options *o, const char *a, const char *v) {
  if (!strcmp(a, "--bucket-mb")) return (o->bucket_mb = atof(v)) <= 0.0 ? -1 : 0;
  if (!strcmp(a, "--lr")) return (o->lr = (float)atof(v)) <= 0.0f ? -1 : 0;
  if (strcmp(a, "--dtype")) return -1;
  if (!strcmp(v, "f32"))
    o->dtype = SG_F32;
  else if (!strcmp(v, "bf16"))
    o->dtype = SG_BF16;
  else if (!strcmp(v, "f16"))
    o->dtype = SG_F16;
  else
    return -1;
  return 0;
}

static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.ranks = 2,
                 .steps = 50,
                 .warmup = 5,
                 .batch = 4,
                 .hidden = 2048,
                 .layers = 4,
                 .dtype = SG_F32,
                 .bucket_mb = 8.0,
                 .lr = 0.0f}; /* 0: after the flags, 3e-3 x min(1, 128 / hidden) as examples/mlp */
  const mlp_cli_int_flag ints[] = {{"--ranks", 1, 1 << 30, &o->ranks},
                                 {"--steps", 1, 1 << 30, &o->steps},
                                 {"--warmup", 0, 1 << 30, &o->warmup},
                                 {"--batch", 1, 1 << 30, &o->batch},
                                 {"--hidden", 1, 1 << 30, &o->hidden},
                                 {"--layers", 1, MLP_MAX_LAYERS, &o->layers}};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    int rc = 0;
    if (!strcmp(a, "--mpi")) {
      o->mpi = 1;
      continue;
    }
    if (!mlp_cli_int_flags(ints, sizeof ints / sizeof *ints, a, v, &rc))
      rc = other_flag(o, a, v);
    if (rc) {
      fprintf(stderr,
              "usage: sg_bench_step [--ranks N | --mpi] [--steps N] [--warmup N] "
              "[--batch N] [--hidden N] [--layers N] [--bucket-mb X] [--lr X] "
              "[--dtype f32|bf16|f16]\n");
      return -1;
    }
    i++;
  }
  /* Adam moves every weight by about lr per step, so wider layers need a smaller one (at 16 x
   * 1024 a fixed 1e-3 made the loss rise); the same rule as examples/mlp. */
  if (o->lr == 0.0f) o->lr = o->hidden <= 128 ? 3e-3f : 3e-3f * 128.0f / (float)o->hidden;
  return 0;
}

static int run_threads(const options *o) {
  const int w = o->ranks;
  sg_comm **comms = calloc((size_t)w, sizeof *comms);
  rank_ctx *ctx = calloc((size_t)w, sizeof *ctx);
  pthread_t *th = calloc((size_t)w, sizeof *th);
  shared sh = {.n = 0};
  int rc = 1;
  mlp_model m;
  if (!comms || !ctx || !th || mlp_init(&m, o->layers, o->hidden, 1, 1) != 0) goto done;
  sh.n = m.total_numel;
  mlp_free(&m);
  if (!(sh.sum = calloc(sh.n, sizeof(float)))) goto done;
  pthread_mutex_init(&sh.mu, NULL);
  pthread_barrier_init(&sh.bar, NULL, (unsigned)w);
  sg_status st = sg_comm_create_local(w, comms);
  if (st != SG_OK) {
    fprintf(stderr, "sg_bench_step: sg_comm_create_local: %s\n", sg_last_error());
    goto destroy;
  }
  int started = 0;
  for (; started < w; started++) {
    ctx[started] =
        (rank_ctx){.o = o, .comm = comms[started], .sh = &sh, .rank = started, .world = w};
    if (pthread_create(&th[started], NULL, rank_main, &ctx[started]) != 0) break;
  }
  rc = started == w ? 0 : 1; /* a missing thread leaves the others at a barrier: report, exit */
  if (rc) {
    fprintf(stderr, "sg_bench_step: pthread_create failed\n");
    exit(1);
  }
  for (int i = 0; i < w; i++) {
    pthread_join(th[i], NULL);
    rc |= ctx[i].rc;
  }
  print_table(o, &ctx[0]);
  for (int i = 0; i < w; i++) sg_comm_destroy(comms[i]);
destroy:
  pthread_barrier_destroy(&sh.bar);
  pthread_mutex_destroy(&sh.mu);
done:
  free(sh.sum);
  free(comms);
  free(ctx);
  free(th);
  return rc;
}

static int run_mpi(const options *o) {
#ifdef SG_HAVE_MPI
  int provided = 0, rc = 1;
  MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided);
  rank_ctx c = {.o = o};
  const sg_status st = sg_comm_create_mpi(NULL, &c.comm);
  if (st != SG_OK) {
    fprintf(stderr, "sg_bench_step: sg_comm_create_mpi: %s\n", sg_last_error());
    goto done;
  }
  c.rank = sg_comm_rank(c.comm);
  c.world = sg_comm_size(c.comm);
  rank_main(&c);
  if (c.rank == 0) print_table(o, &c);
  rc = c.rc;
  sg_comm_destroy(c.comm);
done:
  MPI_Finalize(); /* we initialized MPI, so the library leaves finalizing to us */
  return rc;
#else
  (void)o;
  fprintf(stderr, "sg_bench_step: built without MPI (--mpi unavailable)\n");
  return 1;
#endif
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) return 64;
  setvbuf(stdout, NULL, _IOLBF, 0);
  return o.mpi ? run_mpi(&o) : run_threads(&o);
}
