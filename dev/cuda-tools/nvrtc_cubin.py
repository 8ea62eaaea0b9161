#!/usr/bin/env python3
"""Compile q4moe's CUDA kernels to a cubin on a machine without a GPU, as Device::new does.

The sources are crates/cuda/kernels/* joined in device.rs SOURCES order with the same
"// ---- <name>" separators and the same options, so the cubin matches the one the engine
builds on a device with the same libnvrtc. Usage:

    nvrtc_cubin.py --nvrtc <libnvrtc.so> [--kernels DIR] [--arch 90] [--timeline] [--define NAME] OUT.cubin
"""
import argparse
import ctypes
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def source_order():
    """File names of device.rs SOURCES, in order (the one list; not repeated here)."""
    text = (ROOT / "crates/cuda/src/device.rs").read_text()
    block = text[text.index("const SOURCES"):]
    block = block[: block.index("];")]
    return re.findall(r'\("([\w.]+)", include_str!', block)


def compile_cubin(lib, src, opts):
    # libnvrtc dlopens its builtins by name; load the one beside it first so no
    # LD_LIBRARY_PATH is needed.
    for b in sorted(pathlib.Path(lib).parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
        break
    nv = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"q4moe_kernels.cu", 0, None, None)
    if rc:
        sys.exit(f"nvrtcCreateProgram failed: {rc}")
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"compile failed ({rc}):\n{log.value.decode(errors='replace')}")
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvrtc", required=True, help="path to libnvrtc.so")
    ap.add_argument("--kernels", default=str(ROOT / "crates/cuda/kernels"))
    ap.add_argument("--arch", default="90")
    ap.add_argument("--kv-f32", action="store_true", help="compile for the f32 KV cache")
    ap.add_argument("--timeline", action="store_true", help="-DQ4MOE_TIMELINE (the probe build)")
    ap.add_argument("--define", action="append", default=[], help="-D<this> (NAME or NAME=VALUE), a compile-time switch to compare in SASS")
    ap.add_argument("out")
    a = ap.parse_args()
    kdir = pathlib.Path(a.kernels)
    src = "".join(f"// ---- {n}\n{(kdir / n).read_text()}\n" for n in source_order())
    # device.rs compile_options, in its order.
    opts = [f"--gpu-architecture=sm_{a.arch}", "-default-device", "--std=c++17", "-lineinfo"]
    if not a.kv_f32:
        opts.append("-DKV_F16")
    if a.timeline:
        opts.append("-DQ4MOE_TIMELINE")
    opts += [f"-D{d}" for d in a.define]
    pathlib.Path(a.out).write_bytes(compile_cubin(a.nvrtc, src, opts))


if __name__ == "__main__":
    main()
