#!/usr/bin/env bash
# GPU checks of shardgrad, for a machine with (at least) one NVIDIA GPU. Not part of ctest: CI
# has no GPU. Usage, from anywhere:
#
#   bash tests/gpu/run.sh            # results in $OUT/gpu_results.txt, else build-gpu/gpu_results.txt
#
# Steps (each with a time limit; a failing step does not stop the others):
#   1. configure and build the CUDA library (cmake -DSG_WITH_CUDA=ON) in build-gpu/ (or
#      $SG_GPU_BUILD), for the GPU's own architecture (SG_GPU_ARCHS overrides, e.g. "80;90");
#   2. test_cuda_device and test_cuda_emu (also in ctest), test_cuda_kernels (every CUDA kernel
#      against the CPU kernels: bitwise, sumsq within 1e-12) and test_cuda_queues (streams,
#      tickets, deadlines, NCCL at world 1);
#   3. compute-sanitizer memcheck on test_cuda_kernels --quick (skipped, and said so, when
#      compute-sanitizer is not installed);
#   4. the engine on the CUDA device: test_cuda_engine (W = 1..3 ranks as threads with the local
#      communicator, W = 1 with NCCL, bitwise against the CPU device), then the HOOK below;
#   5. benchmark and example (built separately, so that a failure there leaves steps 2-4 alone):
#      sg_bench_adamw_cuda (fused AdamW vs device-to-device copy, 1M..256M params),
#      bench/adamw_torch.py (torch.optim.AdamW(fused=True), when torch is importable) and
#      examples/mlp_cuda --ranks 2 --check (two ranks as threads on the one GPU, cuBLAS GEMMs);
#      their tables are copied into the results file.
# The results file has one line per step (PASS / FAIL / SKIP with the test's own summary line),
# the logs are next to it in logs/. Exit status: 0 when nothing failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
B="${SG_GPU_BUILD:-$ROOT/build-gpu}"
if [[ -n "${OUT:-}" ]]; then DEST="$OUT"; else DEST="$B"; fi
mkdir -p "$DEST/logs" "$B"
RES="$DEST/gpu_results.txt"
LOGS="$DEST/logs"
JOBS="$(nproc 2>/dev/null || echo 2)"
NPASS=0
NFAIL=0
NSKIP=0

export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"

line() { echo "$*" | tee -a "$RES"; }
pass() { NPASS=$((NPASS + 1)); line "PASS  $*"; }
fail() { NFAIL=$((NFAIL + 1)); line "FAIL  $*"; }
skip() { NSKIP=$((NSKIP + 1)); line "SKIP  $*"; }

# The test's own summary ("N passed, M failed"), or the log's last line.
summary_of() {
  local s
  s="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -1)"
  [[ -n "$s" ]] || s="$(tail -1 "$1" 2>/dev/null)"
  echo "$s"
}

# run_step NAME TIMEOUT_S COMMAND...: runs in $B, log in $LOGS/NAME.log.
run_step() {
  local name="$1" limit="$2"
  shift 2
  local log="$LOGS/$name.log" t0=$SECONDS rc
  (cd "$B" && timeout "$limit" "$@") >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  if [[ $rc -eq 0 ]]; then
    pass "$name (${took}s): $(summary_of "$log")"
  elif [[ $rc -eq 124 ]]; then
    fail "$name: timed out after ${limit}s: $(summary_of "$log")"
  else
    fail "$name (exit $rc, ${took}s): $(summary_of "$log")"
    grep -E '^FAIL' "$log" | head -20 | sed 's/^/      /' | tee -a "$RES"
  fi
  return $rc
}

: >"$RES"
line "shardgrad GPU checks, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
if command -v nvidia-smi >/dev/null; then
  line "gpu: $(nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
else
  line "gpu: nvidia-smi not found"
fi
line "nvcc: $(nvcc --version 2>/dev/null | tail -1)"

# ---- 1. build --------------------------------------------------------------------------------
ARCHS="${SG_GPU_ARCHS:-}"
if [[ -z "$ARCHS" ]] && command -v nvidia-smi >/dev/null; then
  # compute_cap "9.0" -> "90"; several GPUs of one kind give one entry
  ARCHS="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u | paste -sd ';' -)"
fi
[[ -n "$ARCHS" ]] || ARCHS="80;90"
line "architectures: $ARCHS"

BUILD_OK=0
if ! command -v cmake >/dev/null; then
  fail "configure: cmake not found"
elif run_step configure 600 cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release \
  -DSG_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" -DSG_BUILD_EXAMPLES=ON &&
  run_step build 1200 cmake --build "$B" -j "$JOBS" --target shardgrad shardgrad_static \
    test_cuda_device test_cuda_emu test_cuda_kernels test_cuda_queues test_cuda_engine \
    test_engine_cuda test_fp16_scale_cuda; then
  BUILD_OK=1
