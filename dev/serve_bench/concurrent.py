#!/usr/bin/env python3
"""Issue 54's CPU serving target: N concurrent greedy requests against one, over HTTP, through a
release `q4moe serve` (continuous batching, and `--max-batch 1` as the one-at-a-time baseline).

    cargo build --release -p q4moe
    python3 dev/serve_bench/concurrent.py [--geometry mid] [--tokens 64] [--runs 5] [--streams 4]

Writes bench/results/serve-batch-<date>.json: per mode, the wall time of one request and of
`streams` requests sent together (each greedy, `tokens` tokens past EOS, distinct prompts so no
KV is reused), median/min/max over `runs` after one warm-up, and their ratio.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.join(ROOT, "target", "release", "q4moe")
PROMPT = "The history of the mixture of experts architecture begins with a simple idea:"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    assert out["usage"]["completion_tokens"] > 0, out
    return out


def cpu_seconds(pid):
    """User + system CPU time of a process so far (steadier than wall time on a shared box)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wall(port, n, tokens, tag, pid=None):
    """Seconds for n requests sent at once, each with its own first word, and the server's CPU
    seconds over them (with `pid`)."""
    errors = []

    def one(i):
        body = {"prompt": f"{tag}{i} {PROMPT}", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        try:
            post(port, body)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    c0 = cpu_seconds(pid) if pid else 0.0
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return elapsed, (cpu_seconds(pid) - c0 if pid else 0.0)


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def serve(model, max_batch, port, threads):
    args = [BIN, "serve", "-m", model, "--port", str(port), "--device", "cpu",
            "--max-batch", str(max_batch)]
    env = dict(os.environ)
    if threads:
        env["RAYON_NUM_THREADS"] = str(threads)
    log = f"{model}.{max_batch}.log"
    with open(log, "w") as err:
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err, env=env)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            with open(log) as f:
                return p, f.read().strip()
        except OSError:
            time.sleep(0.2)
    p.kill()
    with open(log) as f:
        raise RuntimeError("the server did not come up: " + f.read())


def measure(model, max_batch, a):
    port = free_port()
    p, startup = serve(model, max_batch, port, a.threads)
    try:
        wall(port, a.streams, a.tokens, "warm")
        ones, manys = [], []
        for r in range(a.runs):
            ones.append(wall(port, 1, a.tokens, f"one{r}-", p.pid))
            manys.append(wall(port, a.streams, a.tokens, f"many{r}-", p.pid))
    finally:
        p.terminate()
        p.wait()
    n = a.streams
    rec = {"max_batch": max_batch, "server_log": startup}
    for k, what in ((0, "wall"), (1, "cpu")):
        one, many = [x[k] for x in ones], [x[k] for x in manys]
        rec[f"{what}_one_s"] = summary(one)
        rec[f"{what}_{n}_s"] = summary(many)
        rec[f"{what}_ratio"] = summary([m / o for m, o in zip(many, one) if o > 0])
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="mid")
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--threads", type=int, help="RAYON_NUM_THREADS for the server")
    ap.add_argument("--out")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, f"{a.geometry}.gguf")
        subprocess.run([BIN, "synth", "--geometry", a.geometry, "--quant", a.quant, "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
        modes = [measure(model, 16, a), measure(model, 1, a)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    rec = {
        "bench": "dev/serve_bench/concurrent.py",
        "date": date,
        "commit": commit,
        "machine": f"{os.cpu_count()}-core CPU (shared with other jobs)",
        "conditions": {"device": "cpu", "geometry": a.geometry, "quant": f"{a.quant} (synthetic)",
                       "tokens": a.tokens, "greedy": True, "ignore_eos": True,
                       "streams": a.streams, "runs": a.runs, "prompt": PROMPT,
                       "rayon_threads": a.threads or "default",
                       "what": "wall seconds (and the server process's CPU seconds) of 1 "
                               "request and of `streams` sent together; ratio = many / one per "
                               "run (target: wall ratio < 2)"},
        "modes": modes,
    }
    out = a.out or os.path.join(ROOT, "bench", "results", f"serve-batch-cpu-{date}.json")
    with open(out, "w") as f:
        json.dump(rec, f, indent=2)
    for m in modes:
        for what in ("wall", "cpu"):
            r = m[f"{what}_ratio"]
            print(f"max_batch {m['max_batch']} {what}: one {m[f'{what}_one_s']['median']:.2f}s, "
                  f"{a.streams} {m[f'{what}_{a.streams}_s']['median']:.2f}s, "
                  f"ratio {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
    print("wrote", out, file=sys.stderr)


if __name__ == "__main__":
    main()
