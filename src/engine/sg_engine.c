/* Engine lifecycle: create, parameter registration, finalize (the cross-rank agreement check),
 * parameter access, memory reports, destroy. */
#include <math.h>
#include <stddef.h> /* offsetof */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/cpu/sg_cpu_kernels.h" /* host-side dtype conversion */
#include "sg_engine_internal.h"


/* ---------------------------------------------------------------------------------------- */
/* create / destroy                                                                          */

/* The device, and the communicator's channel bound to it (which tells the device how to run
 * its collectives). */
static sg_status make_device(const sg_config *c, sg_comm *comm, sg__device **dev,
                             sg_comm **chan) {
  sg_status st = SG_OK;
  if (c->device == SG_DEVICE_CPU) {
    st = sg__device_cpu_create(comm->rank, 1, dev);
  } else {
#ifdef SG_HAVE_CUDA
    st = sg__device_cuda_create(comm->rank, c->cuda_device, dev);
#else
    return sg__err(SG_ERR_UNSUPPORTED, "sg_engine_create: SG_DEVICE_CUDA requested but shardgrad "
                                       "was built without CUDA");
#endif
  }
  if (st == SG_OK) st = sg__comm_bind(comm, *dev, c->timeout_ms, chan);
  if (st != SG_OK && *dev) {
    (*dev)->ops->destroy(*dev);
    *dev = NULL;
  }
  return st;
}

/* What a flat engine cannot honour yet, refused rather than ignored. */
static sg_status check_flat_options(const sg_config *c, const sg_comm *comm, const char *fn) {
  if (c->replica_codec != SG_CODEC_NONE)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->replica_codec compresses the sum across "
                   "the replicas of a hybrid engine; a flat engine has none (use "
                   "sg_engine_create_hybrid, or SG_CODEC_NONE)", fn);
  if (c->outer_every != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->outer_every synchronises the replicas of a "
                   "hybrid engine every H steps; a flat engine has none (use "
                   "sg_engine_create_hybrid, or 0)", fn);
  if (c->shard_ranks != 0 && c->shard_ranks != comm->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->shard_ranks is %d but the communicator has %d ranks (0 = all)", fn,
                   c->shard_ranks, comm->world);
  if (c->offload_optimizer && c->device == SG_DEVICE_CUDA && !sg__strategy_offloads(c))
    return sg__err(SG_ERR_UNSUPPORTED,
                   "%s: cfg->offload_optimizer needs a sharded strategy (SG_SHARD_GRAD_OP or "
                   "SG_SHARD_OPT); SG_NO_SHARD keeps the whole optimizer state on every rank",
                   fn);
  return SG_OK;
}

/* What both kinds of engine do: the config, the device and the shard communicator's channel;
 * `check` refuses what the kind cannot honour, `replica` (NULL: flat) is bound last. */
static sg_status create(sg_comm *comm, sg_comm *replica, const sg_config *cfg, const char *fn,
                        sg_status (*check)(const sg_config *, const sg_comm *, const char *),
                        sg_engine **out) {
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  if (!cfg) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
  if (comm->broken || (replica && replica->broken))
    return sg__err(SG_ERR_COMM, "%s: the communicator is broken by an earlier failure", fn);
  sg_engine *e = calloc(1, sizeof *e);
  if (!e) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  sg_status st;
  SG_TRY_GOTO(sg__config_copy(cfg, &e->cfg, fn), st, fail);
  SG_TRY_GOTO(sg__config_check(&e->cfg, fn), st, fail);
  SG_TRY_GOTO(check(&e->cfg, comm, fn), st, fail);
  sg__env_report(comm->rank);
  e->strat = sg__strategy_select(&e->cfg);
  if (replica && !sg__strategy_sharded(e->strat)) {
    st = sg__err(SG_ERR_INVALID_ARGUMENT, "%s: strategy %s keeps every gradient and all "
                 "optimizer state on every rank, so there is nothing to shard inside a node; use "
                 "SG_SHARD_GRAD_OP or SG_SHARD_OPT (or sg_engine_create)", fn, e->strat->name);
    goto fail;
  }
  SG_TRY_GOTO(make_device(&e->cfg, comm, &e->dev, &e->comm), st, fail); /* e->comm: a channel */
  e->rank = comm->rank;
  e->world = comm->world;
  e->rep.n = 1;
  if ((st = sg__replicas_attach(e, replica, fn)) != SG_OK) {
    sg__comm_unbind(e->comm);
    e->dev->ops->destroy(e->dev);
    goto fail;
  }
  sg__optim_init(e);
  sg__scale_init(e);
  *out = e;
  SG_LOG(SG_LOG_INFO, e->rank, "engine created: world %d x %d replicas, strategy %s, param %s, "
         "grad %s, reduce %s", e->world, e->rep.n, e->strat->name,
         sg__dtype_name(e->cfg.param_dtype), sg__dtype_name(e->cfg.grad_dtype),
         sg__dtype_name(e->cfg.reduce_dtype));
  return SG_OK;
fail:
  free(e);
  return st;
}

