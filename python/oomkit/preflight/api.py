"""``oomkit.preflight()``: the step recorded at a micro-batch and answered, and the largest micro-batch searched.

The package's ``preflight()`` builds the settings and calls :func:`measure`
here, so that importing oomkit imports no torch. Each run is the driver's
(``driver.record``), answered by ``answer.answer``; a step that needs
data, or runs past the time limit, is said in one line
(``PreflightError``).
"""

from __future__ import annotations

import dataclasses
import os

from oomkit import _native
from oomkit._native import PreflightError
from oomkit.preflight import driver
from oomkit.preflight.answer import answer, unsupported
from oomkit.preflight.record.recorder import PreflightStopped, StepUnsupportedError
from oomkit.preflight.result import Preflight
from oomkit.preflight.settings import Settings


def measure(settings: Settings) -> Preflight:
    """Runs the step as ``settings`` say and answers; with ``max_micro_batch``, also the largest micro-batch that fits."""
    result = once(settings)
    if settings.max_micro_batch is not None:
        _search(settings, result)
    return result


def once(settings: Settings) -> Preflight:
    """One run at ``settings.micro_batch``, answered (with its snapshot, where one is asked for)."""
    if settings.snapshot is not None and os.path.exists(settings.snapshot):
        raise PreflightError(f"{os.fspath(settings.snapshot)}: exists; preflight never overwrites a file")
    try:
        recording = driver.record(settings)
    except StepUnsupportedError as e:
        raise unsupported(e) from None
    except PreflightStopped as e:
        raise PreflightError(str(e)) from None
    return answer(recording, settings, settings.header())


def _search(settings: Settings, first: Preflight) -> None:
    """The largest micro-batch up to ``max_micro_batch`` that fits, by the project's one
    search (``oomkit_supervise::search``, through the binding), the first run reused."""
    assert settings.micro_batch is not None and settings.max_micro_batch is not None
    micro_batch, max_micro_batch = settings.micro_batch, settings.max_micro_batch
    effective = micro_batch * first.grad_accum
    if first.grad_accum > 1:
        # A micro-batch above the effective batch would change it, which accumulation exists to avoid.
        max_micro_batch = min(max_micro_batch, effective)

    def measure(b: int) -> tuple[bool, int]:
        # Each size tried is a run of its own, with no snapshot: the first run's is the one asked for.
        r = first if b == micro_batch else once(dataclasses.replace(settings, micro_batch=b, snapshot=None))
        # Within the capacity where it fits (what the limited allocator reserved), else what it needs.
        return r.fits, (r.capacity_bytes - r.margin_bytes) if r.fits else r.peak_reserved_bytes

    best, tried = _native.largest_that_fits(micro_batch, max_micro_batch, first.capacity_bytes, measure)
    first.tried = tried
    if best is not None:
        first.largest_micro_batch = best
        first.largest_grad_accum = max(1, -(-effective // best))
