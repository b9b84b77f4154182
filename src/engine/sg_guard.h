/* One thread at a time per engine (DESIGN.md section 8), enforced: every public engine function
 * enters the engine's guard first and leaves it on return. A second thread that calls into an
 * engine while another thread is inside gets SG_ERR_INVALID_STATE, and the engine's state is
 * never touched by it; calls made from inside a call on the same thread (sg_import calls
 * sg_set_param) nest. */
#ifndef SG_GUARD_H
#define SG_GUARD_H

#include <stdatomic.h>
#include <stdint.h>

#include "../core/sg_core.h" /* sg_status */

typedef struct sg__guard {
  _Atomic(uintptr_t) owner;   /* the thread inside (its token's address), 0 when free */
  _Atomic(const char *) fn;   /* the public function it is in, for the refusal's message */
  int depth;                  /* nesting of the owner's calls; touched by the owner only */
} sg__guard;

/* Where a public function's scope keeps what it entered; left automatically. */
typedef struct sg__guard_scope {
  sg__guard *g; /* NULL: nothing entered (NULL engine, refused) */
} sg__guard_scope;

/* Enters g for the calling thread on behalf of `fn`; SG_ERR_INVALID_STATE naming the other
 * thread's function when it is taken. g NULL: nothing to guard (the caller reports it). */
sg_status sg__guard_enter(sg__guard *g, const char *fn, sg__guard_scope *s);
void sg__guard_leave(sg__guard_scope *s);

#if defined(__GNUC__) || defined(__clang__)
/* First statement of every public function taking an engine: enters e's guard and leaves it
 * when the function returns, whichever return it is. */
#define SG_ENGINE_GUARD(e, fn)                                                       \
  sg__guard_scope sg__guard_here __attribute__((cleanup(sg__guard_leave))) = {NULL}; \
  SG_TRY(sg__guard_enter((e) ? &(e)->guard : NULL, (fn), &sg__guard_here))
#else
#error "SG_ENGINE_GUARD needs __attribute__((cleanup)) (GCC or Clang)"
#endif

#endif /* SG_GUARD_H */