sg_status sg_engine_create(sg_comm *comm, const sg_config *cfg, sg_engine **out) {
  static const char *fn = "sg_engine_create";
  if (out) *out = NULL;
  if (!comm) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is NULL", fn);
  return create(comm, NULL, cfg, fn, check_flat_options, out);
}

/* What a hybrid engine's config must agree with (the communicators' kinds: sg_replica.c). */
static sg_status check_hybrid_options(const sg_config *c, const sg_comm *shard, const char *fn) {
  if (c->shard_ranks != 0 && c->shard_ranks != shard->world)
    return sg__err(SG_ERR_INVALID_ARGUMENT,
                   "%s: cfg->shard_ranks is %d but the shard communicator has %d ranks (0 = its "
                   "size)", fn, c->shard_ranks, shard->world);
  return SG_OK;
}

sg_status sg_engine_create_hybrid(sg_comm *shard, sg_comm *replica, const sg_config *cfg,
                                  sg_engine **out) {
  static const char *fn = "sg_engine_create_hybrid";
  if (out) *out = NULL;
  if (!shard) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: shard is NULL", fn);
  if (!replica) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: replica is NULL", fn);
  if (shard == replica)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: shard and replica are the same communicator "
                   "(split the world with sg_comm_split: color rank / L for the shard, rank %% L "
                   "for the replica)", fn);
  if (shard->parent || replica->parent)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: a communicator of another engine's channel", fn);
  return create(shard, replica, cfg, fn, check_hybrid_options, out);
}

static void free_registration(sg_engine *e) {
  for (int i = 0; i < e->reg.nparams; i++) free(e->reg.names[i]);
  free(e->reg.names);
  sg__names_free(&e->reg.name_index);
  free(e->reg.numels);
  free(e->reg.flags);
  free(e->reg.group);
}

static void free_finalized(sg_engine *e) {
  sg__outcome_free(e);
  sg__replicas_free(e);
  sg__grads_free(e);
  sg__optim_free(e);
  if (e->strat) e->strat->place->free(e);
  sg__gathers_free(e);
  sg__arenas_free(&e->ar);
  sg__plan_free(e->plan);
  e->plan = NULL;
}

void sg_engine_destroy(sg_engine *e) {
  if (!e) return;
  /* Another thread inside a call: freeing the engine under it would crash it; leak instead. */
  sg__guard_scope gs;
  if (sg__guard_enter(&e->guard, "sg_engine_destroy", &gs) != SG_OK) {
    SG_LOG(SG_LOG_WARN, e->rank, "%s; the engine is not destroyed", sg_last_error());
    return;
  }
  /* Pending reductions finish before memory goes away (every collective has its own deadline
   * and jobs after a failure are skipped, so this ends), and the memory goes back through the
   * device before the device itself is destroyed. */
  if (e->dev && e->last_ticket)
    (void)e->dev->ops->comm_wait(e->dev, e->last_ticket, sg__engine_host_deadline(e));
  /* after every queued job (bounded by their deadlines); the replica channel, bound last,
   * first: a device's attachments come off in reverse order */
  sg__replicas_detach(e);
  sg__comm_unbind(e->comm);
  e->comm = NULL;
  sg__trace_free(e);
  free_finalized(e);
  if (e->dev) e->dev->ops->destroy(e->dev); /* joins the comm worker */
  e->dev = NULL;
  free_registration(e);
  free(e);
}

