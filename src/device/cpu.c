/* The CPU device (src/device/sg_device.h): host memory, memcpy/memset, the loops of
 * kernels/cpu, and a comm queue that is a worker thread running jobs in FIFO order.
 *
 * Queues on CPU. Compute-queue work runs inline on the calling thread, so it is complete when
 * the call returns. Comm jobs go through the shared job queue (sg_jobq.h): on its worker, or
 * inline in comm_submit (threaded_comm = 0, or a communicator that must not be called from
 * another thread). Kernels and copies on SG_Q_COMM run inline too: inside a job they are
 * ordered after the job's earlier work by construction; from any other thread they first wait
 * until every submitted job has finished, which is the order a stream would give. */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#define _DEFAULT_SOURCE         /* MAP_ANONYMOUS */

#include <math.h>      /* NAN, isnan */
#include <stdatomic.h> /* allocation-failure test hook */
#include <stdint.h>    /* INT64_MAX */
#include <stdlib.h>    /* posix_memalign, malloc, free */
#include <string.h>    /* memcpy, memset, strlen */
#include <sys/mman.h>  /* mmap, munmap: large blocks; madvise: zero_release */
#include <unistd.h>    /* sysconf: the page size */

#include "../../kernels/cpu/sg_cpu_kernels.h" /* sg__cpu_* loops */
#include "sg_device.h"                        /* sg__device, sg__device_ops */
#include "sg_jobq.h"                          /* the comm queue */

#define SG_CPU_ALIGN 64   /* bytes: a cache line, and the widest vector register */
/* Blocks from this size on are fresh anonymous pages: already zero, and not resident until
 * written, so an arena costs RSS only where it is used (f32 comm scratch never is). */
#define SG_CPU_MAP_MIN ((size_t)1 << 20)

/* ---- allocation-failure test hook ---------------------------------------------------------- */

/* Allocations still allowed to succeed before one fails; -1 = hook off. */
static atomic_int sg__fail_alloc_left = -1;

void sg__device_fail_alloc_after(int n) { atomic_store(&sg__fail_alloc_left, n < 0 ? -1 : n); }

/* Counts one allocation. With the hook set by sg__device_fail_alloc_after(n), the first n
 * allocations succeed and the next one fails (once; the hook is then off). */
int sg__device_should_fail_alloc(void) {
  int left = atomic_load(&sg__fail_alloc_left);
  while (left >= 0) {
    if (atomic_compare_exchange_weak(&sg__fail_alloc_left, &left, left - 1)) return left == 0;
  }
  return 0;
}

/* ---- the device object --------------------------------------------------------------------- */

typedef struct cpu_device {
  sg__device base; /* first: the vtable's sg__device* is this struct */
  sg__jobq q;      /* comm jobs: the worker thread, or inline */
  int attached;    /* a communicator is attached */
} cpu_device;

static cpu_device *as_cpu(sg__device *d) { return (cpu_device *)d; }

/* ---- memory -------------------------------------------------------------------------------- */

/* Every block is preceded by a header of SG_CPU_ALIGN bytes: the length of its mapping, or 0
 * for a block from posix_memalign (free() then). */
static sg_status cpu_alloc_block(size_t bytes, void **out, int *fresh) {
  /* a multiple of the alignment, never 0, so every allocation is a distinct non-NULL block */
  size_t rounded = bytes == 0 ? SG_CPU_ALIGN : (bytes + SG_CPU_ALIGN - 1) / SG_CPU_ALIGN * SG_CPU_ALIGN;
  size_t total = rounded + SG_CPU_ALIGN;
  char *head = NULL;
  *fresh = rounded >= SG_CPU_MAP_MIN;
  if (*fresh) {
    void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
      return sg__err_at(SG_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                        "cpu alloc: mmap of %zu bytes failed", total);
    head = m;
    *(size_t *)head = total;
  } else {
    void *p = NULL;
    int rc = posix_memalign(&p, SG_CPU_ALIGN, total);
    if (rc != 0 || !p)
      return sg__err_at(SG_ERR_OUT_OF_MEMORY, __FILE__, __LINE__,
                        "cpu alloc: posix_memalign of %zu bytes failed (%d)", total, rc);
    head = p;
    *(size_t *)head = 0;
  }
  *out = head + SG_CPU_ALIGN;
  return SG_OK;
}

