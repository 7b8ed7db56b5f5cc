"""No figure oomkit did not measure, no plan it did not apply: real scripts, run as a new user would, on CPU.

Each test drives one of the example training scripts (a plain loop, a
Hugging Face Trainer, a Lightning script whose batch size lives only in its
DataLoader) through the installed `oomkit` command or package, and checks
that what oomkit says is what happened.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import uuid
from pathlib import Path

import oomkit
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")
GPT = [sys.executable, str(EXAMPLES / "gpt_train.py"), "--device", "cpu"]


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = dict(os.environ, OOMKIT_CACHE_DIR=str(cwd / "cache"), **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=full, timeout=timeout)


def analyze(*paths: Path) -> object:
    p = subprocess.run([OOMKIT, "analyze", "--json", *map(str, paths)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def result_of(output: str) -> dict:
    """The script's RESULT object; under `oomkit run --json` its stdout and stderr share one stream, so text may follow it on its line."""
    line = [ln for ln in output.splitlines() if ln.startswith("RESULT ")][-1]
    result, _ = json.JSONDecoder().raw_decode(line[len("RESULT "):])
    return result


# ----- find-batch ------------------------------------------------------------


def test_find_batch_measures_an_unmodified_script_and_recommends_only_what_fits(tmp_path):
    # gpt_train.py without --tracker: no probe file, no GPU. Every trial's
    # peak is the script's own, read from outside, and the recommendation is
    # a batch whose measured peak is within the budget.
    p = run(
        # From 4: the runs at 1 and 2 would only hold the interpreter's few hundred MiB.
        [OOMKIT, "find-batch", "--capacity", "1.3GiB", "--margin", "0", "--start", "4", "--max", "64", "--json", "--",
         *GPT, "--size", "small", "--steps", "1", "--batch", "{batch_size}"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    trials = r["trials"]
    assert all(t["peak_source"] == "rss" and t["peak_bytes"] > 200 << 20 for t in trials), trials
    best = r["recommended_batch"]
    [chosen] = [t for t in trials if t["batch"] == best]
    assert chosen["ok"] and chosen["peak_bytes"] <= r["budget_bytes"]
    # Each trial's own RESULT line reports the script's peak (its getrusage):
    # the figure read from outside is at least that.
    for line in p.stderr.splitlines():
        if line.startswith("RESULT "):
            res, _ = json.JSONDecoder().raw_decode(line[len("RESULT "):])
            t = next(t for t in trials if t["batch"] == res["micro_batch"])
            assert t["peak_bytes"] >= res["peak_bytes"] * 0.99, (t, res["peak_bytes"])
    if r["fixed_bytes"] is not None:
        for t in trials:
            if not t["oom"]:
                line = r["fixed_bytes"] + r["per_sample_bytes"] * t["batch"]
                assert abs(line - t["peak_bytes"]) <= 0.1 * t["peak_bytes"], (t, r["fixed_bytes"], r["per_sample_bytes"])


# ----- OOMs the kernel kills -------------------------------------------------


def _memory_cgroup() -> Path | None:
    """A fresh memory cgroup under this process's own, where this machine lets us make one."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit = "memory.limit_in_bytes"
            break
    else:
        v2 = [ln for ln in text.splitlines() if ln.startswith("0::")]
        if not v2:
            return None
        base = Path("/sys/fs/cgroup") / v2[0][3:].lstrip("/")
        limit = "memory.max"
    child = base / f"oomkit-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / limit).write_text(str(1300 << 20))
    except OSError:
        return None
    return child


def test_an_oom_the_kernel_kills_is_retried_and_the_killed_log_says_so(tmp_path):
    cg = _memory_cgroup()
    if cg is None:
        pytest.skip("no memory cgroup can be made here (not root, or no memory controller): the kernel's OOM kill is not exercised")
    try:
        # oomkit and the training script in one memory-limited cgroup, as in a container or a SLURM job.
        inner = " ".join(
            [OOMKIT, "run", "--batch-size", "32", "--json", "--", *GPT, "--size", "small", "--steps", "2",
             "--tracker", "--log-dir", "logs", "--batch", "{batch_size}"]
        )
        p = run(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec {inner}"], tmp_path)
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass
    summary = json.loads(p.stdout)
    attempts = summary["attempts"]
    assert attempts[0]["killed_for_memory"] and attempts[0]["exit_code"] == 137, attempts
    assert attempts[0]["oom"] and attempts[0]["cause"] == "capacity" and attempts[0]["action"] == "step_down"
    assert "killed by the kernel's OOM killer" in attempts[0]["oom_message"]
    assert summary["outcome"] == "succeeded", p.stderr[-3000:]
    assert attempts[-1]["batch_size"] < 32
    killed_log = Path(attempts[0]["logs"][0])
    a = analyze(killed_log)
    assert a["ending"] == "killed_for_memory" and a["verdict"]["failed"], a["verdict"]
    assert "KILLED FOR MEMORY" in a["verdict"]["headline"]
    assert [o["killed_by_kernel"] for o in a["ooms"]] == [True]
    # The limit is the cgroup's, never the host's memory.
    assert a["capacity_bytes"] <= 1300 << 20
    # Analyzed together, the logs are attempts of one rank, not ranks.
    logs = sorted(tmp_path.glob("logs/run-*.jsonl"))
    files = analyze(*logs)
    rows = files[0]["multi_rank"]
    assert not any(r["imbalanced"] or r["failed_first"] for r in rows), rows
    outcomes = [x["outcome"] for x in files[0]["attempts"]]
    assert outcomes[0] == "ran_out" and outcomes[-1] == "finished", outcomes


def test_a_host_memory_limit_rehearses_the_recovery_on_cpu(tmp_path):
    # RLIMIT_DATA makes PyTorch's CPU allocator fail as on a smaller machine.
    p = run(
        [OOMKIT, "run", "--host-memory-limit", "1.6GiB", "--batch-size", "16", "--json", "--",
         *GPT, "--size", "small", "--steps", "1", "--tracker", "--log-dir", "logs", "--batch", "{batch_size}"],
        tmp_path,
    )
    summary = json.loads(p.stdout)
    first, last = summary["attempts"][0], summary["attempts"][-1]
    assert first["oom"] and "DefaultCPUAllocator" in first["oom_message"], first
    assert summary["outcome"] == "succeeded" and last["batch_size"] < 16, summary


# ----- plans applied or not --------------------------------------------------


LIGHTNING_DL = [sys.executable, str(EXAMPLES / "lightning_dataloader.py"), "--root", "runs"]


def test_the_plan_reaches_a_lightning_script_whose_batch_size_is_only_in_its_dataloader(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed for this Python")
    p = run([OOMKIT, "run", "--batch-size", "20", "--effective-batch", "40", "--json", "--", *LIGHTNING_DL,
             "--oom-above", "10", "--test"], tmp_path)
    summary = json.loads(p.stdout)
    first, last = summary["attempts"][0], summary["attempts"][-1]
    assert first["plan_applied"] is True and first["oom"], first
    assert (last["batch_size"], last["grad_accum"], last["plan_applied"]) == (10, 4, True), last
    res = result_of(p.stderr)
    assert set(res["batches"]) == {10} and res["accumulate_grad_batches"] == 4, res
    plans = json.loads((tmp_path / "cache" / "plans.json").read_text())
    assert "10" in json.dumps(plans)
    # The test phase's own log is named for what it is, with its peak.
    logs = sorted((tmp_path / "runs" / "oomkit-logs").glob("run-*.jsonl"))
    test_only = [a for a in map(analyze, logs) if a["steps"] == 0]
    assert len(test_only) == 1, [a["no_steps"] for a in map(analyze, logs)]
    assert "[test]-only" in test_only[0]["no_steps"] and test_only[0]["peak_bytes"] > 0
    assert "peak 0 B" not in test_only[0]["verdict"]["headline"]


def test_a_plan_a_lightning_script_cannot_take_is_reported_not_applied_and_never_remembered(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed for this Python")
    p = run([OOMKIT, "run", "--batch-size", "10", "--effective-batch", "40", "--json", "--", *LIGHTNING_DL,
             "--batch-sampler"], tmp_path)
    summary = json.loads(p.stdout)
    [attempt] = summary["attempts"]
    assert attempt["plan_applied"] is False and "batch_sampler" in attempt["plan_not_applied"], attempt
    assert any("not remembered" in n for n in summary["notes"]), summary["notes"]
    assert not (tmp_path / "cache" / "plans.json").exists()
    # Half a plan is no plan: the script's own accumulation stands.
    res = result_of(p.stderr)
    assert set(res["batches"]) == {20} and res["accumulate_grad_batches"] == 1, res
    [log] = (tmp_path / "runs" / "oomkit-logs").glob("run-*.jsonl")
    plan = analyze(log)["plan"]
    assert plan["applied"] is False and plan["micro_batch"] == 20 and plan["grad_accum"] == 1, plan


# ----- retries are attempts, not ranks ---------------------------------------


def test_retries_of_a_plain_loop_are_attempts_not_ranks_in_analyze_and_report(tmp_path):
    p = run([OOMKIT, "run", "--batch-size", "16", "--effective-batch", "16", "--", *GPT, "--steps", "2",
             "--tracker", "--log-dir", "logs", "--oom-above", "4", "--batch", "{batch_size}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    logs = sorted(tmp_path.glob("logs/run-*.jsonl"))
    assert len(logs) == 3
    files = analyze(*logs)
    assert [a["attempt"] for a in files] == [1, 2, 3]
    assert [x["outcome"] for x in files[0]["attempts"]] == ["ran_out", "ran_out", "finished"]
    rows = files[0]["multi_rank"]
    assert not any(r["imbalanced"] or r["failed_first"] for r in rows), rows
    text = subprocess.run([OOMKIT, "analyze", *map(str, logs)], capture_output=True, text=True).stdout
    assert "[imbalance]" not in text and "[failed_first]" not in text, text
    assert "== attempts (3)" in text and "the last attempt, 3" in text, text
    diff = subprocess.run([OOMKIT, "diff", str(logs[0]), str(logs[2])], capture_output=True, text=True).stdout
    assert diff.startswith(f"== A: {logs[0]} (attempt 1)\n== B: {logs[2]} (attempt 3)"), diff
    page = tmp_path / "report.html"
    subprocess.run([OOMKIT, "report", *map(str, logs), "-o", str(page)], check=True, capture_output=True)
    data = re.search(r'<script id="oomkit-data" type="application/json">(.*?)</script>', page.read_text(), re.S)
    assert data is not None
    doc = json.loads(data.group(1))
    assert [a["attempt"] for a in doc["attempts"]] == [1, 2, 3]


# ----- zeros that would read as facts ----------------------------------------


def test_an_oom_in_the_first_step_is_diagnosed_with_what_was_measured(tmp_path):
    p = run([*GPT, "--tracker", "--log-dir", "logs", "--batch", "8", "--oom-above", "4"], tmp_path)
    assert p.returncode == 1
    diagnosis = p.stderr[p.stderr.index("out of memory, diagnosis"):]
    assert "0 steps" not in diagnosis and "peak 0 B" not in diagnosis, diagnosis
    assert "no step finished: it ran out of memory in step 0" in diagnosis, diagnosis


def test_a_trainer_callback_that_never_marks_steps_still_gets_the_optimizers_steps(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed for this Python")
    from hf_trainer import build
    from transformers import TrainerCallback

    class Mine(TrainerCallback):
        """A user's own callback, as in the issue: a tracker, and nothing else."""

        tracker = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            Mine.tracker = oomkit.Tracker(model, optimizer=optimizer, log_dir=str(tmp_path / "logs"))

        def on_train_end(self, args, state, control, **kwargs):
            Mine.tracker.close()

    build(str(tmp_path / "out"), batch=4, steps=8, callback=Mine()).train()
    a = oomkit.analyze(Mine.tracker.log_path)
    assert a["steps"] == 8 and a["steps_from_optimizer"], a["no_steps"]
    assert a["peak_bytes"] > 0 and a["seen"]["optimizer"] == 8
    assert [s["count"] for s in a["stages"] if s["name"] in ("forward", "backward", "optimizer")] == [8, 8, 8]


def test_a_tracker_left_open_says_how_the_program_ended(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import torch, oomkit\n"
        "m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "t = oomkit.Tracker(m, optimizer=opt, log_dir='logs')\n"
        "for _ in range(3):\n"
        "    m(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "raise ValueError('the data ran out')\n"
    )
    p = run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 1
    [log] = tmp_path.glob("logs/run-*.jsonl")
    a = analyze(log)
    assert a["ending"] == "exception" and "ValueError: the data ran out" in a["verdict"]["detail"], a["verdict"]
    assert a["steps"] == 3 and a["steps_from_optimizer"]


# ----- the watcher does not change what it watches ---------------------------


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's")
def test_the_tracker_never_resets_the_process_peak_that_other_tools_read(tmp_path):
    # An early peak well above what training needs, then a tracked run.
    big = torch.ones(400 << 18)  # 400 MiB, touched
    del big
    hwm, rusage = _vm_hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with oomkit.Tracker(model, optimizer=opt, log_dir=tmp_path) as tracker:
        for i in range(3):
            with tracker.step(i):
                model(torch.randn(8, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert _vm_hwm() >= hwm
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= rusage
    a = oomkit.analyze(tracker.log_path)
    # The steps stayed under the early peak: their peaks are bounds, and say so.
    steps = next(s for s in a["stages"] if s["name"] == "step")
    assert steps["peaks_bounded"] == 3 and steps["max_peak_at_most_bytes"] >= hwm - (1 << 20)


def test_reset_peaks_gives_exact_stage_peaks_when_asked(tmp_path):
    model = torch.nn.Linear(64, 64)
    with oomkit.Tracker(model, log_dir=tmp_path, reset_peaks=True) as tracker, tracker.step(0):
        model(torch.randn(8, 64)).sum().backward()
    a = oomkit.analyze(tracker.log_path)
    assert all(s["peaks_bounded"] == 0 for s in a["stages"]), a["stages"]
