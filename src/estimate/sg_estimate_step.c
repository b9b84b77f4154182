/* The step-time model (sg_estimate_step, docs/planner.md): the collectives the engine issues for a
 * plan, each costed with a linear alpha-beta model per link level, played through the engine's
 * queues (the backward pass handing buckets to the comm queue, the update and the gathers after
 * the norm). What the strategy does is read from its ops table (sharded or not, staging pool or
 * full buffer, offloaded state), never from cfg.strategy. */
#include <stdlib.h> /* malloc, free */
#include <string.h> /* memcpy, memset */

#include "../core/sg_core.h"        /* sg__err, sg__config_copy, sg__dtype_size */
#include "../engine/policy/sg_replica_policy.h" /* sg__replica_codec_region */
#include "../engine/sg_strategy.h"  /* sg__strategy_select, sg__strategy_sharded */
#include "../optim/sg_optimizer.h"  /* sg__optim_default: state arrays per element */
#include "../plan/sg_plan.h"        /* sg__plan_build, buckets */

enum { COPY = SG_LEVELS, KINDS }; /* job kinds: the two levels, and host<->device copies */
enum { RS, AG, AR };              /* what sg__comm_count counts (reduce-scatter, ...) */

/* A communicator as the model sees it: w ranks, g of them on each node it spans. */
typedef struct span {
  int w, g;
} span;

/* One collective's cost on this rank. */
typedef struct cost {
  double s[SG_LEVELS];        /* time per level */
  uint64_t link[SG_LEVELS];   /* NODE: bytes this rank sends in its node; NET: its node's link */
  uint64_t bus;               /* what the communicator's counter adds */
} cost;

/* A span of the comm queue, for attributing the compute queue's waits to what it waited for. */
typedef struct job {
  double start, end;
  int kind;
  double s[SG_LEVELS];        /* the collective's time at each level (both run at once) */
  double waited;              /* of it, the time the compute queue waited for it */
  double stolen;              /* what it took from the compute queue's work beside it */
} job;

typedef struct model {
  const sg_hardware *hw;
  const sg_config *cfg;
  const sg__strategy_ops *st;
  const sg__plan *p;
  int W, L, N, rpn;           /* world, shard ranks, replicas, ranks per node (<= W) */
  int hybrid;                 /* cfg->shard_ranks set: a replica stage, even of one replica (its
                                 all-reduces over one rank move nothing but are issued) */
  int codec_bits;             /* cfg->replica_codec: 8 or 4; 0 none */
  int outer_first;            /* outer steps: the first bucket the modelled step syncs (-1:
                                 none), then every outer_stride-th (1: all; streaming: H) */
  int outer_stride;
  span shard, replica;
  int nstaging;               /* staging buffers (0: a full gradient buffer) */
  double per_elem_s;          /* norm + update time per shard element */
  job *jobs;                  /* the comm queue's jobs that may still end after the compute
                                 queue's present (older ones are dropped) */
  size_t njobs, cap;
  size_t live;                /* jobs before it ended before the compute queue's present */
  double comm_free;           /* when the comm queue is next idle */
  sg_step_estimate *out;
} model;

/* ---------------------------------------------------------------------------------------- */
/* one collective                                                                            */

/* Bus bytes exactly as sg__comm_count adds them (integer division per collective). */
static uint64_t bus_bytes(int op, int w, uint64_t b) {
  const uint64_t n = (uint64_t)w;
  return op == AR ? 2u * (n - 1u) * b / n : (n - 1u) * b / n;
}

/* Bytes per level of one pass (a reduce-scatter or an all-gather) of S bytes over sp: the host
 * algorithm sends S/w to every peer (at two ranks the ring does the same), so a node's link
 * carries what each of its ranks sends to the other nodes; the ring sends S/w per step to its
 * neighbour, and only the last rank of a node's run crosses. */
static void pass_bytes(const model *m, span sp, double S, double bytes[SG_LEVELS]) {
  const double w = sp.w, g = sp.g, ranks = m->rpn < m->W ? m->rpn : m->W;
  if (m->hw->algorithm == SG_ALGO_RING) {
    bytes[SG_LEVEL_NODE] = sp.g > 1 ? (w - 1) / w * S : 0;
    bytes[SG_LEVEL_NET] = sp.w > sp.g ? ranks / g * (w - 1) / w * S : 0;
    return;
  }
  bytes[SG_LEVEL_NODE] = (g - 1) / w * S;
  bytes[SG_LEVEL_NET] = ranks * (w - g) / w * S;
}

/* Message steps of one pass: the host algorithm sends everything at once; a ring w - 1 hops. */
static double pass_steps(const model *m, span sp) {
  return m->hw->algorithm == SG_ALGO_RING ? sp.w - 1 : 1;
}

