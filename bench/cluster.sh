#!/usr/bin/env bash
# bench/cluster.sh: training across 2 nodes x 2 ranks joined by a slow link, on the simulated
# cluster of scripts/cluster.sh, with gradient accumulation. For each link rate and number of
# micro-batches per optimizer step it runs, in the same run:
#   shardgrad flat ZeRO-2 over W=4 (sg_bench_cluster --mode flat), syncing every micro-batch
#     (the default) and with sg_set_sync(0) on all but the last (no_sync)
#   shardgrad hybrid (sharded in a node, replicated across nodes: sg_bench_cluster --mode hybrid,
#     nodes by host), with f32 and with bf16 on the cross-node wire (replica_reduce_dtype)
#   the model alone (sg_bench_cluster --mode compute: the same forward and backward passes on
#     the same 4 processes with no library, no communication, no optimizer; --no-alone leaves it
#     out): the least a step takes on these cores, whatever the link
#   PyTorch FSDP2 hybrid ZeRO-2 (bench/cluster_fsdp.py: fully_shard on a 2-D mesh,
#     reshard_after_forward=False, gloo), as a user runs it: nothing disabled, no_sync
#     (set_requires_gradient_sync), and the cross-node all-reduce once per step
#     (set_requires_all_reduce) -- when torch is importable
# and prints one table: median time per optimizer step (slowest rank) and the bytes all nodes
# put on their links per step (from the node interfaces' counters; TCP/IP headers included).
#
#   bench/cluster.sh [--build DIR] [--rates "1gbit 10gbit"] [--micro "1 8"] [--steps N]
#                    [--warmup N] [--batch N] [--hidden N] [--layers N] [--bucket-mb X]
#                    [--python PY] [--no-torch] [--no-alone]
#                    [--flat-sync "every last"] [--wires "f32 bf16"]
#                    [--torch-sync "every last allreduce-last"] [--profile]
#                    [--cluster NAME] [--subnet A.B.C] [--slow "int8 int4 outer8 outer32"]
#                    [--no-flat]
# --flat-sync: the flat variants (with more than one micro-batch; "every" always runs, it is the
# baseline of the ratios); --wires: the hybrid rows; --torch-sync: the PyTorch rows (those
# listed; "last" and "allreduce-last" only with more than one micro-batch). A quick subset:
#   bench/cluster.sh --rates 1gbit --micro 8 --flat-sync every --wires bf16 --torch-sync allreduce-last
# --slow: hybrid rows of the slow-link modes (docs/slow-links.md): intN (replica_codec, f32
# accumulator) and outerH (outer steps every H, f32 wire; outerHbf16: bf16 wire; outerHint8: the
# pseudo-gradient as int8 codes with error feedback; outerHstream: streaming outer steps, a group
# of buckets every step, also after bf16/int8 as outerHbf16stream), each outer row
# timed over H steps so that one outer step falls in it (read "mean ms" there: the median
# leaves the outer step out). --no-flat leaves out the flat row (at 100 Mbit/s with 8
# micro-batches it alone takes minutes); "vs flat" then divides by the first row.
# --profile: a second table, where each shardgrad row's step went (sg_bench_cluster --profile:
# forward+backward, reductions inside the engine's communicator, the all-reduce across nodes,
# sg_step, AdamW, all-gather, CPU seconds per rank).
#
# Environment variables named SG_* (the library's knobs, e.g. SG_COMM_WAIT) are passed to every rank.
# Defaults: the MLP of sg_bench_cluster at 9 layers x 2048 (29.5M parameters, f32), batch 2 per
# micro-batch per rank, buckets of 32 MiB (--bucket-mb: the shardgrad rows), 1 warm-up + 2 timed steps. Needs root (network namespaces); exits 77
# with the reason where they are not permitted. The cluster (default name sgbench,
# 10.79.0.0/24) is taken down at the end, also after a failure.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build RATES="1gbit 10gbit" MICROS="1 8" STEPS=2 WARMUP=1 BATCH=2 HIDDEN=2048
LAYERS=9 PY="" TORCH=1 FLAT_SYNC="every last" TORCH_SYNC="every last allreduce-last"
WIRES="f32 bf16" PROFILE="" CNAME=sgbench CSUBNET=10.79.0 BUCKET=32 ALONE=1 SLOW="" FLAT=1
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --micro) MICROS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --bucket-mb) BUCKET=$2; shift 2 ;;
    --hidden) HIDDEN=$2; shift 2 ;;
    --layers) LAYERS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --no-torch) TORCH=0; shift ;;
    --no-alone) ALONE=0; shift ;;
    --flat-sync) FLAT_SYNC=$2; shift 2 ;;
    --torch-sync) TORCH_SYNC=$2; shift 2 ;;
    --wires) WIRES=$2; shift 2 ;;
    --profile) PROFILE=--profile; shift ;;
    --slow) SLOW=$2; shift 2 ;;
    --no-flat) FLAT=0; shift ;;
    --cluster) CNAME=$2; shift 2 ;;
    --subnet) CSUBNET=$2; shift 2 ;;
    *) sed -n '2,32p' "$0" >&2; exit 64 ;;
  esac
