"""Time per training step of the small transformer with and without oomkit.Tracker.

Runs both loops in one process, alternating blocks so that drift of the
machine hits both alike, and reports the median step time of each, the
overhead, and the tracker's own memory (Python allocations, traced) over a
long run. Usage: python scripts/bench_tracker.py [--steps N] [--long N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
import oomkit  # noqa: E402
from models import TinyTransformer  # noqa: E402


def step(model, opt, batch):
    model.loss(batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--long", type=int, default=10_000)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 512, (8, 65))
    for _ in range(10):
        step(model, opt, batch)
    logs = tempfile.mkdtemp(prefix="oomkit-bench-")
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=logs)
    plain, tracked = [], []
    per = args.steps // args.blocks
    i = 0
    for _ in range(args.blocks):
        for _ in range(per):
            t = time.perf_counter()
            step(model, opt, batch)
            plain.append(time.perf_counter() - t)
        for _ in range(per):
            t = time.perf_counter()
            with tracker.step(i):
                step(model, opt, batch)
            tracked.append(time.perf_counter() - t)
            i += 1
    a, b = statistics.median(plain), statistics.median(tracked)
    print(f"torch {torch.__version__}, CPU, 1 thread, {len(plain)} steps each")
    print(f"without tracker: {a * 1e3:.3f} ms/step (median)")
    print(f"with tracker:    {b * 1e3:.3f} ms/step (median)")
    print(f"overhead:        {100 * (b - a) / a:+.2f}%")

    # The tracker's own memory over a long run: tiny steps, so that only the
    # tracker's bookkeeping is measured.
    small = torch.nn.Linear(8, 8)
    sopt = torch.optim.SGD(small.parameters(), lr=0.1)
    t2 = oomkit.Tracker(small, optimizer=sopt, log_dir=logs, check_duplicates=False)
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
