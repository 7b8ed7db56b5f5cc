"""oomkit.auto_batch, the tracker's probe file, and find-batch driving a real PyTorch script."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import oomkit
import pytest
import torch

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free."


def _oom() -> BaseException:
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return oom_type(OOM)


def test_steps_down_and_keeps_the_effective_batch() -> None:
    calls = []

    @oomkit.auto_batch(batch_size=64, effective_batch=256)
    def train(micro: int, accum: int, scale: int = 1) -> int:
        calls.append((micro, accum))
        held = torch.zeros(micro * 1000)  # what a real try would leave behind
        if micro > 16:
            raise _oom()
        return int(held.numel()) * scale

    assert train(scale=2) == 32000
    assert calls == [(64, 4), (32, 8), (16, 16)]
    assert train.plan == (16, 16)
    assert all(m * a == 256 for m, a in calls)


def test_steps_to_the_largest_micro_batch_the_figures_leave_possible() -> None:
    calls = []

    def oom(held: int, request: int, free: int) -> BaseException:
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {request}.00 GiB. GPU 0 has a total capacity of 79.15 GiB of "
            f"which {free}.00 GiB is free. Including non-PyTorch memory, this process has {held}.00 GiB memory in use."
        )

    @oomkit.auto_batch(batch_size=64, effective_batch=192)
    def train(micro: int, accum: int) -> None:
        calls.append((micro, accum))
        if micro == 64:
            raise oom(19, 57, 1)  # needed at least 76 GiB with 20 in reach: at most 16 fit
        if micro > 12:
            raise oom(70, 10, 9)  # at 16, at least 80 with 79 in reach: at most 15 fit

    train()
    # Halving would have gone 32, 16, 8; the largest exact micro-batch under 15 is 12.
    assert calls == [(64, 3), (16, 12), (12, 16)]


def test_message_forms_count_as_oom() -> None:
    for message in (
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "[enforce fail at alloc_cpu.cpp:75] DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 bytes.",
        "HIP out of memory. Tried to allocate 16.00 GiB.",
    ):
        assert oomkit.is_oom(RuntimeError(message)), message
    assert not oomkit.is_oom(RuntimeError("shape mismatch"))
    assert not oomkit.is_oom(ValueError("CUDA out of memory"))


def test_other_errors_pass_through_and_the_floor_reraises() -> None:
    @oomkit.auto_batch(batch_size=8)
    def broken(micro: int, accum: int) -> None:
        raise ValueError("bad data")

    with pytest.raises(ValueError):
        broken()

    tries = []

    @oomkit.auto_batch(batch_size=8, min_batch_size=2)
    def never_fits(micro: int, accum: int) -> None:
        tries.append(micro)
        raise RuntimeError(OOM)

    with pytest.raises(RuntimeError, match="out of memory"):
        never_fits()
    assert tries == [8, 4, 2]


def test_uneven_effective_batch_rounds_up(caplog: pytest.LogCaptureFixture) -> None:
    @oomkit.auto_batch(batch_size=16, effective_batch=97)
    def train(micro: int, accum: int) -> None:
        if micro > 8:
            raise RuntimeError(OOM)

    with caplog.at_level("WARNING", logger="oomkit"):
        train()
    # 97 is prime: 7 x 14 = 98 overshoots least among 4..8.
    assert train.plan == (7, 14)
    assert "98 samples per step" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import oomkit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tries = []

    @oomkit.auto_batch(batch_size=64, effective_batch=128)
    def train(micro, accum):
        tries.append(micro)
        total = 0.0
        for step in range(3):
            with oomkit.oom_guard():
                # Only rank 1 runs out, at its second step and only above 16:
                # rank 0 must step down with it instead of waiting below.
                if rank == 1 and micro > 16 and step == 1:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
            # A collective after the work, as a gradient all-reduce would be.
            t = torch.tensor([float(micro)])
            dist.all_reduce(t)
            total += t.item()
        return total

    total = train()
    print(json.dumps({"rank": rank, "tries": tries, "plan": list(train.plan), "sum": total}))
    dist.destroy_process_group()
    """
)


