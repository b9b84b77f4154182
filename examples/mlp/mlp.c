/* mlp: trains a multi-layer perceptron with shardgrad on data from a fixed random teacher network.
 *
 *   mlp --ranks 2 --strategy shard_grad_op --dtype bf16      (2 ranks as threads)
 *   mpirun -np 2 mlp                                         (one rank per process; as root
 *                                   add --allow-run-as-root, on fewer cores --oversubscribe)
 *   mlp --save ck --save-every 50 ; mlp --resume ck --ranks 3   (checkpoint, resume elsewhere)
 *   mpirun -np 4 mlp --hybrid 2 --micro-batches 8            (2 nodes of 2: hybrid sharding)
 *
 * Every rank holds the full model (working parameters), computes forward and backward on its own
 * slice of the data in plain C, writes each gradient into the engine's slot (sg_grad_ptr, in the
 * grad dtype, last layer first) and calls sg_step, which reduces the gradients, runs AdamW on the
 * rank's shard and gathers the updated parameters. Rank 0 prints its own (local) loss. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "mlp_cli.h"
#include "mlp_model.h"
#include "mlp_plot.h"
#include "shardgrad.h"

typedef struct options {
  mlp_cli c; /* the flags shared with mlp_cuda */
  int mpi, no_sync;
  int hybrid;                        /* --hybrid N: N nodes (0: flat) */
  const char *save_dir, *resume_dir; /* --save (with --save-every N, and at the end), --resume */
  const char *plot;                  /* --plot FILE: rank 0's loss curve and memory, a PNG */
  int save_every;
  const char *launcher; /* mpirun, srun, ... that started this process (NULL: none) */
  int launched;         /* the number of processes it started (0: unknown) */
} options;

static int failed(int rank, const char *what, sg_status st) {
  return mlp_cli_failed("mlp", rank, what, st);
}

