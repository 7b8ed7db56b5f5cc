"""A preflight's answer: what was recorded, served through the allocator model.

The recorded allocations and frees go through oomkit's model of the CUDA
caching allocator (``_native.realize_ops``) once without a limit (the
peaks) and once at the capacity (whether it fits); the roles and the
lines are read at the allocated peak, in the allocator's blocks; the
snapshot, where asked for, is written in PyTorch's format; and an
operation that cannot run without data is said in one line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from oomkit import _native
from oomkit._native import PreflightError
from oomkit._preflight_frames import user_line
from oomkit._preflight_record import Recorder, StepUnsupportedError, Trace
from oomkit._preflight_roles import Known
from oomkit._preflight_snapshot import write_snapshot

#: The roles an answer tells memory by, in the order a report lists them (docs/roles.md;
#: ``kv_cache``: held across forwards and read by a later one, as a generation's cache is).
ROLES = ("parameters", "gradients", "optimizer_state", "activations", "kv_cache", "temporaries", "inputs", "other")

#: Lines listed in the answer, largest first.
TOP_LINES = 10


@dataclass
class Preflight:
    """What a preflight measured for one micro-batch, and the search's answer."""

    #: The micro-batch each step ran with.
    micro_batch: int | None
    #: Micro-batches accumulated per optimizer step.
    grad_accum: int
    #: Optimizer steps run.
    steps: int
    #: The most memory handed out at once, in the allocator's rounded blocks.
    peak_allocated_bytes: int
    #: The most memory the allocator reserved from the device.
    peak_reserved_bytes: int
    #: Reserved but not handed out when reserved peaked (fragmentation and cache).
    free_in_segments_at_peak_bytes: int
    #: What the allocator may hold: the capacity given, less the CUDA context for a GPU's name.
    capacity_bytes: int
    #: The capacity as given (``80GiB``, ``H100``).
    capacity: str
    #: No allocation failed when the allocator was limited to the capacity.
    fits: bool
    #: The capacity less the peak reserved (negative when it does not fit).
    margin_bytes: int
    #: Bytes live at the allocated peak, by role (``parameters``, ``gradients``,
    #: ``optimizer_state``, ``activations``, ``kv_cache``, ``temporaries``, ``inputs``, ``other``).
    by_role: dict[str, int]
    #: The user's lines holding the most at the allocated peak: ``{"line", "bytes", "role"}``.
    by_line: list[dict[str, Any]]
    #: Allocations recorded and trace entries written.
    allocations: int
    #: What the preflight assumed or could not do, in words.
    notes: list[str] = field(default_factory=list)
    #: The snapshot written, if one was asked for.
    snapshot: str | None = None
    #: Micro-batches tried by the search and whether each fitted.
    tried: list[tuple[int, bool]] = field(default_factory=list)
    #: The largest micro-batch that fits, when a search ran (None: not even the smallest).
    largest_micro_batch: int | None = None
    #: The accumulation that keeps the effective batch at the largest micro-batch.
    largest_grad_accum: int | None = None
    #: ``training`` (optimizer steps, or backward passes) or ``inference`` (forwards alone, the whole run measured).
    mode: str = "training"
    #: Top-level forwards of the model run (a module's forward called outside any other's).
    forwards: int = 0
    #: The most allocated while each phase ran (``setup``, ``inputs``, ``forward``,
    #: ``backward``, ``optimizer``, and ``eval``: forwards without gradients in a
    #: script that trains), in the allocator's blocks.
    phase_peaks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The answer as plain data (what ``json.dumps`` writes)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        # The same report `oomkit preflight` prints, from the one renderer.
        return _native.preflight_text(json.dumps(self.as_dict()))


@dataclass
class Settings:
    """What a preflight ran with, as its answer and snapshot header state it."""

    micro_batch: int | None
    grad_accum: int
    steps: int
    capacity: str
    capacity_bytes: int
    alloc_conf: str | None
    #: ``training`` or ``inference`` (forwards alone).
    mode: str = "training"


def answer(
    rec: Recorder,
    known: Known,
    settings: Settings,
    snapshot: str | os.PathLike[str] | None,
    header: dict[str, Any],
    extra_notes: list[str] | None = None,
) -> Preflight:
    """Serves what ``rec`` recorded through the allocator model and answers; writes the snapshot if asked."""
    tr = rec.trace
    roles = known.roles(tr)
    realized, capped = _served(tr, settings.alloc_conf, settings.capacity_bytes)
    peak_reserved, peak_allocated, _peak_op, free_at_peak, _ = realized[2]
    fits = not capped[2][4]
    by_role, by_line = _at_peak(tr, roles, realized[3][0])
    notes = _notes(tr, known, settings.mode) + (extra_notes or [])
    result = Preflight(
        micro_batch=settings.micro_batch,
        grad_accum=settings.grad_accum,
        steps=settings.steps,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        free_in_segments_at_peak_bytes=free_at_peak,
        capacity_bytes=settings.capacity_bytes,
        capacity=settings.capacity,
        fits=fits,
        margin_bytes=settings.capacity_bytes - (capped[2][0] if fits else peak_reserved),
        by_role=by_role,
        by_line=by_line,
        allocations=sum(1 for k in tr.kinds if k == 0),
        notes=notes,
        mode=settings.mode,
        forwards=rec.forwards,
        phase_peaks=_phase_peaks(tr, realized[3][0]),
    )
    if snapshot is not None:
        full = {
            "micro_batch": settings.micro_batch,
            "grad_accum": settings.grad_accum,
            "steps": settings.steps,
            "capacity": settings.capacity,
            **header,
            "torch": str(torch.__version__),
            "oomkit": _native.__version__,
            "notes": notes,
        }
        try:
            write_snapshot(snapshot, realized, tr.stacks, tr.stack_of, roles, settings.alloc_conf, full, tr.library)
        except OSError as e:
            raise PreflightError(f"{os.fspath(snapshot)}: {e.strerror or e}") from None
        result.snapshot = os.fspath(snapshot)
    return result