static sg_status cpu_alloc_fresh(sg__device *d, size_t bytes, void **out, int *fresh) {
  if (!d || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "cpu alloc: NULL %s", d ? "out" : "device");
  *out = NULL;
  if (bytes > SIZE_MAX - 2 * SG_CPU_ALIGN)
    return sg__err(SG_ERR_OUT_OF_MEMORY, "cpu alloc: %zu bytes is too large", bytes);
  if (sg__device_should_fail_alloc())
    return sg__err(SG_ERR_OUT_OF_MEMORY, "cpu alloc: %zu bytes (injected failure)", bytes);
  return cpu_alloc_block(bytes, out, fresh);
}

static sg_status cpu_alloc(sg__device *d, size_t bytes, void **out) {
  int fresh = 0;
  return cpu_alloc_fresh(d, bytes, out, &fresh);
}

/* Fresh mappings read as zeros without being written (and stay off RSS); small blocks are
 * cleared. */
static sg_status cpu_alloc_zeroed(sg__device *d, size_t bytes, void **out) {
  int fresh = 0;
  SG_TRY(cpu_alloc_fresh(d, bytes, out, &fresh));
  if (!fresh) sg__cpu_zero(*out, bytes);
  return SG_OK;
}

static void cpu_free(sg__device *d, void *p) {
  if (!p) return;
  char *head = (char *)p - SG_CPU_ALIGN;
  size_t mapped = *(const size_t *)head;
  if (mapped) (void)munmap(head, mapped);
  else free(head);
}

/* ---- comm queue ---------------------------------------------------------------------------- */

static sg_status cpu_comm_wait(sg__device *d, uint64_t ticket, int64_t deadline_ms) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "comm_wait: NULL device");
  return sg__jobq_wait(&as_cpu(d)->q, ticket, deadline_ms, "comm_wait");
}

static sg_status cpu_comm_submit(sg__device *d, sg__job_fn fn, void (*drop)(void *), void *arg,
                                 uint64_t *ticket) {
  if (!d || !fn || !ticket) {
    if (drop) drop(arg);
    return sg__err(SG_ERR_INVALID_ARGUMENT, "comm_submit: NULL %s",
                   !d ? "device" : !fn ? "fn" : "ticket");
  }
  return sg__jobq_submit(&as_cpu(d)->q, fn, drop, arg, ticket);
}

static sg_status cpu_comm_attach(sg__device *d, const sg__comm_attach *a, sg__comm_native *out) {
  if (!d || !a || !out) return sg__err(SG_ERR_INVALID_ARGUMENT, "comm_attach: NULL argument");
  cpu_device *cd = as_cpu(d);
  if (cd->attached)
    return sg__err(SG_ERR_INVALID_STATE, "comm_attach: a communicator is already attached");
  if (a->stream_ordered)
    return sg__err(SG_ERR_UNSUPPORTED, "comm_attach: the CPU device has no streams");
  sg__jobq_set_threaded(&cd->q, a->threaded);
  cd->attached = 1;
  out->stream = NULL;
  out->ordinal = -1;
  return SG_OK;
}

static void cpu_comm_detach(sg__device *d) {
  if (!d) return;
  cpu_device *cd = as_cpu(d);
  sg__jobq_set_threaded(&cd->q, 1);
  cd->attached = 0;
}

static sg_status cpu_comm_start(sg__device *d) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "comm_start: NULL device");
  return sg__jobq_start(&as_cpu(d)->q, "comm_start");
}

/* Before SG_Q_COMM work issued outside a job: let every submitted job finish first. */
static sg_status enter_queue(sg__device *d, sg__queue q, const char *fn) {
  if (q != SG_Q_COMPUTE && q != SG_Q_COMM)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: unknown queue (%d)", fn, (int)q);
  if (q == SG_Q_COMPUTE) return SG_OK;
  return sg__jobq_wait_all(&as_cpu(d)->q, INT64_MAX, fn);
}

/* ---- copies and kernels -------------------------------------------------------------------- */

