#!/usr/bin/env bash
# tests/fault_matrix.sh: faults on the slow link of the simulated 2-node cluster
# (scripts/cluster.sh), one rank per node, training tests/fault_run.c's model (gradients that
# sum exactly: a run that completes must end with the clean run's bits). Cases:
#   clean        no fault: the reference bits
#   loss 1%      tc netem loss 1% on both ends of node 1's link, for the whole run; where the
#                kernel has no sch_netem, the same loss by iptables' statistic match (1% of
#                the packets dropped each way on node 1's eth0)
#   jitter       tc netem delay 50ms 100ms (100 ms jitter) on both ends of node 1's link;
#                without sch_netem, stalls instead: node 1's link drops everything for a
#                random 0-100 ms, every 100-300 ms (iptables), which TCP sees as delay
#                spikes with retransmits (labelled "stalls" in the table)
#   down 10 s    node 1's switch port down 10 s, then up (timeout_ms 60000: must complete)
#   down > timeout   the port down 30 s with timeout_ms 8000: every rank must fail within
#                its deadline, and sg_engine_destroy / sg_comm_destroy must return (a rank
#                whose destroys never return shows DID NOT RETURN; mpirun is stopped at 120 s)
#   kill -9      the rank on node 1 killed during the cross-node phase (timeout_ms 8000;
#                mpirun's recovery on, so the other rank can report)
# After a failed case, the checkpoint saved before the fault is loaded (--resume, a fresh
# mpirun on the healed link) and the same steps trained: its bits must be the clean run's.
# Prints one table: case, outcome, each rank's status and time to error (from the fault's
# start), destroy time, resume. Everything it creates (the cluster's namespaces, the qdiscs on
# them, its temporary directory) is removed at the end, also after a failure or an interrupt;
# only the cluster's own namespaces are touched.
#
#   tests/fault_matrix.sh [--build DIR] [--steps N] [--rate R] [--cases "clean loss ..."]
# Needs root and an MPI build (fault_run). Exits 77 where network namespaces are not permitted.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build STEPS=60 RATE=1gbit CASES="clean loss jitter down10 downlong kill"
while [ $# -gt 0 ]; do
  case $1 in
    --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --cases) CASES=$2; shift 2 ;;
    *) sed -n '2,22p' "$0" >&2; exit 64 ;;
  esac