/* ---------------------------------------------------------------------------------------- */
/* registration                                                                              */


static sg_status grow(sg_engine *e) {
  int cap = e->reg.cap ? e->reg.cap * 2 : 64;
  char **n = realloc(e->reg.names, (size_t)cap * sizeof *n);
  if (!n) return SG_ERR_OUT_OF_MEMORY;
  e->reg.names = n;
  size_t *s = realloc(e->reg.numels, (size_t)cap * sizeof *s);
  if (!s) return SG_ERR_OUT_OF_MEMORY;
  e->reg.numels = s;
  uint32_t *f = realloc(e->reg.flags, (size_t)cap * sizeof *f);
  if (!f) return SG_ERR_OUT_OF_MEMORY;
  e->reg.flags = f;
  int *g = realloc(e->reg.group, (size_t)cap * sizeof *g);
  if (!g) return SG_ERR_OUT_OF_MEMORY;
  e->reg.group = g;
  e->reg.cap = cap;
  return SG_OK;
}

sg_status sg_add_param(sg_engine *e, const char *name, size_t numel, uint32_t flags, int *id) {
  SG_ENGINE_GUARD(e, "sg_add_param");
  static const char *fn = "sg_add_param";
  SG_TRY(sg__engine_check(e, fn, 0));
  if (!id) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: id is NULL", fn);
  if (!name) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: name is NULL", fn);
  SG_TRY(sg__name_check(name, fn));
  const size_t len = strlen(name);
  if (numel == 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: numel must be >= 1 (param '%s')", fn, name);
  if (numel > ((size_t)1 << 48))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: numel %zu is too large (param '%s')", fn, numel,
                   name);
  if (flags & ~SG_PARAM_NO_DECAY)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x (param '%s')", fn,
                   (unsigned)flags, name);
  if (e->reg.nparams >= (1 << 30))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: too many parameters", fn);
  const int dup = sg__names_find(&e->reg.name_index, e->reg.names, name);
  if (dup >= 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: parameter '%s' is already registered (id %d)",
                   fn, name, dup);
  if (e->reg.nparams == e->reg.cap && grow(e) != SG_OK)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  char *copy = malloc(len + 1);
  if (!copy) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  memcpy(copy, name, len + 1);
  e->reg.names[e->reg.nparams] = copy;
  if (sg__names_add(&e->reg.name_index, e->reg.names, e->reg.nparams) != SG_OK) {
    free(copy);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  }
  e->reg.numels[e->reg.nparams] = numel;
  e->reg.flags[e->reg.nparams] = flags;
  e->reg.group[e->reg.nparams] = 0;
  *id = e->reg.nparams++;
  return SG_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* finalize                                                                                  */

/* What every rank must agree on, exchanged as 64-bit words: status, parameter count, plan
 * hash, the config words (sg__config_words), then the environment settings that change the
 * wire protocol (sg__env_wire_words). */
enum { SG__AG_STATUS, SG__AG_NPARAMS, SG__AG_HASH, SG__AG_CFG0 };
#define SG__NCFG SG__CONFIG_NWORDS
#define SG__NWIRE 2 /* SG_COLL_ALLGATHER, SG_COLL_REDUCE_SCATTER */
#define SG__AG_WIRE0 (SG__AG_CFG0 + SG__NCFG)
#define SG__AG_WORDS (SG__AG_WIRE0 + SG__NWIRE)

static uint64_t cfg_hash(const sg_config *c) {
  uint64_t w[SG__NCFG];
  sg__config_words(c, w, SG__NCFG);
  return sg__hash_bytes(SG__HASH_INIT, w, sizeof w);
}

static sg_status build_plan(sg_engine *e, sg__plan **out) {
  if (e->reg.nparams == 0)
    return sg__err(SG_ERR_INVALID_STATE, "sg_finalize: no parameters registered");
  sg__plan_input *in = malloc((size_t)e->reg.nparams * sizeof *in);
  if (!in) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  for (int i = 0; i < e->reg.nparams; i++) in[i] = (sg__plan_input){e->reg.names[i], e->reg.numels[i], e->reg.flags[i]};
  sg_status st = sg__plan_build_aligned(in, e->reg.nparams, e->world,
                                        sg__dtype_size(e->cfg.grad_dtype), e->cfg.bucket_bytes,
                                        cfg_hash(&e->cfg), e->strat->place->align, out);
  free(in);
  return st == SG_OK ? st : sg__err_prefix(st, "sg_finalize");
}

