#!/usr/bin/env bash
# Runs on the device machine in ONE call (binaries built here and carried):
#   cargo test --release -p q4moe-cuda --no-run && cargo build --release -p q4moe-cuda --examples
#   run(command="bash scripts/gpu-check.sh [tests] [sanitize] [bench:q4_0] [bench:q4_k_m]",
#       carry=[target/release/deps/kernels-<hash>, target/release/deps/parity-<hash>,
#              target/release/examples/cuda_bench])
# Writes logs and bench/results-style JSON under $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/q4moe-out}
mkdir -p "$OUT"
export Q4MOE_NO_PROGRESS=1
steps=${*:-tests sanitize bench:q4_0 bench:q4_k_m}
bin() { ls -t target/release/deps/$1-* 2>/dev/null | grep -v '\.d$' | head -1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
for s in $steps; do
  case $s in
    tests)
      for t in kernels parity; do
        echo "== $t"; timeout 300 "$(bin $t)" --test-threads=1 --nocapture 2>&1
      done | tee "$OUT/tests.log" ;;
    sanitize)
      for tool in memcheck racecheck; do
        echo "== compute-sanitizer $tool (tiny)"
        timeout 90 compute-sanitizer --tool $tool --print-limit 20 "$(bin parity)" tiny_q4_0 --test-threads=1 2>&1 | tail -25
      done | tee "$OUT/sanitizer.log" ;;
    bench:*)
      q=${s#bench:}
      echo "== bench $q"
      timeout 480 target/release/examples/cuda_bench qwen3-30b-a3b "$q" "$OUT/cuda-bench-$q.json" 5 2>&1 | tee "$OUT/bench-$q.log" ;;
  esac
done
