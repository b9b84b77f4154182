#!/usr/bin/env bash
# GPU checks of shardgrad, for a machine with (at least) one NVIDIA GPU. Not part of ctest: CI
# has no GPU. Usage, from anywhere:
#
#   bash tests/gpu/run.sh [--quick | --full] [--dry-run]   (default --quick; or SG_GPU_PROFILE)
#
# It is sized for the device machine the project's checks get (one H200, 16 cores, about 15
# minutes in all, start-up included, at most 10 per command, and at most 8 files back from
# $OUT). It leaves exactly two files in $OUT (else in build-gpu/gpu-out/):
#   gpu_results.txt   one line per step (PASS / FAIL / SKIP, seconds taken, the estimate, the
#                     test's own summary line or the reason), the benchmark tables, a summary
#   gpu_logs.tar.gz   every step's log (logs/NAME.log) and the Chrome traces (traces/)
# Both are rewritten after every step, so a run stopped by a timeout still returns what it did.
#
# Time. Every step and every probe (nvidia-smi, torch and pytest imports, nccl.h in Python's
# wheel) runs under `timeout -k`, with its limit cut to what is left of the budget
# (SG_GPU_BUDGET_S; quick 285 s, full 570 s) less the estimates of the quick steps still to come
# (EST below): a step that hangs uses its own share and never the time of the steps after it,
# and one that no longer fits is reported SKIP. The benchmark and the timeline come right after
# the build, before the tests, so that their numbers come back even when a test hangs.
#
# --dry-run (no GPU, no build, nothing run): walks the same steps on a simulated clock, each one
# taking its estimate (SG_GPU_DRY_HANG=NAME: that one takes its whole limit, as a hang would),
# prints each step's limit, and exits 1 unless every step still got at least its estimate within
# the budget. ctest runs it (tests/cuda.cmake, test_gpu_run_dry).
# SG_GPU_STEPS (a bash regex) runs only the steps whose names match, besides configure and the
# builds, which are quick on a second call in the same build directory.
#
# Profiles (estimates on 16 cores from a bare checkout; the build for the GPU's own
# architecture only, SG_GPU_ARCHS overrides, e.g. "80;90"):
#   quick (~3.5 min): configure (15 s), build of the library, the kernel/engine tests, the AdamW
#     benchmark and the MLP example (80 s); sg_bench_adamw_cuda (fused AdamW against a
#     device-to-device copy; 15 s), one timeline (mlp_cuda --nccl-solo --trace: reductions on
#     the comm stream against the cuBLAS backward; 20 s); test_cuda_device (2 s), test_cuda_kernels (every
#     CUDA kernel against the CPU kernels, bitwise; 25 s), test_cuda_queues (streams, tickets,
#     deadlines, NCCL at world 1; 15 s), test_cuda_engine (the engine on the GPU against the
#     CPU device, W = 1..3 threads, W = 1 NCCL; 30 s), test_hybrid_cuda (hybrid engines of
#     threads on the GPU against the CPU's, with and without offload; 2 x 15 s).
#   full (~9 min): the quick steps, then the other test programs and examples (build 60 s);
#     test_engine_cuda (W = 2 threads, W = 1 NCCL, W = 3 and 4 quick, two MPI processes through
#     pinned staging), test_fp16_scale_cuda, test_trace_cuda, test_groups_cuda; the timeline of
#     two ranks as threads; mlp_cuda --ranks 2 --check in f32 and bf16 and with
#     --overlap-gather; cnn_cudnn --check (cuDNN convolutions against a CPU reference, 2 ranks)
#     and a traced --nccl-solo run; bench/adamw_torch.py, python/tests/test_torch_cuda.py and
#     examples/python/train_lm.py --device cuda (when torch and pytest import); compute-sanitizer
#     memcheck on test_cuda_kernels --quick and test_cuda_engine; the host side of optimizer
#     offload (test_host_step_cuda, test_offload_cuda: host norm and AdamW pipeline against the
#     GPU's kernels, bitwise; sg_bench_host_step --device cuda: the host step with DMA copies),
#     the whole step of mlp_cuda with and without --offload (steps/s, same run).
#     test_cuda_engine (quick) runs every sharded case offloaded
#     too, bitwise against the run without offload.
# Exit status: 0 when nothing failed. Without a GPU every GPU step fails fast with its reason.
set -uo pipefail

