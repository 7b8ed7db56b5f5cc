#!/usr/bin/env python3
"""Make the screenshots of `oomkit report` that docs/commands.md shows, in headless Chromium.

    python3 scripts/screenshots.py [--oomkit BINARY] [--out DIR]

It reports on the bundled demo snapshot, and on two ranks' run logs
recorded here by oomkit.Tracker on CPU (rank 1 runs out of memory), and
writes report-demo.png and report-ranks.png into DIR: target/screenshots
unless told otherwise, so that the committed images are replaced only on
purpose (`--out docs/img`). BINARY defaults to target/release/oomkit.
"""
import argparse
import base64
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
from chromium import Chromium, Page, find_chromium  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--oomkit", default=os.path.join(ROOT, "target", "release", "oomkit"), help="the oomkit binary")
ap.add_argument("--out", default=os.path.join(ROOT, "target", "screenshots"),
                help="where the images go (docs/img replaces the committed ones)")
args = ap.parse_args()
oomkit = args.oomkit
out_dir = os.path.abspath(args.out)
os.makedirs(out_dir, exist_ok=True)
work = tempfile.mkdtemp()

RUN = r"""
import os, sys, torch, oomkit
from torch import nn
rank, oom_at, width = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
os.environ["RANK"] = str(rank)
torch.manual_seed(rank)
model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))
opt = torch.optim.AdamW(model.parameters())
kept = []
with oomkit.Tracker(model, optimizer=opt, log_dir=sys.argv[4], console=False) as tracker:
    for i in range(30):
        try:
            with tracker.step(i):
                if i == oom_at:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")
                loss = model(torch.randn(256, width)).pow(2).mean()
                loss.backward()
                opt.step(); opt.zero_grad(set_to_none=True)
                # A validation loss kept with its autograd graph: a leak.
                kept.append(model(torch.randn(1024, width)).pow(2).mean())
        except torch.OutOfMemoryError:
            break
        if i % 10 == 9:
            with tracker.phase("eval"), torch.no_grad():
                model(torch.randn(1024, width))
print(tracker.log_path)
"""


def run_log(rank, oom_at, width):
    r = subprocess.run([sys.executable, "-c", RUN, str(rank), str(oom_at), str(width), work],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip().splitlines()[-1]


def report(name, *inputs):
    path = os.path.join(work, name + ".html")
    subprocess.run([oomkit, "report", *inputs, "-o", path], check=True)
    return path


demo = os.path.join(work, "demo.pickle")
subprocess.run([oomkit, "demo", "--save", demo], check=True, stdout=subprocess.DEVNULL)
pages = {
    "report-demo": report("demo", demo),
    "report-ranks": report("ranks", run_log(0, -1, 512), run_log(1, 24, 768)),
}
browser = Chromium(find_chromium())
try:
    for name, html in pages.items():
        page = Page(browser)
        page.open(html)
        page.wait_for("window.oomkitReport && window.oomkitReport.ready")
        assert page.console_errors() == [], page.console_errors()
        data = page.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(os.path.join(out_dir, name + ".png"), "wb") as f:
            f.write(base64.b64decode(data))
        print(f"wrote {os.path.join(out_dir, name + '.png')}")
        page.close()
finally:
    browser.close()
