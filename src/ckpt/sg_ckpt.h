/* Checkpoints (DESIGN.md section 7; issue 5): internal interface of src/ckpt.
 *
 * On disk, a checkpoint directory holds
 *   manifest               the commit point, written last by rank 0 (tmp + fsync + rename)
 *   g<G>.r<R>.shard        rank R's file of generation G (one generation per sg_save)
 * and nothing else of ours once a save has finished. Every save writes a new generation under
 * new names, so the files the current manifest names are never touched; the previous
 * generation is deleted only after the new manifest is durable.
 *
 * A rank file holds the elements of every parameter fragment the rank owned in the saving
 * plan, concatenated (the manifest says where each fragment is), once per section: working
 * params (param dtype), fp32 master (absent for f32 params, whose working copy is the master),
 * and each of the optimizer's state arrays. Each section is cut into chunks of chunk_bytes,
 * each with its own CRC-32C, so a loading rank reads and verifies just the chunks that hold
 * what its new shard needs.
 *
 * All integers are little-endian; float data are written as the host holds them (the library
 * supports little-endian hosts only, as safetensors does). Format version 1:
 *
 * manifest                               rank file g<G>.r<R>.shard
 *   "SGCKMANF" u32 version u32 0           "SGCKSHRD" u32 version u32 header_bytes
 *   u64 total_bytes u64 generation         u64 generation u64 plan_hash
 *   u32 world strategy param_dtype         u32 rank world nsections chunk_bytes
 *       has_master                         u64 numel (elements per section) u64 nchunks
 *   u64 plan_hash step                     nsections x {u32 kind elem_bytes, u64 offset bytes
 *   u32 loss_scale(f32) clean_steps                     crc_index}
 *       dynamic_scale lr(f32)              nchunks x u32 CRC-32C of each chunk of each section
 *   u32 ncfg, ncfg x u64 config words      u32 CRC-32C of all header bytes before it
 *   u32 nparams                            section data, back to back (kinds ascending:
 *   world x {u16 len, name, u64 bytes,       working params, master, optimizer states,
 *                                            replica state)
 *            u64 numel, u32 header_crc}
 *   nparams x {u16 len, name, u64 numel, u32 flags, u32 dtype, u32 nfrags,
 *              nfrags x {u32 rank, u64 param_off, u64 len, u64 elem_off}}
 *   (manifest version 2 on) u32 ngroups, ngroups x {u32 lr(f32), u32 weight_decay(f32)}
 *   (manifest version 3 on) 4 x u32 record bytes of the replica sections, u64 outer position
 *   (manifest version 4) nparams x u64 step count of the parameter (<= step)
 *   u32 CRC-32C of all bytes before it
 * A save writes version 4 when some parameter's step count differs from the step (it was
 * skipped in steps without a gradient), else version 3 when the engine's replica transport has
 * state of its own (a codec, outer steps), else version 2, which older libraries read too;
 * versions 1 (without the groups: every group then takes the saved lr), 2 (without replica
 * sections: that state begins afresh) and 3 (without step counts: every parameter's is the
 * step) still load. Rank files stay at SG_CK_VERSION. */
#ifndef SG_CKPT_H
#define SG_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "../core/sg_core.h"          /* sg_status, sg__err */
#include "../engine/sg_strategy.h"    /* sg__strategy_known */
#include "../../kernels/sg_kernel_args.h" /* SG__OPTIM_MAX_STATES */

#define SG_CK_VERSION 1u          /* rank files */
#define SG_CK_MANIFEST_VERSION 4u /* 2: parameter groups' lr and weight decay appended; 3: the
                                     replica transport's sections and position; 4: per-parameter
                                     step counts */
#define SG_CK_MANIFEST_NAME "manifest"
#define SG_CK_MANIFEST_TMP "manifest.tmp"
#define SG_CK_MAX_WORLD 4096u
#define SG_CK_MAX_NAME 255u
#define SG_CK_CHUNK_DEFAULT (1u << 20)
#define SG_CK_CHUNK_MIN 64u
#define SG_CK_CHUNK_MAX (1u << 30)
#define SG_CK_FIXED_HEADER 64u  /* bytes of the shard header before the section table */
#define SG_CK_SECTION_BYTES 32u /* one section descriptor */
#define SG_CK_NCFG SG__CONFIG_CK_WORDS /* config words recorded in the manifest (21) */

