// The CUDA kernels of kernels/cuda/sg_cuda_kernels.cu run on the host through the emulation of
// kernels/cuda/sg_cuda_emu.h (no GPU needed), against the CPU kernels on the same inputs:
// bitwise for accumulate, cast, reduce_sum, fill and adamw (a NaN equals any NaN), sumsq within
// 1e-12 relative with the same non-finite count. Every launcher runs with several grid limits,
// which must give the same bits, and on arrays shifted by one element, which takes the
// unaligned (scalar) paths. What this cannot check: device code generation and -fmad=false
// (tests/gpu/test_cuda_kernels.c does, on a GPU).
#define SG_CUDA_EMULATE 1
#include "cuda/sg_cuda_kernels.cu"  // the kernels and launchers, compiled for the host

#include <cmath>    // std::isnan, std::fabs, std::pow, std::sqrt
#include <cstdio>   // printf
#include <cstdlib>  // malloc, free

extern "C" {
#include "cpu/sg_cpu_kernels.h"  // the references
}

static int g_pass, g_fail;

static void check(bool ok, const char *what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  (ok ? g_pass : g_fail)++;
}

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static float rnd_unit() { return (float)((double)(rnd() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
static size_t esize(int dt) { return dt == 3 ? 8u : dt == 0 ? 4u : 2u; }

// Random values; with specials, some raw bit patterns (NaN, inf, subnormals).
static void fill_random(void *p, int dt, size_t n, float scale, bool specials) {
  for (size_t i = 0; i < n; i++) {
    const bool raw = specials && rnd() % 16 == 0;
    if (dt == 3) {
      ((double *)p)[i] = (double)rnd_unit() * scale;
    } else if (dt == 0) {
      float f = rnd_unit() * scale;
      const uint32_t u = (uint32_t)rnd();
      if (raw) memcpy(&f, &u, 4);
      ((float *)p)[i] = f;
    } else {
      uint16_t h = (uint16_t)rnd();
      if (!raw)
        h = dt == 1 ? sg_elem_f32_to_bf16(rnd_unit() * scale)
                    : sg_elem_f32_to_f16(rnd_unit() * scale);
      ((uint16_t *)p)[i] = h;
    }
  }
}

static bool is_nan(const void *p, int dt, size_t i) {
  if (dt == 3) return std::isnan(((const double *)p)[i]);
  const float f = sg_elem_load(p, dt, i);
  return f != f;
}

static bool same(const void *a, const void *b, int dt, size_t n) {
  const size_t es = esize(dt);
  for (size_t i = 0; i < n; i++) {
    if (memcmp((const char *)a + i * es, (const char *)b + i * es, es) == 0) continue;
    if (is_nan(a, dt, i) && is_nan(b, dt, i)) continue;
    printf("  first difference at %zu of %zu\n", i, n);
    return false;
  }
  return true;
}

static const size_t k_sizes[] = {1, 3, 4, 5, 63, 1000, 4097, 30011};
static const int k_grids[] = {1, 3, 64};

// ---- accumulate, cast -------------------------------------------------------------------------

static void test_elementwise() {
  char what[128];
  for (size_t n : k_sizes)
    for (size_t off = 0; off < 2; off++)
      for (int g : k_grids) {
        sg__cuda_launch L = {nullptr, g};
        for (int adt = 0; adt < 3; adt++)
          for (int sdt = 0; sdt < 3; sdt++) {
            std::vector<char> acc((n + off) * esize(adt)), src((n + off) * esize(sdt));
            fill_random(acc.data(), adt, n + off, 8.0f, true);
            fill_random(src.data(), sdt, n + off, 8.0f, true);
            std::vector<char> ref = acc;
            sg__cpu_accumulate(ref.data() + off * esize(adt), adt, src.data() + off * esize(sdt),
                               sdt, n);
            int rc = sg__cuda_accumulate(L, acc.data() + off * esize(adt), adt,
                                         src.data() + off * esize(sdt), sdt, n);
            snprintf(what, sizeof what, "accumulate acc %d src %d n %zu off %zu grid %d", adt, sdt,
                     n, off, g);
            check(rc == 0 && same(ref.data(), acc.data(), adt, n + off), what);
          }
        for (int ddt = 0; ddt < 3; ddt++)
          for (int sdt = 0; sdt < 3; sdt++) {
            std::vector<char> dst((n + off) * esize(ddt), 0), src((n + off) * esize(sdt));
            fill_random(src.data(), sdt, n + off, 70000.0f, true);
            std::vector<char> ref = dst;
            sg__cpu_cast(ref.data() + off * esize(ddt), ddt, src.data() + off * esize(sdt), sdt, n);
            int rc = sg__cuda_cast(L, dst.data() + off * esize(ddt), ddt,
                                   src.data() + off * esize(sdt), sdt, n);
            snprintf(what, sizeof what, "cast dst %d src %d n %zu off %zu grid %d", ddt, sdt, n,
                     off, g);
            const bool ok = ddt == sdt ? memcmp(ref.data(), dst.data(), dst.size()) == 0
                                       : same(ref.data(), dst.data(), ddt, n + off);
            check(rc == 0 && ok, what);
          }
      }
}

// ---- reduce_sum, fill ---------------------------------------------------------------------------

static void test_reduce_sum() {
  char what[128];
  static const int nsrcs[] = {1, 2, 3, 33};  // 33: the large by-value table
  for (int dt = 0; dt < 4; dt++)
    for (int nsrc : nsrcs)
      for (int in_place = 0; in_place < 2; in_place++) {
        const size_t n = 5003;
        std::vector<std::vector<char>> src(nsrc, std::vector<char>(n * esize(dt)));
        std::vector<const void *> ptrs(nsrc);
        for (int k = 0; k < nsrc; k++) {
          fill_random(src[k].data(), dt, n, 4.0f, true);
          ptrs[k] = src[k].data();
        }
        std::vector<char> ref(n * esize(dt)), out(n * esize(dt));
        sg__cpu_reduce_sum(ref.data(), ptrs.data(), nsrc, dt, n);
        void *dst = in_place ? (void *)src[0].data() : (void *)out.data();
        sg__cuda_launch L = {nullptr, 3};
        int rc = sg__cuda_reduce_sum(L, dst, ptrs.data(), nsrc, dt, n);
        snprintf(what, sizeof what, "reduce_sum dtype %d nsrc %d%s", dt, nsrc,
                 in_place ? " in place" : "");
        check(rc == 0 && same(ref.data(), dst, dt, n), what);
      }
  const void *none[1] = {nullptr};
  sg__cuda_launch L = {nullptr, 1};
  check(sg__cuda_reduce_sum(L, (void *)none, none, SG__CUDA_MAX_SRCS + 1, 0, 4) ==
            cudaErrorInvalidValue,
        "reduce_sum: too many sources rejected");
  for (int dt = 0; dt < 4; dt++) {
    const size_t n = 1001;
    std::vector<char> got(n * esize(dt)), want(n * esize(dt));
    for (size_t i = 0; i < n; i++) {
      if (dt == 3)
        ((double *)want.data())[i] = -2.5;
      else
        sg_elem_store(want.data(), dt, i, -2.5f);
    }
    check(sg__cuda_fill(L, got.data(), dt, n, -2.5) == 0 && got == want, "fill");
  }
}

// ---- sumsq ----------------------------------------------------------------------------------

static bool close_rel(double a, double b) {
  if (a == b) return true;
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::fabs(a - b) <= 1e-12 * std::fabs(a);
}

static void test_sumsq() {
  char what[160];
  static const size_t sizes[] = {0, 1, 5, 8191, 8192, 8193, 50000};
  for (int dt = 0; dt < 3; dt++)
    for (size_t n : sizes)
      for (int specials = 0; specials < 2; specials++) {
        std::vector<char> x(n * esize(dt) + 8);
        fill_random(x.data(), dt, n, 3.0f, specials != 0);
        double cs = 0, cn = 0;
        sg__cpu_sumsq(x.data(), dt, n, &cs, &cn);
        double first[2] = {0, 0};
        for (int g : k_grids) {
          std::vector<char> scratch(sg__cuda_sumsq_scratch_bytes(n));
          double *r = (double *)scratch.data();
          sg__cuda_launch L = {nullptr, g};
          int rc = sg__cuda_sumsq(L, x.data(), dt, n, r, r);
          snprintf(what, sizeof what,
                   "sumsq dtype %d n %zu specials %d grid %d: cpu %.17g/%g emu %.17g/%g", dt, n,
                   specials, g, cs, cn, r[0], r[1]);
          check(rc == 0 && close_rel(cs, r[0]) && cn == r[1], what);
          if (g == k_grids[0]) {
            first[0] = r[0];
            first[1] = r[1];
          } else {
            check(memcmp(first, r, sizeof first) == 0, "sumsq: same bits for every grid limit");
          }
        }
      }
}

// ---- adamw ----------------------------------------------------------------------------------

static int make_segments(sg__seg *segs, size_t *shard_n, size_t *flat_n) {
  static const size_t lens[] = {1, 2, 3, 4, 5, 63, 64, 65, 1000, 4099, 0, 7};
  size_t so = 1, fo = 3;
  int n = 0;
  for (int rep = 0; rep < 2; rep++)
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++, n++) {
      segs[n].shard_off = so;
      segs[n].flat_off = fo;
      segs[n].len = lens[(i * 5 + (size_t)rep) % (sizeof lens / sizeof lens[0])];
      segs[n].decay = (int)((i + (size_t)rep) % 3 != 0);
      segs[n].sr_index = ((uint64_t)n << 40) + (uint64_t)(rep * 17);
      segs[n].group = (n * 3) % 5;  // read only when the call has ngroups > 1
      so += segs[n].len + (size_t)(rnd() % 3);
      fo += segs[n].len + (size_t)(rnd() % 5);
    }
  *shard_n = so + 4;
  *flat_n = fo + 4;
  return n;
}

struct adamw_state {
  std::vector<char> param, grad;
  std::vector<float> master, m, v;
};

static void adamw_args(sg__adamw_args *a, adamw_state *s, int pdt, int gdt, bool master, bool sr,
                       const sg__seg *segs, int nsegs, uint64_t step, int ngroups) {
  memset(a, 0, sizeof *a);
  const double lr = 1e-3, wd = 0.01, b1 = 0.9, b2 = 0.999;
  a->param = s->param.data();
  a->param_dtype = pdt;
  a->master = master ? s->master.data() : nullptr;
  a->state[SG__ADAMW_M] = s->m.data();
  a->state[SG__ADAMW_V] = s->v.data();
  a->grad = s->grad.data();
  a->grad_dtype = gdt;
  a->segs = segs;
  a->nsegs = nsegs;
  a->grad_scale = 0.25f;
  a->group_scalar[0][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - lr * wd);
  a->scalar[SG__ADAMW_BETA1] = (float)b1;
  a->scalar[SG__ADAMW_ONE_MINUS_BETA1] = (float)(1.0 - b1);
  a->scalar[SG__ADAMW_BETA2] = (float)b2;
  a->scalar[SG__ADAMW_ONE_MINUS_BETA2] = (float)(1.0 - b2);
  a->group_scalar[0][SG__ADAMW_STEP_SIZE] = (float)(lr / (1.0 - std::pow(b1, (double)step)));
  a->scalar[SG__ADAMW_BC2_SQRT] = (float)std::sqrt(1.0 - std::pow(b2, (double)step));
  a->scalar[SG__ADAMW_EPS] = 1e-8f;
  a->stochastic_rounding = sr;
  a->seed = 99;
  a->step = step;
  // parameter groups 1..ngroups-1: their own lr and weight decay
  a->ngroups = ngroups;
  for (int g = 1; g < ngroups; g++) {
    const double lr_g = lr * (g + 1), wd_g = 0.05 * g;
    a->group_scalar[g][SG__ADAMW_DECAY_FACTOR] = (float)(1.0 - lr_g * wd_g);
    a->group_scalar[g][SG__ADAMW_STEP_SIZE] = (float)(lr_g / (1.0 - std::pow(b1, (double)step)));
  }
}

static void test_adamw() {
  struct {
    int pdt, gdt;
    bool master, sr;
  } cases[] = {{0, 0, false, false}, {0, 1, false, false}, {0, 2, false, false},
               {0, 0, true, false},  {1, 0, true, false},  {1, 0, true, true},
               {1, 1, true, true},   {2, 0, true, false},  {2, 2, true, false}};
  char what[160];
  for (int ngroups : {0, 5})
  for (const auto &c : cases) {
    sg__seg segs[32];
    size_t sn, fn;
    const int nsegs = make_segments(segs, &sn, &fn);
    adamw_state s0;
    s0.param.resize(fn * esize(c.pdt));
    s0.grad.resize(sn * esize(c.gdt));
    s0.master.resize(sn);
    s0.m.resize(sn);
    s0.v.resize(sn);
    fill_random(s0.param.data(), c.pdt, fn, 1.0f, false);
    fill_random(s0.grad.data(), c.gdt, sn, 0.1f, false);
    fill_random(s0.master.data(), 0, sn, 1.0f, false);
    fill_random(s0.m.data(), 0, sn, 0.01f, false);
    for (float &x : s0.v) x = std::fabs(rnd_unit()) * 1e-4f;
    adamw_state ref = s0;
    sg__adamw_args a;
    adamw_args(&a, &ref, c.pdt, c.gdt, c.master, c.sr, segs, nsegs, 5, ngroups);
    sg__cpu_adamw(&a);
    for (int g : k_grids) {
      adamw_state s = s0;
      std::vector<char> table(sg__cuda_seg_table_bytes(nsegs));
      uint64_t work = 0;
      sg__cuda_seg_table_build(table.data(), segs, nsegs, &work);
      adamw_args(&a, &s, c.pdt, c.gdt, c.master, c.sr, segs, nsegs, 5, ngroups);
      sg__cuda_launch L = {nullptr, g};
      int rc = sg__cuda_adamw(L, &a, table.data(), work);
      snprintf(what, sizeof what, "adamw param %d grad %d master %d sr %d grid %d groups %d",
               c.pdt, c.gdt, (int)c.master, (int)c.sr, g, ngroups);
      const bool ok = rc == 0 && same(ref.param.data(), s.param.data(), c.pdt, fn) &&
                      same(ref.master.data(), s.master.data(), 0, sn) &&
                      same(ref.m.data(), s.m.data(), 0, sn) &&
                      same(ref.v.data(), s.v.data(), 0, sn);
      check(ok, what);
    }
  }
}

// ---- the step's outcome read by AdamW from device memory (issue 28, defect 4) ---------------

// The step kernel's record against sg_elem_step_outcome on the host, and AdamW reading its
// factor (a.outcome; a.grad_scale is then ignored) against the CPU loop given that factor as
// grad_scale, bit for bit; with a non-finite count the kernel writes nothing. Clipping on and
// off, averaging, a user scale.
static void test_step_outcome() {
  struct {
    double ss0, ss1, max_norm;
    int skip_enabled;
  } steps[] = {{1234.5678, 0, 1.0, 1},  {1234.5678, 0, 0.001, 1}, {99.0, 0, 0.0, 1},
               {5.0, 1, 1.0, 1},        {5.0, 1, 1.0, 0},      {INFINITY, 0, 1.0, 1}};
  char what[200];
  for (const auto &st : steps) {
    sg_elem_step_in in;
    memset(&in, 0, sizeof in);
    in.avg = 1.0 / 3.0, in.inv_scale = 1.0 / 1024.0, in.user_scale = -0.75;
    in.max_norm = st.max_norm, in.skip_enabled = st.skip_enabled;
    const sg_elem_step_out want = sg_elem_step_outcome(st.ss0, st.ss1, &in);
    const double ss[2] = {st.ss0, st.ss1};
    sg_elem_step_out dev, host;
    memset(&dev, 0xff, sizeof dev), memset(&host, 0, sizeof host);
    sg__cuda_launch L1 = {nullptr, 1};
    const int rc = sg__cuda_step_outcome(L1, ss, &in, &dev, &host, 42);
    snprintf(what, sizeof what, "step kernel ss (%g, %g) max_norm %g skip %d: factor %a norm %a "
             "clip %a skip %d, seq 42 in both records", st.ss0, st.ss1, st.max_norm,
             st.skip_enabled, (double)want.factor, (double)want.norm, (double)want.clip,
             want.skip);
    check(rc == 0 && dev.seq == 42 && host.seq == 42 &&
              memcmp(&dev.factor, &want.factor, 5 * 4) == 0 &&
              memcmp(&host.factor, &want.factor, 5 * 4) == 0,
          what);
    for (int pdt : {0, 1}) {
      const int gdt = 0;
      const bool master = pdt != 0, sr = pdt == 1;
      sg__seg segs[32];
      size_t sn, fn;
      const int nsegs = make_segments(segs, &sn, &fn);
      adamw_state s0;
      s0.param.resize(fn * esize(pdt));
      s0.grad.resize(sn * esize(gdt));
      s0.master.resize(sn), s0.m.resize(sn), s0.v.resize(sn);
      fill_random(s0.param.data(), pdt, fn, 1.0f, false);
      fill_random(s0.grad.data(), gdt, sn, 0.1f, false);
      fill_random(s0.master.data(), 0, sn, 1.0f, false);
      fill_random(s0.m.data(), 0, sn, 0.01f, false);
      for (float &x : s0.v) x = std::fabs(rnd_unit()) * 1e-4f;
      adamw_state ref = s0, s = s0;
      sg__adamw_args a;
      if (!want.skip) {
        adamw_args(&a, &ref, pdt, gdt, master, sr, segs, nsegs, 5, 5);
        a.grad_scale = want.factor;
        sg__cpu_adamw(&a);
      }
      std::vector<char> table(sg__cuda_seg_table_bytes(nsegs));
      uint64_t work = 0;
      sg__cuda_seg_table_build(table.data(), segs, nsegs, &work);
      adamw_args(&a, &s, pdt, gdt, master, sr, segs, nsegs, 5, 5);
      a.grad_scale = 7.0f; /* not read */
      a.outcome = &dev;
      sg__cuda_launch L = {nullptr, 3};
      const int rk = sg__cuda_adamw(L, &a, table.data(), work);
      snprintf(what, sizeof what, "adamw param %d reading the step's record (ss %g, %g; skip %d) "
               "== the CPU loop with its factor", pdt, st.ss0, st.ss1, want.skip);
      check(rk == 0 && same(ref.param.data(), s.param.data(), pdt, fn) &&
                same(ref.master.data(), s.master.data(), 0, sn) &&
                same(ref.m.data(), s.m.data(), 0, sn) && same(ref.v.data(), s.v.data(), 0, sn),
            what);
      /* the CPU loop reads the record the same way */
      adamw_state c = s0;
      adamw_args(&a, &c, pdt, gdt, master, sr, segs, nsegs, 5, 5);
      a.grad_scale = 7.0f;
      a.outcome = &dev;
      sg__cpu_adamw(&a);
      snprintf(what, sizeof what, "cpu adamw param %d reading the record (skip %d)", pdt,
               want.skip);
      check(same(ref.param.data(), c.param.data(), pdt, fn) &&
                same(ref.m.data(), c.m.data(), 0, sn) && same(ref.v.data(), c.v.data(), 0, sn),
            what);
    }
  }
}

// ---- adamw over 8-bit state ------------------------------------------------------------------

// Blocks of state: coded ones (random codes and scales, one all-zero block) and fp32 ones (the
// pool, by the map); each segment one block's run from its start, as sg_state_q8.c cuts them.
struct q8_state {
  std::vector<char> param, grad;
  std::vector<float> master, sm, sv, pm, pv;
  std::vector<uint8_t> cm, cv;
};

static void test_adamw_q8() {
  static const size_t lens[] = {256, 1, 77, 255, 256, 100, 3, 256, 200, 256};
  const int nb = (int)(sizeof lens / sizeof lens[0]);
  std::vector<sg__seg> segs((size_t)nb);
  std::vector<uint32_t> map((size_t)nb);
  size_t fo = 5;
  uint32_t nf = 0;
  for (int b = 0; b < nb; b++) {
    segs[b] = sg__seg{(size_t)b * 256, fo, lens[b], b % 3 != 0, ((uint64_t)b << 40) + 7, b % 2};
    fo += lens[b] + (size_t)(rnd() % 5);
    map[b] = b % 4 == 3 ? nf++ : SG__Q8_CODED;
  }
  const size_t sn = (size_t)nb * 256;
  struct {
    int pdt, gdt;
    bool master, sr;
  } cases[] = {{0, 0, false, false}, {0, 1, false, false}, {1, 0, true, false},
               {1, 0, true, true},   {1, 1, true, false},  {2, 0, true, false}};
  char what[160];
  for (const auto &c : cases) {
    q8_state s0;
    s0.param.resize(fo * esize(c.pdt));
    s0.grad.resize(sn * esize(c.gdt));
    s0.master.resize(sn);
    s0.cm.resize(sn), s0.cv.resize(sn);
    s0.sm.resize((size_t)nb), s0.sv.resize((size_t)nb);
    s0.pm.resize((size_t)nf * 256 + 1), s0.pv.resize((size_t)nf * 256 + 1);
    fill_random(s0.param.data(), c.pdt, fo, 1.0f, false);
    fill_random(s0.grad.data(), c.gdt, sn, 0.1f, false);
    fill_random(s0.master.data(), 0, sn, 1.0f, false);
    for (size_t i = 0; i < sn; i++) s0.cm[i] = (uint8_t)rnd(), s0.cv[i] = (uint8_t)rnd();
    for (int b = 0; b < nb; b++) {
      s0.sm[b] = b == 1 ? 0.0f : std::fabs(rnd_unit()) * 0.01f;
      s0.sv[b] = b == 1 ? 0.0f : std::fabs(rnd_unit()) * 0.01f;
    }
    fill_random(s0.pm.data(), 0, s0.pm.size(), 0.01f, false);
    for (float &x : s0.pv) x = std::fabs(rnd_unit()) * 1e-4f;
    auto args = [&](sg__update_args *a, q8_state *s, uint64_t step) {
      adamw_state none;  // the scalars; the arrays are set below
      adamw_args(a, &none, c.pdt, c.gdt, c.master, c.sr, segs.data(), nb, step, 2);
      a->param = s->param.data();
      a->master = c.master ? s->master.data() : nullptr;
      a->grad = s->grad.data();
      a->state[SG__ADAMW_M] = s->pm.data(), a->state[SG__ADAMW_V] = s->pv.data();
      a->q8_code[SG__ADAMW_M] = s->cm.data(), a->q8_code[SG__ADAMW_V] = s->cv.data();
      a->q8_scale[SG__ADAMW_M] = s->sm.data(), a->q8_scale[SG__ADAMW_V] = s->sv.data();
      a->q8_f32 = map.data();
    };
    q8_state ref = s0;
    sg__update_args a;
    for (uint64_t t = 5; t < 7; t++) {
      args(&a, &ref, t);
      sg__cpu_adamw_q8(&a);
    }
    for (int g : k_grids) {
      q8_state s = s0;
      std::vector<char> table(sg__cuda_seg_table_bytes(nb));
      uint64_t work = 0;
      sg__cuda_seg_table_build(table.data(), segs.data(), nb, &work);
      int rc = 0;
      for (uint64_t t = 5; t < 7; t++) {
        args(&a, &s, t);
        sg__cuda_launch L = {nullptr, g};
        rc |= sg__cuda_adamw_q8(L, &a, table.data(), work);
      }
      snprintf(what, sizeof what, "adamw q8 param %d grad %d master %d sr %d grid %d", c.pdt,
               c.gdt, (int)c.master, (int)c.sr, g);
      const bool ok = rc == 0 && same(ref.param.data(), s.param.data(), c.pdt, fo) &&
                      same(ref.master.data(), s.master.data(), 0, sn) && ref.cm == s.cm &&
                      ref.cv == s.cv && same(ref.sm.data(), s.sm.data(), 0, (size_t)nb) &&
                      same(ref.sv.data(), s.sv.data(), 0, (size_t)nb) &&
                      same(ref.pm.data(), s.pm.data(), 0, s.pm.size()) &&
                      same(ref.pv.data(), s.pv.data(), 0, s.pv.size());
      check(ok, what);
    }
  }
}

// ---- outer steps -------------------------------------------------------------------------------

// outer_delta and outer_step against the CPU loops (kernels/cpu/sg_cpu_outer.c), bitwise, with
// specials among the inputs, every grid limit and the unaligned paths.
static void test_outer() {
  char what[128];
  for (size_t n : k_sizes)
    for (size_t off = 0; off < 2; off++)
      for (int g : k_grids) {
        sg__cuda_launch L = {nullptr, g};
        const size_t m = n + off;
        std::vector<float> po(m), theta(m), mom(m), dsum(m), d(m, 0.0f), dref(m, 0.0f);
        fill_random(po.data(), 0, m, 2.0f, true);
        fill_random(theta.data(), 0, m, 2.0f, true);
        fill_random(mom.data(), 0, m, 0.5f, false);
        fill_random(dsum.data(), 0, m, 3.0f, true);
        sg__cpu_outer_delta(dref.data() + off, po.data() + off, theta.data() + off, n);
        int rc = sg__cuda_outer_delta(L, d.data() + off, po.data() + off, theta.data() + off, n);
        snprintf(what, sizeof what, "outer_delta n %zu off %zu grid %d", n, off, g);
        check(rc == 0 && same(dref.data(), d.data(), 0, m), what);
        std::vector<float> po2 = po, mom2 = mom, th2 = theta;
        sg__cpu_outer_step(po.data() + off, mom.data() + off, theta.data() + off, dsum.data() + off,
                           n, 3, 0.7f, 0.9f);
        rc = sg__cuda_outer_step(L, po2.data() + off, mom2.data() + off, th2.data() + off,
                                 dsum.data() + off, n, 3, 0.7f, 0.9f);
        snprintf(what, sizeof what, "outer_step n %zu off %zu grid %d", n, off, g);
        check(rc == 0 && same(po.data(), po2.data(), 0, m) && same(mom.data(), mom2.data(), 0, m) &&
                  same(theta.data(), th2.data(), 0, m),
              what);
      }
}

// ---- blockwise codes -------------------------------------------------------------------------

// code_encode and code_decode against kernels/cpu/sg_cpu_codec.c: the same bytes and residuals,
// the same decoded values (added or not), with specials (NaN, inf blocks) and every grid limit.
static void test_codes() {
  char what[128];
  static const size_t sizes[] = {1, 255, 256, 257, 1000, 4097};
  for (size_t n : sizes)
    for (int bits = 8; bits >= 4; bits -= 4)
      for (int g : k_grids) {
        sg__cuda_launch L = {nullptr, g};
        const size_t cb = sg__cpu_code_bytes(n, bits);
        std::vector<float> src(n), r1(n);
        fill_random(src.data(), 0, n, 5.0f, n > 300);
        fill_random(r1.data(), 0, n, 0.01f, false);
        std::vector<float> r2(r1);
        std::vector<unsigned char> c1(cb, 0xab), c2(cb, 0xcd);
        sg__cpu_code_encode(c1.data(), src.data(), r1.data(), n, bits);
        int rc = sg__cuda_code_encode(L, c2.data(), src.data(), r2.data(), n, bits);
        snprintf(what, sizeof what, "code_encode bits %d n %zu grid %d", bits, n, g);
        check(rc == 0 && memcmp(c1.data(), c2.data(), cb) == 0 && same(r1.data(), r2.data(), 0, n),
              what);
        for (int add = 0; add < 2; add++) {
          std::vector<float> d1(n);
          fill_random(d1.data(), 0, n, 1.0f, false);
          std::vector<float> d2(d1);
          sg__cpu_code_decode(d1.data(), c1.data(), n, bits, add);
          rc = sg__cuda_code_decode(L, d2.data(), c1.data(), n, bits, add);
          snprintf(what, sizeof what, "code_decode bits %d n %zu add %d grid %d", bits, n, add, g);
          check(rc == 0 && same(d1.data(), d2.data(), 0, n), what);
        }
      }
}

int main() {
  test_codes();
  test_outer();
  test_elementwise();
  test_reduce_sum();
  test_sumsq();
  test_adamw();
  test_step_outcome();
  test_adamw_q8();
  printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
