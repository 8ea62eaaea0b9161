#!/usr/bin/env bash
# Copies the kernel sources of each git ref into variants/<name>/cu/, so one device call can
# time kernel variants with one binary (the carried target/release/q4moe, reading its kernels
# from that directory: the CUDA option kernel_dir):
#   dev/kernel-variants.sh next/att-walk
#   BASE=target/release/q4moe Q_ARGS="--cuda-opt kernel_dir=variants/next-att-walk/cu" \
#     bash dev/gpu-check.sh ab:q4_0          (carry "variants" and target/release/q4moe)
# Only for refs whose Rust code matches the carried build; a ref that changes Rust needs
# dev/build-variants.sh.
set -eu -o pipefail
root=$(git rev-parse --show-toplevel)
for ref in "$@"; do
  name=$(echo "$ref" | tr '/' '-')
  rust=$(git -C "$root" diff --name-only HEAD "$ref" -- 'crates/cuda/src' 'crates/cuda/tests')
  [ -z "$rust" ] || echo "warning: $ref changes Rust code the carried build lacks: $rust" >&2
  rm -rf "$root/variants/$name/cu"
  mkdir -p "$root/variants/$name/cu"
  git -C "$root" archive "$ref" crates/cuda/kernels | tar x -C "$root/variants/$name/cu" \
    --strip-components=3
  echo "variants/$name/cu: $(git -C "$root" rev-parse --short "$ref")"
done