static sg_status cpu_copy(sg__device *d, sg__queue q, void *dst, const void *src, size_t bytes,
                          sg__copy_kind kind) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "copy: NULL device");
  if (bytes && (!dst || !src))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "copy: NULL %s with %zu bytes", dst ? "src" : "dst", bytes);
  if (kind != SG_COPY_H2D && kind != SG_COPY_D2H && kind != SG_COPY_D2D)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "copy: unknown kind (%d)", (int)kind);
  SG_TRY(enter_queue(d, q, "copy"));
  if (bytes && dst != src) memcpy(dst, src, bytes);
  return SG_OK;
}

/* The checks of zero and zero_release, and the queue's order before them. */
static sg_status enter_zero(sg__device *d, sg__queue q, const void *dst, size_t bytes,
                            const char *fn) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL device", fn);
  if (bytes && !dst) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: NULL dst with %zu bytes", fn, bytes);
  return enter_queue(d, q, fn);
}

static sg_status cpu_zero(sg__device *d, sg__queue q, void *dst, size_t bytes) {
  SG_TRY(enter_zero(d, q, dst, bytes, "zero"));
  sg__cpu_zero(dst, bytes);
  return SG_OK;
}

/* Ranges from this size on give their whole pages back (madvise) instead of writing zeros:
 * below it the system calls and the page faults of the next write cost more than memset. */
#define SG_CPU_RELEASE_MIN ((size_t)64 << 10)

#define SG_CPU_HUGE ((uintptr_t)2 << 20)      /* a transparent huge page on x86-64 and arm64 */
#define SG_CPU_HUGE_MIN ((uintptr_t)16 << 20) /* the smallest range marked for them */

/* A released range is refilled by the next micro-batch or step (slots, the accumulator), and
 * 4 KiB faults made that refill the larger part of a backward pass here (2 us a page:
 * refilling 8 MiB took 4.2 ms against 0.9 ms of memset). Marked for transparent huge pages,
 * its 2 MiB-aligned interior comes back with one fault per 2 MiB (0.8 ms for 8 MiB). But a
 * huge page is resident from its first written byte: an accumulator filling bucket by bucket,
 * or a staging buffer next used by a smaller bucket, then holds up to 2 MiB per range that is
 * not written yet, which raised the peak RSS of bench/torch_side_by_side.py (2 and 4 MiB
 * buffers) by 3 MiB. So only ranges from 16 MiB on, where that is at most 1/8 more.
 * SG_CPU_HUGEPAGES=0 keeps 4 KiB pages everywhere (read once). */
static void hint_huge(uintptr_t a, uintptr_t end) {
#ifdef MADV_HUGEPAGE
  const int w = (int)sg__env_value(SG_ENV_CPU_HUGEPAGES, 1);
  const uintptr_t lo = (a + SG_CPU_HUGE - 1) / SG_CPU_HUGE * SG_CPU_HUGE;
  const uintptr_t hi = end / SG_CPU_HUGE * SG_CPU_HUGE;
  if (w && end - a >= SG_CPU_HUGE_MIN && hi > lo)
    (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE); /* a hint: may fail */
#else
  (void)a;
  (void)end;
#endif
}

/* Device memory is private anonymous (mmap or the heap), so pages dropped with MADV_DONTNEED
 * read as zeros when next touched. The partial pages at either end are cleared. */
static sg_status cpu_zero_release(sg__device *d, sg__queue q, void *dst, size_t bytes) {
  SG_TRY(enter_zero(d, q, dst, bytes, "zero_release"));
  const long ps = sysconf(_SC_PAGESIZE);
  const uintptr_t page = ps > 0 ? (uintptr_t)ps : 4096;
  const uintptr_t a = (uintptr_t)dst, end = a + bytes;
  const uintptr_t lo = (a + page - 1) / page * page, hi = end / page * page;
  if (bytes < SG_CPU_RELEASE_MIN || hi <= lo || madvise((void *)lo, hi - lo, MADV_DONTNEED) != 0) {
    sg__cpu_zero(dst, bytes);
    return SG_OK;
  }
  hint_huge(a, end);
  sg__cpu_zero(dst, lo - a);
  sg__cpu_zero((void *)hi, end - hi);
  return SG_OK;
}

