#!/usr/bin/env bash
# SASS instruction counts and registers per kernel of two git refs' kernels, compiled here like
# the runtime does (nvrtc_check.py, sm_90, f16 KV cache), the kernels that differ listed: the
# check after any change to a weight kernel (read its first loads' order too, `cuobjdump -sass
# -fun <kernel>` on the cubins it leaves in $SASS_DIFF_OUT: docs/performance.md, session 25).
#   dev/cuda-tools/sass_diff.sh main next/q4k-addr32 [kernel name regex]
# Needs the pip NVRTC and cuobjdump (PYTHON, default /work/pyenv/bin/python, and its
# nvidia/cu13/bin on PATH).
set -eu -o pipefail
[ $# -ge 2 ] || { echo "usage: $0 <ref a> <ref b> [kernel regex]" >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-/work/pyenv/bin/python}
bin=$(dirname "$py")/../lib/python3.11/site-packages/nvidia/cu13/bin
[ -d "$bin" ] && PATH="$bin:$PATH"
out=${SASS_DIFF_OUT:-$(mktemp -d)}
for side in a b; do
  ref=$([ $side = a ] && echo "$1" || echo "$2")
  mkdir -p "$out/$side"
  # The ref's kernels and its source list (crates/cuda/src), which may name other files.
  git -C "$root" archive "$ref" crates/cuda/kernels crates/cuda/src | tar x -C "$out/$side"
  "$py" "$root/dev/cuda-tools/nvrtc_check.py" --kernels "$out/$side/crates/cuda/kernels" \
    --src "$out/$side/crates/cuda/src" sm_90 "$out/$side.cubin" \
    -DKV_F16 --ptxas-options=-v > "$out/$side.log" 2>&1 || { tail -20 "$out/$side.log"; exit 1; }
  # name instructions registers, a kernel a line
  cuobjdump -sass "$out/$side.cubin" | awk '/Function :/ {f=$3} /^ +\/\*[0-9a-f]+\*\// {n[f]++} END {for (k in n) print k, n[k]}' \
    | sort > "$out/$side.count"
  awk '/Function properties for/ {f=$NF} /Used [0-9]+ registers/ {for (i=1;i<=NF;i++) if ($i=="Used") print f, $(i+1)}' \
    "$out/$side.log" | sort > "$out/$side.regs"
  join "$out/$side.count" "$out/$side.regs" > "$out/$side.table"
done
echo "kernel: instructions a -> b, registers a -> b ($1 -> $2; cubins and logs in $out)"
join -a1 -a2 -e - -o 0,1.2,2.2,1.3,2.3 "$out/a.table" "$out/b.table" \
  | awk -v re="${3:-.}" '$1 ~ re && ($2 != $3 || $4 != $5) {printf "%-28s %6s -> %-6s %4s -> %s\n", $1, $2, $3, $4, $5}'
