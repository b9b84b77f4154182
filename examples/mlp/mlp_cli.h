/* Command line and run scaffolding shared by examples/mlp (mlp.c) and examples/mlp_cuda
 * (mlp_cuda.c): the options both accept, their parsing, the memory and result lines, and ranks
 * as threads over a local communicator.
 *
 * Header-only (static inline): tests/mlp.cmake builds mlp.c with mlp_model.c alone, so the shared
 * code must come in with the include. Each program keeps its own flags through mlp_cli_prog:
 * switches (no value) and value flags it recognizes itself; anything else is refused. */
#ifndef MLP_CLI_H
#define MLP_CLI_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h> /* isatty */

#include "mlp_model.h" /* MLP_MAX_LAYERS */
#include "shardgrad.h"

/* The options both programs accept, with the defaults mlp_cli_parse sets. */
typedef struct mlp_cli {
  sg_strategy strategy;
  sg_dtype dtype;
  int ranks, steps, micro, batch, hidden, layers, check, log_every;
  int overlap_gather; /* --overlap-gather: overlap_param_gather, waits layer by layer */
  int offload;        /* --offload: offload_optimizer (the optimizer state in host memory) */
  double bucket_mb;
  float lr, clip;
  uint64_t seed;
  const char *trace; /* --trace PATH: Chrome trace of the steps after the first (%r: rank) */
  int ranks_given, lr_given; /* --ranks, --lr on the command line */
} mlp_cli;

/* What differs between the programs' command lines. */
typedef struct mlp_cli_prog {
  const char *name; /* prefix of the messages: "mlp", "mlp_cuda" */
  int max_ranks;    /* upper bound of --ranks */
  int n_dtypes;     /* --dtype accepts the first n of f32, bf16, f16 */
  void (*usage)(void);
  /* 1 when `flag` is one of the program's switches (then set in opts), else 0 */
  int (*switch_flag)(void *opts, const char *flag);
  /* 1 when `flag` is one of the program's value flags, else 0; *bad = 1 for a bad value */
  int (*value_flag)(void *opts, const char *flag, const char *v, int *bad);
  /* the program's value flags with what they expect ("--save", "DIR"), NULL-terminated pairs;
   * for the messages about a missing or bad value */
  const char *const *value_flags;
} mlp_cli_prog;

/* One rank's run: train(mlp_rank_run *) reads o (the program's options) and sets rc. */
typedef struct mlp_rank_run {
  const void *o;
  sg_comm *comm;
  int gpu; /* mlp_cuda: the GPU this rank computes on */
  int rc;  /* 0 ok, 1 a call failed, 2 --check failed */
} mlp_rank_run;

static inline const char *mlp_cli_strategy_name(sg_strategy s) {
  return s == SG_NO_SHARD ? "NO_SHARD" : s == SG_SHARD_OPT ? "SHARD_OPT" : "SHARD_GRAD_OP";
}

static inline const char *mlp_cli_strategy_flag(sg_strategy s) {
  return s == SG_NO_SHARD ? "no_shard" : s == SG_SHARD_OPT ? "shard_opt" : "shard_grad_op";
}

/* What --dtype accepts: the first n_dtypes of f32, bf16, f16. */
static inline const char *mlp_cli_dtypes(const mlp_cli_prog *p) {
  return p->n_dtypes >= 3 ? "f32, bf16 or f16" : p->n_dtypes == 2 ? "f32 or bf16" : "f32";
}

static inline const char *mlp_cli_dtype_name(sg_dtype d) {
  return d == SG_F32 ? "f32" : d == SG_BF16 ? "bf16" : "f16";
}

static inline double mlp_cli_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline double mlp_cli_mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* Reports a failed sg_ call with the library's detail (thread-local, so printed here); 1. */
static inline int mlp_cli_failed(const char *prog, int rank, const char *what, sg_status st) {
  fprintf(stderr, "%s: rank %d: %s failed: %s: %s\n", prog, rank, what, sg_status_string(st),
          sg_last_error());
  return 1;
}

