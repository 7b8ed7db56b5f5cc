"""Will it fit? The user's own training step, run on tensors without memory.

``preflight`` builds the model on PyTorch's ``meta`` device (shapes and
dtypes, no memory), runs a few full training steps on it (forward,
backward, optimizer step, with gradient accumulation and autocast as the
real loop has them), records every allocation and free the GPU would make
with its Python stack and its role, and serves them through oomkit's model
of the CUDA caching allocator. The answer is the peak allocated and
reserved memory, what held it by role and by line, whether it fits a
capacity, the largest micro-batch that does, and a snapshot file that
``oomkit analyze``, ``report`` and ``whatif`` open like a recorded one.
Nothing is allocated on a GPU, and the model's weights are never allocated.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from oomkit import _native
from oomkit._native import PreflightError
from oomkit._preflight_answer import Preflight
from oomkit._preflight_dist import STRATEGIES
from oomkit._preflight_driver import DEFAULT_STEPS, _Run
from oomkit._preflight_record import DEFAULT_TIME_LIMIT

__all__ = ["Preflight", "PreflightError", "preflight"]


def preflight(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any | Callable[[int], Any],
    *,
    micro_batch: int | None = None,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    step: Callable[[torch.nn.Module, Any, torch.optim.Optimizer | None], Any] | None = None,
    optimizer: str | Callable[[Any], torch.optim.Optimizer] | None = "adamw",
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    grad_accum: int = 1,
    steps: int = DEFAULT_STEPS,
    capacity: str = "H100",
    alloc_conf: str | None = None,
    snapshot: str | os.PathLike[str] | None = None,
    max_micro_batch: int | None = None,
    set_to_none: bool = True,
    gpus: int = 1,
    sharding: str = "fsdp",
    time_limit: float | None = DEFAULT_TIME_LIMIT,
) -> Preflight:
    """Runs ``steps`` training steps on tensors without memory and says whether they fit ``capacity``.

    ``model`` is a module or a function that builds one (built on ``meta``,
    so its weights are never allocated); ``batch`` is a batch or a function
    of the micro-batch size that makes one. The step is ``loss(model,
    batch)`` then ``backward`` then the optimizer's step, or the whole of
    ``step(model, batch, optimizer)`` where given; ``set_to_none=False``
    zeroes the gradients instead of freeing them after each step, as
    ``zero_grad()`` did before PyTorch 2.0 (and the Trainer with it), which
    keeps them allocated throughout. With ``max_micro_batch``
    it also searches the largest micro-batch up to it that fits (with
    accumulation, up to the effective batch ``micro_batch x grad_accum``,
    which the accumulation found for it keeps). With ``gpus`` above 1 the
    model is spread over that many GPUs and the answer is one GPU's:
    sharded with FSDP (``sharding="fsdp"`` or ``"zero3"`` frees the gathered
    parameters after forward, ``"zero2"`` keeps them until backward) or
    replicated with DDP (``"ddp"``), or replicated with each GPU keeping a
    share of the optimizer's state (``"zero1"``: DDP and PyTorch's
    ``ZeroRedundancyOptimizer``). A run still going after ``time_limit``
    seconds (a loop waiting on a value the step does not have; ``None``: no
    limit) stops with a ``PreflightError`` that says what ran and where.
    """
    if grad_accum < 1 or steps < 1 or gpus < 1:
        raise PreflightError(f"grad_accum, steps and gpus must be at least 1 (got {grad_accum}, {steps} and {gpus})")
    if gpus > 1 and sharding not in STRATEGIES:
        raise PreflightError(f"sharding {sharding!r}: give one of {', '.join(STRATEGIES)}")
    if max_micro_batch is not None and not callable(batch):
        raise PreflightError("max_micro_batch needs batch to be a function of the micro-batch size")
    if callable(batch) and micro_batch is None:
        raise PreflightError("batch is a function: give micro_batch, the size to call it with")
    capacity_bytes, _label = _native.parse_capacity(capacity)
    if alloc_conf is not None:
        # Checked before running anything, so a typo costs no step.
        _native.realize_ops([], [], [], alloc_conf, None)
    run = _Run(model, batch, loss, step, optimizer, dtype, autocast, grad_accum, steps, capacity, capacity_bytes, alloc_conf)
    run.set_to_none = set_to_none
    run.gpus, run.sharding = gpus, sharding
    run.time_limit = time_limit
    result = run.once(micro_batch, snapshot)
    if max_micro_batch is not None:
        assert micro_batch is not None
        _search(run, result, micro_batch, max_micro_batch)
    return result


def _search(run: _Run, first: Preflight, micro_batch: int, max_micro_batch: int) -> None:
    """The largest micro-batch up to ``max_micro_batch`` that fits, by the project's one
    search (``oomkit_supervise::search``, through the binding), the first run reused."""
    effective = micro_batch * first.grad_accum
    if first.grad_accum > 1:
        # A micro-batch above the effective batch would change it, which accumulation exists to avoid.
        max_micro_batch = min(max_micro_batch, effective)

    def measure(b: int) -> tuple[bool, int]:
        r = first if b == micro_batch else run.once(b, None)
        # Within the capacity where it fits (what the limited allocator reserved), else what it needs.
        return r.fits, (r.capacity_bytes - r.margin_bytes) if r.fits else r.peak_reserved_bytes

    best, tried = _native.largest_that_fits(micro_batch, max_micro_batch, first.capacity_bytes, measure)
    first.tried = tried
    if best is not None:
        first.largest_micro_batch = best
        first.largest_grad_accum = max(1, -(-effective // best))
