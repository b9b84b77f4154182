#!/usr/bin/env bash
# GPU checks of shardgrad, for a machine with (at least) one NVIDIA GPU. Not part of ctest: CI
# has no GPU. Usage, from anywhere:
#
#   bash tests/gpu/run.sh            # results in $OUT/gpu_results.txt, else build-gpu/gpu_results.txt
#
# The whole script keeps to a time budget (SG_GPU_BUDGET_S, default 330 s, so that it ends
# within 6 minutes): every step's limit is cut to what is left, and steps that no longer fit are
# reported as skipped. SG_GPU_STEPS (a bash regex) runs only the steps whose names match, besides
# configure and build, which are quick on a second call (the build directory is kept): e.g.
# SG_GPU_STEPS='memcheck|torch' for what a first call had no time for. Steps run most important
# first:
#   1. configure and build the CUDA library, the GPU test programs, the AdamW benchmark and the
#      cuBLAS MLP example (cmake -DSG_WITH_CUDA=ON) in build-gpu/ (or $SG_GPU_BUILD), for the
#      GPU's own architecture only (SG_GPU_ARCHS overrides, e.g. "80;90");
#   2. test_cuda_device, test_cuda_kernels (every CUDA kernel against the CPU kernels: bitwise,
#      sumsq within 1e-12), test_cuda_queues (streams, tickets, deadlines, NCCL at world 1);
#   3. the engine on the GPU against the CPU device, bitwise: test_cuda_engine (W = 1..3 threads,
#      W = 1 NCCL), test_engine_cuda (the engine's main matrix: W = 2 threads, W = 1 NCCL, then
#      W = 3 and 4, two MPI processes on the GPU through pinned staging), test_fp16_scale_cuda,
#      test_trace_cuda (trace events in causal order), test_groups_cuda (parameter groups);
#   4. sg_bench_adamw_cuda (fused AdamW vs device-to-device copy), the reduce/backward timeline
#      (examples/mlp_cuda --nccl-solo --trace: reductions on the comm stream against the cuBLAS
#      backward on the caller's stream; the trace files come back in $OUT), mlp_cuda --ranks 2
#      --check in f32 and bf16, bench/adamw_torch.py (torch fused AdamW, when torch imports),
#      python/tests/test_torch_cuda.py (ShardedAdamW on the GPU vs torch.optim.AdamW) and
#      examples/python/train_lm.py --device cuda (when torch and pytest import);
#   5. compute-sanitizer memcheck on test_cuda_kernels --quick and on test_cuda_engine (skipped,
#      and said so, when it is not installed or no time is left).
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

BUDGET="${SG_GPU_BUDGET_S:-330}"

