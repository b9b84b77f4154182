/* The engine's one-thread-at-a-time guard (sg_guard.h). The owner is identified by the address
 * of a thread-local byte: unique among live threads, and no thread API is needed. The acquire
 * on entry and the release on the last leave order each call's engine accesses after the
 * previous caller's, whatever thread that was. */
#include "sg_guard.h"

static _Thread_local char sg__guard_me;

sg_status sg__guard_enter(sg__guard *g, const char *fn, sg__guard_scope *s) {
  s->g = NULL;
  if (!g) return SG_OK;
  const uintptr_t me = (uintptr_t)&sg__guard_me;
  uintptr_t free_ = 0;
  if (atomic_compare_exchange_strong_explicit(&g->owner, &free_, me, memory_order_acquire,
                                              memory_order_relaxed)) {
    g->depth = 1;
    atomic_store_explicit(&g->fn, fn, memory_order_relaxed);
  } else if (free_ == me) {
    g->depth++; /* a public function called from inside another, on the same thread */
  } else {
    const char *other = atomic_load_explicit(&g->fn, memory_order_relaxed);
    return sg__err(SG_ERR_INVALID_STATE,
                   "%s: another thread is inside %s on this engine; an engine is driven by one "
                   "thread at a time (nothing was done)",
                   fn, other ? other : "an engine call");
  }
  s->g = g;
  return SG_OK;
}

void sg__guard_leave(sg__guard_scope *s) {
  sg__guard *g = s->g;
  if (!g) return;
  s->g = NULL;
  if (--g->depth > 0) return;
  atomic_store_explicit(&g->owner, 0, memory_order_release);
}