/* rate: what a node's link carries each way for this collective. */
static cost coll_cost_at(const model *m, int op, span sp, uint64_t S, double net_rate) {
  cost c;
  memset(&c, 0, sizeof c);
  c.bus = bus_bytes(op, sp.w, S);
  if (sp.w < 2) return c;
  const double passes = op == AR ? 2 : 1;
  double bytes[SG_LEVELS];
  pass_bytes(m, sp, (double)S, bytes);
  for (int l = 0; l < SG_LEVELS; l++) {
    if (bytes[l] <= 0) continue;
    c.link[l] = (uint64_t)(passes * bytes[l]);
    c.s[l] = passes * (pass_steps(m, sp) * m->hw->link_latency_s[l] +
                       bytes[l] / (l == SG_LEVEL_NET ? net_rate : m->hw->link_bytes_per_s[l]));
  }
  return c;
}

static cost coll_cost(const model *m, int op, span sp, uint64_t S) {
  return coll_cost_at(m, op, sp, S, m->hw->link_bytes_per_s[SG_LEVEL_NET]);
}

/* A hybrid engine's sums behind the buckets' reductions: each rank of a node sums its slice
 * with its counterparts as a flow of its own, and the node's ranks meet in every bucket's
 * reduction, so the link runs at one flow's rate whenever their sums end apart. Where the probe
 * measured that (replica_bytes_per_s), the sums run at its rate. */
static cost sum_cost(const model *m, int op, uint64_t S) {
  const double r = m->hw->replica_bytes_per_s;
  return coll_cost_at(m, op, m->replica, S, r > 0 ? r : m->hw->link_bytes_per_s[SG_LEVEL_NET]);
}

/* The level a collective waits on: the slower one (both run at once). */
static int bound_level(const cost *c) {
  return c->s[SG_LEVEL_NET] > c->s[SG_LEVEL_NODE] ? SG_LEVEL_NET : SG_LEVEL_NODE;
}

static double cost_time(const cost *c) {
  return c->s[bound_level(c)];
}

/* ---------------------------------------------------------------------------------------- */
/* the comm queue                                                                            */

/* Seconds of the compute queue's work a job takes per second of it where they share cores:
 * each level's part of it costs (1 - overlap) of itself. */
static double job_steal(const model *m, const job *j) {
  const double len = j->end - j->start;
  double cpu = 0;
  for (int l = 0; l < SG_LEVELS; l++) cpu += (1 - m->hw->overlap[l]) * j->s[l];
  return len > 0 ? cpu / len : 0;
}

/* What a job took from the compute queue, charged to its levels in proportion to their cost. */
static void settle_job(model *m, const job *j) {
  double cpu = 0;
  for (int l = 0; l < SG_LEVELS; l++) cpu += (1 - m->hw->overlap[l]) * j->s[l];
  if (cpu <= 0 || j->stolen <= 0) return;
  for (int l = 0; l < SG_LEVELS; l++)
    m->out->exposed_s[l] += j->stolen * (1 - m->hw->overlap[l]) * j->s[l] / cpu;
}

/* Drops the jobs that ended by `now`: the compute queue never waits before its present. */
static void forget_jobs(model *m, double now) {
  size_t k = 0;
  while (k < m->njobs && m->jobs[k].end <= now) settle_job(m, &m->jobs[k++]);
  if (k == 0) return;
  memmove(m->jobs, m->jobs + k, (m->njobs - k) * sizeof *m->jobs);
  m->njobs -= k;
  m->live = m->live > k ? m->live - k : 0;
}

static sg_status push_job(model *m, double start, double len, int kind, const double *s) {
  if (m->njobs == m->cap) {
    size_t cap = m->cap ? 2 * m->cap : 256;
    job *j = realloc(m->jobs, cap * sizeof *j);
    if (!j) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_estimate_step: out of host memory");
    m->jobs = j;
    m->cap = cap;
  }
  job *j = &m->jobs[m->njobs++];
  *j = (job){start, start + len, kind, {0, 0}, 0, 0};
  if (s) memcpy(j->s, s, sizeof j->s);
  m->comm_free = start + len;
  return SG_OK;
}

/* A collective submitted at `ready`: queued behind the comm queue's earlier work, counted. */
static sg_status run_coll(model *m, double ready, const cost *c, int replica) {
  for (int l = 0; l < SG_LEVELS; l++) {
    m->out->comm_s[l] += c->s[l];
    m->out->link_bytes[l] += c->link[l];
  }
  if (replica) {
    m->out->replica_bytes += c->bus;
    m->out->replica_collectives++;
  } else {
    m->out->shard_bytes += c->bus;
    m->out->shard_collectives++;
  }
  const double start = ready > m->comm_free ? ready : m->comm_free;
  return push_job(m, start, cost_time(c), bound_level(c), c->s);
}

