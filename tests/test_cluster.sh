#!/usr/bin/env bash
# ctest test_cluster: brings up a simulated cluster of 2 nodes (scripts/cluster.sh, 1 Gbit/s
# links), runs at np 4 as 2 nodes x 2 ranks the layout check (host names, shared-memory split,
# private /dev/shm; plus a link measurement that is printed, not checked), the MPI communicator
# test, sg_comm_split_nodes by host (2 hosts of 2 ranks: a 2 x 2 layout) and the hybrid engine's
# MPI test (2 x 2 against flat W = 4 and one rank, across the shaped link), and takes the
# cluster down again, also when a step fails or the test is killed.
# Exit 77 (ctest SKIP_RETURN_CODE) where network namespaces are not permitted.
#   usage: test_cluster.sh CLUSTER_SH TEST_CLUSTER_TOPO TEST_COMM TEST_COMM_SPLIT_NODES TEST_HYBRID
set -uo pipefail
[ $# -eq 5 ] || { echo "usage: $0 CLUSTER_SH TEST_CLUSTER_TOPO TEST_COMM TEST_COMM_SPLIT_NODES TEST_HYBRID" >&2; exit 64; }
cluster=$1 topo=$2 comm=$3 split_nodes=$4 hybrid=$5
# a name of its own (this process), so that test runs in other build trees at the same time and
# a cluster a user has up are left alone; clusters of earlier runs that were killed are pruned
name=t$$
cl() { "$cluster" --name "$name" "$@"; }

if ! cl check; then
  echo "test_cluster: skipped: network namespaces are not permitted here (scripts/cluster.sh check says why)"
  exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
cleanup() { cl down; }
trap cleanup EXIT
trap 'exit 1' INT TERM
"$cluster" prune
cl up --nodes 2 --rate 1gbit --owner $$ || exit 1
cl status
rc=0
t0=$SECONDS
# each job under its own deadline, well inside ctest's TIMEOUT, so that a hung job still ends
# here and the trap takes the cluster down (ctest's kill at its timeout would skip the trap)
run() { timeout -k 5 90 "$cluster" --name "$name" run "$@"; }
run --ranks-per-node 2 "$topo" --ranks-per-node 2 --bandwidth 16 || rc=1
echo "layout check: $((SECONDS - t0))s"
# where the machine has a CPU cgroup for it, every rank (node 0's under mpirun, the others'
# under the launch agent's orted, which starts a session of its own) is in the cluster's one
# scheduling group
if cl status | grep -q "scheduling: one CPU cgroup"; then
  where=$(run --ranks-per-node 2 sh -c "grep -q ':/shardgrad-$name\$' /proc/self/cgroup && echo in || echo out")
  [ "$(grep -c '^in$' <<<"$where")" = 4 ] || { echo "test_cluster: ranks outside the cluster's cgroup: $where"; rc=1; }
  echo "scheduling group: $(grep -c '^in$' <<<"$where") of 4 ranks in the cluster's cgroup"
fi
t0=$SECONDS
run --ranks-per-node 2 "$comm" --mpi || rc=1
echo "test_comm --mpi at np 4 (2 nodes x 2 ranks): $((SECONDS - t0))s"
t0=$SECONDS
run --ranks-per-node 2 "$split_nodes" --mpi --per-host 2 || rc=1
echo "test_comm_split_nodes --mpi, nodes by host (2 x 2): $((SECONDS - t0))s"
t0=$SECONDS
run --ranks-per-node 2 "$hybrid" --mpi || rc=1
echo "test_hybrid --mpi (2 nodes x 2 ranks): $((SECONDS - t0))s"
cl counters
exit $rc
