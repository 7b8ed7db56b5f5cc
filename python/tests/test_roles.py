"""Memory by role from the installed `oomkit analyze --json`, checked against figures CPython's pickle gives for the same file."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "..", "shared", "fixtures", "snapshots")
ROLES = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "other", "unknown"]


OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")


def analyze(path: str) -> dict:
    out = subprocess.run([OOMKIT, "analyze", "--json", path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def demo(tmp_path) -> str:
    path = str(tmp_path / "demo.pickle")
    subprocess.run([OOMKIT, "demo", "--save", path], check=True, capture_output=True)
    return path


def test_analyze_gives_the_roles_adding_up_to_the_peak(tmp_path):
    a = analyze(demo(tmp_path))
    (dev,) = a["devices"]
    assert sorted(dev["roles"]["peak"]) == sorted(ROLES)
    assert sum(dev["roles"]["peak"].values()) == dev["peak_active_bytes"]
    assert sum(dev["roles"]["end"].values()) == dev["active_bytes"]
    (oom,) = dev["ooms"]
    assert sum(oom["roles"].values()) == oom["live_bytes"]
    assert a["verdict"]["role"] == "activations"


def kind(e) -> str:
    """The kind docs/roles.md gives an allocation by its frames, for the frames this file has."""
    names = [fr["name"] for fr in e["frames"]]
    files = [fr["filename"] for fr in e["frames"] if fr["filename"].endswith(".py")]
    if any("AccumulateGrad" in n for n in names):
        return "gradient"
    if any("optim" in f.rsplit("/", 1)[-1] or "/optim/" in f for f in files):
        return "optimizer"
    if any("torch::autograd::Engine::" in n or ("torch::autograd::" in n and "Backward" in n and "VariableType" not in n)
           for n in names):
        return "backward"
    return "forward" if files else "bare"


@pytest.mark.skipif(not os.path.isdir(FIXTURES), reason="../shared/fixtures/snapshots is absent")
def test_gradients_and_parameters_match_an_independent_count():
    """The CS336 medium training step, worked from the pickle by the rules of docs/roles.md: the
    gradients are AccumulateGrad's allocations and the backward results that outlive their pass
    (the pass lasts until other work allocates); at the end, the blocks from before recording of
    each gradient's requested size are parameters, up to the most gradients of that size alive
    at once; all in the blocks' own sizes."""
    path = os.path.join(FIXTURES, "lm_medium_ctx128_training.pickle")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    allocs = [i for i, e in enumerate(trace) if e["action"] == "alloc"]
    kinds = {i: kind(trace[i]) for i in allocs}
    ends: dict[int, int] = {}
    open_: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            if e["addr"] in open_:
                ends[open_[e["addr"]]] = i
            open_[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in open_:
            ends[open_.pop(e["addr"])] = i
    never = len(trace)

    def pass_end(a: int) -> int:
        nxt = next((j for j in allocs if j > a and kinds[j] in ("forward", "optimizer")), never)
        return max(j for j in allocs if j < nxt and kinds[j] in ("backward", "gradient"))

    grads = [a for a in allocs if kinds[a] == "gradient"
             or (kinds[a] == "backward" and ends.get(a, never) > pass_end(a))]
    # The most gradients of each size alive at once.
    changes = sorted([(a, 1, trace[a]["size"]) for a in grads]
                     + [(ends[a], 0, trace[a]["size"]) for a in grads if a in ends])
    live: dict[int, int] = {}
    most: dict[int, int] = {}
    for _, start, size in changes:
        live[size] = live.get(size, 0) + (1 if start else -1)
        most[size] = max(most.get(size, 0), live[size])
    blocks = {b["address"]: b for s in snap["segments"] for b in s["blocks"] if b["state"].startswith("active")}
    want_grads = sum(blocks[trace[a]["addr"]]["size"] for a in grads if a not in ends)
    before = [b for addr, b in blocks.items() if addr not in open_]
    want_params = 0
    for size, n in most.items():
        want_params += sum([b["size"] for b in before if b["requested_size"] == size][:n])

    end = analyze(path)["devices"][0]["roles"]["end"]
    assert end["gradients"] == want_grads
    assert end["parameters"] == want_params
    # The medium model's 423,183,360 fp32 parameters, to the allocator's rounding.
    assert abs(want_params - 423_183_360 * 4) < 0.01 * want_params