static sg_status run_copy(model *m, double ready, uint64_t bytes) {
  m->out->copy_bytes += bytes;
  const double start = ready > m->comm_free ? ready : m->comm_free;
  return push_job(m, start, (double)bytes / m->hw->pcie_bytes_per_s, COPY, NULL);
}

/* The compute queue waited from t0 to t1: charged to the comm jobs running meanwhile. */
static void charge_wait(model *m, double t0, double t1) {
  if (t1 <= t0) return;
  double left = t1 - t0;
  for (size_t i = m->njobs; i-- > 0 && left > 0;) {
    job *j = &m->jobs[i];
    if (j->end <= t0) break;
    const double a = j->start > t0 ? j->start : t0, b = j->end < t1 ? j->end : t1;
    if (b <= a) continue;
    const double d = b - a;
    j->waited += d;
    if (j->kind == COPY)
      m->out->copy_s += d;
    else
      m->out->exposed_s[j->kind] += d;
    left -= d;
  }
}

/* The compute queue at t waits for the comm queue to reach `until`. */
static double wait_until(model *m, double t, double until) {
  if (until <= t) return t;
  charge_wait(m, t, until);
  return until;
}

/* `work` seconds of the compute queue's own work (forward, backward, hand-over, updates)
 * started at t; returns when it ends. Beside a comm job it progresses at 1 - job_steal(j) per
 * second (below 0: it loses ground, the job's cost beyond its length paid after it), so a job
 * slows the step only where the compute queue is on its critical path: work that would have
 * waited for the comm queue anyway absorbs what the job takes. */
static double compute_for(model *m, double t, double work) {
  /* the queue runs one job at a time: ends grow with the index, and t never goes back */
  while (m->live < m->njobs && m->jobs[m->live].end <= t) m->live++;
  for (size_t i = m->live; i < m->njobs && work > 0; i++) {
    job *j = &m->jobs[i];
    if (j->start > t) {
      if (j->start - t >= work) break;
      work -= j->start - t;
      t = j->start;
    }
    const double steal = job_steal(m, j), rate = 1 - steal, d = j->end - t;
    if (rate > 0 && d * rate >= work) {
      j->stolen += work / rate - work;
      return t + work / rate;
    }
    j->stolen += d * steal;
    work -= d * rate;
    t = j->end;
  }
  return t + work;
}

/* ---------------------------------------------------------------------------------------- */
/* the step                                                                                  */

static uint64_t slice_numel(const model *m, int b) { return sg__plan_slice_numel(m->p, b); }

static int offloaded(const model *m) { return m->st->place->host; }

static int outer_steps(const model *m) { return m->hybrid && m->cfg->outer_every > 0; }

/* The sums across replicas of an offloaded engine (exact, or a codec's exchange) run at the
 * step, on the host slices; outer steps sync at the period's end (sg_replica_select.c). */
static int at_step(const model *m) { return offloaded(m) && !m->cfg->outer_every; }

/* Bucket b's sum across replicas behind its reduction: the exact all-reduce of the slice in
 * replica_reduce_dtype; a codec's all-to-all and all-gather of the codes (each replica sends
 * each other one code region per stage, sg_replica_codec.c; the encoding and decoding on the
 * host are not modelled); nothing with outer steps (their sync is at the period's end). */
/* A codec's exchange of bucket b's slice, submitted at `ready`: the all-to-all, then the
 * all-gather of the codes. */
static sg_status codec_exchange(model *m, int b, double ready) {
  const uint64_t S = (uint64_t)m->N * sg__replica_codec_region(slice_numel(m, b), m->N,
                                                                 m->codec_bits);
  const cost a2a = sum_cost(m, RS, S), ag = sum_cost(m, AG, S);
  SG_TRY(run_coll(m, ready, &a2a, 1));
  return run_coll(m, m->comm_free, &ag, 1);
}

static sg_status replica_sum(model *m, int b) {
  if (outer_steps(m)) return SG_OK;
  if (m->codec_bits) return codec_exchange(m, b, m->comm_free);
  const uint64_t X = sg__dtype_size(m->cfg->replica_reduce_dtype);
  const cost r = sum_cost(m, AR, slice_numel(m, b) * X);
  return run_coll(m, m->comm_free, &r, 1);
}

/* Bucket b's reduction job: the strategy's collective over the shard communicator, the D2H of
 * the rank's slice when the state is offloaded, and in the last micro-batch of a hybrid step
 * (on the device) the all-reduce of the slice across replicas right behind it. Returns when its
 * slot is free again. */
