"""The tracker and auto_batch in a plain accelerate loop (accelerate from PyPI), on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed for this Python")

import oomkit  # noqa: E402
from models import MLP  # noqa: E402


def data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randn(n, 10, generator=g))


def test_the_tracker_works_on_an_accelerate_loop_as_it_is(tmp_path):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = MLP(64, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data(), batch_size=4))
    # The prepared optimizer is accelerate's wrapper, handed over as it is.
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path) as tracker:
        for i, (x, y) in enumerate(loader):
            with accelerator.accumulate(model), tracker.step(i):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
    stages = {}
    for r in map(json.loads, Path(tracker.log_path).read_text().splitlines()):
        if r["type"] == "stage":
            stages.setdefault(r["step"], []).append(r["name"])
    # accelerate steps the inner optimizer only at the end of each accumulation window.
    assert stages == {i: ["forward", "backward"] + (["optimizer"] if i % 2 else []) for i in range(8)}
    a = oomkit.analyze(tracker.log_path)
    assert a["components"]["optimizer_state_bytes"] >= 2 * a["components"]["params_bytes"]
    assert not any(w["kind"] == "tracker_errors" for w in a["warnings"])


def test_auto_batch_frees_accelerate_and_sets_its_accumulation():
    accelerator = accelerate.Accelerator(cpu=True)
    tries = []

    @oomkit.auto_batch(batch_size=16, effective_batch=32, accelerator=accelerator)
    def train(micro: int, accum: int) -> int:
        # What accelerate still holds from an earlier try, and the accumulation it will use.
        tries.append((micro, accum, accelerator.gradient_accumulation_steps, len(accelerator._models)))
        model = MLP(64, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, loader = accelerator.prepare(model, opt, DataLoader(data(), batch_size=micro))
        steps = 0
        for x, y in loader:
            with accelerator.accumulate(model):
                if len(x) > 4:
                    torch.empty(1 << 62, dtype=torch.uint8)  # a real allocator failure
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                steps += int(accelerator.sync_gradients)
        return steps

    assert train() == 32 // 32
    assert tries == [(16, 2, 2, 0), (8, 4, 4, 0), (4, 8, 8, 0)]
    assert train.plan == (4, 8)