/* Sections of a rank file, in file order: the working params, the master, then the optimizer's
 * state arrays in its descriptor's order (kind SG_CK_STATE0 + k for state k, named by the
 * descriptor, src/optim; the files written so far hold kinds 2 and 3, the first optimizer's
 * two states, which load as before). */
enum {
  SG_CK_WORK = 0,
  SG_CK_MASTER = 1,
  SG_CK_STATE0 = 2,
  /* 8-bit optimizer state (cfg.optim_state_dtype SG_Q8) in place of the fp32 kinds: state k as
   * kind SG_CK_Q8_STATE0 + k, one record of SG_CK_Q8_RECORD bytes per element (below) */
  SG_CK_Q8_STATE0 = 2 + SG__OPTIM_MAX_STATES,
  /* A hybrid engine's replica transport's state (manifest version 3), after the optimizer's:
   * kind SG_CK_REP0 + k for the engine's state k (SG__REP_*, src/engine/sg_engine_internal.h):
   * the outer parameters (fp32), the outer momentum (fp32), a codec's residuals (fp32 r2, then
   * r1 of every replica of the saving engine: 4 (N + 1) bytes per element) of the gradient or
   * of the outer steps' pseudo-gradient */
  SG_CK_REP0 = 2 + 2 * SG__OPTIM_MAX_STATES,
  SG_CK_REP_STATES = 4,
  SG_CK_KINDS = SG_CK_REP0 + SG_CK_REP_STATES
};
/* An element's 8-bit state record: byte 0 its class (0 padding, 1 coded, 2 fp32: a tensor
 * below optim_state_min_numel), byte 1 its code, bytes 2..5 (little-endian float bits) the
 * block's scale at the first element of a coded block (every block begins a tensor's run of
 * SG__Q8_BLOCK elements, so a fragment always carries its blocks' first elements), the fp32
 * value of an fp32 element, else 0. The codes and scales as the engine holds them: a load at
 * any world size restores the same bits. */
#define SG_CK_Q8_RECORD 6
/* The replica states k of kind SG_CK_REP0 + k (the engine's SG__REP_*). */
enum {
  SG_CK_REP_OUTER_PARAMS = 0,
  SG_CK_REP_OUTER_MOM = 1,
  SG_CK_REP_RESID = 2,      /* the gradient codec's */
  SG_CK_REP_OUTER_RESID = 3 /* the outer steps' codec's (the pseudo-gradient's) */
};
enum { SG_CK_Q8_PAD = 0, SG_CK_Q8_CODED = 1, SG_CK_Q8_F32 = 2 };

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C (Castagnoli, reflected 0x82F63B78), chainable: crc(crc(0, a), b) == crc(0, a||b). */
uint32_t sg__crc32c(uint32_t crc, const void *data, size_t n);
/* The portable slicing-by-8 path alone (tests compare it with the hardware path). */
uint32_t sg__crc32c_sw(uint32_t crc, const void *data, size_t n);

/* Chunk size of the files sg_save writes (bytes, SG_CK_CHUNK_MIN..MAX; 0 restores the
 * default). A test hook: small chunks give small files many checksums. */
void sg__ckpt_set_chunk_bytes(uint32_t bytes);
uint32_t sg__ckpt_chunk_bytes(void);

/* ---------------------------------------------------------------------------------------- */
/* manifest                                                                                  */

typedef struct sg__ck_frag {
  uint32_t rank;      /* file holding it */
  uint64_t param_off; /* element offset inside the parameter */
  uint64_t len;       /* elements, >= 1 */
  uint64_t elem_off;  /* element offset inside the file's sections */
} sg__ck_frag;

typedef struct sg__ck_param {
  char *name;
  uint64_t numel;
  uint32_t flags, dtype;
  uint32_t nfrags;
  sg__ck_frag *frags; /* sorted by param_off, tiling [0, numel) */
} sg__ck_param;