done
RUNNER=$BUILD/tests/fault_run
[ -x "$RUNNER" ] || { echo "fault_matrix.sh: $RUNNER not built (an MPI build)" >&2; exit 1; }
CNAME=sgfault CSUBNET=10.83.0
CL=("$ROOT/scripts/cluster.sh" --name "$CNAME" --subnet "$CSUBNET")
"${CL[@]}" check || exit 77
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
WORK=$(mktemp -d /tmp/sg_fault_XXXXXX)
INJ_PID=""
cleanup() {
  [ -n "$INJ_PID" ] && kill "$INJ_PID" 2>/dev/null
  [ -n "${STALL_PID:-}" ] && kill "$STALL_PID" 2>/dev/null
  "${CL[@]}" down >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
"${CL[@]}" down >/dev/null 2>&1
"${CL[@]}" up --nodes 2 --rate "$RATE" >/dev/null 2>&1 || { echo "fault_matrix.sh: cluster up failed" >&2; exit 1; }
N1=$CNAME-n1 SW=$CNAME-sw

# netem on both ends of node 1's link (replaces the rate shaping there for the case)
netem_on() {
  tc -n "$N1" qdisc replace dev eth0 root netem "$@" &&
    tc -n "$SW" qdisc replace dev port1 root netem "$@"
}
# without netem: iptables in node 1's namespace (it goes with the namespace at the end)
ipt() { ip netns exec "$N1" iptables "$@"; }
drop_on() { # drop_on PROBABILITY: that share of node 1's packets dropped both ways
  ipt -I INPUT -i eth0 -m statistic --mode random --probability "$1" -j DROP &&
    ipt -I OUTPUT -o eth0 -m statistic --mode random --probability "$1" -j DROP
}
drop_off() { ipt -F INPUT 2>/dev/null; ipt -F OUTPUT 2>/dev/null; }
dropped() { ipt -L -v -x -n 2>/dev/null | awk '/DROP/ && /statistic/ {s += $1} END {print s + 0}'; }
STALL_PID=""
stalls() { # until killed: the link gone for 0-100 ms, every 100-300 ms
  while :; do
    sleep "0.$((100 + RANDOM % 200))"
    drop_on 1 2>/dev/null
    sleep "$(awk -v r=$((RANDOM % 100)) 'BEGIN{printf "%.3f", r / 1000}')"
    drop_off
  done
}
heal() {
  [ -n "$STALL_PID" ] && { kill "$STALL_PID" 2>/dev/null; wait "$STALL_PID" 2>/dev/null; STALL_PID=""; }
  [ "$HAVE_NETEM" = 0 ] && [ "$HAVE_IPT" = 1 ] && drop_off
  ip -n "$SW" link set port1 up 2>/dev/null
  "${CL[@]}" up --nodes 2 --rate "$RATE" >/dev/null 2>&1 # re-shapes: tbf back on every end
}
wait_ready() { # the runner's marker: the checkpoint is saved, the timed steps begin
  for _ in $(seq 1 600); do [ -e "$1/ready" ] && return 0; sleep 0.1; done
  return 1
}
# the fault, in the background once the runner is ready
inject() {
  local kind=$1 dir=$2
  wait_ready "$dir" || return
  sleep 0.5
  date +%s%N >"$dir/fault_at"
  case $kind in
    down10) ip -n "$SW" link set port1 down; sleep 10; ip -n "$SW" link set port1 up ;;
    downlong) ip -n "$SW" link set port1 down; sleep 30; ip -n "$SW" link set port1 up ;;
    kill)
      for p in $(ip netns pids "$N1"); do
        [ "$(cat /proc/"$p"/comm 2>/dev/null)" = fault_run ] && kill -9 "$p"
      done ;;
  esac
}

# netem is a kernel module (sch_netem) some kernels lack; the loss and jitter cases use it, or
# iptables' statistic match (Debian's iptables package) in node 1's namespace where it is missing
HAVE_NETEM=0 HAVE_IPT=0
if tc -n "$N1" qdisc add dev lo root netem delay 1ms 2>/dev/null; then
  HAVE_NETEM=1
  tc -n "$N1" qdisc del dev lo root 2>/dev/null
elif command -v iptables >/dev/null && ipt -L INPUT >/dev/null 2>&1; then
  HAVE_IPT=1
fi

