"""The plain PyTorch example scripts, run as docs/examples.md shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")


def test_a_clean_cnn_run_has_no_finding_and_a_planted_oom_fails_the_run(tmp_path):
    base = [sys.executable, os.path.join(EXAMPLES, "cnn_train.py"), "--device", "cpu", "--steps", "6", "--tracker"]
    p = subprocess.run(base + ["--log-dir", "clean"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    [log] = (tmp_path / "clean").glob("run-*.jsonl")
    a = json.loads(subprocess.run([OOMKIT, "analyze", "--json", str(log)], capture_output=True, text=True).stdout)
    assert a["steps"] == 6 and a["findings"] == []
    p = subprocess.run(base + ["--log-dir", "oom", "--batch", "16", "--oom-above", "8"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1 and "DefaultCPUAllocator" in p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1][len("RESULT "):])
    assert (result["status"], result["error"]) == ("oom", "RuntimeError")


def test_an_eval_that_keeps_its_outputs_is_named_even_when_rss_stays_up(tmp_path):
    # On CPU the process keeps the eval's memory, so the steps after it peak as high:
    # the spike is measured against the steps before it.
    cmd = [sys.executable, os.path.join(EXAMPLES, "gpt_train.py"), "--device", "cpu", "--size", "small",
           "--steps", "7", "--eval-every", "5", "--tracker", "--log-dir", "runs", "--eval-keeps-outputs"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    [log] = (tmp_path / "runs").glob("run-*.jsonl")
    a = json.loads(subprocess.run([OOMKIT, "analyze", "--json", str(log)], capture_output=True, text=True).stdout)
    assert "eval_spike" in [f["kind"] for f in a["findings"]], a["findings"]


def test_a_small_leak_on_cpu_is_named(tmp_path):
    # The tiny model keeps its output, 1 MiB a step (8 x 64 x 512 float32), on a
    # 700 MiB resident set that glibc sometimes trims by a few MiB.
    cmd = [sys.executable, os.path.join(EXAMPLES, "gpt_train.py"), "--device", "cpu", "--steps", "30",
           "--tracker", "--log-dir", "runs", "--leak"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    [log] = (tmp_path / "runs").glob("run-*.jsonl")
    a = json.loads(subprocess.run([OOMKIT, "analyze", "--json", str(log)], capture_output=True, text=True).stdout)
    assert [f["kind"] for f in a["findings"]] == ["leak"], a["findings"]
    assert 1 << 19 < a["leak"]["bytes_per_step"] < 2 << 20, a["leak"]


def test_record_snapshot_refuses_plainly_without_a_gpu(tmp_path):
    # README, "Record a snapshot in PyTorch": on a GPU it writes snap.pickle for `oomkit analyze`;
    # without one it says why in one line and exits 1.
    import torch

    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "record_snapshot.py")], capture_output=True, text=True, cwd=tmp_path)
    if torch.cuda.is_available():
        assert p.returncode == 0, p.stderr[-2000:]
        out = subprocess.run([OOMKIT, "analyze", "snap.pickle"], capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0 and "no OOM; peak" in out.stdout, out.stdout + out.stderr
    else:
        assert p.returncode == 1
        assert p.stderr.strip().splitlines() == [
            "record_snapshot.py: no CUDA device here, and PyTorch records snapshots of CUDA memory only; "
            "`oomkit demo --save snap.pickle` writes one to try oomkit on"
        ]
        assert not (tmp_path / "snap.pickle").exists()
