"""The GPU running out as the script sees it: CUDA's out-of-memory error, raised where the allocator would raise it.

On a GPU, an allocation that finds no room raises ``torch.OutOfMemoryError``
in the script, and scripts act on it: accelerate's
``find_executable_batch_size`` and the Hugging Face Trainer's
``auto_find_batch_size`` halve the batch and run again, as do evaluation
harnesses and oomkit's own ``auto_batch``; trainers skip a batch that does
not fit. A preflight that never raised would run such a script at the
batch it first tried, and say that it does not fit where it runs on that
GPU. So, from the first forward on, each allocation is served through the
allocator model at the capacity as it is made (``_native.AllocatorRun``),
and one the model refuses raises CUDA's error, worded as CUDA words it.

What the answer is then depends on what the script does with it:

- it catches the error and completes a step after the last one: the
  answer is the run as it went on, and says so;
- it stops (the error raised to its end, or another after it), or catches
  error after error without completing a step (a loop that skips every
  batch): the run's figures are of a run stopped early, so ``oomkit
  preflight`` runs the script again without refusing anything and
  answers from that run, saying where the GPU ran out.

The set-up's allocations (the model built and moved, the first batch made
before the first forward) are recorded as the step begins, not as they are
made; one the GPU would refuse raises CUDA's error at the step's first
allocation, where the script's own handler (around its step) meets it, and
the answer names the line that made it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from oomkit import _native
from oomkit.preflight.record.frames import user_line

#: The share of the capacity the script's live tensors must reach before each allocation is
#: served through the model as it is made: below it, an allocation fails only where over half
#: of what is reserved is cached and cannot be released, and the cost of asking is spared.
WATCH_FROM = 0.5

#: Errors raised in a row, with no step completed between them, after which the script is
#: taken to skip whatever does not fit and is stopped: a search that halves the batch from a
#: million to one needs 20.
GIVE_UP_AFTER = 32

#: The trace's kind for an allocation the GPU refused, which the script caught (``_native.realize_ops``'s 3).
REFUSED = 3

#: The attribute that marks an error as one preflight raised, for the script's end to tell it.
MARK = "_oomkit_refused"


@dataclass
class Refused:
    """The first allocation refused, and how the run went after the last one."""

    #: Errors raised in the script.
    raised: int
    #: The bytes the first one tried to allocate (the segment it needed).
    first_bytes: int
    #: The script's line where the first was raised.
    first_at: str
    #: Whether the script completed a step (or, running no backward, a forward) after the last.
    went_on: bool = False
    #: How the script ended after the last one (its error's first line), where it did not go on.
    ended: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The answer's ``out_of_memory`` field (docs/commands.md)."""
        return asdict(self)