def replayed(rec: Recorder, settings: Settings, alloc_conf: str) -> dict[str, Any]:
    """The recorded step served through the allocator model again under ``alloc_conf``
    (the same capacity): what a run with those settings measures, without the run."""
    realized, capped = _served(rec.trace, alloc_conf, settings.capacity_bytes)
    peak_reserved, peak_allocated = realized[2][0], realized[2][1]
    return {
        "alloc_conf": alloc_conf,
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_bytes": peak_reserved,
        "fits": not capped[2][4],
    }


def _served(tr: Trace, alloc_conf: str | None, capacity_bytes: int) -> tuple[Any, Any]:
    """The recorded step served through the allocator model without a limit (its peaks) and
    limited to the capacity (whether it fits)."""
    streams = [0] * len(tr.kinds)
    realized = _native.realize_ops(tr.kinds, tr.args, streams, alloc_conf, None)
    capped = _native.realize_ops(tr.kinds, tr.args, streams, alloc_conf, capacity_bytes)
    return realized, capped


def unsupported(e: StepUnsupportedError) -> PreflightError:
    """The one line for an operation that needs data."""
    module = f", in {e.module}'s forward" if e.module else ""
    fix = "give the operator a fake implementation (torch.library.register_fake), " if e.needs_kernel else ""
    return PreflightError(
        f"preflight cannot run {e.op} without data (at {e.where}{module}: {e.reason}); "
        f"{fix}run that part outside the step, or estimate it with `oomkit estimate`"
    )


def _at_peak(tr: Trace, roles: dict[int, str], allocated_after: list[int]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Bytes live at the allocated peak, by role and by the user's line, in the allocator's blocks.

    ``allocated_after`` is the allocator model's allocated bytes after each
    operation: the peak is where it is highest (the headline's figure), and
    each allocation counts the block it was handed (the request rounded,
    plus a remainder too small to split off), so the roles add up to the
    peak allocated exactly, as ``max_memory_allocated`` counts it.
    """
    peak_at = max(range(len(allocated_after)), key=allocated_after.__getitem__, default=-1)
    freed_by = {arg: i for i, (kind, arg) in enumerate(zip(tr.kinds, tr.args)) if kind == 1}
    by_role = dict.fromkeys(ROLES, 0)
    lines: dict[tuple[str, str], int] = {}
    for i in range(peak_at + 1):
        if tr.kinds[i] != 0 or freed_by.get(i, len(tr.kinds)) <= peak_at:
            continue
        size = allocated_after[i] - (allocated_after[i - 1] if i else 0)
        role = roles.get(i, "other")
        by_role[role] = by_role.get(role, 0) + size
        key = (user_line(tr.stacks[tr.stack_of[i]]), role)
        lines[key] = lines.get(key, 0) + size
    by_line = [{"line": line, "role": role, "bytes": b} for (line, role), b in sorted(lines.items(), key=lambda kv: -kv[1])[:TOP_LINES]]
    return by_role, by_line


def _phase_peaks(tr: Trace, allocated_after: list[int]) -> dict[str, int]:
    """The most allocated after any operation of each phase: an evaluation's own peak beside training's."""
    peaks: dict[str, int] = {}
    for phase, allocated in zip(tr.phases, allocated_after):
        if allocated > peaks.get(phase, -1):
            peaks[phase] = allocated
    return peaks


def _notes(tr: Trace, known: Known, mode: str) -> list[str]:
    notes = [
        "sizes are the CUDA allocator's, modelled; the CUDA context is outside them (a GPU's name as the capacity takes it off)",
    ]
    if tr.library:
        if len(tr.library) == 1:
            notes.append("includes cuBLAS's workspace, allocated at the first matrix multiply")
        else:
            notes.append(
                f"includes cuBLAS's {len(tr.library)} workspaces, one for each thread that multiplies matrices "
                "(the forward's and autograd's backward thread), allocated at each one's first"
            )
    if tr.assumed:
        where = sorted({w for _, w in tr.assumed})
        notes.append(
            f"{len(tr.assumed)} value(s) read from tensors without data were taken as 0 "
            f"(first at {where[0]}); a step whose memory depends on data may differ"
        )
    if not known.grads and mode == "training":
        notes.append("no parameter received a gradient: nothing was trained")
    return notes
