/* Gradient slots in a pool of staging buffers (SHARD_GRAD_OP): bucket b's slot is a buffer of
 * the pool while its gradients are written and reduced, recycled once its reduction zeroed it. */
#include <stdlib.h>

#include "sg_policy.h"

/* The staging pool: lay.nstaging buffers in the GRADS arena, more allocated if forced. */
typedef struct {
  sg__slot_tickets t;
  size_t stride;        /* bytes of one staging buffer */
  int n;                /* staging buffers */
  char **ptr;           /* [n] */
  int *owner;           /* [n]: bucket holding it, -1 free */
  uint64_t *ticket;     /* [n]: job after which it is zero and free */
  int *bucket_staging;  /* [nbuckets]: staging index held, -1 none */
} pool;

static void staging_free(sg_engine *e, void *state) {
  pool *s = state;
  if (!s) return;
  for (int k = e->lay.nstaging; k < s->n; k++) sg__arenas_extra_free(&e->ar, s->ptr[k], s->stride);
  free(s->t.bucket);
  free(s->ptr);
  free(s->owner);
  free(s->ticket);
  free(s->bucket_staging);
  free(s);
}

static sg_status staging_init(sg_engine *e, void **state) {
  const int nb = e->plan->nbuckets, ns = e->lay.nstaging;
  pool *s = calloc(1, sizeof *s);
  if (!s) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  s->t.bucket = calloc((size_t)nb, sizeof *s->t.bucket);
  s->bucket_staging = calloc((size_t)nb, sizeof *s->bucket_staging);
  s->owner = calloc((size_t)(ns ? ns : 1), sizeof *s->owner);
  s->ticket = calloc((size_t)(ns ? ns : 1), sizeof *s->ticket);
  s->ptr = calloc((size_t)(ns ? ns : 1), sizeof *s->ptr);
  if (!s->t.bucket || !s->bucket_staging || !s->owner || !s->ticket || !s->ptr) {
    staging_free(e, s);
    return sg__err(SG_ERR_OUT_OF_MEMORY, "sg_finalize: out of host memory");
  }
  s->n = ns;
  s->stride = ns ? e->lay.slots_bytes / (size_t)ns : 0;
  for (int k = 0; k < ns; k++) {
    s->owner[k] = -1;
    s->ptr[k] = e->g.slots + (size_t)k * s->stride;
  }
  for (int b = 0; b < nb; b++) s->bucket_staging[b] = -1;
  *state = s;
  return SG_OK;
}

/* An extra staging buffer, for gradients that arrive so far out of order that every staging
 * buffer is held by a bucket that cannot be reduced yet: memory instead of a deadlock. */
static sg_status add_staging(sg_engine *e, pool *s, int *k_out) {
  const size_t bytes = s->stride;
  int n = s->n + 1;
  int *own = realloc(s->owner, (size_t)n * sizeof *own);
  if (own) s->owner = own;
  uint64_t *tk = realloc(s->ticket, (size_t)n * sizeof *tk);
  if (tk) s->ticket = tk;
  char **pp = realloc(s->ptr, (size_t)n * sizeof *pp);
  if (pp) s->ptr = pp;
  if (!own || !tk || !pp) return sg__err(SG_ERR_OUT_OF_MEMORY, "out of host memory");
  void *buf = NULL;
  SG_TRY(sg__arenas_extra_alloc(&e->ar, bytes, &buf));
  s->ptr[s->n] = buf;
  s->owner[s->n] = -1;
  s->ticket[s->n] = 0;
  *k_out = s->n++;
  SG_LOG(SG_LOG_WARN, e->rank, "all %d staging buckets are held by buckets that cannot be "
         "reduced yet (bucket %d, earlier in backward order, is incomplete): allocated one more "
         "(%zu bytes). Produce gradients in reverse registration order or raise staging_buckets.",
         s->n - 1, e->g.next_launch, bytes);
  return SG_OK;
}

