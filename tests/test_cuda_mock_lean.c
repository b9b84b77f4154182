/* The lean step (issue 13), counted on the mock CUDA runtime: what one training step of a rank
 * asks of the device and how often its host waits for it, from the caller's first sg_grad_ptr to
 * the return of sg_step. 200 parameters in 10 buckets, SG_SHARD_GRAD_OP, f32, two ranks (threads)
 * over the mock NCCL (stream-ordered collectives), one micro-batch per step; the counters are the
 * calling thread's (sg_cudamock_thread_calls), summed over the engine calls only, so the test's
 * own gradient writes are not counted. Steady state: steps 3 and 4 (the AdamW segment tables are
 * cached by then).
 *
 * Bounds asserted (DESIGN.md section 4, "The step on the device"; issue 28 defect 4): no host
 * synchronization in a step whose caller asks for no result (the clip/unscale factor and the skip
 * decision reach AdamW through device memory), exactly one in a step with sg_step_info asked for,
 * at most two kernels per bucket, and at most three device operations (kernels, copies, memsets)
 * per bucket plus the step's three norm kernels and the collectives. The full counts are printed
 * (before/after numbers of the issue). More cases, W = 1 on the mock NCCL with two micro-batches,
 * gradient clipping, a step with a NaN gradient (skipped on the device) and a step with no
 * gradients at all, hold the parameters, the step count, the loss scale and the info of the last
 * step to the same run on the CPU device bit for bit: f32 gradients with a static scale, and f16
 * gradients with dynamic loss scaling (the skip halves the scale, clean steps double it), so that
 * the deferred outcome (the host learns of a skip at the next step, or when it asks) keeps the
 * bias corrections and the scale of the host-decided path. */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h> /* the mock's: sg_cudamock_thread_calls */

#include "engine/sg_engine_internal.h" /* e->plan->nbuckets */
#include "sg_elem.h"                   /* sg_elem_store */
#include "shardgrad.h"
#include "sg_test_params.h" /* sg_test_ramp_params */
#include "sg_test_check.h"            /* CHECK, sg_test_summary */

#define NPARAM 200
#define NUMEL 256
#define STEPS 4
#define MAXW 2
#define NAN_PARAM 7 /* the parameter whose gradient holds a NaN at nan_step */

/* What is counted: the calling thread's calls of these (see tests/cudamock/cuda_runtime.h). */
enum { C_SYNC, C_KERNEL, C_COPY, C_MEMSET, C_COLL, C_RECORD, C_WAIT, NC };
static const char *const k_names[NC] = {"host_sync", "kernel", "cudaMemcpyAsync",
                                        "cudaMemsetAsync", "collective", "cudaEventRecord",
                                        "cudaStreamWaitEvent"};

typedef struct counts {
  long long c[NC];
} counts;

static void now(counts *x) {
  for (int k = 0; k < NC; k++) x->c[k] = sg_cudamock_thread_calls(k_names[k]);
}

/* acc += what the calls between *t0 and now added. */
static void add_since(counts *acc, const counts *t0) {
  counts t1;
  now(&t1);
  for (int k = 0; k < NC; k++) acc->c[k] += t1.c[k] - t0->c[k];
}

/* One engine call, counted. */
#define COUNTED(acc, call)      \
  do {                          \
    counts t0_;                 \
    now(&t0_);                  \
    st = (call);                \
    add_since((acc), &t0_);     \
  } while (0)

static float grad_val(int rank, int step, int mb, int p, size_t i) {
  const int k = (int)((i * 7u + (size_t)p * 13u + (size_t)step * 5u + (size_t)mb) % 17u) - 8;
  return (float)(k * (rank + 1)) * 0.125f;
}

typedef struct rank_arg {
  int rank, world, cuda, mb;
  int f16;       /* f16 gradients (dynamic loss scaling) */
  int nan_step;  /* the step whose gradients hold a NaN; -1: none */
  int info_step; /* the step whose sg_step asks for sg_step_info; -1: none */
  sg_step_info info;
  counts tail;   /* sg_get_loss_scale and sg_get_step after the run */
  sg_step_info lazy; /* sg_last_step_info right after the NaN step's sg_step(e, NULL) */
  counts lazy_c;     /* its calls */
  float loss_scale;
  uint64_t steps;
  const unsigned char *nccl_id;
  sg_comm *comm;
  counts per_step[STEPS];
  int nbuckets;
  float *params; /* NPARAM * NUMEL, after the run */
  char err[512];
} rank_arg;

