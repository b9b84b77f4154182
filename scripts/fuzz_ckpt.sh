#!/usr/bin/env bash
# Fuzzes the checkpoint readers (tests/fuzz_ckpt.c: manifest, rank-file header, safetensors
# header, and sg_load on fuzzed manifests) with libFuzzer for a bounded time.
#   scripts/fuzz_ckpt.sh [SECONDS]     (default 60; or SG_FUZZ_SECONDS)
# Builds with clang, ASan+UBSan and coverage in build-fuzz/, seeds the corpus from a real
# checkpoint, and exits non-zero on any finding (crash, leak, sanitizer report, timeout); the
# reproducer is left in build-fuzz/ (crash-*, leak-*, timeout-*).
# Environment: JOBS (build jobs, default 2), CC_FUZZ (default clang).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECS=${1:-${SG_FUZZ_SECONDS:-60}}
JOBS=${JOBS:-2}
B=$ROOT/build-fuzz

cmake -S "$ROOT" -B "$B" -DCMAKE_C_COMPILER="${CC_FUZZ:-clang}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DSG_SANITIZE=address,undefined -DSG_FUZZ=ON -DSG_WITH_MPI=OFF -DSG_WITH_CUDA=OFF \
  -DSG_BUILD_EXAMPLES=OFF -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON >/dev/null
cmake --build "$B" -j "$JOBS" --target fuzz_ckpt

CORPUS=$B/fuzz_ckpt_corpus
mkdir -p "$CORPUS"
SG_FUZZ_WRITE_SEEDS="$CORPUS" "$B/tests/fuzz_ckpt" -runs=0 "$CORPUS" >/dev/null 2>&1
echo "fuzz_ckpt: $(ls "$CORPUS" | wc -l) corpus files, running ${SECS}s"
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} \
  "$B/tests/fuzz_ckpt" -max_total_time="$SECS" -max_len=16384 -timeout=20 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$B/" "$CORPUS"
