#!/usr/bin/env bash
# bench/slow_links_quality.sh: the quality of the slow-link modes (docs/slow-links.md) in one
# run: examples/python/train_lm.py as 2 nodes x 2 ranks (threads) on the Python standard
# library's sources, the same seed, model, data and schedule for every mode, held-out loss every
# --eval-every steps; one JSON per mode in OUT, then scripts/plot_slow_links.py draws the curves.
#
#   bench/slow_links_quality.sh [--out DIR] [--steps N] [--eval-every N] [--python PY]
#                               [--modes "exact int8 int4 diloco8 diloco32 diloco8bf16 diloco8int8
#                                         diloco8m5 diloco32m5 diloco8int8m5 diloco8avg
#                                         diloco8stream diloco8stream256k
#                                         diloco8int8stream256k"]
#                               [-- extra train_lm.py flags]
# Steps and the evaluation period should be multiples of the outer periods (8, 32): between
# outer steps rank 0 holds its own replica's parameters, at them every replica's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/bench/out/slow-links STEPS=320 EVAL=32 PY=${PY:-} EXTRA=()
MODES="exact int8 int4 diloco8 diloco32 diloco8bf16 diloco8int8"
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --eval-every) EVAL=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "bench/slow_links_quality.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
[ -n "$PY" ] || PY=$(command -v python3)
mkdir -p "$OUT"
opts_of() {
  case $1 in
    exact) echo "" ;;
    int8) echo "--opt replica_codec=int8" ;;
    int4) echo "--opt replica_codec=int4" ;;
    diloco8) echo "--opt outer_every=8" ;;
    diloco32) echo "--opt outer_every=32" ;;
    diloco8bf16) echo "--opt outer_every=8 --opt replica_reduce_dtype=bf16" ;;
    diloco8int8) echo "--opt outer_every=8 --opt replica_codec=int8" ;;
    # outer momentum 0.5 instead of the DiLoCo paper's 0.9 (tuned for H in the hundreds)
    diloco8m5) echo "--opt outer_every=8 --opt outer_momentum=0.5" ;;
    diloco32m5) echo "--opt outer_every=32 --opt outer_momentum=0.5" ;;
    diloco8int8m5) echo "--opt outer_every=8 --opt replica_codec=int8 --opt outer_momentum=0.5" ;;
    diloco8avg) echo "--opt outer_every=8 --opt outer_lr=1.0 --opt outer_momentum=0" ;;
    # streaming outer steps: step k of each period syncs the buckets b with b mod 8 = k - 1
    diloco8stream) echo "--opt outer_every=8 --opt outer_streaming=1 --opt outer_momentum=0.5" ;;
    # the same over 256 KiB buckets: train_lm's 1 MiB buckets give this 3.2 MB model 4
    # buckets, so only 4 of the 8 steps would sync one; 256 KiB gives 22, spread over the period
    diloco8stream256k) echo "--opt outer_every=8 --opt outer_streaming=1 --opt outer_momentum=0.5 --opt bucket_bytes=262144" ;;
    # ... with the pseudo-gradient as int8 codes with error feedback
    diloco8int8stream256k) echo "--opt outer_every=8 --opt outer_streaming=1 --opt outer_momentum=0.5 --opt replica_codec=int8 --opt bucket_bytes=262144" ;;
    *) echo "bench/slow_links_quality.sh: unknown mode $1" >&2; exit 2 ;;
  esac
}
for m in $MODES; do
  # shellcheck disable=SC2046
  "$PY" "$ROOT/examples/python/train_lm.py" --ranks 4 --hybrid 2 --stdlib-corpus 2 \
    --steps "$STEPS" --eval-every "$EVAL" --threads 1 --log-every 64 --json "$OUT/$m.json" \
    $(opts_of "$m") "${EXTRA[@]}" > "$OUT/$m.log" 2>&1 || { echo "$m failed:"; tail -5 "$OUT/$m.log"; exit 1; }
  echo "$m: $(grep -E 'steps in' "$OUT/$m.log")"
done
"$PY" "$ROOT/scripts/plot_slow_links.py" "$OUT" $MODES