typedef struct sg__ck_file {
  char *name;          /* plain file name inside the checkpoint directory */
  uint64_t bytes;      /* file size */
  uint64_t numel;      /* elements per section */
  uint32_t header_crc; /* the file's header checksum: binds the file to this manifest */
} sg__ck_file;

typedef struct sg__ck_manifest {
  uint64_t generation;
  uint32_t world, strategy, param_dtype, has_master;
  uint64_t plan_hash;
  uint64_t step;
  float loss_scale;
  uint32_t clean_steps, dynamic_scale;
  float lr;
  uint64_t cfg[SG_CK_NCFG]; /* sg_config as recorded (sg__config_words) */
  uint32_t version;         /* parsed: 1..4; encode writes this (0: 4 with step counts, else 3
                               with replica sections, else 2) */
  uint32_t ngroups;         /* version 2: groups recorded (group_lr[0] is group 0's lr) */
  float group_lr[SG_MAX_GROUPS], group_wd[SG_MAX_GROUPS];
  /* version 3: the record bytes of the replica transport's sections (kind SG_CK_REP0 + k; 0:
   * not in the files) and the outer period's position; versions 1 and 2: none */
  uint32_t rep_esz[SG_CK_REP_STATES];
  uint64_t rep_position;
  uint32_t nparams;
  sg__ck_param *params; /* registration order of the saving engine */
  uint64_t *param_steps; /* version 4: [nparams] each parameter's own step count (<= step, the
                            steps it had a gradient in); NULL: every count is `step` */
  sg__ck_file *files;   /* [world] */
} sg__ck_manifest;

/* A growing byte buffer for the encoders (the manifest, the safetensors header). An append
 * keeps a NUL after the bytes, so that text can be read as a string; after a failed allocation
 * oom is set and later appends do nothing. The caller frees p. */
typedef struct sg__ck_buf {
  uint8_t *p;
  size_t len, cap;
  int oom;
} sg__ck_buf;
void sg__ck_buf_add(sg__ck_buf *b, const void *src, size_t n);

/* Encodes m (checksum included) into a malloc'd buffer. */
sg_status sg__ck_manifest_encode(const sg__ck_manifest *m, uint8_t **out, size_t *len);
/* Parses and validates untrusted bytes: SG_ERR_CORRUPT naming `what` and the reason, or
 * SG_ERR_OUT_OF_MEMORY. On success *m owns its memory (sg__ck_manifest_free). */
sg_status sg__ck_manifest_parse(const uint8_t *buf, size_t len, const char *what,
                                sg__ck_manifest *m);
void sg__ck_manifest_free(sg__ck_manifest *m);
/* The generation of a manifest's bytes without verifying anything (0 when unreadable). */
uint64_t sg__ck_manifest_peek_generation(const uint8_t *buf, size_t len);

/* ---------------------------------------------------------------------------------------- */
/* rank file header                                                                          */

typedef struct sg__ck_section {
  uint32_t kind, elem_bytes;
  uint64_t offset;    /* in the file */
  uint64_t bytes;     /* = numel * elem_bytes */
  uint64_t crc_index; /* index of the section's first chunk checksum in crcs */
} sg__ck_section;

typedef struct sg__ck_header {
  uint32_t header_bytes; /* fixed part + section table + chunk checksums + header checksum */
  uint64_t generation, plan_hash;
  uint32_t rank, world, nsections, chunk_bytes;
  uint64_t numel; /* elements per section */
  uint64_t nchunks;
  sg__ck_section sec[SG_CK_KINDS];
  uint32_t *crcs; /* [nchunks] (owned by the header after parse/layout) */
  uint32_t header_crc;
} sg__ck_header;

/* Lays out sections for `kinds` (ascending, elem_bytes each) and `numel` elements: offsets,
 * chunk counts, header_bytes; allocates crcs. SG_ERR_INVALID_ARGUMENT if it does not fit. */
sg_status sg__ck_header_layout(sg__ck_header *h, const uint32_t *kinds, const uint32_t *elem_bytes,
                               uint32_t nsections);