done
BENCH=$BUILD/bench/sg_bench_cluster
[ -x "$BENCH" ] || { echo "bench/cluster.sh: $BENCH not built (an MPI build: cmake --build $BUILD)" >&2; exit 1; }
CL=("$ROOT/scripts/cluster.sh" --name "$CNAME" --subnet "$CSUBNET")
"${CL[@]}" check || exit 77
if [ "$TORCH" = 1 ]; then
  for p in "$PY" "$ROOT/build-venv/bin/python" python3; do
    [ -n "$p" ] && "$p" -c "import torch.distributed.fsdp" 2>/dev/null && { PY=$p; break; }
    PY=""
  done
  [ -n "$PY" ] || { echo "bench/cluster.sh: no python with torch: the PyTorch rows are left out" >&2; TORCH=0; }
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export TORCH_CPP_LOG_LEVEL=ERROR
trap '"${CL[@]}" down >/dev/null 2>&1' EXIT
trap 'exit 1' INT TERM
"${CL[@]}" down >/dev/null 2>&1
RESULTS=() PROFILES=() SGENV=()
for v in $(compgen -e); do [[ $v == SG_* ]] && SGENV+=(-x "$v"); done # the library's knobs reach every rank
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

# one RATE MICRO LABEL COMMAND...: runs COMMAND across 2 nodes x 2 ranks, keeps its RESULT line
one() {
  local rate=$1 micro=$2 label=$3 out line
  shift 3
  echo "== $rate, $micro micro-batch(es): $label" >&2
  out=$("${CL[@]}" run --ranks-per-node 2 -x TORCH_CPP_LOG_LEVEL "${SGENV[@]}" "$@" 2>&1)
  line=$(grep '^RESULT ' <<<"$out" | tail -1)
  grep -q '^PROFILE ' <<<"$out" && PROFILES+=("$rate|$micro|$label|$(grep '^PROFILE ' <<<"$out" | tail -1)")
  if [ -z "$line" ]; then
    echo "$out" | tail -20 >&2
    line="RESULT failed=1"
  fi
  echo "   $line" >&2
  RESULTS+=("rate=$rate micro=$micro label=$label|$line")
}

model=(--steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH" --hidden "$HIDDEN" --layers "$LAYERS")
for rate in $RATES; do
  "${CL[@]}" down >/dev/null 2>&1
  "${CL[@]}" up --nodes 2 --rate "$rate" 2>/dev/null || exit 1
  for micro in $MICROS; do
    [ "$FLAT" = 1 ] &&
      one "$rate" "$micro" "shardgrad flat ZeRO-2, sync every" "$BENCH" --mode flat --sync every --micro "$micro" "${model[@]}" --bucket-mb "$BUCKET" $PROFILE
    [ "$micro" -gt 1 ] && [[ " $FLAT_SYNC " == *" last "* ]] &&
      one "$rate" "$micro" "shardgrad flat ZeRO-2, no_sync" "$BENCH" --mode flat --sync last --micro "$micro" "${model[@]}" --bucket-mb "$BUCKET" $PROFILE
    [ "$ALONE" = 1 ] &&
      one "$rate" "$micro" "the model alone (no library)" "$BENCH" --mode compute --micro "$micro" "${model[@]}" $PROFILE
    for wire in $WIRES; do
      one "$rate" "$micro" "shardgrad hybrid, $wire wire" "$BENCH" --mode hybrid --wire "$wire" --micro "$micro" "${model[@]}" --bucket-mb "$BUCKET" $PROFILE
    done
    for m in $SLOW; do
      case $m in
        int8|int4) one "$rate" "$micro" "shardgrad hybrid, $m codes + feedback" "$BENCH" --mode hybrid --codec "$m" --micro "$micro" "${model[@]}" --bucket-mb "$BUCKET" $PROFILE ;;
        outer*) h=${m#outer} w=f32 c=none s=0
          [[ $h == *stream ]] && { h=${h%stream}; s=1; }
          kind="outer steps"; [ "$s" = 1 ] && kind="streaming outer steps"
          [[ $h == *bf16 ]] && { h=${h%bf16}; w=bf16; }
          [[ $h == *int8 ]] && { h=${h%int8}; c=int8; }
          one "$rate" "$micro" "shardgrad hybrid, $kind H=$h, $([ "$c" = int8 ] && echo int8 || echo "$w")" "$BENCH" --mode hybrid --outer "$h" --stream "$s" --wire "$w" --codec "$c" --micro "$micro" --steps "$h" --warmup "$WARMUP" --batch "$BATCH" --hidden "$HIDDEN" --layers "$LAYERS" --bucket-mb "$BUCKET" $PROFILE ;;
        *) echo "bench/cluster.sh: unknown --slow mode $m" >&2; exit 64 ;;
      esac
    done
    if [ "$TORCH" = 1 ]; then
      fsdp=("$PY" "$ROOT/bench/cluster_fsdp.py" --ranks-per-node 2 --master "$CNAME-n0" --micro "$micro" "${model[@]}")
      [[ " $TORCH_SYNC " == *" every "* ]] &&
        one "$rate" "$micro" "torch FSDP2 HSDP ZeRO-2, sync every" "${fsdp[@]}" --sync every
      if [ "$micro" -gt 1 ]; then
        [[ " $TORCH_SYNC " == *" last "* ]] &&
          one "$rate" "$micro" "torch FSDP2 HSDP, no_sync" "${fsdp[@]}" --sync last
        [[ " $TORCH_SYNC " == *" allreduce-last "* ]] &&
          one "$rate" "$micro" "torch FSDP2 HSDP, all-reduce last" "${fsdp[@]}" --sync allreduce-last
      fi
    fi
  done
