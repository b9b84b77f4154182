#!/usr/bin/env bash
# The whole check, as CI runs it (.ci/run):
#   1. installs what is missing from Debian (apt: cmake, Open MPI, clang, its sanitizer runtimes
#      and libomp, python3-venv); nothing is installed into the system's Python
#   1b. its own Python venv, $N-venv/ (build-venv/ by default; SG_TEST_VENV=DIR elsewhere), with
#      scripts/pydeps/requirements-test.txt at the versions of constraints-test.txt (the ones CI
#      passed with: torch, numpy, pytest, safetensors, transformers, accelerate, lightning,
#      matplotlib; ~6 GB, ~4 min on the first run, reused while the constraints are unchanged),
#      and on CUDA builds requirements-cuda-tools.txt (cuobjdump). Its bin/ goes first on PATH for
#      everything below, so every python3 the tests start is this venv's
#   2. Release build in build/ (CUDA compiled when nvcc exists), all ctest labels:
#      unit, local, mpi, install, nofold; then label cluster (MPI at np 4 across a simulated 2-node
#      cluster, scripts/cluster.sh; skipped where network namespaces are not permitted)
#   2b. clang Release build in build-clang/ (clang's OpenMP runtime, libomp, whose schedules differ
#      from gcc's libgomp; no CUDA, MPI as found): labels unit and local
#   3. ASan+UBSan build in build-asan/ (no MPI, -O1; CUDA when nvcc exists): labels unit, local
#      and cuda (the mock CUDA runtime)
#   4. TSan build in build-tsan/ (no MPI, no CUDA, no OpenMP): label local; and in
#      build-tsan-cuda/ the mock CUDA tests of the CUDA device's worker thread
#   5. pytest over python/tests with the venv's python; SG_TEST_NO_TORCH=1 installs numpy and
#      pytest only (the torch tests then skip themselves)
#   6. pip check (scripts/pip_check.sh): fresh venvs, pip install ./python and pip wheel, the
#      README's Python quick start with no environment variable (~2 min)
#   --newest (or SG_TEST_NEWEST=1): one more stage at the end, pytest in a second venv
#      ($N-venv-newest/) with the newest releases of the same requirements, printing which
#      versions differ from the constraints; what breaks there is what the next update of
#      constraints-test.txt must fix first
# Every stage runs even when an earlier one failed (except those that need its build); the
# summary at the end lists them all with their times, and the exit status is non-zero when any
# failed. Environment: JOBS (default 2), SG_TEST_SKIP_DEPS=1 to skip step 1, SG_TEST_BUILD=name
# to build into name/, name-asan/, name-tsan/ ... instead of build/, build-asan/, build-tsan/.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JOBS=${JOBS:-2}
N=${SG_TEST_BUILD:-build}
B=$ROOT/$N
VENV=${SG_TEST_VENV:-$B-venv}
PYDEPS=$ROOT/scripts/pydeps
NEWEST=${SG_TEST_NEWEST:-0}
for arg in "$@"; do
  case $arg in
    --newest) NEWEST=1 ;;
    *) echo "usage: scripts/test.sh [--newest]" >&2; exit 2 ;;
  esac
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export CTEST_OUTPUT_ON_FAILURE=1

declare -a SUMMARY=()
FAILED=0
T_START=$SECONDS

# stage NAME COMMAND...: runs the command, records PASS/FAIL and its duration
stage() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo
  echo "==== $name ===="
  "$@" || rc=$?
  local dt=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("PASS  $name (${dt}s)")
  else
    SUMMARY+=("FAIL  $name (exit $rc, ${dt}s)")
    FAILED=1
  fi
  return "$rc"
}

skip() { SUMMARY+=("SKIP  $1 ($2)"); }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi
}

