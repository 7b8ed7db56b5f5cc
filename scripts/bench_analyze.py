#!/usr/bin/env python3
"""Time `oomkit analyze` beside what a user would otherwise run, on one file.

For each tool it runs the command --runs times, the tools taking turns in
balanced orders, and reports the median wall time and the largest peak
resident set size (from wait4), then the ratios.

    python3 scripts/bench_analyze.py bench-data/big.pickle --oomkit target/release/oomkit

With --baseline OTHER_OOMKIT it also times another build of oomkit side by
side (before and after a change); --oomkit-only leaves the Python tools out.
With --whatif it also times `oomkit whatif FILE --capacity 1TiB` (the trace
replayed twice: as recorded, and the scenario) on the machine's cores and
on one core (taskset), beside `oomkit analyze` on one core.
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
ap.add_argument("--runs", type=int, default=8)
ap.add_argument("--pause", type=float, default=2.0, help="idle seconds before each round")
ap.add_argument("--baseline", help="another oomkit binary to time beside --oomkit (before a change)")
ap.add_argument("--oomkit-only", action="store_true", help="time only the oomkit builds")
ap.add_argument("--whatif", action="store_true", help="also time oomkit whatif, on all cores and on one")
args = ap.parse_args()

py = sys.executable
tools = [
    ("oomkit analyze", [args.oomkit, "analyze", args.file]),
    ("oomkit analyze --json", [args.oomkit, "analyze", "--json", args.file]),
    ("pickle.load", [py, "-c", f"import pickle; pickle.load(open({args.file!r}, 'rb'))"]),
]
if args.baseline:
    tools[2:2] = [
        ("baseline analyze", [args.baseline, "analyze", args.file]),
        ("baseline analyze --json", [args.baseline, "analyze", "--json", args.file]),
    ]
if args.oomkit_only:
    tools = [t for t in tools if "analyze" in t[0]]
if args.whatif:
    one = ["taskset", "-c", "0"]
    tools += [
        ("oomkit analyze, one core", one + [args.oomkit, "analyze", args.file]),
        ("oomkit whatif (2 replays)", [args.oomkit, "whatif", args.file, "--capacity", "1TiB"]),
        ("oomkit whatif (2 replays), one core", one + [args.oomkit, "whatif", args.file, "--capacity", "1TiB"]),
    ]
# Never import torch here: a child's peak RSS on Linux starts from its
# parent's high-water mark, so a heavy parent would inflate every figure.
if args.oomkit_only:
    pass
elif importlib.util.find_spec("torch") is not None:
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


def balanced_orders(n):
    """Orders of n tools in which each tool runs right after each other tool
    equally often (a Williams design: for odd n, the rows and their reverses)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


size = os.path.getsize(args.file)
print(f"file: {args.file}, {size / 2**20:.1f} MiB")
results = {}
# One untimed run of each tool first, then the tools in turn, round after
# round: this machine's speed drifts by tens of percent over minutes, and
# interleaving makes every tool see the same drift.
for _, cmd in tools:
    run(cmd)
runs = {name: [] for name, _ in tools}
# A run right after a tool that kept the CPU busy for seconds is slower on
# this machine, so the order within a round follows a balanced design: over
# each block of rounds every tool runs right after every other tool once.
# Each round starts after a pause, so its first tool follows an idle machine,
# which each tool also does once per block.
orders = balanced_orders(len(tools))
if args.runs % len(orders):
    print(f"--runs {args.runs} is not a multiple of {len(orders)}: the orders are not balanced", file=sys.stderr)
for r in range(args.runs):
    time.sleep(args.pause)
    for i in orders[r % len(orders)]:
        name, cmd = tools[i]
        runs[name].append(run(cmd))
for name, rs in runs.items():
    results[name] = (statistics.median(w for w, _ in rs), max(r for _, r in rs))
base_wall, base_rss = results["oomkit analyze"]
print(f"| tool | wall (median of {args.runs}) | peak RSS | RSS / file | time vs oomkit |")
print("|---|---|---|---|---|")
for name, (wall, rss) in results.items():
    print(f"| {name} | {wall:.3f} s | {rss / 2**20:.0f} MiB | {rss / size:.2f} | {wall / base_wall:.2f}x |")
