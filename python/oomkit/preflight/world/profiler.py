"""PyTorch's profiler under preflight: it traces the host alone, as there is no GPU to trace.

A benchmarking or tuning script profiles its steps
(``torch.profiler.profile(activities=[CPU, CUDA], profile_memory=True)``,
or no activities: every one ``supported_activities()`` names, CUDA among
them since ``torch.cuda.is_available()`` is true here). Tracing CUDA needs
the driver: each operation then logs "Failed to record CUDA event" with a
C++ backtrace, thousands of lines around the answer. The CUDA activity is
dropped from what the profiler is given, so it runs as on a machine
without a GPU, and a note says so; the script's own use of the profile
(its table, its trace file) works as there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from oomkit.preflight.notes import Notes

#: The profiler module that resolves the activities a profile traces.
PROFILER = "torch.profiler.profiler"

#: What an answer says when the script's profiler was asked to trace CUDA.
HOST_ONLY_NOTE = "the script's profiler traced the host alone: CUDA's activity needs a GPU, and was left out"


class HostOnlyProfiler:
    """The stand-ins of one preflight run for PyTorch's profiler, and the note they leave."""

    def __init__(self, notes: Notes) -> None:
        self.notes = notes

    def stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``supported_activities`` and ``_parse_activities`` of ``module`` (PyTorch's profiler),
        and the package's own ``supported_activities``, without CUDA, as (owner, name, value)."""
        if not hasattr(module, "_parse_activities") or not hasattr(module, "supported_activities"):
            return []
        from torch.profiler import ProfilerActivity

        supported: Callable[[], Any] = module.supported_activities
        parse: Callable[..., Any] = module._parse_activities
        notes = self.notes

        def without_cuda(activities: Iterable[Any]) -> set[Any]:
            kept = set(activities)
            if ProfilerActivity.CUDA in kept:
                kept.discard(ProfilerActivity.CUDA)
                notes.add(HOST_ONLY_NOTE)
            return kept

        def supported_activities() -> set[Any]:
            return without_cuda(supported())

        def parse_activities(*args: Any, **kwargs: Any) -> Any:
            activities, configs = parse(*args, **kwargs)
            return without_cuda(activities), configs

        found: list[tuple[Any, str, Any]] = [
            (module, "supported_activities", supported_activities),
            (module, "_parse_activities", parse_activities),
        ]
        package = sys.modules.get("torch.profiler")
        if package is not None and getattr(package, "supported_activities", None) is supported:
            found.append((package, "supported_activities", supported_activities))
        return found