install_deps() {
  local -a apt=()
  command -v cmake >/dev/null || apt+=(cmake)
  command -v pkg-config >/dev/null || apt+=(pkg-config)
  command -v mpirun >/dev/null || apt+=(openmpi-bin)
  command -v mpicc >/dev/null || apt+=(libopenmpi-dev)
  command -v clang >/dev/null || apt+=(clang)
  dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || apt+=(libclang-rt-14-dev)
  dpkg -s libomp-14-dev >/dev/null 2>&1 || apt+=(libomp-14-dev) # the clang stage's OpenMP
  python3 -c 'import ensurepip, venv' 2>/dev/null || apt+=(python3-venv)
  if [ "${#apt[@]}" -gt 0 ]; then
    echo "installing: ${apt[*]}"
    as_root apt-get update -q || return 1
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${apt[@]}" || return 1
  fi
  echo "dependencies present"
}

have_nvcc() { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }

# make_venv DIR PIN REQUIREMENTS...: a venv at DIR with the requirements, pinned to the
# constraints when PIN=1, else the newest releases (always upgraded); a pinned one is reused
# while its stamp (the requirement and constraint files' contents) matches.
make_venv() {
  local dir=$1 pin=$2 t0=$SECONDS stamp
  shift 2
  local -a req=() con=()
  local f
  for f in "$@"; do req+=(-r "$f"); done
  [ "$pin" = 1 ] && con=(-c "$PYDEPS/constraints-test.txt")
  stamp=$(cat "$@" "${con[@]:1}" 2>/dev/null | cksum)
  if [ "$pin" = 1 ] && [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.sg-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "reusing $dir (torch $("$dir/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))"
    return 0
  fi
  echo "installing $(grep -hv '^#' "$@" | awk 'NF{print $1}' | tr '\n' ' ')into $dir" \
    "$([ "$pin" = 1 ] && echo "(pinned: scripts/pydeps/constraints-test.txt)" || echo "(newest)")"
  rm -f "$dir/.sg-stamp"
  { [ -x "$dir/bin/python" ] || python3 -m venv "$dir"; } || return 1
  local -a upgrade=()
  [ "$pin" = 1 ] || upgrade=(--upgrade)
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "${upgrade[@]}" \
    "${req[@]}" "${con[@]}" || return 1
  echo "$stamp" >"$dir/.sg-stamp"
  echo "installed in $((SECONDS - t0))s"
}

venv_requirements() {
  if [ "${SG_TEST_NO_TORCH:-0}" = 1 ]; then
    local f
    f=$(mktemp /tmp/shardgrad-req-no-torch.XXXXXX)
    grep -E '^(numpy|pytest)\b' "$PYDEPS/requirements-test.txt" >"$f"
    echo "$f"
  else
    echo "$PYDEPS/requirements-test.txt"
  fi
  have_nvcc && echo "$PYDEPS/requirements-cuda-tools.txt"
}

# newest_check: pytest against the newest releases, and which versions moved
newest_check() {
  local new=$B-venv-newest
  # shellcheck disable=SC2046
  make_venv "$new" 0 $(venv_requirements) || return 1
  echo "versions that differ from scripts/pydeps/constraints-test.txt:"
  "$new/bin/python" -m pip freeze --exclude shardgrad |
    grep -vxF -f <(grep -v '^#' "$PYDEPS/constraints-test.txt") | sed 's/^/  /'
  PYTEST_PY=$new/bin/python run_pytest
}

configure_release() {
  cmake -S "$ROOT" -B "$B" -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)"
}

# A second compiler and OpenMP runtime: libomp hands out dynamic schedules out of order where
# libgomp does not (a272a1a fixed a loop that assumed order; only a clang build showed it).
configure_clang() {
  cmake -S "$ROOT" -B "$B-clang" -DCMAKE_C_COMPILER=clang \
    -DCMAKE_BUILD_TYPE=Release -DSG_WITH_CUDA=OFF -DSG_BUILD_EXAMPLES=OFF || return 1
  grep -q '^OpenMP_C_FLAGS:.*=.*fopenmp' "$B-clang/CMakeCache.txt" ||
    { echo "clang build without OpenMP (libomp missing): the stage would test nothing new" >&2; return 1; }
}

