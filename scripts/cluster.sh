#!/usr/bin/env bash
# A simulated cluster on one machine: N "nodes" joined by a slow network, for running MPI jobs
# (and torch.distributed) as if across servers.
#
#   scripts/cluster.sh up [--nodes N] [--rate R] [--delay D] [--owner PID]
#                                                  create (or re-shape) the cluster
#   scripts/cluster.sh run [--ranks-per-node K] [-x VAR]... [--mca K V]... PROGRAM ARGS...
#                                                  mpirun -np N*K across the nodes (K per node)
#   scripts/cluster.sh exec NODE COMMAND...        one command inside node NODE (0..N-1)
#   scripts/cluster.sh counters                    bytes each node sent/received on its link
#   scripts/cluster.sh status                      what is up
#   scripts/cluster.sh down                        remove everything (also what a failed up left)
#   scripts/cluster.sh prune                       take down every cluster whose --owner is gone
#   scripts/cluster.sh check                       exit 0 when this machine allows it, else 77
#
# Each node is a network namespace <name>-n<i> with one interface eth0 (10.77.<k>.<i+1>/24, the
# only address its programs see besides loopback), plugged by a veth pair into a bridge that lives
# in a namespace of its own (<name>-sw): nothing is added to the root namespace. Every program
# started in a node also gets a UTS namespace (host name <name>-n<i>) and a mount namespace with
# a private /dev/shm, an /etc/hosts naming the nodes and its own /sys (/sys/class/net/eth0 is
# the node's link), so that Open MPI's shared memory stays
# inside a node and MPI_Get_processor_name tells the nodes apart. Those two namespaces belong to
# the process tree and vanish with it; `down` removes the network namespaces, which takes the
# veth pairs and the bridge with them, after ending the processes still inside.
#
# Shaping: a token-bucket filter (tc tbf) at --rate on both ends of every node's veth pair, so
# each node has a full-duplex link of that rate to the switch (as a NIC to a switch port).
# --delay adds netem latency on both ends (half each way) where the kernel has netem; without
# netem the default delay is skipped with a warning, and an explicit --delay is refused.
#
# run: mpirun starts inside node 0; the other nodes' daemons (orted) are started through a launch
# agent (plm_rsh_agent) that enters the node's namespaces instead of ssh. Between nodes MPI
# uses TCP on the cluster subnet only (btl tcp, oob tcp), inside a node shared memory (vader).
#
# Scheduling: every process started in a node (run, the agent, exec) first joins one CPU cgroup
# of the cluster's own, shardgrad-<name> (cgroup v1 cpu hierarchy, or v2 where the root enables
# cpu; made by up, removed by down; without one nothing is moved and up says so). Without it
# each node's processes were a scheduling group of their own (orted calls setsid, and the
# kernel's autogroup makes every session a group), and on a loaded machine one node's runnable
# ranks sometimes got no CPU for seconds (docs/slow-links.md, "The long streaming step").
#
# Options before the command: --name NAME (default sgc; several clusters can coexist under
# different names and --subnet), --subnet A.B.C (default 10.77.0; a private range, and only
# inside the cluster's namespaces). Environment: SG_CLUSTER_NAME, SG_CLUSTER_SUBNET. Needs root
# (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ip, tc, nsenter, unshare.
#
# Clean-up: an `up` that fails or is interrupted (INT, TERM) removes what it made; a `run`
# whose job fails or is interrupted ends the processes that job left inside the nodes (found by
# the SG_CLUSTER_RUN tag in their environment), other jobs' untouched; `down` removes the
# namespaces, the state, and probe namespaces of this name whose process is gone.
set -Eeuo pipefail

SELF=$(readlink -f "$0")
NAME=${SG_CLUSTER_NAME:-sgc}
SUBNET=${SG_CLUSTER_SUBNET:-10.77.0}
STATE_ROOT=/run/shardgrad-cluster

die() {
  echo "cluster.sh: $*" >&2
  exit 1
}
note() { echo "cluster.sh: $*" >&2; }

usage() {
  sed -n '2,14p' "$SELF" | sed 's/^# \{0,1\}//' >&2
  exit 64
}

state_dir() { echo "$STATE_ROOT/$NAME"; }
node_ns() { echo "$NAME-n$1"; }
sw_ns() { echo "$NAME-sw"; }
node_host() { echo "$NAME-n$1"; }
node_ip() { echo "$SUBNET.$(($1 + 1))"; }

