/* test_comm_xport_split W: splits of communicators over the caller's transport
 * (sg_comm_create_xport; ranks as threads, an in-process mailbox, tests/sg_test_mailbox.h)
 * against the same splits of local (thread) communicators.
 *
 * W = 4: split_nodes(2) as 2 x 2, and split_nodes(2) of a split that reverses the ranks (a
 * child's child: two rank maps composed); W = 3: sg_comm_split into 2 + 1. On every part:
 *  - all-reduce, reduce-scatter (f32, bf16), all-gather and broadcast of random inputs bitwise
 *    equal to the local part's results (the transport's algorithms sum in rank order, and a
 *    sum of two is the same either way round);
 *  - W = 4: a hybrid engine (sg_engine_create_hybrid) on the transport's shard and replica
 *    communicators, bitwise equal to one on the local ones after 3 steps of random gradients;
 *  - a rank that skips a collective of one part: SG_ERR_TIMEOUT within the deadline on the
 *    others, that part broken, the parent and the other parts still working;
 *  - a failing isend callback during a collective of a part: SG_ERR_COMM with the callback's
 *    text, the parent still working;
 *  - two splits of one rank's family members at the same time on two threads: each either
 *    succeeds on every rank of it or fails with SG_ERR_INVALID_STATE on every rank, with the
 *    parent usable (then both succeed one after the other);
 *  - the tag contexts running out (64 communicators of one transport alive on a rank):
 *    SG_ERR_UNSUPPORTED on every rank, the parent usable;
 *  - lifetimes: the parent destroyed before its parts (which keep working), the transport
 *    released exactly once per rank, at its family's last destroy. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/comm/sg_comm.h" /* ops: the collectives of a communicator */
#include "sg_test_check.h"
#include "sg_test_mailbox.h"
#include "shardgrad.h"

