"""Reading a run log's records in tests."""

from __future__ import annotations

import json
import os
import subprocess


def records(path, kind):
    """The records of one type, in order."""
    return [r for r in map(json.loads, open(path)) if r["type"] == kind]


def stages_by_step(path):
    """Each step's stage names, in order."""
    out = {}
    for r in records(path, "stage"):
        out.setdefault(r["step"], []).append(r["name"])
    return out


def logs_in_start_order(folder):
    """The run logs in a folder, in the order their runs started."""
    return sorted(folder.glob("run-*.jsonl"), key=lambda f: json.loads(f.open().readline())["time"])


def run_isolated(cmd, tmp_path, timeout=600):
    """Runs a command (`oomkit run ...`) with a plan memory of its own, so that no earlier run's plan is reused."""
    env = dict(os.environ, OOMKIT_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