valid_name() { [[ $NAME =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--name: 1-8 lowercase letters/digits, got '$NAME'"; }
# Private addresses only (10/8, 172.16/12, 192.168/16): a node never sees an address that
# exists outside. They live inside the cluster's own namespaces, nothing is added to the root
# namespace, so clusters on the same subnet under different names do not see each other either.
valid_subnet() {
  [[ $SUBNET =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] ||
    die "--subnet: three octets such as 10.77.0, got '$SUBNET'"
  local a=${BASH_REMATCH[1]} b=${BASH_REMATCH[2]} c=${BASH_REMATCH[3]}
  [ "$a" -le 255 ] && [ "$b" -le 255 ] && [ "$c" -le 255 ] ||
    die "--subnet: octets are 0..255, got '$SUBNET'"
  [ "$a" = 10 ] || { [ "$a" = 172 ] && [ "$b" -ge 16 ] && [ "$b" -le 31 ]; } ||
    { [ "$a" = 192 ] && [ "$b" = 168 ]; } ||
    die "--subnet: a private range (10.x.y, 172.16-31.y, 192.168.y), got '$SUBNET'"
}

# ---- probing ----------------------------------------------------------------------------------

# 0 when network, UTS and mount namespaces can be made here; else prints why and returns 77.
check() {
  local t why=""
  for t in ip tc nsenter unshare mount; do
    command -v "$t" >/dev/null 2>&1 || why="$why no '$t' on PATH;"
  done
  if [ -z "$why" ] && ! unshare --net --uts --mount --propagation private \
    sh -c 'hostname sgc-probe && mount -t tmpfs tmpfs /dev/shm' >/dev/null 2>&1; then
    why="network/UTS/mount namespaces not permitted here (unshare --net --uts --mount failed; needs root or CAP_SYS_ADMIN)"
  fi
  if [ -z "$why" ]; then
    local probe="$NAME-probe$$"
    trap 'ip netns del "'"$probe"'" 2>/dev/null; exit 1' INT TERM
    if ! ip netns add "$probe" 2>/dev/null; then
      why="'ip netns add' not permitted (needs root or CAP_SYS_ADMIN)"
    else
      ip -n "$probe" link add p0 type veth peer name p1 2>/dev/null ||
        why="veth links not available in this kernel"
      [ -n "$why" ] || ip -n "$probe" link add b0 type bridge 2>/dev/null ||
        why="bridges not available in this kernel"
      [ -n "$why" ] || ip -n "$probe" link set p0 up 2>/dev/null
      [ -n "$why" ] || tc -n "$probe" qdisc add dev p0 root tbf rate 1gbit burst 128k latency 50ms \
        2>/dev/null || why="tc tbf (token bucket shaping) not available in this kernel"
      ip netns del "$probe" 2>/dev/null || true
    fi
    trap - INT TERM
  fi
  if [ -n "$why" ]; then
    echo "cluster.sh: cannot simulate a cluster: $why" >&2
    return 77
  fi
  return 0
}

have_netem() {
  local probe="$NAME-nprobe$$" ok=1
  trap 'ip netns del "'"$probe"'" 2>/dev/null; exit 1' INT TERM
  ip netns add "$probe" 2>/dev/null || { trap - INT TERM; return 1; }
  ip -n "$probe" link set lo up && tc -n "$probe" qdisc add dev lo root netem delay 1ms \
    2>/dev/null && ok=0
  ip netns del "$probe" 2>/dev/null || true
  trap - INT TERM
  return $ok
}

# ---- rates ------------------------------------------------------------------------------------

# rate_bps "1gbit" -> bits per second (tc's units: bit, kbit, mbit, gbit; also 1g, 100m)
rate_bps() {
  local r=${1,,} n unit
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|k|m|g)?$ ]] ||
    die "--rate: a rate such as 1gbit, 100mbit, 10gbit; got '$1'"
  n=${BASH_REMATCH[1]}
  unit=${BASH_REMATCH[3]:-bit}
  case $unit in
    bit) awk -v n="$n" 'BEGIN{printf "%.0f", n}' ;;
    k | kbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e3}' ;;
    m | mbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e6}' ;;
    g | gbit) awk -v n="$n" 'BEGIN{printf "%.0f", n*1e9}' ;;
  esac
}

