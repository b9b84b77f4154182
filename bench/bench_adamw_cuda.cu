/* sg_bench_adamw_cuda: the fused AdamW step on the GPU (sg__cuda_adamw, the launcher the CUDA
 * device calls) over N parameters, beside a device-to-device cudaMemcpyAsync measured in the
 * same run on the same stream.
 *
 * Bytes per parameter, counted as bench/bench_adamw.c counts them:
 *   f32 params (the param is the master):  grad 4 + param r/w 8 + m r/w 8 + v r/w 8   = 28 B
 *   bf16 params (fp32 master):              grad 4 + master r/w 8 + m 8 + v 8 + bf16 write 2
 *                                                                                      = 30 B
 *   copy of B bytes: B read + B written = 2B; the copy moves half the step's bytes each way.
 * ratio = AdamW GB/s / copy GB/s, the median of the per-rep ratios (the two alternate rep by
 * rep after the warm-up, timed with cudaEvents). Goal: >= 0.85.
 *
 * Before timing, one untimed step on a small size (several segments, decay on and off) is
 * compared with the CPU kernel (sg__cpu_adamw) from the same inputs: bitwise, since both run
 * the element math of kernels/sg_elem.h and the library's CUDA code is built with -fmad=false.
 *
 *   sg_bench_adamw_cuda [--sizes 1,4,16,64,256] [--reps 20] [--warmup 3]   (sizes in Mi params)
 * Exit status: 0, 1 when the check fails, 2 on a usage or CUDA error (3: no GPU). */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {                    /* a C header without C++ guards */
#include "cpu/sg_cpu_kernels.h" /* sg__cpu_adamw, sg__cpu_cast: the reference */
}
#include "cuda/sg_cuda_kernels.h" /* sg__cuda_adamw and its segment table */

#define SEG_MAX ((size_t)4 << 20) /* parameters of at most 4 Mi elements, as bench/bench_adamw.c */

#define CU(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "sg_bench_adamw_cuda: %s: %s (%s:%d)\n", #call,                  \
              cudaGetErrorString(e_), __FILE__, __LINE__);                              \
      exit(2);                                                                          \
    }                                                                                   \
  } while (0)

