#!/usr/bin/env bash
# bench/plan_validate.sh: the planner's predictions against measured steps on the simulated
# cluster (scripts/cluster.sh, 2 nodes x 2 ranks; docs/planner.md). For each link rate:
#   1. the probe on the cluster (python -m shardgrad.plan --probe: link rate and latency per
#      level, norm + AdamW rate), written to OUT/probe-RATE.json;
#   2. for each micro-batch count: the model alone (sg_bench_cluster --mode compute: the
#      forward + backward time per micro-batch, an input of the model), then shardgrad flat
#      ZeRO-2 and hybrid with an f32 and a bf16 wire (sg_bench_cluster --mode flat|hybrid);
#   3. at the rates of --slow-rates and the micro-batch counts of --slow-micro, the slow-links
#      modes of --slow (hybrid, docs/slow-links.md): int8, int4 (replica_codec), outerH (outer
#      steps every H, f32 wire), outerHbf16, outerHint8 (the pseudo-gradient as int8 codes);
#      an outer row times H steps (a multiple of H >= --steps), one outer step among them;
# then bench/plan_validate.py predicts each measured row from its probe and compute time and
# prints the table (and writes OUT/validation.json; --plot PNG: predicted against measured).
# OUT/results.txt and OUT/probe-*.json are all it reads: run it again on them to re-predict
# without measuring (python bench/plan_validate.py --results OUT/results.txt --probes OUT).
#
#   bench/plan_validate.sh [--build DIR] [--rates "100mbit 1gbit 10gbit"] [--micro "1 8"]
#                          [--slow "int8 int4 outer8 outer8int8"] [--slow-rates "100mbit 1gbit"]
#                          [--slow-micro "8"] [--hidden N] [--layers N] [--batch N] [--steps N]
#                          [--warmup N] [--bucket-mb X] [--python PY] [--out DIR] [--plot PNG]
#                          [--cluster NAME] [--subnet A.B.C] [--profile]
# --slow "": no slow-links rows. --profile: sg_bench_cluster --profile on every shardgrad row
# (where the step went, from the engine's trace: kept in results.txt, not used by the model).
# --cluster/--subnet: the simulated cluster's name and subnet (default sgplan, 10.78.0), so that
# runs of other people on the same machine do not collide.
# Needs root (network namespaces) and an MPI build with the benchmarks; exits 77 without them.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build RATES="100mbit 1gbit 10gbit" MICROS="1 8" HIDDEN=1024 LAYERS=9 BATCH=32
STEPS=3 WARMUP=1 BUCKET=8 PY=$ROOT/build-venv/bin/python OUT="" PLOT=""
SLOW="int8 int4 outer8 outer8int8" SLOW_RATES="100mbit 1gbit" SLOW_MICROS="8"
CNAME=sgplan CSUBNET=10.78.0 PROFILE=""
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --micro) MICROS=$2; shift 2 ;;
    --slow) SLOW=$2; shift 2 ;;
    --slow-rates) SLOW_RATES=$2; shift 2 ;;
    --slow-micro) SLOW_MICROS=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --bucket-mb) BUCKET=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --plot) PLOT=$2; shift 2 ;;
    --cluster) CNAME=$2; shift 2 ;;
    --subnet) CSUBNET=$2; shift 2 ;;
    --profile) PROFILE=--profile; shift ;;
    *) sed -n '2,28p' "$0" >&2; exit 64 ;;
  esac
done
for m in $SLOW; do
  [[ $m =~ ^(int8|int4|outer[0-9]+(bf16|int8)?)$ ]] ||
    { echo "plan_validate: unknown --slow mode $m (int8, int4, outerH, outerHbf16, outerHint8)" >&2; exit 64; }
done
BENCH=$BUILD/bench/sg_bench_cluster
[ -x "$BENCH" ] || { echo "plan_validate: $BENCH not built (an MPI build)" >&2; exit 77; }
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$(mktemp -d /tmp/sg_plan_validate.XXXXXX)}
mkdir -p "$OUT"
CL=("$ROOT/scripts/cluster.sh" --name "$CNAME" --subnet "$CSUBNET")
"${CL[@]}" check || exit 77
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export PYTHONPATH=$ROOT/python SHARDGRAD_LIBRARY=$BUILD/libshardgrad.so
trap '"${CL[@]}" down >/dev/null 2>&1' EXIT
trap 'exit 1' INT TERM
RESULTS=$OUT/results.txt
: > "$RESULTS"
T0=$(date +%s)
run() { "${CL[@]}" run --ranks-per-node 2 -x PYTHONPATH -x SHARDGRAD_LIBRARY -x OMP_NUM_THREADS "$@"; }
has() { [[ " $1 " == *" $2 "* ]]; }

