/* mlp: trains a multi-layer perceptron with shardgrad on data from a fixed random teacher network.
 *
 *   mlp --ranks 2 --strategy shard_grad_op --dtype bf16      (2 ranks as threads)
 *   mpirun -np 2 mlp --mpi                                   (one rank per process)
 *   mlp --save ck --save-every 50 ; mlp --resume ck --ranks 3   (checkpoint, resume elsewhere)
 *
 * Every rank holds the full model (working parameters), computes forward and backward on its own
 * slice of the data in plain C, writes each gradient into the engine's slot (sg_grad_ptr, in the
 * grad dtype, last layer first) and calls sg_step, which reduces the gradients, runs AdamW on the
 * rank's shard and gathers the updated parameters. Rank 0 prints its own (local) loss. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mlp_model.h"
#include "shardgrad.h"

typedef struct options {
  sg_strategy strategy;
  sg_dtype dtype;
  int ranks, mpi, steps, micro, no_sync, batch, hidden, layers, check, log_every;
  double bucket_mb;
  float lr, clip;
  uint64_t seed;
  const char *save_dir, *resume_dir; /* --save (with --save-every N, and at the end), --resume */
  int save_every;
} options;

typedef struct rank_run {
  const options *o;
  sg_comm *comm;
  int rc; /* 0 ok, 1 an sg_ call failed, 2 --check failed */
} rank_run;

static const char *strategy_name(sg_strategy s) {
  return s == SG_NO_SHARD ? "NO_SHARD" : s == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP";
}

