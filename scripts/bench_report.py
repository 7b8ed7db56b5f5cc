#!/usr/bin/env python3
"""Benchmark `oomkit report` against PyTorch's own page for a snapshot.

    python3 scripts/bench_report.py SNAPSHOT [--runs N] [--oomkit target/release/oomkit]

Side by side on the same file, in one run: the wall time to write the page
and its size, for `oomkit report` and for `python -m torch.cuda._memory_viz
trace_plot` (which embeds the whole snapshot and draws it with
MemoryViz.js, fetched from the network when the page opens). Where
Chromium is installed, it also times how long oomkit's page takes to be
drawn (until window.oomkitReport.ready), median of N loads.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))

ap = argparse.ArgumentParser()
ap.add_argument("snapshot")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--oomkit", default=os.path.join(ROOT, "target", "release", "oomkit"))
args = ap.parse_args()
work = tempfile.mkdtemp()


def timed(cmd):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


ours = os.path.join(work, "oomkit.html")
t_ours = statistics.median(timed([args.oomkit, "report", args.snapshot, "-o", ours, "--force"]) for _ in range(args.runs))
theirs = os.path.join(work, "torch.html")
t_theirs = statistics.median(
    timed([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", args.snapshot, "-o", theirs])
    for _ in range(args.runs))
mib = lambda p: os.path.getsize(p) / 2**20  # noqa: E731
print(f"snapshot: {args.snapshot} ({os.path.getsize(args.snapshot) / 2**20:.1f} MiB)")
print(f"{'':28} {'write (s)':>10} {'page (MiB)':>11}")
print(f"{'oomkit report':28} {t_ours:10.2f} {mib(ours):11.2f}")
print(f"{'_memory_viz trace_plot':28} {t_theirs:10.2f} {mib(theirs):11.2f}")
print(f"ratio: oomkit writes the page {t_theirs / t_ours:.1f}x faster, {mib(theirs) / mib(ours):.1f}x smaller")

try:
    from chromium import Chromium, Page, find_chromium
except ImportError:
    find_chromium = lambda: None  # noqa: E731
binary = find_chromium()
if binary:
    b = Chromium(binary)
    loads = []
    try:
        for _ in range(args.runs):
            page = Page(b)
            t = time.perf_counter()
            page.open(ours)
            page.wait_for("window.oomkitReport && window.oomkitReport.ready", timeout=300)
            loads.append(time.perf_counter() - t)
            assert page.console_errors() == []
            page.close()
    finally:
        b.close()
    print(f"oomkit page drawn in Chromium (headless): {statistics.median(loads):.2f} s (median of {len(loads)})")