static sg_status reduce_bucket(model *m, int b, double ready, int last, double *slot_free) {
  const sg__bucket *bk = &m->p->buckets[b];
  const uint64_t R = sg__dtype_size(m->cfg->reduce_dtype);
  const int sharded = sg__strategy_sharded(m->st);
  const cost c = coll_cost(m, sharded ? RS : AR, m->shard, bk->numel * R);
  SG_TRY(run_coll(m, ready, &c, 0));
  if (offloaded(m)) SG_TRY(run_copy(m, m->comm_free, slice_numel(m, b) * R));
  *slot_free = m->comm_free;
  if (last && m->hybrid && !at_step(m)) SG_TRY(replica_sum(m, b));
  return SG_OK;
}

/* How many buckets back the slot of the k-th bucket of a step was last used: its staging
 * buffer (handed out in order: the one of bucket k - nstaging) or its own region of a full
 * buffer (the same bucket of the previous micro-batch). */
static size_t slot_lag(const model *m) {
  return m->nstaging > 0 ? (size_t)m->nstaging : (size_t)m->p->nbuckets;
}

/* When the backward pass may write the k-th bucket: once that earlier reduction freed the slot.
 * freed[] is a ring of slot_lag entries. */
static double slot_ready(const model *m, const double *freed, size_t k) {
  const size_t lag = slot_lag(m);
  return k >= lag ? freed[k % lag] : 0;
}

/* The micro-batches: forward, then the backward pass producing the buckets in plan order in
 * proportion to their elements, each handed to the comm queue once written. */
static sg_status backward_passes(model *m, int M, double *t_out) {
  const int nb = m->p->nbuckets;
  const double fwd = m->hw->compute_s * (1 - m->hw->backward_fraction);
  const double bwd = m->hw->compute_s * m->hw->backward_fraction;
  const double handover = m->hw->handover_s_per_byte * (double)sg__dtype_size(m->cfg->grad_dtype);
  double *freed = malloc(slot_lag(m) * sizeof *freed);
  if (!freed) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_estimate_step: out of host memory");
  double t = 0;
  sg_status st = SG_OK;
  for (int mb = 0; mb < M && st == SG_OK; mb++) {
    forget_jobs(m, t);
    t = compute_for(m, t, fwd);
    for (int b = 0; b < nb && st == SG_OK; b++) {
      const size_t k = (size_t)mb * (size_t)nb + (size_t)b;
      t = wait_until(m, t, slot_ready(m, freed, k));
      t = compute_for(m, t, bwd * (double)m->p->buckets[b].numel / (double)m->p->total_numel +
                                handover * (double)m->p->buckets[b].numel);
      st = reduce_bucket(m, b, t, mb == M - 1, &freed[k % slot_lag(m)]);
    }
  }
  free(freed);
  *t_out = t;
  return st;
}

/* Offloaded hybrid: the sums across replicas run at the step, on the folded host slices (a
 * codec's exchange: its codes made on the host, not modelled). */
static sg_status replica_sums_at_step(model *m, double t) {
  if (!m->hybrid || !at_step(m)) return SG_OK;
  const uint64_t X = sg__dtype_size(m->cfg->replica_reduce_dtype);
  for (int b = 0; b < m->p->nbuckets; b++) {
    const cost r = coll_cost(m, AR, m->replica, slice_numel(m, b) * X);
    SG_TRY(m->codec_bits ? codec_exchange(m, b, t) : run_coll(m, t, &r, 1));
  }
  return SG_OK;
}

/* Norm + update of n shard elements started at t (beside the gathers before it), and its H2D
 * copy under offload (pipelined in chunks with the host update: the slower of the two).
 * Returns when both are done. */
static double update(model *m, double t, uint64_t n) {
  const double upd = (double)n * m->per_elem_s;
  m->out->optim_s += upd;
  const double end = compute_for(m, t, upd);
  if (!offloaded(m)) return end;
  const uint64_t P = sg__dtype_size(m->cfg->param_dtype);
  const double h2d = (double)(n * P) / m->hw->pcie_bytes_per_s;
  m->out->copy_bytes += n * P;
  if (t + h2d <= end) return end;
  m->out->copy_s += t + h2d - end;
  return t + h2d;
}

/* The last step of an outer period (sg_replica_outer.c, sg_step.c), or with streaming any step
 * whose group has buckets (sg_replica_outer_stream.c): once the step's gathers landed, bucket
 * by bucket (all, or the group's) the all-reduce of the rank's pseudo-gradient across the
 * replicas in replica_reduce_dtype (with the int8 codec its exchange, sg_replica_outer_int8.c),
 * each waited for (the host's outer update and coding between them are not modelled), then the
 * node's all-gathers of those buckets' new parameters. */
