#!/usr/bin/env bash
# bench/plan_validate.sh: the planner's predictions against measured steps on the simulated
# cluster (scripts/cluster.sh, 2 nodes x 2 ranks; docs/planner.md). For each link rate:
#   1. the probe on the cluster (python -m shardgrad.plan --probe: link rate and latency per
#      level, norm + AdamW rate), written to OUT/probe-RATE.json;
#   2. for each micro-batch count: the model alone (sg_bench_cluster --mode compute: the
#      forward + backward time per micro-batch, an input of the model), then shardgrad flat
#      ZeRO-2 and hybrid with an f32 and a bf16 wire (sg_bench_cluster --mode flat|hybrid);
# then bench/plan_validate.py predicts each measured row from its probe and compute time and
# prints the table (and writes OUT/validation.json; --plot PNG: predicted against measured).
#
#   bench/plan_validate.sh [--build DIR] [--rates "100mbit 1gbit 10gbit"] [--micro "1 8"]
#                          [--hidden N] [--layers N] [--batch N] [--steps N] [--warmup N]
#                          [--bucket-mb X] [--python PY] [--out DIR] [--plot PNG]
# Needs root (network namespaces) and an MPI build with the benchmarks; exits 77 without them.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build RATES="100mbit 1gbit 10gbit" MICROS="1 8" HIDDEN=1024 LAYERS=9 BATCH=32
STEPS=3 WARMUP=1 BUCKET=8 PY=$ROOT/build-venv/bin/python OUT="" PLOT=""
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --micro) MICROS=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --bucket-mb) BUCKET=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --plot) PLOT=$2; shift 2 ;;
    *) sed -n '2,16p' "$0" >&2; exit 64 ;;
  esac
done
BENCH=$BUILD/bench/sg_bench_cluster
[ -x "$BENCH" ] || { echo "plan_validate: $BENCH not built (an MPI build)" >&2; exit 77; }
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$(mktemp -d /tmp/sg_plan_validate.XXXXXX)}
mkdir -p "$OUT"
CL=("$ROOT/scripts/cluster.sh" --name sgplan --subnet 10.78.0)
"${CL[@]}" check || exit 77
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export PYTHONPATH=$ROOT/python SHARDGRAD_LIBRARY=$BUILD/libshardgrad.so
trap '"${CL[@]}" down >/dev/null 2>&1' EXIT
trap 'exit 1' INT TERM
RESULTS=$OUT/results.txt
: > "$RESULTS"
model=(--steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH" --hidden "$HIDDEN" --layers "$LAYERS")
run() { "${CL[@]}" run --ranks-per-node 2 -x PYTHONPATH -x SHARDGRAD_LIBRARY -x OMP_NUM_THREADS "$@"; }

for rate in $RATES; do
  "${CL[@]}" down >/dev/null 2>&1
  "${CL[@]}" up --nodes 2 --rate "$rate" 2>/dev/null || exit 1
  echo "== $rate: probe (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  run "$PY" -m shardgrad.plan --probe --out "$OUT/probe-$rate.json" > /dev/null || exit 1
  for micro in $MICROS; do
    for v in "compute" "flat" "hybrid f32" "hybrid bf16"; do
      set -- $v
      args=(--mode "$1" --micro "$micro" "${model[@]}")
      [ "$1" != compute ] && args+=(--bucket-mb "$BUCKET")
      [ "$1" = hybrid ] && args+=(--wire "$2")
      load=$(cut -d' ' -f1 /proc/loadavg)
      line=$(run "$BENCH" "${args[@]}" 2>&1 | grep '^RESULT ' | tail -1)
      echo "   $rate micro=$micro $v: ${line:-failed}" >&2
      [ -n "$line" ] && echo "rate=$rate variant=${v// /_} load=$load $line" >> "$RESULTS"
    done
  done
done
"${CL[@]}" down >/dev/null 2>&1
"$PY" "$ROOT/bench/plan_validate.py" --results "$RESULTS" --probes "$OUT" --hidden "$HIDDEN" \
  --layers "$LAYERS" --bucket-mb "$BUCKET" ${PLOT:+--plot "$PLOT"} --json "$OUT/validation.json"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); files in $OUT" >&2