# delay_us "0.1ms" -> microseconds
delay_us() {
  local d=${1,,}
  [[ $d =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)?$ ]] || die "--delay: a time such as 0.1ms, 50us; got '$1'"
  case ${BASH_REMATCH[3]:-ms} in
    us) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n}' ;;
    ms) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n*1e3}' ;;
    s) awk -v n="${BASH_REMATCH[1]}" 'BEGIN{printf "%.0f", n*1e6}' ;;
  esac
}

# shape NS DEV BPS DELAY_US: replaces DEV's root qdisc by [netem delay ->] tbf at BPS.
# The bucket holds 2 ms at the rate (at least 64 KiB: one GSO packet), queued packets wait at
# most 100 ms: enough for TCP to fill the link, small enough that it sees the rate.
shape() {
  local ns=$1 dev=$2 bps=$3 dus=$4 burst
  burst=$(awk -v b="$bps" 'BEGIN{x=b/8*0.002; if (x<65536) x=65536; printf "%.0f", x}')
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  if [ "$dus" -gt 0 ]; then
    tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "${dus}us" limit 100000
    tc -n "$ns" qdisc add dev "$dev" parent 1: handle 2: tbf rate "${bps}bit" burst "$burst" \
      latency 100ms
  else
    tc -n "$ns" qdisc add dev "$dev" root handle 1: tbf rate "${bps}bit" burst "$burst" \
      latency 100ms
  fi
}

# ---- the scheduling group ----------------------------------------------------------------------

# The cluster's CPU cgroup: all its processes in one group, so that autogroup (which only groups
# tasks of the root cgroup, one group per session) no longer splits the nodes into groups that
# the scheduler balances against each other and the machine's other sessions.
cg_root() {
  if [ -f /sys/fs/cgroup/cpu/cgroup.procs ]; then
    echo /sys/fs/cgroup/cpu # v1: the cpu hierarchy
  elif grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
    echo /sys/fs/cgroup # v2 with the cpu controller enabled below the root
  else
    return 1
  fi
}
cg_dir() {
  local r
  r=$(cg_root) || return 1
  echo "$r/shardgrad-$NAME"
}
# cg_make NODES: the group, weighted as NODES sessions (as many as the nodes were before)
cg_make() {
  local d
  if ! d=$(cg_dir) || ! mkdir -p "$d" 2>/dev/null; then
    note "no CPU cgroup here: the nodes stay in their sessions' scheduling groups (autogroup)"
    return 0
  fi
  if [ -f "$d/cpu.shares" ]; then echo $((1024 * $1)) 2>/dev/null >"$d/cpu.shares" || true; fi
  if [ -f "$d/cpu.weight" ]; then echo $((100 * $1)) 2>/dev/null >"$d/cpu.weight" || true; fi
  return 0
}
# cg_join PID: PID (and the processes it starts) into the cluster's group, where there is one
cg_join() {
  local d
  if d=$(cg_dir) && [ -d "$d" ]; then echo "$1" 2>/dev/null >"$d/cgroup.procs" || true; fi
}
# after end_processes: processes killed a moment ago may still be leaving the group
cg_remove() {
  local d k
  d=$(cg_dir) && [ -d "$d" ] || return 0
  for k in 1 2 3 4 5 6 7 8 9 10; do
    rmdir "$d" 2>/dev/null && return 0
    sleep 0.2
  done
  note "could not remove the cgroup $d (processes still in it?)"
}

# ---- up / down --------------------------------------------------------------------------------

read_state() {
  local f
  f="$(state_dir)/config"
  [ -f "$f" ] || return 1
  # shellcheck disable=SC1090
  . "$f"
}

