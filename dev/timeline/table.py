#!/usr/bin/env python3
"""The launch timeline of a `q4moe bench --json-out` record as one row per kernel.

A build with q4moe-cuda's cargo feature `timeline` (crates/cuda/src/timeline.rs; the probe
perturbs what it measures, so compare marks between probe builds only) writes the timeline as profile
entries "timeline <kernel> <what>", µs a call: lead, pass, in, x, mid, end, release, step,
spread. This prints them side by side, in the layer's launch order, so a launch's step reads as
its parts: the pass skew, the input's first value (in), the input staged (x), the midpoint
(mid), the last store (end), and the next launch's release after it.

    table.py RECORD.json [RECORD.json ...]
"""
import json
import sys

ORDER = ["embed", "qkv", "attn_gqa", "o_proj", "moe_gate_up", "moe_down", "head"]
COLUMNS = ["lead", "pass", "in", "x", "mid", "end", "release", "step", "spread"]


def rows(record):
    """{kernel: {what: µs}} from a record's timeline entries."""
    out = {}
    for e in record.get("kernel_profile", []):
        parts = e["name"].split(" ")
        if len(parts) == 3 and parts[0] == "timeline":
            out.setdefault(parts[1], {})[parts[2]] = e["us_per_call"]
    return out


def table(record):
    t = rows(record)
    names = [n for n in ORDER if n in t] + sorted(n for n in t if n not in ORDER)
    variant = (record.get("variants") or [{}])[0]
    tok_s = variant.get("decode_tok_s", {}).get("median")
    lines = [f"{record.get('model', '?')}: {tok_s:.1f} tok/s (probe build)" if tok_s else "timeline"]
    lines.append("%-12s" % "us" + "".join("%8s" % c for c in COLUMNS))
    for n in names:
        cells = ("%8.2f" % t[n][c] if c in t[n] else "%8s" % "-" for c in COLUMNS)
        lines.append("%-12s" % n + "".join(cells))
    return "\n".join(lines)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        with open(path) as f:
            print(table(json.load(f)))


if __name__ == "__main__":
    main()
