"""Triton kernels a script or a library launches itself, on the fake GPU: launched as nothing.

A kernel written in Triton (TRL's chunked log-probabilities, Liger's
fused losses, a fused norm) writes into tensors the step allocated through
PyTorch before the launch; the launch allocates nothing through the
caching allocator. A library takes that path once a tensor says it is on
CUDA, as tensors on the fake GPU do. Without a GPU, Triton cannot load
its driver ("libcuda.so cannot found"), and on tensors without data there
is nothing to compute, so each launch, autotuned or not, returns at once,
and the answer says so. ``torch.compile``'s own kernels never come here
(its graphs are measured by ``world.compile``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from oomkit.preflight.notes import Notes


def skipped(kernel: str) -> str:
    """The note a run whose script launched Triton kernels carries (``kernel``: the first one)."""
    return (
        f"the script's Triton kernels (first {kernel}) were launched as nothing: each writes into "
        "tensors the step allocated through PyTorch, which are counted"
    )


def launch_stand_ins(notes: Notes) -> list[tuple[Any, str, Any]]:
    """Triton's launches (a kernel's and an autotuner's ``run``) as nothing, as (owner, name, value)
    for the fake GPU's ledger; none where Triton is not installed, or does not import."""
    if importlib.util.find_spec("triton") is None:
        return []
    try:
        from triton.runtime import autotuner, jit
    except Exception:  # noqa: BLE001 - a Triton that does not import is one the script cannot launch either
        return []

    first: list[str] = []

    def launched(self: Any, *_: Any, **__: Any) -> None:
        if not first:
            fn = getattr(self, "fn", self)
            first.append(getattr(fn, "__name__", type(fn).__name__))
            notes.add(skipped(first[0]))

    found = [(jit.JITFunction, "run", launched)]
    for name in ("Autotuner", "Heuristics"):
        cls = getattr(autotuner, name, None)
        if cls is not None and hasattr(cls, "run"):
            found.append((cls, "run", launched))
    return found