done

field() { grep -o "\b$1=[^ |]*" <<<"$2" | head -1 | cut -d= -f2; }
params=$(for r in "${RESULTS[@]}"; do field params "$r"; done | grep . | head -1)
echo
echo "bench/cluster.sh: 2 nodes x 2 ranks (W=4), MLP $LAYERS layers x $HIDDEN (${params:-?} params, f32), batch $BATCH per micro-batch per rank, $WARMUP warm-up + $STEPS timed steps; $(getconf _NPROCESSORS_ONLN) cores, load average $LOAD0 at the start, $(cut -d' ' -f1-3 /proc/loadavg) at the end"
# bits per second of a tc rate (1gbit, 100mbit, 10g)
bps() { awk -v r="${1,,}" 'BEGIN{n=r+0; u=r; sub(/^[0-9.]+/,"",u); f=1;
  if (u ~ /^k/) f=1e3; else if (u ~ /^m/) f=1e6; else if (u ~ /^g/) f=1e9; printf "%.0f", n*f}'; }
printf '%-9s %5s  %-38s %10s %9s %13s %13s %10s %10s\n' "link" "micro" "variant" "step ms" "vs flat" "link MB/step" "link s/step" "mean ms" "max ms"
base=""
for r in "${RESULTS[@]}"; do
  rate=$(field rate "$r") micro=$(field micro "$r") label=${r#*label=}
  label=${label%%|*}
  ms=$(field step_ms "$r") sent=$(field link_sent_per_step "$r") maxn=$(field link_sent_max_node "$r")
  case $label in "shardgrad flat ZeRO-2, sync every") base=$ms ;; esac
  if [ "$FLAT" = 0 ] && [ "$rate/$micro" != "${group:-}" ]; then base=$ms group=$rate/$micro; fi
  mean=$(field step_mean_ms "$r") max=$(field step_max_ms "$r")
  if [ -z "$ms" ]; then
    printf '%-9s %5s  %-38s %10s\n' "$rate" "$micro" "$label" "FAILED"
  else
    printf '%-9s %5s  %-38s %10.1f %8.2fx %13.1f %13.2f %10s %10s\n' "$rate" "$micro" "$label" "$ms" \
      "$(awk -v a="$ms" -v b="${base:-$ms}" 'BEGIN{print a/b}')" \
      "$(awk -v s="$sent" 'BEGIN{print (s < 0 ? -1 : s/1e6)}')" \
      "$(awk -v s="$maxn" -v b="$(bps "$rate")" 'BEGIN{print (s < 0 ? -1 : 8*s/b)}')" "${mean:--}" "${max:--}"
  fi
done
echo "mean ms: the mean of the same steps (outer-step rows: over H steps, one outer step among them). max ms: the longest of them."
echo "step ms: median time per optimizer step, slowest rank; vs flat: / shardgrad flat ZeRO-2 (sync every) at the same link and micro-batches."
echo "link MB/step: bytes all nodes sent on their links per step (interface counters; TCP/IP headers included). link s/step: the busiest node's bytes at the link rate, the least time the link needs per step."
echo "Shaping: tc tbf at the rate on both ends of each node's link."
if [ ${#PROFILES[@]} -gt 0 ]; then
  echo
  echo "Where the step went (sg_bench_cluster --profile; ms per optimizer step, mean over the 4 ranks):"
  printf '%-9s %5s  %-28s %8s %8s %8s %8s %8s %8s %9s %9s\n' "link" "micro" "variant" "fwd+bwd" \
    "rs" "x-node" "sg_step" "adamw" "gather" "cpu/rank" "cpu main"
  for r in "${PROFILES[@]}"; do
    IFS='|' read -r rate micro label p <<<"$r"
    mean() { field "${1}_ms" "$p" | cut -d/ -f1; }
    printf '%-9s %5s  %-28s %8s %8s %8s %8s %8s %8s %9s %9s\n' "$rate" "$micro" "${label#shardgrad }" "$(mean fwd_bwd)" \
      "$(mean reduce_scatter)" "$(mean replica_allreduce)" "$(mean sg_step)" "$(mean adamw)" \
      "$(mean all_gather)" "$(mean cpu)" "$(mean cpu_main)"
  done
  echo "fwd+bwd, sg_step: the caller's wall time in them (sg_step includes waiting for the reductions); rs, x-node, gather: spans of the engine's comm thread (reductions inside its communicator, all-reduce across nodes, all-gathers), which overlap the caller's; adamw: the norm + AdamW span; cpu/rank: CPU time of a rank's process (all threads), cpu main: of its caller thread."
fi
