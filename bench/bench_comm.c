/* sg_bench_comm: bandwidth of the MPI communicator's collectives beside Open MPI's own, on the
 * same buffers in the same run (nccl-tests conventions).
 *
 *   mpirun -np 2 sg_bench_comm [--min BYTES] [--max BYTES] [--dtype f32|bf16] [--iters N]
 *                              [--ops rs,ag,ar]
 *   (Open MPI as root: add --allow-run-as-root; more ranks than cores: --oversubscribe)
 *
 * For each size S (64 KiB .. 256 MiB, powers of 4), S is the whole buffer: reduce-scatter
 * reduces S into S/W per rank, all-gather fills S from S/W per rank, all-reduce reduces S.
 *   algbw = S / time; busbw = algbw * (W-1)/W (reduce-scatter, all-gather), 2(W-1)/W
 *   (all-reduce); time = mean over the iterations of a round, slowest rank; the median of 5
 *   rounds (ours and MPI's alternate) is reported, as the machine may be shared.
 *   ratio = our busbw / MPI's busbw
 * MPI counterparts: MPI_Reduce_scatter_block, MPI_Allgather (in place), MPI_Allreduce (in
 * place), MPI_FLOAT / MPI_SUM. bf16 has no MPI type: with --dtype bf16 the MPI column is the
 * f32 call on the same number of elements (twice the bytes).
 * Before timing, an untimed pass with small-integer inputs (exact sums) checks every result;
 * a failed check is printed and makes the exit status non-zero. SG_COLL_ALLGATHER=direct|ring|mpi
 * selects our all-gather algorithm, SG_COLL_REDUCE_SCATTER=ring|direct our reduce-scatter (and
 * all-reduce's first half). */
#define _POSIX_C_SOURCE 200809L

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/sg_comm.h" /* sg_comm ops, scratch */
#include "core/sg_core.h" /* sg__deadline */

enum { OP_RS, OP_AG, OP_AR };
static const char *const op_names[] = {"reduce_scatter", "all_gather", "all_reduce"};

typedef struct opts {
  size_t min_bytes, max_bytes;
  int dtype, iters;
  const char *ops; /* subset, e.g. "rs,ag" (default all) */
} opts;

static int g_bad; /* failed correctness checks on this rank */