static const char *dtype_name(sg_dtype d) {
  return d == SG_F32 ? "f32" : d == SG_BF16 ? "bf16" : "f16";
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* Reports a failed sg_ call with the library's detail (thread-local, so printed here). */
static int failed(int rank, const char *what, sg_status st) {
  fprintf(stderr, "mlp: rank %d: %s failed: %s: %s\n", rank, what, sg_status_string(st),
          sg_last_error());
  return 1;
}

#define CHECK(call)                     \
  do {                                  \
    sg_status st_ = (call);             \
    if (st_ != SG_OK) {                 \
      r->rc = failed(rank, #call, st_); \
      goto done;                        \
    }                                   \
  } while (0)

static void make_config(const options *o, sg_config *cfg) {
  cfg->strategy = o->strategy;
  cfg->param_dtype = o->dtype;
  cfg->grad_dtype = o->dtype;
  cfg->reduce_dtype = o->dtype;
  cfg->bucket_bytes = (size_t)(o->bucket_mb * 1024.0 * 1024.0);
  cfg->lr = o->lr;
  cfg->max_grad_norm = o->clip;
  cfg->seed = o->seed;
  cfg->timeout_ms = 120000; /* a failed rank makes the others fail within 2 minutes, not hang */
}

static void print_memory(const options *o, const mlp_model *m, const sg_memory_stats *mem,
                         const sg_memory_stats *ddp, int world) {
  printf(
      "mlp: %s, W=%d (%s), %s params, %d layers x %d hidden, %zu params, batch %d x %d "
      "micro-batch(es) per rank%s\n",
      strategy_name(o->strategy), world, o->mpi ? "MPI" : "threads", dtype_name(o->dtype),
      m->layers, o->hidden, m->total_numel, o->batch, o->micro, o->no_sync ? " (no_sync)" : "");
  printf(
      "memory per rank: %.3f MiB (params %.3f, grads %.3f, master %.3f, optim %.3f, comm %.3f)"
      " vs %.3f MiB with NO_SHARD\n",
      mib(mem->total_bytes), mib(mem->params_bytes), mib(mem->grads_bytes), mib(mem->master_bytes),
      mib(mem->optim_bytes), mib(mem->comm_bytes), mib(ddp->total_bytes));
  printf("loss below is rank 0's local loss (each rank trains on its own slice of the data)\n");
}

/* One micro-batch on this rank's slice of the data stream. */
static sg_status micro_batch(mlp_engine *me, const options *o, int step, int mb, int rank,
                             int world, float loss_scale, float *loss) {
  const uint64_t slot = ((uint64_t)step * (uint64_t)o->micro + (uint64_t)mb) * (uint64_t)world;
  mlp_make_batch(me->m, (slot + (uint64_t)rank) * (uint64_t)o->batch);
  return mlp_engine_micro_batch(me, loss_scale / (float)o->micro, loss);
}

static void *train(void *arg) {
  rank_run *r = arg;
  const options *o = r->o;
  const int rank = sg_comm_rank(r->comm), world = sg_comm_size(r->comm);
  sg_engine *e = NULL;
  mlp_model m;
  mlp_engine me;
  memset(&me, 0, sizeof me);
  if (mlp_init(&m, o->layers, o->hidden, o->batch, o->seed) != 0) {
    fprintf(stderr, "mlp: rank %d: out of memory\n", rank);
    r->rc = 1;
    return NULL;
  }
  sg_config cfg;
  CHECK(sg_config_init(&cfg, sizeof cfg));
  make_config(o, &cfg);
  CHECK(sg_engine_create(r->comm, &cfg, &e));
  CHECK(mlp_engine_register(&me, &m, e, &cfg));
  CHECK(sg_finalize(e));
  CHECK(mlp_engine_init_params(&me));

  sg_memory_stats mem = {.struct_size = sizeof mem}, ddp = {.struct_size = sizeof ddp};
  CHECK(sg_memory(e, &mem));
  sg_config ddp_cfg = cfg;
  ddp_cfg.strategy = SG_NO_SHARD;
  CHECK(sg_estimate_memory(&ddp_cfg, m.numel, m.nparams, world, &ddp));
  if (rank == 0) print_memory(o, &m, &mem, &ddp, world);

  int start = 0;
  if (o->resume_dir) { /* any world size, strategy or bucket size; the data stream continues */
    uint64_t done = 0;
    CHECK(sg_load(e, o->resume_dir));
    CHECK(sg_get_step(e, &done));
    start = (int)done;
    if (rank == 0) printf("resumed from %s at step %d\n", o->resume_dir, start);
  }
  float first = 0.0f, last = 0.0f;
  int skipped = 0;
  const double t_start = now_s();
  for (int step = start; step < o->steps; step++) {
    const double t0 = now_s();
    float scale = 1.0f, loss_sum = 0.0f;
    CHECK(sg_get_loss_scale(e, &scale));
    for (int mb = 0; mb < o->micro; mb++) {
      if (o->no_sync && o->micro > 1) CHECK(sg_set_sync(e, mb == o->micro - 1));
      float loss = 0.0f;
      CHECK(micro_batch(&me, o, step, mb, rank, world, scale, &loss));
      CHECK(sg_backward_end(e));
      loss_sum += loss;
    }
    sg_step_info info = {.struct_size = sizeof info};
    CHECK(sg_step(e, &info));
    const double dt = now_s() - t0;
    last = loss_sum / (float)o->micro;
    if (step == start) first = last;
    skipped += info.skipped;
    if (rank == 0 && (step % o->log_every == 0 || step == o->steps - 1)) {
      printf("step %5d  loss %.6f  grad_norm %.5f  %.1f steps/s", step, (double)last,
             (double)info.grad_norm, 1.0 / dt);
      if (o->dtype == SG_F16) printf("  loss_scale %g", (double)info.loss_scale);
      printf("%s\n", info.skipped ? "  (skipped: non-finite gradients)" : "");
    }
    const int save_now = o->save_every > 0 && (step + 1) % o->save_every == 0;
    if (o->save_dir && (save_now || step == o->steps - 1)) {
      CHECK(sg_save(e, o->save_dir));
      if (rank == 0) printf("saved step %llu to %s\n", (unsigned long long)info.step, o->save_dir);
    }
  }
  const double rate = (double)(o->steps - start) / (now_s() - t_start);
  if (rank == 0 && start >= o->steps) {
    printf("nothing to train: the checkpoint is at step %d, --steps is %d\n", start, o->steps);
  } else if (rank == 0) {
    printf(
        "loss %.4g -> %.4g (%.1fx lower) in %d steps, %.1f steps/s, %s, W=%d, %.3f MiB/rank "
        "vs %.3f MiB NO_SHARD%s\n",
        (double)first, (double)last, (double)(first / last), o->steps - start, rate,
        strategy_name(o->strategy), world, mib(mem.total_bytes), mib(ddp.total_bytes),
        skipped ? " (some steps skipped)" : "");
    if (o->check && !(last < 0.5f * first)) {
      fprintf(stderr, "mlp: --check failed: final loss %g is not below 0.5 x first loss %g\n",
              (double)last, (double)first);
      r->rc = 2;
    }
  }
done:
  mlp_engine_free(&me);
  sg_engine_destroy(e);
  mlp_free(&m);
  return NULL;
}

/* ---- command line -------------------------------------------------------------------------- */

static void usage(void) {
  fprintf(stderr,
          "usage: mlp [--ranks N | --mpi] [--strategy no_shard|shard_opt|shard_grad_op]\n"
          "           [--dtype f32|bf16|f16] [--steps N] [--micro-batches N] [--no-sync]\n"
          "           [--batch N] [--hidden N] [--layers N] [--bucket-mb X] [--lr X]\n"
          "           [--clip X] [--seed N] [--log-every N] [--check]\n"
          "           [--save DIR [--save-every N]] [--resume DIR]\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

static int parse_num(const char *s, double lo, double *out) {
  char *end = NULL;
  errno = 0;
  const double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo)) return -1;
  *out = v;
  return 0;
}

static int parse_enum(const char *s, const char *const *names, int n, int *out) {
  for (int i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = i;
      return 0;
    }
  return -1;
}

static int parse_value(options *o, const char *flag, const char *v) {
  static const char *const strategies[] = {"no_shard", "shard_opt", "shard_grad_op"};
  static const char *const dtypes[] = {"f32", "bf16", "f16"};
  double d = 0.0;
  int i = 0, rc = 0;
  if (!strcmp(flag, "--strategy")) {
    rc = parse_enum(v, strategies, 3, &i);
    o->strategy = (sg_strategy)i;
  } else if (!strcmp(flag, "--dtype")) {
    rc = parse_enum(v, dtypes, 3, &i);
    o->dtype = (sg_dtype)i;
  } else if (!strcmp(flag, "--ranks"))
    rc = parse_int(v, 1, 4096, &o->ranks);
  else if (!strcmp(flag, "--steps"))
    rc = parse_int(v, 1, 100000000, &o->steps);
  else if (!strcmp(flag, "--micro-batches"))
    rc = parse_int(v, 1, 1000000, &o->micro);
  else if (!strcmp(flag, "--batch"))
    rc = parse_int(v, 1, 1 << 20, &o->batch);
  else if (!strcmp(flag, "--hidden"))
    rc = parse_int(v, 1, 1 << 16, &o->hidden);
  else if (!strcmp(flag, "--layers"))
    rc = parse_int(v, 1, MLP_MAX_LAYERS, &o->layers);
  else if (!strcmp(flag, "--log-every"))
    rc = parse_int(v, 1, 1 << 30, &o->log_every);
  else if (!strcmp(flag, "--bucket-mb"))
    rc = parse_num(v, 1e-6, &o->bucket_mb);
  else if (!strcmp(flag, "--lr")) {
    rc = parse_num(v, 0.0, &d);
    o->lr = (float)d;
  } else if (!strcmp(flag, "--clip")) {
    rc = parse_num(v, 0.0, &d);
    o->clip = (float)d;
  } else if (!strcmp(flag, "--save"))
    o->save_dir = v;
  else if (!strcmp(flag, "--resume"))
    o->resume_dir = v;
  else if (!strcmp(flag, "--save-every"))
    rc = parse_int(v, 1, 1 << 30, &o->save_every);
  else if (!strcmp(flag, "--seed")) {
    rc = parse_num(v, 0.0, &d);
    o->seed = (uint64_t)d;
  } else
    rc = -1;
  if (rc) fprintf(stderr, "mlp: bad value for %s: '%s'\n", flag, v);
  return rc;
}

static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.strategy = SG_SHARD_GRAD_OP,
                 .dtype = SG_F32,
                 .ranks = 2,
                 .steps = 200,
                 .micro = 1,
                 .batch = 32,
                 .hidden = 128,
                 .layers = 3,
                 .bucket_mb = 0.25,
                 .lr = 3e-3f,
                 .clip = 1.0f,
                 .seed = 1,
                 .log_every = 1};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--mpi"))
      o->mpi = 1;
    else if (!strcmp(a, "--no-sync"))
      o->no_sync = 1;
    else if (!strcmp(a, "--check"))
      o->check = 1;
    else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage();
      exit(0);
    } else if (!strncmp(a, "--", 2) && i + 1 < argc) {
      if (parse_value(o, a, argv[++i])) return -1;
    } else {
      fprintf(stderr, "mlp: unknown argument '%s'\n", a);
      return -1;
    }
  }
  return 0;
}