static sg_status acquire(sg_engine *e, pool *s, int b, const char *fn) {
  int best = -1;
  for (int k = 0; k < s->n; k++)
    if (s->owner[k] < 0 && (best < 0 || s->ticket[k] < s->ticket[best])) best = k;
  if (best < 0) {
    sg_status st = add_staging(e, s, &best);
    if (st != SG_OK) return sg__err_prefix(st, fn);
  }
  /* the job that zeroed it, not a replica all-reduce queued before that job */
  sg__device *d = e->dev;
  sg_status (*wait)(sg__device *, uint64_t, int64_t) =
      d->ops->compute_wait_job ? d->ops->compute_wait_job : d->ops->compute_wait_comm;
  sg_status st = wait(d, s->ticket[best], sg__deadline(e->cfg.timeout_ms));
  if (st != SG_OK) return sg__engine_broken(e, st);
  s->owner[best] = b;
  s->bucket_staging[b] = best;
  return SG_OK;
}

static sg_status staging_slot(sg_engine *e, void *state, int b, char **base, const char *fn) {
  pool *s = state;
  if (s->bucket_staging[b] < 0) SG_TRY(acquire(e, s, b, fn));
  *base = s->ptr[s->bucket_staging[b]];
  return SG_OK;
}

static void staging_release(sg_engine *e, void *state, int b, uint64_t ticket) {
  pool *s = state;
  if (ticket) s->t.bucket[b] = ticket;
  const int k = s->bucket_staging[b];
  if (k >= 0) {
    s->owner[k] = -1;
    s->ticket[k] = s->t.bucket[b];
    s->bucket_staging[b] = -1;
  }
}

/* acquire()'s order: the free buffer with the oldest ticket, the lowest index among equals. */
static int acquired_before(uint64_t t1, int k1, uint64_t t2, int k2) {
  return t1 < t2 || (t1 == t2 && k1 < k2);
}

/* Bucket b is about to release buffer k. The later buckets of the micro-batch that hold no
 * buffer yet will each acquire one (at the latest when sg_backward_end completes them); k is
 * handed out again iff they outnumber the buffers that can be taken before it: the free ones
 * acquire() orders first, and one more for each later bucket whose release can order before k.
 * Not handed out again, the whole buffer is idle: a larger bucket that held it before b may
 * have written (and left resident, zeroed) more of it than b's part.
 * With sync on, b's release ticket (its new reduction's) is newer than every ticket so far,
 * and so are those of the later buckets' releases (sg_set_sync holds for a whole micro-batch):
 * every other free buffer is taken first, no later release is, and the answer is exact. With
 * sync off every release keeps the bucket's last ticket, so equal tickets of later buckets
 * whose buffer is not known yet count as before k (the answer may then be a needless 0). */
static int handed_again(const sg_engine *e, const pool *s, int b) {
  const int k = s->bucket_staging[b], sync = e->g.sync;
  if (k < 0 || !e->g.touched) return 0; /* sg__grads_flush: the step follows */
  const uint64_t tk = s->t.bucket[b];
  int ahead = 0, later = 0;
  for (int j = 0; j < s->n; j++)
    if (j != k && s->owner[j] < 0 && (sync || acquired_before(s->ticket[j], j, tk, k))) ahead++;
  for (int c = b + 1; c < e->plan->nbuckets; c++) {
    const int held = s->bucket_staging[c];
    later += held < 0;
    if (!sync && (held < 0 ? s->t.bucket[c] <= tk : acquired_before(s->t.bucket[c], held, tk, k)))
      ahead++;
  }
  return later > ahead;
}

static size_t staging_idle_bytes(const sg_engine *e, const void *state, int b) {
  const pool *s = state;
  return handed_again(e, s, b) ? 0 : s->stride;
}

const sg__slots_ops sg__slots_staging = {
    .name = "staging", .init = staging_init, .free = staging_free, .slot = staging_slot,
    .release = staging_release, .idle_bytes = staging_idle_bytes,
};
