/* Internal pieces of the NCCL communicator (src/comm/nccl.c) that tests reach directly: the
 * file bootstrap of the unique id, which needs no GPU. */
#ifndef SG_NCCL_INTERNAL_H
#define SG_NCCL_INTERNAL_H

#include <stdint.h> /* int64_t */

#include "../../core/sg_core.h" /* sg_status */

/* Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES). */
#define SG__NCCL_ID_BYTES 128

#ifdef SG_HAVE_NCCL
/* Writes id128 (and world, checked by readers) to `path` atomically: a temporary file next to
 * it, fsync, rename. SG_ERR_IO on failure. */
sg_status sg__nccl_id_file_write(const char *path, const void *id128, int world);
/* Polls for `path` until it appears or deadline_ms (sg__now_ms clock) passes (SG_ERR_TIMEOUT),
 * then reads the id. SG_ERR_CORRUPT for a damaged file, SG_ERR_MISMATCH for another world
 * size, SG_ERR_IO when it cannot be read. */
sg_status sg__nccl_id_file_read(const char *path, int world, int64_t deadline_ms, void *id128);
/* The deadline of bootstrap waits: SG_NCCL_INIT_TIMEOUT_MS (ms, > 0), default 600000. */
int sg__nccl_init_timeout_ms(void);
#endif

#endif /* SG_NCCL_INTERNAL_H */