static sg_status check_update(const sg__optim_desc *od, const sg__update_args *a) {
  if (!od || !od->cpu_update) return sg__err(SG_ERR_INVALID_ARGUMENT, "update: NULL optimizer");
  if (!a) return sg__err(SG_ERR_INVALID_ARGUMENT, "update: NULL args");
  if (a->nsegs < 0 || (a->nsegs > 0 && !a->segs))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "update: bad segments (nsegs %d)", a->nsegs);
  if (!sg__dtype_valid(a->param_dtype) || !sg__dtype_valid(a->grad_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "update: bad dtype (param %d, grad %d)",
                   a->param_dtype, a->grad_dtype);
  if (a->nsegs > 0 && (!a->param || !a->grad))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "update: NULL param or grad");
  for (int k = 0; a->nsegs > 0 && k < od->nstates; k++)
    if (!a->state[k])
      return sg__err(SG_ERR_INVALID_ARGUMENT, "update: NULL %s state '%s'", od->name,
                     od->state_name[k]);
  if (a->param_dtype != SG_F32 && !a->master)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "update: %s params need an fp32 master",
                   sg__dtype_name((sg_dtype)a->param_dtype));
  if (!sg__update_groups_ok(a))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "update: bad parameter groups (ngroups %d)",
                   a->ngroups);
  return SG_OK;
}

static sg_status cpu_update(sg__device *d, sg__queue q, const sg__optim_desc *od,
                            const sg__update_args *a) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "update: NULL device");
  SG_TRY(check_update(od, a));
  SG_TRY(enter_queue(d, q, "update"));
  if (a->nsegs > 0) od->cpu_update(a);
  return SG_OK;
}

static sg_status cpu_accumulate(sg__device *d, sg__queue q, void *acc, int acc_dtype,
                                const void *src, int src_dtype, size_t n) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "accumulate: NULL device");
  /* any acc dtype: f32/bf16 accumulators, and f16 gradient slots (sg_grad_add) */
  if (!sg__dtype_valid(acc_dtype) || !sg__dtype_valid(src_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "accumulate: bad dtype (acc %d, src %d)", acc_dtype,
                   src_dtype);
  if (n && (!acc || !src)) return sg__err(SG_ERR_INVALID_ARGUMENT, "accumulate: NULL buffer");
  SG_TRY(enter_queue(d, q, "accumulate"));
  sg__cpu_accumulate(acc, acc_dtype, src, src_dtype, n);
  return SG_OK;
}

static sg_status cpu_cast(sg__device *d, sg__queue q, void *dst, int dst_dtype, const void *src,
                          int src_dtype, size_t n) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "cast: NULL device");
  if (!sg__dtype_valid(dst_dtype) || !sg__dtype_valid(src_dtype))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "cast: bad dtype (dst %d, src %d)", dst_dtype, src_dtype);
  if (n && (!dst || !src)) return sg__err(SG_ERR_INVALID_ARGUMENT, "cast: NULL buffer");
  SG_TRY(enter_queue(d, q, "cast"));
  sg__cpu_cast(dst, dst_dtype, src, src_dtype, n);
  return SG_OK;
}

static sg_status cpu_sumsq(sg__device *d, sg__queue q, const void *x, int dtype, size_t n,
                           double *sumsq, double *nonfinite) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "sumsq: NULL device");
  if (!sg__dtype_valid(dtype)) return sg__err(SG_ERR_INVALID_ARGUMENT, "sumsq: bad dtype (%d)", dtype);
  if ((n && !x) || !sumsq || !nonfinite)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "sumsq: NULL %s", (n && !x) ? "x" : "output");
  SG_TRY(enter_queue(d, q, "sumsq"));
  sg__cpu_sumsq(x, dtype, n, sumsq, nonfinite);
  return SG_OK;
}

/* Device memory is host memory: the values land in dev2 at once. */
static sg_status cpu_sumsq_to(sg__device *d, sg__queue q, const void *x, int dtype, size_t n,
                              double *dev2) {
  if (!dev2) return sg__err(SG_ERR_INVALID_ARGUMENT, "sumsq: NULL output");
  return cpu_sumsq(d, q, x, dtype, n, &dev2[0], &dev2[1]);
}

