/* Tests of the communicators (src/comm): reduce-scatter, all-reduce, all-gather and broadcast
 * for f32/bf16/f16 (and f64 reductions) at counts 1 .. 3M, with
 *  - exact inputs (small integers): results must equal the integer sums bit for bit;
 *  - random inputs: bitwise equal to an fp32 sum in the backend's documented order rounded once
 *    to the dtype (local: rank order; mpi: around the ring, starting after the chunk's owner),
 *    and within a stated tolerance of a double reference (which a per-hop rounding would miss);
 *  - all-reduce results identical on every rank;
 *  - reduce_scatter_fold bit for bit what reduce_scatter and then the fold give;
 * and the failure paths: a rank that never arrives (timeout, no hang), mismatched calls, invalid
 * arguments on one rank, a broken communicator staying broken, destroy while in use; and a
 * rank waiting for a late peer sleeps instead of spinning (its thread's CPU time).
 *
 *   test_comm --local W          W ranks as threads (local backend)
 *   test_comm --mpi              one rank per process, under mpirun
 *   test_comm --mpi --timeout    under mpirun: one rank skips a collective
 *   test_comm --xport W          W ranks as threads, each an sg_comm_create_xport over an
 *                                in-process mailbox (the MPI algorithms over the public
 *                                transport interface), its timeouts and callback failures */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier */

#include <math.h>    /* fabs, ldexp, frexp */
#include <pthread.h> /* rank threads */
#include <stdarg.h>  /* va_list */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h> /* nanosleep, clock_gettime: the late peer */

#include "comm/sg_comm.h" /* sg_comm, ops, SG__F64 */
#include "core/sg_core.h" /* sg__now_ms, sg__deadline */
#include "sg_test_mailbox.h" /* the caller's transport over an in-process mailbox */
#ifdef SG_HAVE_MPI
#include <mpi.h> /* MPI_Allreduce of the check counts only */
#endif

static atomic_int g_pass, g_fail;
static int g_ring; /* backend under test sums around the MPI ring (else in rank order) */

/* Rank 0 prints what it checked; any rank prints its failures. */
static void check(int rank, int ok, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (ok) {
    atomic_fetch_add(&g_pass, 1);
    if (rank == 0) printf("ok   %s\n", msg);
  } else {
    atomic_fetch_add(&g_fail, 1);
    printf("FAIL rank %d: %s (last error: %s)\n", rank, msg, sg_last_error());
  }
  fflush(stdout);
}

/* ---- dtype conversions written here, independent of the library's -------------------- */

