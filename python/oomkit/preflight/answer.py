"""A preflight's answer: what a run recorded, served through the allocator model.

The recorded allocations and frees go through oomkit's model of the CUDA
caching allocator (``_native.realize_ops``) once without a limit (the
peaks) and once at the capacity (whether it fits); the roles and the
lines are read at the allocated peak, in the allocator's blocks; the
notes of the run are collected with the answer's own; the snapshot,
where asked for, is written in PyTorch's format; and an operation that
cannot run without data is said in one line.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from oomkit import _native
from oomkit._native import PreflightError
from oomkit.preflight.record.frames import user_line
from oomkit.preflight.record.out_of_memory import REFUSED
from oomkit.preflight.record.recorder import StepUnsupportedError, Trace
from oomkit.preflight.record.recording import TRAINING, Recording
from oomkit.preflight.record.roles import Known
from oomkit.preflight.result import ROLES, Preflight
from oomkit.preflight.settings import Settings
from oomkit.preflight.snapshot import write_snapshot

#: Lines listed in the answer, largest first.
TOP_LINES = 10


def answer(recording: Recording, settings: Settings, header: dict[str, Any]) -> Preflight:
    """Serves what ``recording`` holds through the allocator model and answers, with the
    run's notes after the answer's own; writes ``settings.snapshot`` if asked, stating
    the settings and ``header`` (what else the run was: its precision, or its command)."""
    rec, known = recording.recorder, recording.known
    tr = rec.trace
    roles = known.roles(tr)
    realized, fits = _served(tr, recording.alloc_conf, recording.capacity_bytes)
    peak_reserved, peak_allocated, _peak_op, free_at_peak, _ = realized[2]
    allocated_after = since = realized[3][0]
    went_on_from = max(_after_last_refusal(tr), tr.measured_from)
    if not 0 < went_on_from < len(allocated_after):
        went_on_from = 0
    else:
        # The script caught the GPU's error and went on (a smaller batch), or searched its batch
        # size first: its figures are of what it ran after, not of the attempts.
        reserved_after = realized[3][1]
        at = max(range(went_on_from, len(reserved_after)), key=reserved_after.__getitem__)
        peak_reserved, free_at_peak = reserved_after[at], reserved_after[at] - allocated_after[at]
        since = [0] * went_on_from + allocated_after[went_on_from:]
        peak_allocated = max(since)
    by_role, by_line = _at_peak(tr, roles, allocated_after, went_on_from)
    notes = _notes(tr, known, recording.mode) + recording.notes
    if by_role.get("ema"):
        notes.append(
            "an EMA of the weights (a copy the script keeps in step with them between steps) is on the GPU at the peak "
            "(role ema); kept on the CPU, as AveragedModel(model, device='cpu') or timm's ModelEmaV3(model, device='cpu') "
            "keep it, it would take that off, for a copy from the GPU at each update"
        )
    result = Preflight(
        micro_batch=settings.micro_batch,
        grad_accum=settings.grad_accum,
        steps=recording.steps,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        free_in_segments_at_peak_bytes=free_at_peak,
        capacity_bytes=recording.capacity_bytes,
        capacity=settings.capacity,
        fits=fits,
        margin_bytes=recording.capacity_bytes - (realized[2][0] if fits else peak_reserved),
        by_role=by_role,
        by_line=by_line,
        allocations=sum(1 for k in tr.kinds if k == 0),
        notes=notes,
        mode=recording.mode,
        forwards=rec.forwards,
        phase_peaks=_phase_peaks(tr, since),
        # (A step that completed before the GPU ran out is what it was; a batch-size search's trials are none.)
        step_peaks=_step_peaks(tr, allocated_after, went_on_from)[sum(1 for end in tr.step_ends if end <= tr.measured_from) :],
        host_peak_bytes=rec.host.peak_bytes,
        host_pinned_peak_bytes=rec.host.pinned_peak_bytes,
        host_paged_peak_bytes=rec.host.paged_peak_bytes,
    )
    snapshot = settings.snapshot
    if snapshot is not None:
        full = {
            "micro_batch": settings.micro_batch,
            "grad_accum": settings.grad_accum,
            "steps": recording.steps,
            "capacity": settings.capacity,
            **header,
            "torch": str(torch.__version__),
            "oomkit": _native.__version__,
            "notes": notes,
        }
        try:
            write_snapshot(snapshot, realized, tr.stacks, tr.stack_of, roles, recording.alloc_conf, full, tr.library)
        except OSError as e:
            raise PreflightError(f"{os.fspath(snapshot)}: {e.strerror or e}") from None
        result.snapshot = os.fspath(snapshot)
    return result


def replayed(recording: Recording, alloc_conf: str) -> dict[str, Any]:
    """The recorded step served through the allocator model again under ``alloc_conf``
    (the same capacity): what a run with those settings measures, without the run."""
    tr = recording.recorder.trace
    served, fits = _served(tr, alloc_conf, recording.capacity_bytes)
    peak_reserved, peak_allocated = served[2][:2]
    return {
        "alloc_conf": alloc_conf,
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_bytes": peak_reserved,
        "fits": fits,
    }


def _after_last_refusal(tr: Trace) -> int:
    """The first allocation after the last one refused as the step ran (0 where none was): the
    script went on from there, once the attempt that ran out had let go of its tensors."""
    try:
        last = len(tr.kinds) - 1 - tr.kinds[::-1].index(REFUSED)
    except ValueError:
        return 0
    return next((i for i in range(last + 1, len(tr.kinds)) if tr.kinds[i] == 0), len(tr.kinds))


def _fits(tr: Trace, capped: Any) -> bool:
    """Whether no allocation failed at the capacity, but those the script saw fail and went on from
    (``record/out_of_memory.py``: refused as the step ran, kind 3)."""
    return all(tr.kinds[i] == REFUSED for i in capped[2][4])


def _served(tr: Trace, alloc_conf: str | None, capacity_bytes: int) -> tuple[Any, bool]:
    """The recorded step served through the allocator model, and whether it fits the capacity.

    Where it fits, as served within the capacity, as the GPU serves it: where
    it came close, the allocator released its cache and retried (and where
    the script caught an error, it ran out), which the model without a limit
    never does. Where it does not, as served without a limit, for the peaks
    it would have reached; only then is it served a second time.
    """
    streams = tr.streams()
    capped = _native.realize_ops(tr.kinds, tr.args, streams, alloc_conf, capacity_bytes)
    if _fits(tr, capped):
        return capped, True
    return _native.realize_ops(tr.kinds, tr.args, streams, alloc_conf, None), False


def unsupported(e: StepUnsupportedError) -> PreflightError:
    """The one line for an operation that needs data."""
    module = f", in {e.module}'s forward" if e.module else ""
    fix = "give the operator a fake implementation (torch.library.register_fake), " if e.needs_kernel else ""
    return PreflightError(
        f"preflight cannot run {e.op} without data (at {e.where}{module}: {e.reason}); "
        f"{fix}run that part outside the step, or estimate it with `oomkit estimate`"
    )


def _at_peak(tr: Trace, roles: dict[int, str], allocated_after: list[int], since: int = 0) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Bytes live at the allocated peak, by role and by the user's line, in the allocator's blocks.

    ``allocated_after`` is the allocator model's allocated bytes after each
    operation: the peak is where it is highest (the headline's figure), and
    each allocation counts the block it was handed (the request rounded,
    plus a remainder too small to split off), so the roles add up to the
    peak allocated exactly, as ``max_memory_allocated`` counts it. The peak
    is looked for from operation ``since`` on (after the GPU last ran out).
    """
    peak_at = max(range(since, len(allocated_after)), key=allocated_after.__getitem__, default=-1)
    freed_by = {arg: i for i, (kind, arg) in enumerate(zip(tr.kinds, tr.args)) if kind == 1}
    by_role = dict.fromkeys(ROLES, 0)
    lines: dict[tuple[str, str], int] = {}
    # Many allocations share a stack (each block of a deep network's): its line is found once.
    line_of: dict[int, str] = {}
    for i in range(peak_at + 1):
        if tr.kinds[i] != 0 or freed_by.get(i, len(tr.kinds)) <= peak_at:
            continue
        size = allocated_after[i] - (allocated_after[i - 1] if i else 0)
        role = roles.get(i, "other")
        by_role[role] = by_role.get(role, 0) + size
        sid = tr.stack_of[i]
        line = line_of.get(sid)
        if line is None:
            line = line_of[sid] = user_line(tr.stacks[sid])
        key = (line, role)
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