#define CHECK(call)                     \
  do {                                  \
    sg_status st_ = (call);             \
    if (st_ != SG_OK) {                 \
      r->rc = failed(rank, #call, st_); \
      goto done;                        \
    }                                   \
  } while (0)

static void print_memory(const options *o, const mlp_model *m, const sg_memory_stats *mem,
                         const sg_memory_stats *ddp, int world) {
  char layout[64] = "";
  if (o->hybrid)
    snprintf(layout, sizeof layout, ", hybrid: %d nodes x %d ranks", o->hybrid, world / o->hybrid);
  printf(
      "mlp: %s, W=%d (%s%s), %s params, %d layers x %d hidden, %zu params, batch %d x %d "
      "micro-batch(es) per rank, lr %g%s\n",
      mlp_cli_strategy_name(o->c.strategy), world, o->mpi ? "MPI" : "threads", layout,
      mlp_cli_dtype_name(o->c.dtype), m->layers, o->c.hidden, m->total_numel, o->c.batch,
      o->c.micro, (double)o->c.lr, o->no_sync ? " (no_sync)" : "");
  mlp_cli_print_memory(mem, ddp);
}

/* One micro-batch on this rank's slice of the data stream. */
static sg_status micro_batch(mlp_engine *me, const options *o, int step, int mb, int rank,
                             int world, float loss_scale, float *loss) {
  const uint64_t slot = ((uint64_t)step * (uint64_t)o->c.micro + (uint64_t)mb) * (uint64_t)world;
  mlp_make_batch(me->m, (slot + (uint64_t)rank) * (uint64_t)o->c.batch);
  return mlp_engine_micro_batch(me, loss_scale / (float)o->c.micro, loss);
}

/* Flat: one engine over all ranks. Hybrid: the world split into o->hybrid nodes of consecutive
 * ranks, the engine sharded inside a node and replicated across nodes (after sg_finalize it is
 * told the micro-batches per step, so the cross-node all-reduce overlaps the last backward). */
static sg_status create_engine(const options *o, sg_comm *comm, const sg_config *cfg,
                               sg_comm **shard, sg_comm **replica, sg_engine **e) {
  if (!o->hybrid) return sg_engine_create(comm, cfg, e);
  sg_status st = sg_comm_split_nodes(comm, sg_comm_size(comm) / o->hybrid, shard, replica);
  if (st == SG_OK) st = sg_engine_create_hybrid(*shard, *replica, cfg, e);
  return st;
}

static void *train(void *arg) {
  mlp_rank_run *r = arg;
  const options *o = r->o;
  const int rank = sg_comm_rank(r->comm), world = sg_comm_size(r->comm);
  sg_engine *e = NULL;
  sg_comm *shard = NULL, *replica = NULL; /* --hybrid */
  float *curve = NULL; /* rank 0's loss per step, for --plot */
  mlp_model m;
  mlp_engine me;
  memset(&me, 0, sizeof me);
  if (mlp_init(&m, o->c.layers, o->c.hidden, o->c.batch, o->c.seed) != 0) {
    fprintf(stderr, "mlp: rank %d: out of memory\n", rank);
    r->rc = 1;
    return NULL;
  }
  if (o->hybrid && world % o->hybrid != 0) { /* under MPI: the same verdict on every rank */
    if (rank == 0)
      fprintf(stderr, "mlp: --hybrid %d: %d ranks are not a multiple of the %d nodes (every node "
                      "needs the same number of ranks)\n", o->hybrid, world, o->hybrid);
    r->rc = 1;
    goto done;
  }
  sg_config cfg;
  CHECK(sg_config_init(&cfg, sizeof cfg));
  mlp_cli_config(&o->c, &cfg);
  CHECK(create_engine(o, r->comm, &cfg, &shard, &replica, &e));
  CHECK(mlp_engine_register(&me, &m, e, &cfg));
  CHECK(sg_finalize(e));
  if (o->hybrid) CHECK(sg_set_microbatches(e, o->c.micro));
  CHECK(mlp_engine_init_params(&me));

  sg_memory_stats mem = {.struct_size = sizeof mem}, ddp = {.struct_size = sizeof ddp};
  CHECK(sg_memory(e, &mem));
  sg_config ddp_cfg = cfg;
  ddp_cfg.strategy = SG_NO_SHARD;
  ddp_cfg.offload_optimizer = 0;
  ddp_cfg.shard_ranks = 0;
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
  if (rank == 0 && o->plot && start < o->c.steps &&
      !(curve = malloc((size_t)(o->c.steps - start) * sizeof *curve))) {
    fprintf(stderr, "mlp: out of memory for the --plot curve\n");
    r->rc = 1;
    goto done;
  }
  const double t_start = mlp_cli_now_s();
  const int tty = mlp_cli_want_bar(rank);
  for (int step = start; step < o->c.steps; step++) {
    const double t0 = mlp_cli_now_s();
    float scale = 1.0f, loss_sum = 0.0f;
    CHECK(sg_get_loss_scale(e, &scale));
    CHECK(mlp_cli_trace_step(&o->c, e, step, start));
    for (int mb = 0; mb < o->c.micro; mb++) {
      if (o->no_sync && o->c.micro > 1) CHECK(sg_set_sync(e, mb == o->c.micro - 1));
      CHECK(mlp_cli_trace_micro(&o->c, e, step, start));
      float loss = 0.0f;
      CHECK(micro_batch(&me, o, step, mb, rank, world, scale, &loss));
      CHECK(sg_backward_end(e));
      loss_sum += loss;
    }
    sg_step_info info = {.struct_size = sizeof info};
    CHECK(sg_step(e, &info));
    const double dt = mlp_cli_now_s() - t0;
    last = loss_sum / (float)o->c.micro;
    if (step == start) first = last;
    if (curve) curve[step - start] = last;
    skipped += info.skipped;
    const double elapsed = mlp_cli_now_s() - t_start;
    if (rank == 0 && (step % o->c.log_every == 0 || step == o->c.steps - 1)) {
      char eta[32];
      mlp_cli_bar_clear(tty);
      printf("step %5d  loss %.6f  grad_norm %.5f  %.1f steps/s  eta %s", step, (double)last,
             (double)info.grad_norm, 1.0 / dt,
             mlp_cli_eta(elapsed, step + 1 - start, o->c.steps - start, eta, sizeof eta));
      if (o->c.dtype == SG_F16) printf("  loss_scale %g", (double)info.loss_scale);
      printf("%s\n", info.skipped ? "  (skipped: non-finite gradients)" : "");
    }
    if (step < o->c.steps - 1) mlp_cli_bar(tty, step + 1 - start, o->c.steps - start, elapsed);
    const int save_now = o->save_every > 0 && (step + 1) % o->save_every == 0;
    if (o->save_dir && (save_now || step == o->c.steps - 1)) {
      CHECK(sg_save(e, o->save_dir));
      mlp_cli_bar_clear(tty);
      if (rank == 0) printf("saved step %llu to %s\n", (unsigned long long)info.step, o->save_dir);
    }
  }
  mlp_cli_bar_clear(tty);
  const double rate = (double)(o->c.steps - start) / (mlp_cli_now_s() - t_start);
  CHECK(mlp_cli_trace_finish(&o->c, e, rank));
  if (rank == 0 && start >= o->c.steps) {
    printf("nothing to train: the checkpoint is at step %d, --steps is %d\n", start, o->c.steps);
  } else if (rank == 0) {
    r->rc = mlp_cli_report("mlp", &o->c, first, last, o->c.steps - start, rate, world, &mem, &ddp,
                           skipped);
    if (curve && mlp_plot_write(o->plot, curve, o->c.steps - start, start,
                                (double)mem.total_bytes, (double)ddp.total_bytes,
                                mlp_cli_strategy_name(o->c.strategy), world) != 0) {
      fprintf(stderr, "mlp: --plot %s: %s\n", o->plot, strerror(errno));
      r->rc = 1;
    } else if (curve) {
      printf("plot: loss curve and memory per rank written to %s\n", o->plot);
    }
  }
done:
  free(curve);
  mlp_engine_free(&me);
  sg_engine_destroy(e);
  sg_comm_destroy(shard);
  sg_comm_destroy(replica);
  mlp_free(&m);
  return NULL;
}

/* ---- command line -------------------------------------------------------------------------- */

static const mlp_cli_prog *prog_info(void);

static void usage(void) {
  printf("usage: mlp [options]: trains an MLP on data from a random teacher network with\n"
         "shardgrad, on --ranks N threads or one rank per process under mpirun or srun:\n"
         "  mlp --ranks 2                 2 ranks as threads of this process\n"
         "  mpirun -np 2 mlp              2 processes (Open MPI as root: add --allow-run-as-root;\n"
         "                                more ranks than cores: add --oversubscribe)\n"
         "  srun -N 2 --ntasks-per-node=2 mlp   4 processes on 2 nodes of a Slurm cluster\n"
         "  --mpi               one rank per process (mpirun -np N mlp); used without the flag\n"
         "                      when mpirun or srun started mlp\n");
  mlp_cli_help_common(stdout, prog_info());
  printf("  --no-sync           with --micro-batches: no communication until the last one\n"
         "  --hybrid N          hybrid sharding: the ranks as N nodes of consecutive ranks,\n"
         "                      sharded inside a node, replicated across nodes (one all-reduce\n"
         "                      across nodes per step); the rank count must be a multiple of N\n"
         "  --save DIR          checkpoint at the end (and every --save-every N steps)\n"
         "  --save-every N      with --save: also every N steps\n"
         "  --resume DIR        continue from a checkpoint (any rank count, strategy, buckets)\n"
         "  --plot FILE         draw rank 0's loss curve and the memory per rank beside\n"
         "                      NO_SHARD's into the PNG FILE\n");
}

static int switch_flag(void *opts, const char *flag) {
  options *o = opts;
  if (!strcmp(flag, "--mpi"))
    o->mpi = 1;
  else if (!strcmp(flag, "--no-sync"))
    o->no_sync = 1;
  else
    return 0;
  return 1;
}

static int value_flag(void *opts, const char *flag, const char *v, int *bad) {
  options *o = opts;
  if (!strcmp(flag, "--save"))
    o->save_dir = v;
  else if (!strcmp(flag, "--resume"))
    o->resume_dir = v;
  else if (!strcmp(flag, "--plot"))
    o->plot = v;
  else if (!strcmp(flag, "--save-every"))
    *bad = mlp_cli_parse_int(v, 1, 1 << 30, &o->save_every) != 0;
  else if (!strcmp(flag, "--hybrid"))
    *bad = mlp_cli_parse_int(v, 1, 4096, &o->hybrid) != 0;
  else
    return 0;
  return 1;
}

static const mlp_cli_prog *prog_info(void) {
  static const char *const values[] = {"--save", "a directory", "--resume",
                                       "a checkpoint directory", "--save-every",
                                       "an integer >= 1", "--plot", "a .png file name",
                                       "--hybrid", "a number of nodes in 1..4096", NULL};
  static const mlp_cli_prog prog = {.name = "mlp",
                                    .max_ranks = 4096,
                                    .n_dtypes = 3,
                                    .usage = usage,
                                    .switch_flag = switch_flag,
                                    .value_flag = value_flag,
                                    .value_flags = values};
  return &prog;
}

/* 1 when the directory part of `path` (".": none) is a directory. */
static int dir_exists(const char *path) {
  char dir[4096];
  const char *slash = strrchr(path, '/');
  size_t n = slash ? (size_t)(slash - path) : 1;
  if (n >= sizeof dir) return 0;
  memcpy(dir, slash ? path : ".", n);
  dir[n] = 0;
  if (slash && n == 0) strcpy(dir, "/");
  struct stat st;
  return stat(dir, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The flags, then how the ranks start: --mpi, or without it MPI when a launcher started this
 * process (two trainings of --ranks threads each is never what mpirun -np 2 meant). */
static int parse_args(int argc, char **argv, options *o) {
  memset(o, 0, sizeof *o);
  if (mlp_cli_parse(prog_info(), argc, argv, &o->c, o) != 0) return -1;
  int nprocs = 0;
  const char *launcher = mlp_cli_launcher(&nprocs); /* before MPI_Init, which sets them too */
  o->launcher = launcher;
  o->launched = nprocs;
  if (o->mpi && o->c.ranks_given) {
    fprintf(stderr, "mlp: --ranks and --mpi conflict: with --mpi the ranks are the processes "
                    "(mpirun -np N mlp --mpi); --ranks N runs N threads without MPI\n");
    return -1;
  }
  if (launcher && !o->mpi && o->c.ranks_given) {
    fprintf(stderr, "mlp: started by %s, and --ranks %d asks for threads: each of the %d "
                    "processes would train alone; drop --ranks (one rank per process)\n",
            launcher, o->c.ranks, nprocs);
    return -1;
  }
  if (launcher && !o->mpi) {
    if (!sg_has_backend("mpi")) {
      fprintf(stderr, "mlp: started by %s (%d processes), but this libshardgrad has no MPI: "
                      "rebuild with -DSG_WITH_MPI=ON, or run mlp --ranks N without mpirun\n",
              launcher, nprocs);
      return -1;
    }
    o->mpi = 1; /* as if --mpi was given */
  }
  if (o->plot && !dir_exists(o->plot)) {
    fprintf(stderr, "mlp: --plot %s: its directory does not exist\n", o->plot);
    return -1;
  }
  if (o->save_every && !o->save_dir) {
    fprintf(stderr, "mlp: --save-every needs --save DIR\n");
    return -1;
  }
  if (o->hybrid && o->c.strategy == SG_NO_SHARD) {
    fprintf(stderr, "mlp: --hybrid shards inside a node: it needs --strategy shard_grad_op or "
                    "shard_opt, not no_shard\n");
    return -1;
  }
  if (o->hybrid && !o->mpi && o->c.ranks % o->hybrid != 0) {
    fprintf(stderr, "mlp: --hybrid %d: --ranks %d is not a multiple of the %d nodes (every node "
                    "needs the same number of ranks)\n", o->hybrid, o->c.ranks, o->hybrid);
    return -1;
  }
  return 0;
}

/* 0 when MPI's world is the launcher's job. A launcher of another MPI than the one libshardgrad
 * was built with starts processes that each MPI_Init as a world of one: every one would train
 * alone and print as rank 0, so say so and stop. Without a launcher, --mpi is one rank. */
static int check_mpi_world(const options *o, int world) {
  if (o->launcher && o->launched > 0 && o->launched != world) {
    fprintf(stderr, "mlp: %s started %d processes, but MPI made this one a world of %d: "
                    "libshardgrad's MPI is not the launcher's; start mlp with the mpirun (or "
                    "srun --mpi=...) of the MPI that libshardgrad was built with\n",
            o->launcher, o->launched, world);
    return -1;
  }
  if (!o->launcher && world == 1)
    printf("mlp: --mpi without a launcher: 1 rank (for N ranks: mpirun -np N mlp, or mlp "
           "--ranks N for threads)\n");
  return 0;
}

static int run_mpi(const options *o) {
  mlp_rank_run run = {.o = o};
  const sg_status st = sg_comm_create_mpi(NULL, &run.comm);
  if (st != SG_OK) return failed(-1, "sg_comm_create_mpi", st);
  if (check_mpi_world(o, sg_comm_size(run.comm)) != 0)
    run.rc = 1;
  else
    train(&run);
  sg_comm_destroy(run.comm); /* the last destroy finalizes MPI, which the library initialized */
  return run.rc;
}

int main(int argc, char **argv) {
  options o;
  if (parse_args(argc, argv, &o) != 0) return 64;
  setvbuf(stdout, NULL, _IOLBF, 0);
  return o.mpi ? run_mpi(&o) : mlp_cli_run_threads("mlp", &o, o.c.ranks, 0, train);
}
