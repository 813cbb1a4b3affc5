#!/usr/bin/env bash
# Builds what benches/gpu/run.sh runs, for a machine with an NVIDIA GPU that may have no Rust
# toolchain and no network: the digits and mlp_synthetic examples and the device_kernels
# benchmark, stripped and xz-compressed into benches/gpu/bundle/ (ignored by git, ~30 MB).
# Carry that directory (with run.sh) to the GPU machine and run `bash run.sh`.
#
#   FEATURE=cuda (default) | wgpu   the backend to build for (wgpu: a dry run on lavapipe)
#   PROFILE=release (default) | dev  cargo profile (dev reuses a test build's cache)
set -euo pipefail
cd "$(dirname "$0")/../.."
feature="${FEATURE:-cuda}"
profile="${PROFILE:-release}"
# Burn's cuda build downloads LLVM from the web; where only package registries are reachable,
# the workplace script installs the same LLVM from PyPI first. Elsewhere nothing is needed.
if [ "$feature" = cuda ] && [ -f ../shared/scripts/install-llvm-bundle.sh ]; then
  bash ../shared/scripts/install-llvm-bundle.sh Cargo.lock
fi
cargo build --profile "$profile" --no-default-features \
  -p accelerate-examples -p accelerate-benches \
  --features "accelerate-examples/$feature,accelerate-benches/$feature" \
  --example digits --example mlp_synthetic --bin device_kernels
target="${CARGO_TARGET_DIR:-target}"
dir="$target/$([ "$profile" = dev ] && echo debug || echo "$profile")"
bundle=benches/gpu/bundle
rm -rf "$bundle" && mkdir -p "$bundle"
for bin in "$dir/examples/digits" "$dir/examples/mlp_synthetic" "$dir/device_kernels"; do
  name=$(basename "$bin")
  strip -o "$bundle/$name" "$bin"
  xz -T0 -6 -f "$bundle/$name"
done
echo "$feature" > "$bundle/BACKEND"
du -sh "$bundle"