static float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static uint16_t to_bf16(float f) { /* round to nearest even; inputs here are finite */
  const uint32_t u = f32_bits(f);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static float from_f16(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float s = (h & 0x8000) ? -1.0f : 1.0f;
  if (e == 0) return s * ldexpf((float)m, -24);
  return s * ldexpf((float)(m | 1024), e - 25);
}

/* Exact round to nearest even for finite values within f16 range (the tests stay there). */
static uint16_t to_f16(float f) {
  const uint16_t sign = f < 0 ? 0x8000 : 0;
  double a = fabs((double)f);
  if (a == 0) return sign;
  int e;
  frexp(a, &e);                              /* a = m * 2^e, m in [0.5, 1) */
  const int q = e - 11 < -24 ? -24 : e - 11; /* quantum: 11 significant bits, min 2^-24 */
  double n = a / ldexp(1.0, q);              /* exact: a scaled by a power of two */
  double r = floor(n);
  if (n - r > 0.5 || (n - r == 0.5 && fmod(r, 2.0) != 0)) r += 1;
  /* r * 2^q as f16: find its encoding by search-free construction */
  const double v = r * ldexp(1.0, q);
  int ev;
  frexp(v, &ev);
  if (ev - 1 < -14) return (uint16_t)(sign | (uint16_t)(v / ldexp(1.0, -24)));
  const int mant = (int)(v / ldexp(1.0, ev - 11)) - 1024;
  return (uint16_t)(sign | (uint16_t)((ev - 1 + 15) << 10) | (uint16_t)mant);
}

static size_t esize(int dt) { return dt == SG__F64 ? 8 : dt == SG_F32 ? 4 : 2; }

static const char *dname(int dt) {
  static const char *n[] = {"f32", "bf16", "f16", "f64"};
  return n[dt];
}

/* Rounds v (already an fp32 value for the 16-bit types) to dtype and back. */
static double round_to(int dt, double v) {
  switch (dt) {
    case SG_F32:
      return (float)v;
    case SG_BF16:
      return from_bf16(to_bf16((float)v));
    case SG_F16:
      return from_f16(to_f16((float)v));
  }
  return v;
}

static void set_elem(void *buf, int dt, size_t i, double v) {
  switch (dt) {
    case SG_F32:
      ((float *)buf)[i] = (float)v;
      break;
    case SG_BF16:
      ((uint16_t *)buf)[i] = to_bf16((float)v);
      break;
    case SG_F16:
      ((uint16_t *)buf)[i] = to_f16((float)v);
      break;
    default:
      ((double *)buf)[i] = v;
  }
}

static double get_elem(const void *buf, int dt, size_t i) {
  switch (dt) {
    case SG_F32:
      return ((const float *)buf)[i];
    case SG_BF16:
      return from_bf16(((const uint16_t *)buf)[i]);
    case SG_F16:
      return from_f16(((const uint16_t *)buf)[i]);
  }
  return ((const double *)buf)[i];
}

/* ---- inputs -------------------------------------------------------------------------------- */

/* Small integers in [-8, 8]: any sum over <= 8 ranks is exact in every dtype. */
static double exact_val(int k, size_t i) { return (double)((i * 7 + (size_t)k * 13 + 3) % 17) - 8; }

static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Uniform in [-1, 1), representable in dt. */
static double rand_val(int dt, uint64_t seed, int k, size_t i) {
  const uint64_t h = mix(seed * 0x100000001b3ull ^ mix((uint64_t)k * 0x9e37ull + i));
  const double u = (double)(h >> 11) * ldexp(1.0, -53) * 2.0 - 1.0;
  return round_to(dt, u);
}

/* ---- reference ---------------------------------------------------------------------------- */

/* Sum of rank values in the backend's order, rounded once: local and the MPI direct
 * reduce-scatter add ranks 0..W-1; the MPI ring starts chunk q at rank q+1 and ends at its
 * owner q. fp32 sums (f64 for f64). */
static double ordered_sum(int dt, int w, int owner, double (*val)(int, uint64_t, int, size_t),
                          uint64_t seed, size_t i) {
  const int first = g_ring ? (owner + 1) % w : 0;
  if (dt == SG__F64) {
    double acc = val(dt, seed, first, i);
    for (int t = 1; t < w; t++) acc = acc + val(dt, seed, (first + t) % w, i);
    return acc;
  }
  float acc = (float)val(dt, seed, first, i);
  for (int t = 1; t < w; t++) acc = acc + (float)val(dt, seed, (first + t) % w, i);
  return round_to(dt, acc);
}

static double exact_adapter(int dt, uint64_t seed, int k, size_t i) { return exact_val(k, i); }

/* Tolerance of a sum of fp32 values rounded once: per-hop rounding of bf16/f16 exceeds it. */
static int within(int dt, double got, double ref, double abssum, int w) {
  const double eps = dt == SG__F64 ? ldexp(1.0, -52) : ldexp(1.0, -23);
  double tol = (double)w * eps * abssum;
  if (dt == SG_BF16 || dt == SG_F16) {
    const double a = fabs(ref) > fabs(got) ? fabs(ref) : fabs(got);
    int e;
    frexp(a, &e); /* a in [2^(e-1), 2^e) */
    const int bits = dt == SG_BF16 ? 8 : 11;
    double half_ulp = a > 0 ? ldexp(1.0, e - 1 - bits) : 0;
    if (dt == SG_F16 && half_ulp < ldexp(1.0, -25)) half_ulp = ldexp(1.0, -25);
    tol += half_ulp;
  }
  return fabs(got - ref) <= tol;
}

/* ---- one rank's checks ---------------------------------------------------------------------- */

typedef struct rank_ctx {
  sg_comm *c;
  int rank, world;
  int64_t timeout_ms;
} rank_ctx;

static void chunk_of(size_t n, int w, int k, size_t *off, size_t *len) {
  const size_t base = n / (size_t)w, rem = n % (size_t)w, kk = (size_t)k;
  *off = kk * base + (kk < rem ? kk : rem);
  *len = base + (kk < rem ? 1u : 0u);
}

/* Word-wise hash (the byte-wise FNV is slow under the sanitizers on 24 MB buffers). */
static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = SG__HASH_INIT, w;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    memcpy(&w, (const char *)p + i, 8);
    h = mix(h ^ w);
  }
  return sg__hash_bytes(h, (const char *)p + i, n - i);
}

/* Every rank's all-reduce result must have the same bits: gather the hashes. */
static int same_on_all_ranks(rank_ctx *x, uint64_t h) {
  uint64_t *hs = calloc((size_t)x->world, sizeof *hs);
  hs[x->rank] = h;
  int ok = x->c->ops->all_gather(x->c, hs, sizeof *hs, sg__deadline((int)x->timeout_ms)) == SG_OK;
  for (int k = 0; ok && k < x->world; k++) ok = hs[k] == h;
  free(hs);
  return ok;
}

typedef double (*val_fn)(int, uint64_t, int, size_t);

/* Compares each element to the ordered sum (bitwise) and the double reference (tolerance). */
static int verify(rank_ctx *x, const void *buf, int dt, size_t off, size_t len, int owner,
                  val_fn val, uint64_t seed, size_t *bad) {
  for (size_t i = off; i < off + len; i++) {
    const double got = get_elem(buf, dt, i);
    if (val == exact_adapter) { /* integer sums: exact in any order */
      double sum = 0;
      for (int k = 0; k < x->world; k++) sum += exact_val(k, i);
      if (got != sum) {
        *bad = i;
        return 0;
      }
      continue;
    }
    const double want = ordered_sum(dt, x->world, owner, val, seed, i);
    double ref = 0, abssum = 0;
    for (int k = 0; k < x->world; k++) {
      const double v = val(dt, seed, k, i);
      ref += v;
      abssum += fabs(v);
    }
    if (got != want || !within(dt, got, ref, abssum, x->world)) {
      *bad = i;
      return 0;
    }
  }
  return 1;
}

