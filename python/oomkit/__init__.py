"""oomkit: find out why PyTorch ran out of memory.

``oomkit.Tracker`` records memory per training stage, component costs,
gradient health, duplicate model copies and OOMs to a run log;
``oomkit.analyze`` (and the ``oomkit`` command) explains a run log or a
PyTorch memory snapshot. Importing oomkit starts no thread and touches no
GPU.
"""

from __future__ import annotations

import json
import os
from typing import Any

from oomkit._native import OomkitError, PreflightError, RunLogError, __version__
from oomkit._oom import is_oom, requested_bytes
from oomkit._plan import Plan
from oomkit.auto_batch import BatchSizeError, UsageError, auto_batch, current_plan, oom_guard

# The function; its package (oomkit/preflight/) stays importable as `oomkit.preflight.<module>`.
from oomkit.preflight import preflight
from oomkit.tracker import Tracker, record_history

__all__ = [
    "BatchSizeError",
    "OomkitError",
    "Plan",
    "PreflightError",
    "RunLogError",
    "Tracker",
    "UsageError",
    "__version__",
    "analyze",
    "auto_batch",
    "current_plan",
    "is_oom",
    "oom_guard",
    "preflight",
    "record_history",
    "requested_bytes",
]


def analyze(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Analyzes a run log and returns what ``oomkit analyze --json`` prints for it."""
    from oomkit import _native

    result: dict[str, Any] = json.loads(_native.analyze_run_json(os.fspath(path)))
    return result