/* Names the first parameter that differs between this rank and another. */
static sg_status param_mismatch(sg_engine *e, const uint64_t *all, const sg__plan *p) {
  uint64_t maxn = 0;
  for (int r = 0; r < e->world; r++)
    if (all[r * SG__AG_WORDS + SG__AG_NPARAMS] > maxn) maxn = all[r * SG__AG_WORDS + SG__AG_NPARAMS];
  uint64_t *h = calloc((size_t)maxn * (size_t)e->world, sizeof *h);
  if (!h) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  if (p) memcpy(h + (size_t)e->rank * maxn, p->param_hash, (size_t)e->reg.nparams * sizeof *h);
  sg_status st = sg__engine_allgather_host(e, h, (size_t)maxn * sizeof *h);
  if (st != SG_OK) goto done;
  for (uint64_t i = 0; i < maxn; i++) {
    for (int r = 0; r < e->world; r++) {
      if (h[(size_t)r * maxn + i] == h[i]) continue;
      int other = r == e->rank ? 0 : r;
      if ((int)i < e->reg.nparams)
        st = sg__err(SG_ERR_MISMATCH, "sg_finalize: ranks registered different parameters: "
                     "parameter #%d is '%s' (numel %zu, flags %u, group %d) on rank %d and differs "
                     "on rank %d", (int)i, e->reg.names[i], e->reg.numels[i], (unsigned)e->reg.flags[i],
                     e->reg.group[i], e->rank, other);
      else
        st = sg__err(SG_ERR_MISMATCH, "sg_finalize: ranks registered different parameters: "
                     "rank %d has %d parameters, rank %d has more (first extra is #%d)", e->rank,
                     e->reg.nparams, other, (int)i);
      goto done;
    }
  }
  st = sg__err(SG_ERR_MISMATCH, "sg_finalize: ranks built different plans (same parameters)");
done:
  free(h);
  return st;
}

/* Compares every rank's record with rank 0's and with this rank's. */
static sg_status check_agreement(sg_engine *e, const uint64_t *all, const sg__plan *p) {
  for (int r = 0; r < e->world; r++) {
    uint64_t s = all[r * SG__AG_WORDS + SG__AG_STATUS];
    if (s != SG_OK && r != e->rank)
      return sg__err(SG_ERR_MISMATCH, "sg_finalize: rank %d failed to finalize (%s)", r,
                     sg_status_string((sg_status)s));
  }
  for (int r = 1; r < e->world; r++)
    for (int k = 0; k < SG__NCFG; k++)
      if (all[r * SG__AG_WORDS + SG__AG_CFG0 + k] != all[SG__AG_CFG0 + k])
        return sg__err(SG_ERR_MISMATCH, "sg_finalize: config field %s differs between rank 0 "
                       "and rank %d", sg__config_word_name(k), r);
  const char *wire[SG__NWIRE];
  uint64_t w[SG__NWIRE];
  sg__env_wire_words(w, SG__NWIRE, wire);
  for (int r = 1; r < e->world; r++)
    for (int k = 0; k < SG__NWIRE; k++)
      if (all[r * SG__AG_WORDS + SG__AG_WIRE0 + k] != all[SG__AG_WIRE0 + k])
        return sg__err(SG_ERR_MISMATCH, "sg_finalize: environment setting %s differs between "
                       "rank 0 and rank %d (it changes what ranks send each other: set it alike, "
                       "or leave it unset, on every rank)", wire[k], r);
  for (int r = 0; r < e->world; r++)
    if (all[r * SG__AG_WORDS + SG__AG_HASH] != all[e->rank * SG__AG_WORDS + SG__AG_HASH] ||
        all[r * SG__AG_WORDS + SG__AG_NPARAMS] != (uint64_t)e->reg.nparams)
      return param_mismatch(e, all, p);
  return SG_OK;
}