namespace {

struct options {
  std::vector<size_t> sizes;
  int reps = 20, warmup = 3;
};

/* One rank's shard on the device: param (f32 or bf16), master (bf16 only), m, v, grad (f32),
 * and the segment table the launcher reads. */
struct state {
  size_t n = 0;
  int bf16 = 0;
  void *param = nullptr;
  float *master = nullptr, *m = nullptr, *v = nullptr, *grad = nullptr;
  std::vector<sg__seg> segs;
  void *table_host = nullptr, *table_dev = nullptr;
  uint64_t work = 0;
};

void make_segs(state &s) {
  const size_t nseg = (s.n + SEG_MAX - 1) / SEG_MAX;
  s.segs.resize(nseg);
  for (size_t k = 0; k < nseg; k++) {
    const size_t off = k * SEG_MAX;
    s.segs[k].shard_off = s.segs[k].flat_off = off;
    s.segs[k].len = s.n - off < SEG_MAX ? s.n - off : SEG_MAX;
    s.segs[k].decay = !(k & 1); /* alternate, as weights and biases/norms would */
    s.segs[k].sr_index = off;
  }
}

void state_init(state &s, size_t n, int bf16, cudaStream_t st) {
  s.n = n;
  s.bf16 = bf16;
  make_segs(s);
  CU(cudaMalloc(&s.param, n * (bf16 ? 2 : 4)));
  if (bf16) CU(cudaMalloc((void **)&s.master, 4 * n));
  CU(cudaMalloc((void **)&s.m, 4 * n));
  CU(cudaMalloc((void **)&s.v, 4 * n));
  CU(cudaMalloc((void **)&s.grad, 4 * n));
  const size_t tb = sg__cuda_seg_table_bytes((int)s.segs.size());
  CU(cudaMallocHost(&s.table_host, tb));
  CU(cudaMalloc(&s.table_dev, tb));
  sg__cuda_seg_table_build(s.table_host, s.segs.data(), (int)s.segs.size(), &s.work);
  CU(cudaMemcpyAsync(s.table_dev, s.table_host, tb, cudaMemcpyHostToDevice, st));
}

void state_free(state &s) {
  cudaFree(s.param), cudaFree(s.master), cudaFree(s.m), cudaFree(s.v), cudaFree(s.grad);
  cudaFree(s.table_dev), cudaFreeHost(s.table_host);
  s = state();
}

sg__adamw_args args_of(const state &s, uint64_t t) {
  sg__adamw_args a;
  memset(&a, 0, sizeof a);
  a.param = s.param, a.param_dtype = s.bf16 ? 1 : 0, a.master = s.master;
  a.state[SG__ADAMW_M] = s.m, a.state[SG__ADAMW_V] = s.v, a.grad = s.grad, a.grad_dtype = 0;
  a.segs = s.segs.data(), a.nsegs = (int)s.segs.size();
  a.grad_scale = 0.5f;
  sg__adamw_scalars(&a, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
  return a;
}

void launch(const state &s, sg__cuda_launch L, uint64_t t) {
  const sg__adamw_args a = args_of(s, t);
  const int e = sg__cuda_adamw(L, &a, s.table_dev, s.work);
  if (e) CU((cudaError_t)e);
}

/* Values a training run would hold (as bench/bench_adamw.c fills them). */
void fill_host(std::vector<float> &x, float base, float scale) {
  for (size_t i = 0; i < x.size(); i++)
    x[i] = base + scale * (float)((i * 2654435761u) % 1000u) / 1000.0f;
}

/* One step on the GPU and on the CPU from the same inputs; the number of elements that differ
 * in any of param, master, m, v. */
size_t check(sg__cuda_launch L, cudaStream_t st, int bf16) {
  const size_t n = 3 * SEG_MAX / 2 + 4099; /* two segments, one short, an odd tail */
  std::vector<float> p(n), m(n), v(n), g(n);
  fill_host(p, -0.5f, 1.0f), fill_host(m, -0.01f, 0.02f), fill_host(v, 1e-6f, 1e-4f);
  fill_host(g, -1.0f, 2.0f);
  std::vector<uint16_t> pb(n);
  if (bf16) sg__cpu_cast(pb.data(), 1, p.data(), 0, n);
  state s;
  state_init(s, n, bf16, st);
  CU(cudaMemcpyAsync(bf16 ? (void *)s.master : s.param, p.data(), 4 * n, cudaMemcpyHostToDevice, st));
  if (bf16) CU(cudaMemcpyAsync(s.param, pb.data(), 2 * n, cudaMemcpyHostToDevice, st));
  CU(cudaMemcpyAsync(s.m, m.data(), 4 * n, cudaMemcpyHostToDevice, st));
  CU(cudaMemcpyAsync(s.v, v.data(), 4 * n, cudaMemcpyHostToDevice, st));
  CU(cudaMemcpyAsync(s.grad, g.data(), 4 * n, cudaMemcpyHostToDevice, st));
  launch(s, L, 3);
  std::vector<float> gp(n), gm(n), gv(n);
  std::vector<uint16_t> gpb(n);
  CU(cudaMemcpyAsync(gp.data(), bf16 ? (void *)s.master : s.param, 4 * n, cudaMemcpyDeviceToHost, st));
  if (bf16) CU(cudaMemcpyAsync(gpb.data(), s.param, 2 * n, cudaMemcpyDeviceToHost, st));
  CU(cudaMemcpyAsync(gm.data(), s.m, 4 * n, cudaMemcpyDeviceToHost, st));
  CU(cudaMemcpyAsync(gv.data(), s.v, 4 * n, cudaMemcpyDeviceToHost, st));
  CU(cudaStreamSynchronize(st));

  /* the CPU step on host copies of the same state */
  sg__adamw_args a = args_of(s, 3);
  a.param = bf16 ? (void *)pb.data() : (void *)p.data();
  a.master = bf16 ? p.data() : nullptr;
  a.state[SG__ADAMW_M] = m.data(), a.state[SG__ADAMW_V] = v.data(), a.grad = g.data();
  sg__cpu_adamw(&a);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    bool same = memcmp(&gp[i], &p[i], 4) == 0 && memcmp(&gm[i], &m[i], 4) == 0 &&
                memcmp(&gv[i], &v[i], 4) == 0;
    if (bf16) same = same && gpb[i] == pb[i];
    bad += !same;
  }
  state_free(s);
  return bad;
}

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  const size_t k = t.size();
  return k % 2 ? t[k / 2] : 0.5 * (t[k / 2 - 1] + t[k / 2]);
}

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.0f;
  CU(cudaEventSynchronize(b));
  CU(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

struct result {
  double adamw_ms, copy_ms, ratio;
};

/* Copy and AdamW alternate rep by rep, each between two events on the stream. */
result measure(const state &s, sg__cuda_launch L, cudaStream_t st, void *cdst, const void *csrc,
               size_t cbytes, const options &o) {
  cudaEvent_t ev[4];
  for (auto &e : ev) CU(cudaEventCreate(&e));
  const double bytes = (s.bf16 ? 30.0 : 28.0) * (double)s.n;
  uint64_t t = 1;
  for (int r = 0; r < o.warmup; r++) {
    CU(cudaMemcpyAsync(cdst, csrc, cbytes, cudaMemcpyDeviceToDevice, st));
    launch(s, L, t++);
  }
  std::vector<double> ta, tc, ratio;
  for (int r = 0; r < o.reps; r++) {
    CU(cudaEventRecord(ev[0], st));
    CU(cudaMemcpyAsync(cdst, csrc, cbytes, cudaMemcpyDeviceToDevice, st));
    CU(cudaEventRecord(ev[1], st));
    launch(s, L, t++);
    CU(cudaEventRecord(ev[2], st));
    const double c = elapsed_ms(ev[0], ev[1]), a = elapsed_ms(ev[1], ev[2]);
    tc.push_back(c), ta.push_back(a);
    ratio.push_back((bytes / a) / (2.0 * (double)cbytes / c));
  }
  for (auto &e : ev) cudaEventDestroy(e);
  return result{median(ta), median(tc), median(ratio)};
}

bool parse(int argc, char **argv, options &o) {
  for (size_t k : {1, 4, 16, 64, 256}) o.sizes.push_back(k << 20);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
      o.reps = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
      o.warmup = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
      o.sizes.clear();
      for (char *tok = strtok(argv[++i], ","); tok; tok = strtok(nullptr, ","))
        o.sizes.push_back((size_t)strtoull(tok, nullptr, 10) << 20);
    } else {
      fprintf(stderr, "usage: %s [--sizes 1,4,16,64,256] [--reps 20] [--warmup 3]  (Mi params)\n",
              argv[0]);
      return false;
    }
  }
  for (size_t n : o.sizes)
    if (n == 0) return false;
  return o.reps > 0 && o.reps <= 10000 && o.warmup >= 0 && !o.sizes.empty();
}

}  // namespace

