#!/usr/bin/env python3
"""Time `oomkit analyze` beside what a user would otherwise run, on one file.

For each tool it runs the command --runs times, the tools taking turns, and
reports the median wall time and the largest peak resident set size (from
wait4), then the ratios.

    python3 scripts/bench_analyze.py bench-data/big.pickle --oomkit target/release/oomkit
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("file")
ap.add_argument("--oomkit", default="target/release/oomkit")
ap.add_argument("--runs", type=int, default=3)
args = ap.parse_args()

py = sys.executable
tools = [
    ("oomkit analyze", [args.oomkit, "analyze", args.file]),
    ("oomkit analyze --json", [args.oomkit, "analyze", "--json", args.file]),
    ("pickle.load", [py, "-c", f"import pickle; pickle.load(open({args.file!r}, 'rb'))"]),
]
# Never import torch here: a child's peak RSS on Linux starts from its
# parent's high-water mark, so a heavy parent would inflate every figure.
if importlib.util.find_spec("torch") is not None:
    tools.append(("torch.cuda._memory_viz stats", [py, "-m", "torch.cuda._memory_viz", "stats", args.file]))
else:
    print("torch is not installed: skipping torch.cuda._memory_viz", file=sys.stderr)


def run(cmd):
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed")
    return wall, usage.ru_maxrss * 1024


size = os.path.getsize(args.file)
print(f"file: {args.file}, {size / 2**20:.1f} MiB")
results = {}
# One untimed run of each tool first, then the tools in turn, round after
# round: this machine's speed drifts by tens of percent over minutes, and
# interleaving makes every tool see the same drift.
for _, cmd in tools:
    run(cmd)
runs = {name: [] for name, _ in tools}
# Each round starts one tool later than the last, so that every tool
# follows every other equally often: a run right after a tool that freed a
# gigabyte is slower here, while the kernel hands that memory back.
for r in range(args.runs):
    for name, cmd in tools[r % len(tools):] + tools[:r % len(tools)]:
        runs[name].append(run(cmd))
for name, rs in runs.items():
    results[name] = (statistics.median(w for w, _ in rs), max(r for _, r in rs))
base_wall, base_rss = results["oomkit analyze"]
print(f"| tool | wall (median of {args.runs}) | peak RSS | RSS / file | time vs oomkit |")
print("|---|---|---|---|---|")
for name, (wall, rss) in results.items():
    print(f"| {name} | {wall:.3f} s | {rss / 2**20:.0f} MiB | {rss / size:.2f} | {wall / base_wall:.1f}x |")