/* One round of agreement: every rank learns every rank's status (and config, plan hash). */
static sg_status exchange(sg_engine *e, sg_status local, const sg__plan *p, uint64_t **all_out) {
  uint64_t *all = calloc((size_t)e->world * SG__AG_WORDS, sizeof *all);
  if (!all) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  uint64_t *mine = all + (size_t)e->rank * SG__AG_WORDS;
  mine[SG__AG_STATUS] = (uint64_t)local;
  mine[SG__AG_NPARAMS] = (uint64_t)e->reg.nparams;
  mine[SG__AG_HASH] = p ? p->hash : 0;
  sg__config_words(&e->cfg, mine + SG__AG_CFG0, SG__NCFG);
  if (sg__env_wire_words(mine + SG__AG_WIRE0, SG__NWIRE, NULL) != SG__NWIRE) {
    free(all);
    return sg__err(SG_ERR_INTERNAL, "sg_finalize: the wire settings are not %d", SG__NWIRE);
  }
  sg_status st = sg__engine_allgather_host(e, all, SG__AG_WORDS * sizeof *all);
  if (st != SG_OK) {
    free(all);
    return st;
  }
  *all_out = all;
  return SG_OK;
}

/* The layout shape of a config: the strategy's sizes, the optimizer's state count and the
 * replica stage's buffer (replicas: 0 for a flat engine; a hybrid one may have 1). */
static void engine_shape(const sg__strategy_ops *st, const sg__plan *p, const sg_config *cfg,
                         int replicas, sg__layout_shape *out) {
  memset(out, 0, sizeof *out);
  st->shape(p, cfg, out);
  out->nstates = sg__optim_default()->nstates;
  sg__replicas_shape(p, cfg, replicas, out);
}

static sg_status setup_buffers(sg_engine *e) {
  sg__layout *l = &e->lay;
  sg__layout_shape shape;
  engine_shape(e->strat, e->plan, &e->cfg, e->rep.comm ? e->rep.n : 0, &shape); /* 0: flat */
  SG_TRY(sg__layout_compute(e->plan, &e->cfg, &shape, l));
  SG_TRY(sg__arenas_alloc(&e->ar, e->dev, l));
  e->params = (char *)e->ar.base[SG_MEM_PARAMS] + l->params_off;
  char *comm = (char *)e->ar.base[SG_MEM_COMM] + l->comm_off;
  sg__comm_set_scratch(e->comm, comm, l->comm_scratch_bytes);
  e->small = (char *)e->ar.base[SG_MEM_COMM] + l->small_off;
  return SG_OK;
}

/* Mixes each parameter's group into its hash and the plan's, so that ranks must agree on the
 * groups. Group 0 mixes nothing: plans without groups hash as before. */
static void hash_groups(sg_engine *e, sg__plan *p) {
  for (int i = 0; i < e->reg.nparams; i++) {
    if (e->reg.group[i] == 0) continue;
    const uint64_t w[2] = {(uint64_t)i, (uint64_t)e->reg.group[i]};
    p->param_hash[i] = sg__hash_bytes(p->param_hash[i], &w[1], sizeof w[1]);
    p->hash = sg__hash_bytes(p->hash, w, sizeof w);
  }
}

static sg_status finalize_local(sg_engine *e) {
  sg_status st = build_plan(e, &e->plan);
  if (st == SG_OK) hash_groups(e, e->plan);
  if (st == SG_OK) st = setup_buffers(e);
  if (st == SG_OK) st = e->strat->place->init(e);
  if (st == SG_OK) st = sg__optim_bind(e);
  if (st == SG_OK) st = sg__gathers_init(e);
  if (st == SG_OK) st = sg__grads_init(e);
  if (st == SG_OK) st = sg__replicas_init(e);
  if (st == SG_OK) st = sg__outcome_init(e);
  return sg__err_prefix(st, "sg_finalize");
}

