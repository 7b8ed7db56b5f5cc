"""How the tracker reads memory: the meter (CUDA's allocator statistics, or the process's resident set on CPU) and a measure in progress."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from oomkit import _native

#: Set by ``oomkit preflight`` in the script it runs: that run's own folder, removed after it.
PREFLIGHT_DIR_ENV = "OOMKIT_PREFLIGHT_DIR"


def preflight_dir() -> Optional[str]:
    """The folder of the ``oomkit preflight`` run this process is, or None outside one.

    Under preflight the model is on ``meta`` standing for the GPU, and
    ``torch.cuda`` answers from the allocator model; a tracker's run log
    goes to this folder, since nothing ran on a GPU to log.
    """
    return os.environ.get(PREFLIGHT_DIR_ENV) or None


def _torch() -> Any:
    import torch

    return torch


class _Meter:
    """Reads memory in use, reserved, and the process's high-water mark, on CUDA or CPU.

    The high-water mark is the process-wide counter other tools read too
    (``torch.cuda.max_memory_allocated()``; on CPU the kernel's VmHWM, which
    ``getrusage`` and ``/usr/bin/time`` report), so it is never reset unless
    the user asks for exact per-stage peaks with ``reset_peaks=True``.
    """

    def __init__(self, device: Any, reset_peaks: bool = False) -> None:
        torch = _torch()
        # Under preflight, meta tensors are the GPU's, and torch.cuda answers for them.
        self.cuda = device is not None and (device.type == "cuda" or (device.type == "meta" and preflight_dir() is not None))
        self.device = device
        self.capacity_source: Optional[str] = None
        if self.cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.capacity: Optional[int] = torch.cuda.get_device_properties(self.index).total_memory
            self.capacity_source = "device"
            self.resets = bool(reset_peaks)
        else:
            # The memory cgroup's limit where one is set below the machine's
            # memory: in containers and SLURM jobs that is where the kernel kills.
            host = _native.host_capacity()
            self.capacity = host[0] if host else None
            self.capacity_source = host[1] if host else None
            self.resets = bool(reset_peaks) and _native.reset_process_peak_rss()

    def sample(self) -> tuple[int, int, int]:
        """Returns (the high-water mark, in use now, reserved now); with resets, the mark starts again from now.

        One call per boundary between stages: on CUDA one query of the
        allocator's statistics; on CPU one native call (statm and status
        through open handles, see oomkit_runlog::process::sample_rss).
        """
        if self.cuda:
            torch = _torch()
            try:
                # The allocator's own nested statistics: what memory_allocated(),
                # max_memory_allocated() and memory_reserved() each rebuild and flatten.
                stats = torch._C._cuda_memoryStats(self.index)
                allocated = stats["allocated_bytes"]["all"]
                peak, now = allocated["peak"], allocated["current"]
                reserved = stats["reserved_bytes"]["all"]["current"]
            except Exception:  # noqa: BLE001 - a torch without the private call
                flat = torch.cuda.memory_stats(self.index)
                peak = flat.get("allocated_bytes.all.peak", 0)
                now = flat.get("allocated_bytes.all.current", 0)
                reserved = flat.get("reserved_bytes.all.current", 0)
            if self.resets:
                torch.cuda.reset_peak_memory_stats(self.index)
            return peak, now, reserved
        peak, now = _native.process_sample(self.resets)
        return peak, now, 0

    def now(self) -> int:
        """Memory in use now, without touching the peak."""
        if self.cuda:
            return _torch().cuda.memory_allocated(self.index)
        return _native.process_rss()

    def reserved(self) -> int:
        """Memory the allocator holds now (0 on CPU)."""
        if self.cuda:
            return _torch().cuda.memory_reserved(self.index)
        return 0


class _Open:
    """A measure in progress: stage, step or phase.

    ``peak`` is the most memory seen in use while it ran; ``at_most`` is set
    where part of it ran while the process stayed under an earlier
    high-water mark, so its true peak lies between ``peak`` and that mark.
    """

    __slots__ = ("at_most", "auto", "kind", "name", "peak", "start", "step", "t0")

    def __init__(self, kind: str, name: str, step: Optional[int], start: int) -> None:
        self.kind = kind
        self.name = name
        self.step = step
        self.start = start
        self.peak = start
        self.at_most = 0
        # A step the tracker opened itself, in a loop that marks none.
        self.auto = False
        self.t0 = time.perf_counter()
