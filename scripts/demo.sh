#!/usr/bin/env bash
# Demo: builds the library and the MLP example (Release, build/) and trains the MLP with
# ZeRO-2 (SHARD_GRAD_OP) on 2 ranks: 2 MPI processes when mpirun is there and the build has
# MPI, else 2 threads. --ranks N trains on N ranks instead (N processes, or N threads); other
# arguments go to the example (e.g. --dtype bf16 --steps 500).
# SG_BUILD_DIR=dir builds there instead of build/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

ranks=2
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --ranks)
      [ $# -ge 2 ] || { echo "demo.sh: --ranks needs a value (a number of ranks >= 1)" >&2; exit 64; }
      ranks=$2
      shift 2
      ;;
    --ranks=*) ranks=${1#--ranks=}; shift ;;
    --mpi) echo "demo.sh: no --mpi: the demo uses MPI when it can (--ranks N sets the count)" >&2; exit 64 ;;
    *) extra+=("$1"); shift ;;
  esac
done
case $ranks in
  '' | *[!0-9]* | 0*) echo "demo.sh: --ranks must be a whole number >= 1, not '$ranks'" >&2; exit 64 ;;
esac

b=${SG_BUILD_DIR:-build}
cmake -S . -B "$b" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$b" -j "${JOBS:-2}" --target example_mlp >/dev/null
exe=$b/examples/mlp
args=(--strategy shard_grad_op --steps 200 --log-every 20 ${extra[@]+"${extra[@]}"})

if command -v mpirun >/dev/null && grep -q '^SG_WITH_MPI:BOOL=ON' "$b/CMakeCache.txt"; then
  # the command as it runs (as root and on fewer cores than ranks too), for a user to copy
  echo "\$ mpirun -np $ranks --oversubscribe --allow-run-as-root $exe --mpi ${args[*]}"
  mpirun -np "$ranks" --oversubscribe --allow-run-as-root "$exe" --mpi "${args[@]}"
else
  echo "(mpirun or MPI support missing: $ranks ranks as threads)"
  echo "\$ $exe --ranks $ranks ${args[*]}"
  "$exe" --ranks "$ranks" "${args[@]}"
fi