sg_status sg_finalize(sg_engine *e) {
  SG_ENGINE_GUARD(e, "sg_finalize");
  static const char *fn = "sg_finalize";
  SG_TRY(sg__engine_check(e, fn, 0));
  /* The comm worker first: a thread that cannot start fails this rank here, and its jobs run
   * inline, so the agreement below still tells every rank at once (not at their timeout). */
  sg_status local = sg__err_prefix(e->dev->ops->comm_start(e->dev), fn);
  if (local == SG_OK) local = finalize_local(e);
  char local_msg[512] = "";
  if (local != SG_OK) snprintf(local_msg, sizeof local_msg, "%s", sg_last_error());
  uint64_t *all = NULL;
  sg_status st = exchange(e, local, e->plan, &all);
  if (st != SG_OK) goto fail;
  if (local != SG_OK) {
    st = sg__replicas_agree(e, sg__err(local, "%s", local_msg));
    goto fail;
  }
  st = check_agreement(e, all, e->plan);
  /* every replica learns every node's verdict (flat: st as it is) */
  SG_TRY_GOTO(sg__replicas_agree(e, st), st, fail);
  free(all);
  e->state = SG_ES_READY;
  sg__grads_reset_microbatch(e);
  sg__trace_auto_start(e);
  SG_LOG(SG_LOG_INFO, e->rank, "finalized: %d params, %d buckets, %zu elements, shard %zu",
         e->reg.nparams, e->plan->nbuckets, e->plan->total_numel, e->lay.opt_numel);
  return SG_OK;
fail:
  free(all);
  free_finalized(e);
  sg__comm_set_scratch(e->comm, NULL, 0);
  return sg__err_prefix(st, fn);
}

/* ---------------------------------------------------------------------------------------- */
/* parameters                                                                                */

static size_t psize(const sg_engine *e) { return sg__dtype_size(e->cfg.param_dtype); }
static char *param_at(const sg_engine *e, int id) {
  return e->params + e->plan->params[id].offset * psize(e);
}

sg_status sg_param_ptr(sg_engine *e, int id, void **ptr) {
  SG_ENGINE_GUARD(e, "sg_param_ptr");
  static const char *fn = "sg_param_ptr";
  SG_TRY(sg__engine_check_param(e, id, ptr, "ptr", fn));
  *ptr = param_at(e, id);
  return SG_OK;
}

sg_status sg__engine_for_pieces(sg_engine *e, int id,
                                sg_status (*f)(sg_engine *, const sg__piece *, void *), void *ctx) {
  const sg__plan_param *pp = &e->plan->params[id];
  sg__owned o;
  e->strat->owned(e->plan, e->rank, pp->bucket, &o);
  const size_t x0 = pp->offset > o.flat0 ? pp->offset : o.flat0;
  const size_t z = pp->offset + pp->numel, x1 = z < o.flat0 + o.n ? z : o.flat0 + o.n;
  if (x0 >= x1) return SG_OK;
  const sg__piece pc = {x0 - pp->offset, o.state0 + (x0 - o.flat0), x1 - x0};
  return f(e, &pc, ctx);
}

static sg_status set_master_piece(sg_engine *e, const sg__piece *pc, void *ctx) {
  const float *src = ctx;
  return e->dev->ops->copy(e->dev, SG_Q_COMPUTE, e->opt.master + pc->opt_off, src + pc->param_off,
                           pc->len * 4, SG_COPY_H2D);
}

/* The checks of sg_set_param (to_host 0) and sg_get_param (to_host 1) on the host buffer and its
 * dtype, then the step settled. */
static sg_status host_param_begin(sg_engine *e, int id, const void *host, int dt, int to_host,
                                  const char *fn) {
  SG_TRY(sg__engine_check_param(e, id, host, to_host ? "host_dst" : "host_src", fn));
  SG_TRY(sg__engine_check_dtype(dt, to_host ? "dst_dtype" : "src_dtype", fn));
  return sg__err_prefix(sg__step_settle(e), fn);
}

