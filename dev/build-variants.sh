#!/usr/bin/env bash
# Builds the release binary and the CUDA test binaries of each git ref into variants/<name>/, so
# one device call can time a ref against another (dev/gpu-check.sh ab):
#   dev/build-variants.sh main next/gate-up-one-row
#   tar czf variants.tar.gz variants
#   run(command="tar xzf variants.tar.gz; BASE=variants/main/q4moe Q=variants/next-gate-up-one-row/q4moe
#       bash dev/gpu-check.sh ab:q4_0 ab:q4_k_m", carry=["variants.tar.gz"])
# Each ref builds in its own worktree and target directory (kernels are embedded at build time).
# About 15 MB a variant (stripped: the binary, the parity and the kernel tests, the launch-chain
# bench where the build has it), ~5.5 MB
# gzipped: the device tool carries at most 64 MiB.
set -eu -o pipefail
root=$(git rev-parse --show-toplevel)
mkdir -p "$root/variants"
for ref in "$@"; do
  name=$(echo "$ref" | tr '/' '-')
  sha=$(git -C "$root" rev-parse --short "$ref")  # the commit built, even if the ref moves meanwhile
  wt=$(mktemp -d)
  git -C "$root" worktree add -q --detach "$wt" "$sha"
  tgt="${CARGO_TARGET_DIR_VARIANTS:-/tmp/q4moe-variants}/$name"
  (cd "$wt" && CARGO_TARGET_DIR="$tgt" cargo build -q --release -p q4moe \
     && CARGO_TARGET_DIR="$tgt" cargo test -q --release -p q4moe-cuda --test parity --test kernels --no-run \
     && { CARGO_TARGET_DIR="$tgt" cargo bench -q -p q4moe-cuda --bench launch_chain --no-run 2>/dev/null || true; })
  mkdir -p "$root/variants/$name"
  cp "$tgt/release/q4moe" "$root/variants/$name/q4moe"
  for t in parity kernels launch_chain; do  # launch_chain: builds that have the bench
    f=$(ls -t "$tgt"/release/deps/$t-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$f" ] && cp "$f" "$root/variants/$name/$t"
  done
  for f in q4moe parity kernels launch_chain; do  # the binaries only (wrappers, notes stay)
    if [ -f "$root/variants/$name/$f" ]; then strip "$root/variants/$name/$f"; fi
  done
  git -C "$root" worktree remove --force "$wt"
  echo "variants/$name: $sha"
done
