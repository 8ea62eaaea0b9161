#!/usr/bin/env bash
# The GPU check and the benchmark of record, in ONE device call from the repository root.
# dev/gpu-stage.sh builds and stages everything below and prints the call (the manual recipe follows).
# The device machine has no Rust toolchain: build here first, then carry the binaries.
#   cargo build --release --bin q4moe && cargo test --release -p q4moe-cuda -p q4moe-engine --no-run
#   cargo build --release -p q4moe-server --example serve_bench        # for serve:<quant>
# Stripped copies fit the 64 MiB carry together (the newest of each test binary, the product,
# the baseline, serve_bench) in one ignored folder:
#   mkdir -p target/gpu/deps; for t in batch kernels moe_kernels parity matrix_parity generate logprobs constraint; do
#     f=$(ls -t target/release/deps/$t-* | grep -v '\.d$' | head -1); strip -s -o target/gpu/deps/${f##*/} $f; done
#   strip -s -o target/gpu/q4moe target/release/q4moe; strip -s -o target/gpu/base target/baseline/q4moe
#   strip -s -o target/gpu/serve_bench target/release/examples/serve_bench
#   run(carry=["target/gpu"], command="mkdir -p target/release/deps target/baseline target/release/examples
#       && cp target/gpu/deps/* target/release/deps/ && cp target/gpu/q4moe target/release/
#       && cp target/gpu/base target/baseline/q4moe && cp target/gpu/serve_bench target/release/examples/
#       && bash dev/gpu-check.sh tests sanitize")
# Steps (default: tests bench:q4_0 bench:q4_k_m):
#   tests          every carried CUDA test binary (TEST_BINS, default "batch kernels moe_kernels parity matrix_parity generate logprobs constraint": the newest
#                  target/release/deps/<name>-*) with --include-ignored; pass/fail counts. The
#                  probe's test: TEST_BINS="timeline" (`cargo test --release -p q4moe-cuda --features timeline --no-run`).
#   sanitize       compute-sanitizer memcheck on the tiny parity and batched-step tests and on the kernel tests.
#   bench:<quant>  `q4moe bench` of record (q4_0, q4_k_m) on a synthetic Qwen3-30B-A3B written
#                  once per quant to /tmp; JSON to $OUT/bench-<quant>.json (TAG as batch).
#   batch:<quant>  `q4moe bench --batch` (BATCH, default 1,2,4,8,16,32,64) on the synthetic model:
#                  aggregate tok/s, step ms and the invariance verdict per B; JSON to
#                  $OUT/batch-<quant>.json (batch-<quant>-$TAG.json with TAG set: two binaries,
#                  Q=... TAG=..., in one call). BATCH_ARGS adds bench arguments (e.g.
#                  "--profile kernels": the batched step's launches eager, each timed).
#   serve:<quant>  the HTTP serving bench (target/release/examples/serve_bench, carried; `cargo build
#                  --release -p q4moe-server --example serve_bench`) at CONC streams (default
#                  1,4,16,64): aggregate tok/s, TTFT and inter-token p50/p99; JSON to $OUT/serve-<quant>.json.
#                  SERVE_ARGS adds serve_bench arguments (e.g. "--cuda-opt batched_step=on").
#   prefill:<quant> `q4moe bench --prefill` (PREFILL, default 128,512,2048,8192): prefill alone,
#                  tok/s per prompt length; JSON to $OUT/prefill-<quant>.json (TAG as batch).
#   schema:<quant> `q4moe bench --json-schema` (a long JSON string): decode tok/s with and without
#                  the schema; JSON to $OUT/schema-<quant>.json.
#   ab:<quant>     the before/after gate: binaries $Q and $BASE (default target/baseline/q4moe)
#                  benched alternately for ROUNDS rounds (default 5) under the record's decode
#                  conditions (cache on, in-flight 2); a median/min/max table per binary of the
#                  rounds' medians. Q_ARGS / BASE_ARGS add bench arguments to one side (e.g.
#                  "--cuda-opt key=value" to compare options with one binary: BASE=$Q).
# One device command may run 600 s: tests + sanitize + two benches may need two calls.
# Same card, same call: compare only figures one call measured. A change passes the gate when
# its decode median is within 1% of the baseline's (or above), on both quants.
set -u -o pipefail
OUT=${OUT:-/tmp/q4moe-out}
mkdir -p "$OUT"
Q=${Q:-target/release/q4moe}
BASE=${BASE:-target/baseline/q4moe}
ROUNDS=${ROUNDS:-5}
steps=${*:-tests bench:q4_0 bench:q4_k_m}
failed=0

say() { echo -e "$1" | tee -a "$OUT/summary.txt"; }
# newest <name>: the newest carried test binary of that name (cargo appends a hash).
newest() { ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -1; }

# model <quant>: the synthetic model of record, written once per call (~17-19 GB).
model() {
  [ -f "/tmp/$1.gguf" ] && return 0
  timeout 300 "$Q" synth --geometry qwen3-30b-a3b --quant "$1" --seed 1 --out "/tmp/$1.gguf" \
    > "$OUT/synth-$1.log" 2>&1 || { say "synth $1 FAILED: $(tail -2 "$OUT/synth-$1.log")"; return 1; }
}