sg_status sg_set_param(sg_engine *e, int id, const void *src, sg_dtype src_dtype) {
  SG_ENGINE_GUARD(e, "sg_set_param");
  static const char *fn = "sg_set_param";
  SG_TRY(host_param_begin(e, id, src, src_dtype, 0, fn));
  const size_t n = e->reg.numels[id];
  void *work = malloc(n * psize(e));
  float *f32 = e->opt.master ? malloc(n * 4) : NULL;
  sg_status st = SG_OK;
  if (!work || (e->opt.master && !f32)) {
    st = sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory (param '%s')", fn, e->reg.names[id]);
    goto done;
  }
  sg__cpu_cast(work, e->cfg.param_dtype, src, src_dtype, n);
  SG_TRY_GOTO(e->dev->ops->copy(e->dev, SG_Q_COMPUTE, param_at(e, id), work, n * psize(e),
                                SG_COPY_H2D), st, done);
  if (e->opt.master) {
    sg__cpu_cast(f32, SG_F32, src, src_dtype, n);
    st = sg__engine_for_pieces(e, id, set_master_piece, f32);
  }
done:
  free(work);
  free(f32);
  return st;
}

sg_status sg_get_param(sg_engine *e, int id, void *dst, sg_dtype dst_dtype) {
  SG_ENGINE_GUARD(e, "sg_get_param");
  static const char *fn = "sg_get_param";
  SG_TRY(host_param_begin(e, id, dst, dst_dtype, 1, fn));
  const size_t n = e->reg.numels[id];
  void *work = malloc(n * psize(e));
  if (!work) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  sg_status st = e->dev->ops->copy(e->dev, SG_Q_COMPUTE, work, param_at(e, id), n * psize(e),
                                   SG_COPY_D2H);
  if (st == SG_OK) sg__cpu_cast(dst, dst_dtype, work, e->cfg.param_dtype, n);
  free(work);
  return st;
}

sg_status sg_broadcast_params(sg_engine *e, int root) {
  SG_ENGINE_GUARD(e, "sg_broadcast_params");
  static const char *fn = "sg_broadcast_params";
  SG_TRY(sg__engine_check(e, fn, 1));
  const int w = sg__replicas_world(e); /* global rank: replica x world + shard rank */
  if (root < 0 || root >= w)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: root %d outside 0..%d", fn, root, w - 1);
  SG_TRY(sg__grads_idle(e, fn));
  SG_TRY(e->dev->ops->sync(e->dev, sg__engine_host_deadline(e)));
  SG_TRY(sg__replicas_broadcast_params(e, root / e->world));
  SG_TRY(sg__engine_broadcast(e, e->params, e->plan->total_numel * psize(e), root % e->world));
  return sg__optim_master_from_working(e);
}

sg_status sg_get_master(sg_engine *e, int id, float *dst) {
  SG_ENGINE_GUARD(e, "sg_get_master");
  static const char *fn = "sg_get_master";
  SG_TRY(sg__engine_check_param(e, id, dst, "host_dst", fn));
  SG_TRY(sg__grads_idle(e, fn));
  if (!e->opt.master) return sg_get_param(e, id, dst, SG_F32);
  return sg__err_prefix(e->strat->shard->param_state(e, id, e->opt.master, dst), fn);
}

/* sg_get_optim_state's reader of a state array in fp32 (the placement's view of it). */
struct state_read {
  int id;
  float *dst;
};
static sg_status read_param_state(sg_engine *e, const float *view, void *ctx) {
  const struct state_read *r = ctx;
  return e->strat->shard->param_state(e, r->id, view, r->dst);
}

sg_status sg_get_optim_state(sg_engine *e, int id, int which, float *dst) {
  SG_ENGINE_GUARD(e, "sg_get_optim_state");
  static const char *fn = "sg_get_optim_state";
  SG_TRY(sg__engine_check_param(e, id, dst, "host_dst", fn));
  SG_TRY(sg__optim_check_state(e, which, fn));
  SG_TRY(sg__grads_idle(e, fn));
  struct state_read r = {id, dst};
  return sg__err_prefix(e->strat->place->read_state(e, which, id, read_param_state, &r), fn);
}

/* ---------------------------------------------------------------------------------------- */
/* memory                                                                                    */

static sg_status check_stats(sg_memory_stats *out, const char *fn) {
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  /* 0.2's layout ended before host_bytes; both are published. */
  if (out->struct_size != sizeof(sg_memory_stats) &&
      out->struct_size != offsetof(sg_memory_stats, host_bytes))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out->struct_size %zu, expected %zu (or 0.2's %zu)",
                   fn, out->struct_size, sizeof(sg_memory_stats),
                   offsetof(sg_memory_stats, host_bytes));
  return SG_OK;
}

