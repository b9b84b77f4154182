/* The optimizer table. A new optimizer adds its file (its descriptor) and its row here. */
#include <string.h>

#include "sg_optimizer.h"

extern const sg__optim_desc sg__optim_adamw;

static const sg__optim_desc *const table[] = {&sg__optim_adamw};
#define SG__NOPTIMS (int)(sizeof table / sizeof table[0])

const sg__optim_desc *sg__optim_default(void) { return table[0]; }

const sg__optim_desc *sg__optim_find(const char *name) {
  for (int i = 0; name && i < SG__NOPTIMS; i++)
    if (strcmp(table[i]->name, name) == 0) return table[i];
  return NULL;
}

int sg__optim_state_index(const sg__optim_desc *od, const char *name) {
  for (int k = 0; od && name && k < od->nstates; k++)
    if (strcmp(od->state_name[k], name) == 0) return k;
  return -1;
}
