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

The way in is this module: :func:`preflight` (``oomkit.preflight``),
:class:`Preflight` (what it returns) and ``PreflightError``. The rest of the package, bottom first
(docs/architecture.md draws it; ``scripts/check_deps.py`` holds each
module to its layer):

- ``settings``, ``result``, ``notes``: what a preflight runs with, what it
  answers, and what it says it assumed; no torch.
- ``record/``: the recorder of every allocation below autograd
  (``recorder``), the values of small tensors (``values``), which line is
  the user's (``frames``), the roles known from the objects (``roles``),
  and what a finished run hands the answer (``recording``).
- ``frameworks/``: what other libraries need under preflight (a Hugging
  Face model from its config, bitsandbytes' optimizers): a new
  framework's loader goes here.
- ``world/``: the fake GPU and every stand-in for CUDA, one ledger
  (``fake_gpu``), with what CUDA does differently (``cuda``, ``autocast``), its memory
  queries (``memory``), the meta kernels (``kernels``), ``torch.compile``
  (``compile``) and several GPUs (``dist``): a new stand-in goes here.
- ``driver`` (``oomkit.preflight()``'s steps) and ``fixes`` (the changes
  tried inside a script): they run in the world and record.
- ``answer`` (and ``snapshot``): a recording served through the allocator
  model.
- ``api``, ``script``, ``config``: the three ways a preflight starts
  (this function, ``oomkit preflight -- python train.py``, ``oomkit
  estimate --trace``), and ``warm``: the interpreter the command's runs
  after the first are forked from.

Importing this package imports no torch: the rest is imported when a
preflight runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from oomkit._native import PreflightError
from oomkit.preflight.result import Preflight
from oomkit.preflight.settings import DEFAULT_CAPACITY, DEFAULT_STEPS, DEFAULT_TIME_LIMIT, Optimizer, Settings

if TYPE_CHECKING:
    import torch

__all__ = ["Preflight", "PreflightError", "preflight"]


def preflight(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    *,
    micro_batch: int | None = None,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    step: Callable[[torch.nn.Module, Any, Any], Any] | None = None,
    optimizer: Optimizer = "adamw",
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    grad_accum: int = 1,
    steps: int = DEFAULT_STEPS,
    capacity: str = DEFAULT_CAPACITY,
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
    Bad settings raise ``PreflightError`` before anything runs. Imports
    torch when called, not when oomkit is imported.
    """
    settings = Settings(
        model=model,
        batch=batch,
        micro_batch=micro_batch,
        loss=loss,
        step=step,
        optimizer=optimizer,
        dtype=dtype,
        autocast=autocast,
        grad_accum=grad_accum,
        steps=steps,
        set_to_none=set_to_none,
        max_micro_batch=max_micro_batch,
        capacity=capacity,
        alloc_conf=alloc_conf,
        gpus=gpus,
        sharding=sharding,
        time_limit=time_limit,
        snapshot=snapshot,
    )
    from oomkit.preflight.api import measure

    return measure(settings)


# `oomkit.preflight` is this function (oomkit/__init__.py binds it there), and
# Python finds `import oomkit.preflight.world.cuda as cuda` through whatever
# stands at that name: where the function has no such attribute, the import
# looks for the module named after the function's `__name__` and the rest.
# Named as this package, it leads there.
preflight.__name__ = __name__