static sg_status setup(rank_arg *a, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  if (st) return st;
  cfg.strategy = SG_SHARD_GRAD_OP;
  cfg.device = a->cuda ? SG_DEVICE_CUDA : SG_DEVICE_CPU;
  cfg.bucket_bytes = 20 * NUMEL * 4; /* 20 parameters per bucket: 10 buckets */
  cfg.lr = 0.01f;
  cfg.timeout_ms = 60000;
  cfg.max_grad_norm = a->f16 ? 0.1f : 1.0f; /* the norm is far above: every step clips */
  if (a->f16) {
    cfg.grad_dtype = SG_F16; /* with loss_scale 0 (the default): dynamic loss scaling */
    cfg.reduce_dtype = SG_F32;
    cfg.init_loss_scale = 1024.0f;
    cfg.scale_window = 2;
  }
  if ((st = sg_engine_create(a->comm, &cfg, e))) return st;
  st = sg_test_ramp_params(*e, NPARAM, NUMEL, 5, ids);
  if (!st) a->nbuckets = (*e)->plan->nbuckets;
  return st;
}

/* Gradients in reverse registration order through sg_grad_ptr; the test writes them (host
 * values, then a copy on the caller's stream), outside the counted calls. */
static sg_status micro_batch(rank_arg *a, sg_engine *e, const int *ids, cudaStream_t s,
                             float *stage, int step, int mb, counts *acc) {
  sg_status st = SG_OK;
  const size_t es = a->f16 ? 2 : 4;
  for (int p = NPARAM - 1; p >= 0 && !st; p--) {
    void *g = NULL;
    COUNTED(acc, sg_grad_ptr(e, ids[p], &g));
    if (st) break;
    char *h = s ? (char *)stage + (size_t)p * NUMEL * 4 : (char *)g;
    for (int i = 0; i < NUMEL; i++) {
      float x = grad_val(a->rank, step, mb, p, (size_t)i);
      if (step == a->nan_step && p == NAN_PARAM && i == 3) x = NAN;
      sg_elem_store(h, a->f16 ? 2 : 0, (size_t)i, x);
    }
    if (s && cudaMemcpyAsync(g, h, NUMEL * es, cudaMemcpyHostToDevice, s) != cudaSuccess)
      return SG_ERR_CUDA;
    COUNTED(acc, sg_grad_ready(e, ids[p]));
  }
  return st;
}

/* The test's own wait for its stream (the staging buffers are written again): polled, since the
 * mock's streams move only when queried and a gather needs every rank's; NotReady cleared. */
static sg_status drain(cudaStream_t s) {
  if (!s) return SG_OK;
  for (long spin = 0; spin < 100000000; spin++) {
    const cudaError_t ce = cudaStreamQuery(s);
    (void)cudaGetLastError();
    if (ce == cudaSuccess) return SG_OK;
    if (ce != cudaErrorNotReady) return SG_ERR_CUDA;
    sched_yield();
  }
  return SG_ERR_TIMEOUT;
}

static void *rank_main(void *arg) {
  rank_arg *a = (rank_arg *)arg;
  sg_engine *e = NULL;
  int ids[NPARAM];
  cudaStream_t s = NULL;
  float *stage = NULL;
  sg_status st = SG_OK;
  if (a->nccl_id) st = sg_comm_create_nccl(a->rank, a->world, a->nccl_id, 0, &a->comm);
  if (!st) st = setup(a, &e, ids);
  if (!st && a->cuda) {
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    /* one buffer per parameter: a step's copies are all in flight before anything waits */
    if (cudaMallocHost((void **)&stage, (size_t)NPARAM * NUMEL * 4) != cudaSuccess)
      st = SG_ERR_OUT_OF_MEMORY;
    if (!st) st = sg_set_stream(e, s);
  }
  for (int step = 0; step < STEPS && !st; step++) {
    counts *acc = &a->per_step[step];
    memset(acc, 0, sizeof *acc);
    for (int mb = 0; mb < a->mb && !st; mb++) {
      st = micro_batch(a, e, ids, s, stage, step, mb, acc);
      if (!st && mb + 1 < a->mb) st = drain(s);
    }
    if (!st) {
      a->info.struct_size = sizeof a->info;
      COUNTED(acc, sg_step(e, step == a->info_step ? &a->info : NULL));
    }
    if (!st && step == a->nan_step) { /* its info, asked for after the step */
      a->lazy.struct_size = sizeof a->lazy;
      COUNTED(&a->lazy_c, sg_last_step_info(e, &a->lazy));
    }
    if (!st) st = drain(s);
  }
  if (!st) COUNTED(&a->per_step[0], sg_step(e, NULL)); /* a step without gradients */
  if (!st) COUNTED(&a->tail, sg_get_loss_scale(e, &a->loss_scale));
  if (!st) COUNTED(&a->tail, sg_get_step(e, &a->steps));
  a->params = malloc((size_t)NPARAM * NUMEL * 4);
  for (int p = 0; p < NPARAM && !st; p++)
    st = sg_get_param(e, ids[p], a->params + (size_t)p * NUMEL, SG_F32);
  if (st) snprintf(a->err, sizeof a->err, "%s: %s", sg_status_string(st), sg_last_error());
  sg_engine_destroy(e);
  (void)drain(s);
  if (stage) cudaFreeHost(stage);
  if (s) cudaStreamDestroy(s);
  if (a->nccl_id) sg_comm_destroy(a->comm);
  return NULL;
}