static void test_all_reduce(rank_ctx *x, int dt, size_t n, int random) {
  const val_fn val = random ? rand_val : exact_adapter;
  const uint64_t seed = 1000 + n * 4 + (uint64_t)dt;
  void *buf = malloc(n * esize(dt));
  for (size_t i = 0; i < n; i++) set_elem(buf, dt, i, val(dt, seed, x->rank, i));
  const sg_status st = x->c->ops->all_reduce(x->c, buf, n, dt, sg__deadline((int)x->timeout_ms));
  int ok = st == SG_OK;
  size_t bad = 0;
  /* each rank checks its own chunk; with the bitwise-identical check below that covers all */
  if (ok) {
    size_t off, len;
    chunk_of(n, x->world, x->rank, &off, &len);
    ok = verify(x, buf, dt, off, len, x->rank, val, seed, &bad);
  }
  check(x->rank, ok, "all_reduce %-4s n=%-7zu %s inputs: status %s%s", dname(dt), n,
        random ? "random" : "exact ", sg_status_string(st), ok ? "" : " (element mismatch)");
  if (!ok && st == SG_OK)
    printf("  rank %d element %zu: got %.9g\n", x->rank, bad, get_elem(buf, dt, bad));
  if (st == SG_OK)
    check(x->rank, same_on_all_ranks(x, fnv(buf, n * esize(dt))),
          "all_reduce %-4s n=%-7zu bitwise identical on all ranks", dname(dt), n);
  free(buf);
}

static void test_reduce_scatter(rank_ctx *x, int dt, size_t n, int random) {
  const val_fn val = random ? rand_val : exact_adapter;
  const uint64_t seed = 5000 + n * 4 + (uint64_t)dt;
  const size_t total = n * (size_t)x->world;
  void *buf = malloc(total * esize(dt));
  for (size_t i = 0; i < total; i++) set_elem(buf, dt, i, val(dt, seed, x->rank, i));
  const sg_status st =
      x->c->ops->reduce_scatter(x->c, buf, n, dt, sg__deadline((int)x->timeout_ms));
  size_t bad = 0;
  const int ok =
      st == SG_OK && verify(x, buf, dt, (size_t)x->rank * n, n, x->rank, val, seed, &bad);
  check(x->rank, ok, "reduce_scatter %-4s n=%-7zu %s inputs: status %s", dname(dt), n,
        random ? "random" : "exact ", sg_status_string(st));
  if (!ok && st == SG_OK)
    printf("  rank %d element %zu: got %.9g\n", x->rank, bad, get_elem(buf, dt, bad));
  free(buf);
}

/* reduce_scatter_fold against reduce_scatter of the same inputs followed by the fold written
 * here (acc = the slice rounded to adt, or acc + it in fp32 rounded to adt): bit for bit. */
static void test_reduce_scatter_fold(rank_ctx *x, int dt, size_t n, int adt, int first) {
  if (!x->c->ops->reduce_scatter_fold) return;
  const uint64_t seed = 7000 + n * 4 + (uint64_t)dt;
  const size_t total = n * (size_t)x->world;
  void *buf = malloc(total * esize(dt) + 8), *ref = malloc(total * esize(dt) + 8);
  void *acc = malloc(n * esize(adt) + 8), *want = malloc(n * esize(adt) + 8);
  for (size_t i = 0; i < total; i++) set_elem(buf, dt, i, rand_val(dt, seed, x->rank, i));
  memcpy(ref, buf, total * esize(dt));
  for (size_t i = 0; i < n; i++) set_elem(acc, adt, i, rand_val(adt, seed + 1, x->rank, i));
  memcpy(want, acc, n * esize(adt));
  const int64_t dl = sg__deadline((int)x->timeout_ms);
  const sg_status st0 = x->c->ops->reduce_scatter(x->c, ref, n, dt, dl);
  const sg__fold f = {acc, adt, first};
  const sg_status st = x->c->ops->reduce_scatter_fold(x->c, buf, n, dt, &f, dl);
  for (size_t i = 0; i < n; i++) {
    const float v = (float)get_elem(ref, dt, (size_t)x->rank * n + i);
    set_elem(want, adt, i, first ? v : (float)get_elem(want, adt, i) + v);
  }
  const int ok = st0 == SG_OK && st == SG_OK && memcmp(acc, want, n * esize(adt)) == 0;
  check(x->rank, ok, "reduce_scatter_fold %-4s into %-4s n=%-7zu %s: the bits of reduce_scatter "
        "then the fold (status %s)", dname(dt), dname(adt), n, first ? "first" : "added",
        sg_status_string(st));
  free(buf);
  free(ref);
  free(acc);
  free(want);
}

static unsigned char gather_byte(int k, size_t i) { return (unsigned char)(k * 31 + i * 7 + 1); }

static void test_all_gather(rank_ctx *x, size_t bytes) {
  unsigned char *buf = malloc(bytes * (size_t)x->world);
  memset(buf, 0xEE, bytes * (size_t)x->world);
  for (size_t i = 0; i < bytes; i++) buf[(size_t)x->rank * bytes + i] = gather_byte(x->rank, i);
  const sg_status st = x->c->ops->all_gather(x->c, buf, bytes, sg__deadline((int)x->timeout_ms));
  int ok = st == SG_OK;
  unsigned char *want = malloc(bytes + 1);
  for (int k = 0; ok && k < x->world; k++) {
    for (size_t i = 0; i < bytes; i++) want[i] = gather_byte(k, i);
    ok = memcmp(buf + (size_t)k * bytes, want, bytes) == 0;
  }
  free(want);
  check(x->rank, ok, "all_gather bytes=%-8zu status %s", bytes, sg_status_string(st));
  free(buf);
}

