"""Time per training step of the small transformer with and without oomkit.Tracker.

Runs both loops in one process, alternating blocks so that drift of the
machine hits both alike, and reports the median step time of each, the
overhead, the tracker's fixed cost per step (the same comparison on a
model so small that the step is almost all fixed cost), and the tracker's
own memory (Python allocations, traced) over a long run.
Usage: python scripts/bench_tracker.py [--steps N] [--long N] [--tracker-from FILE]
(--tracker-from loads the Tracker class from another tracker.py, such as
an older version written out with `git show REV:python/oomkit/tracker.py`.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
import oomkit
from models import TinyTransformer


def step_tiny(model, opt, x):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step(model, opt, batch):
    model.loss(batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def alternate(blocks: int, per: int, plain_step, tracked_step) -> tuple:
    """Median seconds of a plain and a tracked step, timed in alternating blocks."""
    plain, tracked = [], []
    i = 0
    for _ in range(blocks):
        for _ in range(per):
            t = time.perf_counter()
            plain_step()
            plain.append(time.perf_counter() - t)
        for _ in range(per):
            t = time.perf_counter()
            tracked_step(i)
            tracked.append(time.perf_counter() - t)
            i += 1
    return statistics.median(plain), statistics.median(tracked), len(plain)


def tracker_class(path):
    if path is None:
        return oomkit.Tracker
    spec = importlib.util.spec_from_file_location("tracker_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Tracker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--long", type=int, default=10_000)
    ap.add_argument("--tiny-steps", type=int, default=4000)
    ap.add_argument("--tracker-from", default=None)
    args = ap.parse_args()
    Tracker = tracker_class(args.tracker_from)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 512, (8, 65))
    for _ in range(10):
        step(model, opt, batch)
    logs = tempfile.mkdtemp(prefix="oomkit-bench-")
    tracker = Tracker(model, optimizer=opt, log_dir=logs)

    def tracked(i):
        with tracker.step(i):
            step(model, opt, batch)

    a, b, n = alternate(args.blocks, args.steps // args.blocks, lambda: step(model, opt, batch), tracked)
    print(f"torch {torch.__version__}, CPU, 1 thread, {n} steps each")
    print(f"without tracker: {a * 1e3:.3f} ms/step (median)")
    print(f"with tracker:    {b * 1e3:.3f} ms/step (median)")
    print(f"overhead:        {100 * (b - a) / a:+.2f}%")

    # The fixed cost: a step of a model this small is almost nothing, so the
    # difference is what the tracker adds to every step whatever its size.
    tiny = torch.nn.Linear(8, 8)
    topt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    tx = torch.randn(2, 8)
    for _ in range(200):
        step_tiny(tiny, topt, tx)
    t1 = Tracker(tiny, optimizer=topt, log_dir=logs, check_duplicates=False)

    def tiny_tracked(i):
        with t1.step(i):
            step_tiny(tiny, topt, tx)

    a, b, n = alternate(args.blocks * 2, args.tiny_steps // (args.blocks * 2), lambda: step_tiny(tiny, topt, tx), tiny_tracked)
    print(f"fixed cost:      {(b - a) * 1e6:.0f} us/step (a tiny model: {a * 1e6:.0f} us without, {b * 1e6:.0f} us with; {n} steps each)")
    t1.close()

    # The tracker's own memory over a long run: tiny steps, so that only the
    # tracker's bookkeeping is measured.
    small = torch.nn.Linear(8, 8)
    sopt = torch.optim.SGD(small.parameters(), lr=0.1)
    t2 = Tracker(small, optimizer=sopt, log_dir=logs, check_duplicates=False)
    x = torch.randn(2, 8)
    # Count only allocations made by oomkit's own code (any frame in the
    # package); torch's own allocations are not the tracker's to answer for.
    only_oomkit = [tracemalloc.Filter(True, "*/oomkit/*", all_frames=True)]
    tracemalloc.start(25)
    marks = []
    for j in range(args.long):
        with t2.step(j):
            small(x).sum().backward()
            sopt.step()
            sopt.zero_grad(set_to_none=True)
        if j in (args.long // 10, args.long - 1):
            snap = tracemalloc.take_snapshot().filter_traces(only_oomkit)
            marks.append(sum(st.size for st in snap.statistics("filename")))
    tracemalloc.stop()
    print(
        f"memory held by oomkit's code over {args.long} steps: {marks[0] / 1024:.1f} KiB at step "
        f"{args.long // 10}, {marks[1] / 1024:.1f} KiB at step {args.long - 1}"
    )
    t2.close()
    tracker.close()


if __name__ == "__main__":
    main()
