"""The tracker on real models running real training steps (CPU), as the installed package."""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import ClassVar

import oomkit
import pytest
import torch
from models import MLP, TinyTransformer
from oomkit.tracker import oom_capture

MIB = 1 << 20
# The console script installed beside this interpreter.
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")


def kinds(analysis):
    return [f["kind"] for f in analysis["findings"]]


def mlp_loop(tmp_path, steps=40, keep="val.item()"):
    """Trains a 4-layer MLP under a tracker in a Python of its own, and returns its run log's path.

    On CPU the tracker's meter is the process's resident set. A pytest worker
    that already ran hundreds of tests serves new tensors from heap its earlier
    tests freed, so growth that is real does not show there; a training script
    is a process of its own, and so is this loop. ``keep`` is the expression
    each step keeps of its validation loss.
    """
    script = textwrap.dedent(
        f"""
        import sys, torch, oomkit
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from models import MLP
        torch.manual_seed(0)
        model = MLP(1024, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        history = []
        with oomkit.Tracker(model, optimizer=opt, log_dir={str(tmp_path)!r}) as tracker:
            for i in range({steps}):
                with tracker.step(i):
                    loss = model(torch.randn(128, 1024)).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    # A validation loss computed with autograd on.
                    val = model(torch.randn(128, 1024)).square().mean()
                    history.append({keep})
        print(tracker.log_path)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def test_keeping_losses_with_their_graph_is_a_leak(tmp_path):
    a = oomkit.analyze(mlp_loop(tmp_path, keep="val"))
    assert a["kind"] == "run" and a["steps"] == 40
    leak = next(f for f in a["findings"] if f["kind"] == "leak")
    # Each kept loss holds its graph: 4 layers x (linear input + GELU input)
    # of 128x1024 fp32 = 4 MiB, plus the head's input.
    assert leak["bytes_per_step"] > 2 * MIB, leak
    assert a["leak"]["confidence"] > 0.8


def test_a_clean_loop_has_no_leak_and_no_duplicate(tmp_path):
    a = oomkit.analyze(mlp_loop(tmp_path))
    assert "leak" not in kinds(a), a["findings"]
    assert "duplicate_copy" not in kinds(a), a["findings"]
    names = {(s["kind"], s["name"]): s["count"] for s in a["stages"]}
    assert names[("stage", "forward")] == 80  # training and validation forwards
    assert names[("stage", "backward")] == 40
    assert names[("stage", "optimizer")] == 40
    assert names[("step", "step")] == 40
    c = a["components"]
    assert c["params_bytes"] == sum(p.numel() * 4 for p in MLP(1024, 4).parameters())
    # AdamW keeps two moments per parameter and a step count per tensor.
    assert 2 * c["params_bytes"] <= c["optimizer_state_bytes"] <= 2 * c["params_bytes"] + 4096


def test_fp32_model_kept_beside_bf16_copy_is_a_duplicate(tmp_path):
    model32 = MLP(512, 3)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    expected = sum(p.numel() * 4 for p in model32.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path) as tracker:
        for i in range(3):
            with tracker.step(i):
                model(torch.randn(8, 512, dtype=torch.bfloat16)).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        found = tracker.find_duplicates()
    assert found["bytes"] == expected
    [group] = found["groups"]
    assert group["dtype"] == "torch.float32" and group["device"] == "cpu"
    a = oomkit.analyze(tracker.log_path)
    dup = next(f for f in a["findings"] if f["kind"] == "duplicate_copy")
    assert dup["bytes"] == expected
    del model32


def test_nan_gradients_are_reported(tmp_path):
    torch.manual_seed(0)
    model = MLP(64, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path, grad_every=1) as tracker:
        for i in range(4):
            with tracker.step(i):
                x = torch.randn(16, 64)
                if i == 2:
                    x[0, 0] = float("nan")
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    a = oomkit.analyze(tracker.log_path)
    f = next(f for f in a["findings"] if f["kind"] == "grad_nonfinite")
    assert f["step"] == 2
    assert a["grad_nonfinite_checks"] >= 1


def test_transformer_stages_and_components(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path, grad_every=2) as tracker:
        for i in range(6):
            with tracker.step(i):
                model.loss(torch.randint(0, 512, (8, 65))).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if i % 3 == 0:
                with tracker.phase("eval"), torch.no_grad():
                    model.loss(torch.randint(0, 512, (8, 65)))
    a = oomkit.analyze(tracker.log_path)
    stages = {(s["kind"], s["name"]): s for s in a["stages"]}
    assert stages[("stage", "backward")]["count"] == 6
    assert stages[("phase", "eval")]["count"] == 2
    by_module = {m["name"]: m for m in a["components"]["by_module"]}
    assert set(by_module) == {"embed", "blocks", "norm", "lm_head"}
    grads = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"grad"' in line]
    assert [g["step"] for g in grads] == [0, 2, 4]
    assert all(g["total_norm"] > 0 and g["nan_params"] == 0 for g in grads)


def test_oom_inside_a_step_is_recorded_diagnosed_and_reraised(tmp_path, capfd):
    model = MLP(64, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path)
    with tracker.step(0):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    msg = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
        "of which 1.12 GiB is free."
    )

    def fail(module, args, output):
        raise torch.OutOfMemoryError(msg)

    # The allocation fails inside the model's forward, as a real one would.
    model.head.register_forward_hook(fail)
    with pytest.raises(torch.OutOfMemoryError), tracker.step(1):
        model(torch.randn(4, 64)).sum().backward()
    tracker.close()
    records = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines()]
    types = [r["type"] for r in records]
    assert types[0] == "start" and types[-1] == "end"
    oom = next(r for r in records if r["type"] == "oom")
    assert oom["step"] == 1 and oom["requested_bytes"] == 2 << 30
    assert oom["stage"] == "forward"
    assert any(r["type"] == "duplicates" and r["when"] == "oom" for r in records)
    assert any(r["type"] == "step" and r["step"] == 1 for r in records)
    err = capfd.readouterr().err
    assert "out of memory" in err and "[oom]" in err
    a = oomkit.analyze(tracker.log_path)
    assert kinds(a)[0] == "oom"


def test_an_oom_is_handed_to_oomkit_run_through_its_file(tmp_path, monkeypatch):
    oom_file = tmp_path / "ooms.jsonl"
    monkeypatch.setenv("OOMKIT_EVENTS_FILE", str(oom_file))
    model = MLP(64, 2)
    tracker = oomkit.Tracker(model, log_dir=tmp_path / "logs")
    msg = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
        "of which 1.12 GiB is free.\nSee the documentation for Memory Management"
    )
    with pytest.raises(RuntimeError), tracker.step(0):
        try:
            raise torch.OutOfMemoryError(msg)
        except torch.OutOfMemoryError as e:
            # A framework wraps it; the tracker still hands on the OOM's own first line.
            raise RuntimeError("training failed") from e
    tracker.close()
    lines = [json.loads(line) for line in oom_file.read_text().splitlines()]
    # The log's path comes first, so that `oomkit run` can close a log the kernel killed.
    assert lines[0] == {"log": os.path.abspath(tracker.log_path), "rank": 0}
    assert lines[1:] == [{"message": msg.splitlines()[0], "step": 0, "stage": None}]


def test_tracker_failures_never_reach_the_training_loop(tmp_path, monkeypatch):
    model = MLP(64, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path) as tracker:
        def broken():
            raise RuntimeError("meter broke")

        monkeypatch.setattr(tracker._meter, "sample", broken)
        for i in range(3):
            with tracker.step(i):
                model(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    a = oomkit.analyze(tracker.log_path)
    assert any(w["kind"] == "tracker_errors" for w in a["warnings"])


def test_tracker_holds_no_tensors_and_works_under_no_grad(tmp_path):
    model = MLP(64, 2)
    ref = weakref.ref(model)
    tracker = oomkit.Tracker(model, log_dir=tmp_path)
    with torch.no_grad():
        for i in range(2):
            with tracker.step(i):
                model(torch.randn(4, 64))
    assert not any(isinstance(o, torch.Tensor) for o in gc.get_referents(*vars(tracker).values()))
    del model
    gc.collect()
    assert ref() is None
    tracker.close()
    a = oomkit.analyze(tracker.log_path)
    assert a["steps"] == 2


def test_log_survives_sigkill(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch, oomkit
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from models import MLP
        model = MLP(64, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = oomkit.Tracker(model, optimizer=opt, log_dir={str(tmp_path)!r})
        print(tracker.log_path, flush=True)
        for i in range(5):
            with tracker.step(i):
                model(torch.randn(4, 64)).sum().backward()
                opt.step()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL
    log = p.stdout.strip().splitlines()[-1]
    out = subprocess.run([OOMKIT, "analyze", "--json", log], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    assert a["steps"] == 5
    assert any(w["kind"] == "not_closed" for w in a["warnings"])


def test_import_starts_no_thread_and_no_cuda():
    code = (
        "import threading, torch; n = threading.active_count(); import oomkit; "
        "assert threading.active_count() == n; "
        "assert not torch.cuda.is_initialized(); print('ok')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr


def test_logs_are_never_overwritten_and_errors_are_typed(tmp_path):
    path = tmp_path / "x.jsonl"
    log = oomkit._native.RunLog(str(path))
    log.write({"type": "start", "device": "cpu"})
    log.close()
    with pytest.raises(oomkit.RunLogError):
        oomkit._native.RunLog(str(path))
    with pytest.raises(oomkit.RunLogError):
        log.write({"type": "step"})
    assert issubclass(oomkit.RunLogError, oomkit.OomkitError)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(oomkit.RunLogError, match="not an oomkit run log"):
        oomkit.analyze(bad)
    out = subprocess.run([OOMKIT, "analyze", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "bad.jsonl" in out.stderr


class ShadowEMA:
    """An EMA that holds shadow tensors in a dict, as many training scripts write it."""

    def __init__(self, model):
        self.decay = 0.99
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_ema_is_counted_and_not_a_duplicate(tmp_path):
    model = MLP(256, 2)
    ema_module = copy.deepcopy(model)
    shadow = ShadowEMA(model)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    for ema in (ema_module, shadow):
        with oomkit.Tracker(model, ema=ema, log_dir=tmp_path) as tracker, tracker.step(0):
            model(torch.randn(4, 256)).sum().backward()
        a = oomkit.analyze(tracker.log_path)
        assert a["components"]["ema_bytes"] == param_bytes
        assert a["components"]["ema_device"] == "cpu"
        # The EMA is tracked, so it is not reported as a stray copy; the other
        # EMA object of this test is, as it mirrors the model untracked.
        dup = [f for f in a["findings"] if f["kind"] == "duplicate_copy"]
        assert len(dup) == 1 and dup[0]["bytes"] == param_bytes


def test_one_log_per_rank_and_console_from_rank_zero(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, torch, oomkit
        model = torch.nn.Linear(4, 4)
        t = oomkit.Tracker(model, log_dir={str(tmp_path)!r}, record_history=True)
        t.close()
        print(t.log_path)
        """
    )
    paths = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        paths.append(p.stdout.strip())
        said = "record_history needs CUDA" in p.stderr
        assert said == (rank == 0), p.stderr
    assert paths[0].endswith("-rank0.jsonl") and paths[1].endswith("-rank1.jsonl")
    for rank, path in enumerate(paths):
        a = oomkit.analyze(path)
        assert a["rank"] == rank