static void test_broadcast(rank_ctx *x, size_t bytes, int root) {
  unsigned char *buf = malloc(bytes);
  for (size_t i = 0; i < bytes; i++)
    buf[i] = x->rank == root ? (unsigned char)(i * 13 + (size_t)root * 5 + 11) : 0xEE;
  const sg_status st =
      x->c->ops->broadcast(x->c, buf, bytes, root, sg__deadline((int)x->timeout_ms));
  int ok = st == SG_OK;
  for (size_t i = 0; ok && i < bytes; i++)
    ok = buf[i] == (unsigned char)(i * 13 + (size_t)root * 5 + 11);
  check(x->rank, ok, "broadcast bytes=%-8zu root=%d status %s", bytes, root, sg_status_string(st));
  free(buf);
}

static const size_t k_counts[] = {1, 63, 64, 65, 1000, 100003, 3000000};
#define N_COUNTS (sizeof k_counts / sizeof k_counts[0])

/* Reduce-scatter and all-gather take a count per rank: the big ones are split over the ranks so
 * that memory does not grow with W. */
static size_t per_rank(size_t n, int w) { return n >= 100003 ? n / (size_t)w : n; }

static void run_collectives(rank_ctx *x) {
  for (int dt = 0; dt <= SG__F64; dt++) {
    for (size_t ci = 0; ci < N_COUNTS; ci++) {
      const size_t n = k_counts[ci];
      /* 3M: f32 (native path) and bf16 (fp32-partials path) cover the multi-piece rings; f16
       * and f64 share those paths and would only add minutes under the sanitizers */
      if (n > 1000000 && (dt == SG_F16 || dt == SG__F64)) continue;
      test_all_reduce(x, dt, n, 0);
      test_reduce_scatter(x, dt, per_rank(n, x->world), 0);
      if (n == 65 || n == 1000 || n == 100003) {
        test_all_reduce(x, dt, n, 1);
        test_reduce_scatter(x, dt, per_rank(n, x->world), 1);
      }
      if (dt != SG__F64 && (n == 1 || n == 1000 || n == 3000000))
        for (int adt = SG_F32; adt <= SG_BF16; adt++)
          test_reduce_scatter_fold(x, dt, per_rank(n, x->world), adt, n != 1000);
    }
  }
  for (size_t ci = 0; ci < N_COUNTS; ci++) {
    const size_t n = k_counts[ci];
    test_all_gather(x, per_rank(n, x->world) * (ci % 2 ? 2 : 4)); /* bf16 and f32 sized */
    test_broadcast(x, n * 2, (int)(ci % (size_t)x->world));
  }
  /* count 0 is a no-op that still succeeds */
  check(x->rank,
        x->c->ops->all_reduce(x->c, NULL, 0, SG_F32, sg__deadline((int)x->timeout_ms)) == SG_OK,
        "all_reduce count 0 is a no-op");
}

/* ---- failure paths (local backend: ranks are threads) ------------------------------------ */

typedef struct fail_ctx {
  sg_comm **to, **mm, **bad;
  pthread_barrier_t *bar;
} fail_ctx;

/* The last rank never calls: the others must return TIMEOUT/COMM (no hang), and after that the
 * communicator stays broken on every rank, the late one included. */
static void test_timeout(int rank, int world, sg_comm *c, pthread_barrier_t *bar) {
  float v[64] = {0};
  if (rank != world - 1) {
    const sg_status st = c->ops->all_reduce(c, v, 64, SG_F32, sg__deadline(200));
    check(rank, st == SG_ERR_TIMEOUT || st == SG_ERR_COMM,
          "timeout: waiting rank returns TIMEOUT or COMM (got %s)", sg_status_string(st));
    check(rank, strstr(sg_last_error(), "timed out") || strstr(sg_last_error(), "deadline"),
          "timeout: message says so ('%s')", sg_last_error());
  }
  pthread_barrier_wait(bar);
  const sg_status st2 = c->ops->all_reduce(c, v, 64, SG_F32, sg__deadline(60000));
  check(rank, st2 == SG_ERR_COMM, "timeout: later call fails at once with COMM (got %s)",
        sg_status_string(st2));
  check(rank, c->broken == 1, "timeout: communicator marked broken");
  pthread_barrier_wait(bar);
  /* still broken a second time, for every op */
  unsigned char b[8];
  check(rank, c->ops->broadcast(c, b, 8, 0, sg__deadline(60000)) == SG_ERR_COMM,
        "timeout: broken stays broken (broadcast)");
}

/* Rank 0 calls with another count (then another op): every rank fails instead of corrupting. */
static void test_mismatch(int rank, int world, sg_comm *c) {
  float v[66] = {0};
  const size_t n = rank == 0 ? 64 : 65;
  const sg_status st = c->ops->all_reduce(c, v, n, SG_F32, sg__deadline(60000));
  check(rank, st == SG_ERR_MISMATCH || st == SG_ERR_COMM,
        "mismatch: count 64 vs 65 detected (got %s)", sg_status_string(st));
  const sg_status st2 = c->ops->reduce_scatter(c, v, 1, SG_F32, sg__deadline(60000));
  check(rank, st2 == SG_ERR_COMM, "mismatch: communicator broken afterwards (got %s)",
        sg_status_string(st2));
}