cmd_up() {
  local nodes=2 rate=1gbit delay=0.1ms delay_given=0
  OWNER=${OWNER:-}
  while [ $# -gt 0 ]; do
    case $1 in
      --owner) OWNER=${2:?--owner needs a process id}; shift 2 ;;
      --nodes) nodes=${2:?--nodes needs a value}; shift 2 ;;
      --rate) rate=${2:?--rate needs a value}; shift 2 ;;
      --delay) delay=${2:?--delay needs a value}; delay_given=1; shift 2 ;;
      *) die "up: unknown option '$1'" ;;
    esac
  done
  [[ $nodes =~ ^[0-9]+$ ]] && [ "$nodes" -ge 2 ] && [ "$nodes" -le 64 ] ||
    die "up: --nodes must be 2..64, got '$nodes'"
  local bps dus
  bps=$(rate_bps "$rate")
  [ "$bps" -ge 1000000 ] || die "up: --rate must be at least 1mbit, got '$rate'"
  dus=$(delay_us "$delay")
  if [ "$dus" -gt 0 ] && ! have_netem; then
    [ "$delay_given" = 0 ] ||
      die "up: --delay $delay needs the netem qdisc, which this kernel lacks (use --delay 0)"
    note "no netem qdisc in this kernel: the default delay ($delay) is not applied (veth latency only)"
    dus=0
  fi
  check || exit $?

  local sd
  sd=$(state_dir)
  if read_state; then
    [ "$NODES" = "$nodes" ] ||
      die "up: cluster '$NAME' is already up with $NODES nodes; run 'cluster.sh down' first"
    reshape "$nodes" "$bps" "$dus"
    write_state "$nodes" "$bps" "$dus"
    note "cluster '$NAME' was already up; link shaping now $(describe "$bps" "$dus")"
    return 0
  fi
  leftovers && die "up: namespaces of '$NAME' exist without its state ($(leftovers_list | tr '\n' ' ')); run 'cluster.sh down' first"

  mkdir -p "$sd" 2>/dev/null || mkdir -p "$sd" # a second try: another cluster's down may rmdir the root in between
  trap 'note "up failed; removing what it created"; teardown; exit 1' ERR
  trap 'trap - ERR; note "up interrupted; removing what it created"; teardown; exit 130' INT TERM
  build_cluster "$nodes"
  reshape "$nodes" "$bps" "$dus"
  write_state "$nodes" "$bps" "$dus"
  trap - ERR INT TERM
  note "cluster '$NAME' up: $nodes nodes ($(node_host 0)..$(node_host $((nodes - 1))), $SUBNET.0/24), links $(describe "$bps" "$dus")"
}

describe() {
  local d="no added delay"
  [ "$2" -gt 0 ] && d="$(awk -v u="$2" 'BEGIN{printf "%g ms", u/1e3}') delay"
  echo "$(awk -v b="$1" 'BEGIN{printf "%g Gbit/s", b/1e9}') per node, $d"
}

build_cluster() {
  local nodes=$1 i sw
  sw=$(sw_ns)
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for ((i = 0; i < nodes; i++)); do
    local ns
    ns=$(node_ns "$i")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$sw" link add "port$i" type veth peer name eth0 netns "$ns"
    ip -n "$sw" link set "port$i" master br0
    ip -n "$sw" link set "port$i" up
    ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
  {
    echo "127.0.0.1 localhost"
    for ((i = 0; i < nodes; i++)); do echo "$(node_ip "$i") $(node_host "$i")"; done
  } >"$(state_dir)/hosts"
  for ((i = 0; i < nodes; i++)); do echo "$(node_host "$i")"; done >"$(state_dir)/nodes"
  cg_make "$nodes"
  printf '#!/bin/sh\n# Open MPI launch agent of cluster %s: called as "agent HOST COMMAND..."\nexec %q --name %q --subnet %q agent "$@"\n' \
    "$NAME" "$SELF" "$NAME" "$SUBNET" >"$(state_dir)/agent"
  chmod +x "$(state_dir)/agent"
}

reshape() {
  local nodes=$1 bps=$2 dus=$3 i half=$(($3 / 2))
  for ((i = 0; i < nodes; i++)); do
    shape "$(node_ns "$i")" eth0 "$bps" "$half"
    shape "$(sw_ns)" "port$i" "$bps" "$half"
  done
}

write_state() {
  printf 'NODES=%s\nBPS=%s\nDELAY_US=%s\nSUBNET=%s\nOWNER=%s\n' "$1" "$2" "$3" "$SUBNET" \
    "${OWNER:-}" >"$(state_dir)/config"
}

leftovers_list() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-(n[0-9]+|sw)$" || true; }
leftovers() { [ -n "$(leftovers_list)" ]; }

# Probe namespaces of check/have_netem (<name>-probe<pid>, <name>-nprobe<pid>) whose process is
# gone: one killed at the wrong moment (SIGKILL skips its trap) leaves its probe behind.
stale_probes() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-n?probe[0-9]+$"); do
    pid=${ns##*probe}
    kill -0 "$pid" 2>/dev/null || echo "$ns"
  done
}

# of_run PID TAG: 0 when process PID was started by the run tagged TAG (SG_CLUSTER_RUN in its
# environment, which mpirun, its daemons and the ranks inherit, orphaned or not)
of_run() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -qx "SG_CLUSTER_RUN=$2"; }