ROWS=() CLEAN_HASH=""
one_case() {
  local kind=$1 timeout=60000 dir=$WORK/$1 extra=() out t0 t1 outcome ranks hashes
  local label=$kind
  if { [ "$kind" = loss ] || [ "$kind" = jitter ]; } && [ "$HAVE_NETEM" = 0 ] && [ "$HAVE_IPT" = 0 ]; then
    ROWS+=("$kind|skipped: neither sch_netem nor iptables here|-|-|-")
    return
  fi
  mkdir -p "$dir"
  case $kind in
    loss) if [ "$HAVE_NETEM" = 1 ]; then netem_on loss 1%; else drop_on 0.01; label="loss(ipt)"; fi ;;
    jitter)
      if [ "$HAVE_NETEM" = 1 ]; then netem_on delay 50ms 100ms; else
        stalls &
        STALL_PID=$!
        label="stalls"
      fi ;;
    downlong) timeout=8000 ;;
    kill) timeout=8000 extra=(--mca orte_enable_recovery 1) ;;
  esac
  inject "$kind" "$dir" &
  INJ_PID=$!
  t0=$(date +%s%N)
  out=$(timeout 120 "${CL[@]}" run --ranks-per-node 1 "${extra[@]}" "$RUNNER" "$dir" "$STEPS" "$timeout" 2>&1)
  t1=$(date +%s%N)
  wait "$INJ_PID" 2>/dev/null
  INJ_PID=""
  [ "$label" = "loss(ipt)" ] && label="loss(ipt, $(dropped) dropped)"
  heal
  echo "$out" | grep '^OUTCOME' >"$dir/outcome"
  echo "$out" | grep '^DESTROY' >"$dir/destroy"
  echo "== $kind" >&2
  echo "$out" | grep -v '^OUTCOME' | tail -5 >&2
  cat "$dir/outcome" "$dir/destroy" >&2
  local fault_ns=0
  [ -e "$dir/fault_at" ] && fault_ns=$(cat "$dir/fault_at")
  ranks="" hashes=""
  local ok=0 failed=0 n=0
  while read -r line; do
    n=$((n + 1))
    local r st ms dms h
    r=$(grep -o 'rank=[^ ]*' <<<"$line" | cut -d= -f2)
    st=$(grep -o 'status=[^ ]*' <<<"$line" | cut -d= -f2)
    ms=$(grep -o 'err_ms=[^ ]*' <<<"$line" | cut -d= -f2)
    dms=$(grep "^DESTROY rank=$r " "$dir/destroy" | grep -o 'engine_ms=[^ ]* comm_ms=[^ ]*' |
      sed 's/engine_ms=\([0-9]*\) comm_ms=\([0-9]*\)/engine \1 + comm \2/')
    [ -n "$dms" ] || dms="DID NOT RETURN"
    h=$(grep -o 'hash=[^ ]*' <<<"$line" | cut -d= -f2)
    # time to error from the fault's start: the runner measures from its marker, the fault
    # came 0.5 s later
    if [ "$ms" != -1 ] && [ "$fault_ns" != 0 ]; then ms=$(awk -v m="$ms" 'BEGIN{printf "%.1f s", (m - 500) / 1000}'); else ms="-"; fi
    ranks+="r$r ${st#SG_ERR_} err ${ms}, destroy ${dms} ms; "
    [ "$st" = SG_OK ] && { ok=$((ok + 1)); hashes+="$h "; } || failed=$((failed + 1))
  done <"$dir/outcome"
  [ "$kind" = clean ] && CLEAN_HASH=$(awk '{print $1}' <<<"$hashes")
  local same=1
  for h in $hashes; do [ "$h" = "$CLEAN_HASH" ] || same=0; done
  if [ "$n" -eq 2 ] && [ "$ok" -eq 2 ] && [ "$same" = 1 ]; then
    outcome="completed, clean run's bits"
  elif [ "$n" -eq 2 ] && [ "$ok" -eq 2 ]; then
    outcome="completed, BITS DIFFER"
  elif [ "$failed" -gt 0 ] && [ "$ok" -eq 0 ]; then
    outcome="every reporting rank ($n) failed"
  else
    outcome="MIXED or missing ($ok ok, $failed failed of 2)"
  fi
  local resume="-"
  if [ "$ok" -lt 2 ]; then
    local rout
    rout=$(timeout 300 "${CL[@]}" run --ranks-per-node 1 "$RUNNER" "$dir" "$STEPS" 60000 --resume 2>&1 | grep '^OUTCOME')
    if [ "$(grep -c 'status=SG_OK' <<<"$rout")" = 2 ] && ! grep -qv "hash=$CLEAN_HASH" <<<"$rout"; then
      resume="loads, clean run's bits"
    else
      resume="FAILED: $(head -1 <<<"$rout")"
    fi
  fi
  ROWS+=("$label|$outcome|$ranks|$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", (b - a) / 1e9}')|$resume")
}

for c in $CASES; do one_case "$c"; done

echo
echo "tests/fault_matrix.sh: 2 nodes x 1 rank, link $RATE, $STEPS steps after the checkpoint, $(getconf _NPROCESSORS_ONLN) cores"
printf '%-24s %-32s %-7s %-20s %s\n' case outcome "run s" "resume" "ranks (status, time to error from the fault, destroy)"
for r in "${ROWS[@]}"; do
  IFS='|' read -r k o ranks secs res <<<"$r"
  printf '%-24s %-32s %-7s %-20s %s\n' "$k" "$o" "$secs" "$res" "$ranks"
done
