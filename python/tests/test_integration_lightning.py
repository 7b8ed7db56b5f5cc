"""oomkit's callback in real Lightning runs (lightning from PyPI, both namespaces), on CPU."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning", reason="lightning is not installed for this Python (it needs Python 3.10 or newer)")

import oomkit
from lightning_trainer import build
from runlog import logs_in_start_order, records, run_isolated, stages_by_step

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")
NAMESPACES = {
    "lightning.pytorch": "oomkit.integrations.lightning",
    "pytorch_lightning": "oomkit.integrations.pytorch_lightning",
}


def callback(namespace, **kw):
    return importlib.import_module(NAMESPACES[namespace]).OomkitCallback(**kw)


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
@pytest.mark.parametrize("accum", [1, 2])
def test_every_optimizer_step_has_its_stages_in_order(tmp_path, namespace, accum):
    cb = callback(namespace)
    trainer, model, data = build(namespace, str(tmp_path), accum=accum, steps=3, callbacks=[cb])
    trainer.fit(model, datamodule=data)
    log = cb.log_path
    per_step = ["forward", "backward"] * accum + ["optimizer"]
    assert stages_by_step(log) == {0: per_step, 1: per_step, 2: per_step}
    a = oomkit.analyze(log)
    assert a["steps"] == 3
    c = a["components"]
    assert 2 * c["trainable_bytes"] <= c["optimizer_state_bytes"] <= 2 * c["trainable_bytes"] + 4096
    assert (a["plan"]["micro_batch"], a["plan"]["grad_accum"]) == (8, accum)
    assert not any(w["kind"] in ("tracker_errors", "not_closed") for w in a["warnings"]), a["warnings"]


def test_stages_are_right_when_training_step_calls_self(tmp_path):
    # Then the module's forward hooks fire too; they must not add stages.
    cb = callback("lightning.pytorch")
    trainer, model, data = build("lightning.pytorch", str(tmp_path), accum=2, steps=2, callbacks=[cb], call_self=True)
    trainer.fit(model, datamodule=data)
    per_step = ["forward", "backward", "forward", "backward", "optimizer"]
    assert stages_by_step(cb.log_path) == {0: per_step, 1: per_step}


def test_validation_is_an_eval_phase(tmp_path):
    cb = callback("lightning.pytorch")
    trainer, model, data = build("lightning.pytorch", str(tmp_path), steps=4, val_every=2, callbacks=[cb])
    trainer.fit(model, datamodule=data)
    names = [p["name"] for p in records(cb.log_path, "phase")]
    assert names == ["sanity_check", "eval", "eval"]
    assert sum(len(v) for v in stages_by_step(cb.log_path).values()) == 4 * 3


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_real_oom_is_captured_and_reraised(tmp_path, where, capfd):
    cb = callback("lightning.pytorch")
    trainer, model, data = build(
        "lightning.pytorch", str(tmp_path), steps=4, callbacks=[cb], oom_at_batch=2, oom_in_backward=(where == "backward")
    )
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        trainer.fit(model, datamodule=data)
    [oom] = records(cb.log_path, "oom")
    assert (oom["step"], oom["stage"], oom["requested_bytes"]) == (2, where, 1 << 62)
    a = oomkit.analyze(cb.log_path)
    assert a["findings"][0]["kind"] == "oom"
    assert not any(w["kind"] == "not_closed" for w in a["warnings"])
    assert "out of memory, diagnosis" in capfd.readouterr().err


def test_the_plan_of_oomkit_run_is_applied_before_the_loaders_are_built(tmp_path, monkeypatch):
    monkeypatch.setenv("OOMKIT_MICRO_BATCH", "4")
    monkeypatch.setenv("OOMKIT_GRAD_ACCUM", "4")
    monkeypatch.setenv("OOMKIT_ATTEMPT", "2")
    cb = callback("lightning.pytorch")
    trainer, model, data = build("lightning.pytorch", str(tmp_path), batch=16, accum=1, steps=1, callbacks=[cb])
    trainer.fit(model, datamodule=data)
    assert model.seen_batches == [4, 4, 4, 4] and trainer.accumulate_grad_batches == 4
    [plan] = records(cb.log_path, "plan")
    assert (plan["micro_batch"], plan["grad_accum"], plan["attempt"]) == (4, 4, 2)


def test_the_entry_point_adds_the_callback_only_under_oomkit_run(tmp_path, monkeypatch):
    import lightning.pytorch as L
    from oomkit.integrations.lightning import OomkitCallback

    monkeypatch.delenv("OOMKIT_AUTO_CALLBACK", raising=False)
    assert not any(isinstance(c, OomkitCallback) for c in L.Trainer(logger=False).callbacks)
    monkeypatch.setenv("OOMKIT_AUTO_CALLBACK", "1")
    added = [c for c in L.Trainer(logger=False).callbacks if isinstance(c, OomkitCallback)]
    assert len(added) == 1 and added[0].automatic
    # With the user's own callback present, the added one stands aside.
    mine = OomkitCallback()
    trainer, model, data = build("lightning.pytorch", str(tmp_path), steps=1, callbacks=[mine])
    auto = [c for c in trainer.callbacks if isinstance(c, OomkitCallback) and c.automatic]
    assert len(auto) == 1
    trainer.fit(model, datamodule=data)
    assert mine.log_path is not None and auto[0].log_path is None
    assert len(list((tmp_path / "oomkit-logs").glob("run-*.jsonl"))) == 1


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_oomkit_run_steps_a_lightning_run_down_with_no_code(tmp_path, namespace):
    summary = tmp_path / "summary.json"
    cmd = [
        OOMKIT, "run", "--gpus", "0", "--batch-size", "8", "--effective-batch", "32",
        "--summary-json", str(summary), "--",
        sys.executable, os.path.join(EXAMPLES, "lightning_trainer.py"), "--namespace", namespace,
        "--root", str(tmp_path), "--oom-above", "4", "--steps", "2", "--val-every", "0",
    ]
    p = run_isolated(cmd, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(summary.read_text())
    # One step down is the whole path (docs/tracker.md's example takes two, from 16).
    assert [(a["batch_size"], a["grad_accum"], a["oom"]) for a in s["attempts"]] == [(8, 4, True), (4, 8, False)]
    assert "trained with micro-batch 4 x accumulation 8" in p.stdout
    assert NAMESPACES[namespace] + ".OomkitCallback" in p.stdout
    logs = logs_in_start_order(tmp_path / "oomkit-logs")
    assert len(logs) == 2
    first, last = oomkit.analyze(logs[0]), oomkit.analyze(logs[-1])
    assert first["ooms"][0]["stage"] == "forward"
    assert (last["plan"]["micro_batch"], last["plan"]["grad_accum"], last["plan"]["attempt"]) == (4, 8, 2)
    assert last["steps"] == 2 and not last["ooms"]


def test_the_example_script_with_the_callback_reads_accumulation_and_validation(tmp_path):
    # examples/lightning_trainer.py --oomkit, then oomkit analyze on its log (docs/tracker.md runs the quickstart).
    p = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "lightning_trainer.py"), "--root", "runs/pl", "--oomkit"],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    [log] = (tmp_path / "runs/pl/oomkit-logs").glob("run-*.jsonl")
    out = subprocess.run([OOMKIT, "analyze", str(log.relative_to(tmp_path))], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "6 steps" in out.stdout and "[eval]" in out.stdout and "[sanity_check]" in out.stdout
    analysis = oomkit.analyze(log)
    counts = {s["name"]: s["count"] for s in analysis["stages"]}
    assert (counts["forward"], counts["backward"], counts["optimizer"]) == (12, 12, 6)
    # A clean run: nothing to report (scripts/gpu_validate.py's planted section asks the same on a GPU).
    assert analysis["findings"] == [], analysis["findings"]
