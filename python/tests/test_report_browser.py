"""`oomkit report` pages, loaded in real headless Chromium.

Each report must load with no console error and no request leaving the
file, draw a chart that is not blank, and show the peak and every OOM as
markers. A screenshot of each is kept in target/test-artifacts/.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import oomkit
import pytest
import torch
from chromium import Chromium, Page, find_chromium
from models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")
FIXTURES = os.path.join(ROOT, "..", "shared", "fixtures", "snapshots")
ARTIFACTS = os.environ.get("OOMKIT_TEST_ARTIFACTS", os.path.join(ROOT, "target", "test-artifacts"))

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("OOMKIT_REQUIRE_BROWSER"),
    reason="Chromium is not installed (scripts/test.sh installs Debian's chromium)",
)

# The share of each chart canvas painted in the first series' blue (its
# line and the fill under it), read from the canvas itself: axes, grid and
# labels alone do not count, so a chart without data reads as blank.
CANVAS_INK = """
(() => Array.from(document.querySelectorAll('.uplot canvas')).map(c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let ink = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 0 && d[i + 2] > 200 && d[i + 2] - d[i] > 20) ink++;
  }
  return ink / (c.width * c.height);
}))()
"""


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("OOMKIT_REQUIRE_BROWSER is set but Chromium is not installed")
    b = Chromium(CHROMIUM)
    yield b
    b.close()


def oomkit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([OOMKIT, *args], capture_output=True, text=True)


def make_report(out_dir, name: str, *inputs: str, extra: tuple = ()) -> str:
    out = os.path.join(str(out_dir), name + ".html")
    r = oomkit_cli("report", *inputs, "-o", out, *extra)
    assert r.returncode == 0, r.stderr
    return out


def analysis(path: str) -> dict:
    r = oomkit_cli("analyze", "--json", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def load(browser, html: str, name: str) -> tuple[Page, dict]:
    """Opens a report, checks what every report must satisfy, and keeps a screenshot."""
    page = Page(browser)
    start = time.monotonic()
    page.open(html)
    page.wait_for("window.oomkitReport && window.oomkitReport.ready", timeout=120)
    elapsed = time.monotonic() - start
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(os.path.join(ARTIFACTS, name + ".png"))
    assert page.console_errors() == []
    assert page.evaluate("window.oomkitReport.errors") == []
    leaving = [u for u in page.requests() if not u.startswith(("file:", "data:", "about:"))]
    assert leaving == [], "the report must make no network request"
    info = page.evaluate(
        "({markers: window.oomkitReport.markers,"
        " charts: window.oomkitReport.charts.map(c => ({kind: c.kind, points: c.points, device: c.device})),"
        " title: document.title})"
    )
    info["ink"] = page.evaluate(CANVAS_INK)
    info["seconds"] = elapsed
    return page, info


def kinds(info: dict, kind: str) -> list[dict]:
    return [m for m in info["markers"] if m["kind"] == kind]


def demo_snapshot(tmp_path) -> str:
    path = str(tmp_path / "demo.pickle")
    r = oomkit_cli("demo", "--save", path)
    assert r.returncode == 0, r.stderr
    return path


def test_demo_report_draws_its_timeline_peak_and_oom(browser, tmp_path):
    snap = demo_snapshot(tmp_path)
    page, info = load(browser, make_report(tmp_path, "demo", snap), "demo")
    a = analysis(snap)
    dev = a["devices"][0]
    assert [c["kind"] for c in info["charts"]] == ["timeline"]
    assert info["ink"][0] > 0.01, "the chart canvas is blank"
    (peak,) = kinds(info, "peak")
    assert peak["x"] == dev["peak_event_index"] + 1
    assert [m["x"] - 1 for m in kinds(info, "oom")] == [o["event_index"] for o in dev["ooms"]]
    assert len(dev["ooms"]) == 1
    assert {m["text"] for m in kinds(info, "phase")} >= {"eval"}
    # The site table lists what the analysis found, largest first.
    first_site = page.evaluate("document.querySelector('td.site').textContent")
    assert first_site == dev["top_sites"][0]["label"]
    # Hovering the peak shows its entry and its site.
    tip = page.evaluate(
        "(() => { const c = window.oomkitReport.charts[0].plot;"
        f" const i = c.valToIdx({peak['x']}); c.setCursor({{left: c.valToPos(c.data[0][i], 'x'), top: 50}});"
        " return document.querySelector('.tip').textContent; })()"
    )
    assert f"entry {dev['peak_event_index']}" in tip
    # Zooming in through the buttons narrows the x range.
    span = page.evaluate(
        "(async () => { const u = window.oomkitReport.charts[0].plot; const a = u.scales.x.max - u.scales.x.min;"
        " document.querySelector('.chart-tools button').click();"
        " await new Promise(r => requestAnimationFrame(r)); return [a, u.scales.x.max - u.scales.x.min]; })()"
    )
    assert span[1] < span[0]
    page.close()


def fixture_files() -> list[str]:
    if not os.path.isdir(FIXTURES):
        return []
    return sorted(f for f in os.listdir(FIXTURES) if f.endswith((".pickle", ".pkl")))


def _human_bytes(n: int) -> str:
    """oomkit's terminal units (crates/oomkit-units human_bytes): Python's formatting rounds exact ties to even, as Rust's does."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    v, i = float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    if i == 0:
        return f"{n} B"
    return f"{v:.0f} {units[i]}" if v >= 100 else f"{v:.1f} {units[i]}" if v >= 10 else f"{v:.2f} {units[i]}"


