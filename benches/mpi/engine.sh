#!/usr/bin/env bash
# Our MPI engine beside Open MPI's own MPI_Allreduce on the same machine, same mpirun, same
# transports (shared memory on one host), in the same run: the two alternate ROUNDS times
# (default 3). Ours also runs bf16 (16-bit words reduced by our operation).
#
#   apt-get install openmpi-bin libopenmpi-dev libclang-dev
#   bash benches/mpi/engine.sh [MAX_BYTES] [ROUNDS] [NP]
set -euo pipefail
cd "$(dirname "$0")/../.."
max=${1:-67108864}
rounds=${2:-3}
np=${3:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpicc -O2 -o "$out/mpi_all_reduce" benches/mpi/all_reduce.c
ours=$(cargo bench -p accelerate-benches --features mpi --bench collectives --no-run 2>&1 |
    sed -n 's/.*Executable.*(\(.*\))$/\1/p' | tail -1)
mpi_root=()
[ "$(id -u)" = 0 ] && mpi_root=(--allow-run-as-root)
for round in $(seq "$rounds"); do
    echo "## round $round"
    "$ours" --bench --transports mpi --worlds "$np" --dtypes f32,bf16 --max-size "$max" |
        grep -v '^$'
    mpirun "${mpi_root[@]}" --oversubscribe -np "$np" "$out/mpi_all_reduce" "$max"
done