static sg_status outer_sync(model *m, double *t) {
  if (!outer_steps(m) || m->outer_first < 0) return SG_OK;
  *t = wait_until(m, *t, m->comm_free);
  const uint64_t X = sg__dtype_size(m->cfg->replica_reduce_dtype);
  const int b0 = m->outer_first, db = m->outer_stride;
  for (int b = b0; b < m->p->nbuckets; b += db) {
    const cost r = coll_cost(m, AR, m->replica, slice_numel(m, b) * X);
    SG_TRY(m->codec_bits ? codec_exchange(m, b, *t) : run_coll(m, *t, &r, 1));
    *t = wait_until(m, *t, m->comm_free);
  }
  if (m->L < 2) return SG_OK;
  const uint64_t P = sg__dtype_size(m->cfg->param_dtype);
  for (int b = b0; b < m->p->nbuckets; b += db) {
    const cost c = coll_cost(m, AG, m->shard, m->p->buckets[b].numel * P);
    SG_TRY(run_coll(m, *t, &c, 0));
  }
  return SG_OK;
}

/* sg_step: every reduction waited for, the norm's all-reduce, then bucket by bucket (last
 * first) the update and its all-gather on the comm queue. Returns the step's end. */
static sg_status step(model *m, double t, double *end) {
  SG_TRY(replica_sums_at_step(m, t));
  t = wait_until(m, t, m->comm_free);
  const int sharded = sg__strategy_sharded(m->st);
  /* a replicated strategy's gather is a no-op: no collective */
  const int gathers = sharded && m->L > 1;
  /* sum of squares, non-finite count and the absent flag (f64); a replicated state sums the
   * flag alone, where presence is tracked (no replicas: DESIGN.md section 4) */
  const uint64_t norm_bytes = sharded ? 24 : m->N <= 1 ? 8 : 0;
  if (norm_bytes && m->L > 1) {
    const cost c = coll_cost(m, AR, m->shard, norm_bytes);
    SG_TRY(run_coll(m, t, &c, 0));
    t = wait_until(m, t, m->comm_free);
  }
  const uint64_t P = sg__dtype_size(m->cfg->param_dtype);
  for (int b = m->p->nbuckets - 1; b >= 0; b--) {
    const uint64_t n = sharded ? slice_numel(m, b) : m->p->buckets[b].numel;
    t = update(m, t, n);
    if (gathers) {
      const cost c = coll_cost(m, AG, m->shard, m->p->buckets[b].numel * P);
      SG_TRY(run_coll(m, t, &c, 0));
    }
  }
  SG_TRY(outer_sync(m, &t));
  /* overlap_param_gather: the next forward pass runs beside the gathers (slowed by them as
   * any compute is; what they take from it belongs to this step) */
  const double fwd = m->hw->compute_s * (1 - m->hw->backward_fraction);
  const double next = m->cfg->overlap_param_gather ? compute_for(m, t, fwd) : t;
  const double hidden = m->cfg->overlap_param_gather ? fwd : 0;
  *end = (m->comm_free > next ? m->comm_free : next) - hidden;
  charge_wait(m, next, m->comm_free);
  return SG_OK;
}

/* Bytes the norm and the update move per shard element: the accumulator read by the norm and
 * the update, the state arrays read and written, the master (below-fp32 params) read and
 * written and the working value written, or an fp32 working value (its own master) read and
 * written. */
static uint64_t update_bytes_per_elem(const sg_config *cfg) {
  const uint64_t A = sg__dtype_size(cfg->accum_dtype), P = sg__dtype_size(cfg->param_dtype);
  /* 8-bit state: a code byte read and written per state (the block scales, 4 bytes per 256
   * elements, and the small tensors kept in fp32 are left out) */
  const uint64_t per_state = cfg->optim_state_dtype == SG_Q8 ? 2u : 8u;
  const uint64_t states = per_state * (uint64_t)sg__optim_default()->nstates;
  return 2 * A + states + (P < 4 ? 8 + P : 8);
}

static double per_elem_time(const sg_hardware *hw, const sg_config *cfg, int off) {
  if (off) return 1.0 / hw->host_optim_params_per_s;
  if (hw->optim_params_per_s > 0) return 1.0 / hw->optim_params_per_s;
  return (double)update_bytes_per_elem(cfg) / hw->device_bytes_per_s;
}

/* ---------------------------------------------------------------------------------------- */
/* arguments                                                                                 */

/* What sg_hardware_init writes into `magic` ("SGhwdesc" in ASCII): a description of the right
 * size that never went through sg_hardware_init (stack garbage, memset 0) is refused. */
