/* What the checkpoint code needs from the engine, on top of sg_engine_internal.h: the vote that
 * makes every rank return the same status, and the device addresses of a rank's fragments. */
#ifndef SG_CKPT_ENGINE_H
#define SG_CKPT_ENGINE_H

#include "../engine/sg_engine_internal.h" /* struct sg_engine, plan, device, comm queue */
#include "sg_ckpt.h"                      /* formats */

#define SG_CK_VOTE_MSG 472

/* One rank's contribution to an agreement round: 512 bytes. */
typedef struct sg__ck_vote {
  uint64_t status;
  uint64_t val[4];
  char msg[SG_CK_VOTE_MSG]; /* the failure text when status != SG_OK */
} sg__ck_vote;

/* The checks of sg_save, sg_load, sg_export and sg_import: a finalized engine, the directory or
 * file (the argument `what`) named, and with need_idle no micro-batch open on this rank (sg_save
 * instead agrees on that in its first round). */
sg_status sg__ck_check_call(sg_engine *e, const char *path, const char *what, int need_idle,
                            const char *fn);

/* Collective: every rank contributes (local, val) and learns everybody's. Call right after the
 * local step (local's text is taken from sg_last_error()). Returns the exchange's failure
 * (the engine is then broken), or the failure of the lowest failing rank with its text (naming
 * the rank when it is another one), or SG_OK. *all receives the votes (malloc'd, world
 * entries) whenever the exchange itself worked, else NULL. */
sg_status sg__ck_agree(sg_engine *e, const char *fn, sg_status local, const uint64_t val[4],
                       sg__ck_vote **all);

/* Sections a checkpoint of this engine holds, in file order, and their element sizes. */
uint32_t sg__ck_kinds(const sg_engine *e, uint32_t *kinds, uint32_t *elem_bytes);

/* Rank r's fragments of parameter id in the engine's plan (also where the state is replicated: every
 * rank holds everything but each writes only the part the plan assigns it). */
static inline size_t sg__ck_frag_begin(const sg_engine *e, int id, int r) {
  return e->plan->frag_index[(size_t)id * (size_t)e->plan->world + (size_t)r];
}
static inline size_t sg__ck_frag_end(const sg_engine *e, int id, int r) {
  return e->plan->frag_index[(size_t)id * (size_t)e->plan->world + (size_t)r + 1];
}

/* The replica transport's sections (record bytes rep_esz[k], 0: none) appended after n
 * kinds; returns how many. */
uint32_t sg__ck_rep_kinds(const uint32_t rep_esz[SG_CK_REP_STATES], uint32_t *kinds,
                          uint32_t *elem_bytes);
/* State k of a replica section (kind SG_CK_REP0 + k); -1 for any other kind. Its name. */
int sg__ck_kind_rep(uint32_t kind);
const char *sg__ck_rep_name(int k);
/* State k of an 8-bit state section (kind SG_CK_Q8_STATE0 + k); -1 for any other kind. */
int sg__ck_kind_q8(uint32_t kind);
/* A section's name in messages: "working params", "master" or the optimizer's state name. */
const char *sg__ck_kind_name(const sg_engine *e, uint32_t kind);
/* The engine's fp32 array of section `kind` (master or an optimizer state; device memory). */
float *sg__ck_state_array(const sg_engine *e, uint32_t kind);
/* Device address of element `param_off` of parameter id in section `kind`, for an element this
 * rank holds (at shard offset `opt_off` in the master and state arrays). */
char *sg__ck_state_ptr(const sg_engine *e, int kind, int id, size_t param_off, size_t opt_off);

/* Host-side all-gather of the working parameters, every bucket in place (after a load). */
sg_status sg__ck_gather_params(sg_engine *e);

/* The rank that writes manifests and exported files: global rank 0 (rank 0 of replica 0). */
int sg__ck_lead(const sg_engine *e);

#endif /* SG_CKPT_ENGINE_H */