/* Invalid arguments on one rank: that rank gets INVALID_ARGUMENT, the others fail at once. */
static void test_invalid(int rank, int world, sg_comm *c) {
  float v[4] = {0};
  const int dt = rank == 1 ? 7 : SG_F32;
  const sg_status st = c->ops->all_reduce(c, v, 4, dt, sg__deadline(60000));
  if (rank == 1)
    check(rank, st == SG_ERR_INVALID_ARGUMENT, "invalid dtype rejected (got %s)",
          sg_status_string(st));
  else
    check(rank, st == SG_ERR_COMM || st == SG_ERR_MISMATCH,
          "invalid arguments on a peer: fails at once (got %s)", sg_status_string(st));
}

/* A rank whose peer comes late sleeps while it waits (spin, yield, then nap or, for a transport
 * that signals completion, block): its own thread's CPU time stays a small part of the wait.
 * Waits that only spun and yielded (SG_COMM_WAIT=yield, or before) cost the whole wait on an
 * idle machine, and took that CPU from ranks sharing a core. */
static double thread_cpu_ms(void) {
  struct timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0.0;
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void test_late_peer(rank_ctx *x) {
  if (x->world < 2) return;
  float v[1000] = {0};
  sg_comm *c = x->c;
  check(x->rank, c->ops->all_reduce(c, v, 1000, SG_F32, sg__deadline(60000)) == SG_OK,
        "late peer: a first all_reduce lines the ranks up");
  if (x->rank == x->world - 1) {
    struct timespec late = {0, 400 * 1000000L};
    nanosleep(&late, NULL);
  }
  const int64_t t0 = sg__now_ms();
  const double cpu0 = thread_cpu_ms();
  const sg_status st = c->ops->all_reduce(c, v, 1000, SG_F32, sg__deadline(60000));
  const double cpu = thread_cpu_ms() - cpu0, wall = (double)(sg__now_ms() - t0);
  check(x->rank, st == SG_OK, "late peer: the all_reduce completes (%s)", sg_status_string(st));
  const char *wt = getenv("SG_COMM_WAIT");
  if (x->rank == x->world - 1 || wall < 200.0 || (wt && !strcmp(wt, "yield"))) return;
  check(x->rank, cpu < 0.5 * wall,
        "late peer: waiting %.0f ms cost %.1f ms of this thread's CPU (sleeps, not spins)", wall,
        cpu);
}

/* ---- drivers ---------------------------------------------------------------------------- */

typedef struct thread_arg {
  rank_ctx x;
  fail_ctx f;
} thread_arg;

static void *rank_main(void *p) {
  thread_arg *a = p;
  run_collectives(&a->x);
  test_late_peer(&a->x);
  if (a->x.world > 1) {
    pthread_barrier_wait(a->f.bar);
    test_timeout(a->x.rank, a->x.world, a->f.to[a->x.rank], a->f.bar);
    test_mismatch(a->x.rank, a->x.world, a->f.mm[a->x.rank]);
    test_invalid(a->x.rank, a->x.world, a->f.bad[a->x.rank]);
  }
  return NULL;
}

static void test_api(void) {
  sg_comm *cs[2] = {NULL, NULL};
  check(0, sg_comm_rank(NULL) == -1 && sg_comm_size(NULL) == -1, "rank/size of NULL are -1");
  sg_comm_destroy(NULL); /* NULL is fine (a crash would fail the test) */
  check(0, sg_comm_create_local(0, cs) == SG_ERR_INVALID_ARGUMENT, "create_local(0) rejected");
  check(0, sg_comm_create_local(4097, cs) == SG_ERR_INVALID_ARGUMENT,
        "create_local(4097) rejected");
  check(0, sg_comm_create_local(2, NULL) == SG_ERR_INVALID_ARGUMENT, "create_local(NULL) rejected");
#ifdef SG_HAVE_MPI
  check(0, sg_comm_create_mpi(NULL, NULL) == SG_ERR_INVALID_ARGUMENT,
        "create_mpi(out NULL) rejected");
#else
  sg_comm *m = (sg_comm *)1;
  check(0, sg_comm_create_mpi(NULL, &m) == SG_ERR_UNSUPPORTED && m == NULL,
        "create_mpi without MPI: UNSUPPORTED (%s)", sg_last_error());
#endif
  /* destroy while an engine holds it: the free waits for the last channel (ASan would flag a
   * use after a free that came too early) */
  sg_comm *one = NULL;
  check(0, sg_comm_create_local(1, &one) == SG_OK, "create_local(1)");
  sg_comm *chan = NULL;
  check(0, sg__comm_bind(one, NULL, 0, &chan) == SG_OK && chan && chan->parent == one,
        "bind: a channel of the communicator");
  sg_comm *chan2 = NULL;
  check(0, sg__comm_bind(chan, NULL, 0, &chan2) == SG_ERR_INVALID_ARGUMENT && !chan2,
        "a channel cannot be bound again");
  sg_comm_destroy(one);
  sg_comm_destroy(chan); /* refused too: channels go through sg__comm_unbind */
  float v = 3;
  check(0, one->ops->all_reduce(one, &v, 1, SG_F32, sg__deadline(1000)) ==
               SG_ERR_INVALID_STATE, "a destroyed communicator takes no new work");
  check(0, chan->ops->all_reduce(chan, &v, 1, SG_F32, sg__deadline(1000)) == SG_OK && v == 3,
        "its channel alive works on");
  check(0, sg_comm_rank(one) == 0 && sg_comm_size(one) == 1, "rank/size of a W=1 comm");
  sg_comm *chan3 = NULL;
  check(0, sg__comm_bind(one, NULL, 0, &chan3) == SG_ERR_INVALID_STATE && !chan3,
        "no new channel of a destroyed communicator");
  sg__comm_unbind(chan); /* the last channel: frees `one` */
  check(0, sg__comm_usable(NULL, "x") == SG_ERR_INVALID_ARGUMENT, "usable(NULL) rejected");
  /* a rank that destroys its communicator breaks the group: the other fails at once */
  check(0, sg_comm_create_local(2, cs) == SG_OK, "create_local(2)");
  sg_comm_destroy(cs[1]);
  const sg_status st = cs[0]->ops->all_reduce(cs[0], &v, 1, SG_F32, sg__deadline(60000));
  check(0, st == SG_ERR_COMM && strstr(sg_last_error(), "destroyed"),
        "peer destroyed: call fails at once with COMM (%s)", sg_last_error());
  sg_comm_destroy(cs[0]);
}

static int run_local(int world) {
  test_api();
  sg_comm **cs = calloc((size_t)world * 4, sizeof *cs);
  int ok = sg_comm_create_local(world, cs) == SG_OK;
  for (int g = 1; ok && g < 4; g++) ok = sg_comm_create_local(world, cs + g * world) == SG_OK;
  check(0, ok, "create_local(%d) x4", world);
  if (!ok) return 1;
  const size_t scratch_bytes = sg__comm_scratch_bytes(k_counts[N_COUNTS - 1]);
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)world);
  thread_arg *args = calloc((size_t)world, sizeof *args);
  pthread_t *th = calloc((size_t)world, sizeof *th);
  for (int r = 0; r < world; r++) {
    check(0, sg_comm_rank(cs[r]) == r && sg_comm_size(cs[r]) == world, "rank %d of %d", r, world);
    cs[r]->scratch = malloc(scratch_bytes);
    cs[r]->scratch_bytes = scratch_bytes;
    args[r].x = (rank_ctx){cs[r], r, world, 60000};
    args[r].f = (fail_ctx){cs + world, cs + 2 * world, cs + 3 * world, &bar};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++) free(cs[r]->scratch);
  for (int i = 0; i < 4 * world; i++) sg_comm_destroy(cs[i]);
  pthread_barrier_destroy(&bar);
  free(args);
  free(th);
  free(cs);
  return 0;
}