PROFILE="${SG_GPU_PROFILE:-quick}"
DRY=0
for a in "$@"; do
  case "$a" in
    --quick) PROFILE=quick ;;
    --full) PROFILE=full ;;
    --dry-run) DRY=1 ;;
    *) echo "usage: run.sh [--quick | --full] [--dry-run]" >&2; exit 64 ;;
  esac
done
case "$PROFILE" in
  quick) BUDGET="${SG_GPU_BUDGET_S:-285}" ;;
  full) BUDGET="${SG_GPU_BUDGET_S:-570}" ;;
  *) echo "run.sh: SG_GPU_PROFILE must be quick or full (got '$PROFILE')" >&2; exit 64 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
B="${SG_GPU_BUILD:-$ROOT/build-gpu}"
DEST="${OUT:-$B/gpu-out}"
WORK="$B/gpu-run" # logs/ and traces/, archived into $DEST after every step
mkdir -p "$B" "$DEST" || exit 1
rm -rf "$WORK" && mkdir -p "$WORK/logs" "$WORK/traces" || exit 1
RES="$DEST/gpu_results.txt"
ARCHIVE="$DEST/gpu_logs.tar.gz"
LOGS="$WORK/logs"
TRACES="$WORK/traces"
JOBS="$(nproc 2>/dev/null || echo 2)"
NPASS=0 NFAIL=0 NSKIP=0
CURRENT="" CHILD=""

# The quick steps' estimates (seconds, 16 cores), in the order they run. RESERVE is what the
# ones still to come need: a step's limit is cut so that it leaves them that much.
declare -A EST=([configure]=15 [build]=80 [bench_adamw_cuda]=15 [timeline_nccl_solo]=20
  [test_cuda_device]=2 [test_cuda_kernels]=25 [test_cuda_queues]=15 [test_cuda_engine]=45
  [hybrid_cuda]=15 [hybrid_cuda_offload]=15)
RESERVE=0
for k in "${!EST[@]}"; do RESERVE=$((RESERVE + EST[$k])); done
CLOCK=0     # --dry-run: the simulated seconds so far
DRY_SHORT="" # --dry-run: the steps that got less than their estimate

export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"
export PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

line() { echo "$*" | tee -a "$RES"; }
pass() { NPASS=$((NPASS + 1)); line "PASS  $*"; }
fail() { NFAIL=$((NFAIL + 1)); line "FAIL  $*"; }
skip() { NSKIP=$((NSKIP + 1)); line "SKIP  $*"; }

# The logs and traces so far, replacing the archive in one rename.
archive() {
  tar -C "$WORK" -czf "$DEST/.gpu_logs.part" logs traces 2>/dev/null &&
    mv -f "$DEST/.gpu_logs.part" "$ARCHIVE"
}

summary() {
  line "summary: $NPASS passed, $NFAIL failed, $NSKIP skipped in ${SECONDS}s (profile $PROFILE," \
    "budget ${BUDGET}s); logs and traces in $(basename "$ARCHIVE")"
  archive
}

# Stopped from outside (the device machine's limit, ^C): say where, keep what was done.
on_signal() {
  [[ -n "$CHILD" ]] && kill -TERM "$CHILD" 2>/dev/null
  fail "${CURRENT:-run.sh}: interrupted by SIG$1 after ${SECONDS}s"
  summary
  exit 130
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

# The test's own summary ("N passed, M failed"), or the log's last line.
summary_of() {
  local s
  s="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" 2>/dev/null | tail -1)"
  [[ -n "$s" ]] || s="$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -1 | cut -c1-200)"
  echo "$s"
}