/* Writes the header (h->header_bytes bytes) into buf, sets h->header_crc. */
void sg__ck_header_encode(sg__ck_header *h, uint8_t *buf);
/* From the first SG_CK_FIXED_HEADER bytes: magic, version and the header size, checked
 * against the file size. SG_ERR_CORRUPT naming `what` otherwise. */
sg_status sg__ck_header_size(const uint8_t *fixed, size_t fixed_len, uint64_t file_bytes,
                             const char *what, uint32_t *header_bytes);
/* Parses and validates a whole header (checksum included). On success h->crcs is malloc'd. */
sg_status sg__ck_header_parse(const uint8_t *buf, size_t len, const char *what, sg__ck_header *h);
void sg__ck_header_free(sg__ck_header *h);

/* ---------------------------------------------------------------------------------------- */
/* files (sg_ckpt_io.c): every failure is SG_ERR_IO with the path and strerror                */

/* strerror, thread-safe: the text of err in buf. */
const char *sg__ck_errstr(int err, char *buf, size_t n);
/* dir + "/" + name, malloc'd; NULL when out of memory. */
char *sg__ck_path(const char *dir, const char *name);
sg_status sg__ck_write_at(int fd, const void *buf, size_t n, uint64_t off, const char *path);
/* Reads exactly n bytes at off; a short file is SG_ERR_CORRUPT ("truncated"). */
sg_status sg__ck_read_at(int fd, void *buf, size_t n, uint64_t off, const char *path);
/* Opens a regular file for reading (anything else is refused without blocking: a FIFO's
 * open would wait for a writer). follow 0: a symbolic link is refused too (files inside a
 * checkpoint directory); 1: the caller's own path (sg_import), followed as given. */
sg_status sg__ck_open_read(const char *path, int follow, int *fd, uint64_t *bytes);
/* Creates a temporary as a new regular file (0644) through sg__file_create: never through a
 * symbolic link; a stale regular file under the name is replaced, anything else there refused
 * (SG_ERR_IO saying what it is). */
sg_status sg__ck_open_write(const char *path, int *fd);
sg_status sg__ck_fsync_close(int fd, const char *path);
sg_status sg__ck_fsync_dir(const char *dir);
sg_status sg__ck_rename(const char *from, const char *to);
/* Whole small file of a checkpoint directory (the manifest) into memory, at most max bytes;
 * a symbolic link is refused. */
sg_status sg__ck_read_file(const char *path, size_t max, uint8_t **out, size_t *len);
/* Writes a whole buffer to dir/name via dir/tmp_name (a new file), fsync, rename, directory
 * fsync. */
sg_status sg__ck_write_atomic(const char *dir, const char *name, const char *tmp_name,
                              const uint8_t *buf, size_t len);
/* mkdir if missing; SG_ERR_IO if it is not a directory or cannot be made. */
sg_status sg__ck_make_dir(const char *dir);

/* The save lock (sg_ckpt_lock.c): rank 0 holds "save.lock" in the directory for the whole
 * sg_save. A second saver fails with SG_ERR_IO naming the holder; a lock left by a process that
 * is provably gone (same host) is removed, one from another host never is. */
#define SG_CK_LOCK_NAME "save.lock"
typedef struct sg__ck_lock {
  char *path;
  char text[1024]; /* what we wrote: release removes the file only if it still says this */
  int held;
} sg__ck_lock;
sg_status sg__ck_lock_acquire(const char *dir, sg__ck_lock *l);
/* Removes our lock (if held) and frees l; safe on a zeroed or released l. */
void sg__ck_lock_release(sg__ck_lock *l);

/* Rank file names: "g<gen>.r<rank>.shard" and the temporary "g<gen>.r<rank>.tmp". */
void sg__ck_shard_name(char *buf, size_t n, uint64_t gen, int rank, int tmp);
/* 1 when `name` is one of ours (shard, its temporary, the manifest's temporary); *gen is its
 * generation (0 for the manifest's temporary). */
int sg__ck_parse_name(const char *name, uint64_t *gen);

#endif /* SG_CKPT_H */
