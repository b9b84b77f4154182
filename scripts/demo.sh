#!/usr/bin/env bash
# Demo: builds the library and the MLP example (Release, build/) and trains the MLP with
# ZeRO-2 (SHARD_GRAD_OP) on 2 ranks: 2 MPI processes when mpirun is there and the build has
# MPI, else 2 threads. Extra arguments go to the example (e.g. --dtype bf16 --steps 500).
# SG_BUILD_DIR=dir builds there instead of build/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

b=${SG_BUILD_DIR:-build}
cmake -S . -B "$b" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$b" -j "${JOBS:-2}" --target example_mlp >/dev/null
exe=$b/examples/mlp
args=(--strategy shard_grad_op --steps 200 --log-every 20 "$@")

if command -v mpirun >/dev/null && grep -q '^SG_WITH_MPI:BOOL=ON' "$b/CMakeCache.txt"; then
  echo "\$ mpirun -np 2 $exe --mpi ${args[*]}"
  mpirun -np 2 --oversubscribe --allow-run-as-root "$exe" --mpi "${args[@]}"
else
  echo "(mpirun or MPI support missing: 2 ranks as threads)"
  echo "\$ $exe --ranks 2 ${args[*]}"
  "$exe" --ranks 2 "${args[@]}"
fi