def stage_sequence(log_path):
    """The (step, name) of every stage record, in order."""
    return [(r["step"], r["name"]) for r in map(json.loads, open(log_path)) if r["type"] == "stage"]


class Wrapper(torch.optim.Optimizer):
    """Wraps an optimizer without calling Optimizer.__init__, as accelerate's AcceleratedOptimizer does."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def test_a_wrapped_optimizer_is_unwrapped_and_its_state_counted(tmp_path):
    model = MLP(64, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = Wrapper(Wrapper(inner))
    # The wrapper has none of torch's hook tables: hooking it directly raises.
    with pytest.raises(AttributeError):
        wrapped.register_step_pre_hook(lambda *a: None)
    with oomkit.Tracker(model, optimizer=wrapped, log_dir=tmp_path) as tracker:
        assert tracker.optimizer is inner
        for i in range(2):
            with tracker.step(i):
                model(torch.randn(4, 64)).sum().backward()
                wrapped.step()
                wrapped.zero_grad()
    assert stage_sequence(tracker.log_path) == [(i, s) for i in range(2) for s in ("forward", "backward", "optimizer")]
    a = oomkit.analyze(tracker.log_path)
    assert a["components"]["optimizer_state_bytes"] >= 2 * a["components"]["params_bytes"]
    assert not any(w["kind"] == "tracker_errors" for w in a["warnings"])


def test_hooks_that_cannot_be_installed_are_logged_and_training_goes_on(tmp_path):
    class NoHooks:
        """An optimizer-like object torch cannot hook."""

        param_groups: ClassVar[list] = []

        def step(self):
            pass

    model = MLP(64, 2)
    with oomkit.Tracker(model, optimizer=NoHooks(), log_dir=tmp_path) as tracker, tracker.step(0):
        model(torch.randn(4, 64)).sum().backward()
    a = oomkit.analyze(tracker.log_path)
    assert any(w["kind"] == "tracker_errors" for w in a["warnings"]), a["warnings"]
    assert a["steps"] == 1


def test_begin_and_end_calls_mark_steps_stages_and_phases_without_hooks(tmp_path):
    model = MLP(64, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path, stage_hooks=False)
    for i in range(3):
        tracker.begin_step(i)
        for _ in range(2):  # two micro-batches
            tracker.begin_stage("forward")
            loss = model(torch.randn(4, 64)).sum()
            tracker.begin_stage("backward")
            loss.backward()
            tracker.end_stage()
        tracker.begin_stage("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.end_step()
    tracker.begin_phase("eval")
    with torch.no_grad():
        model(torch.randn(4, 64))
    tracker.end_phase()
    tracker.end_phase()  # nothing open: does nothing
    tracker.end_step()
    tracker.close()
    per_step = ["forward", "backward", "forward", "backward", "optimizer"]
    assert stage_sequence(tracker.log_path) == [(i, s) for i in range(3) for s in per_step]
    a = oomkit.analyze(tracker.log_path)
    counts = {(s["kind"], s["name"]): s["count"] for s in a["stages"]}
    assert counts[("step", "step")] == 3 and counts[("phase", "eval")] == 1
    assert not any(w["kind"] == "tracker_errors" for w in a["warnings"])


def test_an_oom_in_forward_is_recorded_even_when_the_caller_swallows_it(tmp_path):
    model = MLP(64, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path)

    def huge(module, args, output):
        # A real allocator failure inside the forward.
        torch.empty(1 << 62, dtype=torch.uint8)

    handle = model.head.register_forward_hook(huge)
    tracker.begin_step(0)
    try:
        model(torch.randn(4, 64))
    except RuntimeError as exc:  # a framework's retry loop would swallow it
        swallowed = exc
    handle.remove()
    tracker.end_step()
    # Raising it later (or again) does not record it twice.
    assert tracker.record_oom(swallowed) is True
    tracker.close()
    ooms = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert len(ooms) == 1
    assert ooms[0]["stage"] == "forward" and ooms[0]["step"] == 0
    assert ooms[0]["requested_bytes"] == 1 << 62


def test_an_oom_wrapped_by_a_framework_is_found_through_its_cause(tmp_path):
    model = MLP(64, 2)
    tracker = oomkit.Tracker(model, log_dir=tmp_path)
    try:
        try:
            torch.empty(1 << 62, dtype=torch.uint8)
        except RuntimeError as e:
            # The Hugging Face Trainer's evaluation wraps it like this.
            raise RuntimeError("Evaluation hit an out-of-memory error.") from e
    except RuntimeError as wrapped:
        outer = wrapped
    assert oomkit.is_oom(outer)
    assert not oomkit.is_oom(RuntimeError("Evaluation hit an error."))
    tracker.begin_phase("eval")
    assert tracker.record_oom(outer) is True
    assert tracker.record_oom(ValueError("not memory")) is False
    tracker.close()
    [oom] = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert oom["phase"] == "eval" and oom["requested_bytes"] == 1 << 62
    assert "DefaultCPUAllocator" in oom["message"]
    # accelerate's give-up is an OOM too, though no allocator message is chained to it.
    assert oomkit.is_oom(RuntimeError("No executable batch size found, reached zero."))


def test_an_oom_seen_by_the_allocator_observer_is_recorded_once(tmp_path):
    model = MLP(64, 2)
    tracker = oomkit.Tracker(model, log_dir=tmp_path)
    tracker._meter.index = 0  # as a tracker on cuda:0 is
    tracker.begin_step(5)
    tracker.begin_stage("backward")
    # What torch's CUDA allocator calls, with (device, alloc, device_limit, device_free).
    oom_capture.on_allocator_oom(tracker._core, 1, 1 << 30, 0, 0)  # another device: not ours
    oom_capture.on_allocator_oom(tracker._core, 0, 3 << 30, 70 << 30, 1 << 29)
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")
    assert tracker.record_oom(exc) is True
    tracker.close()
    [oom] = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert (oom["step"], oom["stage"], oom["requested_bytes"]) == (5, "backward", 3 << 30)


def test_an_oom_under_the_process_s_own_cap_is_told_as_such(tmp_path):
    # As on an H200 capped by set_per_process_memory_fraction(0.25): the
    # allocator's observer passes the cap as the limit, with 114 GiB free.
    gib = 1 << 30
    model = MLP(64, 2)
    tracker = oomkit.Tracker(model, log_dir=tmp_path)
    tracker._meter.index, tracker._meter.capacity = 0, 140 * gib
    tracker.begin_step(0)
    oom_capture.on_allocator_oom(tracker._core, 0, 12 * gib, 35 * gib, 114 * gib)
    tracker.close()
    [oom] = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert (oom["memory"]["allowed_bytes"], oom["memory"]["free_bytes"]) == (35 * gib, 114 * gib)
    assert oomkit.analyze(tracker.log_path)["ooms"][0]["cause"] == "memory_fraction_limit"
    # Without a cap, the limit the allocator passes is the device's own: no cap is recorded.
    tracker = oomkit.Tracker(model, log_dir=tmp_path / "uncapped")
    tracker._meter.index, tracker._meter.capacity = 0, 140 * gib
    tracker.begin_step(0)
    oom_capture.on_allocator_oom(tracker._core, 0, 12 * gib, 140 * gib, 1 * gib)
    tracker.close()
    assert oomkit.analyze(tracker.log_path)["ooms"][0]["cause"] == "capacity"
    # From PyTorch's message alone (the exception, no observer), as the H200 printed it.
    message = (
        "CUDA out of memory. Tried to allocate 12.27 GiB. GPU 0 has a total capacity of 139.80 GiB of which 114.39 GiB is free. "
        "Including non-PyTorch memory, this process has 25.40 GiB memory in use. 34.95 GiB allowed; Of the allocated memory "
        "24.65 GiB is allocated by PyTorch, and 91.13 MiB is reserved by PyTorch but unallocated."
    )
    tracker = oomkit.Tracker(model, log_dir=tmp_path / "message")
    tracker.begin_step(0)
    assert tracker.record_oom(torch.OutOfMemoryError(message)) is True
    tracker.close()
    [oom] = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert abs(oom["memory"]["allowed_bytes"] - 34.95 * gib) < 1 << 20 and abs(oom["memory"]["free_bytes"] - 114.39 * gib) < 1 << 20
    assert oomkit.analyze(tracker.log_path)["ooms"][0]["cause"] == "memory_fraction_limit"


def test_an_allocation_failing_while_an_oom_is_written_is_not_written_again(tmp_path):
    # The allocator calls its observer for every failed allocation, also one
    # made while the tracker writes the first (its duplicate check, a dump,
    # another thread): that one must neither recurse nor add a record.
    model = MLP(64, 2)
    tracker = oomkit.Tracker(model, log_dir=tmp_path)
    tracker._meter.index = 0
    tracker.begin_step(1)
    inner = tracker.find_duplicates

    def failing_inside(when: str = "manual") -> dict:
        oom_capture.on_allocator_oom(tracker._core, 0, 1 << 20, 70 << 30, 0)
        return inner(when)

    tracker.find_duplicates = failing_inside
    oom_capture.on_allocator_oom(tracker._core, 0, 3 << 30, 70 << 30, 1 << 29)
    tracker.find_duplicates = inner
    oom_capture.on_allocator_oom(tracker._core, 0, 5 << 30, 70 << 30, 1 << 29)  # a later OOM is written
    tracker.close()
    ooms = [json.loads(line) for line in Path(tracker.log_path).read_text().splitlines() if '"type":"oom"' in line]
    assert [o["requested_bytes"] for o in ooms] == [3 << 30, 5 << 30]
    assert "of 75161927680 on GPU 0" in ooms[0]["message"]
