#!/usr/bin/env bash
# Builds and stages what dev/gpu-check.sh runs on the device, in one ignored folder the device
# call carries (target/gpu), and prints that call's command. Why a script: the test binaries'
# names are ambiguous (q4moe-cuda and q4moe-engine both have a `batch` test), a stale copy of
# an older build is easy to carry, and the carry plus the tracked tree must stay under 64 MiB
# (so the call carries target/gpuz, the folder packed).
#   dev/gpu-stage.sh                         # the product, the CUDA and engine test binaries
#   BASE=/path/q4moe dev/gpu-stage.sh        # and a baseline binary for ab:<quant>
#   OTHER=/path/q4moe dev/gpu-stage.sh       # and a second build (Q=target/other/q4moe TAG=...)
#   SERVE_BENCH=1 dev/gpu-stage.sh           # and serve_bench (serve:<quant>)
# Test binaries staged: crates/cuda's tests and crates/engine's generate, logprobs and constraint (their
# GPU cases), each the executable cargo names for this build, not the newest file of its name.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu
rm -rf "$out" && mkdir -p "$out/deps"
cargo build --release --bin q4moe
strip -s -o "$out/q4moe" target/release/q4moe
# Every test executable of the two crates, as cargo reports it (package, target name, path).
cargo test --release -p q4moe-cuda -p q4moe-engine --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    pkg, name = m["package_id"], m["target"]["name"]
    cuda = "q4moe-cuda" in pkg or "/cuda#" in pkg
    if m["target"]["kind"] == ["test"] and (cuda and name != "timeline" or name in ("generate", "logprobs", "constraint")):
        print(m["executable"])
' | while read -r exe; do strip -s -o "$out/deps/$(basename "$exe")" "$exe"; done
[ -n "${BASE:-}" ] && strip -s -o "$out/base" "$BASE"
[ -n "${OTHER:-}" ] && strip -s -o "$out/other" "$OTHER"
if [ -n "${SERVE_BENCH:-}" ]; then
  cargo build --release -p q4moe-server --example serve_bench
  strip -s -o "$out/serve_bench" target/release/examples/serve_bench
fi
# The carry is one xz archive of the folder (the stripped binaries compress about 4.5x: the
# product, a baseline, another build and eight test binaries came to 70 MiB, 15 MiB packed).
rm -rf target/gpuz && mkdir -p target/gpuz
tar cf - -C target gpu | xz -T0 -6 > target/gpuz/gpu.tar.xz
carried=$(du -sb target/gpuz | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "staged $(ls "$out/deps" | wc -l) test binaries: $(ls "$out/deps" | sed 's/-[0-9a-f]*$//' | tr '\n' ' ')"
echo "carry $((carried >> 20)) MiB packed + tracked $((tracked >> 20)) MiB (the limit is 64 MiB)"
[ $((carried + tracked)) -lt $((64 << 20)) ] || { echo "over the 64 MiB carry: stage less" >&2; exit 1; }
cat <<'EOF'
run(carry=["target/gpuz"], command=
  "tar xJf target/gpuz/gpu.tar.xz -C target
   && mkdir -p target/release/deps target/baseline target/other target/release/examples
   && cp target/gpu/deps/* target/release/deps/ && cp target/gpu/q4moe target/release/
   && { [ ! -f target/gpu/base ] || cp target/gpu/base target/baseline/q4moe; }
   && { [ ! -f target/gpu/other ] || cp target/gpu/other target/other/q4moe; }
   && { [ ! -f target/gpu/serve_bench ] || cp target/gpu/serve_bench target/release/examples/; }
   && export OUT && bash dev/gpu-check.sh tests sanitize ab:q4_0 ...;
   cd $OUT && tar czf /tmp/o.tgz . && rm -rf $OUT/* && mv /tmp/o.tgz $OUT/")
(tar: the reply brings back a few files only; one archive keeps every log.)
EOF