# end_processes [TAG]: ends the processes still inside the node namespaces (the cluster's own:
# mpirun, orted, ranks), or only those of the run tagged TAG.
end_processes() {
  local ns pids round p mine
  for round in TERM KILL; do
    pids=""
    for ns in $(leftovers_list); do pids="$pids $(ip netns pids "$ns" 2>/dev/null || true)"; done
    if [ -n "${1:-}" ]; then
      mine=""
      for p in $pids; do ! of_run "$p" "$1" || mine="$mine $p"; done
      pids=$mine
    fi
    pids=$(echo $pids)
    [ -n "$pids" ] || break
    # shellcheck disable=SC2086
    kill -s "$round" $pids 2>/dev/null || true
    [ "$round" = KILL ] || sleep 1
  done
}

# Ends the processes, then deletes the namespaces (their veth ends and the bridge go with them),
# stale probes and the state.
teardown() {
  local ns
  end_processes
  for ns in $(leftovers_list) $(stale_probes); do
    ip netns del "$ns" 2>/dev/null || note "could not delete namespace $ns"
  done
  cg_remove
  rm -rf "$(state_dir)"
  rmdir "$STATE_ROOT" 2>/dev/null || true
}

cmd_down() {
  [ $# -eq 0 ] || die "down: no options expected"
  if ! leftovers && [ ! -d "$(state_dir)" ] && [ -z "$(stale_probes)" ]; then
    note "cluster '$NAME' is not up"
    return 0
  fi
  teardown
  if leftovers; then die "down: namespaces remain: $(leftovers_list | tr '\n' ' ')"; fi
  note "cluster '$NAME' down"
}

# Clusters made with --owner PID (tests) whose process has ended: a killed test leaves its
# cluster behind, and the next run cleans it up without touching anyone else's.
cmd_prune() {
  local d n
  for d in "$STATE_ROOT"/*/; do
    [ -f "$d/config" ] || continue
    n=$(basename "$d")
    (
      NAME=$n
      OWNER=""
      read_state
      if [ -n "$OWNER" ] && ! kill -0 "$OWNER" 2>/dev/null; then
        note "pruning cluster '$NAME' (its owner, process $OWNER, is gone)"
        teardown
      fi
    )
  done
}

# ---- entering a node --------------------------------------------------------------------------

# node_index HOST -> i, for a host name or address of this cluster
node_index() {
  local h=$1 i
  for ((i = 0; i < NODES; i++)); do
    if [ "$h" = "$(node_host "$i")" ] || [ "$h" = "$(node_ip "$i")" ]; then
      echo "$i"
      return 0
    fi
  done
  return 1
}

# enter I COMMAND...: runs COMMAND in node I's network namespace with its own host name,
# /dev/shm and /etc/hosts (UTS and mount namespaces that end with the command's process tree).
enter() {
  local i=$1
  shift
  cg_join "$BASHPID" # this process (a subshell's own, in run) before it becomes the node's
  exec nsenter --net="/run/netns/$(node_ns "$i")" -- \
    unshare --uts --mount --propagation private -- "$SELF" --name "$NAME" --subnet "$SUBNET" \
    _init "$i" "$@"
}

# Inside the new namespaces (internal).
cmd_init() {
  local i=$1
  shift
  hostname "$(node_host "$i")"
  mount -t tmpfs -o mode=1777,size=50% "sg-shm-$i" /dev/shm
  mount --bind "$(state_dir)/hosts" /etc/hosts
  # sysfs shows the interfaces of the namespace that mounts it: /sys/class/net/eth0/statistics
  # is then this node's link (as ip netns exec does)
  mount -t sysfs "sg-sys-$i" /sys
  exec "$@"
}

need_up() { read_state || die "cluster '$NAME' is not up (scripts/cluster.sh up)"; }

# The launch agent: Open MPI calls it as ssh, "agent [ssh options] HOST COMMAND...", where
# COMMAND is a shell command line (possibly split over several arguments).
cmd_agent() {
  need_up
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done # ssh options (-x etc.)
  [ $# -ge 2 ] || die "agent: expected HOST COMMAND..."
  local host=$1 i
  shift
  i=$(node_index "$host") || die "agent: '$host' is not a node of cluster '$NAME'"
  enter "$i" /bin/sh -c "$*"
}

cmd_exec() {
  need_up
  [ $# -ge 2 ] || die "exec: expected NODE COMMAND..."
  local i=$1
  shift
  [[ $i =~ ^[0-9]+$ ]] && [ "$i" -lt "$NODES" ] || die "exec: node must be 0..$((NODES - 1)), got '$i'"
  enter "$i" "$@"
}

cmd_run() {
  need_up
  local k=1
  local -a extra=()
  while [ $# -gt 0 ]; do
    case $1 in
      --ranks-per-node) k=${2:?}; shift 2 ;;
      -x) extra+=(-x "${2:?-x needs a variable name}"); shift 2 ;;
      --mca) extra+=(--mca "${2:?}" "${3:?}"); shift 3 ;;
      --) shift; break ;;
      -*) die "run: unknown option '$1'" ;;
      *) break ;;
    esac
  done
  [[ $k =~ ^[0-9]+$ ]] && [ "$k" -ge 1 ] || die "run: --ranks-per-node must be >= 1, got '$k'"
  [ $# -ge 1 ] || die "run: expected PROGRAM ARGS..."
  local sd hostfile
  sd=$(state_dir)
  hostfile="$sd/hostfile.$$"
  awk -v k="$k" '{print $1 " slots=" k}' "$sd/nodes" >"$hostfile"
  local -a mpi=(mpirun --hostfile "$hostfile" -np $((NODES * k)) --map-by slot --bind-to none
    --mca plm_rsh_agent "$sd/agent" --mca plm_rsh_no_tree_spawn 1
    --mca pml ob1 --mca btl self,vader,tcp
    --mca btl_tcp_if_include "$SUBNET.0/24" --mca oob_tcp_if_include "$SUBNET.0/24"
    -x PATH -x LD_LIBRARY_PATH -x OMP_NUM_THREADS "${extra[@]}")
  [ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
  local rc=0
  export SG_CLUSTER_RUN="$NAME.$$"
  trap 'rm -f "$hostfile"; end_processes "$SG_CLUSTER_RUN"; exit 130' INT TERM
  (enter 0 "${mpi[@]}" "$@") || rc=$?
  trap - INT TERM
  rm -f "$hostfile"
  # a failed or killed job can leave its ranks or daemons inside the nodes (holding ports,
  # shared memory, CPU): end those (this run's only), so that the next run starts clean
  [ "$rc" -eq 0 ] || end_processes "$SG_CLUSTER_RUN"
  return $rc
}

cmd_counters() {
  need_up
  local i sw
  sw=$(sw_ns)
  echo "# node tx_bytes rx_bytes (on the node's link, seen from the switch port)"
  for ((i = 0; i < NODES; i++)); do
    # the switch port's rx is what the node sent
    echo "$i $(ip netns exec "$sw" cat "/sys/class/net/port$i/statistics/rx_bytes") $(ip netns exec "$sw" cat "/sys/class/net/port$i/statistics/tx_bytes")"
  done
}

cmd_status() {
  if ! read_state; then
    echo "cluster '$NAME': down"
    leftovers && echo "  leftover namespaces: $(leftovers_list | tr '\n' ' ') (cluster.sh down removes them)"
    return 0
  fi
  echo "cluster '$NAME': up, $NODES nodes, $SUBNET.0/24, links $(describe "$BPS" "$DELAY_US")"
  local i
  for ((i = 0; i < NODES; i++)); do echo "  node $i: $(node_host "$i") $(node_ip "$i") (netns $(node_ns "$i"))"; done
  echo "  switch: netns $(sw_ns), bridge br0"
  local d
  if d=$(cg_dir) && [ -d "$d" ]; then echo "  scheduling: one CPU cgroup, $d"; else
    echo "  scheduling: no CPU cgroup (each session its own autogroup)"; fi
}

# ---- main -------------------------------------------------------------------------------------

while [ $# -gt 0 ]; do
  case $1 in
    --name) NAME=${2:?--name needs a value}; shift 2 ;;
    --subnet) SUBNET=${2:?--subnet needs a value}; shift 2 ;;
    -h | --help) usage ;;
    *) break ;;
  esac
done
valid_name
valid_subnet
[ $# -ge 1 ] || usage
cmd=$1
shift
case $cmd in
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  prune) cmd_prune ;;
  run) cmd_run "$@" ;;
  exec) cmd_exec "$@" ;;
  counters) cmd_counters ;;
  status) cmd_status ;;
  check) check ;;
  agent) cmd_agent "$@" ;;
  _init) cmd_init "$@" ;;
  *) usage ;;
esac