int main(int argc, char **argv) {
  options o;
  if (!parse(argc, argv, o)) return 2;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    fprintf(stderr, "sg_bench_adamw_cuda: no CUDA device found\n");
    return 3;
  }
  cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, 0));
  CU(cudaSetDevice(0));
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  sg__cuda_launch L;
  L.stream = st;
  L.max_blocks = 8 * prop.multiProcessorCount; /* as the CUDA device launches */
  printf("sg_bench_adamw_cuda: fused AdamW step (sg__cuda_adamw) vs device-to-device copy, %s "
         "(%d SMs), median of %d after %d warm-up, cudaEvent timing\n",
         prop.name, prop.multiProcessorCount, o.reps, o.warmup);
  printf("bytes per param: f32 28, bf16 (fp32 master) 30; the copy moves the same bytes "
         "(half read, half written)\nratio = median of per-rep ratios adamw GB/s / copy GB/s "
         "(goal >= 0.85)\n");
  int ok = 1;
  for (int bf16 = 0; bf16 <= 1; bf16++) {
    const size_t bad = check(L, st, bf16);
    printf("check vs sg__cpu_adamw (%s, %zu params, one step): %s (%zu elements differ)\n",
           bf16 ? "bf16" : "f32", 3 * SEG_MAX / 2 + 4099, bad ? "WRONG" : "ok, bitwise", bad);
    ok &= bad == 0;
  }
  printf("\n%8s  %-5s  %9s  %10s  %9s  %10s  %6s\n", "params", "param", "adamw ms", "adamw GB/s",
         "copy ms", "copy GB/s", "ratio");
  for (size_t n : o.sizes) {
    for (int bf16 = 0; bf16 <= 1; bf16++) {
      const double bytes = (bf16 ? 30.0 : 28.0) * (double)n;
      const size_t cbytes = (size_t)(bytes / 2);
      void *csrc = nullptr, *cdst = nullptr;
      CU(cudaMalloc(&csrc, cbytes));
      CU(cudaMalloc(&cdst, cbytes));
      CU(cudaMemsetAsync(csrc, 0x3c, cbytes, st));
      state s;
      state_init(s, n, bf16, st);
      /* constant but realistic values: the step's cost does not depend on them */
      int e = sg__cuda_fill(L, bf16 ? (void *)s.master : s.param, 0, n, 0.25);
      if (!e && bf16) e = sg__cuda_fill(L, s.param, 1, n, 0.25);
      if (!e) e = sg__cuda_fill(L, s.m, 0, n, 1e-3);
      if (!e) e = sg__cuda_fill(L, s.v, 0, n, 1e-5);
      if (!e) e = sg__cuda_fill(L, s.grad, 0, n, -0.1);
      if (e) CU((cudaError_t)e);
      const result r = measure(s, L, st, cdst, csrc, cbytes, o);
      printf("%7zuM  %-5s  %9.3f  %10.1f  %9.3f  %10.1f  %6.2f\n", n >> 20, bf16 ? "bf16" : "f32",
             r.adamw_ms, bytes / r.adamw_ms / 1e6, r.copy_ms, 2.0 * (double)cbytes / r.copy_ms / 1e6,
             r.ratio);
      state_free(s);
      cudaFree(csrc), cudaFree(cdst);
    }
  }
  CU(cudaStreamDestroy(st));
  return ok ? 0 : 1;
}