# run_step NAME LIMIT_S COMMAND...: runs in $B, log in $LOGS/NAME.log; the limit is cut to the
# budget left (less 5 s for the summary); a step with under 10 s left is skipped (status 125).
run_step() {
  local name="$1" limit="$2"
  shift 2
  if [[ -n "${SG_GPU_STEPS:-}" && ! "$name" =~ ^(configure|build) && ! "$name" =~ $SG_GPU_STEPS ]]; then
    skip "$name: not selected by SG_GPU_STEPS"
    return 125
  fi
  local left=$((BUDGET - SECONDS - 5))
  if [[ $left -lt 10 ]]; then
    skip "$name: no time left in the ${BUDGET}s budget"
    return 125
  fi
  [[ $limit -le $left ]] || limit=$left
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

# copy_log NAME [N]: the step's last N (40) output lines, indented, into the results file.
copy_log() { [[ -f "$LOGS/$1.log" ]] && sed 's/^/      /' "$LOGS/$1.log" | tail -"${2:-40}" | tee -a "$RES"; }
# have NAME...: every program was built
have() { local f; for f in "$@"; do [[ -x "$f" ]] || return 1; done; }

: >"$RES"
line "shardgrad GPU checks, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), budget ${BUDGET}s"
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

# NCCL: the GPU image may carry it only in Python's nvidia-nccl wheel (header and library under
# site-packages/nvidia/nccl); use that when the system has none, so that the NCCL steps run.
NCCL_ARGS=()
NVCC_INC="$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include"
if [[ ! -f /usr/include/nccl.h && ! -f /usr/local/cuda/include/nccl.h && ! -f "$NVCC_INC/nccl.h" ]]; then
  PYNCCL="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
  if [[ -n "$PYNCCL" && -f "$PYNCCL/include/nccl.h" ]]; then
    NCCL_ARGS=("-DSG_NCCL_INCLUDE_DIR=$PYNCCL/include")
    if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 ' && [[ -f "$PYNCCL/lib/libnccl.so.2" ]]; then
      export SG_NCCL_LIBRARY="$PYNCCL/lib/libnccl.so.2"
    fi
    line "nccl: header from $PYNCCL/include, library ${SG_NCCL_LIBRARY:-from the system}"
  else
    line "nccl: no nccl.h found (the NCCL steps will fail or skip)"
  fi
fi

T="$B/tests"
TEST_TARGETS=(test_cuda_device test_cuda_kernels test_cuda_queues test_cuda_engine test_engine_cuda
  test_fp16_scale_cuda test_trace_cuda test_groups_cuda)
EXTRA_TARGETS=(sg_bench_adamw_cuda example_mlp_cuda)
if ! command -v cmake >/dev/null; then
  fail "configure: cmake not found"
elif run_step configure 90 cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release \
  -DSG_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" -DSG_BUILD_EXAMPLES=ON "${NCCL_ARGS[@]}"; then
  run_step build 240 cmake --build "$B" -j "$JOBS" --target shardgrad "${TEST_TARGETS[@]}"
  # separately: a failure there leaves the tests alone
  run_step build_bench_example 120 cmake --build "$B" -j "$JOBS" --target "${EXTRA_TARGETS[@]}"
fi

# ---- 2. kernels and queues ---------------------------------------------------------------------
step_if() { # step_if PROGRAM NAME LIMIT COMMAND...: the step, or SKIP when PROGRAM was not built
  local prog="$1"
  shift
  if have "$prog"; then run_step "$@"; else skip "$1: $(basename "$prog") was not built"; fi
}
step_if "$T/test_cuda_device" test_cuda_device 30 "$T/test_cuda_device"
step_if "$T/test_cuda_kernels" test_cuda_kernels 90 "$T/test_cuda_kernels"
step_if "$T/test_cuda_queues" test_cuda_queues 60 "$T/test_cuda_queues"

# ---- 3. the engine on the GPU against the CPU device --------------------------------------------
# test_engine's full matrix is 35 cases of 8 params up to 300000 elements: launch- and
# host-bound; on the mock CUDA runtime each run takes 7-17 s on 2 CPU cores, and --nccl
# initializes NCCL once per case. W = 3 and 4 come after the rest (lower value per second).
step_if "$T/test_cuda_engine" test_cuda_engine 90 "$T/test_cuda_engine"
step_if "$T/test_engine_cuda" engine_cuda_w2 90 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --local 2
step_if "$T/test_engine_cuda" engine_cuda_nccl 90 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --nccl
step_if "$T/test_fp16_scale_cuda" fp16_scale_cuda 45 env SG_TEST_DEVICE=cuda "$T/test_fp16_scale_cuda"
step_if "$T/test_trace_cuda" trace_cuda 45 env SG_TEST_DEVICE=cuda "$T/test_trace_cuda"
copy_log trace_cuda 8
step_if "$T/test_groups_cuda" groups_cuda 45 env SG_TEST_DEVICE=cuda "$T/test_groups_cuda"
copy_log groups_cuda 8
# The MPI communicator with GPU buffers (pinned host staging): two processes share the GPU.
if command -v mpirun >/dev/null && grep -q 'SG_WITH_MPI:BOOL=ON' "$B/CMakeCache.txt" 2>/dev/null; then
  step_if "$T/test_engine_cuda" engine_cuda_mpi_np2 60 mpirun -np 2 --oversubscribe \
    --allow-run-as-root --bind-to none "$T/test_engine_cuda" --mpi --quick --device cuda
else
  skip "engine_cuda_mpi_np2: no mpirun or no MPI in the build"
fi
for w in 3 4; do
  step_if "$T/test_engine_cuda" engine_cuda_w$w 60 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --local $w --quick
done

# ---- 4. benchmark, timeline, example ------------------------------------------------------------
MLP="$B/examples/mlp_cuda"
step_if "$B/bench/sg_bench_adamw_cuda" bench_adamw_cuda 60 "$B/bench/sg_bench_adamw_cuda" \
  --sizes 1,4,16,64,256 --reps 20
copy_log bench_adamw_cuda
# The timeline: 8 layers x 4096 (101M params; each 64 MiB weight is a bucket of its own), one rank over an NCCL
# communicator of world 1, so the reductions are ordered on the comm stream as with several
# GPUs; the trace (Chrome JSON) comes back in $OUT.
step_if "$MLP" timeline_nccl_solo 60 "$MLP" --nccl-solo --layers 8 --hidden 4096 --batch 2048 \
  --steps 12 --log-every 100 --bucket-mb 32 --trace "$DEST/trace_nccl_solo.json"
copy_log timeline_nccl_solo 4
step_if "$MLP" timeline_ranks2 60 "$MLP" --ranks 2 --layers 8 --hidden 4096 --batch 2048 \
  --steps 12 --log-every 100 --bucket-mb 32 --trace "$DEST/trace_ranks2-%r.json"
copy_log timeline_ranks2 4
step_if "$MLP" mlp_cuda_ranks2 45 "$MLP" --ranks 2 --steps 300 --log-every 100 --check
copy_log mlp_cuda_ranks2 6
step_if "$MLP" mlp_cuda_ranks2_bf16 45 "$MLP" --ranks 2 --steps 300 --dtype bf16 --log-every 100 --check
copy_log mlp_cuda_ranks2_bf16 6
# overlap_param_gather on the GPU: each layer's GEMM waits on the stream for its own gather.
step_if "$MLP" mlp_cuda_overlap 45 "$MLP" --ranks 2 --steps 300 --dtype bf16 --log-every 100 \
  --check --overlap-gather --trace "$DEST/trace_overlap-%r.json"
copy_log mlp_cuda_overlap 6
if ! command -v python3 >/dev/null || ! timeout 60 python3 -c "import torch" >/dev/null 2>&1; then
  skip "bench_adamw_torch, torch_cuda, train_lm_cuda: torch is not importable"
else
  run_step bench_adamw_torch 90 python3 "$ROOT/bench/adamw_torch.py" --sizes 1,4,16,64,256 --reps 20
  copy_log bench_adamw_torch
  if ! timeout 60 python3 -c "import pytest" >/dev/null 2>&1; then
    skip "torch_cuda: pytest is not importable"
  else
    # SG_TEST_REQUIRE_CUDA: no GPU or no CUDA build is an error there, not a skip
    run_step torch_cuda 150 env SHARDGRAD_LIBRARY="$B/libshardgrad.so" SG_TEST_REQUIRE_CUDA=1 \
      python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/python/tests/test_torch_cuda.py"
    copy_log torch_cuda 12
  fi
  run_step train_lm_cuda 120 env SHARDGRAD_LIBRARY="$B/libshardgrad.so" \
    python3 "$ROOT/examples/python/train_lm.py" --device cuda --ranks 2 --steps 60 \
    --log-every 20 --trace "$DEST/trace_lm_cuda-%r.json"
  copy_log train_lm_cuda 8
fi

# ---- 5. compute-sanitizer ----------------------------------------------------------------------
SAN="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
  /opt/nvidia/compute-sanitizer/compute-sanitizer; do
  [[ -z "$SAN" && -x "$c" ]] && SAN="$c"
done
if [[ -z "$SAN" ]]; then
  skip "memcheck: compute-sanitizer not found"
else
  step_if "$T/test_cuda_kernels" memcheck_test_cuda_kernels 120 "$SAN" --tool memcheck \
    --error-exitcode 99 "$T/test_cuda_kernels" --quick
  grep -E 'ERROR SUMMARY' "$LOGS/memcheck_test_cuda_kernels.log" 2>/dev/null | tail -1 |
    sed 's/^/      /' | tee -a "$RES"
  # the engine's own launches (segments, staging, the comm stream), W = 1..3 threads and NCCL
  step_if "$T/test_cuda_engine" memcheck_test_cuda_engine 120 "$SAN" --tool memcheck \
    --error-exitcode 99 "$T/test_cuda_engine"
  grep -E 'ERROR SUMMARY' "$LOGS/memcheck_test_cuda_engine.log" 2>/dev/null | tail -1 |
    sed 's/^/      /' | tee -a "$RES"
fi

line "summary: $NPASS passed, $NFAIL failed, $NSKIP skipped in ${SECONDS}s; logs in $LOGS"
[[ $NFAIL -eq 0 ]]