/* The engine settings both programs take from the options (the device is the caller's). */
static inline void mlp_cli_config(const mlp_cli *c, sg_config *cfg) {
  cfg->strategy = c->strategy;
  cfg->param_dtype = c->dtype;
  cfg->grad_dtype = c->dtype;
  cfg->reduce_dtype = c->dtype;
  cfg->bucket_bytes = (size_t)(c->bucket_mb * 1024.0 * 1024.0);
  cfg->lr = c->lr;
  cfg->max_grad_norm = c->clip;
  cfg->seed = c->seed;
  cfg->timeout_ms = 120000; /* a failed rank makes the others fail within 2 minutes, not hang */
  cfg->overlap_param_gather = c->overlap_gather;
  cfg->offload_optimizer = c->offload;
}

/* The two lines after the program's own first line of the run. */
static inline void mlp_cli_print_memory(const sg_memory_stats *mem, const sg_memory_stats *ddp) {
  printf(
      "memory per rank: %.3f MiB (params %.3f, grads %.3f, master %.3f, optim %.3f, comm %.3f)"
      " vs %.3f MiB with NO_SHARD\n",
      mlp_cli_mib(mem->total_bytes), mlp_cli_mib(mem->params_bytes),
      mlp_cli_mib(mem->grads_bytes), mlp_cli_mib(mem->master_bytes),
      mlp_cli_mib(mem->optim_bytes), mlp_cli_mib(mem->comm_bytes), mlp_cli_mib(ddp->total_bytes));
  if (mem->host_bytes)
    printf("offloaded optimizer state: %.3f MiB of pinned host memory per rank\n",
           mlp_cli_mib(mem->host_bytes));
  printf("loss below is rank 0's local loss (each rank trains on its own slice of the data)\n");
}

/* The result line of rank 0 and the --check verdict: 0, or 2 when the loss did not halve. */
static inline int mlp_cli_report(const char *prog, const mlp_cli *c, float first, float last,
                                 int steps, double rate, int world, const sg_memory_stats *mem,
                                 const sg_memory_stats *ddp, int skipped) {
  const int lower = last <= first;
  printf(
      "loss %.4g -> %.4g (%.1fx %s) in %d steps, %.1f steps/s, %s, W=%d, %.3f MiB/rank "
      "vs %.3f MiB NO_SHARD%s\n",
      (double)first, (double)last, lower ? (double)(first / last) : (double)(last / first),
      lower ? "lower" : "higher", steps, rate,
      mlp_cli_strategy_name(c->strategy), world, mlp_cli_mib(mem->total_bytes),
      mlp_cli_mib(ddp->total_bytes), skipped ? " (some steps skipped)" : "");
  if (c->check && !(last < 0.5f * first)) {
    fprintf(stderr, "%s: --check failed: final loss %g is not below 0.5 x first loss %g\n", prog,
            (double)last, (double)first);
    return 2;
  }
  return 0;
}

/* ---- --trace ------------------------------------------------------------------------------- */

/* Called at the top of every step: tracing starts after the first step (warm-up: first-touch
 * page faults, cuBLAS handles) and every micro-batch is opened by a mark. */
static inline sg_status mlp_cli_trace_step(const mlp_cli *c, sg_engine *e, int step, int start) {
  if (!c->trace || step <= start) return SG_OK;
  return step == start + 1 ? sg_trace_start(e, 1u << 20) : SG_OK;
}

static inline sg_status mlp_cli_trace_micro(const mlp_cli *c, sg_engine *e, int step, int start) {
  return c->trace && step > start ? sg_trace_mark(e, "micro-batch") : SG_OK;
}