def test_the_page_writes_sizes_as_the_terminal_does(browser, tmp_path):
    page, _ = load(browser, make_report(tmp_path, "demo", demo_snapshot(tmp_path)), "demo")
    ties = [int(134.5 * 2**20), int(12.25 * 2**30), int(0.125 * 2**40) * 8, 1536, int(99.5 * 2**10)]
    values = ties + [0, 1, 1023, 1024, 10**9, 141_033_471, 141_033_473, 2**50 + 12345]
    shown = page.evaluate(f"{json.dumps(values)}.map(n => window.oomkitReport.bytes(n))")
    assert shown == [_human_bytes(n) for n in values]


@pytest.mark.skipif(not fixture_files(), reason="../shared/fixtures/snapshots is absent")
@pytest.mark.parametrize("name", fixture_files() or ["none"])
def test_every_real_snapshot_gives_a_working_report(browser, tmp_path, name):
    path = os.path.join(FIXTURES, name)
    stem = "fixture-" + os.path.splitext(name)[0]
    page, info = load(browser, make_report(tmp_path, stem, path), stem)
    a = analysis(path)
    traced = [d for d in a["devices"] if d["events"] > 0]
    assert [c["device"] for c in info["charts"]] == [d["device"] for d in traced]
    for dev in a["devices"]:
        peaks = [m for m in kinds(info, "peak") if m["device"] == dev["device"]]
        assert len(peaks) == 1
        ooms = [m for m in kinds(info, "oom") if m["device"] == dev["device"]]
        assert len(ooms) == len(dev["ooms"])
    for dev, ink in zip(traced, info["ink"]):
        if dev["peak_active_bytes"] > 0:
            assert ink > 0.002, f"cuda:{dev['device']}: the chart canvas is blank"
    page.close()


# For each timeline: the role bands' labels, and the points where the top
# band (every role stacked) differs from the active bytes.
ROLE_BANDS = """
window.oomkitReport.charts.filter(c => c.kind === 'timeline').map(c => {
  const labels = c.plot.series.map(s => s.label);
  const active = c.plot.data[labels.indexOf('active')];
  const top = c.plot.data[1];
  let off = 0;
  for (let i = 0; i < active.length; i++) if (Math.abs(top[i] - active[i]) > 0.5) off++;
  return {labels: labels, off: off, peakTop: Math.max(...top)};
})
"""


def check_role_bands(page, dev: dict) -> list[str]:
    """The chart stacks the roles the analysis found, and they add up to the active bytes at every point."""
    (chart,) = page.evaluate(ROLE_BANDS)
    roles = [k.replace("_", " ") for k, v in dev["roles"]["peak"].items() if v > 0]
    assert set(roles) <= set(chart["labels"]), chart["labels"]
    assert chart["off"] == 0, f"{chart['off']} points where the roles do not add up to active"
    assert chart["peakTop"] == dev["peak_active_bytes"]
    return chart["labels"]


