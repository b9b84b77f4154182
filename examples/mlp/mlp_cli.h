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

#include "mlp_model.h" /* MLP_MAX_LAYERS */
#include "shardgrad.h"

/* The options both programs accept, with the defaults mlp_cli_parse sets. */
typedef struct mlp_cli {
  sg_strategy strategy;
  sg_dtype dtype;
  int ranks, steps, micro, batch, hidden, layers, check, log_every;
  int overlap_gather; /* --overlap-gather: overlap_param_gather, waits layer by layer */
  double bucket_mb;
  float lr, clip;
  uint64_t seed;
  const char *trace; /* --trace PATH: Chrome trace of the steps after the first (%r: rank) */
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
}

/* The two lines after the program's own first line of the run. */
static inline void mlp_cli_print_memory(const sg_memory_stats *mem, const sg_memory_stats *ddp) {
  printf(
      "memory per rank: %.3f MiB (params %.3f, grads %.3f, master %.3f, optim %.3f, comm %.3f)"
      " vs %.3f MiB with NO_SHARD\n",
      mlp_cli_mib(mem->total_bytes), mlp_cli_mib(mem->params_bytes),
      mlp_cli_mib(mem->grads_bytes), mlp_cli_mib(mem->master_bytes),
      mlp_cli_mib(mem->optim_bytes), mlp_cli_mib(mem->comm_bytes), mlp_cli_mib(ddp->total_bytes));
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

/* Sets the defaults, then reads argv into c (common flags) and opts (the program's, through p).
 * --help prints the usage and exits 0; 0 on success, -1 after a message on a bad argument. */
static inline int mlp_cli_parse(const mlp_cli_prog *p, int argc, char **argv, mlp_cli *c,
                                void *opts) {
  *c = (mlp_cli){.strategy = SG_SHARD_GRAD_OP,
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
    if (p->switch_flag(opts, a))
      continue;
    else if (!strcmp(a, "--check"))
      c->check = 1;
    else if (!strcmp(a, "--overlap-gather"))
      c->overlap_gather = 1;
    else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      p->usage();
      exit(0);
    } else if (!strncmp(a, "--", 2) && i + 1 < argc) {
      const char *v = argv[++i];
      int bad = 0;
      if (mlp_cli_common_value(p, c, a, v, &bad) && !p->value_flag(opts, a, v, &bad))
        bad = 1; /* no such flag: reported as a bad value, as before */
      if (bad) {
        fprintf(stderr, "%s: bad value for %s: '%s'\n", p->name, a, v);
        return -1;
      }
    } else {
      fprintf(stderr, "%s: unknown argument '%s'\n", p->name, a);
      return -1;
    }
  }
  return 0;
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
  if (!comms || !runs || !th) goto done;
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