static sg_status cpu_reduce_sum(sg__device *d, sg__queue q, void *dst, const void *const *srcs,
                                int nsrc, int dtype, size_t n) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "reduce_sum: NULL device");
  if (!sg__dtype_valid(dtype) && dtype != 3)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "reduce_sum: bad dtype (%d)", dtype);
  if (nsrc < 1 || !srcs)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "reduce_sum: need at least one source (%d)", nsrc);
  for (int k = 0; n && k < nsrc; k++)
    if (!srcs[k]) return sg__err(SG_ERR_INVALID_ARGUMENT, "reduce_sum: NULL source %d", k);
  if (n && !dst) return sg__err(SG_ERR_INVALID_ARGUMENT, "reduce_sum: NULL dst");
  SG_TRY(enter_queue(d, q, "reduce_sum"));
  sg__cpu_reduce_sum(dst, srcs, nsrc, dtype, n);
  return SG_OK;
}

/* ---- host memory, sync, stream, destroy ---------------------------------------------------- */

static sg_status cpu_compute_wait_comm(sg__device *d, uint64_t ticket, int64_t deadline_ms) {
  return cpu_comm_wait(d, ticket, deadline_ms); /* the compute queue is the calling thread */
}

static sg_status cpu_sync(sg__device *d, int64_t deadline_ms) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "sync: NULL device");
  return SG_OK; /* compute work ran inline: nothing is pending */
}

static sg_status cpu_set_stream(sg__device *d, void *stream) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg_set_stream: NULL device");
  if (stream)
    return sg__err(SG_ERR_UNSUPPORTED, "sg_set_stream: the CPU device has no streams (%p)", stream);
  return SG_OK;
}

/* ---- timing marks: the monotonic clock when the queue gets there -------------------------- */

/* Compute work runs inline and comm-queue work inside a job runs on the thread that marks, so
 * "now" is when the queue reaches the mark. NaN: never recorded. */
static sg_status cpu_marks_create(sg__device *d, size_t n, void **marks) {
  if (!d || !marks || n == 0) return sg__err(SG_ERR_INVALID_ARGUMENT, "marks_create: bad argument");
  double *t = malloc(n * sizeof *t);
  if (!t) return sg__err(SG_ERR_OUT_OF_MEMORY, "marks_create: out of host memory (%zu marks)", n);
  for (size_t i = 0; i < n; i++) t[i] = NAN;
  *marks = t;
  return SG_OK;
}

static void cpu_marks_destroy(sg__device *d, void *marks, size_t n) { free(marks); }

static sg_status cpu_mark(sg__device *d, void *marks, size_t i, sg__queue q) {
  if (!d || !marks) return sg__err(SG_ERR_INVALID_ARGUMENT, "mark: NULL argument");
  ((double *)marks)[i] = sg__now_us();
  return SG_OK;
}

static sg_status cpu_mark_elapsed(sg__device *d, void *marks, size_t from, size_t to,
                                  double *us) {
  if (!d || !marks || !us) return sg__err(SG_ERR_INVALID_ARGUMENT, "mark_elapsed: NULL argument");
  const double *t = marks;
  if (isnan(t[from]) || isnan(t[to]))
    return sg__err(SG_ERR_INVALID_STATE, "mark_elapsed: mark %zu was never recorded",
                   isnan(t[from]) ? from : to);
  *us = t[to] - t[from];
  return SG_OK;
}

/* Pending jobs are run (or skipped after a failure) before the worker exits. A job stuck in a
 * collective is bounded by that communicator's own deadline, so the join ends. */
static void cpu_destroy(sg__device *d) {
  if (!d) return;
  cpu_device *cd = as_cpu(d);
  sg__jobq_destroy(&cd->q);
  free(cd);
}

static sg_status cpu_outer_delta(sg__device *d, sg__queue q, float *dst, const float *po,
                                 const float *theta, size_t n) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "outer_delta: NULL device");
  if (n && (!dst || !po || !theta))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "outer_delta: NULL buffer");
  SG_TRY(enter_queue(d, q, "outer_delta"));
  sg__cpu_outer_delta(dst, po, theta, n);
  return SG_OK;
}