static int run(int world, int cuda, int mb, int f16, int nan_step, int info_step,
               rank_arg *args) {
  unsigned char id[128];
  sg_comm *comms[MAXW] = {0};
  pthread_t th[MAXW];
  if (cuda ? sg_nccl_unique_id(id) != SG_OK : sg_comm_create_local(world, comms) != SG_OK) {
    CHECK(0, "communicator");
    return 0;
  }
  for (int r = 0; r < world; r++) {
    memset(&args[r], 0, sizeof args[r]);
    args[r].rank = r, args[r].world = world, args[r].cuda = cuda, args[r].mb = mb;
    args[r].f16 = f16, args[r].nan_step = nan_step, args[r].info_step = info_step;
    args[r].nccl_id = cuda ? id : NULL;
    args[r].comm = comms[r];
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  int ok = 1;
  for (int r = 0; r < world; r++) {
    pthread_join(th[r], NULL);
    if (!cuda) sg_comm_destroy(comms[r]);
    char what[700];
    snprintf(what, sizeof what, "%s W=%d, rank %d: %d steps%s%s", cuda ? "cuda+nccl" : "cpu+local",
             world, r, STEPS, args[r].err[0] ? " -- " : "", args[r].err);
    CHECK(!args[r].err[0], "%s", what);
    ok &= !args[r].err[0];
  }
  return ok;
}

/* The counts of the steady steps; the bounds. */
static void report(const rank_arg *a) {
  char what[300];
  const int nb = a->nbuckets;
  snprintf(what, sizeof what, "rank %d: %d buckets", a->rank, nb);
  CHECK(nb == 10, "%s", what);
  for (int step = 2; step < STEPS; step++) {
    const long long *c = a->per_step[step].c;
    const long long ops = c[C_KERNEL] + c[C_COPY] + c[C_MEMSET] + c[C_COLL];
    printf("rank %d step %d: %lld host syncs, %lld device operations (%lld kernels = %.2f per "
           "bucket, %lld copies, %lld memsets, %lld collectives), %lld event records, %lld "
           "stream waits\n", a->rank, step + 1, c[C_SYNC], ops, c[C_KERNEL],
           (double)c[C_KERNEL] / nb, c[C_COPY], c[C_MEMSET], c[C_COLL], c[C_RECORD], c[C_WAIT]);
    snprintf(what, sizeof what, "rank %d step %d: no host synchronization without a result "
             "asked for (%lld)", a->rank, step + 1, c[C_SYNC]);
    CHECK(c[C_SYNC] == 0, "%s", what);
    snprintf(what, sizeof what, "rank %d step %d: at most 2 kernels per bucket (%lld for %d)",
             a->rank, step + 1, c[C_KERNEL], nb);
    CHECK(c[C_KERNEL] <= 2LL * nb, "%s", what);
    /* Per bucket: the staging slot's memset and AdamW (the reduce-scatter writes the
     * accumulator itself: before, a copy of the slice into it was a third); per step: two
     * sumsq kernels and the step kernel (issue 28's target: <= 2 per bucket). */
    const long long own = ops - c[C_COLL];
    printf("rank %d step %d: %.2f device operations per bucket besides the collectives\n",
           a->rank, step + 1, (double)own / nb);
    snprintf(what, sizeof what, "rank %d step %d: at most 2 device operations per bucket + 3 "
             "(%lld for %d buckets, besides %lld collectives)", a->rank, step + 1, own, nb,
             c[C_COLL]);
    CHECK(own <= 2LL * nb + 3, "%s", what);
  }
}

/* Two infos alike: every field bit for bit, but a NaN norm is any NaN (its payload is the sum's). */
static int same_info(const sg_step_info *x, const sg_step_info *y) {
  const int norm = isnan(x->grad_norm) ? isnan(y->grad_norm)
                                       : memcmp(&x->grad_norm, &y->grad_norm, sizeof(float)) == 0;
  return norm && x->struct_size == y->struct_size && x->step == y->step &&
         memcmp(&x->clip_coef, &y->clip_coef, sizeof(float)) == 0 &&
         memcmp(&x->loss_scale, &y->loss_scale, sizeof(float)) == 0 && x->skipped == y->skipped;
}

/* W = 1, two micro-batches, a NaN in step 2's gradients, sg_step_info asked for in the last
 * step, then a step without gradients: the CUDA engine against the CPU device's. */
static void bitwise(int f16) {
  static rank_arg ref[MAXW], got[MAXW];
  const char *k = f16 ? "f16 grads, dynamic scale" : "f32 grads";
  const int ok_ref = run(1, 0, 2, f16, 1, STEPS - 1, ref);
  const int ok = run(1, 1, 2, f16, 1, STEPS - 1, got);
  for (int step = 1; ok && step < STEPS; step++) {
    const long long n = got[0].per_step[step].c[C_SYNC];
    if (step == STEPS - 1) /* the info asked for: one wait, at its end */
      CHECK(n == 1, "%s, W=1, step %d with sg_step_info: %lld host sync(s), expected 1", k,
            step + 1, n);
    else /* the skipped step too: the host learns of it at the next step, without a wait */
      CHECK(n == 0, "%s, W=1, 2 micro-batches, step %d: %lld host sync(s), expected 0", k,
            step + 1, n);
  }
  if (ok)
    CHECK(got[0].tail.c[C_SYNC] <= 1, "%s: sg_get_loss_scale and sg_get_step after a step: %lld "
          "host sync(s), at most 1", k, got[0].tail.c[C_SYNC]);
  if (ok)
    CHECK(got[0].lazy_c.c[C_SYNC] <= 1, "%s: sg_last_step_info after sg_step(e, NULL): %lld host "
          "sync(s), at most 1", k, got[0].lazy_c.c[C_SYNC]);
  if (ok_ref && ok)
    CHECK(same_info(&ref[0].lazy, &got[0].lazy) && got[0].lazy.skipped == 1,
          "%s: sg_last_step_info of the skipped NaN step (step %llu, norm %g, clip %g, scale %g, "
          "skipped %d) == cpu's", k, (unsigned long long)got[0].lazy.step,
          (double)got[0].lazy.grad_norm, (double)got[0].lazy.clip_coef,
          (double)got[0].lazy.loss_scale, got[0].lazy.skipped);
  if (ok_ref && ok) {
    CHECK(memcmp(ref[0].params, got[0].params, (size_t)NPARAM * NUMEL * 4) == 0,
          "%s, W=1, 2 micro-batches, a NaN step, then a step without gradients: cuda+nccl == cpu "
          "bitwise", k);
    /* the NaN step is skipped; the last, without gradients, changes nothing and is not
     * counted either (DESIGN.md section 4, "Parameters without a gradient") */
    CHECK(ref[0].steps == got[0].steps && ref[0].steps == STEPS - 1,
          "%s: steps taken %llu (cpu %llu), expected %d (of %d: one skipped, one without "
          "gradients)", k, (unsigned long long)got[0].steps, (unsigned long long)ref[0].steps,
          STEPS - 1, STEPS + 1);
    CHECK(memcmp(&ref[0].loss_scale, &got[0].loss_scale, sizeof(float)) == 0,
          "%s: loss scale %g (cpu %g)", k, (double)got[0].loss_scale, (double)ref[0].loss_scale);
    CHECK(memcmp(&ref[0].info, &got[0].info, sizeof ref[0].info) == 0 && got[0].info.skipped == 0 &&
              got[0].info.clip_coef < 1.0f,
          "%s: the last step's info (step %llu, norm %g, clip %g, scale %g, skipped %d) == cpu's",
          k,
          (unsigned long long)got[0].info.step, (double)got[0].info.grad_norm,
          (double)got[0].info.clip_coef, (double)got[0].info.loss_scale, got[0].info.skipped);
  }
  free(ref[0].params);
  free(got[0].params);
}

int main(void) {
  static rank_arg got[MAXW];
  if (run(2, 1, 1, 0, -1, -1, got))
    for (int r = 0; r < 2; r++) report(&got[r]);
  for (int r = 0; r < 2; r++) free(got[r].params);
  bitwise(0);
  bitwise(1);
  sg_cudamock_drain();
  return sg_test_summary("");
}