def test_the_timeline_is_stacked_by_role(browser, tmp_path):
    snap = demo_snapshot(tmp_path)
    page, _ = load(browser, make_report(tmp_path, "roles", snap), "roles")
    dev = analysis(snap)["devices"][0]
    labels = check_role_bands(page, dev)
    assert labels[-4:] == ["active", "reserved", "reserved, replayed", "reserved with expandable_segments:True, replayed"]
    text = page.evaluate("document.body.innerText")
    assert "Live at the peak, by role" in text
    # The tooltip of an allocation names its role.
    page.evaluate("(() => { const c = window.oomkitReport.charts[0]; c.plot.setCursor({left: c.plot.over.clientWidth * 0.9, top: 50}); })()")
    tip = page.evaluate("document.querySelector('.tip').innerText")
    assert "role: " in tip or "before the first entry" in tip, tip
    page.close()


def test_million_event_report_is_small_and_loads(browser, tmp_path):
    snap = demo_snapshot(tmp_path)
    big = str(tmp_path / "big.pickle")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_big_snapshot.py"), snap, big,
                    "--events", "1000000"], check=True, capture_output=True)
    html = make_report(tmp_path, "million", big)
    size = os.path.getsize(html)
    assert size < 5 << 20, f"{size} bytes"
    page, info = load(browser, html, "million-events")
    a = analysis(big)
    dev = a["devices"][0]
    assert dev["events"] >= 1_000_000
    (chart,) = info["charts"]
    assert chart["points"] <= 50_001
    assert info["ink"][0] > 0.01
    (peak,) = kinds(info, "peak")
    assert peak["x"] == dev["peak_event_index"] + 1
    assert len(kinds(info, "oom")) == len(dev["ooms"]) > 0
    # A thinned timeline carries each role's changes: the bands still add up.
    check_role_bands(page, dev)
    print(f"\n1M-event report: {size / 2**20:.2f} MiB, ready in {info['seconds']:.2f} s")
    page.close()


def test_hostile_frame_names_stay_text(browser, tmp_path):
    evil = "</script><script>window.pwned=1</script><img src=x onerror=window.pwned=2>"
    frames = [{"filename": "/home/me/train.py", "line": 7, "name": evil}]
    snap = {
        "segments": [{
            "device": 0, "address": 1 << 30, "total_size": 2 << 20, "allocated_size": 1 << 20,
            "active_size": 1 << 20, "requested_size": 1 << 20, "stream": 0, "segment_type": "large",
            "blocks": [
                {"address": 1 << 30, "size": 1 << 20, "requested_size": 1 << 20,
                 "state": "active_allocated", "frames": frames},
                {"address": (1 << 30) + (1 << 20), "size": 1 << 20, "requested_size": 0, "state": "inactive"},
            ],
        }],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0, "frames": frames, "time_us": 1},
            {"action": "alloc", "addr": 1 << 30, "size": 1 << 20, "stream": 0, "frames": frames, "time_us": 2},
        ]],
    }
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    page, _ = load(browser, make_report(tmp_path, "evil", str(path)), "hostile-names")
    assert page.evaluate("window.pwned === undefined")
    assert evil in page.evaluate("document.querySelector('td.site').textContent")
    page.close()