# CUDA as the Release build has it (on when nvcc is found): the host side of src/device/cuda.c,
# src/comm/backend/nccl.c and the engine on the CUDA device then run under the sanitizers over the mock
# CUDA runtime (ctest label cuda).
configure_asan() {
  cmake -S "$ROOT" -B "$B-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" -DSG_SANITIZE=address,undefined \
    -DSG_WITH_MPI=OFF -DSG_BUILD_EXAMPLES=OFF
}

# TSan: gcc when its runtime works here, else clang (TSAN_CC overrides). Both runtimes (gcc 12,
# clang 14) can refuse the high-entropy mmap layout of newer kernels ("unexpected memory
# mapping"); the tests therefore run with ASLR off (setarch -R) where that is allowed.
pick_tsan_cc() {
  local dir cc
  dir=$(mktemp -d)
  printf '#include <pthread.h>\nstatic void *f(void *a) { return a; }\nint main(void) {\n'\
'  pthread_t t; pthread_create(&t, 0, f, 0); return pthread_join(t, 0); }\n' >"$dir/t.c"
  for cc in gcc clang; do
    if command -v "$cc" >/dev/null && "$cc" -fsanitize=thread -pthread "$dir/t.c" -o "$dir/t" \
      2>/dev/null && no_aslr "$dir/t" >/dev/null 2>&1; then
      rm -rf "$dir"
      echo "$cc"
      return
    fi
  done
  rm -rf "$dir"
  echo clang
}

configure_tsan() {
  cmake -S "$ROOT" -B "$B-tsan" -DCMAKE_C_COMPILER="$TSAN_CC" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DSG_SANITIZE=thread -DSG_WITH_MPI=OFF -DSG_WITH_CUDA=OFF -DSG_BUILD_EXAMPLES=OFF \
    -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON
}

# The CUDA device's worker thread (host-driven collectives) under TSan: the mock CUDA runtime
# tests only (the whole mock suite is too slow under TSan), in a build of their own.
configure_tsan_cuda() {
  cmake -S "$ROOT" -B "$B-tsan-cuda" -DCMAKE_C_COMPILER="$TSAN_CC" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DSG_SANITIZE=thread -DSG_WITH_MPI=OFF -DSG_WITH_CUDA=ON -DSG_BUILD_EXAMPLES=OFF \
    -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON
}

# no_aslr COMMAND...: runs an executable with address randomization off when setarch allows it
no_aslr() {
  if setarch "$(uname -m)" -R true 2>/dev/null; then setarch "$(uname -m)" -R "$@"; else "$@"; fi
}

build() { cmake --build "$1" -j "$JOBS"; }

run_ctest() { # run_ctest DIR [ctest args...]
  local dir=$1
  shift
  (cd "$dir" && ctest -j "$JOBS" --output-on-failure "$@")
}

run_ctest_no_aslr() { # the same, with ASLR off (TSan)
  local dir=$1
  shift
  (cd "$dir" && no_aslr ctest -j "$JOBS" --output-on-failure "$@")
}

run_pytest() {
  local rc=0
  PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" SHARDGRAD_LIBRARY="$B/libshardgrad.so" \
    "$PYTEST_PY" -m pytest -q -rs "$ROOT/python/tests" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest: no tests collected (fine)"
    rc=0
  fi
  return "$rc"
}

if [ "${SG_TEST_SKIP_DEPS:-0}" = 1 ]; then
  skip dependencies "SG_TEST_SKIP_DEPS=1"
else
  stage dependencies install_deps
fi

# The venv (and on CUDA builds cuobjdump in it, for the SASS check). cuDNN's headers come with
# the CUDA toolkit here; examples/cnn_cudnn is built only where CMake finds them.
# shellcheck disable=SC2046
if stage "venv $VENV" make_venv "$VENV" 1 $(venv_requirements); then
  export PATH=$VENV/bin:$PATH VIRTUAL_ENV=$VENV
  PYTEST_PY=$VENV/bin/python
else
  PYTEST_PY=python3
fi

