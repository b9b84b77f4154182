/* sg_load_options.convert_optim_state: a checkpoint's optimizer state in the other format than
 * the engine's (cfg.optim_state_dtype), converted in host staging before anything is applied.
 *  - fp32 -> 8-bit: the values become records of class SG_CK_Q8_F32, which the 8-bit state
 *    codes where its blocks are coded (its records op, SG__REC_CODE).
 *  - 8-bit -> fp32: every element decoded with its block's scale, which the record of the
 *    block's first element holds. The fp32 engine's pieces need not begin at a block, so
 *    sg_load also reads the record of the block that each piece begins inside (its "head",
 *    sg__ck_piece_head), after the staging's opt_numel elements, in piece order. */
#include <stdlib.h>

#include "../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_q8_value */
#include "sg_ckpt_engine.h"

sg_status sg__ck_records_of_f32(const float *v, size_t n, uint8_t **out) {
  uint8_t *rec = malloc(n * SG_CK_Q8_RECORD + 1);
  *out = rec;
  if (!rec) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (state conversion)");
  for (size_t i = 0; i < n; i++)
    sg__state_rec_put(rec + i * SG_CK_Q8_RECORD, SG_CK_Q8_F32, 0, v[i]);
  return SG_OK;
}

int sg__ck_piece_head(const sg__piece *pc, size_t *head) {
  *head = pc->param_off / SG__Q8_BLOCK * SG__Q8_BLOCK;
  return pc->param_off % SG__Q8_BLOCK != 0;
}

typedef struct decode_arg {
  int is_m;
  const uint8_t *rec, *heads; /* staging (state coordinates), heads after it */
  size_t nheads;              /* heads used so far */
  float *out;
} decode_arg;

static sg_status decode_piece(sg_engine *e, const sg__piece *pc, void *ctx) {
  (void)e;
  decode_arg *a = ctx;
  size_t head = 0;
  const uint8_t *first = NULL; /* the record of the block of element i's first element */
  if (sg__ck_piece_head(pc, &head)) first = a->heads + a->nheads++ * SG_CK_Q8_RECORD;
  for (size_t i = 0; i < pc->len; i++) {
    const size_t el = pc->param_off + i;
    const uint8_t *r = a->rec + (pc->opt_off + i) * SG_CK_Q8_RECORD;
    if (el % SG__Q8_BLOCK == 0) first = r;
    float v = 0.0f; /* padding records (never among a parameter's elements): 0, as a load */
    if (r[0] == SG_CK_Q8_F32)
      v = sg__state_rec_value(r);
    else if (r[0] == SG_CK_Q8_CODED && first[0] == SG_CK_Q8_CODED)
      v = sg__cpu_q8_value(r[1], sg__state_rec_value(first), a->is_m);
    else if (r[0] != SG_CK_Q8_PAD)
      return sg__err(SG_ERR_CORRUPT, "the 8-bit state record of element %zu of a parameter has "
                     "class %u in a block of class %u", el, (unsigned)r[0], (unsigned)first[0]);
    a->out[pc->opt_off + i] = v;
  }
  return SG_OK;
}

sg_status sg__ck_f32_of_records(sg_engine *e, int k, const uint8_t *rec, size_t opt_numel,
                                float **out) {
  *out = calloc(opt_numel ? opt_numel : 1, sizeof **out);
  if (!*out) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory (state conversion)");
  decode_arg a = {k == 0, rec, rec + opt_numel * SG_CK_Q8_RECORD, 0, *out};
  for (int id = 0; id < e->reg.nparams; id++)
    SG_TRY(sg__engine_for_pieces(e, id, decode_piece, &a));
  return SG_OK;
}