/* Per-step averages of a trace: a reduction is hidden for the part of it that ran before the
 * last gradient of its micro-batch was ready (the backward pass was still computing), exposed
 * for the rest. Micro-batches are delimited by the marks and the steps. The all-gathers are
 * exposed for as long as the caller's queue waited for them (WAIT events: at the end of
 * sg_step, or in sg_param_wait with overlap_param_gather) and hidden for the rest, behind the
 * AdamW of other buckets or the forward pass. */
typedef struct mlp_trace_sums {
  double reduce, hidden, step, gather, gather_wait;
  int steps, reductions;
} mlp_trace_sums;

static inline double mlp_trace_last_ready(const sg_trace_event *ev, size_t n, size_t i) {
  double t = -1.0;
  for (size_t j = i; j-- > 0 && ev[j].kind != SG_TRACE_MARK && ev[j].kind != SG_TRACE_STEP;)
    if (ev[j].kind == SG_TRACE_GRAD_READY && ev[j].start_us > t) t = ev[j].start_us;
  for (size_t j = i + 1; j < n && ev[j].kind != SG_TRACE_MARK && ev[j].kind != SG_TRACE_STEP; j++)
    if (ev[j].kind == SG_TRACE_GRAD_READY && ev[j].start_us > t) t = ev[j].start_us;
  return t;
}

static inline mlp_trace_sums mlp_trace_sum(const sg_trace_event *ev, size_t n) {
  mlp_trace_sums s = {0};
  for (size_t i = 0; i < n; i++) {
    const double d = ev[i].end_us - ev[i].start_us;
    if (ev[i].kind == SG_TRACE_STEP) {
      s.step += d;
      s.steps++;
    } else if (ev[i].kind == SG_TRACE_GATHER) {
      s.gather += d;
    } else if (ev[i].kind == SG_TRACE_WAIT) {
      s.gather_wait += d;
    } else if (ev[i].kind == SG_TRACE_REDUCE) {
      const double ready = mlp_trace_last_ready(ev, n, i);
      s.reduce += d;
      s.reductions++;
      if (ready > ev[i].start_us)
        s.hidden += (ready < ev[i].end_us ? ready : ev[i].end_us) - ev[i].start_us;
    }
  }
  return s;
}

/* Writes the trace file and prints rank 0's summary line; 0 when there is none to write. */
static inline sg_status mlp_cli_trace_finish(const mlp_cli *c, sg_engine *e, int rank) {
  if (!c->trace) return SG_OK;
  size_t n = 0;
  uint64_t dropped = 0;
  sg_status st = sg_trace_events(e, NULL, 0, &n, &dropped);
  if (st == SG_ERR_INVALID_STATE) return SG_OK; /* fewer than two steps: nothing traced */
  if (st != SG_OK) return st;
  sg_trace_event *ev = calloc(n ? n : 1, sizeof *ev);
  if (!ev) return SG_ERR_OUT_OF_MEMORY;
  if ((st = sg_trace_events(e, ev, n, &n, &dropped)) == SG_OK) st = sg_trace_write(e, c->trace);
  const mlp_trace_sums s = mlp_trace_sum(ev, n);
  free(ev);
  if (st != SG_OK || rank != 0 || s.steps == 0) return st;
  const double k = 1e-3 / s.steps; /* us in all -> ms per step */
  const double ghid = s.gather > s.gather_wait ? s.gather - s.gather_wait : 0.0;
  printf("trace: %d steps, %d reductions: %.3f ms/step reducing, %.0f%% of it hidden behind the "
         "backward pass (%.3f ms/step exposed); step %.3f ms; %llu events dropped; written to "
         "%s\n", s.steps, s.reductions, s.reduce * k,
         s.reduce > 0 ? 100.0 * s.hidden / s.reduce : 0.0, (s.reduce - s.hidden) * k, s.step * k,
         (unsigned long long)dropped, c->trace);
  printf("trace: all-gather %.3f ms/step, %.0f%% of it hidden behind AdamW%s (%.3f ms/step "
         "exposed)\n", s.gather * k, s.gather > 0 ? 100.0 * ghid / s.gather : 0.0,
         c->overlap_gather ? " and the forward pass" : "", s.gather_wait * k);
  return SG_OK;
}