sg_status sg_memory(sg_engine *e, sg_memory_stats *out) {
  SG_ENGINE_GUARD(e, "sg_memory");
  static const char *fn = "sg_memory";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  SG_TRY(check_stats(out, fn));
  if (!e->plan) return sg__err(SG_ERR_INVALID_STATE, "%s: call sg_finalize first", fn);
  sg_memory_stats s = {0};
  sg__memory_stats_fill(e->plan, &e->lay, e->ar.extra_grads, e->ar.peak, &s);
  s.struct_size = out->struct_size;
  memcpy(out, &s, out->struct_size);
  return SG_OK;
}

sg_status sg_estimate_memory(const sg_config *cfg, const size_t *numels, int nparams, int world,
                             sg_memory_stats *out) {
  static const char *fn = "sg_estimate_memory";
  SG_TRY(check_stats(out, fn));
  if (!cfg) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
  if (!numels) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: numels is NULL", fn);
  if (nparams < 1) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: nparams must be >= 1", fn);
  if (world < 1 || world > 4096)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world %d outside 1..4096", fn, world);
  sg_config c;
  SG_TRY(sg__config_copy(cfg, &c, fn));
  SG_TRY(sg__config_check(&c, fn));
  /* a hybrid layout: shard groups of shard_ranks ranks, world / shard_ranks replicas */
  const int L = c.shard_ranks ? c.shard_ranks : world;
  if (world % L != 0)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: world %d is not a multiple of cfg->shard_ranks "
                   "%d", fn, world, L);
  if (L != world && !sg__strategy_sharded(sg__strategy_select(&c)))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: cfg->shard_ranks %d < world %d needs a sharded "
                   "strategy (SG_SHARD_GRAD_OP or SG_SHARD_OPT)", fn, L, world);
  sg__plan_input *in = malloc((size_t)nparams * sizeof *in);
  if (!in) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  for (int i = 0; i < nparams; i++) in[i] = (sg__plan_input){NULL, numels[i], 0};
  sg__plan *p = NULL;
  sg_status st = sg__plan_build_aligned(in, nparams, L, sg__dtype_size(c.grad_dtype),
                                        c.bucket_bytes, 0, sg__strategy_select(&c)->place->align,
                                        &p);
  free(in);
  if (st != SG_OK) return sg__err_prefix(st, fn);
  sg__layout l;
  sg__layout_shape shape;
  engine_shape(sg__strategy_select(&c), p, &c, c.shard_ranks ? world / L : 0, &shape);
  st = sg__layout_compute(p, &c, &shape, &l);
  if (st == SG_OK) {
    sg_memory_stats s = {0};
    sg__memory_stats_fill(p, &l, 0, 0, &s);
    s.struct_size = out->struct_size;
    memcpy(out, &s, out->struct_size);
  }
  sg__plan_free(p);
  return st == SG_OK ? st : sg__err_prefix(st, fn);
}

/* ---------------------------------------------------------------------------------------- */
/* stream                                                                                    */

/* ---------------------------------------------------------------------------------------- */
/* parameter groups (registration)                                                           */

sg_status sg_set_param_group(sg_engine *e, int id, int group) {
  SG_ENGINE_GUARD(e, "sg_set_param_group");
  static const char *fn = "sg_set_param_group";
  SG_TRY(sg__engine_check(e, fn, 0));
  SG_TRY(sg__engine_check_id(e, id, fn));
  SG_TRY(sg__engine_check_group(group, fn));
  e->reg.group[id] = group;
  return SG_OK;
}

sg_status sg_set_stream(sg_engine *e, void *stream) {
  SG_ENGINE_GUARD(e, "sg_set_stream");
  static const char *fn = "sg_set_stream";
  if (!e) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: engine is NULL", fn);
  if (e->state == SG_ES_BROKEN) return sg__engine_check(e, fn, 1);
  if (e->g.touched)
    return sg__err(SG_ERR_INVALID_STATE, "%s: a micro-batch is in progress", fn);
  SG_TRY(sg__err_prefix(e->dev->ops->set_stream(e->dev, stream), fn));
  return sg__err_prefix(sg__gathers_new_queue(e), fn);
}

