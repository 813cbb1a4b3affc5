#!/usr/bin/env bash
# The GPU figures of benches/RESULTS.md, from the prebuilt bundle of build.sh, in under five
# minutes and with nothing but bash, xz and the driver: digits accuracy, mlp_synthetic's step
# time in fp32 / bf16 / fp16 (Burn's AdamW and the fused one), and our cubecl kernels' GB/s.
#
#   bash run.sh [BUNDLE_DIR]     (default: ./bundle beside this script)
#   DIGITS_EPOCHS=30 MLP_SAMPLES=32000 KERNEL_MELEMS=64   (smaller for a dry run on lavapipe)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="${1:-$here/bundle}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
xz -dc "$bundle/gpu_figures.xz" > "$work/gpu_figures" && chmod +x "$work/gpu_figures"
bin="$work/gpu_figures"
backend="$(cat "$bundle/BACKEND" 2>/dev/null || echo unknown)"
export ACCELERATE_CONFIG_FILE=none RUST_BACKTRACE=0

echo "# accelerate-rs GPU figures ($backend build, $(date -u +%Y-%m-%dT%H:%MZ))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo

# Runs "$@" with a time limit, keeping its output; prints the last matching line or the error.
first_match() {
  local pattern="$1" limit="$2"; shift 2
  local out
  out="$(timeout "$limit" "$@" 2>&1)"
  local status=$?
  local hit
  hit="$(printf '%s\n' "$out" | grep -E "$pattern" | tail -n 1)"
  local why
  why="$(printf '%s\n' "$out" | grep -m 1 -E '^Error|panicked' || printf '%s\n' "$out" | tail -n 1)"
  if [ -n "$hit" ]; then printf '%s' "$hit"; else printf 'FAILED (exit %s): %s' "$status" "$why"; fi
}

echo "| run | result |"
echo "|---|---|"
epochs="${DIGITS_EPOCHS:-30}"
samples="${MLP_SAMPLES:-32000}"
echo "| digits, $epochs epochs, fp32 | $(first_match 'test accuracy' 150 "$bin" digits "$epochs") |"
for precision in no bf16 fp16; do
  for optimizer in --burn-optimizer ""; do
    result="$(ACCELERATE_MIXED_PRECISION=$precision first_match 'samples/s' 60 "$bin" mlp "$samples" $optimizer)"
    label="${optimizer:-fused}"
    echo "| mlp_synthetic, $precision, ${label#--} | $result |"
  done
done
echo
echo "## device kernels"
timeout 90 "$bin" kernels "${KERNEL_MELEMS:-64}" 2>&1 | grep -E '^\||^device|^Error' || echo "kernels FAILED"