/* ---- command line -------------------------------------------------------------------------- */

static inline int mlp_cli_parse_int(const char *s, int lo, int hi, int *out) {
  char *end = NULL;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

/* An integer flag of a program's command line: its name, its range and where it goes. */
typedef struct mlp_cli_int_flag {
  const char *name;
  int lo, hi;
  int *out;
} mlp_cli_int_flag;

/* 1 when `flag` is one of flags[0..n), its value v parsed into place (*bad = 1 when v is not a
 * whole number in its range); 0 when it is none of them. */
static inline int mlp_cli_int_flags(const mlp_cli_int_flag *flags, int n, const char *flag,
                                    const char *v, int *bad) {
  for (int k = 0; k < n; k++)
    if (!strcmp(flag, flags[k].name)) {
      *bad = mlp_cli_parse_int(v, flags[k].lo, flags[k].hi, flags[k].out) != 0;
      return 1;
    }
  return 0;
}

static inline int mlp_cli_parse_num(const char *s, double lo, double *out) {
  char *end = NULL;
  errno = 0;
  const double v = strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo)) return -1;
  *out = v;
  return 0;
}

static inline int mlp_cli_parse_enum(const char *s, const char *const *names, int n, int *out) {
  for (int i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = i;
      return 0;
    }
  return -1;
}

/* A common value flag; 1 when `flag` is not one of them. */
static inline int mlp_cli_common_value(const mlp_cli_prog *p, mlp_cli *c, const char *flag,
                                       const char *v, int *bad) {
  static const char *const strategies[] = {"no_shard", "shard_opt", "shard_grad_op"};
  static const char *const dtypes[] = {"f32", "bf16", "f16"};
  double d = 0.0;
  int i = 0, rc = 0;
  if (!strcmp(flag, "--strategy")) {
    rc = mlp_cli_parse_enum(v, strategies, 3, &i);
    c->strategy = (sg_strategy)i;
  } else if (!strcmp(flag, "--dtype")) {
    rc = mlp_cli_parse_enum(v, dtypes, p->n_dtypes, &i);
    c->dtype = (sg_dtype)i;
  } else if (!strcmp(flag, "--ranks"))
    rc = mlp_cli_parse_int(v, 1, p->max_ranks, &c->ranks);
  else if (!strcmp(flag, "--steps"))
    rc = mlp_cli_parse_int(v, 1, 100000000, &c->steps);
  else if (!strcmp(flag, "--micro-batches"))
    rc = mlp_cli_parse_int(v, 1, 1000000, &c->micro);
  else if (!strcmp(flag, "--batch"))
    rc = mlp_cli_parse_int(v, 1, 1 << 20, &c->batch);
  else if (!strcmp(flag, "--hidden"))
    rc = mlp_cli_parse_int(v, 1, 1 << 16, &c->hidden);
  else if (!strcmp(flag, "--layers"))
    rc = mlp_cli_parse_int(v, 1, MLP_MAX_LAYERS, &c->layers);
  else if (!strcmp(flag, "--log-every"))
    rc = mlp_cli_parse_int(v, 1, 1 << 30, &c->log_every);
  else if (!strcmp(flag, "--bucket-mb"))
    rc = mlp_cli_parse_num(v, 1e-6, &c->bucket_mb);
  else if (!strcmp(flag, "--lr")) {
    rc = mlp_cli_parse_num(v, 0.0, &d);
    c->lr = (float)d;
  } else if (!strcmp(flag, "--clip")) {
    rc = mlp_cli_parse_num(v, 0.0, &d);
    c->clip = (float)d;
  } else if (!strcmp(flag, "--seed")) {
    rc = mlp_cli_parse_num(v, 0.0, &d);
    c->seed = (uint64_t)d;
  } else if (!strcmp(flag, "--trace"))
    c->trace = v;
  else
    return 1;
  *bad = rc != 0;
  return 0;
}

