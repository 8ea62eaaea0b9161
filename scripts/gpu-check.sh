#!/usr/bin/env bash
# CUDA check + benchmark of record in ONE device call. Build here first (no toolchain there):
#   cargo build --release -p q4moe && cargo test --release -p q4moe-cuda --no-run
#   run(command="bash scripts/gpu-check.sh [tests] [sanitize] [ab] [bench:q4_0] [bench:q4_k_m]",
#       carry=[target/release/q4moe, target/release/deps/kernels-<hash>, target/release/deps/parity-<hash>])
# Steps (default: tests bench:q4_0 bench:q4_k_m):
#   tests         kernel unit tests + CPU parity (tiny/mid x Q4_0/Q4_K_M), and the timeline probe's
#                 test where target/release/deps/timeline-* is carried. On failure the benches
#                 parity is re-run with Q4MOE_CUDA_NO_GQA / LEGACY to bisect, and the benches
#                 run with the first passing configuration (or are skipped). A speed-up that breaks
#                 parity is not kept.
#   sanitize      compute-sanitizer memcheck (tiny Q4_0/Q4_K_M parity, kernel tests), then
#                 racecheck (below).
#   ab[:<quant>]  quick A/B (cache on, in-flight 2, 3 runs; default q4_0): the graph of launches,
#                 the graph with programmatic dependent launch (the default), the fused step;
#                 AB_ENVS="A=1 B=2" times those settings instead ("A=1+B=2": both at once);
#                 QUICK_ARGS="--long-context 4096" adds bench arguments to every quick bench
#                 (that one sizes the KV as the record does: 4,360 positions, not 392).
#   parity:<V=x>  the CPU-parity tests with environment setting V=x.
#   addrs[:<q>]   the device addresses the backend logs (weights, step state) under
#                 each AB_ENVS setting (default q4_0): do kernel directories move the buffers?
#   variants      for each variants/<name>/ (scripts/build-variants.sh; carry "variants"; a variant
#                 of the kernels only is variants/<name>/cu/*.cu*, run by the carried binaries
#                 with Q4MOE_CUDA_KERNEL_DIR, scripts/kernel-variants.sh): its CPU
#                 parity test and kernel unit tests (when its build has them; whole output in
#                 $OUT/{parity,kernels}-<name>.txt, failures named in the summary), then the
#                 quick bench (cache on, in-flight 2, 3 runs) on Q4_0 and Q4_K_M, and on Q4_0
#                 with the fused step (VARIANT_RUNS="q4_0 0,q4_k_m 0": quant and fused; none: no quick benches);
#                 VARIANT_LONG=4096 adds Q4_0 decode at that context, after its prefill
#                 (VARIANT_LONG_QUANTS="q4_0 q4_k_m": those quants; VARIANT_LONG_FOR="<names>":
#                 those variants only); VARIANT_SAMPLED="<names>|all" adds their --sampled rows;
#                 VARIANTS="<names>" picks and orders them; VARIANT_TESTS=0 skips their tests,
#                 VARIANT_TESTS_FOR="<names>" runs those variants' tests only;
#                 VARIANT_ROUNDS=N times them N times in alternating order (tests once): one
#                 call's spread between processes reached ~3% (session 9), so decide nothing at
#                 the 1-3% level on one round.
#   long:<N>      Q4_0 decode after N positions of context (quick bench).
#   racecheck     racecheck per kernel family and memcheck on short tiny-geometry decodes
#                 (RACE_KINDS="<kernel name prefixes>": those families only).
#   omit[:<q>]    each layer kernel's cost inside the graph: the quick bench with it left out
#                 (Q4_0, or quant <q>).
#   ncu           Nsight Compute (--clock-control none) on one layer's eager launches and the output
#                 head (cache off): $OUT/ncu-{layer,head}.txt; NCU_FUSED=1 adds the fused step.
#   ncu-prefill:<N> Nsight Compute on the batched prefill's pf_mma launches of layer 0 after an
#                 N-token prompt: $OUT/ncu-prefill.txt.
#   ncu-att:<N>   Nsight Compute on two attn_gqa launches after an N-token prompt: $OUT/ncu-att.txt.
#   ncu-k:<q>:<re> Nsight Compute on two eager decode launches of the kernels matching <re>, quant <q>.
#   chain         what one dependent launch costs in a graph without work (benches/launch_chain.rs),
#                 PDL on and off.
#   timeline[:<q>] per kernel inside the graph (Q4_0, or quant <q>): how early its blocks were
#                 resident, what it costs the chain, how late its last blocks arrived, and in the
#                 hot kernels when their input's first value came, when it was staged, a
#                 midpoint (qkv and the head: their weights landed), when their last store was
#                 made and how long the next launch took to pass after it
#                 (Q4MOE_CUDA_TIMELINE=1, timeline.rs).
#   vtimeline[:<q>] the timeline of each variant (VARIANTS="<names>", default all of variants/;
#                 carry "variants"): $OUT/timeline-<name>-<q>.json, its table printed.
#   placement     where each kernel's code lies in the module (tools/cubin_layout): each of
#                 PLACEMENT="<variants>" (default: main, the carried binary) compiles its kernels into
#                 a cache of its own; $OUT/placement-<name>.txt its layout, and
#                 $OUT/placement-<name>-vs-first.txt the kernels that moved against the first named
#                 (the build effect: NOTES.md sessions 33-34, 40).
#   stamps        per-phase times inside the fused step (Q4MOE_CUDA_STAMPS=1), from the JSON record.
#   profile:<q>   per-kernel GPU times (--profile kernels: eager launches, cache off; 64 tokens, one run).
#   bench:<quant> `q4moe bench` (the benchmark of record) on a synthetic qwen3-30b-a3b model written
#                 on the device machine; JSON to $OUT/bench-<quant>.json, with --profile kernels.
#                 bench:<quant>@N uses --long-context N (default 4096; 0 skips it). --sampled adds
#                 device-sampler (top-k 20) and host-sampler (top-k off) variants.
set -u -o pipefail
OUT=${OUT:-/tmp/q4moe-out}
mkdir -p "$OUT"
export Q4MOE_NO_PROGRESS=1
steps=${*:-tests bench:q4_0 bench:q4_k_m}
bin() { ls -t target/release/deps/$1-* 2>/dev/null | grep -v '\.d$' | head -1; }
Q=${Q:-target/release/q4moe}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
ok=1
model() {  # writes the synthetic model once per call (with a variant's binary where $Q was not carried)
  local q=$Q
  [ -x "$q" ] || q=$(ls variants/*/q4moe 2>/dev/null | head -1)
  [ -f /tmp/$1.gguf ] || timeout 120 $q synth --geometry qwen3-30b-a3b --quant "$1" --seed 1 --out /tmp/$1.gguf >/dev/null 2>&1 \
    || say "model $1 NOT written (synth with '$q' failed)"
}
summary=""
# step_quant <step>: the quant a step names after its colon (ab:q4_k_m, omit:q4_k_m, ..), else q4_0.
step_quant() { if [[ $1 == *:* ]]; then echo "${1#*:}"; else echo q4_0; fi; }
kernel_table() {  # kernel_table <bench log> [rows]: the kernel table `q4moe bench` printed (report.rs)
  sed -n '/^kernel profile/,$p' "$1" | head -$((${2:-24} + 2))
}
# Printed as it happens and kept in $OUT/summary.txt: a call that runs out of time returns $OUT
# but no output when a pipe held it.
say() { echo -e "$1" | tee -a "$OUT/summary.txt"; summary+="$1\n"; }
# The quick bench (cache on, in-flight 2, 3 runs of 256 tokens after a 128-token prompt):
# quick <binary> <quant> [more bench args]; prints its decode median line (QUICK_LINE: another line;
# QUICK_ALL=1: the last 9 lines that match), the last one followed by the backend's start-up
# time where the binary prints it ("backend ready in X s", from bfb7f13).
quick() {
  local b=$1 q=$2 n=1 out ready
  shift 2
  [ -n "${QUICK_ALL:-}" ] && n=9
  out=$(timeout 150 "$b" bench --model /tmp/$q.gguf --device cuda --prompt-len 128 --decode-len 256 --runs 3 \
    --setup-cache on --in-flight 2 ${QUICK_ARGS:-} "$@" 2>&1)
  ready=$(grep -o "backend ready in [0-9.]* s" <<< "$out")
  grep -E "${QUICK_LINE:-median [0-9.]+ tok/s\$}" <<< "$out" | tail -$n | sed "\$s/\$/${ready:+ ($ready)}/"
}
# vtest <variant> <parity|kernels>: a variant's test binary; its whole output goes to
# $OUT/<test>-<variant>.txt, and a failure names the failing tests and their panics in the
# summary (and marks the variant failed).
vtest() {
  local log="$OUT/$2-$1.txt" r
  vrun "$1" timeout 200 "$(vbin "$1" "$2")" --test-threads=1 --nocapture > "$log" 2>&1
  r=$(grep -E "^test result" "$log")
  say "variant $1: $2 [$r] (at ${SECONDS} s)"
  [[ $r == *" 0 failed"* ]] && return 0
  say "$(grep -E "^test .* FAILED$|panicked|^  left|^ right|assertion" "$log" | head -12)"
  failed+="$1 "
  return 1
}
# vbin <variant> <q4moe|parity|kernels>: the variant's own build of it; for a variant without
# a q4moe of its own (kernels only, or main) the carried one; nothing for a variant built on its
# own without it (the carried test would check main's code, not the variant's).
vbin() {
  if [ -x "variants/$1/$2" ]; then echo "variants/$1/$2"
  elif [ -x "variants/$1/q4moe" ]; then :
  elif [ "$2" = q4moe ]; then echo "$Q"
  else bin "$2"; fi
}
# vrun <variant> <command...>: the command with the variant's kernel sources (cu/) where it has them.
vrun() {
  local n=$1
  shift
  if [ -d "variants/$n/cu" ]; then Q4MOE_CUDA_KERNEL_DIR="variants/$n/cu" "$@"; else "$@"; fi
}
# timeline <q4moe> <quant> <name> <kernel rows>: the probe bench ($OUT/<name>.{json,log}), its
# kernel table's first rows, and tools/timeline/table.py's marks a kernel a row.
timeline() {
  Q4MOE_CUDA_TIMELINE=1 timeout 150 "$1" bench --model /tmp/$2.gguf --device cuda --prompt-len 128 --decode-len 256 \
    --runs 3 --setup-cache on --in-flight 2 --long-context 0 --json-out "$OUT/$3.json" > "$OUT/$3.log" 2>&1
  say "$3: $(grep -E "median [0-9.]+ tok/s\$" "$OUT/$3.log" | tail -1)"  # decode, not the prefill
  [ "$4" = 0 ] || kernel_table "$OUT/$3.log" "$4"
  say "$(python3 tools/timeline/table.py "$OUT/$3.json" 2>&1)"
}
named() {  # named "<names>" <name>: the list is empty or "all" or holds the name
  [ -z "$1" ] || [ "$1" = all ] || [[ " $1 " == *" $2 "* ]]
}
# Racecheck one kernel family at a time (--kernel-name; the others run uninstrumented) on short
# decodes of the tiny geometry (`q4moe bench`: a 100-token prompt, so attention merges 4 chunks,
# then 8 tokens; the parity tests under racecheck outlast a device call), then memcheck on the
# same runs (graph, device sampler). The "router" family is the router folded into o_proj's
# launch (o_proj_router_*, session 14); with the fold off, racecheck runs without the router
# cluster: it fails on it with an internal error (session 7), router_topk stands in. Nor the
# fused step (its grid barrier spins when racecheck serialises blocks).
tiny_sanitize() {
  racy() {  # racy <quant> <tool args..>: the sanitizer's verdict on one short tiny decode
    local q=$1 extra="--setup-cache off" cluster=0
    shift
    [[ "$*" == *sample* || "$*" == *memcheck* ]] && extra="--setup-cache on --sampled"
    [[ "$*" == *memcheck* ]] && cluster=1
    Q4MOE_CUDA_ROUTER_CLUSTER=$cluster timeout 90 compute-sanitizer --print-limit 10 "$@" $Q bench --model /tmp/tiny-$q.gguf \
      --device cuda --prompt-len 100 --decode-len 8 --runs 1 --in-flight 1 $extra 2>&1 \
      | grep -E "SUMMARY|Sanitizer Error|panicked|^Error" | head -3 | tr '\n' ' '
  }
  for q in q4_0 q4_k_m; do
    timeout 60 $Q synth --geometry tiny --quant $q --seed 1 --out /tmp/tiny-$q.gguf > /dev/null 2>&1
    kinds="attn_gqa moe_ router matvec argmax sample pf_"
    [ $q = q4_k_m ] && kinds="moe_ matvec pf_"  # its Q4_K / Q6_K paths
    kinds=${RACE_KINDS:-$kinds}  # RACE_KINDS="moe_": the families a change touched, on both quants
    for k in $kinds; do
      say "racecheck $q $k: $(racy $q --tool racecheck --kernel-name kns=$k) (at ${SECONDS} s)"
    done
    say "memcheck $q: $(racy $q --tool memcheck) (at ${SECONDS} s)"
  done
}
for s in $steps; do
  case $s in
    tests)
      # The timeline probe's test (where carried: its own process, an env switch) fails the
      # step but not the benches: it checks the probe, not the decode.
      probe="not carried"
      for t in kernels parity timeline; do
        [ "$t" = timeline ] && [ -z "$(bin $t)" ] && continue
        echo "== $t"
        if timeout 300 "$(bin $t)" --test-threads=1 --nocapture 2>&1; then
          [ "$t" = timeline ] && probe=ok
          continue
        fi
        echo "!! $t FAILED"; [ "$t" = timeline ] && probe=FAILED || ok=0
      done > "$OUT/tests.log" 2>&1
      grep -E "relative logit error|agree on|test result|FAILED|panicked" "$OUT/tests.log" | sort | uniq -c | tail -20
      say "tests: $([ $ok = 1 ] && echo PASS || echo FAIL) (timeline probe test: $probe)"
      if [ $ok = 0 ]; then
        # Bisect by path; the benches then run with the first configuration that passes.
        for env in Q4MOE_CUDA_NO_GQA=1 Q4MOE_CUDA_LEGACY=1; do
          r=$(env $env timeout 200 "$(bin parity)" --test-threads=1 2>&1 | grep -E "^test result")
          say "bisect [$env]: $r"
          if [[ $r == *" 0 failed"* ]]; then export $env; ok=1; say "benches run with $env"; break; fi
        done
      fi ;;
    sanitize)
      # memcheck on the tiny parity tests of both quants (Q4_K_M runs the Q6_K kernels; the
      # fused step included) and on the kernel tests, racecheck on the attention kernel test
      # (where the builds have it), then tiny_sanitize (racecheck a family at
      # a time, memcheck of the graph and the device sampler).
      {
        echo "== compute-sanitizer memcheck (tiny Q4_0 and Q4_K_M parity)"
        timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$(bin parity)" tiny_q4 --test-threads=1 2>&1 | tail -4
        echo "== compute-sanitizer memcheck (kernel tests)"
        timeout 120 compute-sanitizer --tool memcheck --print-limit 20 "$(bin kernels)" --test-threads=1 2>&1 | tail -4
        # The Qwen3-shape attention kernels run only at full geometry and in this kernel test
        # (the tiny geometry has its own shape), so they are racechecked here.
        echo "== compute-sanitizer racecheck (kernel test attention_matches_host)"
        timeout 150 compute-sanitizer --tool racecheck --print-limit 10 "$(bin kernels)" attention_matches_host 2>&1 | tail -4
        tiny_sanitize
      } 2>&1 | tee "$OUT/sanitizer.log" ;;
    ab|ab:*)
      [ $ok = 1 ] || continue
      q=$(step_quant "$s")
      model $q
      for env in ${AB_ENVS:-Q4MOE_CUDA_PDL=0 Q4MOE_CUDA_PDL=1 Q4MOE_CUDA_FUSED=1}; do
        r=$(export ${env//+/ }; quick "$Q" $q)
        say "ab $q [$env]: $r"
      done ;;
    addrs|addrs:*)
      # Where the backend's buffers land (Q4MOE_LOG=q4moe_cuda=debug) under each AB_ENVS setting,
      # e.g. kernel directories (NOTES.md sessions 42-43): one short decode.
      q=$(step_quant "$s")
      model $q
      for env in ${AB_ENVS:-Q4MOE_DUMMY=0}; do
        r=$(export ${env//+/ }; Q4MOE_LOG=q4moe_cuda=debug timeout 120 "$Q" bench --model /tmp/$q.gguf --device cuda \
          --prompt-len 4 --decode-len 4 --runs 1 2>&1 | grep -o "device addresses.*" | head -1)
        say "addrs $q [$env]: ${r:-no address line}"
      done ;;
    parity:*)
      # The CPU-parity tests under one setting, e.g. parity:Q4MOE_CUDA_TOPK=experts.
      r=$(env ${s#parity:} timeout 200 "$(bin parity)" --test-threads=1 2>&1 | grep -E "^test result|panicked")
      say "parity [${s#parity:}]: $r" ;;
    variants)
      model q4_0; model q4_k_m
      say "models written (at ${SECONDS} s)"
      # Each variant's kernels compiled at once, in parallel (NVRTC is one thread; the cubin cache
      # keeps them): a token on the tiny geometry each.
      timeout 60 "$Q" synth --geometry tiny --out /tmp/tiny.gguf > /dev/null 2>&1
      for n in ${VARIANTS:-$(ls variants)}; do
        vrun "$n" timeout 120 "$(vbin "$n" q4moe)" run --model /tmp/tiny.gguf --device cuda -p hi -n 1 > "$OUT/warm-$n.txt" 2>&1 &
      done
      wait
      say "kernels compiled (at ${SECONDS} s)"
      failed=" "
      for round in $(seq "${VARIANT_ROUNDS:-1}"); do  # rounds alternate the builds (see above)
      for n in ${VARIANTS:-$(ls variants)}; do  # VARIANTS="<names>": those, in that order
        [[ $failed == *" $n "* ]] && continue
        [ "$round" -gt 1 ] && tag=" round $round" || tag=""
        tests=${VARIANT_TESTS:-1}
        named "${VARIANT_TESTS_FOR:-}" "$n" || tests=0
        if [ "$tests" = 0 ] || [ "$round" -gt 1 ]; then :  # timed again: its tests passed
        elif [ -n "$(vbin "$n" parity)" ]; then  # a variant stacked under a checked one may come without it
          vtest "$n" parity || continue
        fi
        if [ "$tests" != 0 ] && [ "$round" = 1 ] && [ -n "$(vbin "$n" kernels)" ]; then
          vtest "$n" kernels || continue
        fi
        runs=()  # VARIANT_RUNS=none: no quick benches (the long-context or sampled rows only)
        [ "${VARIANT_RUNS:-}" = none ] || IFS=, read -ra runs <<< "${VARIANT_RUNS:-q4_0 0,q4_k_m 0,q4_0 1}"
        for run in ${runs[@]+"${runs[@]}"}; do
          set -- $run
          b=$(Q4MOE_CUDA_FUSED=$2 vrun "$n" quick "$(vbin "$n" q4moe)" $1)
          say "variant $n$tag $1 fused=$2: $b (at ${SECONDS} s)"
        done
        [ "$round" = 1 ] || continue  # long-context and sampled rows once
        if [ -n "${VARIANT_LONG:-}" ] && named "${VARIANT_LONG_FOR:-}" "$n"; then  # decode at that context
          for lq in ${VARIANT_LONG_QUANTS:-q4_0}; do
          b=$(QUICK_LINE="decode at" vrun "$n" quick "$(vbin "$n" q4moe)" "$lq" --long-context "$VARIANT_LONG")
          say "variant $n $lq long: $b (at ${SECONDS} s)"
          done
        fi
        if [ -n "${VARIANT_SAMPLED:-}" ] && named "$VARIANT_SAMPLED" "$n"; then  # the --sampled rows
          b=$(QUICK_ALL=1 vrun "$n" quick "$(vbin "$n" q4moe)" q4_0 --sampled)
          say "variant $n q4_0 sampled (at ${SECONDS} s):\n$b"
        fi
      done
      done ;;
    long:*)
      # Q4_0 decode after long:<N> positions (quick bench, its own KV capacity), as set now.
      model q4_0
      say "long ${s#long:}: $(QUICK_LINE="decode at" quick "$Q" q4_0 --long-context ${s#long:}) (at ${SECONDS} s)" ;;
    racecheck) tiny_sanitize ;;
    placement)
      timeout 60 "$Q" synth --geometry tiny --out /tmp/tiny.gguf > /dev/null 2>&1
      first=""
      for n in ${PLACEMENT:-main}; do
        XDG_CACHE_HOME=/tmp/cubins-$n vrun "$n" timeout 120 "$(vbin "$n" q4moe)" run --model /tmp/tiny.gguf \
          --device cuda -p hi -n 1 > /dev/null 2>&1
        c=$(ls /tmp/cubins-$n/q4moe/kernels/*.cubin 2>/dev/null | head -1)
        [ -n "$c" ] || { say "placement $n: no cubin compiled"; continue; }
        python3 tools/cubin_layout/cubin_layout.py "$c" > "$OUT/placement-$n.txt"
        [ -n "$first" ] && python3 tools/cubin_layout/cubin_layout.py "$first" "$c" > "$OUT/placement-$n-vs-first.txt"
        first=${first:-$c}
        say "placement $n: $(head -1 "$OUT/placement-$n.txt")"
      done ;;
    omit|omit:*)
      # Each layer kernel's cost inside the graph: the step without it (Q4MOE_CUDA_OMIT; wrong
      # output, timing only), Q4_0 (omit:<quant>: that quant), cache on, in-flight 2, 3 runs.
      # o_proj includes the folded router (router_topk is a launch of its own only with
      # Q4MOE_CUDA_ROUTER_FOLD=0). The head's cost: AB_ENVS="Q4MOE_CUDA_HEAD_ARGMAX=0
      # Q4MOE_CUDA_HEAD_ARGMAX=0+Q4MOE_CUDA_OMIT=head" with `ab` (the arg-max launches after the
      # head still publish the token; the head's own greedy tail, left out, would not).
      q=$(step_quant "$s")
      model $q
      for k in none qkv attn_gqa o_proj moe_gate_up moe_down; do
        r=$(Q4MOE_CUDA_OMIT=$k quick "$Q" $q)
        say "omit $q $k: $r"
      done ;;
    ncu)
      model q4_0
      sec="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
      args="bench --model /tmp/q4_0.gguf --device cuda --prompt-len 4 --decode-len 8 --runs 1 --in-flight 1"
      [ "${NCU_FUSED:-0}" = 1 ] && Q4MOE_CUDA_FUSED=1 timeout 240 ncu --clock-control none $sec --kernel-name step_fused \
        --launch-skip 6 --launch-count 1 $Q $args --setup-cache on > "$OUT/ncu-fused.txt" 2>&1
      # Eager: embed + 5 launches a layer (the router folded into o_proj's) + head + arg-max (2)
      # per token; skip 5 tokens, the embedding and one layer, then profile one layer's
      # launches; then token 6's head.
      tok=$((1 + 5 * 48 + 3))
      timeout 240 ncu --clock-control none $sec --launch-skip $((5 * tok + 6)) --launch-count 5 \
        $Q $args --setup-cache off > "$OUT/ncu-layer.txt" 2>&1
      timeout 120 ncu --clock-control none $sec --launch-skip $((5 * tok + 1 + 5 * 48)) --launch-count 1 \
        $Q $args --setup-cache off > "$OUT/ncu-head.txt" 2>&1
      for f in layer head; do
        grep -E "^  [a-z_]+|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Ipc" "$OUT/ncu-$f.txt" | head -120
      done
      [ "${NCU_FUSED:-0}" = 1 ] && grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Warp Cycles Per Issued|Issued Ipc" "$OUT/ncu-fused.txt" | head -20 ;;
    chain)
      # One dependent launch's cost inside a graph apart from any work (benches/launch_chain.rs:
      # empty pdl_probe launches at the step's grid sizes), with PDL and without. The binary:
      # CHAIN_BIN (variants/<name>/launch_chain, scripts/build-variants.sh) or the carried
      # target/release/deps/launch_chain-* (cargo bench -p q4moe-cuda --no-run).
      b=${CHAIN_BIN:-$(bin launch_chain)}
      say "$(timeout 120 "$b" 2>&1 | tail -8)"
      say "$(Q4MOE_CUDA_PDL=0 timeout 120 "$b" 2>&1 | tail -8)" ;;
    ncu-k:*)
      # Nsight Compute on two eager decode launches of the kernels matching a regex, in one quant:
      # ncu-k:<quant>:<regex> (e.g. ncu-k:q4_k_m:moe_gate_up), after the first 20 matching
      # (cache off); $OUT/ncu-<quant>-<regex>.txt, its stall and issue lines printed.
      IFS=: read -r _ q re <<< "$s"
      model "$q"
      f="$OUT/ncu-$q-$(tr -c 'a-zA-Z0-9_\n' _ <<< "$re").txt"
      timeout 240 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --kernel-name "regex:$re" --launch-skip 20 --launch-count 2 $Q bench --model /tmp/$q.gguf --device cuda \
        --prompt-len 4 --decode-len 8 --runs 1 --in-flight 1 --setup-cache off > "$f" 2>&1
      grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per|Issued Ipc|Issue Slots|Executed Instructions|No Eligible|Active Warps Per|Eligible Warps" "$f" | head -80 ;;
    ncu-prefill:*)
      # Nsight Compute on the batched prefill's first seven pf_mma launches (layer 0's q, k, v,
      # o, gate, up, down) of an N-token prompt: $OUT/ncu-prefill.txt.
      model q4_0
      sec="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats"
      timeout 300 ncu --clock-control none $sec --kernel-name pf_mma --launch-count 7 $Q bench --model /tmp/q4_0.gguf \
        --device cuda --prompt-len ${s#ncu-prefill:} --decode-len 4 --runs 1 --in-flight 1 --setup-cache on > "$OUT/ncu-prefill.txt" 2>&1
      grep -E "^  [a-z_]+|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Ipc|L1/TEX Hit|L2 Hit|Bank" "$OUT/ncu-prefill.txt" | head -160 ;;
    ncu-att:*)
      # Nsight Compute on attention alone after a long prompt (ncu-att:<N>, eager, cache off):
      # the attn_gqa launches of the last prefill tokens and the decode, two profiled.
      model q4_0
      sec="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section SourceCounters"
      n=${s#ncu-att:}
      timeout 400 ncu --clock-control none $sec --kernel-name regex:attn_gqa --launch-skip $((48 * n)) --launch-count 2 \
        $Q bench --model /tmp/q4_0.gguf --device cuda --prompt-len "$n" --decode-len 4 --runs 1 --in-flight 1 \
        --setup-cache off > "$OUT/ncu-att.txt" 2>&1
      grep -E "^  [a-z_]+|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Ipc" "$OUT/ncu-att.txt" | head -60 ;;
    timeline|timeline:*)
      # When each launch's blocks reached and passed pdl_wait (Q4MOE_CUDA_TIMELINE=1, timeline.rs),
      # per kernel: lead (its first block resident before the predecessor finished), step (its
      # first pass to the next launch's), spread (its blocks arriving after the first passed).
      # Q4_0 (timeline:<quant>: that quant), cache on, in-flight 2, 3 runs of 256 tokens, ~33
      # steps a run recorded. The probe perturbs what it measures (its atomics; ~12% of the tok/s
      # in session 46): compare marks within probe builds only. tools/timeline/table.py prints
      # the marks a kernel a row (lead, pass, in, x, mid, end, release, step, spread).
      q=$(step_quant "$s")
      model $q
      timeline "$Q" "$q" "timeline-$q" 40 ;;
    vtimeline|vtimeline:*)
      # The timeline (above) of each variant (VARIANTS="<names>", default all of variants/),
      # its binary or its kernel sources: a change to a chain should move its marks (NOTES.md
      # session 46); ~40 s a variant warm, with its probe build's compile.
      q=$(step_quant "$s")
      model $q
      for n in ${VARIANTS:-$(ls variants)}; do
        b=$(vbin "$n" q4moe)
        if [ -n "$b" ]; then vrun "$n" timeline "$b" "$q" "timeline-$n-$q" 0
        else say "vtimeline $n: no q4moe (a build of its own without it)"; fi
      done ;;
    stamps)
      # Per-phase time inside the fused step (block 0's %globaltimer at each phase start).
      [ $ok = 1 ] || continue
      model q4_0
      Q4MOE_CUDA_FUSED=1 Q4MOE_CUDA_STAMPS=1 timeout 120 $Q bench --model /tmp/q4_0.gguf --device cuda --prompt-len 128 --decode-len 64 \
        --runs 1 --setup-cache on --in-flight 1 --json-out "$OUT/stamps.json" > "$OUT/stamps.log" 2>&1
      kernel_table "$OUT/stamps.log" ;;
    profile:*)
      # Per-kernel GPU times (--profile kernels), 64 decode tokens, one run: where a quant's time goes.
      q=${s#profile:}
      model "$q"
      timeout 120 $Q bench --model /tmp/$q.gguf --device cuda --prompt-len 128 --decode-len 64 --runs 1 --setup-cache off \
        --in-flight 1 --profile kernels --json-out "$OUT/profile-$q.json" > "$OUT/profile-$q.log" 2>&1
      echo "== kernel profile $q"; kernel_table "$OUT/profile-$q.log" ;;
    bench:*)
      [ $ok = 1 ] || { echo "skipping $s: tests failed"; continue; }
      q=${s#bench:}; long=4096
      [[ $q == *@* ]] && { long=${q#*@}; q=${q%@*}; }  # bench:<quant>@<long-context>, 0 = none
      model "$q"
      echo "== bench $q"
      timeout 300 $Q bench --model /tmp/$q.gguf --device cuda --prompt-len 128 --decode-len 256 --runs 5 \
        --long-context $long --profile kernels --sampled --json-out "$OUT/bench-$q.json" > "$OUT/bench-$q.log" 2>&1
      tail -45 "$OUT/bench-$q.log"
      say "bench $q: $(grep -E 'cache on, in-flight 2' "$OUT/bench-$q.log" | head -1)" ;;
  esac
  say "  ($s done at ${SECONDS} s)"  # for planning device time: each step's end
done
echo "== summary"; printf "$summary"