#define SG__HARDWARE_MAGIC UINT64_C(0x5347687764657363)

sg_status sg_hardware_init(sg_hardware *hw, size_t struct_size) {
  if (!hw) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_hardware_init: hw is NULL");
  if (struct_size != sizeof *hw)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_hardware_init: struct_size %zu, expected %zu",
                   struct_size, sizeof *hw);
  memset(hw, 0, sizeof *hw);
  hw->struct_size = sizeof *hw;
  hw->algorithm = SG_ALGO_HOST;
  for (int l = 0; l < SG_LEVELS; l++) {
    hw->link_bytes_per_s[l] = 0.125e9;
    hw->link_latency_s[l] = 50e-6;
    hw->overlap[l] = 1.0;
  }
  hw->backward_fraction = 2.0 / 3.0;
  hw->device_bytes_per_s = 10e9;
  hw->magic = SG__HARDWARE_MAGIC;
  return SG_OK;
}

static int positive(double x) { return x > 0 && x < 1e300; } /* finite and > 0; not NaN */
static int nonneg(double x) { return x >= 0 && x < 1e300; }

static sg_status check_links(const sg_hardware *hw, const char *fn) {
  static const char *const names[SG_LEVELS] = {"NODE", "NET"};
  for (int l = 0; l < SG_LEVELS; l++) {
    if (!positive(hw->link_bytes_per_s[l]))
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->link_bytes_per_s[SG_LEVEL_%s] must be "
                     "finite and > 0 (got %g)", fn, names[l], hw->link_bytes_per_s[l]);
    if (!nonneg(hw->link_latency_s[l]))
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->link_latency_s[SG_LEVEL_%s] must be "
                     "finite and >= 0 (got %g)", fn, names[l], hw->link_latency_s[l]);
  }
  return SG_OK;
}

static sg_status check_overlap(const sg_hardware *hw, const char *fn) {
  for (int l = 0; l < SG_LEVELS; l++)
    if (!(hw->overlap[l] >= 0 && hw->overlap[l] <= 1))
      return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->overlap[%d] must be in [0, 1] (got %g)",
                     fn, l, hw->overlap[l]);
  return SG_OK;
}

static sg_status check_hw(const sg_hardware *hw, int off, const char *fn) {
  if (!hw) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw is NULL", fn);
  if (hw->struct_size != sizeof *hw)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->struct_size %zu, expected %zu (use "
                   "sg_hardware_init)", fn, hw->struct_size, sizeof *hw);
  if (hw->magic != SG__HARDWARE_MAGIC)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw was never initialised (hw->magic is 0x%llx, "
                   "not sg_hardware_init's): call sg_hardware_init(&hw, sizeof hw) before setting "
                   "its fields", fn, (unsigned long long)hw->magic);
  if (hw->ranks_per_node < 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->ranks_per_node must be >= 0 (got %d)", fn,
                   hw->ranks_per_node);
  if (hw->algorithm != SG_ALGO_HOST && hw->algorithm != SG_ALGO_RING)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->algorithm %d is not SG_ALGO_HOST or "
                   "SG_ALGO_RING", fn, hw->algorithm);
  SG_TRY(check_links(hw, fn));
  SG_TRY(check_overlap(hw, fn));
  if (!nonneg(hw->compute_s) || !nonneg(hw->optim_params_per_s) ||
      !nonneg(hw->handover_s_per_byte) || !nonneg(hw->replica_bytes_per_s))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->compute_s, hw->optim_params_per_s, "
                   "hw->handover_s_per_byte and hw->replica_bytes_per_s must be finite and >= 0 "
                   "(got %g, %g, %g, %g)", fn, hw->compute_s, hw->optim_params_per_s,
                   hw->handover_s_per_byte, hw->replica_bytes_per_s);
  if (!(hw->backward_fraction > 0 && hw->backward_fraction <= 1))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->backward_fraction must be in (0, 1] (got "
                   "%g)", fn, hw->backward_fraction);
  if (hw->optim_params_per_s == 0 && !positive(hw->device_bytes_per_s))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->device_bytes_per_s must be finite and > 0 "
                   "when hw->optim_params_per_s is 0 (got %g)", fn, hw->device_bytes_per_s);
  if (off && (!positive(hw->host_optim_params_per_s) || !positive(hw->pcie_bytes_per_s)))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg offloads the optimizer: "
                   "hw->host_optim_params_per_s and hw->pcie_bytes_per_s must be finite and > 0 "
                   "(got %g, %g)", fn, hw->host_optim_params_per_s, hw->pcie_bytes_per_s);
  return SG_OK;
}