fi

# ---- 2. tests --------------------------------------------------------------------------------
TESTS="$B/tests"
if [[ $BUILD_OK -eq 1 ]]; then
  run_step test_cuda_device 120 "$TESTS/test_cuda_device"
  run_step test_cuda_emu 300 "$TESTS/test_cuda_emu"
  run_step test_cuda_kernels 600 "$TESTS/test_cuda_kernels"
  run_step test_cuda_queues 300 "$TESTS/test_cuda_queues"
else
  skip "tests: the build failed (see $LOGS/configure.log, $LOGS/build.log)"
fi

# ---- 3. compute-sanitizer ----------------------------------------------------------------------
SAN="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
  /opt/nvidia/compute-sanitizer/compute-sanitizer; do
  [[ -z "$SAN" && -x "$c" ]] && SAN="$c"
done
if [[ $BUILD_OK -ne 1 ]]; then
  skip "memcheck: the build failed"
elif [[ -z "$SAN" ]]; then
  skip "memcheck: compute-sanitizer not found"
else
  run_step memcheck_test_cuda_kernels 600 "$SAN" --tool memcheck --error-exitcode 99 \
    "$TESTS/test_cuda_kernels" --quick
  grep -E 'ERROR SUMMARY' "$LOGS/memcheck_test_cuda_kernels.log" | tail -1 | sed 's/^/      /' |
    tee -a "$RES"
fi

# ---- 4. engine tests on the CUDA device --------------------------------------------------------
if [[ $BUILD_OK -eq 1 ]]; then
  run_step test_cuda_engine 600 "$TESTS/test_cuda_engine"
else
  skip "test_cuda_engine: the build failed"
fi
# The engine's own tests with SG_DEVICE_CUDA: tests/test_engine.c and tests/test_fp16_scale.c
# with their engines under test on the GPU and their references on the CPU device, bitwise
# (test_engine: W ranks as threads with the local communicator, then W = 1 with NCCL). Full
# matrix: 35 cases of 8 params up to 300000 elements, so launch- and host-bound; the mock CUDA
# runs each of these steps in 7-17 s on 2 CPU cores (test_fp16_scale 2 s), a GPU host should
# be no slower; the limits leave room for engine setup and NCCL init per case.
if [[ $BUILD_OK -eq 1 ]]; then
  for w in 2 3 4; do
    run_step engine_cuda_w$w 120 env SG_TEST_DEVICE=cuda "$TESTS/test_engine_cuda" --local $w
  done
  run_step engine_cuda_nccl 120 env SG_TEST_DEVICE=cuda "$TESTS/test_engine_cuda" --nccl
  run_step fp16_scale_cuda 60 env SG_TEST_DEVICE=cuda "$TESTS/test_fp16_scale_cuda"
else
  skip "the engine's own tests with SG_DEVICE_CUDA: the build failed"
fi

# ---- 5. AdamW benchmark (ours, torch's) and the cuBLAS MLP example ---------------------------
# copy_log NAME: the step's output, indented, into the results file (tables, not just a summary).
copy_log() { sed 's/^/      /' "$LOGS/$1.log" | tail -40 | tee -a "$RES"; }
EXTRA_OK=0
if [[ $BUILD_OK -ne 1 ]]; then
  skip "bench and example: the build failed"
elif run_step build_bench_example 300 cmake --build "$B" -j "$JOBS" --target sg_bench_adamw_cuda \
  example_mlp_cuda; then
  EXTRA_OK=1
fi
if [[ $EXTRA_OK -eq 1 ]]; then
  run_step bench_adamw_cuda 120 "$B/bench/sg_bench_adamw_cuda" --sizes 1,4,16,64,256 --reps 20
  copy_log bench_adamw_cuda
fi
if ! command -v python3 >/dev/null || ! timeout 60 python3 -c "import torch" >/dev/null 2>&1; then
  skip "bench_adamw_torch: torch is not importable"
else
  run_step bench_adamw_torch 180 python3 "$ROOT/bench/adamw_torch.py" --sizes 1,4,16,64,256 \
    --reps 20
  copy_log bench_adamw_torch
fi
if [[ $EXTRA_OK -eq 1 ]]; then
  run_step mlp_cuda_ranks2 120 "$B/examples/mlp_cuda" --ranks 2 --steps 300 --log-every 50 --check
  copy_log mlp_cuda_ranks2
  run_step mlp_cuda_ranks2_bf16 120 "$B/examples/mlp_cuda" --ranks 2 --steps 300 --dtype bf16 \
    --log-every 100 --check
  copy_log mlp_cuda_ranks2_bf16
else
  skip "bench_adamw_cuda, mlp_cuda: not built"
fi

line "summary: $NPASS passed, $NFAIL failed, $NSKIP skipped; logs in $LOGS"
[[ $NFAIL -eq 0 ]]
