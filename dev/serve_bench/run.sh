#!/usr/bin/env bash
# Serving benchmark in one command: isolated engine vs the HTTP server (one stream, then 1/4/16
# concurrent streams); writes bench/results/serve-<date>.json. Extra arguments pass through, e.g.
#   dev/serve_bench/run.sh                       # synthetic mid model, --device auto
#   dev/serve_bench/run.sh --model F.gguf --tokens 128 --device cuda
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo run --release -q -p q4moe-server --example serve_bench -- "$@"