/* The defaults of the common options. --lr left out follows --hidden (mlp_cli_default_lr). */
static inline mlp_cli mlp_cli_defaults(void) {
  return (mlp_cli){.strategy = SG_SHARD_GRAD_OP,
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
}

/* 3e-3 up to --hidden 128, then 3e-3 x 128 / hidden: Adam's step moves every weight by about
 * lr, so the change of a layer's output grows with its width; at 16 x 1024 the fixed 3e-3 made
 * the loss rise (0.81 -> 2.0 in 12 steps), 3.75e-4 makes it fall. */
static inline float mlp_cli_default_lr(int hidden) {
  return hidden <= 128 ? 3e-3f : 3e-3f * 128.0f / (float)hidden;
}

#define MLP_CLI_STR_(x) #x
#define MLP_CLI_STR(x) MLP_CLI_STR_(x)

/* What each common value flag expects, for the messages (--ranks and --dtype: see below). */
static const char *const mlp_cli_common_values[] = {
    "--strategy", "no_shard, shard_opt or shard_grad_op", "--dtype", "f32, bf16 or f16",
    "--ranks", "a number of ranks >= 1", "--steps", "an integer in 1..100000000",
    "--micro-batches", "an integer in 1..1000000", "--batch", "an integer in 1..1048576",
    "--hidden", "an integer in 1..65536", "--layers", "an integer in 1.." MLP_CLI_STR(MLP_MAX_LAYERS),
    "--log-every", "an integer >= 1", "--bucket-mb", "a size in MiB > 0",
    "--lr", "a number >= 0", "--clip", "a number >= 0 (0: no clipping)",
    "--seed", "an integer >= 0", "--trace", "a file name (%r: the rank)", NULL};

/* What value flag `flag` expects (in buf when it depends on the program), or NULL when it is
 * not one. */
static inline const char *mlp_cli_expects(const mlp_cli_prog *p, const char *flag, char *buf,
                                          size_t n) {
  if (!strcmp(flag, "--ranks")) {
    snprintf(buf, n, "an integer in 1..%d", p->max_ranks);
    return buf;
  }
  if (!strcmp(flag, "--dtype")) return mlp_cli_dtypes(p);
  for (const char *const *f = mlp_cli_common_values; *f; f += 2)
    if (!strcmp(*f, flag)) return f[1];
  for (const char *const *f = p->value_flags; f && *f; f += 2)
    if (!strcmp(*f, flag)) return f[1];
  return NULL;
}

/* The common flags for --help, with their defaults (from mlp_cli_defaults). */
static inline void mlp_cli_help_common(FILE *out, const mlp_cli_prog *p) {
  const mlp_cli d = mlp_cli_defaults();
  fprintf(out,
          "  --strategy S        no_shard (plain data parallel), shard_opt (ZeRO-1) or\n"
          "                      shard_grad_op (ZeRO-2) (default %s)\n"
          "  --ranks N           ranks as threads of this process, 1..%d (default %d)\n"
          "  --dtype D           working parameters and gradients: %s (default %s)\n"
          "  --steps N           optimizer steps (default %d)\n"
          "  --micro-batches N   micro-batches per step, gradients summed (default %d)\n"
          "  --batch N           samples per rank per micro-batch (default %d)\n"
          "  --hidden N          width of every layer (default %d)\n"
          "  --layers N          linear layers, 1..%d (default %d)\n"
          "  --bucket-mb X       gradient bucket size in MiB (default %g)\n"
          "  --lr X              AdamW learning rate (default %g up to --hidden 128, then\n"
          "                      %g x 128 / hidden: wider layers need a smaller one)\n"
          "  --clip X            clip the global gradient norm to X, 0: off (default %g)\n"
          "  --seed N            seed of the model and the data (default %llu)\n"
          "  --log-every N       print every N steps (default %d; first and last always)\n"
          "  --check             exit 2 unless the final loss is below half the first\n"
          "  --trace FILE        Chrome trace of the steps after the first, per rank (%%r: the\n"
          "                      rank), and a summary of the overlap\n"
          "  --overlap-gather    sg_step returns before the parameters are gathered; each layer\n"
          "                      of the next forward pass waits for its own (sg_param_wait)\n"
          "  --offload           master weights, Adam moments and gradient accumulator in pinned\n"
          "                      host memory, AdamW on the CPU (offload_optimizer; needs\n"
          "                      shard_grad_op or shard_opt; on the CPU device it changes nothing)\n"
          "  --help              this text\n",
          mlp_cli_strategy_flag(d.strategy), p->max_ranks, d.ranks, mlp_cli_dtypes(p),
          mlp_cli_dtype_name(d.dtype), d.steps, d.micro, d.batch, d.hidden, MLP_MAX_LAYERS,
          d.layers, d.bucket_mb, (double)d.lr, (double)d.lr, (double)d.clip,
          (unsigned long long)d.seed, d.log_every);
}

/* Sets the defaults, then reads argv into c (common flags) and opts (the program's, through p).
 * --help prints the usage to stdout and exits 0; 0 on success, -1 after a one-line message on
 * stderr for a bad argument. */
static inline int mlp_cli_parse(const mlp_cli_prog *p, int argc, char **argv, mlp_cli *c,
                                void *opts) {
  *c = mlp_cli_defaults();
  for (int i = 1; i < argc; i++) {
    char buf[64];
    const char *a = argv[i], *expects = mlp_cli_expects(p, a, buf, sizeof buf);
    if (p->switch_flag(opts, a))
      continue;
    else if (!strcmp(a, "--check"))
      c->check = 1;
    else if (!strcmp(a, "--overlap-gather"))
      c->overlap_gather = 1;
    else if (!strcmp(a, "--offload"))
      c->offload = 1;
    else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      p->usage();
      exit(0);
    } else if (expects && i + 1 >= argc) {
      fprintf(stderr, "%s: %s needs a value (%s); %s --help lists the flags\n", p->name, a,
              expects, p->name);
      return -1;
    } else if (expects) {
      const char *v = argv[++i];
      int bad = 0;
      if (mlp_cli_common_value(p, c, a, v, &bad) && !p->value_flag(opts, a, v, &bad)) bad = 1;
      if (bad) {
        fprintf(stderr, "%s: bad value for %s: '%s' (expected %s)\n", p->name, a, v, expects);
        return -1;
      }
      c->ranks_given |= !strcmp(a, "--ranks");
      c->lr_given |= !strcmp(a, "--lr");
    } else {
      fprintf(stderr, "%s: unknown argument '%s'; %s --help lists the flags\n", p->name, a,
              p->name);
      return -1;
    }
  }
  if (!c->lr_given) c->lr = mlp_cli_default_lr(c->hidden);
  if (c->offload && c->strategy == SG_NO_SHARD) {
    fprintf(stderr, "%s: --offload needs --strategy shard_grad_op or shard_opt (no_shard keeps "
            "the whole optimizer state on every rank)\n", p->name);
    return -1;
  }
  return 0;
}

