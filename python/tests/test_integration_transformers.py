"""oomkit's callback in a real Hugging Face Trainer (transformers and accelerate from PyPI), on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed for this Python (it needs Python 3.10 or newer)"
)
pytest.importorskip("accelerate", reason="accelerate is not installed for this Python")

import oomkit  # noqa: E402
from hf_trainer import build  # noqa: E402
from oomkit.integrations.transformers import OomkitCallback, train  # noqa: E402
from runlog import logs_in_start_order, records, run_isolated, stages_by_step  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")


def callback_of(trainer):
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, OomkitCallback))


@pytest.mark.parametrize("accum", [1, 2])
def test_every_optimizer_step_has_its_stages_in_order(tmp_path, accum):
    trainer = build(str(tmp_path), batch=4, accum=accum, steps=3)
    trainer.train()
    cb = callback_of(trainer)
    per_step = ["forward", "backward"] * accum + ["optimizer"]
    assert stages_by_step(cb.tracker.log_path) == {0: per_step, 1: per_step, 2: per_step}
    a = oomkit.analyze(cb.tracker.log_path)
    assert a["steps"] == 3
    # The optimizer is accelerate's wrapper; its AdamW state is counted.
    c = a["components"]
    assert 2 * c["trainable_bytes"] <= c["optimizer_state_bytes"] <= 2 * c["trainable_bytes"] + 4096
    assert a["plan"]["micro_batch"] == 4 and a["plan"]["grad_accum"] == accum
    assert a["plan"]["source"] == "training arguments"
    assert not any(w["kind"] in ("tracker_errors", "not_closed") for w in a["warnings"]), a["warnings"]


def test_evaluation_is_an_eval_phase(tmp_path):
    trainer = build(str(tmp_path), steps=4, eval_steps=2)
    trainer.train()
    log = callback_of(trainer).tracker.log_path
    phases = records(log, "phase")
    assert [(p["name"], p["step"]) for p in phases] == [("eval", None), ("eval", None)]
    # No stage is recorded while evaluating, though the forward hooks fire.
    assert sum(len(v) for v in stages_by_step(log).values()) == 4 * 3
    stages = {(s["kind"], s["name"]) for s in oomkit.analyze(log)["stages"]}
    assert ("phase", "eval") in stages


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_real_oom_is_captured_and_reraised(tmp_path, where, capfd):
    trainer = build(str(tmp_path), steps=4, oom_at_step=2, oom_in_backward=(where == "backward"))
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        train(trainer)
    log = callback_of(trainer).tracker.log_path
    [oom] = records(log, "oom")
    assert (oom["step"], oom["stage"]) == (2, where)
    assert oom["requested_bytes"] == 1 << 62
    assert "oom" in [f["kind"] for f in oomkit.analyze(log)["findings"]]
    assert "out of memory, diagnosis" in capfd.readouterr().err


def test_an_oom_that_ends_the_script_is_captured_without_the_wrapper(tmp_path):
    # trainer.train() alone: the callback's excepthook records it as Python exits.
    script = tmp_path / "run.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {EXAMPLES!r})\n"
        "from hf_trainer import build\n"
        "from oomkit.integrations.transformers import OomkitCallback\n"
        f"trainer = build({str(tmp_path)!r}, steps=4, oom_at_step=1, oom_in_backward=True)\n"
        "cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OomkitCallback))\n"
        "try:\n"
        "    trainer.train()\n"
        "finally:\n"
        "    print('log:', cb.tracker.log_path, flush=True)\n"
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    assert "DefaultCPUAllocator" in p.stderr and "out of memory, diagnosis" in p.stderr
    log = p.stdout.split("log:")[-1].strip()
    [oom] = records(log, "oom")
    assert (oom["step"], oom["stage"]) == (1, "backward")
    a = oomkit.analyze(log)
    assert not any(w["kind"] == "not_closed" for w in a["warnings"])


def test_auto_find_batch_size_retries_are_logged_with_their_batch(tmp_path):
    trainer = build(str(tmp_path), batch=8, accum=2, steps=2, oom_above=5)
    trainer.args.auto_find_batch_size = True
    trainer.train()
    log = callback_of(trainer).tracker.log_path
    plans = records(log, "plan")
    # accelerate tries 8, then 7 (x0.9) and 6, then 5 fits; accumulation stays 2.
    assert [p["micro_batch"] for p in plans] == [8, 7, 6, 5]
    assert {p["grad_accum"] for p in plans} == {2}
    assert [p["source"] for p in plans[1:]] == ["auto_find_batch_size"] * 3
    # The forward OOMs that accelerate swallowed were recorded where they happened.
    ooms = records(log, "oom")
    assert len(ooms) == 3 and all(o["stage"] == "forward" for o in ooms)
    assert oomkit.analyze(log)["plan"]["micro_batch"] == 5


def test_the_plan_of_oomkit_run_is_applied_without_editing_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("OOMKIT_MICRO_BATCH", "2")
    monkeypatch.setenv("OOMKIT_GRAD_ACCUM", "4")
    monkeypatch.setenv("OOMKIT_EFFECTIVE_BATCH", "8")
    monkeypatch.setenv("OOMKIT_ATTEMPT", "3")
    trainer = build(str(tmp_path), batch=8, accum=1, steps=1)
    assert trainer._train_batch_size == 2 and trainer.args.gradient_accumulation_steps == 4
    trainer.train()
    log = callback_of(trainer).tracker.log_path
    assert stages_by_step(log) == {0: ["forward", "backward"] * 4 + ["optimizer"]}
    [plan] = records(log, "plan")
    assert (plan["micro_batch"], plan["grad_accum"], plan["attempt"], plan["source"]) == (2, 4, 3, "oomkit run")
    text = subprocess.run([OOMKIT, "analyze", log], capture_output=True, text=True).stdout
    assert "plan: micro-batch 2 x accumulation 4 = 8 samples per optimizer step, from oomkit run (attempt 3)" in text


def test_oomkit_run_steps_a_trainer_down_and_keeps_the_effective_batch(tmp_path):
    out = tmp_path / "out"
    summary = tmp_path / "summary.json"
    cmd = [
        OOMKIT, "run", "--gpus", "0", "--batch-size", "8", "--effective-batch", "32",
        "--summary-json", str(summary), "--",
        sys.executable, os.path.join(EXAMPLES, "hf_trainer.py"), "--out", str(out), "--oom-above", "4", "--steps", "2",
        "--eval-steps", "0",
    ]
    p = run_isolated(cmd, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(summary.read_text())
    # One step down is the whole path (docs/tracker.md's example takes two, from 16).
    assert [(a["batch_size"], a["grad_accum"], a["oom"]) for a in s["attempts"]] == [(8, 4, True), (4, 8, False)]
    assert "trained with micro-batch 4 x accumulation 8" in p.stdout
    assert "oomkit run attempt 2: training with micro-batch 4 x accumulation 8 (the script asked for 8 x 2)" in p.stderr
    logs = logs_in_start_order(out / "oomkit-logs")
    assert len(logs) == 2
    last = oomkit.analyze(logs[-1])
    assert last["plan"]["effective_batch"] == 32 and last["steps"] == 2
    first = oomkit.analyze(logs[0])
    assert first["ooms"] and first["ooms"][0]["stage"] == "forward"


def test_train_applies_the_plan_when_the_callback_came_after_the_trainer(tmp_path, monkeypatch):
    # trainer.add_callback(...) after Trainer(...): on_init_end never reaches the callback.
    trainer = build(str(tmp_path), batch=8, accum=1, steps=1, callback=transformers.TrainerCallback())
    cb = OomkitCallback()
    trainer.add_callback(cb)
    monkeypatch.setenv("OOMKIT_MICRO_BATCH", "4")
    monkeypatch.setenv("OOMKIT_GRAD_ACCUM", "2")
    train(trainer)
    assert trainer._train_batch_size == 4 and trainer.args.gradient_accumulation_steps == 2
    [plan] = records(cb.log_path, "plan")
    assert (plan["micro_batch"], plan["grad_accum"], plan["source"]) == (4, 2, "oomkit run")
