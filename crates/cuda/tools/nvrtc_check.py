#!/usr/bin/env python3
"""Compiles crates/cuda/kernels like src/nvrtc.rs does (one NVRTC program, its SOURCES order) on a
machine without a GPU, prints the log, and writes the cubin (for cuobjdump/nvdisasm -res-usage).
usage: python3 crates/cuda/tools/nvrtc_check.py [sm_90] [out.cubin] [extra NVRTC options, e.g. -DKV_F16]
Q4MOE_CUDA_KERNEL_DIR=<dir> compiles the same file names from that directory (as
CudaOptions::kernel_dir has the runtime do)."""
import ctypes, glob, os, re, sys
here = os.path.dirname(os.path.abspath(__file__))
kdir = os.environ.get("Q4MOE_CUDA_KERNEL_DIR") or os.path.join(here, "..", "kernels")
# The files and their order: src/nvrtc.rs SOURCES, the list the runtime compiles.
order = re.findall(r'\(\s*"([\w.]+)",\s*include_str!', open(os.path.join(here, "..", "src", "nvrtc.rs")).read())
assert order and order[0] == "common.cuh", "no SOURCES list found in src/nvrtc.rs"
src = "".join(f"// ---- {n}\n{open(os.path.join(kdir, n)).read()}\n" for n in order)
lib = None
for p in glob.glob("/work/pyenv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so*") + ["libnvrtc.so"]:
    try:
        lib = ctypes.CDLL(p); break
    except OSError:
        pass
arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"q4moe_kernels.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"--std=c++17", b"-lineinfo"]
opts += [o.encode() for o in sys.argv[3:]]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(errors="replace"))
if rc != 0:
    print("COMPILE FAILED", rc); sys.exit(1)
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
buf = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, buf)
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp/q4moe_kernels.cubin"
open(out, "wb").write(buf.raw)
print("ok", out, n.value, "bytes")
