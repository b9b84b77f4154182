/* Property tests of the shard planner (DESIGN.md section 2) over thousands of random inputs.
 * Usage: test_plan [seed]   (or SG_TEST_SEED=...); the seed in use is printed first. */
#define _POSIX_C_SOURCE 200809L /* fork, setrlimit, clock_gettime */

#include <inttypes.h>     /* PRIu64 */
#include <stdio.h>        /* printf */
#include <stdlib.h>       /* malloc, qsort, strtoull */
#include <string.h>       /* memcmp, strstr */
#include <sys/resource.h> /* setrlimit: out-of-memory paths */
#include <sys/wait.h>     /* waitpid */
#include <time.h>         /* clock_gettime (printed, never asserted) */
#include <unistd.h>       /* fork */

#include "plan/sg_plan.h" /* sg__plan_build */

#define SG_TEST_PRINT_PASSES 0
#define SG_TEST_MAX_FAIL_LINES 30
#include "sg_test_check.h"
/* splitmix64: small, seedable, identical everywhere */
static uint64_t g_rng;
static uint64_t rnd(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static size_t rnd_range(size_t lo, size_t hi) { return lo + (size_t)(rnd() % (hi - lo + 1)); }

typedef struct testcase {
  sg__plan_input *in;
  char (*names)[32];
  int n, world;
  size_t elem_bytes, bucket_bytes;
  uint64_t cfg_hash;
} testcase;

static size_t rnd_numel(int world) {
  switch (rnd() % 10) {
    case 0: {
      static const size_t edge[] = {1, 2, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097};
      return edge[rnd() % (sizeof edge / sizeof edge[0])];
    }
    case 1: return (size_t)64 * (size_t)world + rnd_range(0, 2) - 1 + 1; /* 64W, 64W+1, 64W+2 */
    case 2: return rnd_range((size_t)1 << 30, (size_t)1 << 40);          /* huge: no memory used */
    case 3: return rnd_range(100000, 5000000);
    default: return rnd_range(1, 3000);
  }
}

static size_t rnd_bucket_bytes(size_t elem) {
  switch (rnd() % 4) {
    case 0: return elem * 64 + rnd_range(0, elem - 1); /* the smallest legal bucket */
    case 1: return rnd_range(elem * 64, elem * 4096);
    case 2: return rnd_range(elem * 4096, (size_t)64 << 20);
    default: return ((size_t)1 << rnd_range(8, 36)) + rnd_range(0, 3);
  }
}

static void case_make(testcase *t, int maxn) {
  t->n = (int)rnd_range(1, (size_t)maxn);
  t->world = rnd() % 4 == 0 ? 64 : (int)rnd_range(1, 64);
  t->elem_bytes = rnd() % 2 ? 2 : 4;
  t->bucket_bytes = rnd_bucket_bytes(t->elem_bytes);
  t->cfg_hash = rnd();
  t->in = calloc((size_t)t->n, sizeof *t->in);
  t->names = calloc((size_t)t->n, sizeof *t->names);
  for (int i = 0; i < t->n; i++) {
    snprintf(t->names[i], sizeof t->names[i], "layer%d.w%u", i, (unsigned)(rnd() % 1000));
    t->in[i].name = t->names[i];
    t->in[i].numel = rnd_numel(t->world);
    t->in[i].flags = (uint32_t)(rnd() % 2);
  }
}

static void case_free(testcase *t) {
  free(t->in);
  free(t->names);
}

static size_t align_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

/* Buckets: contiguous, aligned, padded, in plan order, sized by the bucket rule. */
static void check_buckets(const testcase *t, const sg__plan *p) {
  size_t W = (size_t)t->world, unit = 64 * W, start = 0, max = 0;
  int first = 0;
  CHECK(p->nbuckets >= 1 && p->nbuckets <= t->n, "nbuckets %d", p->nbuckets);
  CHECK(p->bucket_elems == t->bucket_bytes / t->elem_bytes, "bucket_elems %zu", p->bucket_elems);
  for (int b = 0; b < p->nbuckets; b++) {
    const sg__bucket *bk = &p->buckets[b];
    CHECK(bk->start == start && bk->start % unit == 0, "bucket %d start %zu", b, bk->start);
    CHECK(bk->numel > 0 && bk->numel % unit == 0, "bucket %d numel %zu", b, bk->numel);
    CHECK(bk->shard_offset == start / W, "bucket %d shard_offset %zu", b, bk->shard_offset);
    CHECK(bk->first_param == first && bk->param_count >= 1, "bucket %d params", b);
    size_t rel = 0;
    for (int k = bk->first_param; k < bk->first_param + bk->param_count; k++) {
      const sg__plan_param *pp = &p->params[p->order[k]];
      size_t want = align_up(rel, 64);
      CHECK(pp->bucket == b && pp->offset == start + want, "param %d offset %zu want %zu",
            p->order[k], pp->offset, start + want);
      /* Every param after the first fits inside the target size. */
      if (k > bk->first_param)
        CHECK(want + pp->numel <= p->bucket_elems, "bucket %d overfilled by param %d", b,
              p->order[k]);
      rel = want + pp->numel;
    }
    CHECK(bk->numel == align_up(rel, unit), "bucket %d padding: numel %zu used %zu", b, bk->numel,
          rel);
    /* The next bucket exists only because its first param would not fit in this one. */
    if (b + 1 < p->nbuckets) {
      size_t nxt = p->params[p->order[first + bk->param_count]].numel;
      CHECK(align_up(rel, 64) + nxt > p->bucket_elems, "bucket %d closed early", b);
    }
    if (bk->numel > max) max = bk->numel;
    start += bk->numel;
    first += bk->param_count;
  }
  CHECK(first == t->n, "bucket param counts sum to %d of %d", first, t->n);
  CHECK(p->total_numel == start && p->shard_numel * W == start, "total %zu", p->total_numel);
  CHECK(p->max_bucket_numel == max, "max_bucket_numel %zu want %zu", p->max_bucket_numel, max);
}

static void check_params(const testcase *t, const sg__plan *p) {
  CHECK(p->world == t->world && p->nparams == t->n, "world %d nparams %d", p->world, p->nparams);
  int ok_order = 1, ok_fields = 1;
  for (int k = 0; k < t->n; k++) ok_order &= p->order[k] == t->n - 1 - k;
  for (int id = 0; id < t->n; id++) {
    const sg__plan_param *pp = &p->params[id];
    ok_fields &= pp->numel == t->in[id].numel && pp->flags == t->in[id].flags;
    ok_fields &= pp->order == t->n - 1 - id && pp->offset % SG_PLAN_ALIGN == 0;
  }
  CHECK(ok_order, "plan order is reverse registration order");
  CHECK(ok_fields, "params[]: numel, flags, order, 64-aligned offset");
}

typedef struct span {
  size_t lo, len;
} span;
static int span_cmp(const void *a, const void *b) {
  size_t x = ((const span *)a)->lo, y = ((const span *)b)->lo;
  return x < y ? -1 : x > y;
}

/* Fragments of one param over all ranks tile [0, numel); each maps into its rank's slice. */
static int check_param_frags(const sg__plan *p, int id, span *tmp) {
  size_t W = (size_t)p->world, nf = 0;
  const sg__plan_param *pp = &p->params[id];
  for (size_t r = 0; r < W; r++) {
    size_t a = p->frag_index[id * W + r], e = p->frag_index[id * W + r + 1];
    if (e < a) return 0;
    for (size_t f = a; f < e; f++) {
      const sg__fragment *fr = &p->frags[f];
      size_t slice = sg__plan_slice_numel(p, fr->bucket);
      size_t s0 = sg__plan_slice_start(p, fr->bucket, (int)r);
      size_t flat = pp->offset + fr->param_offset;
      if (fr->length == 0 || fr->bucket != pp->bucket) return 0;
      if (fr->param_offset + fr->length > pp->numel) return 0;
      if (flat < s0 || flat + fr->length > s0 + slice) return 0;
      if (fr->shard_offset != p->buckets[fr->bucket].shard_offset + (flat - s0)) return 0;
      if (f > a && fr->param_offset < p->frags[f - 1].param_offset) return 0; /* sorted */
      tmp[nf++] = (span){fr->param_offset, fr->length};
    }
  }
  qsort(tmp, nf, sizeof *tmp, span_cmp);
  size_t pos = 0;
  for (size_t i = 0; i < nf; i++) {
    if (tmp[i].lo != pos) return 0; /* a gap or an overlap: some element owned 0 or 2 times */
    pos += tmp[i].len;
  }
  return pos == pp->numel;
}

/* Per rank: fragments never overlap inside the shard; padding is what is left over. */
static void check_shards(const testcase *t, const sg__plan *p, span *tmp) {
  size_t W = (size_t)t->world, owned_all = 0, numel_all = 0;
  int ok = 1;
  for (int id = 0; id < t->n; id++) numel_all += t->in[id].numel;
  for (size_t r = 0; r < W; r++) {
    size_t nf = 0, owned = 0;
    for (int id = 0; id < t->n; id++)
      for (size_t f = p->frag_index[id * W + r]; f < p->frag_index[id * W + r + 1]; f++)
        tmp[nf++] = (span){p->frags[f].shard_offset, p->frags[f].length};
    qsort(tmp, nf, sizeof *tmp, span_cmp);
    for (size_t i = 0; i < nf; i++) {
      if (i > 0 && tmp[i].lo < tmp[i - 1].lo + tmp[i - 1].len) ok = 0;
      owned += tmp[i].len;
    }
    if (nf && tmp[nf - 1].lo + tmp[nf - 1].len > p->shard_numel) ok = 0;
    owned_all += owned;
  }
  CHECK(ok, "shards: fragments disjoint and inside shard_numel %zu", p->shard_numel);
  CHECK(owned_all == numel_all && p->total_numel - numel_all == W * p->shard_numel - owned_all,
        "padding: owned %zu of %zu elements", owned_all, numel_all);
}

static size_t frag_capacity(const testcase *t) {
  return (size_t)t->n + (size_t)t->n * (size_t)t->world;
}

static void check_plan(const testcase *t, const sg__plan *p) {
  size_t W = (size_t)t->world;
  check_params(t, p);
  check_buckets(t, p);
  size_t nfr = p->frag_index[(size_t)t->n * W];
  CHECK(p->frag_index[0] == 0 && nfr >= (size_t)t->n && nfr <= frag_capacity(t), "frag count %zu",
        nfr);
  span *tmp = malloc((nfr + 1) * sizeof *tmp);
  int ok = 1;
  for (int id = 0; id < t->n && ok; id++) ok = check_param_frags(p, id, tmp);
  CHECK(ok, "every element of every param owned by exactly one rank (fragments tile it)");
  check_shards(t, p, tmp);
  free(tmp);
}

/* Field by field: struct padding is not part of the plan. */
static int plans_equal(const sg__plan *a, const sg__plan *b) {
  size_t n = (size_t)a->nparams, W = (size_t)a->world;
  if (a->hash != b->hash || a->nbuckets != b->nbuckets || a->total_numel != b->total_numel ||
      a->shard_numel != b->shard_numel || a->max_bucket_numel != b->max_bucket_numel)
    return 0;
  for (size_t i = 0; i < n; i++) {
    const sg__plan_param *x = &a->params[i], *y = &b->params[i];
    if (x->offset != y->offset || x->numel != y->numel || x->flags != y->flags ||
        x->bucket != y->bucket || x->order != y->order || a->order[i] != b->order[i] ||
        a->param_hash[i] != b->param_hash[i])
      return 0;
  }
  for (int i = 0; i < a->nbuckets; i++) {
    const sg__bucket *x = &a->buckets[i], *y = &b->buckets[i];
    if (x->start != y->start || x->numel != y->numel || x->shard_offset != y->shard_offset ||
        x->first_param != y->first_param || x->param_count != y->param_count)
      return 0;
  }
  if (memcmp(a->frag_index, b->frag_index, (n * W + 1) * sizeof *a->frag_index)) return 0;
  for (size_t f = 0; f < a->frag_index[n * W]; f++) {
    const sg__fragment *x = &a->frags[f], *y = &b->frags[f];
    if (x->bucket != y->bucket || x->param_offset != y->param_offset ||
        x->shard_offset != y->shard_offset || x->length != y->length)
      return 0;
  }
  return 1;
}

static sg__plan *build(const testcase *t) {
  sg__plan *p = NULL;
  sg_status st =
      sg__plan_build(t->in, t->n, t->world, t->elem_bytes, t->bucket_bytes, t->cfg_hash, &p);
  CHECK(st == SG_OK && p, "build n=%d W=%d elem=%zu bucket=%zu: %s %s", t->n, t->world,
        t->elem_bytes, t->bucket_bytes, sg_status_string(st), sg_last_error());
  return st == SG_OK ? p : NULL;
}

/* Any change to a name, numel, flag, W, elem size, bucket size or cfg_hash changes the hash;
 * a param's own hash changes with its own fields only. */
static void check_hash_sensitivity(testcase *t, const sg__plan *p) {
  int id = (int)rnd_range(0, (size_t)t->n - 1);
  for (int what = 0; what < 7; what++) {
    testcase m = *t;
    sg__plan_input saved = t->in[id];
    char name[32];
    if (what == 0) {
      snprintf(name, sizeof name, "%s", t->in[id].name);
      name[rnd() % strlen(name)] ^= 1;
      t->in[id].name = name;
    }
    if (what == 1) t->in[id].numel += 1;
    if (what == 2) t->in[id].flags ^= 1u;
    if (what == 3) m.world = t->world == 64 ? 63 : t->world + 1;
    if (what == 4) m.bucket_bytes += 1; /* same bucket length in elements at times: still hashed */
    if (what == 5) m.elem_bytes = 6 - t->elem_bytes;
    if (what == 6) m.cfg_hash ^= 1;
    if (what == 5 && m.bucket_bytes / m.elem_bytes < 64) m.bucket_bytes = 64 * m.elem_bytes;
    sg__plan *q = build(&m);
    if (q) {
      CHECK(q->hash != p->hash, "hash unchanged after change %d to param %d", what, id);
      if (what <= 2) CHECK(q->param_hash[id] != p->param_hash[id], "param_hash %d unchanged", id);
      if (what > 2) CHECK(q->param_hash[id] == p->param_hash[id], "param_hash %d changed", id);
    }
    sg__plan_free(q);
    t->in[id] = saved;
  }
}

static void test_random(int count, int maxn) {
  printf("random plans: %d cases, up to %d params, W in 1..64 ...\n", count, maxn);
  for (int c = 0; c < count; c++) {
    testcase t;
    case_make(&t, maxn);
    sg__plan *a = build(&t), *b = build(&t);
    if (a && b) {
      check_plan(&t, a);
      CHECK(plans_equal(a, b), "determinism: two builds differ (case %d)", c);
      if (c % 4 == 0) check_hash_sensitivity(&t, a);
    }
    sg__plan_free(a);
    sg__plan_free(b);
    case_free(&t);
  }
}

/* Hand-computed layouts, so the properties are not only checked against themselves. */
static void test_known(void) {
  printf("known layouts ...\n");
  sg__plan_input in[3] = {{"a", 100, 0}, {"b", 10, 1}, {"c", 30, 0}};
  sg__plan *p = NULL;
  /* W=2, f32, bucket 128 elements: order c(0..30) b(64..74) | a(0..100); units of 128. */
  CHECK(sg__plan_build(in, 3, 2, 4, 512, 0, &p) == SG_OK, "build: %s", sg_last_error());
  if (!p) return;
  CHECK(p->nbuckets == 2 && p->order[0] == 2 && p->order[1] == 1 && p->order[2] == 0, "order");
  CHECK(p->params[2].offset == 0 && p->params[1].offset == 64 && p->params[0].offset == 128,
        "offsets %zu %zu %zu", p->params[2].offset, p->params[1].offset, p->params[0].offset);
  CHECK(p->buckets[0].numel == 128 && p->buckets[1].start == 128 && p->buckets[1].numel == 128,
        "buckets");
  CHECK(p->total_numel == 256 && p->shard_numel == 128, "total %zu", p->total_numel);
  /* Param a at [128, 228): rank 0 owns [128,192) -> 64 elems at shard 64; rank 1 36 at 64. */
  const sg__fragment *f0 = &p->frags[p->frag_index[0 * 2 + 0]];
  const sg__fragment *f1 = &p->frags[p->frag_index[0 * 2 + 1]];
  CHECK(f0->length == 64 && f0->param_offset == 0 && f0->shard_offset == 64, "a rank0 frag");
  CHECK(f1->length == 36 && f1->param_offset == 64 && f1->shard_offset == 64, "a rank1 frag");
  CHECK(p->frag_index[2 * 2 + 2] - p->frag_index[2 * 2 + 1] == 0, "c not owned by rank 1");
  CHECK(p->frag_index[1 * 2 + 1] - p->frag_index[1 * 2 + 0] == 0, "b not owned by rank 0");
  sg__plan_free(p);
  /* A param bigger than a bucket gets its own; the next one starts a new bucket. */
  sg__plan_input big[3] = {{"x", 5, 0}, {"y", 1000, 0}, {"z", 5, 0}};
  CHECK(sg__plan_build(big, 3, 1, 2, 128, 0, &p) == SG_OK, "build: %s", sg_last_error());
  if (!p) return;
  CHECK(p->nbuckets == 3 && p->buckets[1].param_count == 1 && p->params[1].bucket == 1,
        "oversized param alone (%d buckets)", p->nbuckets);
  sg__plan_free(p);
  /* NULL names are allowed and hash differently from "". */
  sg__plan_input n1 = {NULL, 7, 0}, n2 = {"", 7, 0};
  sg__plan *q = NULL;
  CHECK(sg__plan_build(&n1, 1, 3, 4, 256, 0, &p) == SG_OK, "NULL name build");
  CHECK(sg__plan_build(&n2, 1, 3, 4, 256, 0, &q) == SG_OK, "empty name build");
  if (p && q) CHECK(p->hash != q->hash, "NULL and \"\" names hash differently");
  sg__plan_free(p);
  sg__plan_free(q);
}

static void expect_bad(const sg__plan_input *in, int n, int w, size_t eb, size_t bb, sg_status want,
                       const char *what) {
  sg__plan *p = (sg__plan *)&p; /* must come back NULL */
  sg__err_clear();
  sg_status st = sg__plan_build(in, n, w, eb, bb, 0, &p);
  const char *msg = sg_last_error();
  CHECK(st == want && p == NULL && strstr(msg, "sg__plan_build") != NULL,
        "%s: got %s, message '%s'", what, sg_status_string(st), msg);
  printf("  rejected %-26s -> %s: %s\n", what, sg_status_string(st), msg);
}

static void test_bad_inputs(void) {
  printf("bad inputs ...\n");
  sg__plan_input ok[2] = {{"a", 10, 0}, {"b", 20, 0}};
  sg__plan_input zero[2] = {{"a", 10, 0}, {"b", 0, 0}};
  sg__plan_input huge1[1] = {{"h", SIZE_MAX - 5, 0}};
  sg__plan_input huge2[2] = {{"h1", SIZE_MAX / 2, 0}, {"h2", SIZE_MAX / 2, 0}};
  sg__plan_input huge3[1] = {{"h", SIZE_MAX / 8 + 1, 0}};
  const sg_status E = SG_ERR_INVALID_ARGUMENT;
  expect_bad(NULL, 2, 2, 4, 4096, E, "params NULL");
  expect_bad(ok, 0, 2, 4, 4096, E, "nparams 0");
  expect_bad(ok, -3, 2, 4, 4096, E, "nparams -3");
  expect_bad(ok, 2, 0, 4, 4096, E, "world 0");
  expect_bad(ok, 2, 4097, 4, 4096, E, "world 4097");
  expect_bad(ok, 2, -1, 4, 4096, E, "world -1");
  expect_bad(ok, 2, 2, 3, 4096, E, "elem_bytes 3");
  expect_bad(ok, 2, 2, 8, 4096, E, "elem_bytes 8");
  expect_bad(ok, 2, 2, 4, 255, E, "bucket_bytes 255 (f32)");
  expect_bad(ok, 2, 2, 2, 127, E, "bucket_bytes 127 (bf16)");
  expect_bad(zero, 2, 2, 4, 4096, E, "numel 0");
  expect_bad(huge1, 1, 3, 4, 4096, E, "numel SIZE_MAX-5");
  expect_bad(huge2, 2, 1, 4, 4096, E, "two params of SIZE_MAX/2");
  expect_bad(huge3, 1, 1, 4, 4096, E, "total beyond SIZE_MAX/8");
  sg__err_clear();
  sg_status st = sg__plan_build(ok, 2, 2, 4, 4096, 0, NULL);
  CHECK(st == E && sg_last_error()[0] != '\0', "out NULL: %s", sg_status_string(st));
  sg__plan_free(NULL); /* must be a no-op */
  CHECK(1 + 1 == 2, "sg__plan_free(NULL) returned");
}

/* Out-of-memory paths: a child process with a small address-space limit builds a plan whose
 * fragment index cannot fit. Skipped under sanitizers, whose allocators reserve huge ranges. */
static void test_oom(void) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  printf("out of memory: skipped under sanitizers\n");
#else
  printf("out of memory (address-space limit in a child process) ...\n");
  int n = 20000;
  sg__plan_input *in = calloc((size_t)n, sizeof *in);
  for (int i = 0; i < n; i++) in[i] = (sg__plan_input){NULL, (size_t)(i % 97) + 1, 0};
  fflush(stdout); /* the child must not print the parent's buffered lines again */
  pid_t pid = fork();
  if (pid == 0) {
    struct rlimit rl = {(rlim_t)512 << 20, (rlim_t)512 << 20};
    setrlimit(RLIMIT_AS, &rl);
    sg__plan *p = NULL; /* 20000*4096 index entries = 655 MB > limit */
    sg_status st = sg__plan_build(in, n, 4096, 4, 1 << 20, 0, &p);
    int ok = st == SG_ERR_OUT_OF_MEMORY && p == NULL && strstr(sg_last_error(), "allocate");
    if (ok) printf("  got %s: %s\n", sg_status_string(st), sg_last_error());
    fflush(stdout);
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
  free(in);
#endif
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The large case of the brief: built and fully checked; its time is printed, not asserted. */
static void test_large(void) {
  testcase t = {0};
  t.n = 100000;
  t.world = 64;
  t.elem_bytes = 2;
  t.bucket_bytes = (size_t)32 << 20;
  t.in = calloc((size_t)t.n, sizeof *t.in);
  t.names = calloc((size_t)t.n, sizeof *t.names);
  for (int i = 0; i < t.n; i++) {
    snprintf(t.names[i], sizeof t.names[i], "blocks.%d.weight", i);
    t.in[i] = (sg__plan_input){t.names[i], rnd_numel(64) % 5000000 + 1, (uint32_t)(i & 1)};
  }
  double t0 = now_s();
  sg__plan *p = build(&t);
  double t1 = now_s();
  printf("large plan: %d params, W=%d: built in %.3f s\n", t.n, t.world, t1 - t0);
  if (p) check_plan(&t, p);
  sg__plan_free(p);
  case_free(&t);
}

int main(int argc, char **argv) {
  const char *env = getenv("SG_TEST_SEED");
  uint64_t seed = 20240611;
  if (argc > 1)
    seed = strtoull(argv[1], NULL, 0);
  else if (env && env[0])
    seed = strtoull(env, NULL, 0);
  g_rng = seed;
  printf("test_plan seed %" PRIu64 " (rerun: test_plan %" PRIu64 ")\n", seed, seed);
  test_known();
  test_bad_inputs();
  test_random(3000, 60);
  test_random(200, 1500);
  test_oom();
  test_large();
  return sg_test_summary("");
}