enum { MAXW = 8, NPARAM = 1000, STEPS = 3 };
static const size_t k_counts[] = {1, 1000, 65537};
#define NCOUNTS (sizeof k_counts / sizeof *k_counts)
#define SCRATCH ((size_t)65537 * 8)

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* n random elements of dt (f32 in [-1, 1); bf16: the top half of such a float). */
static void fill(void *buf, int dt, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) {
    const float f = (float)((double)(mix(seed * 1000003u + i) >> 11) * 0x1p-52 - 1.0);
    if (dt == SG_F32) {
      ((float *)buf)[i] = f;
    } else {
      uint32_t u;
      memcpy(&u, &f, 4);
      ((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
    }
  }
}

static int same_bits_on(sg_comm *x, sg_comm *l, int op, int dt, size_t n, uint64_t seed) {
  const int w = sg_comm_size(x), me = sg_comm_rank(x);
  const size_t es = dt == SG_F32 ? 4 : 2, total = op == 0 || op == 3 ? n : n * (size_t)w;
  unsigned char *a = calloc(total, es), *b = calloc(total, es);
  if (!a || !b) return free(a), free(b), 0;
  fill(a, dt, total, seed * 131u + (uint64_t)me);
  memcpy(b, a, total * es);
  const int64_t dl = sg__deadline(60000);
  sg_status sa, sb;
  switch (op) {
    case 0:
      sa = x->ops->all_reduce(x, a, n, dt, dl), sb = l->ops->all_reduce(l, b, n, dt, dl);
      break;
    case 1:
      sa = x->ops->reduce_scatter(x, a, n, dt, dl), sb = l->ops->reduce_scatter(l, b, n, dt, dl);
      /* only this rank's slice is specified */
      memmove(a, a + (size_t)me * n * es, n * es), memmove(b, b + (size_t)me * n * es, n * es);
      break;
    case 2:
      sa = x->ops->all_gather(x, a, n * es, dl), sb = l->ops->all_gather(l, b, n * es, dl);
      break;
    default:
      sa = x->ops->broadcast(x, a, n * es, w - 1, dl), sb = l->ops->broadcast(l, b, n * es, w - 1, dl);
  }
  const size_t cmp = op == 1 ? n * es : total * es;
  const int ok = sa == SG_OK && sb == SG_OK && memcmp(a, b, cmp) == 0;
  free(a);
  free(b);
  return ok;
}

/* Every collective on part x (transport) against part l (threads): the same bits. */
static void same_collectives(sg_comm *x, sg_comm *l, const char *what) {
  static const char *const ops[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
  int ok = 1;
  for (int op = 0; op < 4; op++)
    for (int dt = SG_F32; dt <= SG_BF16; dt++)
      for (size_t k = 0; k < NCOUNTS; k++) {
        if (op >= 2 && dt != SG_F32) continue; /* byte moves */
        const int one = same_bits_on(x, l, op, dt, k_counts[k], (uint64_t)(op * 16 + dt * 4 + k));
        if (!one)
          CHECK(0, "%s: %s %s n=%zu bitwise equal to threads", what, ops[op],
                dt == SG_F32 ? "f32" : "bf16", k_counts[k]);
        ok &= one;
      }
  CHECK(ok, "%s (%d of %d ranks): every collective bitwise equal to the thread part's", what,
        sg_comm_rank(x), sg_comm_size(x));
}

/* A hybrid engine over (shard, replica), random gradients per global rank; final params. */
static sg_status train_hybrid(sg_comm *shard, sg_comm *replica, int grank, float *out) {
  sg_config cfg;
  sg_engine *e = NULL;
  int id = -1;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 60000;
  cfg.max_grad_norm = 0.5f;
  if (st == SG_OK) st = sg_engine_create_hybrid(shard, replica, &cfg, &e);
  if (st == SG_OK) st = sg_add_param(e, "w", NPARAM, 0, &id);
  if (st == SG_OK) st = sg_finalize(e);
  float g[NPARAM];
  for (int s = 0; s < STEPS && st == SG_OK; s++) {
    fill(g, SG_F32, NPARAM, 7000u + (uint64_t)(s * 64 + grank));
    st = sg_grad_add(e, id, g, SG_F32);
    if (st == SG_OK) st = sg_step(e, NULL);
  }
  if (st == SG_OK) st = sg_get_param(e, id, out, SG_F32);
  sg_engine_destroy(e);
  return st;
}

typedef struct rank_arg {
  sg_comm *x, *l; /* this rank's transport and thread communicators */
  xuser *u;       /* its transport's user: `released` */
  mailbox *mb;
  pthread_barrier_t *bar;
  sg_status conc[2]; /* the concurrent splits' results, read by rank 0 */
} rank_arg;

static rank_arg g_args[MAXW];

/* The parts of this rank for W: 2 x 2 nodes (W = 4) or 2 + 1 (W = 3), on both kinds. */
static sg_status parts(sg_comm *c, sg_comm **a, sg_comm **b) {
  const int w = sg_comm_size(c), r = sg_comm_rank(c);
  if (w == 4) return sg_comm_split_nodes(c, 2, a, b);
  *b = NULL;
  return sg_comm_split(c, r < 2 ? 0 : 1, r, a);
}

static void compare_parts(rank_arg *a) {
  const int w = sg_comm_size(a->x), r = sg_comm_rank(a->x);
  sg_comm *xa = NULL, *xb = NULL, *la = NULL, *lb = NULL;
  const sg_status s1 = parts(a->x, &xa, &xb), s2 = parts(a->l, &la, &lb);
  if (!CHECK(s1 == SG_OK && s2 == SG_OK, "W=%d: the same split of both kinds", w)) return;
  CHECK(sg_comm_rank(xa) == sg_comm_rank(la) && sg_comm_size(xa) == sg_comm_size(la),
        "W=%d rank %d: part rank %d of %d, as the threads' part", w, r, sg_comm_rank(xa),
        sg_comm_size(xa));
  xa->scratch = malloc(SCRATCH), la->scratch = malloc(SCRATCH);
  xa->scratch_bytes = la->scratch_bytes = SCRATCH;
  same_collectives(xa, la, w == 4 ? "2 x 2 shard" : "2 + 1 split");
  if (xb) same_collectives(xb, lb, "2 x 2 replica");
  if (w == 4) {
    float px[NPARAM], pl[NPARAM];
    const sg_status ex = train_hybrid(xa, xb, r, px), el = train_hybrid(la, lb, r, pl);
    CHECK(ex == SG_OK && el == SG_OK && memcmp(px, pl, sizeof px) == 0,
          "2 x 2 hybrid engine over the transport's parts: the bits of the threads' (%s, %s)",
          sg_status_string(ex), sg_status_string(el));
  }
  free(xa->scratch), free(la->scratch);
  xa->scratch = la->scratch = NULL;
  sg_comm_destroy(xa), sg_comm_destroy(xb), sg_comm_destroy(la), sg_comm_destroy(lb);
}

/* W = 4: a split that reverses the ranks, then split_nodes of it (rank maps composed). */
static void compare_nested(rank_arg *a) {
  const int r = sg_comm_rank(a->x);
  sg_comm *xr = NULL, *lr = NULL, *xs = NULL, *xp = NULL, *ls = NULL, *lp = NULL;
  sg_status st = sg_comm_split(a->x, 0, -r, &xr);
  if (st == SG_OK) st = sg_comm_split(a->l, 0, -r, &lr);
  if (st == SG_OK) st = sg_comm_split_nodes(xr, 2, &xs, &xp);
  if (st == SG_OK) st = sg_comm_split_nodes(lr, 2, &ls, &lp);
  if (CHECK(st == SG_OK && sg_comm_rank(xr) == 3 - r, "reversed split, then 2 x 2 (%s)",
            sg_status_string(st))) {
    xr->scratch = malloc(SCRATCH), lr->scratch = malloc(SCRATCH);
    xr->scratch_bytes = lr->scratch_bytes = SCRATCH;
    same_collectives(xr, lr, "reversed W=4");
    same_collectives(xs, ls, "shard of the reversed");
    same_collectives(xp, lp, "replica of the reversed");
    free(xr->scratch), free(lr->scratch);
    xr->scratch = lr->scratch = NULL;
  }
  sg_comm *all[] = {xs, xp, ls, lp, xr, lr};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) sg_comm_destroy(all[i]);
}

static int parent_works(sg_comm *c) {
  float v = 1.0f;
  return c->ops->all_reduce(c, &v, 1, SG_F32, sg__deadline(60000)) == SG_OK &&
         v == (float)sg_comm_size(c);
}

/* The last rank of part 0 skips an all-reduce (calls one of another size): every rank of part
 * 0 times out; part 0 is broken; the parent and part 1 work. */
static void part_timeout(rank_arg *a) {
  const int w = sg_comm_size(a->x), r = sg_comm_rank(a->x);
  sg_comm *p = NULL, *q = NULL;
  if (!CHECK(parts(a->x, &p, &q) == SG_OK, "W=%d: parts for the timeout case", w)) return;
  const int in0 = r < 2, last0 = r == 1;
  if (in0) {
    float v[65] = {0};
    const sg_status st = p->ops->all_reduce(p, v, last0 ? 65 : 64, SG_F32, sg__deadline(300));
    CHECK(st == SG_ERR_TIMEOUT && strstr(sg_last_error(), "deadline"),
          "rank %d: a part's rank skipped a collective: SG_ERR_TIMEOUT (%s)", r, sg_last_error());
    CHECK(p->ops->all_reduce(p, v, 64, SG_F32, sg__deadline(60000)) == SG_ERR_COMM,
          "rank %d: that part stays broken", r);
  }
  pthread_barrier_wait(a->bar);
  CHECK(parent_works(a->x), "rank %d: the parent still works after its part timed out", r);
  if (q) CHECK(parent_works(q), "rank %d: the other part still works", r);
  if (!in0) CHECK(parent_works(p), "rank %d: the other node's part still works", r);
  sg_comm_destroy(p), sg_comm_destroy(q);
}

/* Every isend fails during a collective of a part: SG_ERR_COMM with the callback's text. */
static void part_callback_error(rank_arg *a) {
  const int r = sg_comm_rank(a->x);
  sg_comm *p = NULL, *q = NULL;
  if (!CHECK(parts(a->x, &p, &q) == SG_OK, "parts for the callback case")) return;
  pthread_barrier_wait(a->bar);
  if (r == 0) atomic_store(&a->mb->fail_sends, 1);
  pthread_barrier_wait(a->bar);
  float v[1000] = {0};
  if (sg_comm_size(p) > 1) {
    const sg_status st = p->ops->all_reduce(p, v, 1000, SG_F32, sg__deadline(500));
    CHECK(st == SG_ERR_COMM && strstr(sg_last_error(), "link to rank") &&
              strstr(sg_last_error(), "isend failed (3)"),
          "rank %d: a failing isend on a part gives SG_ERR_COMM with its text (%s)", r,
          sg_last_error());
  }
  pthread_barrier_wait(a->bar);
  if (r == 0) atomic_store(&a->mb->fail_sends, 0);
  pthread_barrier_wait(a->bar);
  CHECK(parent_works(a->x), "rank %d: the parent works after its part's transfer failed", r);
  sg_comm_destroy(p), sg_comm_destroy(q);
}

typedef struct conc_arg {
  sg_comm *c;
  sg_comm *out;
  sg_status st;
  char why[256];
} conc_arg;

static void *conc_split(void *p) {
  conc_arg *ca = p;
  ca->st = sg_comm_split(ca->c, 0, 0, &ca->out);
  snprintf(ca->why, sizeof ca->why, "%s", ca->st == SG_OK ? "" : sg_last_error());
  return NULL;
}

/* W = 4: the shard and the replica split at the same time, on two threads of every rank. */
static void concurrent_splits(rank_arg *a) {
  const int r = sg_comm_rank(a->x);
  sg_comm *s = NULL, *q = NULL;
  if (!CHECK(sg_comm_split_nodes(a->x, 2, &s, &q) == SG_OK, "parts for the concurrent case"))
    return;
  conc_arg ca[2] = {{s, NULL, SG_OK, ""}, {q, NULL, SG_OK, ""}};
  pthread_t th;
  pthread_create(&th, NULL, conc_split, &ca[1]);
  conc_split(&ca[0]);
  pthread_join(th, NULL);
  a->conc[0] = ca[0].st, a->conc[1] = ca[1].st;
  for (int i = 0; i < 2; i++) {
    CHECK((ca[i].st == SG_OK && ca[i].out) ||
              (ca[i].st == SG_ERR_INVALID_STATE && !ca[i].out &&
               strstr(ca[i].why, "at the same time")),
          "rank %d: a concurrent split gives SG_OK or SG_ERR_INVALID_STATE saying why (%s: %s)",
          r, sg_status_string(ca[i].st), ca[i].why);
    sg_comm_destroy(ca[i].out);
  }
  pthread_barrier_wait(a->bar);
  /* every rank of one split got the same result: shard i holds ranks 2i, 2i+1; replica j
   * holds j, j+2 */
  int agree = 1;
  for (int k = 0; k < 4; k++) {
    agree &= g_args[k].conc[0] == g_args[k ^ 1].conc[0];
    agree &= g_args[k].conc[1] == g_args[k ^ 2].conc[1];
  }
  CHECK(agree, "rank %d: each concurrent split had one result on all its ranks (%s, %s)", r,
        sg_status_string(a->conc[0]), sg_status_string(a->conc[1]));
  pthread_barrier_wait(a->bar);
  sg_comm *s2 = NULL, *q2 = NULL;
  const sg_status e1 = sg_comm_split(s, 0, 0, &s2), e2 = sg_comm_split(q, 0, 0, &q2);
  CHECK(e1 == SG_OK && e2 == SG_OK && parent_works(s) && parent_works(q),
        "rank %d: both split fine one after the other", r);
  sg_comm_destroy(s2), sg_comm_destroy(q2), sg_comm_destroy(s), sg_comm_destroy(q);
}

/* Communicators of one transport alive on a rank: the first and 63 splits use every context;
 * the next split fails on every rank with SG_ERR_UNSUPPORTED, and the parent stays usable. */
static void contexts_run_out(rank_arg *a) {
  const int r = sg_comm_rank(a->x);
  sg_comm *kept[63] = {NULL};
  int made = 0;
  while (made < 63 && sg_comm_split(a->x, 0, 0, &kept[made]) == SG_OK) made++;
  CHECK(made == 63, "rank %d: 63 splits alive beside the first communicator (%d)", r, made);
  sg_comm *one = NULL;
  const sg_status st = sg_comm_split(a->x, 0, 0, &one);
  CHECK(st == SG_ERR_UNSUPPORTED && !one && strstr(sg_last_error(), "context"),
        "rank %d: the 64th communicator: SG_ERR_UNSUPPORTED naming the contexts (%s)", r,
        sg_last_error());
  CHECK(parent_works(a->x) && parent_works(kept[62]), "rank %d: the parent and the splits work", r);
  sg_comm_destroy(kept[0]);
  CHECK(sg_comm_split(a->x, 0, 0, &one) == SG_OK && parent_works(one),
        "rank %d: one destroyed, a split fits again", r);
  sg_comm_destroy(one);
  for (int i = 1; i < made; i++) sg_comm_destroy(kept[i]);
}

/* The parent goes first; its parts keep the transport and work; it is released with the last. */
static void parent_first(rank_arg *a) {
  const int r = sg_comm_rank(a->x);
  sg_comm *p = NULL, *q = NULL;
  if (!CHECK(parts(a->x, &p, &q) == SG_OK, "parts for the lifetime case")) return;
  pthread_barrier_wait(a->bar);
  sg_comm_destroy(a->x);
  a->x = NULL;
  pthread_barrier_wait(a->bar);
  CHECK(__atomic_load_n(&a->u->released, __ATOMIC_SEQ_CST) == 0,
        "rank %d: parent destroyed, parts alive: the transport is not released", r);
  CHECK(parent_works(p) && (!q || parent_works(q)), "rank %d: the parts work without the parent", r);
  sg_comm_destroy(p);
  CHECK(__atomic_load_n(&a->u->released, __ATOMIC_SEQ_CST) == (q ? 0 : 1),
        "rank %d: released only with the family's last communicator", r);
  sg_comm_destroy(q);
  CHECK(__atomic_load_n(&a->u->released, __ATOMIC_SEQ_CST) == 1, "rank %d: released once", r);
}

static void *rank_main(void *p) {
  rank_arg *a = p;
  const int w = sg_comm_size(a->x), r = sg_comm_rank(a->x);
  snprintf(sg_test_tag, sizeof sg_test_tag, "[W=%d rank %d]", w, r);
  sg_test_quiet = r != 0;
  compare_parts(a);
  if (w == 4) compare_nested(a);
  pthread_barrier_wait(a->bar);
  part_timeout(a);
  pthread_barrier_wait(a->bar);
  part_callback_error(a);
  pthread_barrier_wait(a->bar);
  if (w == 4) concurrent_splits(a);
  contexts_run_out(a);
  pthread_barrier_wait(a->bar);
  parent_first(a);
  return NULL;
}

int main(int argc, char **argv) {
  const int w = argc >= 2 ? atoi(argv[1]) : 4;
  if (w != 3 && w != 4) {
    printf("usage: %s 3|4\n", argv[0]);
    return 2;
  }
  mailbox mb;
  mb_init(&mb);
  xuser us[MAXW];
  sg_comm *xs[MAXW], *ls[MAXW];
  pthread_t th[MAXW];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)w);
  if (!CHECK(mb_group(&mb, us, w, xs) == SG_OK && sg_comm_create_local(w, ls) == SG_OK,
             "W=%d transport and thread communicators", w))
    return sg_test_summary("");
  for (int r = 0; r < w; r++) {
    g_args[r] = (rank_arg){xs[r], ls[r], &us[r], &mb, &bar, {SG_OK, SG_OK}};
    pthread_create(&th[r], NULL, rank_main, &g_args[r]);
  }
  for (int r = 0; r < w; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < w; r++) sg_comm_destroy(g_args[r].x), sg_comm_destroy(ls[r]);
  CHECK(atomic_load(&mb.released) == w, "every rank's transport released once (%d)",
        atomic_load(&mb.released));
  pthread_barrier_destroy(&bar);
  mb_free(&mb);
  return sg_test_summary("");
}
