#!/usr/bin/env bash
# Two hosts on one machine joined by a link shaped to RATE (tc's token bucket filter, `tbf`):
# two network namespaces over a veth pair, each with its own host name and /dev/shm, one
# `accelerate-rs launch` per host. Runs the transformer example on them ROUNDS times in each
# of the CASES (interleaved; by default communication overlapped and not) and prints each
# run's tokens/s and the bytes that crossed the link; then the compute alone (the same
# processes side by side, without communicating). What a slower network costs a user,
# measured.
#
#   sudo benches/shaped-link.sh [RATE=500mbit] [ROUNDS=2] [PER_HOST=1] [-- example args...]
#
# CASES: space-separated runs, each a comma-separated list of VAR=value for the workers, e.g.
# ZeRO-3 against hybrid sharding on 2 processes per host:
#   CASES="ACCELERATE_ZERO_STAGE=3 ACCELERATE_ZERO_STAGE=3,ACCELERATE_SHARD_GROUP_SIZE=host" \
#     sudo -E benches/shaped-link.sh 500mbit 2 2
#
# Needs root, iproute2 (`ip`, `tc`) and a kernel with `sch_tbf`; builds nothing: run
# `cargo build -p accelerate-cli -p accelerate-examples --example transformer_lm` first. Everything it creates is
# removed on exit, also on failure.
set -euo pipefail

RATE=${1:-500mbit}
ROUNDS=${2:-2}
PER_HOST=${3:-1}
shift $(($# < 3 ? $# : 3))
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--steps 300 --stop-at 12 --batch 8 --sample-bytes 0 --log-every 4 --eval-every 12 --eval-sequences 16)

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}/debug
LAUNCH=$TARGET/accelerate-rs
EXAMPLE=$TARGET/examples/transformer_lm
for f in "$LAUNCH" "$EXAMPLE"; do
    [ -x "$f" ] || { echo "missing $f: cargo build -p accelerate-cli -p accelerate-examples --example transformer_lm" >&2; exit 2; }
done

ID=$$
NS=(accrs-link-$ID-a accrs-link-$ID-b)
IP=(10.77.$((ID % 250)).1 10.77.$((ID % 250)).2)
cleanup() {
    for ns in "${NS[@]}"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}
trap cleanup EXIT
ip netns add "${NS[0]}"
ip netns add "${NS[1]}"
ip link add veth0 netns "${NS[0]}" type veth peer name veth1 netns "${NS[1]}"
ip -n "${NS[0]}" addr add "${IP[0]}/24" dev veth0
ip -n "${NS[1]}" addr add "${IP[1]}/24" dev veth1
for i in 0 1; do
    ip -n "${NS[$i]}" link set lo up
    ip -n "${NS[$i]}" link set "veth$i" up
    # Both directions limited: each host's egress.
    ip netns exec "${NS[$i]}" tc qdisc add dev "veth$i" root tbf rate "$RATE" burst 256kb latency 100ms
done

# Bytes host 0 has sent over the link so far.
sent() {
    ip netns exec "${NS[0]}" cat /sys/class/net/veth0/statistics/tx_bytes
}

# One run over the two hosts with the workers' variables `case` (VAR=value,...); prints the
# main process's last line and the bytes host 0 sent.
run_pair() {
    local case=$1 port=$2 token before
    token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
    local pids=() out=/tmp/accrs-link-$ID-run vars
    IFS=, read -r -a vars <<<"$case"
    before=$(sent)
    for m in 0 1; do
        ip netns exec "${NS[$m]}" unshare --uts --mount --propagation private sh -c \
            "hostname accrs-link-$m && mount -t tmpfs tmpfs /dev/shm && exec \"\$0\" \"\$@\"" \
            env ACCELERATE_JOB_TOKEN="$token" "${vars[@]}" RAYON_NUM_THREADS=1 \
            "$LAUNCH" launch --num-machines 2 --machine-rank $m -n "$PER_HOST" \
            --main-process-ip "${IP[0]}" --main-process-port "$port" --no-progress -- \
            "$EXAMPLE" "${ARGS[@]}" >"$out-$m" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}"
    grep -h "tokens/s, " "$out-0" | tail -1
    grep -h "averaged during backward" "$out-0" | tail -1 || true
    echo "host 0 sent $(( ($(sent) - before) / 1000 )) kB over the link"
}

CASES=${CASES:-ACCELERATE_OVERLAP_COMMUNICATION=true ACCELERATE_OVERLAP_COMMUNICATION=false}
echo "link: $RATE each way (tbf), $PER_HOST process(es) of 1 thread per host; args: ${ARGS[*]}"
port=29600
for round in $(seq "$ROUNDS"); do
    for case in $CASES; do
        port=$((port + 1))
        echo "round $round, $case:"
        run_pair "$case" "$port"
    done
done
# Compute alone: as many single processes side by side as the job had, each on its own
# (no communication), so that they share the cores as the job's processes did.
echo "compute alone ($((2 * PER_HOST)) single processes of 1 thread side by side, no link):"
pids=()
for i in $(seq $((2 * PER_HOST))); do
    RAYON_NUM_THREADS=1 "$EXAMPLE" "${ARGS[@]}" >"/tmp/accrs-link-$ID-alone-$i" 2>&1 &
    pids+=($!)
done
wait "${pids[@]}"
grep -h "tokens/s, " /tmp/accrs-link-$ID-alone-* | sed 's/.*; \([0-9]* tokens\/s\).*/\1/'
rm -f /tmp/accrs-link-$ID-*
