#!/usr/bin/env python3
"""Writes the params structs' layout checks on both sides of the FFI: for every #[repr(C)]
struct of crates/cuda/src/params.rs and its mirror in crates/cuda/kernels (matched by name, QW
for Qw; fields paired in order, each pair's size compared), the C layout (natural alignment, as
NVCC and rustc's repr(C) lay it out) becomes
  - after the struct in its kernel file: SIZE_IS(S, n); FIELD_AT(S, field, offset); ... (static
    asserts, macros in common.cuh), and
  - at the end of params.rs: layout!(S, n; field @ offset, ...) (const asserts).
Rerun after changing a params struct on both sides: `python3 dev/params_layout.py`; it refuses
(exit 1) where the two sides disagree in field count or a field's size, and `--check` only
reports whether the files are up to date."""
import glob, os, re, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "cuda")
PARAMS = os.path.join(ROOT, "src", "params.rs")
KERNELS = sorted(glob.glob(os.path.join(ROOT, "kernels", "*.cu*")))
MARK = "// ---- Layouts (dev/params_layout.py writes this block and the kernels' SIZE_IS / FIELD_AT)"
C_NAME = {"Qw": "QW"}
PRIM = {"u64": 8, "i32": 4, "u32": 4, "f32": 4, "int": 4, "float": 4, "unsigned": 4}


def rust_structs(src):
    out = {}
    for m in re.finditer(r"#\[repr\(C\)\]\s*(?:#\[[^\]]*\]\s*)*pub struct (\w+) \{(.*?)\n\}", src, re.S):
        fields = []
        for line in m.group(2).split("\n"):
            f = re.match(r"\s*pub (\w+): (.+),\s*$", line)
            if f:
                t = f.group(2).strip()
                a = re.match(r"\[(\w+); (\d+)\]", t)
                fields.append((f.group(1), a.group(1) if a else t, int(a.group(2)) if a else 1))
        out[m.group(1)] = fields
    return out


def c_structs(path):
    src = open(path).read()
    out = {}
    for m in re.finditer(r"^struct (\w+) \{\n(.*?)^\};", src, re.S | re.M):
        body = re.sub(r"//[^\n]*", "", m.group(2))
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            t, rest = decl.split(" ", 1)
            for name in rest.split(","):
                a = re.match(r"\s*(\w+)(?:\[(\d+)\])?\s*$", name)
                if not a:  # not a plain data struct (methods, templates): no mirror
                    break
                fields.append((a.group(1), t, int(a.group(2) or 1)))
            else:
                continue
            break
        else:
            out[m.group(1)] = (path, fields)
    return out


def layout(name, structs, cache):
    """(size, align, [(field, offset, size)]) of C struct `name`."""
    if name in cache:
        return cache[name]
    off, align, out = 0, 1, []
    for f, t, n in structs[name][1]:
        if t in PRIM:
            s = a = PRIM[t]
        else:
            s, a, _ = layout(t, structs, cache)
        off = (off + a - 1) // a * a
        out.append((f, off, s * n))
        off += s * n
        align = max(align, a)
    cache[name] = ((off + align - 1) // align * align, align, out)
    return cache[name]


def wrap(items, width=110):
    lines, cur = [], ""
    for it in items:
        if cur and len(cur) + 1 + len(it) > width:
            lines.append(cur)
            cur = it
        else:
            cur = f"{cur} {it}" if cur else it
    return lines + [cur]


def main():
    check = "--check" in sys.argv[1:]
    rs = open(PARAMS).read()
    rust = rust_structs(rs.split(MARK)[0])
    cs = {}
    for k in KERNELS:
        cs.update(c_structs(k))
    cache, c_lines, rs_lines, bad = {}, {}, [], []
    for rname, rfields in rust.items():
        cname = C_NAME.get(rname, rname)
        if cname not in cs:
            bad.append(f"{rname}: no struct {cname} in the kernels")
            continue
        size, _, fields = layout(cname, cs, cache)
        if len(fields) != len(rfields):
            bad.append(f"{rname}: {len(rfields)} fields in params.rs, {len(fields)} in {cname}")
            continue
        for (rf, rt, rn), (cf, _, csz) in zip(rfields, fields):
            rsz = (PRIM[rt] if rt in PRIM else layout(C_NAME.get(rt, rt), cs, cache)[0]) * rn
            if rsz != csz:
                bad.append(f"{rname}.{rf} ({rsz} bytes) vs {cname}.{cf} ({csz} bytes)")
        c_lines[cname] = wrap([f"SIZE_IS({cname}, {size});"] + [f"FIELD_AT({cname}, {f}, {o});" for f, o, _ in fields])
        rs_lines += wrap([f"layout!({rname}, {size};"] + [f"{rf} @ {o}," for (rf, _, _), (_, o, _) in zip(rfields, fields)], 96)
        rs_lines[-1] = rs_lines[-1].rstrip(",") + ");"
    if bad:
        print("params.rs and the kernels disagree:\n  " + "\n  ".join(bad))
        sys.exit(1)
    stale = []
    for path in KERNELS:
        src = open(path).read()
        new = re.sub(r"^(?:SIZE_IS|FIELD_AT)\(.*\n", "", src, flags=re.M)
        for cname, lines in c_lines.items():
            if cs[cname][0] != path:
                continue
            m = re.search(r"^struct " + cname + r" \{\n.*?^\};\n", new, re.S | re.M)
            new = new[: m.end()] + "\n".join(lines) + "\n" + new[m.end():]
        if new != src:
            stale.append(path)
            if not check:
                open(path, "w").write(new)
    rs_lines = [l if l.startswith("layout!") else "    " + l for l in rs_lines]
    block = MARK + """
// Each params struct's size and field offsets, the numbers the kernels assert for the same
// fields: a field moved, resized, added or dropped on one side only fails the build.
macro_rules! layout {
    ($t:ty, $size:expr; $($f:ident @ $off:expr),+ $(,)?) => {
        const _: () = {
            assert!(std::mem::size_of::<$t>() == $size);
            $(assert!(std::mem::offset_of!($t, $f) == $off);)+
        };
    };
}
""" + "\n".join(rs_lines) + "\n"
    new_rs = rs.split(MARK)[0].rstrip("\n") + "\n\n" + block
    if new_rs != rs:
        stale.append(PARAMS)
        if not check:
            open(PARAMS, "w").write(new_rs)
    print(("stale: " if check else "wrote: ") + (", ".join(os.path.relpath(p) for p in stale) or "nothing"))
    sys.exit(1 if check and stale else 0)


main()
