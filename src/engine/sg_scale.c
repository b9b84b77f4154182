/* The loss scale (DESIGN.md section 5): its start from the config, the dynamic update after
 * each step and the restore from a checkpoint (the public getter, which waits for a step's
 * outcome decided on the device, is sg_outcome.c's). */
#include <math.h>

#include "sg_engine_internal.h"

void sg__scale_init(sg_engine *e) {
  sg__scale *s = &e->sc;
  s->dynamic = sg__config_dynamic_scale(&e->cfg);
  s->loss_scale = s->dynamic ? e->cfg.init_loss_scale
                             : (e->cfg.loss_scale > 0 ? e->cfg.loss_scale : 1.0f);
  s->clean_steps = 0;
}

void sg__scale_update(sg_engine *e, int overflow) {
  sg__scale *s = &e->sc;
  if (!s->dynamic) return;
  if (overflow) {
    float x = s->loss_scale * 0.5f;
    s->loss_scale = x > e->cfg.min_loss_scale ? x : e->cfg.min_loss_scale;
    s->clean_steps = 0;
    SG_LOG(SG_LOG_INFO, e->rank, "non-finite gradients: loss scale -> %g", s->loss_scale);
    return;
  }
  if (++s->clean_steps >= e->cfg.scale_window) {
    float x = s->loss_scale * 2.0f;
    if (isfinite(x)) s->loss_scale = x;
    s->clean_steps = 0;
  }
}

void sg__scale_restore(sg_engine *e, int saved_dynamic, float loss_scale, uint32_t clean_steps) {
  if (!e->sc.dynamic || !saved_dynamic) return;
  e->sc.loss_scale = loss_scale;
  e->sc.clean_steps = (int)clean_steps;
}