# limited LIMIT LOG COMMAND...: the command in $B under timeout -k, in the background so that a
# signal reaches the trap at once; its exit status (124 or 137 past the limit).
limited() {
  local limit="$1" log="$2"
  shift 2
  (cd "$B" && exec timeout -k 5 "$limit" "$@") </dev/null >"$log" 2>&1 &
  CHILD=$!
  wait "$CHILD"
  local rc=$?
  CHILD=""
  return $rc
}

now() { if [[ $DRY -eq 1 ]]; then echo "$CLOCK"; else echo "$SECONDS"; fi; }

# The budget left for a step, less 8 s for the summary and the archive.
left() { echo $((BUDGET - $(now) - 8)); }

# probe NAME LIMIT COMMAND...: a quiet check inside the budget (0: yes); noted in the results.
probe() {
  local name="$1" limit="$2" l
  shift 2
  if [[ $DRY -eq 1 ]]; then
    line "probe $name: not run (dry run)"
    return 1
  fi
  l=$(left)
  if [[ $l -lt 3 ]]; then
    line "probe $name: no time left"
    return 125
  fi
  [[ $limit -le $l ]] || limit=$l
  local t0=$SECONDS rc
  CURRENT="probe $name"
  limited "$limit" "$LOGS/probe_$name.log" "$@"
  rc=$?
  CURRENT=""
  line "probe $name: $([[ $rc -eq 0 ]] && echo yes || echo "no (exit $rc)") ($((SECONDS - t0))s)"
  return $rc
}

# dry_step NAME LIMIT EST: --dry-run's stand-in for running a step: the simulated clock moves by
# its estimate, or by its whole limit for SG_GPU_DRY_HANG; notes a limit under the estimate.
dry_step() {
  local name="$1" limit="$2" est="$3" took="$3"
  [[ "$name" == "${SG_GPU_DRY_HANG:-}" ]] && took=$limit
  [[ $took -le $limit ]] || took=$limit
  CLOCK=$((CLOCK + took))
  [[ $limit -ge $est ]] || DRY_SHORT+=" $name(${limit}s<${est}s)"
  if [[ $took -eq $limit && "$name" == "${SG_GPU_DRY_HANG:-}" ]]; then
    fail "$name: timed out after ${limit}s (est ${est}s): simulated hang (dry run, at ${CLOCK}s)"
  else
    pass "$name (${took}s, est ${est}s, limit ${limit}s): dry run, at ${CLOCK}s"
  fi
}

# run_step NAME LIMIT_S EST_S COMMAND...: runs in $B, log in logs/NAME.log; the limit is cut to
# the budget left less RESERVE (the quick steps after this one); a step with under 10 s (or
# under its estimate, when that is shorter) is skipped (status 125).
run_step() {
  local name="$1" limit="$2" est="$3"
  shift 3
  [[ -n "${EST[$name]:-}" ]] && RESERVE=$((RESERVE - EST[$name]))
  if [[ -n "${SG_GPU_STEPS:-}" && ! "$name" =~ ^(configure|build) && ! "$name" =~ $SG_GPU_STEPS ]]; then
    skip "$name: not selected by SG_GPU_STEPS"
    return 125
  fi
  local l floor=$((est < 10 ? (est < 1 ? 1 : est) : 10))
  l=$(($(left) - RESERVE))
  if [[ $l -lt $floor ]]; then
    skip "$name: no time left in the ${BUDGET}s budget (est ${est}s, ${RESERVE}s kept for the steps after it)"
    [[ $DRY -eq 1 ]] && DRY_SHORT+=" $name(skipped)"
    return 125
  fi
  [[ $limit -le $l ]] || limit=$l
  if [[ $DRY -eq 1 ]]; then
    dry_step "$name" "$limit" "$est"
    return 0
  fi
  local log="$LOGS/$name.log" t0=$SECONDS rc
  CURRENT="$name"
  limited "$limit" "$log" "$@"
  rc=$?
  CURRENT=""
  local took=$((SECONDS - t0)) sum
  sum="$(summary_of "$log")"
  if [[ $rc -eq 0 && "$sum" =~ (^|: )SKIP ]]; then # the program found nothing to do here
    skip "$name (${took}s): $sum"
  elif [[ $rc -eq 0 ]]; then
    pass "$name (${took}s, est ${est}s): $sum"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    fail "$name: timed out after ${limit}s (est ${est}s): $sum"
  else
    fail "$name (exit $rc, ${took}s, est ${est}s): $sum"
    grep -E '^FAIL' "$log" | head -8 | sed 's/^/      /' | tee -a "$RES"
  fi
  archive
  return $rc
}

