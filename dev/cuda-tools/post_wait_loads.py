#!/usr/bin/env python3
"""Flags global loads a kernel issues after a shuffle chain on its path after pdl_wait.

Why: a launch's time in the step is its dependent chain after griddepcontrol.wait (ACQBULK in
SASS). A load issued there only after a shuffle has waited for an earlier load adds a second
round trip to that chain; session 44 measured such orders at -1.5 to -6% (docs/performance.md).
For each function and each ACQBULK, this walks the instructions in address order up to the
first BAR.SYNC or EXIT (branches are not followed: both sides of a branch are read in turn,
so a flag in code a launch does not take at run time is possible) and counts the global loads
(LDG, LDGSTS) before and after the first SHFL. Usage:

    post_wait_loads.py --cuobjdump <cuobjdump> KERNELS.cubin [NAME_REGEX]

Prints one line a wait: function, loads before the first shuffle, loads after it; `late`
marks the waits with loads after it.
"""
import argparse
import re
import subprocess
import sys

FUNC = re.compile(r"^\s+Function : (\S+)")
INSN = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def functions(sass):
    """(name, [instruction text]) for each function of cuobjdump -sass's output."""
    name, body = None, []
    for line in sass.splitlines():
        m = FUNC.match(line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
            continue
        m = INSN.match(line)
        if m and name:
            body.append(m.group(1))
    if name:
        yield name, body


def waits(body):
    """(loads before the first SHFL, loads after it) for each ACQBULK of a function's body."""
    for i, insn in enumerate(body):
        if "ACQBULK" not in insn:
            continue
        before, after, shuffled = 0, 0, False
        for op in body[i + 1:]:
            if "BAR.SYNC" in op or re.search(r"\bEXIT\b", op):
                break
            if "SHFL" in op:
                shuffled = True
            elif re.search(r"\bLDG(STS)?\.", op):
                if shuffled:
                    after += 1
                else:
                    before += 1
        yield before, after


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("cubin")
    ap.add_argument("names", nargs="?", default=".", help="regex the function names must match")
    a = ap.parse_args()
    sass = subprocess.run([a.cuobjdump, "-sass", a.cubin], check=True, capture_output=True, text=True).stdout
    want = re.compile(a.names)
    late = 0
    for name, body in sorted(functions(sass)):
        if not want.search(name):
            continue
        for k, (before, after) in enumerate(waits(body)):
            late += after > 0
            flag = "  late" if after else ""
            print(f"{name} wait {k}: {before} loads before the first shuffle, {after} after{flag}")
    print(f"{late} wait(s) with loads after their first shuffle", file=sys.stderr)


if __name__ == "__main__":
    main()
