#!/usr/bin/env python3
"""Compiles crates/cuda/kernels as the runtime does, on a machine without a GPU: the sources
joined in the NVRTC source list's order (read from crates/cuda/src, the one list: the
`include_str!("../kernels/<name>")` entries), with the same "// ---- <name>" separators and
options, so a compile error or a kernel's registers are seen before a device call is spent.

usage: python3 dev/cuda-tools/nvrtc_check.py [sm_90] [out.cubin] [extra NVRTC options]
  extra options as the runtime adds them: -DKV_F16 (the f16 KV cache, the default there),
  -DQ4MOE_TIMELINE (the `timeline` feature's probe build).
  --kernels DIR   compile the same file names from DIR (another ref's kernels:
                  `git archive <ref> crates/cuda/kernels | tar x -C DIR --strip-components=3`)
  --src DIR       read the source list from DIR (another ref's crates/cuda/src) instead
  --nvrtc LIB     the libnvrtc to load (default: the pip wheel under /work/pyenv, else the system's)
The cubin goes to out.cubin (default /tmp/q4moe_kernels.cubin) for `cuobjdump -res-usage` /
`-sass` (dev/cuda-tools/README.md)."""
import ctypes
import glob
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENTRY = re.compile(r'include_str!\("(?:\.\./)+kernels/([\w.]+)"\)')


def source_order(src_dir):
    """The kernel files in the runtime's order: the Rust file that embeds common.cuh lists them."""
    for rs in sorted(pathlib.Path(src_dir).rglob("*.rs")):
        names = ENTRY.findall(rs.read_text())
        if "common.cuh" in names:
            return names
    sys.exit(f"no NVRTC source list (include_str! of kernels/common.cuh) under {src_dir}")


def load_nvrtc(path):
    candidates = [path] if path else sorted(
        glob.glob("/work/pyenv/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so*")) + ["libnvrtc.so"]
    for p in candidates:
        try:
            # libnvrtc dlopens its builtins by name: load the one beside it first, so no
            # LD_LIBRARY_PATH is needed.
            for b in sorted(pathlib.Path(p).parent.glob("libnvrtc-builtins.so.*"))[:1]:
                ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(p)
        except OSError:
            continue
    sys.exit(f"no libnvrtc found (tried {candidates}); pass --nvrtc LIB")


def take(args, flag):
    """Removes `flag VALUE` from args; returns VALUE or None."""
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1]
    del args[i:i + 2]
    return value


def main():
    args = sys.argv[1:]
    kdir = pathlib.Path(take(args, "--kernels") or ROOT / "crates/cuda/kernels")
    order = source_order(take(args, "--src") or ROOT / "crates/cuda/src")
    lib = load_nvrtc(take(args, "--nvrtc"))
    arch = args[0] if args else "sm_90"
    out = args[1] if len(args) > 1 else "/tmp/q4moe_kernels.cubin"
    missing = [n for n in order if not (kdir / n).is_file()]
    if missing:
        sys.exit(f"{kdir} lacks {missing}, which the source list names ({' '.join(order)})")
    src = "".join(f"// ---- {n}\n{(kdir / n).read_text()}\n" for n in order)
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"q4moe_kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    # The runtime's compile options, in its order (crates/cuda/src: compile_options).
    opts = [f"--gpu-architecture={arch}", "-default-device", "--std=c++17", "-lineinfo",
            "-DQ4MOE_LAYOUT_CHECK"] + args[2:]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    print(log.value.decode(errors="replace"))
    if rc != 0:
        print("COMPILE FAILED", rc)
        sys.exit(1)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    pathlib.Path(out).write_bytes(buf.raw)
    print("ok", out, n.value, "bytes;", " ".join(order))


if __name__ == "__main__":
    main()