def test_ranks_agree_and_step_down_together(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung: the ranks did not agree")
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["tries"] == [64, 32, 16]
        assert r["plan"] == [16, 8]
        assert r["sum"] == 3 * 32.0


PROBE_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import oomkit

    batch = int(sys.argv[1])
    # Narrow ends and a wide middle: the memory per sample is the hidden layer's, and the
    # matrix products that fill it stay cheap (the search runs the largest batches).
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = oomkit.Tracker(model, optimizer=opt, log_dir=sys.argv[2], console=False)
    for i in range(3):
        with tracker.step(i):
            x = torch.randn(batch, 64)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    tracker.close()
    """
)


def test_tracker_writes_the_probe_file(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    probe = tmp_path / "probe.json"
    env = dict(os.environ, OOMKIT_PROBE_FILE=str(probe))
    subprocess.run([sys.executable, str(script), "64", str(tmp_path / "logs")], env=env, check=True)
    record = json.loads(probe.read_text())
    assert record["device"] == "cpu"
    assert record["steps"] == 3
    # At least the model's weights, gradients and the batch's activations.
    assert record["peak_bytes"] > 3 * (64 * 4096 * 4)


def test_find_batch_drives_a_real_torch_script(tmp_path: Path) -> None:
    """The whole path: find-batch runs the script, the tracker writes its peak, the model fits the line."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    # glibc moves its mmap threshold as tensors are freed, which makes RSS peaks
    # jump by tens of MiB from run to run; a fixed threshold keeps every tensor
    # in its own mapping, so the peak follows the batch as GPU memory would.
    env = dict(
        os.environ,
        OOMKIT_FAKE_GPUS=str(tmp_path / "none.json"),
        OOMKIT_CLAIMS_DIR=str(tmp_path / "claims"),
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    (tmp_path / "none.json").write_text("[]")
    # Capacity: the interpreter and torch (a few hundred MiB of RSS) plus room for some thousands of samples.
    out = subprocess.run(
        [sys.executable, "-c", "import oomkit._cli as c; c.main()", "find-batch", "--json", "--capacity", "1200MiB",
         "--margin", "0", "--start", "64", "--max", "100000", "--", sys.executable, str(script), "{batch_size}", str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode in (0, 5), out.stderr
    report = json.loads(out.stdout)
    assert all(t["peak_bytes"] for t in report["trials"] if t["exit_code"] == 0)
    assert all(t["peak_bytes"] is None or t["peak_bytes"] > 0 for t in report["trials"])
    if out.returncode == 0:
        best = report["recommended_batch"]
        fitted = next(t for t in report["trials"] if t["batch"] == best)
        assert fitted["ok"] and fitted["peak_bytes"] <= report["budget_bytes"]
        # CPU RSS is noisy; the four-run target is measured in BENCHMARKS.md on GPU-like curves.
        assert len(report["trials"]) <= 8


RETRY_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch

    micro, accum = int(sys.argv[1]), int(os.environ["OOMKIT_GRAD_ACCUM"])
    with open(sys.argv[2], "a") as f:
        f.write(f"{micro} {accum}\\n")
    x = torch.zeros(micro, 1024)
    if micro > 8:
        # What the caching allocator raises; the uncaught traceback is what oomkit run reads.
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.12 GiB is free."
        )
    print("trained", x.shape[0] * accum)
    """
)


def test_oomkit_run_retries_a_real_python_traceback(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RETRY_SCRIPT)
    (tmp_path / "gpus.json").write_text("[]")
    env = dict(os.environ, OOMKIT_FAKE_GPUS=str(tmp_path / "gpus.json"), OOMKIT_CLAIMS_DIR=str(tmp_path / "claims"))
    summary = tmp_path / "summary.json"
    out = subprocess.run(
        [sys.executable, "-c", "import oomkit._cli as c; c.main()", "run", "--batch-size", "32", "--effective-batch", "64",
         "--summary-json", str(summary), "--", sys.executable, str(script), "{batch_size}", str(tmp_path / "seen.txt")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "trained 64" in out.stdout
    seen = (tmp_path / "seen.txt").read_text().split("\n")
    assert seen[:3] == ["32 2", "16 4", "8 8"]
    attempts = json.loads(summary.read_text())["attempts"]
    assert [a["oom"] for a in attempts] == [True, True, False]
    assert "OutOfMemoryError" in attempts[0]["oom_message"]


def test_the_log_says_what_the_cause_means_inside_a_running_process(caplog) -> None:
    fragmented = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
        "1.12 GiB is free. Including non-PyTorch memory, this process has 78.02 GiB memory in use. Of the "
        "allocated memory 71.44 GiB is allocated by PyTorch, and 6.08 GiB is reserved by PyTorch but unallocated."
    )
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

    @oomkit.auto_batch(batch_size=8)
    def train(micro: int, accum: int) -> int:
        if micro > 4:
            raise oom_type(fragmented)
        return micro

    with caplog.at_level("WARNING", logger="oomkit"):
        assert train() == 4
    [record] = caplog.records
    assert "fragmentation: expandable segments cannot be turned on inside a running process" in record.getMessage()
    assert oomkit._native.oom_cause(fragmented) == "fragmentation"
    assert oomkit._native.oom_cause(fragmented, "expandable_segments:True") == "fragmentation"
    assert oomkit._native.oom_cause("shape mismatch") is None


def test_a_failure_far_past_the_device_jumps_to_what_the_message_allows() -> None:
    # At 64 the process held 19 GiB and asked for 57 GiB more with 1 GiB free:
    # about 16 fits, so halving to 32 would only fail again.
    far = (
        "CUDA out of memory. Tried to allocate 57.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
        "1.00 GiB is free. Including non-PyTorch memory, this process has 19.00 GiB memory in use. Of the "
        "allocated memory 18.50 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but unallocated."
    )
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    calls = []

    @oomkit.auto_batch(batch_size=64, effective_batch=64)
    def train(micro: int, accum: int) -> None:
        calls.append((micro, accum))
        if micro > 16:
            raise oom_type(far)

    train()
    assert calls == [(64, 1), (16, 4)]