/* ---- launched by mpirun / srun ------------------------------------------------------------- */

/* When this process was started by an MPI launcher, the launcher's name and the number of
 * processes it started (0: unknown); NULL when not. From the launchers' environment variables. */
static inline const char *mlp_cli_launcher(int *nprocs) {
  static const char *const vars[][3] = {
      {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"},
      {"PMI_SIZE", "PMI_SIZE", "an MPI launcher (PMI_SIZE; MPICH, Intel MPI)"},
      {"PMIX_RANK", "PMIX_SIZE", "a PMIx launcher (PMIX_RANK)"},
      {"SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "srun (SLURM_STEP_ID)"},
  };
  for (size_t k = 0; k < sizeof vars / sizeof vars[0]; k++) {
    if (!getenv(vars[k][0])) continue;
    const char *n = getenv(vars[k][1]);
    *nprocs = n ? atoi(n) : 0;
    return vars[k][2];
  }
  *nprocs = 0;
  return NULL;
}

/* ---- progress --------------------------------------------------------------------------------- */

/* "1h02m", "3m05s", "12s": the time left at the average step time so far. */
static inline const char *mlp_cli_eta(double elapsed_s, int done, int total, char *buf,
                                      size_t n) {
  const double left = done > 0 ? elapsed_s / done * (total - done) : 0.0;
  const long s = (long)(left + 0.5);
  if (s >= 3600)
    snprintf(buf, n, "%ldh%02ldm", s / 3600, s / 60 % 60);
  else if (s >= 60)
    snprintf(buf, n, "%ldm%02lds", s / 60, s % 60);
  else
    snprintf(buf, n, "%lds", s);
  return buf;
}

/* 1 when rank 0 should draw a progress bar: stdout is a terminal, and not one an MPI launcher
 * made (Open MPI hands its processes a pseudo-terminal). */
static inline int mlp_cli_want_bar(int rank) {
  int n = 0;
  return rank == 0 && isatty(STDOUT_FILENO) && !mlp_cli_launcher(&n);
}

/* A progress bar on one terminal line, redrawn in place at most 10 times a second (the caller
 * clears it before printing a line of its own, with mlp_cli_bar_clear). */
static inline void mlp_cli_bar(int tty, int done, int total, double elapsed_s) {
  static double drawn_at = -1.0;
  if (!tty || total <= 0 || (elapsed_s - drawn_at < 0.1 && drawn_at >= 0.0)) return;
  drawn_at = elapsed_s;
  char eta[32], bar[41];
  const int w = 40, fill = (int)((long long)w * done / total);
  for (int i = 0; i < w; i++) bar[i] = i < fill ? '#' : '.';
  bar[w] = 0;
  printf("\r[%s] %d/%d  eta %s", bar, done, total, mlp_cli_eta(elapsed_s, done, total, eta, sizeof eta));
  fflush(stdout);
}

static inline void mlp_cli_bar_clear(int tty) {
  if (tty) printf("\r\033[K");
}

/* ---- ranks as threads ---------------------------------------------------------------------- */

/* `ranks` threads running train over a local communicator, all on `gpu`; the worst rank's rc
 * (1 when the threads could not all start). */
static inline int mlp_cli_run_threads(const char *prog, const void *o, int ranks, int gpu,
                                      void *(*train)(void *)) {
  sg_comm **comms = calloc((size_t)ranks, sizeof *comms);
  mlp_rank_run *runs = calloc((size_t)ranks, sizeof *runs);
  pthread_t *th = calloc((size_t)ranks, sizeof *th);
  int rc = 1, started = 0;
  if (!comms || !runs || !th) {
    fprintf(stderr, "%s: out of memory for %d ranks\n", prog, ranks);
    goto done;
  }
  const sg_status st = sg_comm_create_local(ranks, comms);
  if (st != SG_OK) {
    mlp_cli_failed(prog, 0, "sg_comm_create_local", st);
    goto done;
  }
  for (; started < ranks; started++) {
    runs[started] = (mlp_rank_run){.o = o, .comm = comms[started], .gpu = gpu};
    if (pthread_create(&th[started], NULL, train, &runs[started]) != 0) break;
  }
  rc = started == ranks ? 0 : 1;
  if (rc) /* the started ranks fail their first collective after the engine's timeout_ms */
    fprintf(stderr, "%s: could not start the thread of rank %d of %d\n", prog, started, ranks);
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    if (runs[i].rc > rc) rc = runs[i].rc;
  }
  for (int i = 0; i < ranks; i++) sg_comm_destroy(comms[i]);
done:
  free(comms);
  free(runs);
  free(th);
  return rc;
}

#endif
