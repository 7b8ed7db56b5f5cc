"""Retrying a training function with a smaller micro-batch after an OOM,
keeping the effective batch, with every rank of a distributed job agreeing."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional, TypeVar

from oomkit import _elastic, _native, _plan
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

    def __init__(self, oom: Optional[BaseException]) -> None:
        super().__init__("a rank ran out of memory; all ranks step down")
        # This rank's own OOM, or None when another rank ran out.
        self.oom = oom
        self.here = oom is not None


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
    oom: Optional[BaseException] = None
    try:
        yield
    except Exception as exc:
        if not is_oom(exc):
            raise
        oom = exc
        # The guard swallows the error, so the trackers would never see it.
        _note_oom(exc)
    if _any_rank(oom is not None, group):
        raise _StepDown(oom)


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - the rank only labels messages
        pass
    return int(os.environ.get("RANK", "0") or 0)


def _note_trackers(plan: _plan.Plan) -> None:
    """Tells every open tracker the plan of the try that starts now; never raises."""
    try:
        from oomkit.tracker import tracker

        tracker.note_plan(plan)
    except Exception:  # noqa: BLE001 - logging the plan never stops training
        pass


def _note_oom(exc: BaseException) -> None:
    """Has an open tracker record an OOM that a guard caught; never raises."""
    try:
        from oomkit.tracker import tracker

        tracker.note_oom(exc)
    except Exception:  # noqa: BLE001 - recording never stops training
        pass


def _starting_plan(
    first: tuple[int, int], effective: int, min_batch_size: int
) -> tuple[int, int, int, str, Any, str, list[tuple[int, str]]]:
    """The plan the first try runs, and where it came from: the decorator's own, capped by
    ``oomkit run``'s micro-batch, or the one every rank agreed on in torch elastic's store
    after a restart. Returns the micro-batch, accumulation, attempt, its source, the store's
    channel (None outside torchrun), what the store held, and the earlier OOMs it records."""
    micro, accum = first
    attempt, source = 1, "auto_batch"
    # (micro-batch, message) of each OOM so far: two give the per-sample cost.
    earlier: list[tuple[int, str]] = []
    env = _plan.from_env()
    if env is not None:
        attempt = env.attempt or 1
        if env.micro_batch < micro:
            micro, accum = _native.batch_plan(env.micro_batch, effective)
            source = "oomkit run"
    channel = None
    stored = ""
    if _elastic.under_torchrun():
        try:
            channel = _elastic.channel()
            if channel is not None:
                stored, agreed = channel.read()
                if agreed is not None and agreed.stop:
                    raise BatchSizeError(_elastic.stop_text(agreed, min_batch_size))
                if agreed is not None and agreed.effective_batch != effective:
                    _log.warning(
                        "oomkit.auto_batch: ignoring the plan in %s: it keeps an effective batch of %d, not %d",
                        channel.where,
                        agreed.effective_batch,
                        effective,
                    )
                elif agreed is not None:
                    micro, accum, attempt = agreed.micro_batch, agreed.grad_accum, agreed.attempt
                    source = _plan.ELASTIC_SOURCE
                    if agreed.failed_micro_batch is not None and agreed.message:
                        earlier.append((agreed.failed_micro_batch, agreed.message))
                    if _rank() == 0:
                        _log.warning(
                            "oomkit.auto_batch: attempt %d after %s ran out of memory at micro-batch %s: "
                            "every rank runs micro-batch %d x accumulation %d",
                            attempt,
                            "a rank" if agreed.rank is None else f"rank {agreed.rank}",
                            agreed.failed_micro_batch,
                            micro,
                            accum,
                        )
        except BatchSizeError:
            raise
        except Exception as exc:  # noqa: BLE001 - without the store, retries stay in-process
            _log.warning("oomkit.auto_batch: torch elastic's store cannot be read (%s); restarts will not step down", exc)
            channel = None
    return micro, accum, attempt, source, channel, stored, earlier


def auto_batch(
    fn: Optional[Callable[..., T]] = None,
    *,
    batch_size: int,
    effective_batch: Optional[int] = None,
    grad_accum: int = 1,
    min_batch_size: int = 1,
    max_retries: Optional[int] = None,
    accelerator: Any = None,
) -> Any:
    """Calls ``fn(micro_batch, grad_accum, *args, **kwargs)``, stepping the micro-batch down after each OOM.

    The accumulation grows so that micro-batch x accumulation still covers the
    effective batch (``batch_size * grad_accum`` unless given); where no exact
    split exists it rounds up and logs it. Each step goes to the largest
    micro-batch the OOM messages' figures say could fit (the proportional bound
    after one OOM, the fitted per-sample cost after two), else to half.

    Where it runs decides how ranks agree. In one process, the function is
    simply called again. Under ``torch.distributed``, an OOM inside
    :func:`oom_guard` makes every rank leave at that guard together and
    retry in-process. An OOM anywhere else may leave the other ranks waiting
    in a collective, so the rank exits instead: under torchrun with
    ``--max-restarts``, it first stores the next plan in torch elastic's
    rendezvous store (a file on one node), torch elastic restarts every rank
    on every node, and each starts from that plan; under ``oomkit run``, the
    supervisor reruns the command with the next plan. A plan that failed is
    never run again, and two ranks that run out at once step down once.
    Under ``oomkit run``, its micro-batch (``OOMKIT_MICRO_BATCH``) caps the
    first try. After the function returns, ``wrapper.plan`` holds the
    ``(micro_batch, grad_accum)`` that worked; :func:`current_plan` tells a
    script, at start, which plan and attempt it runs.

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

        def first_plan() -> tuple[int, int]:
            micro, accum = _native.batch_plan(batch_size, effective)
            return micro, max(accum, grad_accum)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            micro, accum, attempt, source, channel, stored, earlier = _starting_plan(first_plan(), effective, min_batch_size)
            retries = 0
            while True:
                plan = _plan.Plan(micro, accum, effective, attempt, source)
                _plan.set_active(plan)
                _note_trackers(plan)
                failure: Optional[BaseException] = None
                result: Any = None
                here = False
                if accelerator is not None:
                    accelerator.gradient_accumulation_steps = accum
                try:
                    result = f(micro, accum, *args, **kwargs)
                except _StepDown as exc:
                    failure, here = exc, exc.here
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    if _distributed():
                        # Outside a guard the other ranks may be in a collective this
                        # rank will never join: only restarting every rank gets out.
                        _leave(exc, channel, stored, plan, min_batch_size, earlier)
                        raise
                    failure, here = exc, True
                finally:
                    _plan.set_active(None)
                if failure is None:
                    wrapper.plan = (micro, accum)  # type: ignore[attr-defined]
                    return result
                del result
                own = failure.oom if isinstance(failure, _StepDown) else failure
                failure_message = "" if own is None else str(find_oom(own) or own)
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
                attempt, source = attempt + 1, "auto_batch"
                if channel is not None:
                    # A later restart (for any reason) must not go back to the plan that failed.
                    with contextlib.suppress(Exception):
                        channel.propose(stored, _elastic.Agreed(micro, accum, effective, attempt, failed_micro_batch=plan.micro_batch))
                        stored = channel.read()[0]
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


