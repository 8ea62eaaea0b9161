#!/usr/bin/env python3
"""Picks the winner of a `gpu-check.sh variants` A/B from its summary, so one device call can
time a candidate against the base and then run the benchmark of record on the winner:
    python3 scripts/ab-pick.py $OUT/summary.txt <candidate> <base>
prints the candidate's name when, for every quant timed, its slowest median beats the base's
fastest (the rounds alternate the builds); otherwise the base's name."""
import re, sys
from collections import defaultdict

summary, cand, base = sys.argv[1:4]
runs = defaultdict(list)
pat = re.compile(r"^variant (\S+)(?: round \d+)? (\S+) fused=0: .*median ([0-9.]+) tok/s")
for line in open(summary):
    m = pat.match(line.strip())
    if m:
        runs[(m[1], m[2])].append(float(m[3]))
quants = {q for (v, q) in runs if v == cand} & {q for (v, q) in runs if v == base}
win = bool(quants) and all(min(runs[(cand, q)]) > max(runs[(base, q)]) for q in quants)
for q in sorted(quants):
    print(f"{q}: {cand} {runs[(cand, q)]} vs {base} {runs[(base, q)]}", file=sys.stderr)
print(cand if win else base)