# measure RATE MICRO VARIANT STEPS ARGS...: one sg_bench_cluster row into results.txt
measure() {
  local rate=$1 micro=$2 v=$3 steps=$4 load out line prof
  shift 4
  load=$(cut -d' ' -f1 /proc/loadavg)
  out=$(run "$BENCH" --micro "$micro" --steps "$steps" --warmup "$WARMUP" --batch "$BATCH" \
        --hidden "$HIDDEN" --layers "$LAYERS" "$@" 2>&1)
  line=$(grep '^RESULT ' <<<"$out" | tail -1)
  prof=$(grep '^PROFILE ' <<<"$out" | tail -1 | sed 's/^PROFILE //; s/\([a-z_]*_ms=\)/p_\1/g; s/mode=[^ ]* //; s/sync=[^ ]* //; s/micro=[^ ]* //')
  echo "   $rate micro=$micro $v: ${line:-failed}" >&2
  [ -n "$line" ] || tail -5 <<<"$out" >&2
  [ -n "$line" ] && echo "rate=$rate variant=$v load=$load $line $prof" >> "$RESULTS"
}

# slow MODE: the variant name and sg_bench_cluster's flags of a --slow mode (outer: H too)
slow_args() {
  case $1 in
    int8|int4) echo "hybrid_$1 0 --codec $1" ;;
    outer*) local h=${1#outer} w=f32 c=none
      [[ $h == *bf16 ]] && { h=${h%bf16}; w=bf16; }
      [[ $h == *int8 ]] && { h=${h%int8}; c=int8; }
      echo "outer${h}_$([ "$c" = int8 ] && echo int8 || echo "$w") $h --outer $h --wire $w --codec $c" ;;
  esac
}

for rate in $RATES; do
  "${CL[@]}" down >/dev/null 2>&1
  "${CL[@]}" up --nodes 2 --rate "$rate" 2>/dev/null || exit 1
  echo "== $rate: probe (load $(cut -d' ' -f1-3 /proc/loadavg), $(( $(date +%s) - T0 )) s in)" >&2
  run "$PY" -m shardgrad.plan --probe --out "$OUT/probe-$rate.json" > /dev/null || exit 1
  for micro in $(printf '%s\n' $MICROS $SLOW_MICROS | awk '!seen[$0]++'); do
    exact=0 slow=0
    has "$MICROS" "$micro" && exact=1
    has "$SLOW_MICROS" "$micro" && has "$SLOW_RATES" "$rate" && [ -n "$SLOW" ] && slow=1
    [ "$exact" = 1 ] || [ "$slow" = 1 ] || continue
    measure "$rate" "$micro" compute "$STEPS" --mode compute
    if [ "$exact" = 1 ]; then
      measure "$rate" "$micro" flat "$STEPS" --mode flat --bucket-mb "$BUCKET" $PROFILE
      for w in f32 bf16; do
        measure "$rate" "$micro" "hybrid_$w" "$STEPS" --mode hybrid --wire "$w" --bucket-mb "$BUCKET" $PROFILE
      done
    fi
    [ "$slow" = 1 ] || continue
    for m in $SLOW; do
      set -- $(slow_args "$m")
      v=$1 h=$2
      shift 2
      steps=$STEPS
      [ "$h" -gt 0 ] && steps=$(( (STEPS + h - 1) / h * h ))
      measure "$rate" "$micro" "$v" "$steps" --mode hybrid --bucket-mb "$BUCKET" "$@" $PROFILE
    done
  done
done
"${CL[@]}" down >/dev/null 2>&1
"$PY" "$ROOT/bench/plan_validate.py" --results "$RESULTS" --probes "$OUT" --hidden "$HIDDEN" \
  --layers "$LAYERS" --bucket-mb "$BUCKET" ${PLOT:+--plot "$PLOT"} --json "$OUT/validation.json"
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); $(( $(date +%s) - T0 )) s; files in $OUT" >&2
