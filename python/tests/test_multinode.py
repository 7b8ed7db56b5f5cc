"""An OOM on one rank of a multi-node torchrun job: every rank restarts on one smaller plan.

Two torchrun agents on 127.0.0.1 stand for two nodes (c10d rendezvous, two
gloo workers each); rank 1 hits a real CPU allocator OOM above a micro-batch
limit, inside an ``oom_guard`` or outside any guard while the other ranks
wait in an all-reduce. Every test is bounded in time and checks that no
worker outlives the job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import running

pytest.importorskip("torch")

# Each job must end well inside this; a hang fails the test instead of CI.
JOB_TIMEOUT_S = 150

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import oomkit

    mode, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    min_batch = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    oom_ranks = {int(r) for r in sys.argv[5].split(",")} if len(sys.argv) > 5 else {1}
    open(os.path.join(out, "pids", str(os.getpid())), "w").close()
    start = oomkit.current_plan()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    @oomkit.auto_batch(batch_size=32, effective_batch=128, min_batch_size=min_batch)
    def train(micro, accum):
        model = torch.nn.Linear(8, 8)
        with oomkit.Tracker(model, log_dir=os.path.join(out, "logs"), check_duplicates=False) as tracker:
            for step in range(2):
                with tracker.step(step):
                    one_step(micro, step)
        return micro * accum

    def one_step(micro, step):
        if mode == "guard":
            with oomkit.oom_guard():
                if rank in oom_ranks and micro > limit:
                    torch.empty(1 << 62, dtype=torch.uint8)
        elif rank in oom_ranks and micro > limit and step == 1:
            # Outside any guard: the other ranks are already in the all-reduce below.
            torch.empty(1 << 62, dtype=torch.uint8)
        t = torch.full((1,), float(micro))
        dist.all_reduce(t)
        assert t.item() == micro * dist.get_world_size(), "ranks ran different plans"

    samples = train()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({
            "rank": rank,
            "plan": list(train.plan),
            "samples": samples,
            "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "start_attempt": start.attempt if start else None,
            "start_source": start.source if start else None,
            "separate_store": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
        }, f)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent_cmd(script: Path, rdzv: list[str], args: list[str], restarts: int = 3) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(script),
        *args,
    ]


def _run_job(tmp_path: Path, mode: str, limit: int, nodes: int = 2, min_batch: int = 1, oom_ranks: str = "1") -> tuple[list[tuple[int, str]], dict[int, dict], float]:
    """Runs the job on `nodes` agents; returns each agent's exit code and output, the ranks' results, and the wall time."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    (out / "pids").mkdir(parents=True)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    for k in ("OOMKIT_MICRO_BATCH", "OOMKIT_GRAD_ACCUM", "OOMKIT_EFFECTIVE_BATCH", "OOMKIT_ATTEMPT"):
        env.pop(k, None)
    if nodes == 1:
        rdzvs = [["--standalone", "--nnodes", "1"]]
    else:
        port = _free_port()
        rdzv = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "oomkit-elastic-test"]
        rdzvs = [rdzv] * nodes
    args = [mode, str(out), str(limit), str(min_batch), oom_ranks]
    t0 = time.monotonic()
    agents = [
        subprocess.Popen(_agent_cmd(script, r, args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in rdzvs
    ]
    done: list[tuple[int, str]] = []
    try:
        for a in agents:
            text, _ = a.communicate(timeout=max(1.0, JOB_TIMEOUT_S - (time.monotonic() - t0)))
            done.append((a.returncode, text))
    except subprocess.TimeoutExpired:
        for a in agents:
            os.killpg(a.pid, 9)
        pytest.fail(f"the job did not end within {JOB_TIMEOUT_S} s: a rank hung")
    wall = time.monotonic() - t0
    results = {}
    for f in out.glob("rank*.json"):
        r = json.loads(f.read_text())
        results[r["rank"]] = r
    # No worker of any attempt outlives the job.
    deadline = time.monotonic() + 5
    alive = [p.name for p in (out / "pids").iterdir()]
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(int(pid))]
        time.sleep(0.1)
    assert not alive, f"workers left behind: {alive}"
    return done, results, wall


def _all_on(results: dict[int, dict], plan: list[int]) -> None:
    assert sorted(results) == [0, 1, 2, 3], results
    for r in results.values():
        assert r["plan"] == plan, results
        assert r["samples"] == 128


def test_an_oom_outside_any_guard_restarts_every_rank_on_every_node_with_one_smaller_plan(tmp_path: Path) -> None:
    done, results, wall = _run_job(tmp_path, "outside", limit=8)
    for code, text in done:
        assert code == 0, text[-3000:]
    _all_on(results, [8, 16])
    # 32 failed, then 16: every rank starts its third attempt from the agreed plan.
    # (TORCHELASTIC_RESTART_COUNT counts per agent, and an agent restarted
    # because another node failed does not count it, so it is not compared.)
    assert {r["start_attempt"] for r in results.values()} == {3}, results
    assert {r["start_source"] for r in results.values()} == {"torch elastic restart"}
    log = "\n".join(t for _, t in done)
    assert "out of memory on rank 1 at micro-batch 32 outside an oom_guard" in log
    assert "attempt 2 will run micro-batch 16 x accumulation 8 on every rank" in log
    assert wall < JOB_TIMEOUT_S
    # Every rank's log records its attempt and plan; analyzed together they say who ran out first.
    logs = sorted(str(p) for p in (tmp_path / "out" / "logs").glob("*.jsonl"))
    assert len(logs) == 12, logs
    a = subprocess.run(["oomkit", "analyze", "--json", *logs], capture_output=True, text=True, timeout=60)
    assert a.returncode == 0, a.stderr
    attempts = json.loads(a.stdout)[0]["attempts"]
    assert [(x["attempt"], x["micro_batch"], x["grad_accum"], x["outcome"]) for x in attempts] == [
        (1, 32, 4, "ran_out"),
        (2, 16, 8, "ran_out"),
        (3, 8, 16, "finished"),
    ]
    assert [x["first_oom"]["rank"] for x in attempts[:2]] == [1, 1]
    assert all(x["ranks"] == [0, 1, 2, 3] for x in attempts)
    text = subprocess.run(["oomkit", "analyze", *logs], capture_output=True, text=True, timeout=60).stdout
    assert "== attempts (3)" in text
    assert "rank 1 ran out of memory first (step 1" in text


def test_two_ranks_on_two_nodes_that_run_out_at_once_step_down_once(tmp_path: Path) -> None:
    done, results, _ = _run_job(tmp_path, "outside", limit=16, oom_ranks="1,2")
    for code, text in done:
        assert code == 0, text[-3000:]
    # Both ran out at 32 and proposed 16 for attempt 2: one step down, not two.
    _all_on(results, [16, 8])
    assert {r["start_attempt"] for r in results.values()} == {2}, results


def test_an_oom_inside_a_guard_steps_every_rank_down_without_a_restart(tmp_path: Path) -> None:
    done, results, _ = _run_job(tmp_path, "guard", limit=8)
    for code, text in done:
        assert code == 0, text[-3000:]
    _all_on(results, [8, 16])
    assert {r["restarts"] for r in results.values()} == {0}
    # The tracker starts inside the function: one log per rank and try.
    logs = sorted(str(p) for p in (tmp_path / "out" / "logs").glob("*.jsonl"))
    assert len(logs) == 12, logs
    a = subprocess.run(["oomkit", "analyze", "--json", *logs], capture_output=True, text=True, timeout=60)
    attempts = json.loads(a.stdout)[0]["attempts"]
    assert [(x["micro_batch"], x["outcome"]) for x in attempts] == [(32, "ran_out"), (16, "ran_out"), (8, "finished")]
    assert attempts[0]["first_oom"]["rank"] == 1


def test_when_no_smaller_micro_batch_is_allowed_every_rank_names_the_rank_that_ran_out(tmp_path: Path) -> None:
    done, results, _ = _run_job(tmp_path, "outside", limit=0, min_batch=16)
    assert results == {}
    assert all(code != 0 for code, _ in done)
    log = "\n".join(t for _, t in done)
    assert "rank 1 ran out of memory at micro-batch 16 (attempt 2), and no smaller micro-batch is allowed (min_batch_size=16)" in log
    assert "BatchSizeError" in log


def test_on_one_node_the_plan_is_agreed_through_a_file(tmp_path: Path) -> None:
    done, results, _ = _run_job(tmp_path, "outside", limit=8, nodes=1)
    (code, text), = done
    assert code == 0, text[-3000:]
    assert sorted(results) == [0, 1]
    for r in results.values():
        assert r["plan"] == [8, 16] and r["restarts"] == 2
    assert "oomkit-" in text and "elastic-" in text


SLURM_TASK = textwrap.dedent(
    """
    import json, os, sys, time
    micro, accum, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    task = int(os.environ["SLURM_PROCID"])
    open(os.path.join(out, "pids", str(os.getpid())), "w").close()
    if micro > 8:
        if task == 1:
            import torch
            torch.empty(1 << 62, dtype=torch.uint8)  # a real CPU allocator OOM
        time.sleep(120)  # the other tasks wait, as in a collective, until srun -K stops them
    with open(os.path.join(out, f"task{task}-attempt{os.environ['OOMKIT_ATTEMPT']}.json"), "w") as f:
        json.dump({"micro": micro, "accum": accum, "effective": int(os.environ["OOMKIT_EFFECTIVE_BATCH"])}, f)
    """
)


def test_oomkit_run_around_srun_retries_the_whole_step(tmp_path: Path) -> None:
    """One supervisor around the job step: the OOM on one task stops the step and every task reruns smaller."""
    task = tmp_path / "task.py"
    task.write_text(SLURM_TASK)
    out = tmp_path / "out"
    (out / "pids").mkdir(parents=True)
    srun = [sys.executable, str(Path(__file__).with_name("srun_standin.py")), "-K", "--ntasks", "3"]
    cmd = [
        "oomkit", "run", "--gpus", "0", "--batch-size", "32", "--effective-batch", "128", "--fresh", "--",
        *srun, sys.executable, str(task), "{batch_size}", "{grad_accum}", str(out),
    ]
    env = dict(os.environ, OOMKIT_CACHE_DIR=str(tmp_path / "cache"))
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    finished = sorted(f.name for f in out.glob("task*.json"))
    # Attempts 1 (32) and 2 (16) ran out on task 1; attempt 3 ran every task at 8 x 16.
    assert finished == ["task0-attempt3.json", "task1-attempt3.json", "task2-attempt3.json"], p.stderr
    for f in out.glob("task*.json"):
        assert json.loads(f.read_text()) == {"micro": 8, "accum": 16, "effective": 128}
    assert "attempt 3: micro-batch 8 x accumulation 16 = 128" in p.stderr
    assert not [pid for pid in (out / "pids").iterdir() if running(int(pid.name))]


def test_the_same_code_under_oomkit_run_and_torchrun_without_restarts(tmp_path: Path) -> None:
    """Without torch elastic's restarts, the rank exits and `oomkit run` reruns torchrun with its next plan."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    (out / "pids").mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OOMKIT_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    torchrun = _agent_cmd(script, ["--standalone", "--nnodes", "1"], ["outside", str(out), "8"], restarts=0)
    cmd = ["oomkit", "run", "--gpus", "0", "--batch-size", "32", "--effective-batch", "128", "--fresh", "--", *torchrun]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    assert len(results) == 2
    for r in results:
        assert r["plan"] == [8, 16]
        assert r["start_source"] == "oomkit run" and r["start_attempt"] == 3
        # `oomkit run` sets what torchrun's restarts need, for every command it runs.
        assert r["separate_store"] == "1"
    assert "attempt 3: micro-batch 8 x accumulation 16 = 128" in p.stderr


ROOT = Path(__file__).resolve().parents[2]
# The page whose examples these tests run as written.
DOC = ROOT / "docs" / "multinode.md"
EXAMPLE = ROOT / "examples" / "multinode" / "train.py"


def _doc_block(after: str) -> str:
    text = DOC.read_text()
    start = text.index("```sh\n", text.index(after)) + len("```sh\n")
    return text[start : text.index("```", start)]


def test_the_slurm_example_is_the_documented_one_and_is_valid_bash() -> None:
    sbatch = ROOT / "examples" / "slurm" / "train.sbatch"
    assert sbatch.read_text() == _doc_block("`examples/slurm/train.sbatch`:")
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0


def test_a_lightning_ddp_run_under_torchrun_steps_down_through_restarts(tmp_path: Path) -> None:
    """The Lightning callback applies the plan the ranks agreed on after an OOM, as auto_batch does."""
    pytest.importorskip("lightning")
    script = ROOT / "examples" / "lightning_trainer.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
        "--max-restarts", "3", "--monitor-interval", "0.1", str(script),
        "--root", str(tmp_path), "--oomkit", "--devices", "2", "--batch", "16", "--accum", "1",
        "--oom-above", "4", "--steps", "2", "--val-every", "0",
    ]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    for k in ("OOMKIT_MICRO_BATCH", "OOMKIT_GRAD_ACCUM", "OOMKIT_EFFECTIVE_BATCH", "OOMKIT_ATTEMPT", "OOMKIT_AUTO_CALLBACK"):
        env.pop(k, None)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, start_new_session=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    # 16 x 1 ran out, then 8 x 2; every rank restarted on 4 x 4, the same 16 samples per step.
    assert "trained with micro-batch 4 x accumulation 4" in out, out[-4000:]
    assert "torch elastic restart attempt 3: training with micro-batch 4 x accumulation 4" in out, out[-4000:]
    # Each attempt's logs, the first with the trainer's own plan, read as one job.
    logs = sorted(str(f) for f in (tmp_path / "oomkit-logs").glob("*.jsonl"))
    a = subprocess.run(["oomkit", "analyze", "--json", *logs], capture_output=True, text=True, timeout=60)
    attempts = json.loads(a.stdout)[0]["attempts"]
    assert [(x["attempt"], x["micro_batch"], x["grad_accum"], x["outcome"]) for x in attempts] == [
        (1, 16, 1, "ran_out"), (2, 8, 2, "ran_out"), (3, 4, 4, "finished"),
    ]