static int run_threads(const options *o) {
  sg_comm **comms = calloc((size_t)o->ranks, sizeof *comms);
  rank_run *runs = calloc((size_t)o->ranks, sizeof *runs);
  pthread_t *th = calloc((size_t)o->ranks, sizeof *th);
  int rc = 1, started = 0;
  if (!comms || !runs || !th) goto done;
  const sg_status st = sg_comm_create_local(o->ranks, comms);
  if (st != SG_OK) {
    failed(0, "sg_comm_create_local", st);
    goto done;
  }
  for (; started < o->ranks; started++) {
    runs[started] = (rank_run){.o = o, .comm = comms[started]};
    if (pthread_create(&th[started], NULL, train, &runs[started]) != 0) break;
  }
  rc = started == o->ranks ? 0 : 1;
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    if (runs[i].rc > rc) rc = runs[i].rc;
  }
  for (int i = 0; i < o->ranks; i++) sg_comm_destroy(comms[i]);
done:
  free(comms);
  free(runs);
  free(th);
  return rc;
}

static int run_mpi(const options *o) {
  rank_run run = {.o = o};
  const sg_status st = sg_comm_create_mpi(NULL, &run.comm);
  if (st != SG_OK) return failed(-1, "sg_comm_create_mpi", st);
  train(&run);
  sg_comm_destroy(run.comm); /* the last destroy finalizes MPI, which the library initialized */
  return run.rc;
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) {
    usage();
    return 64;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  return o.mpi ? run_mpi(&o) : run_threads(&o);
}