if stage "configure $N/ (Release)" configure_release && stage "build $N/" build "$B"; then
  stage "ctest $N/ (unit, local, mpi, install)" run_ctest "$B" -LE cluster
  # MPI across a simulated 2-node cluster (network namespaces, 1 Gbit/s links; ~10 s)
  if why=$("$ROOT/scripts/cluster.sh" check 2>&1); then
    stage "ctest $N/ (cluster: np 4 as 2 nodes x 2 ranks)" run_ctest "$B" -L cluster
  else
    skip "ctest $N/ (cluster)" "${why#cluster.sh: }"
  fi
else
  skip "ctest $N/" "build failed"
fi

if ! command -v clang >/dev/null; then
  skip "$N-clang/" "no clang"
elif stage "configure $N-clang/ (clang, libomp)" configure_clang && stage "build $N-clang/" build "$B-clang"; then
  stage "ctest $N-clang/ (unit, local)" run_ctest "$B-clang" -L "unit|local"
else
  skip "ctest $N-clang/" "build failed"
fi

if stage "configure $N-asan/ (ASan+UBSan)" configure_asan && stage "build $N-asan/" build "$B-asan"; then
  SG_TEST_QUICK=1 ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    stage "ctest $N-asan/ (unit, local, cuda mock)" run_ctest "$B-asan" -L "unit|local|cuda"
else
  skip "ctest $N-asan/" "build failed"
fi

TSAN_CC=${TSAN_CC:-$(pick_tsan_cc)}
if stage "configure $N-tsan/ (TSan, $TSAN_CC)" configure_tsan && stage "build $N-tsan/" build "$B-tsan"; then
  SG_TEST_QUICK=1 TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1} \
    stage "ctest $N-tsan/ (local)" run_ctest_no_aslr "$B-tsan" -L local
else
  skip "ctest $N-tsan/" "build failed"
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  skip "$N-tsan-cuda/" "no nvcc: no mock CUDA tests"
elif stage "configure $N-tsan-cuda/ (TSan, mock CUDA)" configure_tsan_cuda &&
  stage "build $N-tsan-cuda/" cmake --build "$B-tsan-cuda" -j "$JOBS" \
    --target test_cuda_mock test_cuda_mock_engine test_cuda_mock_unkind test_cuda_mock_lanes \
    test_cuda_mock_lean test_cuda_mock_fold test_cuda_mock_stream test_hybrid_cudamock; then
  SG_TEST_QUICK=1 TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1} \
    stage "ctest $N-tsan-cuda/ (CUDA worker thread)" run_ctest_no_aslr "$B-tsan-cuda" \
    -R '^test_cuda_mock(_engine|_unkind|_lanes|_lean|_fold|_stream)?$|^test_hybrid_cudamock_smoke_'
else
  skip "ctest $N-tsan-cuda/" "build failed"
fi

# libFuzzer over the checkpoint readers (manifest, rank-file header, safetensors header, sg_load),
# ASan+UBSan, bounded time; any finding fails the stage.
stage "fuzz checkpoint readers (${SG_FUZZ_SECONDS:-60}s)" "$ROOT/scripts/fuzz_ckpt.sh" "${SG_FUZZ_SECONDS:-60}"

if [ -d "$ROOT/python/tests" ]; then
  stage "pytest python/tests ($PYTEST_PY)" run_pytest
else
  skip pytest "no python/tests"
fi

# pip install ./python and pip wheel in fresh venvs, the README's Python quick start in each
# (torch from the torch venv; scikit-build-core from PyPI or pip's cache)
SG_TORCH_PYTHON=$PYTEST_PY stage "pip install ./python, pip wheel (scripts/pip_check.sh)" \
  "$ROOT/scripts/pip_check.sh" "$B-pip-check"

if [ "$NEWEST" = 1 ]; then
  stage "pytest against the newest releases ($B-venv-newest)" newest_check
fi

echo
echo "==== summary ($((SECONDS - T_START))s) ===="
printf '%s\n' "${SUMMARY[@]}"
n_pass=$(printf '%s\n' "${SUMMARY[@]}" | grep -c '^PASS')
n_fail=$(printf '%s\n' "${SUMMARY[@]}" | grep -c '^FAIL')
echo "stages: $n_pass passed, $n_fail failed"
[ "$FAILED" -eq 0 ]