# The conditions of every record: prompt 128, 256 decode tokens (the first excluded), a KV
# sized for 4,096 positions of context plus the decode (--long-context also measures there).
RECORD=(--device cuda --prompt-len 128 --decode-len 256 --long-context 4096)

run_tests() {
  local t b r
  for t in ${TEST_BINS:-batch kernels moe_kernels parity matrix_parity generate logprobs constraint}; do
    b=$(newest "$t")
    [ -n "$b" ] || { say "tests $t: NOT CARRIED"; failed=1; continue; }
    timeout 500 "$b" --include-ignored --test-threads=1 > "$OUT/tests-$t.log" 2>&1
    r=$(grep -E '^test result' "$OUT/tests-$t.log" | tail -1)
    say "tests $t: ${r:-no result (crashed or timed out; see tests-$t.log)}"
    grep -E '^test .* FAILED$|panicked' "$OUT/tests-$t.log" | head -10
    [[ $r == *"test result: ok."* ]] || failed=1
  done
}

# sanitize_one <label> <binary> [test filter]: compute-sanitizer memcheck over one test binary.
sanitize_one() {
  local log="$OUT/memcheck-$1.log"
  timeout 280 compute-sanitizer --tool memcheck --print-limit 20 "$2" ${3:-} --include-ignored \
    --test-threads=1 > "$log" 2>&1
  say "memcheck $1: $(grep -E 'ERROR SUMMARY|^test result' "$log" | tr '\n' ' ')"
  grep -q 'ERROR SUMMARY: 0 errors' "$log" && grep -q 'test result: ok\.' "$log" || failed=1
}

run_sanitize() {
  local p k
  local b
  p=$(newest parity); k=$(newest kernels); b=$(newest batch)
  if [ -n "$p" ]; then sanitize_one parity-tiny "$p" tiny_q4; else say "sanitize: parity not carried"; fi
  if [ -n "$b" ]; then sanitize_one batch-tiny "$b" tiny_q4_0; else say "sanitize: batch not carried"; fi
  if [ -n "$k" ]; then sanitize_one kernels "$k"; else say "sanitize: kernels not carried"; fi
}

# The benchmark of record: the whole ablation (cache off / on, in-flight 1 / 2), 5 runs, the
# per-kernel profile of the eager path and the sampled rows, as the records were made.
run_bench() {
  local q=$1 f="bench-$1${TAG:+-$TAG}"
  [ $failed = 0 ] || { say "bench $q skipped: a step before it failed (no record of a broken build)"; return; }
  model "$q" || return
  timeout 400 "$Q" bench --model "/tmp/$q.gguf" "${RECORD[@]}" --runs 5 --profile kernels \
    --sampled --json-out "$OUT/$f.json" > "$OUT/$f.log" 2>&1
  sed -n '/^variant/,/^parity/p' "$OUT/$f.log"
  say "bench $q${TAG:+ ($TAG)}: $(grep -E '^cache on, in-flight 2' "$OUT/$f.log" | head -1)"
}

run_batch() {
  local q=$1 f="batch-$1${TAG:+-$TAG}"
  model "$q" || return
  timeout 450 "$Q" bench --model "/tmp/$q.gguf" --device cuda --prompt-len 128 --decode-len 64 \
    --runs 5 --batch "${BATCH:-1,2,4,8,16,32,64}" ${BATCH_ARGS:-} --json-out "$OUT/$f.json" > "$OUT/$f.log" 2>&1 \
    || { say "batch $q${TAG:+ ($TAG)} FAILED: $(tail -3 "$OUT/$f.log")"; failed=1; }
  grep -E 'B = ' "$OUT/$f.log" | while read -r l; do say "batch $q${TAG:+ ($TAG)}: $l"; done
}

run_prefill() {
  local q=$1 f="prefill-$1${TAG:+-$TAG}"
  model "$q" || return
  timeout 400 "$Q" bench --model "/tmp/$q.gguf" --device cuda --runs 5 \
    --prefill "${PREFILL:-128,512,2048,8192}" --json-out "$OUT/$f.json" > "$OUT/$f.log" 2>&1 \
    || { say "prefill $q${TAG:+ ($TAG)} FAILED: $(tail -3 "$OUT/$f.log")"; failed=1; }
  grep -E '^ +[0-9]+ ' "$OUT/$f.log" | while read -r l; do say "prefill $q${TAG:+ ($TAG)}: $l"; done
}

# schema <quant>: greedy decode held to a JSON schema (a long string) beside the same decode
# unconstrained (issue 56: what the host-side token mask costs on the GPU).
run_schema() {
  local q=$1
  model "$q" || return
  echo '{"type": "string", "minLength": 8192}' > /tmp/long_string.json
  timeout 300 "$Q" bench --model "/tmp/$q.gguf" --device cuda --prompt-len 128 --decode-len 256 \
    --runs 5 --json-schema /tmp/long_string.json --json-out "$OUT/schema-$q.json" > "$OUT/schema-$q.log" 2>&1 \
    || { say "schema $q FAILED: $(tail -3 "$OUT/schema-$q.log")"; failed=1; }
  grep -E '^(unconstrained|constrained)' "$OUT/schema-$q.log" | while read -r l; do say "schema $q: $l"; done
}