#ifdef SG_HAVE_MPI
/* Under mpirun: the last rank skips an all-reduce. The others time out (the MPI backend cannot
 * tell its peers), the late rank's next call times out too (its messages carry another tag),
 * after which every later call fails at once; a second communicator is unaffected. */
static void mpi_timeout(rank_ctx *x, size_t n) {
  sg_comm *c2 = NULL;
  const int rank = x->rank, world = x->world;
  check(rank, sg_comm_create_mpi(NULL, &c2) == SG_OK, "timeout: second MPI communicator");
  float *v = calloc(n + 1, sizeof *v);
  c2->scratch = calloc(n + 1, 4);
  c2->scratch_bytes = (n + 1) * 4;
  check(rank, c2->ops->all_reduce(c2, v, n, SG_F32, sg__deadline(60000)) == SG_OK,
        "timeout n=%zu: healthy all_reduce first", n);
  sg_status st;
  if (rank != world - 1) {
    st = c2->ops->all_reduce(c2, v, n, SG_F32, sg__deadline(500));
    check(rank, st == SG_ERR_TIMEOUT || st == SG_ERR_COMM,
          "timeout n=%zu: rank waiting for the skipper returns TIMEOUT/COMM (got %s)", n,
          sg_status_string(st));
  } else {
    st = c2->ops->all_reduce(c2, v, n + 1, SG_F32, sg__deadline(1500));
    check(rank, st == SG_ERR_TIMEOUT || st == SG_ERR_COMM,
          "timeout n=%zu: the late rank's next call does not match stale messages (got %s)", n,
          sg_status_string(st));
  }
  st = c2->ops->all_reduce(c2, v, n, SG_F32, sg__deadline(60000));
  check(rank, st == SG_ERR_COMM, "timeout n=%zu: broken stays broken (got %s)", n,
        sg_status_string(st));
  MPI_Barrier(MPI_COMM_WORLD);
  test_all_reduce(x, SG_F32, 1000, 0); /* the first communicator still works */
  sg_comm_destroy(c2);
  free(v);
}
#endif

