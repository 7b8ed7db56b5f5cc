"""What one preflight runs with: one frozen object, built once and passed whole.

``oomkit.preflight()`` builds it from its arguments and ``oomkit
preflight`` from its flags (the JSON the command hands the script, read
by ``script.Launch``); the driver, the world and the answer read it and
never change it. A search over micro-batches runs each size with a copy
(``dataclasses.replace``). What a run turned out to be (the steps it
measured, the allocator settings a script set for itself) is the
recording's (``record.recording.Recording``), not the settings'.

Nothing here imports torch, so ``import oomkit`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from oomkit import _native
from oomkit._native import PreflightError

if TYPE_CHECKING:
    import torch

#: Steps run by default: the first creates the optimizer's state, the
#: second runs with it in place, as every later step does.
DEFAULT_STEPS = 2

#: How long a preflight may run, in seconds, before it is stopped: a step
#: on meta tensors takes seconds, and a loop that has not ended by then is
#: taken not to end (one that waits on a value taken as zero).
DEFAULT_TIME_LIMIT = 300.0

#: The capacity a preflight is measured against unless told otherwise.
DEFAULT_CAPACITY = "H100"

#: Every way of spreading a model over GPUs preflight runs: FSDP's (``fsdp``
#: and ``zero3`` free the gathered parameters after forward, ``zero2`` keeps
#: them until backward), DDP (every GPU keeps the whole model; ZeRO stage 0),
#: and DDP with PyTorch's ZeroRedundancyOptimizer (each GPU keeps a share of
#: the optimizer's state; ZeRO-1).
STRATEGIES = ("fsdp", "zero3", "zero2", "ddp", "zero1")

#: The optimizer: a name (``driver.OPTIMIZERS``), a function of the parameters, or none.
Optimizer = Union[str, Callable[[Any], Any], None]


@dataclass(frozen=True)
class Settings:
    """Everything one preflight runs with: the step (for ``oomkit.preflight()``; a script
    brings its own), its precision and accumulation, how many steps, and what it is
    measured against (capacity, allocator settings, GPUs and sharding, time limit).

    Built once and checked as it is built: a bad value raises ``PreflightError``
    before anything runs.
    """

    #: The model, or a function that builds one (built on ``meta``); None for a script.
    model: Any = None
    #: A batch, or a function of the micro-batch size that makes one; None for a script.
    batch: Any = None
    #: The micro-batch ``batch`` is called with (None: ``batch`` is the batch itself).
    micro_batch: int | None = None
    #: ``loss(model, batch)``, the loss backward runs from (None: the model's own, or its output's mean).
    loss: Callable[[Any, Any], Any] | None = None
    #: ``step(model, batch, optimizer)``: the whole step, in place of loss, backward and the optimizer's step.
    step: Callable[[Any, Any, Any], Any] | None = None
    optimizer: Optimizer = "adamw"
    #: The dtype the model is cast to (None: as built).
    dtype: torch.dtype | None = None
    #: The dtype ``torch.autocast("cuda")`` runs forward and loss in (None: no autocast).
    autocast: torch.dtype | None = None
    #: Micro-batches accumulated per optimizer step.
    grad_accum: int = 1
    #: Optimizer steps run.
    steps: int = DEFAULT_STEPS
    #: ``zero_grad(set_to_none=...)``: False keeps the gradients allocated between steps.
    set_to_none: bool = True
    #: Search the largest micro-batch up to this that fits (None: no search).
    max_micro_batch: int | None = None
    #: The capacity as given (``80GiB``, ``H100``).
    capacity: str = DEFAULT_CAPACITY
    #: What the allocator may hold, worked out from ``capacity`` (a GPU's name takes its CUDA context off).
    capacity_bytes: int = field(init=False)
    #: ``PYTORCH_CUDA_ALLOC_CONF`` settings the allocator is modelled with.
    alloc_conf: str | None = None
    #: The step runs as one of this many GPUs.
    gpus: int = 1
    #: How the model is spread over ``gpus`` (one of ``STRATEGIES``).
    sharding: str = "fsdp"
    #: Seconds before a run still going is stopped (None: no limit).
    time_limit: float | None = DEFAULT_TIME_LIMIT
    #: Where to write the snapshot of the run (None: none is written).
    snapshot: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.grad_accum < 1 or self.steps < 1 or self.gpus < 1:
            raise PreflightError(f"grad_accum, steps and gpus must be at least 1 (got {self.grad_accum}, {self.steps} and {self.gpus})")
        if self.gpus > 1 and self.sharding not in STRATEGIES:
            raise PreflightError(f"sharding {self.sharding!r}: give one of {', '.join(STRATEGIES)}")
        if self.max_micro_batch is not None and not callable(self.batch):
            raise PreflightError("max_micro_batch needs batch to be a function of the micro-batch size")
        if callable(self.batch) and self.micro_batch is None:
            raise PreflightError("batch is a function: give micro_batch, the size to call it with")
        # Frozen: the one field worked out from another is set here, as the settings are built.
        object.__setattr__(self, "capacity_bytes", _native.parse_capacity(self.capacity)[0])
        if self.alloc_conf is not None:
            # Checked before running anything, so a typo costs no step.
            _native.realize_ops([], [], [], self.alloc_conf, None)

    def header(self) -> dict[str, Any]:
        """What the snapshot's header says of the step beyond the counts: its precision and its GPUs."""
        return {
            "dtype": str(self.dtype) if self.dtype else None,
            "autocast": str(self.autocast) if self.autocast else None,
            "gpus": self.gpus,
            "sharding": self.sharding if self.gpus > 1 else None,
        }