# copy_log NAME [N]: the step's last N (40) output lines, indented, into the results file.
copy_log() {
  [[ -f "$LOGS/$1.log" ]] && sed 's/^/      /' "$LOGS/$1.log" | tail -"${2:-40}" | tee -a "$RES"
  return 0
}
# step_if PROGRAM NAME LIMIT EST COMMAND...: the step, or SKIP when PROGRAM was not built
step_if() {
  local prog="$1"
  shift
  if [[ -x "$prog" || $DRY -eq 1 ]]; then
    run_step "$@"
  else
    [[ -n "${EST[$1]:-}" ]] && RESERVE=$((RESERVE - EST[$1]))
    skip "$1: $(basename "$prog") was not built"
  fi
}
# build_targets NAME LIMIT EST TARGET...: the targets that this configuration has (a CUDA build
# without cuBLAS or cuDNN lacks some examples), in one build step
build_targets() {
  local name="$1" limit="$2" est="$3" t
  shift 3
  local -a have=()
  local known
  local l
  l=$(left)
  [[ $l -ge 10 ]] || { skip "$name: no time left in the ${BUDGET}s budget (est ${est}s)"; return 125; }
  if [[ $DRY -eq 1 ]]; then
    have=("$@")
  else
    known="$(cd "$B" && timeout -k 5 $((l < 60 ? l : 60)) cmake --build . --target help 2>/dev/null)"
    for t in "$@"; do
      if grep -qE "(^|[ .])$t( |$)" <<<"$known"; then have+=("$t"); else line "note  $name: no target $t in this configuration"; fi
    done
  fi
  [[ ${#have[@]} -gt 0 ]] || { skip "$name: no targets"; return 125; }
  run_step "$name" "$limit" "$est" cmake --build "$B" -j "$JOBS" --target "${have[@]}"
}

: >"$RES"
line "shardgrad GPU checks ($PROFILE), $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit" \
  "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), budget ${BUDGET}s, $JOBS cores"
GPU_OK=0
if probe nvidia_smi 15 nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total \
  --format=csv,noheader; then
  GPU_OK=1
  line "gpu: $(head -4 "$LOGS/probe_nvidia_smi.log" | tr '\n' ';')"
else
  line "gpu: none found ($(summary_of "$LOGS/probe_nvidia_smi.log")): the GPU steps below fail with their reasons"
fi
probe nvcc 15 nvcc --version >/dev/null && line "nvcc: $(tail -1 "$LOGS/probe_nvcc.log")"
archive

# ---- build ----------------------------------------------------------------------------------------
ARCHS="${SG_GPU_ARCHS:-}"
if [[ -z "$ARCHS" && $GPU_OK -eq 1 ]]; then
  # compute_cap "9.0" -> "90"; several GPUs of one kind give one entry
  ARCHS="$(cut -d, -f3 "$LOGS/probe_nvidia_smi.log" | tr -d ' .' | sort -u | paste -sd ';' -)"
fi
[[ -n "$ARCHS" ]] || ARCHS="80;90"
line "architectures: $ARCHS"

# NCCL: the GPU image may carry it only in Python's nvidia-nccl wheel (header and library under
# site-packages/nvidia/nccl); use that when the system has none, so that the NCCL steps run.
NCCL_ARGS=()
NVCC_INC="$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")/../include"
if [[ ! -f /usr/include/nccl.h && ! -f /usr/local/cuda/include/nccl.h && ! -f "$NVCC_INC/nccl.h" ]]; then
  if probe nccl_wheel 30 python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' &&
    PYNCCL="$(head -1 "$LOGS/probe_nccl_wheel.log")" && [[ -f "$PYNCCL/include/nccl.h" ]]; then
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
MLP="$B/examples/mlp_cuda"
CNN="$B/examples/cnn_cudnn"
QUICK_TARGETS=(shardgrad test_cuda_device test_cuda_kernels test_cuda_queues test_cuda_engine
  test_hybrid_cuda sg_bench_adamw_cuda example_mlp_cuda)
FULL_TARGETS=(test_engine_cuda test_fp16_scale_cuda test_trace_cuda test_groups_cuda
  example_cnn_cudnn test_host_step_cuda test_offload_cuda sg_bench_host_step)
if ! command -v cmake >/dev/null && [[ $DRY -eq 0 ]]; then
  fail "configure: cmake not found"
elif run_step configure 90 "${EST[configure]}" cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release \
  -DSG_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" -DSG_BUILD_EXAMPLES=ON "${NCCL_ARGS[@]}"; then
  build_targets build 200 "${EST[build]}" "${QUICK_TARGETS[@]}"
else
  RESERVE=$((RESERVE - EST[build]))
fi

# ---- quick: AdamW vs copy and one timeline first (numbers back even if a test hangs), then the
# kernels, queues, the engine ---------------------------------------------------------------------
step_if "$B/bench/sg_bench_adamw_cuda" bench_adamw_cuda 60 "${EST[bench_adamw_cuda]}" \
  "$B/bench/sg_bench_adamw_cuda" --sizes 1,4,16,64,256 --reps 20
copy_log bench_adamw_cuda
# The timeline: 8 layers x 4096 (101M params; each 64 MiB weight is a bucket of its own), one
# rank over an NCCL communicator of world 1, so the reductions are ordered on the comm stream as
# with several GPUs.
step_if "$MLP" timeline_nccl_solo 60 "${EST[timeline_nccl_solo]}" "$MLP" --nccl-solo --layers 8 \
  --hidden 4096 --batch 2048 --steps 12 --log-every 100 --bucket-mb 32 \
  --trace "$TRACES/trace_nccl_solo.json"
copy_log timeline_nccl_solo 4
step_if "$T/test_cuda_device" test_cuda_device 30 "${EST[test_cuda_device]}" "$T/test_cuda_device"
step_if "$T/test_cuda_kernels" test_cuda_kernels 90 "${EST[test_cuda_kernels]}" "$T/test_cuda_kernels"
step_if "$T/test_cuda_queues" test_cuda_queues 60 "${EST[test_cuda_queues]}" "$T/test_cuda_queues"
# (with optimizer offload: every sharded case again offloaded, bitwise against the run without)
step_if "$T/test_cuda_engine" test_cuda_engine 120 "${EST[test_cuda_engine]}" "$T/test_cuda_engine"
# Hybrid engines (2x2 and 3x2 ranks as threads on the GPU, quick cases) bitwise against the
# CPU's hybrid, flat and one-rank engines, and offloaded against the same without offload.
step_if "$T/test_hybrid_cuda" hybrid_cuda 60 "${EST[hybrid_cuda]}" "$T/test_hybrid_cuda" \
  --cuda local local --quick
step_if "$T/test_hybrid_cuda" hybrid_cuda_offload 60 "${EST[hybrid_cuda_offload]}" \
  "$T/test_hybrid_cuda" --cuda local local --offload --quick

if [[ $DRY -eq 1 ]]; then # the full profile's other steps are not planned on the clock
  line "dry run ($PROFILE steps of the quick plan): ${CLOCK}s of ${BUDGET}s" \
    "${SG_GPU_DRY_HANG:+(hang: $SG_GPU_DRY_HANG)}"
  if [[ -n "$DRY_SHORT" ]]; then
    line "dry run: FAIL, steps short of their estimate:$DRY_SHORT"
    exit 1
  fi
  line "dry run: every step got at least its estimate within the budget"
  exit 0
fi

if [[ "$PROFILE" != full ]]; then
  summary
  [[ $NFAIL -eq 0 ]]
  exit
fi

# ---- full: the other engine tests -----------------------------------------------------------------
build_targets build_full 150 60 "${FULL_TARGETS[@]}"
# test_engine's full matrix is 35 cases of 8 params up to 300000 elements: launch- and
# host-bound; --nccl initializes NCCL once per case. W = 3 and 4 come after the rest.
step_if "$T/test_engine_cuda" engine_cuda_w2 90 25 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --local 2
step_if "$T/test_engine_cuda" engine_cuda_nccl 90 30 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --nccl
step_if "$T/test_fp16_scale_cuda" fp16_scale_cuda 45 5 env SG_TEST_DEVICE=cuda "$T/test_fp16_scale_cuda"
step_if "$T/test_trace_cuda" trace_cuda 45 5 env SG_TEST_DEVICE=cuda "$T/test_trace_cuda"
copy_log trace_cuda 8
step_if "$T/test_groups_cuda" groups_cuda 45 10 env SG_TEST_DEVICE=cuda "$T/test_groups_cuda"
copy_log groups_cuda 8
# The MPI communicator with GPU buffers (pinned host staging): two processes share the GPU.
if command -v mpirun >/dev/null && grep -q 'SG_WITH_MPI:BOOL=ON' "$B/CMakeCache.txt" 2>/dev/null; then
  step_if "$T/test_engine_cuda" engine_cuda_mpi_np2 60 20 mpirun -np 2 --oversubscribe \
    --allow-run-as-root --bind-to none "$T/test_engine_cuda" --mpi --quick --device cuda
else
  skip "engine_cuda_mpi_np2: no mpirun or no MPI in the build"
fi
for w in 3 4; do
  step_if "$T/test_engine_cuda" engine_cuda_w$w 60 15 env SG_TEST_DEVICE=cuda "$T/test_engine_cuda" --local $w --quick
done

# ---- full: optimizer offload, host side -------------------------------------------------------------
# The host AdamW pipeline and the host norm against the GPU's own kernels, bit for bit (the mock
# CUDA runtime checks the same in CI); then the host step's timing with real DMA copies.
step_if "$T/test_host_step_cuda" host_step_cuda 60 8 "$T/test_host_step_cuda"
step_if "$T/test_offload_cuda" offload_cuda 45 3 "$T/test_offload_cuda"
step_if "$B/bench/sg_bench_host_step" bench_host_step_cuda 60 15 "$B/bench/sg_bench_host_step" \
  --device cuda --size 64 --reps 5 --python python3
copy_log bench_host_step_cuda 22

# The whole step with and without offload, same model, same run (bf16, 8 x 4096: 134M params,
# one rank over NCCL of world 1): steps/s of each and the offloaded one's pinned host memory.
for off in "" --offload; do
  step_if "$MLP" "mlp_cuda_step${off:+_offload}" 60 15 "$MLP" --nccl-solo --layers 8 --hidden 4096 \
    --batch 2048 --steps 12 --dtype bf16 --log-every 100 --bucket-mb 32 $off
  copy_log "mlp_cuda_step${off:+_offload}" 4
done

# ---- full: examples -------------------------------------------------------------------------------
step_if "$MLP" timeline_ranks2 60 20 "$MLP" --ranks 2 --layers 8 --hidden 4096 --batch 2048 \
  --steps 12 --log-every 100 --bucket-mb 32 --trace "$TRACES/trace_ranks2-%r.json"
copy_log timeline_ranks2 4
step_if "$MLP" mlp_cuda_ranks2 45 8 "$MLP" --ranks 2 --steps 300 --log-every 100 --check
copy_log mlp_cuda_ranks2 4
step_if "$MLP" mlp_cuda_ranks2_bf16 45 8 "$MLP" --ranks 2 --steps 300 --dtype bf16 --log-every 100 --check
copy_log mlp_cuda_ranks2_bf16 4
# overlap_param_gather on the GPU: each layer's GEMM waits on the stream for its own gather.
step_if "$MLP" mlp_cuda_overlap 45 8 "$MLP" --ranks 2 --steps 300 --dtype bf16 --log-every 100 \
  --check --overlap-gather --trace "$TRACES/trace_overlap-%r.json"
copy_log mlp_cuda_overlap 6
# cuDNN: a few steps against the same network on the CPU, then training as 2 ranks on one GPU.
step_if "$CNN" cnn_cudnn_check 60 10 "$CNN" --ranks 2 --steps 200 --log-every 50 --check
copy_log cnn_cudnn_check 10
step_if "$CNN" cnn_cudnn_nccl_solo 60 10 "$CNN" --nccl-solo --steps 100 --log-every 50 \
  --trace "$TRACES/trace_cnn_nccl_solo.json"
copy_log cnn_cudnn_nccl_solo 4

# ---- full: torch ----------------------------------------------------------------------------------
if ! command -v python3 >/dev/null || ! probe torch 60 python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"; then
  skip "bench_adamw_torch, torch_cuda, train_lm_cuda: torch is not importable"
else
  run_step bench_adamw_torch 90 20 python3 "$ROOT/bench/adamw_torch.py" --sizes 1,4,16,64,256 --reps 20
  copy_log bench_adamw_torch
  if ! probe pytest 30 python3 -c "import pytest"; then
    skip "torch_cuda: pytest is not importable"
  else
    # SG_TEST_REQUIRE_CUDA: no GPU or no CUDA build is an error there, not a skip
    run_step torch_cuda 150 60 env SHARDGRAD_LIBRARY="$B/libshardgrad.so" SG_TEST_REQUIRE_CUDA=1 \
      python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/python/tests/test_torch_cuda.py"
    copy_log torch_cuda 12
  fi
  run_step train_lm_cuda 120 45 env SHARDGRAD_LIBRARY="$B/libshardgrad.so" \
    python3 "$ROOT/examples/python/train_lm.py" --device cuda --ranks 2 --steps 60 \
    --log-every 20 --trace "$TRACES/trace_lm_cuda-%r.json"
  copy_log train_lm_cuda 8
fi

# ---- full: compute-sanitizer ----------------------------------------------------------------------
SAN="$(command -v compute-sanitizer || true)"
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
  /opt/nvidia/compute-sanitizer/compute-sanitizer; do
  [[ -z "$SAN" && -x "$c" ]] && SAN="$c"
done
if [[ -z "$SAN" ]]; then
  skip "memcheck: compute-sanitizer not found"
else
  step_if "$T/test_cuda_kernels" memcheck_test_cuda_kernels 120 40 "$SAN" --tool memcheck \
    --error-exitcode 99 "$T/test_cuda_kernels" --quick
  grep -E 'ERROR SUMMARY' "$LOGS/memcheck_test_cuda_kernels.log" 2>/dev/null | tail -1 |
    sed 's/^/      /' | tee -a "$RES"
  # the engine's own launches (segments, staging, the comm stream), W = 1..3 threads and NCCL
  step_if "$T/test_cuda_engine" memcheck_test_cuda_engine 150 90 "$SAN" --tool memcheck \
    --error-exitcode 99 "$T/test_cuda_engine"
  grep -E 'ERROR SUMMARY' "$LOGS/memcheck_test_cuda_engine.log" 2>/dev/null | tail -1 |
    sed 's/^/      /' | tee -a "$RES"
fi

summary
[[ $NFAIL -eq 0 ]]