static int run_mpi(int timeout_test) {
#ifdef SG_HAVE_MPI
  sg_comm *c = NULL;
  const sg_status st = sg_comm_create_mpi(NULL, &c);
  if (st != SG_OK) {
    printf("FAIL sg_comm_create_mpi: %s\n0 passed, 1 failed\n", sg_last_error());
    return 1;
  }
  /* the algorithm mpi.c reads from the same variable; unset: ring for 2 ranks, else direct */
  const char *algo = getenv("SG_MPI_REDUCE_SCATTER");
  g_ring = algo && *algo ? strcmp(algo, "ring") == 0 : c->world == 2;
  rank_ctx x = {c, c->rank, c->world, 60000};
  c->scratch_bytes = sg__comm_scratch_bytes(k_counts[N_COUNTS - 1]);
  c->scratch = malloc(c->scratch_bytes);
  if (c->rank == 0)
    printf("MPI communicator: %d ranks, threaded %d, reduce-scatter %s (sums in %s order)\n",
           c->world, c->threaded, g_ring ? "ring" : "direct", g_ring ? "ring" : "rank");
  if (timeout_test) {
    mpi_timeout(&x, 64);     /* eager-sized messages */
    mpi_timeout(&x, 300000); /* rendezvous-sized messages, several pieces */
  } else {
    if (c->rank == 0) test_api();
    run_collectives(&x);
    test_late_peer(&x);
  }
  int mine[2] = {atomic_load(&g_pass), atomic_load(&g_fail)}, tot[2] = {0, 0};
  MPI_Allreduce(mine, tot, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  free(c->scratch);
  const int rank = c->rank;
  sg_comm_destroy(c); /* the last one finalizes MPI, which the library initialized */
  if (rank == 0) printf("%d passed, %d failed\n", tot[0], tot[1]);
  return tot[1] != 0;
#else
  printf("built without MPI\n0 passed, 1 failed\n");
  return 1;
#endif
}

/* ---- the caller's transport (sg_comm_create_xport) over an in-process mailbox ------------- */

static void xport_api(void) {
  mailbox mb;
  mb_init(&mb);
  xuser u = {&mb, 0, 0};
  sg_comm *c = (sg_comm *)1;
  sg_xport t = {sizeof t, "mailbox", &u, 1, mb_isend, mb_irecv, mb_cancel, mb_release};
  check(0, sg_comm_create_xport(&t, 0, 2, NULL) == SG_ERR_INVALID_ARGUMENT, "xport: out NULL");
  check(0, sg_comm_create_xport(NULL, 0, 2, &c) == SG_ERR_INVALID_ARGUMENT && !c, "xport: t NULL");
  t.struct_size = 8;
  check(0, sg_comm_create_xport(&t, 0, 2, &c) == SG_ERR_INVALID_ARGUMENT, "xport: struct_size");
  t.struct_size = sizeof t;
  t.cancel = NULL;
  check(0, sg_comm_create_xport(&t, 0, 2, &c) == SG_ERR_INVALID_ARGUMENT &&
               strstr(sg_last_error(), "cancel"), "xport: cancel NULL (%s)", sg_last_error());
  t.cancel = mb_cancel;
  check(0, sg_comm_create_xport(&t, 2, 2, &c) == SG_ERR_INVALID_ARGUMENT, "xport: rank 2 of 2");
  check(0, sg_comm_create_xport(&t, 0, 0, &c) == SG_ERR_INVALID_ARGUMENT, "xport: world 0");
  check(0, sg_xport_done(NULL, 0, 0, NULL) == SG_ERR_INVALID_ARGUMENT, "xport_done(NULL)");
  check(0, sg_comm_create_xport(&t, 0, 1, &c) == SG_OK && sg_comm_size(c) == 1, "xport: W=1");
  sg_comm *chan = NULL;
  check(0, sg__comm_bind(c, NULL, 0, &chan) == SG_OK, "xport: bind a channel");
  float v = 2;
  check(0, chan->ops->all_reduce(chan, &v, 1, SG_F32, sg__deadline(1000)) == SG_OK && v == 2,
        "xport: W=1 all_reduce");
  /* channel 512 would share channel 0's tags (slot = index mod 512) while 0 is alive */
  int binds_ok = 1;
  for (int i = 1; i < 512; i++) {
    sg_comm *other = NULL;
    binds_ok &= sg__comm_bind(c, NULL, 0, &other) == SG_OK;
    sg__comm_unbind(other);
  }
  sg_comm *late = NULL;
  check(0, binds_ok && sg__comm_bind(c, NULL, 0, &late) == SG_ERR_UNSUPPORTED && !late &&
               strstr(sg_last_error(), "would share the tags of channel 0"),
        "xport: a bind whose tag slot a live channel holds is refused (%s)", sg_last_error());
  sg__comm_unbind(chan);
  for (int i = 513; i < 1024; i++) { /* on to channel 1024: slot 0 again */
    sg_comm *other = NULL;
    binds_ok &= sg__comm_bind(c, NULL, 0, &other) == SG_OK;
    sg__comm_unbind(other);
  }
  check(0, binds_ok && sg__comm_bind(c, NULL, 0, &late) == SG_OK,
        "xport: channel 1024 takes slot 0 once channel 0 is gone");
  sg_comm_destroy(c); /* a channel is alive: freed with it */
  check(0, atomic_load(&mb.released) == 0, "xport: not released while a channel is alive");
  sg__comm_unbind(late);
  check(0, atomic_load(&mb.released) == 1, "xport: released once, with the last channel");
  mb_free(&mb);
}

typedef struct xport_arg {
  rank_ctx x;
  sg_comm *late; /* the timeout test's communicator */
  sg_comm *fail; /* the failing-isend test's */
  mailbox *fail_mb;
  pthread_barrier_t *bar;
} xport_arg;

/* The last rank skips an all-reduce: the others time out, the late rank's next call (another
 * tag) times out too; then every call fails at once. */
static void xport_timeout(xport_arg *a, size_t n) {
  const int rank = a->x.rank, world = a->x.world;
  sg_comm *c = a->late;
  float *v = calloc(n + 1, sizeof *v);
  sg_status st;
  if (rank != world - 1)
    st = c->ops->all_reduce(c, v, n, SG_F32, sg__deadline(300));
  else
    st = c->ops->all_reduce(c, v, n + 1, SG_F32, sg__deadline(600));
  check(rank, st == SG_ERR_TIMEOUT && strstr(sg_last_error(), "deadline") &&
                  strstr(sg_last_error(), "sg_comm(mailbox)"),
        "xport timeout n=%zu: TIMEOUT naming the transport (%s)", n, sg_last_error());
  st = c->ops->all_reduce(c, v, n, SG_F32, sg__deadline(60000));
  check(rank, st == SG_ERR_COMM, "xport timeout n=%zu: broken stays broken", n);
  free(v);
}

static void *xport_rank(void *p) {
  xport_arg *a = p;
  run_collectives(&a->x);
  test_late_peer(&a->x);
  if (a->x.world < 2) return NULL;
  pthread_barrier_wait(a->bar);
  xport_timeout(a, 64);
  pthread_barrier_wait(a->bar);
  if (a->x.rank == 0) atomic_store(&a->fail_mb->fail_sends, 1);
  pthread_barrier_wait(a->bar);
  float v[1000] = {0};
  const sg_status st = a->fail->ops->all_reduce(a->fail, v, 1000, SG_F32, sg__deadline(500));
  /* every rank's first send fails: the callback's text comes back with SG_ERR_COMM */
  check(a->x.rank, st == SG_ERR_COMM && strstr(sg_last_error(), "link to rank") &&
                       strstr(sg_last_error(), "isend failed (3)"),
        "xport: a failing isend gives COMM with its message (%s)", sg_last_error());
  return NULL;
}

static int run_xport(int world) {
  xport_api();
  const char *algo = getenv("SG_MPI_REDUCE_SCATTER");
  g_ring = algo && *algo ? strcmp(algo, "ring") == 0 : world == 2;
  mailbox mb[3];
  for (int g = 0; g < 3; g++) mb_init(&mb[g]);
  xuser *us = calloc((size_t)world * 3, sizeof *us);
  sg_comm **cs = calloc((size_t)world * 3, sizeof *cs);
  int ok = 1;
  for (int g = 0; g < 3; g++)
    for (int r = 0; r < world; r++)
      ok &= xport_comm(&mb[g], &us[g * world + r], r, world, &cs[g * world + r]) == SG_OK;
  check(0, ok, "create_xport x3 at W=%d (%s)", world, sg_last_error());
  if (!ok) return 1;
  xport_arg *args = calloc((size_t)world, sizeof *args);
  pthread_t *th = calloc((size_t)world, sizeof *th);
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, (unsigned)world);
  for (int r = 0; r < world; r++) {
    cs[r]->scratch_bytes = sg__comm_scratch_bytes(k_counts[N_COUNTS - 1]);
    cs[r]->scratch = malloc(cs[r]->scratch_bytes);
    args[r] = (xport_arg){{cs[r], r, world, 60000}, cs[world + r], cs[2 * world + r], &mb[2],
                          &bar};
    pthread_create(&th[r], NULL, xport_rank, &args[r]);
  }
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++) free(cs[r]->scratch);
  for (int i = 0; i < 3 * world; i++) sg_comm_destroy(cs[i]);
  for (int g = 0; g < 3; g++) {
    check(0, atomic_load(&mb[g].released) == world, "xport: every communicator released");
    mb_free(&mb[g]);
  }
  pthread_barrier_destroy(&bar);
  free(args);
  free(th);
  free(cs);
  free(us);
  return 0;
}

/* --local W and --xport W: W ranks as threads of this process. */
static int run_threaded(const char *what, const char *arg, int (*run)(int)) {
  const int world = atoi(arg);
  if (world < 1 || world > 64) {
    printf("bad world %s\n", arg);
    return 2;
  }
  printf("%s, W=%d\n", what, world);
  run(world);
  printf("%d passed, %d failed\n", atomic_load(&g_pass), atomic_load(&g_fail));
  return atomic_load(&g_fail) != 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc >= 3 && strcmp(argv[1], "--local") == 0)
    return run_threaded("local backend", argv[2], run_local);
  if (argc >= 3 && strcmp(argv[1], "--xport") == 0)
    return run_threaded("caller's transport (mailbox)", argv[2], run_xport);
  if (argc >= 2 && strcmp(argv[1], "--mpi") == 0)
    return run_mpi(argc >= 3 && strcmp(argv[2], "--timeout") == 0);
  printf("usage: %s --local W | --mpi [--timeout] | --xport W\n", argv[0]);
  return 2;
}
