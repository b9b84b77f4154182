/* Pieces shared by sg_save, sg_load, sg_export and sg_import: the agreement round, the sections
 * of a checkpoint, device addresses of fragments, the in-place gather of working params. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sg_ckpt_engine.h"

_Static_assert(SG_CK_Q8_RECORD == SG__STATE_RECORD && (int)SG_CK_Q8_PAD == (int)SG__REC_PAD &&
                   (int)SG_CK_Q8_CODED == (int)SG__REC_CODED && (int)SG_CK_Q8_F32 == (int)SG__REC_F32,
               "the checkpoint's 8-bit records are the state placement's");
_Static_assert((int)SG_CK_REP_STATES == (int)SG__REP_STATES &&
                   (int)SG_CK_REP_OUTER_PARAMS == (int)SG__REP_OUTER_PARAMS &&
                   (int)SG_CK_REP_OUTER_MOM == (int)SG__REP_OUTER_MOM &&
                   (int)SG_CK_REP_RESID == (int)SG__REP_RESID &&
                   (int)SG_CK_REP_OUTER_RESID == (int)SG__REP_OUTER_RESID,
               "the checkpoint's replica sections are the replica transports' states");

static const char *const k_rep_names[SG_CK_REP_STATES] = {
    "outer parameters", "outer momentum", "codec residuals", "outer codec residuals"};

sg_status sg__ck_check_call(sg_engine *e, const char *path, const char *what, int need_idle,
                            const char *fn) {
  SG_TRY(sg__engine_check(e, fn, 1));
  if (!path || !path[0])
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s is NULL or empty", fn, what);
  /* the step count and loss scale written or replaced are the last step's, decided */
  SG_TRY(sg__err_prefix(sg__outcome_settle(e, NULL), fn));
  return need_idle ? sg__grads_idle(e, fn) : SG_OK;
}



/* Every rank's vote: over the shard group, then (hybrid) the groups over the replicas, so the
 * array is in global rank order (replica x world + rank) and its first e->world entries are
 * replica 0's, the group that writes. */
sg_status sg__ck_agree(sg_engine *e, const char *fn, sg_status local, const uint64_t val[4],
                       sg__ck_vote **all_out) {
  *all_out = NULL;
  const int w = sg__replicas_world(e);
  sg__ck_vote *all = calloc((size_t)w, sizeof *all);
  if (!all) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  sg__ck_vote *group = all + (size_t)e->rep.rank * (size_t)e->world;
  sg__ck_vote *mine = &group[e->rank];
  const int me = (int)(mine - all);
  mine->status = (uint64_t)local;
  if (val) memcpy(mine->val, val, sizeof mine->val);
  if (local != SG_OK) snprintf(mine->msg, sizeof mine->msg, "%s", sg_last_error());
  sg_status st = sg__engine_allgather_host(e, group, sizeof *all);
  if (st == SG_OK) st = sg__replicas_allgather_host(e, all, (size_t)e->world * sizeof *all);
  if (st != SG_OK) {
    free(all);
    return sg__engine_broken(e, st);
  }
  *all_out = all;
  for (int r = 0; r < w; r++) {
    const sg_status s = (sg_status)all[r].status;
    if (s == SG_OK) continue;
    all[r].msg[SG_CK_VOTE_MSG - 1] = 0;
    if (r == me) return sg__err(s, "%s", all[r].msg);
    const char *msg = all[r].msg;
    const size_t n = strlen(fn);
    if (strncmp(msg, fn, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ') msg += n + 2;
    return sg__err(s, "%s: rank %d failed: %s", fn, r, msg);
  }
  return SG_OK;
}

uint32_t sg__ck_kinds(const sg_engine *e, uint32_t *kinds, uint32_t *elem_bytes) {
  uint32_t n = 0;
  kinds[n] = SG_CK_WORK;
  elem_bytes[n++] = (uint32_t)sg__dtype_size(e->cfg.param_dtype);
  if (e->opt.master) {
    kinds[n] = SG_CK_MASTER;
    elem_bytes[n++] = 4;
  }
  const int coded = e->strat->place->coded;
  for (int k = 0; k < e->opt.nstates; k++) {
    kinds[n] = (coded ? SG_CK_Q8_STATE0 : SG_CK_STATE0) + (uint32_t)k;
    elem_bytes[n++] = coded ? SG_CK_Q8_RECORD : 4;
  }
  return n;
}

uint32_t sg__ck_rep_kinds(const uint32_t rep_esz[SG_CK_REP_STATES], uint32_t *kinds,
                          uint32_t *elem_bytes) {
  uint32_t n = 0;
  for (uint32_t k = 0; k < SG_CK_REP_STATES; k++)
    if (rep_esz[k]) {
      kinds[n] = SG_CK_REP0 + k;
      elem_bytes[n++] = rep_esz[k];
    }
  return n;
}

int sg__ck_kind_rep(uint32_t kind) {
  const uint32_t k = kind - SG_CK_REP0;
  return kind >= SG_CK_REP0 && k < SG_CK_REP_STATES ? (int)k : -1;
}

const char *sg__ck_rep_name(int k) { return k_rep_names[k]; }

int sg__ck_kind_q8(uint32_t kind) {
  const uint32_t k = kind - SG_CK_Q8_STATE0;
  return kind >= SG_CK_Q8_STATE0 && k < SG__OPTIM_MAX_STATES ? (int)k : -1;
}

const char *sg__ck_kind_name(const sg_engine *e, uint32_t kind) {
  if (kind == SG_CK_WORK) return "working params";
  if (kind == SG_CK_MASTER) return "master";
  if (sg__ck_kind_rep(kind) >= 0) return k_rep_names[sg__ck_kind_rep(kind)];
  const int q = sg__ck_kind_q8(kind);
  if (q >= 0) return q < e->opt.nstates ? e->opt.od->state_name[q] : "unknown";
  const uint32_t k = kind - SG_CK_STATE0;
  return k < (uint32_t)e->opt.nstates ? e->opt.od->state_name[k] : "unknown";
}

float *sg__ck_state_array(const sg_engine *e, uint32_t kind) {
  if (kind == SG_CK_MASTER) return e->opt.master;
  const uint32_t k = kind - SG_CK_STATE0;
  return kind >= SG_CK_STATE0 && k < (uint32_t)e->opt.nstates ? e->opt.state[k] : NULL;
}

char *sg__ck_state_ptr(const sg_engine *e, int kind, int id, size_t param_off, size_t opt_off) {
  if (kind == SG_CK_WORK) {
    const size_t flat = e->plan->params[id].offset + param_off;
    return e->params + flat * sg__dtype_size(e->cfg.param_dtype);
  }
  return (char *)(sg__ck_state_array(e, (uint32_t)kind) + opt_off);
}

sg_status sg__ck_gather_params(sg_engine *e) { return sg__gathers_all(e); }

int sg__ck_lead(const sg_engine *e) { return e->rank == 0 && sg__replicas_writer(e); }
