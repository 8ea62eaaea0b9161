#!/usr/bin/env python3
"""Where each kernel's code sits in a cubin (the ELF file NVRTC writes, cached by q4moe under
~/.cache/q4moe/kernels), and how two cubins' placements differ.

Why: builds whose executed kernels are unchanged have read 0.5-1.6% apart (docs/performance.md, sessions
33-34, 40: "the build effect"); this shows which kernels moved, by how much, and which grew.

  cubin_layout.py A.cubin              each kernel's code section: order, offset, size, registers
  cubin_layout.py A.cubin B.cubin      the kernels whose offset or size differ between the two

Offsets are the code's place in the text sections' order (each section aligned as the file
says), which is how the sections lie in the file; the driver's load address is not in the file.
Registers: the EIATTR_REGCOUNT entries of the .nv.info section (symbol index, count). A kernel's
code is also hashed, so "same offset and size" and "same code" can be told apart.
"""
import struct
import sys
import zlib


def elf(path):
    """The file's bytes and (name, offset, size, align, info) of each of its sections."""
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

    return data, [(name(h[0]), h[4], h[5], max(h[8], 1), h[7]) for h in heads]


def registers(data, secs):
    """{symbol name: registers} from .nv.info's EIATTR_REGCOUNT (0x2f) entries."""
    sym = next(s for s in secs if s[0] == ".symtab")
    strs = next(s for s in secs if s[0] == ".strtab")
    strtab = data[strs[1]:strs[1] + strs[2]]

    def sym_name(i):
        off, = struct.unpack_from("<I", data, sym[1] + 24 * i)
        return strtab[off:strtab.index(b"\0", off)].decode()

    out = {}
    for s in (s for s in secs if s[0] == ".nv.info"):
        b, i = data[s[1]:s[1] + s[2]], 0
        while i < len(b):
            fmt, attr, size = struct.unpack_from("<BBH", b, i)
            if fmt == 4:  # EIFMT_SVAL: a payload of `size` bytes
                if attr == 0x2F:
                    idx, regs = struct.unpack_from("<II", b, i + 4)
                    out[sym_name(idx)] = regs
                i += 4 + size
            else:
                i += 4
    return out


def kernels(path):
    """{kernel: (order, text offset, size, registers, code hash)} of the code sections, in
    file order."""
    data, secs = elf(path)
    regs = registers(data, secs)
    out, at = {}, 0
    code = [s for s in secs if s[0].startswith(".text.")]
    for i, (name, off, size, align, _) in enumerate(sorted(code, key=lambda s: s[1])):
        at = (at + align - 1) // align * align
        k = name[len(".text."):]
        out[k] = (i, at, size, regs.get(k, 0), zlib.crc32(data[off:off + size]))
        at += size
    return out


def show(path):
    ks = kernels(path)
    print(f"{path}: {len(ks)} kernels, {sum(k[2] for k in ks.values())} bytes of code")
    print(f"{'#':>4} {'offset':>9} {'bytes':>7} {'regs':>4}  kernel")
    for name, (i, at, size, regs, _) in sorted(ks.items(), key=lambda kv: kv[1][0]):
        print(f"{i:>4} {at:>9} {size:>7} {regs:>4}  {name}")


def compare(a, b):
    ka, kb = kernels(a), kernels(b)
    print(f"A {a}\nB {b}")
    print(f"{'offset A':>9} {'offset B':>9} {'moved':>7} {'bytes A':>7} {'bytes B':>7} {'regs':>7} code  kernel")
    for name in sorted(set(ka) | set(kb), key=lambda n: ka.get(n, kb.get(n))[0]):
        if name not in ka or name not in kb:
            print(f"{'':>9} {'':>9} {'':>7} {'':>7} {'':>7} {'':>7}  {name} only in {'A' if name in ka else 'B'}")
            continue
        (_, oa, sa, ra, ha), (_, ob, sb, rb, hb) = ka[name], kb[name]
        if (oa, sa, ra, ha) != (ob, sb, rb, hb):
            same = "same" if ha == hb else "DIFF"
            print(f"{oa:>9} {ob:>9} {ob - oa:>+7} {sa:>7} {sb:>7} {ra:>3}/{rb:<3} {same}  {name}")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        show(sys.argv[1])
    elif len(sys.argv) == 3:
        compare(sys.argv[1], sys.argv[2])
    else:
        sys.exit(__doc__)
