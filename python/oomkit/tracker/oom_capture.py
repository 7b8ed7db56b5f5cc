"""Writing an OOM the moment it happens.

The record, a snapshot where history is recorded, the diagnosis on
stderr, the plan's step down under torchrun; and the CUDA allocator's OOM
observer, which sees an OOM a framework swallows.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional

from oomkit import _native, _plan
from oomkit.tracker.measure import _torch

if TYPE_CHECKING:
    from oomkit.tracker.core import TrackerCore


def start_history(tracker: TrackerCore, max_entries: int) -> None:
    torch = _torch()
    if not tracker.meter.cuda:
        tracker.say("record_history needs CUDA; not recording on this device")
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    tracker.books.history = True

#: A limit the allocator's OOM observer passes below this share of the
#: device's memory is a cap the process set (set_per_process_memory_fraction).
CAP_BELOW_TOTAL = 0.99


def write_oom(
    tracker: TrackerCore, message: str, requested: Optional[int], limits: Optional[tuple[Optional[int], Optional[int]]] = None
) -> None:
    """Writes an OOM record for the open step, stage and phase, checks duplicates, dumps a snapshot, and prints the diagnosis.

    ``limits`` is the process's own cap (None without one) and what the
    driver had free, where the caller knows them; else the message says them.
    """
    if tracker.books.writing_oom:
        return
    tracker.books.writing_oom = True
    try:
        write_oom_now(tracker, message, requested, limits)
    finally:
        tracker.books.writing_oom = False

def write_oom_now(
    tracker: TrackerCore, message: str, requested: Optional[int], limits: Optional[tuple[Optional[int], Optional[int]]] = None
) -> None:
    step = tracker.current_step
    phase = tracker.current_phase
    stage = tracker.books.stage.name if tracker.books.stage is not None else None
    snapshot = None
    if tracker.books.history:
        snapshot = os.path.join(
            os.path.dirname(str(tracker.log_path)),
            f"oom-step{step}-rank{tracker.rank}-{int(time.time())}.pickle",
        )
        try:
            _torch().cuda.memory._dump_snapshot(snapshot)
        except Exception as e:  # noqa: BLE001
            tracker.report_error("dump snapshot", e)
            snapshot = None
    with contextlib.suppress(Exception):
        # What the failing stage reached up to now, into its open measures.
        tracker.sample()
    peak = max([o.peak for o in tracker.books.open] + [0])
    # The process's own cap and what the driver had free, as the message says
    # them at the failure (the allocator's figures, not read afterwards).
    if limits is None:
        limits = _native.oom_limits(message) if message else (None, None)
    allowed, free = limits
    tracker.write(
        {
            "type": "oom",
            "time": time.time(),
            "step": step,
            "stage": stage or phase,
            "phase": phase,
            "requested_bytes": requested,
            "message": message[:2000],
            "memory": {
                "allocated_bytes": tracker.meter.now(),
                "reserved_bytes": tracker.meter.reserved(),
                "peak_bytes": peak,
                "capacity_bytes": tracker.meter.capacity,
                "allowed_bytes": allowed,
                "free_bytes": free,
            },
            "snapshot": snapshot,
        }
    )
    _plan.report_oom(message, step, stage or phase, snapshot)
    # Under torchrun, a trainer's plan steps down for every rank's restart
    # (auto_batch does its own, from the exception it sees).
    if _plan.active() is None and tracker.books.plan_fields:
        _plan.elastic_step_down(tracker.books.plan_fields, message, tracker.rank)
    tracker.find_duplicates(when="oom")
    tracker.log.flush()
    report = _native.analyze_run_text(tracker.log_path)
    sys.stderr.write(f"\noomkit (rank {tracker.rank}): out of memory, diagnosis\n{report}\n")
    sys.stderr.flush()

def on_allocator_oom(tracker: TrackerCore, device: int, alloc: int, device_limit: int, device_free: int) -> None:
    """Records an OOM the CUDA allocator reports, at the failing allocation, even if a framework swallows the error.

    The allocator passes the device, the bytes asked for, the memory the
    process may use (the device's, or the cap a memory fraction sets)
    and the bytes the driver reports free; it releases its lock first.
    """
    try:
        if tracker.books.closed or device != getattr(tracker.meter, "index", None):
            return
        # The limit is the device's (cudaMemGetInfo's total, which may differ a
        # little from the properties' total), or the process's own cap where a
        # memory fraction lowers it clearly below.
        total = getattr(tracker.meter, "capacity", None)
        allowed = int(device_limit) if total and device_limit < total * CAP_BELOW_TOTAL else None
        write_oom(
            tracker,
            f"CUDA out of memory (seen by the allocator): tried to allocate {alloc} bytes "
            f"with {device_free} bytes free of {device_limit} on GPU {device}",
            int(alloc),
            (allowed, int(device_free)),
        )
        # The exception that follows is this same OOM.
        tracker.books.observed_oom = True
    except Exception as e:  # noqa: BLE001
        tracker.report_error("allocator oom observer", e)


# Trackers on CUDA that hear the allocator's OOM observer; the observer
# cannot be removed once attached, so one is attached per process.
_WATCHERS: weakref.WeakSet[TrackerCore] = weakref.WeakSet()
_OBSERVER_ATTACHED = False


def _allocator_oom(device: int, alloc: int, device_limit: int, device_free: int) -> None:
    for t in list(_WATCHERS):
        on_allocator_oom(t, device, alloc, device_limit, device_free)


def _watch_allocator_ooms(tracker: TrackerCore) -> None:
    """Has the CUDA allocator tell ``tracker`` of every OOM, where torch offers the (private) observer."""
    global _OBSERVER_ATTACHED
    _WATCHERS.add(tracker)
    if _OBSERVER_ATTACHED:
        return
    try:
        attach = getattr(_torch()._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(_allocator_oom)
            _OBSERVER_ATTACHED = True
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("allocator oom observer", exc)


def _forget_tracker(tracker: TrackerCore) -> None:
    _WATCHERS.discard(tracker)


@contextlib.contextmanager
def record_history(path: str | os.PathLike[str], max_entries: int = 100_000) -> Iterator[None]:
    """Records CUDA allocation history inside the block and dumps a snapshot to `path` when it ends."""
    torch = _torch()
    if not torch.cuda.is_available():
        sys.stderr.write("oomkit: record_history needs CUDA; nothing is recorded\n")
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
    finally:
        try:
            torch.cuda.memory._dump_snapshot(os.fspath(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
