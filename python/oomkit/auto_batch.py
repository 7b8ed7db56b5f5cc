"""Retrying a training function with a smaller micro-batch after an OOM,
keeping the effective batch, with every rank of a distributed job agreeing."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from typing import Any, Callable, Iterator, List, Optional, Tuple, TypeVar

from oomkit import _native
from oomkit._native import OomkitError
from oomkit._oom import find_oom, is_oom

_log = logging.getLogger("oomkit")
T = TypeVar("T")


class BatchSizeError(OomkitError, RuntimeError):
    """Raised when even the smallest allowed micro-batch runs out of memory."""

    __module__ = "oomkit"


class UsageError(OomkitError, ValueError):
    """Raised for an argument oomkit cannot use, such as a micro-batch below 1."""

    __module__ = "oomkit"


def _free_memory() -> None:
    """Drops what the failed try left behind: unreachable tensors, then the allocator's cache."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - freeing is best effort
        pass


def _cause_note(message: str) -> str:
    """What the OOM's cause means for a retry inside this process, as a clause for the log."""
    if not message:
        return ""
    cause = _native.oom_cause(message, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if cause == "fragmentation":
        # The allocator reads its settings once, when CUDA starts.
        return (
            " (fragmentation: expandable segments cannot be turned on inside a running process; "
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before it starts, or use `oomkit run`)"
        )
    if cause == "other_processes":
        return " (other processes hold the memory: `oomkit run` moves the job to another GPU)"
    if cause == "memory_fraction_limit":
        return " (the process hit its own set_per_process_memory_fraction cap)"
    return f" ({cause})" if cause else ""


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def _any_rank(flag: bool, group: Any) -> bool:
    """True when `flag` is true on any rank; every rank must call this the same number of times."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return flag
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    backend = dist.get_backend(group)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


class _StepDown(Exception):
    """Raised on every rank at the same guard when any rank ran out of memory there."""

    def __init__(self, here: bool) -> None:
        super().__init__("a rank ran out of memory; all ranks step down")
        self.here = here


@contextlib.contextmanager
def oom_guard(group: Any = None) -> Iterator[None]:
    """Marks the memory-hungry part of a step inside an ``auto_batch`` function.

    An OOM inside is caught; on leaving, every rank learns whether any rank
    ran out (one all-reduce of a flag), and if one did, all of them leave the
    function here together, before the step's collectives, so none waits in
    an all-reduce that another rank will never join. Keep collectives out of
    the guarded block (with DDP, run the backward under ``no_sync()`` there and
    synchronise gradients after it).

    Example::

        with oomkit.oom_guard():
            loss = model(x).loss
            loss.backward()
        dist.all_reduce(grad_buffer)
    """
    failed = False
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only OOMs are caught
        if not is_oom(exc):
            raise
        failed = True
    if _any_rank(failed, group):
        raise _StepDown(failed)


def auto_batch(
    fn: Optional[Callable[..., T]] = None,
    *,
    batch_size: int,
    effective_batch: Optional[int] = None,
    grad_accum: int = 1,
    min_batch_size: int = 1,
    max_retries: Optional[int] = None,
    group: Any = None,
    accelerator: Any = None,
) -> Any:
    """Calls ``fn(micro_batch, grad_accum, *args, **kwargs)``, stepping the micro-batch down after each OOM.

    The accumulation grows so that micro-batch x accumulation still covers the
    effective batch (``batch_size * grad_accum`` unless given); where no exact
    split exists it rounds up and logs it. Each step goes to the largest
    micro-batch the OOM messages' figures say could fit (the proportional bound
    after one OOM, the fitted per-sample cost after two), else to half. Under ``torch.distributed`` every
    rank reports whether its try ran out of memory (an all-reduce of one
    flag), so all ranks step down together and none is left waiting in a
    collective. The agreement happens when the function returns or raises;
    if the function runs collectives after its memory-hungry work, wrap that
    work in :func:`oom_guard` so the ranks agree before the collectives. After
    the function returns, ``wrapper.plan`` holds the ``(micro_batch,
    grad_accum)`` that worked.

    Example::

        @oomkit.auto_batch(batch_size=64, effective_batch=256)
        def train(micro_batch, grad_accum):
            loader = DataLoader(data, batch_size=micro_batch)
            ...  # step the optimizer every grad_accum micro-batches

        train()
        print(train.plan)   # e.g. (16, 16)
    """
    if batch_size < 1 or min_batch_size < 1 or grad_accum < 1:
        raise UsageError("batch_size, grad_accum and min_batch_size must be at least 1")

    def decorate(f: Callable[..., T]) -> Callable[..., T]:
        effective = effective_batch or batch_size * grad_accum

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            micro, accum = _native.batch_plan(batch_size, effective)
            if grad_accum > accum:
                accum = grad_accum
            retries = 0
            # (micro-batch, message) of each OOM so far: two give the per-sample cost.
            earlier: List[Tuple[int, str]] = []
            while True:
                failure: Optional[BaseException] = None
                result: Any = None
                here = False
                if accelerator is not None:
                    accelerator.gradient_accumulation_steps = accum
                try:
                    result = f(micro, accum, *args, **kwargs)
                except _StepDown as exc:
                    failure, here = exc, exc.here
                except Exception as exc:  # noqa: BLE001 - only OOMs are caught, the rest re-raised below
                    if not is_oom(exc):
                        raise
                    failure, here = exc, True
                # The traceback holds the failed try's frames and their tensors.
                ran_out = _any_rank(failure is not None, group)
                if not ran_out:
                    wrapper.plan = (micro, accum)  # type: ignore[attr-defined]
                    return result
                del result
                failure_message = "" if failure is None or isinstance(failure, _StepDown) else str(find_oom(failure) or failure)
                # Ranks must agree on the next plan, and only the rank that ran
                # out has the message: jump by its figures only when alone.
                alone = not _distributed()
                nxt = _native.back_off(micro, effective, min_batch_size, failure_message if alone else None, earlier)
                if alone and failure_message:
                    earlier.append((micro, failure_message))
                if nxt is None or (max_retries is not None and retries >= max_retries):
                    if failure is not None and not isinstance(failure, _StepDown):
                        raise failure
                    raise BatchSizeError(
                        f"another rank ran out of memory at micro-batch {micro}, and no smaller one is allowed"
                    )
                failure = None
                if accelerator is not None:
                    accelerator.free_memory()
                _free_memory()
                retries += 1
                where = "this rank" if here else "another rank"
                why = _cause_note(failure_message)
                micro, accum = nxt
                note = "" if micro * accum == effective else f" ({micro * accum} samples per step: {effective} has no divisor near it)"
                _log.warning(
                    "oomkit.auto_batch: out of memory on %s%s; retrying with micro-batch %d x accumulation %d%s",
                    where,
                    why,
                    micro,
                    accum,
                    note,
                )

        wrapper.plan = None  # type: ignore[attr-defined]
        return wrapper

    if fn is not None:
        return decorate(fn)
    return decorate