def run_log(tmp_path, monkeypatch, rank: int, steps: int, oom_at: int | None, width: int) -> str:
    monkeypatch.setenv("RANK", str(rank))
    model = MLP(width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path / f"rank{rank}", console=False)
    msg = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free."
    for i in range(steps):
        if i == oom_at:
            model.head.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(torch.OutOfMemoryError(msg)))
            with pytest.raises(torch.OutOfMemoryError), tracker.step(i):
                model(torch.randn(8, width)).sum().backward()
            break
        with tracker.step(i):
            model(torch.randn(8, width)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i % 3 == 2:
            with tracker.phase("eval"), torch.no_grad():
                model(torch.randn(16, width))
    tracker.close()
    return tracker.log_path


def test_run_logs_of_two_ranks_side_by_side(browser, tmp_path, monkeypatch):
    r0 = run_log(tmp_path, monkeypatch, 0, steps=8, oom_at=None, width=64)
    r1 = run_log(tmp_path, monkeypatch, 1, steps=8, oom_at=5, width=64)
    page, info = load(browser, make_report(tmp_path, "ranks", r0, r1), "run-logs-two-ranks")
    assert [c["kind"] for c in info["charts"]] == ["steps", "steps"]
    assert all(ink > 0.005 for ink in info["ink"])
    assert len(kinds(info, "oom")) == 1 and len(kinds(info, "peak")) == 2
    table = page.evaluate("document.querySelector('table').innerText")
    assert "failed first" in table
    page.close()


TWO_DEVICES = """
import pickle, sys
def trace(n, oom):
    ev = [{'action': 'alloc', 'addr': (1 << 30) + i * (64 << 20), 'size': 64 << 20, 'time_us': 1000 + i,
           'frames': [{'filename': 'models.py', 'line': 120, 'name': 'forward'}]} for i in range(n)]
    if oom:
        ev.append({'action': 'oom', 'addr': 32 << 20, 'size': 1 << 30, 'time_us': 2000,
                   'frames': [{'filename': 'models.py', 'line': 181, 'name': 'update_nodes'}]})
    return ev
pickle.dump({'segments': [], 'device_traces': [trace(400, False), trace(600, True)]}, open(sys.argv[1], 'wb'), protocol=4)
"""


def test_the_page_opens_on_the_failure(browser, tmp_path):
    path = str(tmp_path / "dp.pickle")
    subprocess.run([sys.executable, "-c", TWO_DEVICES, path], check=True)
    page, info = load(browser, make_report(tmp_path, "dp", path), "verdict-banner")
    banner = page.evaluate("document.getElementById('verdict').textContent")
    assert "OUT OF MEMORY on cuda:1" in banner and "models.py:181 update_nodes" in banner, banner
    # The words come first on the page, not thousands of characters in.
    assert page.evaluate("document.body.innerText.indexOf('OUT OF MEMORY')") < 300
    # The failing device's timeline is drawn first, zoomed to its OOM.
    assert [c["device"] for c in info["charts"]] == [1, 0]
    span = page.evaluate("(() => { const u = window.oomkitReport.charts[0].plot; return [u.scales.x.min, u.scales.x.max]; })()")
    oom_x = page.evaluate("window.oomkitReport.charts[0].zoomed")
    assert span[0] <= oom_x <= span[1] and span[1] - span[0] < 600
    # Every link of the banner leads to a part of the page.
    targets = page.evaluate("[...document.querySelectorAll('#verdict a')].map(a => a.getAttribute('href').slice(1))")
    assert len(targets) == 3
    assert page.evaluate(f"{json.dumps(targets)}.every(id => document.getElementById(id) !== null)")
    page.close()


def test_a_long_run_log_opens_on_its_oom(browser, tmp_path):
    lines = [{"type": "start", "version": 1, "rank": 0, "world_size": 1, "device": "cuda:0", "capacity_bytes": 80 << 30, "time": 100}]
    for s in range(300):
        lines.append({"type": "step", "step": s, "start_bytes": 1 << 30, "end_bytes": 1 << 30, "peak_bytes": (40 << 30) + s})
    lines.append({"type": "oom", "time": 110, "step": 240, "stage": "backward", "requested_bytes": 4 << 30,
                  "message": "CUDA out of memory. Tried to allocate 4.00 GiB",
                  "memory": {"allocated_bytes": 72 << 30, "reserved_bytes": 74 << 30, "capacity_bytes": 80 << 30}})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    page, _ = load(browser, make_report(tmp_path, "long-run", str(path)), "long-run")
    assert "OUT OF MEMORY on rank 0 (cuda:0) in backward of step 240" in page.evaluate("document.getElementById('verdict').textContent")
    lo, hi = page.evaluate("(() => { const u = window.oomkitReport.charts[0].plot; return [u.scales.x.min, u.scales.x.max]; })()")
    assert lo <= 240 <= hi and hi - lo < 100
    page.close()