static sg_status cpu_outer_step(sg__device *d, sg__queue q, float *po, float *m, float *theta,
                                const float *dsum, size_t n, int nrep, float lr, float mu) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "outer_step: NULL device");
  if (nrep < 1) return sg__err(SG_ERR_INVALID_ARGUMENT, "outer_step: nrep must be >= 1 (%d)", nrep);
  if (n && (!po || !m || !theta || !dsum))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "outer_step: NULL buffer");
  SG_TRY(enter_queue(d, q, "outer_step"));
  sg__cpu_outer_step(po, m, theta, dsum, n, nrep, lr, mu);
  return SG_OK;
}

static sg_status cpu_code_encode(sg__device *d, sg__queue q, void *out, const float *src,
                                 float *resid, size_t n, int bits) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "code_encode: NULL device");
  if (bits != 8 && bits != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "code_encode: bits must be 8 or 4 (%d)", bits);
  if (n && (!out || !src || !resid))
    return sg__err(SG_ERR_INVALID_ARGUMENT, "code_encode: NULL buffer");
  SG_TRY(enter_queue(d, q, "code_encode"));
  sg__cpu_code_encode(out, src, resid, n, bits);
  return SG_OK;
}

static sg_status cpu_code_decode(sg__device *d, sg__queue q, float *dst, const void *in, size_t n,
                                 int bits, int add) {
  if (!d) return sg__err(SG_ERR_INVALID_ARGUMENT, "code_decode: NULL device");
  if (bits != 8 && bits != 4)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "code_decode: bits must be 8 or 4 (%d)", bits);
  if (n && (!dst || !in)) return sg__err(SG_ERR_INVALID_ARGUMENT, "code_decode: NULL buffer");
  SG_TRY(enter_queue(d, q, "code_decode"));
  sg__cpu_code_decode(dst, in, n, bits, add);
  return SG_OK;
}

static const sg__device_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .update = cpu_update,
    .accumulate = cpu_accumulate,
    .cast = cpu_cast,
    .sumsq = cpu_sumsq,
    .sumsq_to = cpu_sumsq_to,
    .reduce_sum = cpu_reduce_sum,
    .comm_submit = cpu_comm_submit,
    .comm_wait = cpu_comm_wait,
    .compute_wait_comm = cpu_compute_wait_comm,
    .comm_attach = cpu_comm_attach,
    .comm_detach = cpu_comm_detach,
    .comm_start = cpu_comm_start,
    .sync = cpu_sync,
    .set_stream = cpu_set_stream,
    .marks_create = cpu_marks_create,
    .marks_destroy = cpu_marks_destroy,
    .mark = cpu_mark,
    .mark_elapsed = cpu_mark_elapsed,
    .destroy = cpu_destroy,
    .alloc_zeroed = cpu_alloc_zeroed,
    .zero_release = cpu_zero_release,
    .outer_delta = cpu_outer_delta,
    .outer_step = cpu_outer_step,
    .code_encode = cpu_code_encode,
    .code_decode = cpu_code_decode,
};

/* ---- create -------------------------------------------------------------------------------- */

sg_status sg__device_cpu_create(int rank, int threaded_comm, sg__device **out) {
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__device_cpu_create: NULL out");
  *out = NULL;
  cpu_device *cd = (cpu_device *)calloc(1, sizeof *cd);
  if (!cd) return sg__err(SG_ERR_OUT_OF_MEMORY, "sg__device_cpu_create: no memory");
  cd->base.ops = &cpu_ops;
  cd->base.kind = SG_DEVICE_CPU;
  cd->base.rank = rank;
  /* the worker thread starts with the first job */
  int rc = sg__jobq_init(&cd->q, NULL, NULL, threaded_comm);
  if (rc != 0) {
    free(cd);
    return sg__err_at(SG_ERR_INTERNAL, __FILE__, __LINE__,
                      "sg__device_cpu_create: pthread init failed (%d)", rc);
  }
  *out = &cd->base;
  return SG_OK;
}
