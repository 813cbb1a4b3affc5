#!/usr/bin/env bash
# Builds what benches/gpu/run.sh runs, for a machine with an NVIDIA GPU that may have no Rust
# toolchain and no network: one binary, `gpu_figures` (the digits and mlp_synthetic examples and
# the device-kernel benchmark), stripped and xz-compressed into benches/gpu/bundle/ (ignored by
# git). Carry that directory (with run.sh) to the GPU machine and run `bash run.sh`.
#
#   FEATURE=nccl (default: cuda with NCCL) | cuda | wgpu   what to build for (wgpu: a dry run
#                                   on lavapipe; only the nccl build has run.sh's NCCL rows)
#   PROFILE=release (default) | dev  cargo profile (dev reuses a test build's cache)
set -euo pipefail
cd "$(dirname "$0")/../.."
feature="${FEATURE:-nccl}"
profile="${PROFILE:-release}"
# Burn's cuda build downloads LLVM from the web; where only package registries are reachable,
# the workplace script installs the same LLVM from PyPI first. Elsewhere nothing is needed.
if [ "$feature" != wgpu ] && [ -f ../shared/scripts/install-llvm-bundle.sh ]; then
  bash ../shared/scripts/install-llvm-bundle.sh Cargo.lock
fi
cargo build --profile "$profile" --no-default-features -p accelerate-benches \
  --features "$feature" --bin gpu_figures
target="${CARGO_TARGET_DIR:-target}"
dir="$target/$([ "$profile" = dev ] && echo debug || echo "$profile")"
bundle=benches/gpu/bundle
rm -rf "$bundle" && mkdir -p "$bundle"
strip -o "$bundle/gpu_figures" "$dir/gpu_figures"
xz -T0 -6 -f "$bundle/gpu_figures"
echo "$feature" > "$bundle/BACKEND"
du -sh "$bundle"