/* The two communicators' spans: the shard's ranks are consecutive, a replica's L apart. */
static sg_status layout(model *m, int world, const char *fn) {
  m->W = world;
  m->L = m->cfg->shard_ranks ? m->cfg->shard_ranks : world;
  if (world % m->L != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world %d is not a multiple of cfg->shard_ranks "
                   "%d", fn, world, m->L);
  if (m->L != world && !sg__strategy_sharded(m->st))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->shard_ranks %d < world %d needs a sharded "
                   "strategy (SG_SHARD_GRAD_OP or SG_SHARD_OPT)", fn, m->L, world);
  m->N = world / m->L;
  m->hybrid = m->cfg->shard_ranks != 0;
  if (m->hybrid && m->N < 2 && (m->cfg->replica_codec != SG_CODEC_NONE || m->cfg->outer_every))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->replica_codec and cfg->outer_every need "
                   "at least 2 replicas (world %d / shard_ranks %d is 1), as engines do", fn,
                   world, m->L);
  const int rpn = m->hw->ranks_per_node ? m->hw->ranks_per_node : 1;
  m->rpn = rpn < world ? rpn : world;
  if (world % m->rpn != 0 || (m->L % m->rpn != 0 && m->rpn % m->L != 0))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: hw->ranks_per_node %d must divide world %d and "
                   "divide or be a multiple of the shard ranks %d", fn, rpn, world, m->L);
  m->shard = (span){m->L, m->L < m->rpn ? m->L : m->rpn};
  const int per = m->rpn > m->L ? m->rpn / m->L : 1;
  m->replica = (span){m->N, per < m->N ? per : m->N};
  return SG_OK;
}

static sg_status check_args(const sg_config *cfg, const size_t *numels, int nparams, int world,
                            int microbatches, sg_step_estimate *out, const char *fn) {
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  if (out->struct_size != sizeof *out)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out->struct_size %zu, expected %zu", fn,
                   out->struct_size, sizeof *out);
  if (!cfg) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
  if (!numels) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: numels is NULL", fn);
  if (nparams < 1)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: nparams must be >= 1 (got %d)", fn, nparams);
  if (world < 1 || world > 4096)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world %d outside 1..4096", fn, world);
  if (microbatches < 1 || microbatches > 1 << 20)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: microbatches %d outside 1..%d", fn,
                   microbatches, 1 << 20);
  return SG_OK;
}

static sg_status build_plan(const sg_config *c, const size_t *numels, int nparams, int L,
                            sg__plan **p, const char *fn) {
  sg__plan_input *in = malloc((size_t)nparams * sizeof *in);
  if (!in) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  for (int i = 0; i < nparams; i++) in[i] = (sg__plan_input){NULL, numels[i], 0};
  const sg_status st =
      sg__plan_build_aligned(in, nparams, L, sg__dtype_size(c->grad_dtype), c->bucket_bytes, 0,
                             sg__strategy_select(c)->place->align, p);
  free(in);
  return st == SG_OK ? st : sg__err_prefix(st, fn);
}

static sg_status run_model(model *m, int microbatches) {
  sg__layout_shape shape;
  memset(&shape, 0, sizeof shape);
  m->st->shape(m->p, m->cfg, &shape);
  m->nstaging = shape.nstaging;
  m->per_elem_s = per_elem_time(m->hw, m->cfg, offloaded(m));
  const uint64_t shard = sg__strategy_sharded(m->st) ? m->p->shard_numel : m->p->total_numel;
  m->out->optim_bytes = shard * update_bytes_per_elem(m->cfg);
  m->out->compute_s = microbatches * m->hw->compute_s;
  m->out->handover_s = microbatches * m->hw->handover_s_per_byte * (double)m->p->total_numel *
                       (double)sg__dtype_size(m->cfg->grad_dtype);
  double t = 0;
  SG_TRY(backward_passes(m, microbatches, &t));
  SG_TRY(step(m, t, &m->out->step_s));
  forget_jobs(m, 1e300); /* what each job took from the compute queue, charged to its level */
  return SG_OK;
}

/* One step through the model: with outer steps, one that syncs the buckets first, first +
 * stride, ... (the period's last one: 0, 1; streaming: a group, g, H) or none (first -1). */
static sg_status estimate_once(model *m, int microbatches, int first, int stride,
                               sg_step_estimate *e) {
  memset(e, 0, sizeof *e);
  e->struct_size = sizeof *e;
  m->out = e;
  m->outer_first = first;
  m->outer_stride = stride;
  m->njobs = 0;
  m->live = 0;
  m->comm_free = 0;
  const sg_status st = run_model(m, microbatches);
  free(m->jobs);
  m->jobs = NULL;
  m->cap = 0;
  return st;
}