class OutOfMemory:
    """Serves the step's allocations as they are made and raises CUDA's error where the model refuses one."""

    def __init__(
        self,
        trace: Any,
        alloc_conf: Callable[[], str | None],
        allowed: Callable[[], int],
        total: int,
        forget: Callable[[int], None],
    ) -> None:
        self.trace = trace
        #: Tells the recorder an allocation was refused: it holds nothing, its storage's death frees nothing.
        self.forget = forget
        #: The allocator's settings in force, and the bytes it may hold (the script's share of ``total``).
        self.alloc_conf = alloc_conf
        self.allowed = allowed
        #: The capacity preflight measures against.
        self.total = total
        self._run: _native.AllocatorRun | None = None
        self._capacity = 0
        self.refused: Refused | None = None
        #: Errors raised since the last step completed.
        self.in_a_row = 0
        # Whether the last error's forward may still hold its tensors in reference cycles.
        self._collect = False
        # Steps completed, and completed when the GPU last ran out.
        self._steps = 0
        self._steps_at_refusal = 0
        #: Called when the script has caught ``GIVE_UP_AFTER`` errors in a row: it ends the run.
        self.give_up: Callable[[], None] | None = None
        #: Called as each error is raised: what it leaves unfinished (an optimizer's step whose
        #: closure ran out) ends with it.
        self.on_refused: Callable[[], None] | None = None

    def check(self, index: int, live_bytes: int) -> None:
        """Serves the operations recorded up to the allocation at ``index`` (the last) and raises
        CUDA's error if the model refuses any, having recorded each as refused (kind 3), holding
        nothing: this one, or one of the set-up's, made before the step began (a model that does
        not fit; the first batch, made before its first forward), recorded as the step began,
        where the GPU would have raised it as it was made."""
        allowed = self.allowed()
        if self._run is None:
            if live_bytes < WATCH_FROM * allowed:
                return
            self._run = _native.AllocatorRun(self.alloc_conf(), allowed)
            self._capacity = allowed
        elif allowed != self._capacity:
            self._run.set_capacity(allowed)
            self._capacity = allowed
        tr = self.trace
        start = len(self._run)
        end = index + 1
        streams = [tr.pools.get(i, 0) for i in range(start, end)] if tr.pools else [0] * (end - start)
        refusals = self._run.feed(tr.kinds[start:end], tr.args[start:end], streams)
        if not refusals:
            return
        for at, *_ in refusals:
            tr.kinds[at] = REFUSED
            self.forget(at)
        at, alloc_size, reserved, allocated = refusals[0]
        where = user_line(tr.stacks[tr.stack_of[at]])
        if self.refused is None:
            self.refused = Refused(raised=0, first_bytes=alloc_size, first_at=where)
        self.refused.raised += 1
        self.refused.went_on = False
        self.in_a_row += 1
        self._collect = True
        self._steps_at_refusal = self._steps
        if self.in_a_row > GIVE_UP_AFTER and self.give_up is not None:
            self.give_up()
        if self.on_refused is not None:
            self.on_refused()
        error = torch.OutOfMemoryError(self._message(alloc_size, reserved, allocated, allowed))
        setattr(error, MARK, True)
        try:
            raise error
        finally:
            # The error's traceback holds this frame: held here too, the two would be a cycle that
            # keeps every tensor of the failed forward until Python's collector runs, where a
            # GPU's script has them back as soon as it leaves its ``except``.
            del error

    def before_op(self) -> None:
        """Once the script has handled the last error, frees what its failed forward left in cycles.

        Preflight's module hooks send each forward through ``Module._call_impl``'s
        closure, whose frames an exception leaves in reference cycles: the failed
        forward's tensors would stay until Python's collector next ran, where on a
        GPU (no hooks) the script has them back as it leaves its ``except``.
        """
        if self._collect and sys.exc_info()[1] is None:
            self._collect = False
            gc.collect()

    def step_done(self) -> None:
        """A step completed (or, in a run without backward, a forward): the script went on."""
        self._steps += 1
        self.in_a_row = 0
        if self.refused is not None:
            self.refused.went_on = True

    def steps_since(self, steps_done: int) -> int:
        """Of ``steps_done`` optimizer steps, those completed since the GPU last ran out: the steps the
        script took at the setting it went on with, which are the steps preflight measures."""
        return steps_done if self.refused is None else self._steps - self._steps_at_refusal

    def _message(self, alloc_size: int, reserved: int, allocated: int, allowed: int) -> str:
        """CUDA's words (``CUDACachingAllocator.cpp``'s ``malloc``), at the capacity preflight measures
        against, with the share the script allowed itself where it set one."""
        limit = f"{_size(allowed)} allowed; " if allowed < self.total else ""
        return (
            f"CUDA out of memory. Tried to allocate {_size(alloc_size)}. GPU 0 has a total capacity of "
            f"{_size(self.total)} of which {_size(max(0, self.total - reserved))} is free. {limit}Of the allocated memory "
            f"{_size(allocated)} is allocated by PyTorch, and {_size(reserved - allocated)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables) "
            "(raised by oomkit preflight, where its model of the allocator ran out at the capacity given)"
        )


def raised_here(error: BaseException | None) -> bool:
    """Whether ``error`` is an out-of-memory error preflight raised in the script."""
    return error is not None and bool(getattr(error, MARK, False))


def _size(n: int) -> str:
    """Bytes as ``format_size`` in PyTorch's allocator writes them (``20.00 MiB``)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"