static uint16_t f32_to_bf16_exact(float f) { /* inputs are small integers: truncation is exact */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float exact_val(int rank, size_t i) { return (float)((i * 7 + (size_t)rank * 13) % 17) - 8; }

static void fill(void *buf, int dtype, size_t n, int rank) {
  for (size_t i = 0; i < n; i++) {
    if (dtype == SG_F32)
      ((float *)buf)[i] = exact_val(rank, i);
    else
      ((uint16_t *)buf)[i] = f32_to_bf16_exact(exact_val(rank, i));
  }
}

static float get(const void *buf, int dtype, size_t i) {
  return dtype == SG_F32 ? ((const float *)buf)[i] : bf16_to_f32(((const uint16_t *)buf)[i]);
}

/* buf[off..off+n) must hold the sum over ranks of exact_val at global index base+i. */
static void expect_sums(const char *what, const void *buf, int dtype, size_t off, size_t n,
                        size_t base, int world, int rank) {
  for (size_t i = 0; i < n; i++) {
    float want = 0;
    for (int k = 0; k < world; k++) want += exact_val(k, base + i);
    if (get(buf, dtype, off + i) != want) {
      printf("CHECK FAILED rank %d: %s element %zu: %g != %g\n", rank, what, base + i,
             (double)get(buf, dtype, off + i), (double)want);
      g_bad++;
      return;
    }
  }
}

static void expect_gather(const char *what, const unsigned char *buf, size_t per, int world,
                          int rank) {
  for (int k = 0; k < world; k++)
    for (size_t i = 0; i < per; i++)
      if (buf[(size_t)k * per + i] != (unsigned char)(k * 29 + i * 3 + 1)) {
        printf("CHECK FAILED rank %d: %s slice %d byte %zu\n", rank, what, k, i);
        g_bad++;
        return;
      }
}

static void fill_gather(unsigned char *buf, size_t per, int world, int rank) {
  memset(buf, 0, per * (size_t)world);
  for (size_t i = 0; i < per; i++)
    buf[(size_t)rank * per + i] = (unsigned char)(rank * 29 + i * 3 + 1);
}

/* ---- one call of each implementation ------------------------------------------------------ */

typedef struct bufs {
  void *a;      /* S bytes: the in-place buffer */
  void *recv;   /* S/W bytes: MPI_Reduce_scatter_block's output */
  size_t bytes; /* S */
} bufs;

static int ours(sg_comm *c, int op, const bufs *b, int dtype) {
  const size_t es = dtype == SG_F32 ? 4 : 2, w = (size_t)c->world;
  const int64_t dl = sg__deadline(600000);
  sg_status st = SG_OK;
  if (op == OP_RS) st = c->ops->reduce_scatter(c, b->a, b->bytes / es / w, dtype, dl);
  if (op == OP_AG) st = c->ops->all_gather(c, b->a, b->bytes / w, dl);
  if (op == OP_AR) st = c->ops->all_reduce(c, b->a, b->bytes / es, dtype, dl);
  if (st != SG_OK) printf("rank %d: %s failed: %s\n", c->rank, op_names[op], sg_last_error());
  return st == SG_OK;
}

/* MPI's call on the same buffer; bf16 runs the f32 call on the same element count, reading
 * past S: the caller allocates twice S in that case. */
static int theirs(int op, const bufs *b, int dtype, int world) {
  const size_t n = b->bytes / (dtype == SG_F32 ? 4 : 2), w = (size_t)world;
  int rc = MPI_SUCCESS;
  if (op == OP_RS)
    rc = MPI_Reduce_scatter_block(b->a, b->recv, (int)(n / w), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  if (op == OP_AG)
    rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, b->a, (int)(b->bytes / w), MPI_BYTE,
                       MPI_COMM_WORLD);
  if (op == OP_AR)
    rc = MPI_Allreduce(MPI_IN_PLACE, b->a, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return rc == MPI_SUCCESS;
}

/* ---- correctness (untimed) --------------------------------------------------------------------
 */

static void check_ours(sg_comm *c, int op, const bufs *b, int dtype) {
  const size_t es = dtype == SG_F32 ? 4 : 2, w = (size_t)c->world, n = b->bytes / es;
  const size_t r = (size_t)c->rank;
  if (op == OP_AG) {
    fill_gather(b->a, b->bytes / w, c->world, c->rank);
    if (ours(c, op, b, dtype))
      expect_gather("ours all_gather", b->a, b->bytes / w, c->world, c->rank);
    return;
  }
  fill(b->a, dtype, n, c->rank);
  if (!ours(c, op, b, dtype)) {
    g_bad++;
    return;
  }
  if (op == OP_RS)
    expect_sums("ours reduce_scatter", b->a, dtype, r * (n / w), n / w, r * (n / w), c->world,
                c->rank);
  if (op == OP_AR) expect_sums("ours all_reduce", b->a, dtype, 0, n, 0, c->world, c->rank);
}

static void check_theirs(int op, const bufs *b, int world, int rank) {
  const size_t n = b->bytes / 4, w = (size_t)world;
  if (op == OP_AG) {
    fill_gather(b->a, b->bytes / w, world, rank);
    if (theirs(op, b, SG_F32, world))
      expect_gather("MPI_Allgather", b->a, b->bytes / w, world, rank);
    return;
  }
  fill(b->a, SG_F32, n, rank);
  if (!theirs(op, b, SG_F32, world)) {
    g_bad++;
    return;
  }
  if (op == OP_RS)
    expect_sums("MPI_Reduce_scatter_block", b->recv, SG_F32, 0, n / w, (size_t)rank * (n / w),
                world, rank);
  if (op == OP_AR) expect_sums("MPI_Allreduce", b->a, SG_F32, 0, n, 0, world, rank);
}

/* ---- timing -----------------------------------------------------------------------------------
 */

/* Mean seconds per call on the slowest rank, after one warm-up call. Buffers hold zeros so
 * that repeated in-place sums stay finite (the speed of an add does not depend on the value). */
static double time_calls(sg_comm *c, int mine, int op, const bufs *b, int dtype, int iters) {
  if (!(mine ? ours(c, op, b, dtype) : theirs(op, b, dtype, c->world))) return -1;
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; i++)
    if (!(mine ? ours(c, op, b, dtype) : theirs(op, b, dtype, c->world))) return -1;
  double t = (MPI_Wtime() - t0) / iters, tmax = 0;
  MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return tmax;
}

#define SG_BENCH_ROUNDS 5

static double median(double *v, int n) {
  for (int i = 1; i < n; i++) /* insertion sort: n is tiny */
    for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
      const double t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return v[n / 2];
}

static double busbw_factor(int op, int w) {
  return op == OP_AR ? 2.0 * (w - 1) / w : (double)(w - 1) / w;
}

static int iters_for(size_t bytes, int iters) {
  if (iters > 0) return iters;
  const size_t budget = (size_t)256 << 20; /* about 256 MiB per round */
  size_t n = budget / bytes;
  return n < 2 ? 2 : n > 40 ? 40 : (int)n;
}

static void print_size(char *out, size_t n, size_t bytes) {
  if (bytes >= ((size_t)1 << 20))
    snprintf(out, n, "%zuMiB", bytes >> 20);
  else
    snprintf(out, n, "%zuKiB", bytes >> 10);
}

static void run_size(sg_comm *c, const opts *o, size_t bytes, void *big, void *recv) {
  bufs b = {big, recv, bytes};
  const int w = c->world;
  static const char *const keys[] = {"rs", "ag", "ar"};
  for (int op = OP_RS; op <= OP_AR; op++) {
    if (!strstr(o->ops, keys[op])) continue;
    check_ours(c, op, &b, o->dtype);
    check_theirs(op, &b, w, c->rank);
    memset(big, 0, 2 * bytes);
    const int it = iters_for(bytes, o->iters);
    /* rounds alternate ours and MPI's so that load from other processes hits both alike; the
     * median round is reported */
    double ts[SG_BENCH_ROUNDS], tm[SG_BENCH_ROUNDS];
    for (int k = 0; k < SG_BENCH_ROUNDS; k++) {
      ts[k] = time_calls(c, 1, op, &b, o->dtype, it);
      tm[k] = time_calls(c, 0, op, &b, o->dtype, it);
    }
    const double t_us = median(ts, SG_BENCH_ROUNDS), t_mpi = median(tm, SG_BENCH_ROUNDS);
    if (c->rank != 0) continue;
    /* algbw of MPI's call on the same element count: for bf16 it moves twice the bytes */
    const double mpi_bytes =
        op == OP_AG ? (double)bytes : (double)bytes * (o->dtype == SG_F32 ? 1 : 2);
    const double a = (double)bytes / t_us / 1e9, am = mpi_bytes / t_mpi / 1e9;
    const double f = busbw_factor(op, w);
    char sz[32];
    print_size(sz, sizeof sz, bytes);
    printf("%-15s %8s %5d | %10.1f %8.2f %8.2f | %10.1f %8.2f %8.2f | %6.2fx\n", op_names[op], sz,
           it, t_us * 1e6, a, a * f, t_mpi * 1e6, am, am * f, t_mpi / t_us);
  }
}

static size_t parse_size(const char *s) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (end && (*end == 'K' || *end == 'k')) v *= 1024;
  if (end && (*end == 'M' || *end == 'm')) v *= 1024 * 1024;
  if (end && (*end == 'G' || *end == 'g')) v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

int main(int argc, char **argv) {
  opts o = {(size_t)64 << 10, (size_t)256 << 20, SG_F32, 0, "rs,ag,ar"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--min"))
      o.min_bytes = parse_size(argv[i + 1]);
    else if (!strcmp(argv[i], "--max"))
      o.max_bytes = parse_size(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters"))
      o.iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--ops"))
      o.ops = argv[i + 1];
    else if (!strcmp(argv[i], "--dtype"))
      o.dtype = !strcmp(argv[i + 1], "bf16") ? SG_BF16 : SG_F32;
  }
  sg_comm *c = NULL;
  if (sg_comm_create_mpi(NULL, &c) != SG_OK) {
    fprintf(stderr, "sg_comm_create_mpi: %s\n", sg_last_error());
    return 1;
  }
  const int w = c->world;
  /* buffers: 2x the largest size (bf16 runs MPI's f32 call on the same element count) */
  void *big = malloc(2 * o.max_bytes), *recv = malloc(2 * o.max_bytes / (size_t)w + 64);
  c->scratch_bytes = sg__comm_scratch_bytes(o.max_bytes / 2 / (size_t)w + 1);
  c->scratch = malloc(c->scratch_bytes);
  if (!big || !recv || !c->scratch) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  if (c->rank == 0) {
    /* the library's names (src/core/sg_env.c), then the old ones it still reads */
    const char *ag = getenv("SG_COLL_ALLGATHER"), *rs = getenv("SG_COLL_REDUCE_SCATTER");
    if (!ag || !*ag) ag = getenv("SG_MPI_ALLGATHER");
    if (!rs || !*rs) rs = getenv("SG_MPI_REDUCE_SCATTER");
    printf("sg_bench_comm: %d ranks, dtype %s, all_gather algorithm %s, reduce_scatter %s\n", w,
           o.dtype == SG_F32 ? "f32" : "bf16",
           !ag                  ? "direct (default)"
           : !strcmp(ag, "mpi") ? "MPI_Iallgather"
                                : ag,
           rs && *rs ? rs : w == 2 ? "ring (default)" : "direct (default)");
    printf("%-15s %8s %5s | %-30s | %-30s | %s\n", "", "", "", "  shardgrad (ours)", "  Open MPI",
           "");
    printf("%-15s %8s %5s | %10s %8s %8s | %10s %8s %8s | %7s\n", "op", "size", "iters", "time(us)",
           "algbw", "busbw", "time(us)", "algbw", "busbw", "ratio");
  }
  for (size_t s = o.min_bytes; s <= o.max_bytes; s *= 4) run_size(c, &o, s, big, recv);
  int bad = 0;
  MPI_Allreduce(&g_bad, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (c->rank == 0)
    printf("GB/s = 1e9 bytes/s. correctness checks: %s\n", bad ? "FAILED" : "all passed");
  free(c->scratch);
  free(big);
  free(recv);
  sg_comm_destroy(c); /* finalizes MPI (the library initialized it) */
  return bad != 0;
}
