#!/usr/bin/env bash
# The GPU figures of benches/RESULTS.md, from the prebuilt bundle of build.sh, in under five
# minutes and with nothing but bash, xz and the driver: digits accuracy, mlp_synthetic's step
# time in fp32 / bf16 / fp16 (Burn's AdamW and the fused one), the transformer example's
# tokens/s and peak device memory in fp32 / bf16 / fp16 with and without activation
# checkpointing, the same with Burn's kernel fusion on and off, our cubecl kernels' GB/s, and (nccl build) NCCL against the host path: the
# parameters after 30 updates, the all-reduce's algbw/busbw, and the step time of
# mlp_synthetic and the transformer with NCCL required vs off.
#
#   bash run.sh [BUNDLE_DIR]     (default: ./bundle beside this script)
#   DIGITS_EPOCHS=30 MLP_SAMPLES=32000 KERNEL_MELEMS=64 LM_STEPS=60
#   (smaller for a dry run on lavapipe)
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

# The largest memory.used nvidia-smi reports (every 0.2 s) while "$@" runs, as " | N MiB";
# " | n/a" without nvidia-smi. The command's output goes to $work/out.
with_peak_memory() {
  if ! command -v nvidia-smi >/dev/null; then "$@" > "$work/out"; echo " | n/a"; return; fi
  "$@" > "$work/out" &
  local pid=$! peak=0 used
  while kill -0 "$pid" 2>/dev/null; do
    used="$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)"
    [ "${used:-0}" -gt "$peak" ] 2>/dev/null && peak="$used"
    sleep 0.2
  done
  wait "$pid"
  echo " | $peak MiB"
}
steps="${LM_STEPS:-60}"
echo
echo "| transformer_lm, $steps updates | result | peak device memory |"
echo "|---|---|---|"
for precision in no bf16 fp16; do
  for checkpointing in "" --gradient-checkpointing; do
    memory="$(ACCELERATE_MIXED_PRECISION=$precision with_peak_memory first_match 'tokens/s' 240 \
      "$bin" transformer --steps "$steps" --eval-every 1000 --sample-bytes 0 $checkpointing)"
    echo "| $precision ${checkpointing:-(no checkpointing)} | $(cat "$work/out")$memory |"
  done
done
echo
echo "## Burn's kernel fusion on and off (the same build; ACCELERATE_FUSION=false takes Burn's fusers out)"
echo
fusion_row() { # label, pattern, limit, command...
  local label="$1" pattern="$2" limit="$3"; shift 3
  local on off on_peak off_peak
  on_peak="$(ACCELERATE_FUSION=true with_peak_memory first_match "$pattern" "$limit" "$@")"
  on="$(cat "$work/out")"
  off_peak="$(ACCELERATE_FUSION=false with_peak_memory first_match "$pattern" "$limit" "$@")"
  off="$(cat "$work/out")"
  echo "| $label | $on${on_peak} | $off${off_peak} |"
}
echo "| run | fusion on | peak device memory | fusion off | peak device memory |"
echo "|---|---|---|---|---|"
for precision in no bf16; do
  ACCELERATE_MIXED_PRECISION=$precision fusion_row "transformer_lm, $steps updates, $precision" \
    'tokens/s' 240 "$bin" transformer --steps "$steps" --eval-every 1000 --sample-bytes 0
  ACCELERATE_MIXED_PRECISION=$precision fusion_row "mlp_synthetic, $precision, fused" \
    'samples/s' 60 "$bin" mlp "$samples"
done

echo
echo "## device kernels"
timeout 90 "$bin" kernels "${KERNEL_MELEMS:-64}" 2>&1 | grep -E '^\||^device|^Error' || echo "kernels FAILED"

if [ "$backend" = nccl ]; then
  echo
  echo "## NCCL (one process on one GPU: world size 1)"
  timeout 120 "$bin" nccl 2>&1 | grep -E '^\||^Error' || echo "nccl parity FAILED"
  echo
  timeout 120 "$bin" nccl-allreduce 2>&1 | grep -E '^\||^Error' || echo "nccl-allreduce FAILED"
  echo
  echo "| run | NCCL required | host path |"
  echo "|---|---|---|"
  for optimizer in --burn-optimizer ""; do
    label="${optimizer:-fused}"
    with="$(ACCELERATE_NCCL=require first_match 'samples/s' 60 "$bin" mlp "$samples" $optimizer)"
    without="$(ACCELERATE_NCCL=off first_match 'samples/s' 60 "$bin" mlp "$samples" $optimizer)"
    echo "| mlp_synthetic, ${label#--} | $with | $without |"
  done
  with="$(ACCELERATE_NCCL=require first_match 'tokens/s' 240 "$bin" transformer --steps "$steps" --eval-every 1000 --sample-bytes 0)"
  without="$(ACCELERATE_NCCL=off first_match 'tokens/s' 240 "$bin" transformer --steps "$steps" --eval-every 1000 --sample-bytes 0)"
  echo "| transformer_lm, $steps updates | $with | $without |"
fi