def _leave(
    exc: BaseException,
    channel: Optional[_elastic.Channel],
    stored: str,
    plan: _plan.Plan,
    min_batch_size: int,
    earlier: list[tuple[int, str]],
) -> None:
    """Before a rank exits on an OOM outside any guard: stores the next plan for every rank's restart, and says so."""
    rank = _rank()
    message = str(find_oom(exc) or exc).strip() or type(exc).__name__
    if channel is None:
        _log.error(
            "oomkit.auto_batch: out of memory on rank %d at micro-batch %d outside an oom_guard; the other ranks "
            "may be waiting in a collective this rank will not join, so it exits instead of retrying. To step down "
            "automatically, run under torchrun with --max-restarts N (every rank restarts with a smaller micro-batch) "
            "or under `oomkit run`, or wrap the step's memory-hungry part in oomkit.oom_guard()",
            rank,
            plan.micro_batch,
        )
        return
    effective = plan.effective_batch or plan.micro_batch * plan.grad_accum
    try:
        agreed = _elastic.step_down(
            channel,
            stored,
            (plan.micro_batch, plan.grad_accum, effective, plan.attempt or 1),
            rank,
            message,
            min_batch_size,
            tuple(earlier),
        )
    except Exception as e:  # noqa: BLE001 - the OOM is what the user must see; this only explains it
        _log.error("oomkit.auto_batch: out of memory on rank %d; the next plan could not be stored in %s: %s", rank, channel.where, e)
        return
    left = _elastic.restarts_left()
    then = (
        "torch elastic restarts every rank"
        if left > 0
        else "but torchrun has no restarts left (raise --max-restarts)"
    )
    if agreed.stop:
        _log.error(
            "oomkit.auto_batch: out of memory on rank %d at micro-batch %d, the smallest allowed; every rank stops (%s)",
            rank,
            plan.micro_batch,
            channel.where,
        )
    else:
        _log.error(
            "oomkit.auto_batch: out of memory on rank %d at micro-batch %d outside an oom_guard; attempt %d will run "
            "micro-batch %d x accumulation %d on every rank (agreed in %s); %s",
            rank,
            plan.micro_batch,
            agreed.attempt,
            agreed.micro_batch,
            agreed.grad_accum,
            channel.where,
            then,
        )


def current_plan() -> Optional[_plan.Plan]:
    """The micro-batch, accumulation and attempt this process starts with, or None when nothing chose them.

    Under torchrun after an OOM, the plan every rank agreed on; under ``oomkit
    run``, the plan of its attempt (``OOMKIT_MICRO_BATCH``, ``OOMKIT_ATTEMPT``).
    A script reads it at start to resume from its own checkpoint.

    Example::

        plan = oomkit.current_plan()
        if plan is not None and plan.attempt and plan.attempt > 1:
            state = torch.load("checkpoint.pt")   # resume where the failed attempt left off
    """
    return _plan.current()
