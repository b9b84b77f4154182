/* Public communicator functions (rank, size, destroy) and the helpers every backend shares
 * (DESIGN.md section 6). The backends live in local.c, mpi.c and nccl.c. */
#include <stdarg.h> /* va_list */
#include <stdio.h>  /* vsnprintf */

#include "sg_comm.h" /* sg_comm, sg__comm_ops, sg__comm_fail, sg__comm_usable */

int sg_comm_rank(const sg_comm *c) { return c ? c->rank : -1; }

int sg_comm_size(const sg_comm *c) { return c ? c->world : -1; }

/* Destroying a communicator that an engine still holds would leave the engine with a dangling
 * pointer (its comm worker may be inside a collective right now). We choose to refuse: log a
 * warning and leave the communicator alive (a leak, never a use-after-free). The caller can
 * destroy it again after sg_engine_destroy. */
void sg_comm_destroy(sg_comm *c) {
  if (!c) return;
  if (c->in_use) {
    SG_LOG(SG_LOG_WARN, c->rank,
           "sg_comm_destroy: communicator (rank %d of %d) is still used by an engine; not "
           "destroyed (destroy the engine first)",
           c->rank, c->world);
    return;
  }
  if (c->ops && c->ops->destroy) c->ops->destroy(c);
}

sg_status sg__comm_fail(sg_comm *c, sg_status st, const char *fn, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  if (vsnprintf(msg, sizeof msg, fmt, ap) < 0) msg[0] = '\0';
  va_end(ap);
  if (c) {
    /* Broken for good: a collective that failed half-way leaves peers at unknown points. */
    c->broken = 1;
    /* info, not warn: the caller gets the status and the text; warn is for what it cannot see */
    SG_LOG(SG_LOG_INFO, c->rank, "%s: %s (communicator now broken)", fn ? fn : "comm", msg);
  }
  return sg__err(st, "%s: %s", fn ? fn : "comm", msg);
}

sg_status sg__comm_usable(sg_comm *c, const char *fn) {
  if (!c) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is NULL", fn);
  if (!c->ops) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm has no backend", fn);
  if (c->broken)
    return sg__err(SG_ERR_COMM,
                   "%s: communicator (rank %d of %d) is broken by an earlier failure; create a "
                   "new one",
                   fn, c->rank, c->world);
  return SG_OK;
}

#ifndef SG_HAVE_MPI
sg_status sg_comm_create_mpi(const void *mpi_comm, sg_comm **out) {
  (void)mpi_comm;
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_comm_create_mpi: out is NULL");
  *out = NULL;
  return sg__err(SG_ERR_UNSUPPORTED, "sg_comm_create_mpi: built without MPI");
}
#endif
