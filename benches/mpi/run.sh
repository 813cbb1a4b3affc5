#!/usr/bin/env bash
# Our TCP all-reduce beside Open MPI's TCP transport, 2 ranks on this host, in the same run:
# the two benchmarks alternate ROUNDS times (default 3), so both see the same machine.
#
#   apt-get install openmpi-bin libopenmpi-dev     # Debian's Open MPI (4.1 on bookworm)
#   bash benches/mpi/run.sh [MAX_BYTES] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
max=${1:-268435456}
rounds=${2:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpicc -O2 -o "$out/mpi_all_reduce" benches/mpi/all_reduce.c
ours=$(cargo bench -p accelerate-benches --bench collectives --no-run 2>&1 |
    sed -n 's/.*Executable.*(\(.*\))$/\1/p' | tail -1)
mpi_root=()
[ "$(id -u)" = 0 ] && mpi_root=(--allow-run-as-root)
for round in $(seq "$rounds"); do
    echo "## round $round"
    "$ours" --bench --transports tcp --worlds 2 --max-size "$max" | grep -v '^$'
    mpirun "${mpi_root[@]}" -np 2 --mca btl self,tcp "$out/mpi_all_reduce" "$max"
done
