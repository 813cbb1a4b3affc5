#!/usr/bin/env bash
# What a corpus's size costs a training process: the transformer example (2 layers, d_model
# 128, 16 sequences per process) trains from token files of two sizes on 2 processes
# (`accelerate-rs launch -n 2`), inside a memory cgroup whose limit is a quarter of the larger
# corpus; printed: rank 0's peak resident memory and the cgroup's peak (page cache included).
#
#   bash benches/data-memory.sh [SMALL_REPEATS] [LARGE_REPEATS] [LIMIT_MB] [ORDER]
#
# Defaults: the training text once (8.7 MB of 16-bit tokens) and 240 times (2.0 GiB), a limit
# of 512 MiB for the two processes together, the keyed shuffle order (`--keyed-order`; ORDER
# `drawn` measures the Fisher-Yates order, 8 bytes per window; `stream` the stream loader,
# `--stream`). Needs root (cgroup v1 `memory` at /sys/fs/cgroup/memory, or cgroup v2); removes
# what it made, even when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
small=${1:-1}
large=${2:-240}
limit_mb=${3:-512}
order=${4:-keyed}
order_flag=()
[ "$order" = keyed ] && order_flag=(--keyed-order)
[ "$order" = stream ] && order_flag=(--stream)
target="${CARGO_TARGET_DIR:-target}"
# The dev profile, as `cargo run --example` builds it (dependencies optimised).
cargo build -p accelerate-examples --example transformer_lm --example prepare_data
cargo build -p accelerate-cli
work="$(mktemp -d /var/tmp/accelerate-data-memory.XXXXXX)"
cgroup=/sys/fs/cgroup/memory/accelerate-data-memory-$$
cleanup() {
  [ -d "$cgroup" ] && { cat "$cgroup/cgroup.procs" > /dev/null; rmdir "$cgroup" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT
for repeats in "$small" "$large"; do
  "$target/debug/examples/prepare_data" --out "$work/x$repeats" --repeat "$repeats" \
    --tokens-per-file 100000000 > /dev/null
done
mkdir "$cgroup"
echo $((limit_mb * 1024 * 1024)) > "$cgroup/memory.limit_in_bytes"
for repeats in "$small" "$large"; do
  size=$(du -sb "$work/x$repeats" | cut -f1)
  echo "== corpus $repeats x the text: $((size / 1024 / 1024)) MiB, limit ${limit_mb} MiB for both processes, $order order"
  echo 0 > "$cgroup/memory.max_usage_in_bytes"
  (
    echo $BASHPID > "$cgroup/cgroup.procs"
    exec "$target/debug/accelerate-rs" launch -n 2 --no-progress \
      "$target/debug/examples/transformer_lm" --data "$work/x$repeats" --steps 20 \
      --eval-every 20 --sample-bytes 0 --num-workers 1 --layers 2 --d-model 128 --mlp 512 \
      --batch 16 "${order_flag[@]}"
  ) 2>&1 | grep -E "peak resident|error" || true
  echo "cgroup peak: $(( $(cat "$cgroup/memory.max_usage_in_bytes") / 1024 / 1024 )) MiB"
done
