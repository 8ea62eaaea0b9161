#!/usr/bin/env python3
"""Where each kernel's code sits in a cubin (the ELF file NVRTC writes, cached by q4moe under
~/.cache/q4moe/kernels), and how two cubins' placements differ.

Why: builds whose executed kernels are unchanged have read 0.5-1.6% apart (NOTES.md sessions
33-34, 40: "the build effect"); this shows which kernels moved, by how much, and which grew.

  cubin_layout.py A.cubin              each kernel's code section: order, offset, size, registers
  cubin_layout.py A.cubin B.cubin      the kernels whose offset or size differ between the two

Offsets are the code's place in the text sections' order (each section aligned as the file
says), which is how the sections lie in the file; the driver's load address is not in the file.
Registers: the top byte of a code section's sh_info, where ptxas keeps the count.
"""
import struct
import sys


def sections(path):
    """(name, offset, size, align, info) of every section of an ELF64 little-endian file."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        sys.exit(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx]
    strtab = data[names[4]:names[4] + names[5]]

    def name(off):
        return strtab[off:strtab.index(b"\0", off)].decode()

    return [(name(h[0]), h[4], h[5], max(h[8], 1), h[7]) for h in heads]


def kernels(path):
    """{kernel: (order, text offset, size, registers)} of the code sections, in file order."""
    out, at = {}, 0
    code = [s for s in sections(path) if s[0].startswith(".text.")]
    for i, (name, _, size, align, info) in enumerate(sorted(code, key=lambda s: s[1])):
        at = (at + align - 1) // align * align
        out[name[len(".text."):]] = (i, at, size, info >> 24)
        at += size
    return out


def show(path):
    ks = kernels(path)
    print(f"{path}: {len(ks)} kernels, {sum(k[2] for k in ks.values())} bytes of code")
    print(f"{'#':>4} {'offset':>9} {'bytes':>7} {'regs':>4}  kernel")
    for name, (i, at, size, regs) in sorted(ks.items(), key=lambda kv: kv[1][0]):
        print(f"{i:>4} {at:>9} {size:>7} {regs:>4}  {name}")


def compare(a, b):
    ka, kb = kernels(a), kernels(b)
    print(f"A {a}\nB {b}")
    print(f"{'offset A':>9} {'offset B':>9} {'moved':>7} {'bytes A':>7} {'bytes B':>7} {'regs':>7}  kernel")
    for name in sorted(set(ka) | set(kb), key=lambda n: ka.get(n, kb.get(n))[0]):
        if name not in ka or name not in kb:
            print(f"{'':>9} {'':>9} {'':>7} {'':>7} {'':>7} {'':>7}  {name} only in {'A' if name in ka else 'B'}")
            continue
        (_, oa, sa, ra), (_, ob, sb, rb) = ka[name], kb[name]
        if (oa, sa, ra) != (ob, sb, rb):
            print(f"{oa:>9} {ob:>9} {ob - oa:>+7} {sa:>7} {sb:>7} {ra:>3}/{rb:<3}  {name}")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        show(sys.argv[1])
    elif len(sys.argv) == 3:
        compare(sys.argv[1], sys.argv[2])
    else:
        sys.exit(__doc__)