/* Outer steps: the times of an optimizer step as the mean over a period of H steps, H - 1 like
 * `inner` and the syncing last one like *e; the byte and collective counts stay the syncing
 * step's (what sg_comm_stats counts across it). */
static void period_mean(sg_step_estimate *e, const sg_step_estimate *inner, int H) {
  const double w = 1.0 / H, v = (H - 1.0) / H;
  e->step_s = w * e->step_s + v * inner->step_s;
  e->compute_s = w * e->compute_s + v * inner->compute_s;
  e->optim_s = w * e->optim_s + v * inner->optim_s;
  e->copy_s = w * e->copy_s + v * inner->copy_s;
  e->handover_s = w * e->handover_s + v * inner->handover_s;
  for (int l = 0; l < SG_LEVELS; l++) {
    e->exposed_s[l] = w * e->exposed_s[l] + v * inner->exposed_s[l];
    e->comm_s[l] = w * e->comm_s[l] + v * inner->comm_s[l];
  }
}

/* acc's times += w x's. */
static void add_times(sg_step_estimate *acc, const sg_step_estimate *x, double w) {
  acc->step_s += w * x->step_s;
  acc->compute_s += w * x->compute_s;
  acc->optim_s += w * x->optim_s;
  acc->copy_s += w * x->copy_s;
  acc->handover_s += w * x->handover_s;
  for (int l = 0; l < SG_LEVELS; l++) {
    acc->exposed_s[l] += w * x->exposed_s[l];
    acc->comm_s[l] += w * x->comm_s[l];
  }
}

/* Streaming outer steps: step k of a period syncs group k - 1 (the buckets b with b mod H =
 * k - 1; none when k > nbuckets). The times are the mean over the period; the byte and
 * collective counts are the period's last step's (group H - 1), what sg_comm_stats counts
 * across that step, as without streaming. */
static sg_status stream_estimate(model *m, int microbatches, sg_step_estimate *out) {
  const int H = m->cfg->outer_every, nb = m->p->nbuckets, G = H < nb ? H : nb;
  const int last = H <= nb ? H - 1 : G; /* G: a step whose group has no bucket */
  sg_step_estimate x, mean;
  memset(&mean, 0, sizeof mean);
  for (int g = 0; g <= G; g++) {
    const double w = (g < G ? 1.0 : (double)(H - G)) / H;
    if (g == G && H == G) break;
    SG_TRY(estimate_once(m, microbatches, g < G ? g : -1, H, &x));
    add_times(&mean, &x, w);
    if (g == last) *out = x;
  }
  mean.struct_size = out->struct_size;
  out->step_s = mean.step_s, out->compute_s = mean.compute_s, out->optim_s = mean.optim_s;
  out->copy_s = mean.copy_s, out->handover_s = mean.handover_s;
  memcpy(out->exposed_s, mean.exposed_s, sizeof mean.exposed_s);
  memcpy(out->comm_s, mean.comm_s, sizeof mean.comm_s);
  return SG_OK;
}

sg_status sg_estimate_step(const sg_config *cfg, const size_t *numels, int nparams, int world,
                           int microbatches, const sg_hardware *hw, sg_step_estimate *out) {
  static const char *fn = "sg_estimate_step";
  SG_TRY(check_args(cfg, numels, nparams, world, microbatches, out, fn));
  sg_config c;
  SG_TRY(sg__config_copy(cfg, &c, fn));
  SG_TRY(sg__config_check(&c, fn));
  model m;
  memset(&m, 0, sizeof m);
  m.cfg = &c;
  m.hw = hw;
  m.st = sg__strategy_select(&c);
  SG_TRY(check_hw(hw, m.st->place->host, fn));
  SG_TRY(layout(&m, world, fn));
  sg__plan *p = NULL;
  SG_TRY(build_plan(&c, numels, nparams, m.L, &p, fn));
  m.p = p;
  m.codec_bits = !m.hybrid ? 0 : c.replica_codec == SG_CODEC_INT8 ? 8
                                : c.replica_codec == SG_CODEC_INT4 ? 4 : 0;
  sg_step_estimate e, inner;
  sg_status st = SG_OK;
  if (outer_steps(&m) && c.outer_streaming) {
    st = stream_estimate(&m, microbatches, &e);
  } else {
    st = estimate_once(&m, microbatches, 0, 1, &e);
    if (st == SG_OK && outer_steps(&m) && c.outer_every > 1) {
      st = estimate_once(&m, microbatches, -1, 1, &inner);
      if (st == SG_OK) period_mean(&e, &inner, c.outer_every);
    }
  }
  sg__plan_free(p);
  if (st == SG_OK) *out = e;
  return st;
}