def _step_peaks(tr: Trace, allocated_after: list[int], went_on_from: int = 0) -> list[int]:
    """The most allocated during each optimizer step, set-up left out of the first.

    A step's own peak, as a script that resets the peak at each step logs
    it (``reset_peak_memory_stats()``; torchtune does): the first often runs
    without the optimizer's state, which the later ones hold throughout. The
    step in which the script went on after the GPU last ran out counts from
    there (``went_on_from``), not its attempts that ran out.
    """
    start = next((i for i, phase in enumerate(tr.phases) if phase != "setup"), len(tr.phases))
    peaks = []
    for end in tr.step_ends:
        if start < went_on_from < end:
            start = went_on_from
        # What was allocated as the step began counts, if nothing in it went higher.
        held = allocated_after[start - 1] if start else 0
        peaks.append(max(allocated_after[start:end], default=held))
        start = end
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
    if tr.worst_sized:
        first_op, first_at = tr.worst_sized[0]
        notes.append(
            f"{len(tr.worst_sized)} operation(s) whose result's size depends on data the step does not have were sized "
            f"at their largest: every element selected, every box kept, masks that split one tensor (a router's idx == i) "
            f"sharing its elements (first {first_op} at {first_at}); "
            "a step on real data holds at most that there"
        )
    if not known.grads and not known.graded and mode == TRAINING:
        notes.append("no parameter received a gradient: nothing was trained")
    return notes