run_serve() {
  local q=$1 sb=target/release/examples/serve_bench
  [ -x "$sb" ] || { say "serve: $sb not carried"; failed=1; return; }
  model "$q" || return
  timeout 450 "$sb" --model "/tmp/$q.gguf" --device cuda --tokens 64 --runs "${SERVE_RUNS:-3}" \
    --concurrency "${CONC:-1,4,16,64}" --max-batch 64 ${SERVE_ARGS:-} --out "$OUT/serve-$q.json" > "$OUT/serve-$q.log" 2>&1 \
    || { say "serve $q FAILED: $(tail -3 "$OUT/serve-$q.log")"; failed=1; return; }
  python3 - "$OUT/serve-$q.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"serve: isolated {r['isolated']['steady_tok_s']['median']:.1f} tok/s, one HTTP stream "
      f"{r['http_single_stream']['steady_tok_s']['median']:.1f}")
for c in r["http_concurrent"]:
    print(f"serve: {c['streams']:>3} streams {c['aggregate_tok_s']['median']:8.1f} tok/s aggregate, "
          f"TTFT p50 {c['ttft_ms_percentiles']['p50']:.0f} ms, inter-token p50 "
          f"{c['inter_token_ms']['p50']:.1f} / p99 {c['inter_token_ms']['p99']:.1f} ms")
EOF
}

# ab_one <binary> <quant> <json> <extra args>: one bench of the gate, cache on, in-flight 2, 5 runs.
ab_one() {
  # shellcheck disable=SC2086  # the extra arguments are words
  timeout 200 "$1" bench --model "/tmp/$2.gguf" "${RECORD[@]}" --runs 5 --setup-cache on \
    --in-flight 2 --json-out "$3" $4 > "${3%.json}.log" 2>&1 || say "ab: $1 FAILED ($(tail -1 "${3%.json}.log"))"
}

run_ab() {
  local q=$1 r
  [ -x "$Q" ] && [ -x "$BASE" ] || { say "ab: Q=$Q and BASE=$BASE must both be carried"; failed=1; return; }
  model "$q" || return
  for r in $(seq "$ROUNDS"); do  # alternate, so drift over the call hits both sides alike
    ab_one "$BASE" "$q" "$OUT/ab-$q-base-$r.json" "${BASE_ARGS:-}"
    ab_one "$Q" "$q" "$OUT/ab-$q-q-$r.json" "${Q_ARGS:-}"
  done
  python3 - "$OUT" "$q" <<'EOF' | tee -a "$OUT/summary.txt"
import glob, json, statistics, sys
out, q = sys.argv[1:3]
def side(name):
    dec, lng = [], []
    for f in sorted(glob.glob(f"{out}/ab-{q}-{name}-*.json")):
        r = json.load(open(f))
        v = [v for v in r["variants"] if v["name"] == "cache on, in-flight 2"][0]
        dec.append(v["decode_tok_s"]["median"])
        lng.append((r.get("long_context") or {}).get("tok_s", {}).get("median", 0.0))
    return dec, lng
print(f"ab {q}: rounds' decode medians, tok/s (cache on, in-flight 2; at 4,096 context)")
print(f"{'binary':<6} {'n':>2} {'median':>8} {'min':>8} {'max':>8} {'4096 med':>9}")
res = {}
for name in ("base", "q"):
    dec, lng = side(name)
    if not dec:
        print(f"{name:<6} no runs"); continue
    res[name] = statistics.median(dec)
    print(f"{name:<6} {len(dec):>2} {res[name]:>8.1f} {min(dec):>8.1f} {max(dec):>8.1f} {statistics.median(lng):>9.1f}")
if len(res) == 2:
    d = 100 * (res["q"] / res["base"] - 1)
    print(f"q vs base: {d:+.2f}% ({'PASS' if d >= -1 else 'FAIL'}: the gate is within 1%)")
EOF
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv \
  | tee "$OUT/gpu.txt"
for s in $steps; do
  case $s in
    tests) run_tests ;;
    sanitize) run_sanitize ;;
    bench:*) run_bench "${s#bench:}" ;;
    ab:*) run_ab "${s#ab:}" ;;
    batch:*) run_batch "${s#batch:}" ;;
    serve:*) run_serve "${s#serve:}" ;;
    schema:*) run_schema "${s#schema:}" ;;
    prefill:*) run_prefill "${s#prefill:}" ;;
    ab) run_ab q4_0 ;;
    *) say "unknown step: $s (tests, sanitize, bench:<quant>, ab:<quant>, batch:<quant>, serve:<quant>, schema:<quant>)"; failed=1 ;;
  esac
  say "  ($s done at ${SECONDS} s)"
done
say "gpu-check: $([ $failed = 0 ] && echo PASS || echo FAIL)"
exit $failed
