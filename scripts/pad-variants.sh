#!/usr/bin/env bash
# Placement variants: HEAD's kernel sources with pad kernels of a given code size, never
# launched, so the kernels on one side of them move by that many bytes in the module's code while
# their code stays the same (the build effect: NOTES.md sessions 33-34, 40-42). The module lays
# kernels out in the reverse of their definition order, so a pad defined at the end of prefill.cu
# comes first and moves every other kernel (`all`); one defined before a given line moves only
# the kernels defined before it; one at the end of common.cuh (`top`) comes last and moves
# nothing: the module only grows. Past 16 KB the bytes are several pads of at most 16 KB (NVRTC
# does not unroll a longer one). Each goes to variants/pad-<site>-<bytes>/cu for
# scripts/gpu-check.sh `variants` (or `ab` with Q4MOE_CUDA_KERNEL_DIR) with the carried binary;
# check where it landed with tools/cubin_layout.
#   scripts/pad-variants.sh all 1280 5376          (each pad: 256 + 16 * n bytes, n a multiple of 8)
#   scripts/pad-variants.sh top 294912             (18 pads of 16 KB)
#   scripts/pad-variants.sh mv 1024                (sites: below)
set -eu -o pipefail
root=$(git rev-parse --show-toplevel)
site=$1
shift
# site -> file and the line the pad goes before (empty: the file's end)
case $site in
  all) file=prefill.cu; before="" ;;                                   # every kernel
  top) file=common.cuh; before="" ;;                                   # none (the module grows)
  mv)  file=matvec.cu; before='void embed(' ;;                         # the matvec kernels (qkv)
  att) file=attention.cu; before="" ;;                                 # attention, embed, matvec
  opr) file=moe.cu; before='void router_fold_build(' ;;                # o_proj_router, routers, and those
  *) echo "unknown site $site (all, top, mv, att, opr)" >&2; exit 1 ;;
esac
for bytes in "$@"; do
  dir="$root/variants/pad-$site-$bytes/cu"
  rm -rf "$dir" && mkdir -p "$dir"
  git -C "$root" archive HEAD crates/cuda/kernels | tar x -C "$dir" --strip-components=3
  pad="" left=$bytes i=0
  while (( left > 0 )); do  # pads of at most 16 KB (256 + 16 * 1008)
    part=$(( left > 16384 ? 16384 : left ))
    n=$(( (part - 256) / 16 ))
    if (( n < 8 || n % 8 != 0 )); then echo "pad $bytes: $part is not 256 + 16 * n with n a multiple of 8" >&2; exit 1; fi
    i=$((i + 1)) left=$((left - part))
    pad+=$(printf '%s\n' "" "// Placement pad $i: $n NANOSLEEPs (~$part bytes of SASS), never launched." \
      "extern \"C\" __global__ void placement_pad_$i() {" '#pragma unroll' \
      "  for (int i = 0; i < $n; ++i) asm volatile(\"nanosleep.u32 1;\");" '}' "")
  done
  if [ -z "$before" ]; then
    printf '%s\n' "$pad" >> "$dir/$file"
  else
    line=$(grep -n -F "$before" "$dir/$file" | head -1 | cut -d: -f1)
    [ -n "$line" ] || { echo "$file: no line with '$before'" >&2; exit 1; }
    # the pad goes above the comment block that heads that line
    while (( line > 1 )) && sed -n "$((line - 1))p" "$dir/$file" | grep -q '^//'; do line=$((line - 1)); done
    { head -n $((line - 1)) "$dir/$file"; printf '%s\n' "$pad"; tail -n +"$line" "$dir/$file"; } > "$dir/$file.new"
    mv "$dir/$file.new" "$dir/$file"
  fi
  echo "variants/pad-$site-$bytes/cu"
done
