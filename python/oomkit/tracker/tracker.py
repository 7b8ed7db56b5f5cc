"""The in-training memory tracker: its public API, the measures of steps, stages and phases, and its run log.

The tracker keeps numbers only, never a reference to a tensor, and every
hook body is guarded: a failure inside the tracker is logged and reported
once, never raised into the training loop. Records go to the Rust run-log
writer, which flushes at every stage boundary. Its parts live beside it:
how memory is read (``measure.py``), the hooks that find the stages
(``hooks.py``), what the model holds (``holdings.py``) and the writing of
OOMs (``oom_capture.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any, Optional

from oomkit import _native, _plan
from oomkit._oom import find_oom, requested_bytes
from oomkit.tracker import holdings, oom_capture
from oomkit.tracker import hooks as _hooks  # `hooks` is a parameter name below
from oomkit.tracker.core import Books
from oomkit.tracker.holdings import unwrap_optimizer
from oomkit.tracker.measure import _Meter, _Open, _torch, preflight_dir
from oomkit.tracker.oom_capture import _forget_tracker, _watch_allocator_ooms, record_history

LOG_VERSION = 1

#: Where, inside an ``oomkit preflight`` run's own folder, a tracker's log goes.
PREFLIGHT_LOGS = "tracker-logs"


def _rank() -> tuple[int, int]:
    torch = _torch()
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Tracker:
    """Records memory per training stage, component costs, gradient health and OOMs to a run log.

    Use ``with tracker.step(i):`` in a loop you own, or the ``begin_*``/``end_*``
    calls from a framework's callbacks. Example::

        tracker = oomkit.Tracker(model, optimizer=opt, log_dir="oomkit-logs")
        for i, batch in enumerate(loader):
            with tracker.step(i):
                loss = model(batch).loss
                loss.backward()
                opt.step(); opt.zero_grad(set_to_none=True)
        tracker.close()
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        ema: Any = None,
        log_dir: str | os.PathLike[str] = "oomkit-logs",
        *,
        grad_every: int = 50,
        record_history: bool = False,
        max_entries: int = 100_000,
        console: Optional[bool] = None,
        check_duplicates: bool = True,
        stage_hooks: bool = True,
        rank: Optional[int] = None,
        reset_peaks: bool = False,
    ) -> None:
        torch = _torch()
        # The running state the tracker's parts read and update too (core.py).
        self._books = Books(model_ref=weakref.ref(model), ema_ref=weakref.ref(ema) if ema is not None else None)
        #: What the tracker's parts see of it (``core.TrackerCore``).
        self._core = _Core(self)
        self.grad_every = max(1, int(grad_every))
        self.stage_hooks = bool(stage_hooks)
        self.rank, self.world_size = _rank()
        if rank is not None:
            self.rank = int(rank)
        self.console = (self.rank == 0) if console is None else bool(console)
        self._errors = 0
        # The process's high-water mark at the last sample, and the highest seen.
        self._counter = 0
        self._high = 0
        # How the run ended, where the tracker learns it before closing.
        self._ended: dict[str, Any] = {}
        self._components_after_first_step = False
        # `oomkit find-batch` names a file for this run's peak; only rank 0 writes it.
        probe = os.environ.get(_plan.PROBE_FILE_ENV)
        self._probe = probe if probe and self.rank == 0 else None
        self._probe_peak = 0
        device = None
        for p in model.parameters():
            device = p.device
            break
        self._meter = _Meter(device, reset_peaks)
        self.device = f"cuda:{self._meter.index}" if self._meter.cuda else "cpu"
        # The mark before the first measure: what ran before the tracker counts
        # as an earlier peak, not as one of its stages'.
        self._counter, _, _ = self._meter.sample()
        self._high = self._counter
        fake = preflight_dir()
        if fake is not None:
            # A preflight ran nothing on a GPU: its log is not a run's, and is not kept with them.
            log_dir = os.path.join(fake, PREFLIGHT_LOGS)
        self.log_path = self._new_log_path(log_dir)
        self._log = _native.RunLog(self.log_path)
        if record_history:
            oom_capture.start_history(self._core, max_entries)
        if self._meter.cuda:
            _watch_allocator_ooms(self._core)
        # Before the start record, so that a resumed optimizer's state is counted in it.
        self.set_optimizer(optimizer)
        components: dict[str, Any] = {}
        try:
            with torch.no_grad():
                components = holdings.components(self._core)
        except Exception as exc:  # noqa: BLE001 - an exotic model or optimizer: log it, count nothing
            self._error("components", exc)
        self._write(
            {
                "type": "start",
                "version": LOG_VERSION,
                "time": time.time(),
                "rank": self.rank,
                "world_size": self.world_size,
                "device": self.device,
                "capacity_bytes": self._meter.capacity,
                "capacity_source": self._meter.capacity_source,
                "peaks": "reset" if self._meter.resets else "high_water",
                "attempt": _plan.attempt_from_env(),
                "pid": os.getpid(),
                "torch": str(torch.__version__),
                "grad_every": self.grad_every,
                "components": components,
            }
        )
        # A tracker started inside an `auto_batch` function logs that try's plan.
        active = _plan.active()
        if active is not None:
            self.note("plan", **active.record(PLAIN_FRAMEWORK))
        elif _plan.attempt_from_env() is not None and not _INTEGRATION_PLAN:
            # Under `oomkit run` every log carries its attempt, so that attempts
            # are never read as ranks; an integration's own plan record follows.
            self.note("plan", **_plan.env_record(PLAIN_FRAMEWORK))
        # `oomkit run` closes the logs of an attempt the kernel killed.
        _plan.report_event({"log": os.path.abspath(self.log_path), "rank": self.rank})
        _LIVE.add(self)
        _close_at_exit_once()
        _hooks.install_model_hooks(self._core, model)
        if check_duplicates:
            self.find_duplicates(when="start")

    # ----- public API -------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        """The torch optimizer whose state is counted (wrappers removed), or None."""
        return self._books.opt_ref() if self._books.opt_ref is not None else None

    def set_optimizer(self, optimizer: Any, hooks: Optional[bool] = None) -> None:
        """Tracks ``optimizer`` (unwrapped from accelerate, Lightning or DeepSpeed) instead of the current one.

        With ``hooks`` (default: the tracker's ``stage_hooks``), its step marks
        the optimizer stage. A framework that builds a new optimizer on a
        retry (the Hugging Face Trainer's ``auto_find_batch_size``) calls this
        again; the old optimizer's hooks are removed.
        """
        try:
            for h in self._books.opt_hooks:
                with contextlib.suppress(Exception):
                    h.remove()
            self._books.opt_hooks.clear()
            self._books.opt_ref = None
            if optimizer is None:
                return
            inner = unwrap_optimizer(optimizer)
            self._books.opt_ref = weakref.ref(inner)
            # A new optimizer's state appears after its own first step.
            self._components_after_first_step = False
            if self.stage_hooks if hooks is None else hooks:
                self._books.opt_hooks.append(inner.register_step_pre_hook(functools.partial(_hooks.on_opt_pre, self._core)))
                self._books.opt_hooks.append(inner.register_step_post_hook(functools.partial(_hooks.on_opt_post, self._core)))
        except Exception as exc:  # noqa: BLE001
            self._error("optimizer hooks", exc)

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Measures one training step; forward, backward and optimizer stages are found by hooks."""
        self.begin_step(index)
        try:
            yield
        except BaseException as exc:
            self.record_oom(exc)
            raise
        finally:
            self.end_step()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measures a named phase such as "eval", inside or outside a step."""
        self.begin_phase(name)
        try:
            yield
        except BaseException as exc:
            self.record_oom(exc)
            raise
        finally:
            self.end_phase()

    def begin_step(self, index: int) -> None:
        """Starts measuring training step ``index``; a step still open is ended first."""
        self._books.user_steps = True
        self._begin_step(index, auto=False)

    def _begin_step(self, index: int, auto: bool) -> None:
        try:
            if self._books.step_open is not None:
                self.end_step()
            now, _ = self._sample()
            self._books.step_open = self._open_measure("step", "step", int(index), now)
            self._books.step_open.auto = auto
            self._books.auto_backward = False
        except Exception as exc:  # noqa: BLE001
            self._error("begin step", exc)

    def end_step(self) -> None:
        """Ends the open step (and its open stage) and writes them; does nothing when no step is open."""
        step = self._books.step_open
        if step is None:
            return
        try:
            now, reserved = self._sample()
            if self._books.stage is not None:
                self._close(self._books.stage, now, reserved)
            self._close(step, now, reserved)
        except Exception as exc:  # noqa: BLE001
            self._drop(self._books.stage)
            self._drop(step)
            self._error("end step", exc)
        self._books.steps_done += 1

    def begin_stage(self, name: str) -> None:
        """Starts stage ``name`` (forward, backward, optimizer) of the open step, ending the stage before it.

        For integrations that mark stages from a framework's events; create
        the tracker with ``stage_hooks=False`` so hooks do not mark them too.
        Outside a step, or inside a phase, it does nothing.
        """
        if self._books.step_open is None or self._books.phases:
            return
        try:
            if name == "optimizer" and _hooks.due(self._core):
                holdings.grad_health(self._core)
            now, reserved = self._sample()
            if self._books.stage is not None:
                self._close(self._books.stage, now, reserved)
            self._books.stage = self._open_measure("stage", name, self._books.step_open.step, now)
        except Exception as exc:  # noqa: BLE001
            self._error(f"begin {name}", exc)

    def end_stage(self) -> None:
        """Ends the open stage and writes it; does nothing when none is open."""
        stage = self._books.stage
        if stage is None:
            return
        try:
            now, reserved = self._sample()
            self._close(stage, now, reserved)
        except Exception as exc:  # noqa: BLE001
            self._drop(stage)
            self._error("end stage", exc)

    def begin_phase(self, name: str) -> None:
        """Starts measuring a named phase such as "eval", inside or outside a step."""
        try:
            now, _ = self._sample()
            self._books.phases.append(self._open_measure("phase", str(name), self._current_step, now))
        except Exception as exc:  # noqa: BLE001
            self._error(f"begin {name}", exc)

    def end_phase(self) -> None:
        """Ends the innermost open phase and writes it; does nothing when none is open."""
        if not self._books.phases:
            return
        phase = self._books.phases[-1]
        try:
            now, reserved = self._sample()
            self._close(phase, now, reserved)
        except Exception as exc:  # noqa: BLE001
            self._drop(phase)
            self._error("end phase", exc)

    @property
    def _current_step(self) -> Optional[int]:
        """The open step's index, or None outside a step."""
        return self._books.step_open.step if self._books.step_open is not None else None

    @property
    def closed(self) -> bool:
        """True once the tracker is closed."""
        return self._books.closed

    @property
    def in_step(self) -> bool:
        """True while a step is open."""
        return self._books.step_open is not None

    @property
    def current_phase(self) -> Optional[str]:
        """The innermost open phase's name, or None."""
        return self._books.phases[-1].name if self._books.phases else None

    def record_oom(self, exc: BaseException) -> bool:
        """Records an out-of-memory error (found in ``exc`` or its ``__cause__``/``__context__``) once.

        The record names the open step, stage and phase, the bytes asked for
        and the memory now; a duplicate check runs, a snapshot is dumped when
        history is recorded, and the diagnosis goes to stderr. Returns True
        when ``exc`` is an OOM (recorded now or before); never raises.
        """
        try:
            oom = find_oom(exc)
            if oom is None:
                return False
            if getattr(oom, "_oomkit_seen", False) or getattr(exc, "_oomkit_seen", False):
                return True
            for e in (exc, oom):
                with contextlib.suppress(Exception):
                    e._oomkit_seen = True  # type: ignore[attr-defined]
            if self._books.closed:
                return True
            text = str(oom).strip()
            message = text.splitlines()[0] if text else type(oom).__name__
            if self._books.observed_oom:
                # The allocator's observer already wrote this one, at the failing allocation;
                # `oomkit run` still gets the exception's message, which has the figures.
                self._books.observed_oom = False
                _plan.report_oom(message, self._current_step, self.current_phase)
                return True
            oom_capture.write_oom(self._core, message, requested_bytes(text))
        except Exception as e:  # noqa: BLE001
            self._error("oom capture", e)
        return True

    def note(self, record_type: str, **fields: Any) -> None:
        """Writes an extra record to the run log, such as the batch plan an integration applied."""
        try:
            rec: dict[str, Any] = {"type": record_type, "time": time.time()}
            rec.update(fields)
            self._write(rec)
            if record_type == "plan":
                # The plan this process runs, for the step down after an OOM under torchrun.
                self._books.plan_fields = dict(fields)
        except Exception as exc:  # noqa: BLE001
            self._error(f"note {record_type}", exc)

    def find_duplicates(self, when: str = "manual") -> dict[str, Any]:
        """Finds live tensors that mirror the model's parameters but belong to nothing tracked."""
        step = self._current_step
        result: dict[str, Any] = {"type": "duplicates", "when": when, "step": step, "bytes": 0, "groups": []}
        try:
            torch = _torch()
            with torch.no_grad():
                result = holdings.duplicates(self._core, when)
            self._write(result)
        except Exception as exc:  # noqa: BLE001
            self._error("find_duplicates", exc)
        return result

    def close(self) -> None:
        """Ends what is open, removes the hooks, writes the final record and closes the log."""
        if self._books.closed:
            return
        with contextlib.suppress(Exception):
            while self._books.phases:
                self.end_phase()
            self.end_step()
        self._books.closed = True
        _forget_tracker(self._core)
        for h in self._books.model_hooks + self._books.opt_hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._books.model_hooks.clear()
        self._books.opt_hooks.clear()
        with contextlib.suppress(Exception):
            end: dict[str, Any] = {
                "type": "end",
                "time": time.time(),
                "steps": self._books.steps_done,
                "ended": "closed",
                "seen": dict(self._books.seen),
                "peak_bytes": self._high,
            }
            end.update(self._ended)
            self._write(end)
        with contextlib.suppress(Exception):
            self._log.close()
        if self._books.history:
            with contextlib.suppress(Exception):
                _torch().cuda.memory._record_memory_history(enabled=None)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- measuring --------------------------------------------------------

    def _sample(self) -> tuple[int, int]:
        """Folds what the interval since the last sample reached into every open measure; returns (in use, reserved) now.

        Every open measure spans the whole interval (measures open and close
        at samples). Where the high-water mark rose, its new value is the
        interval's peak exactly; where it did not, the interval stayed at or
        under the earlier mark and its peak is known only between what was in
        use at its ends and that mark.
        """
        mark, now, reserved = self._meter.sample()
        before = self._counter
        self._counter = mark
        if self._meter.resets or mark > before:
            for o in self._books.open:
                if mark > o.peak:
                    o.peak = mark
            self._high = max(self._high, mark)
        else:
            # Below the mark (or another tool reset the counter since): a bound, not a figure.
            # A counter that fell was reset inside this interval, so what it
            # reached since is this interval's too.
            low = mark if mark < before else now
            for o in self._books.open:
                if max(now, low) > o.peak:
                    o.peak = max(now, low)
                if before > o.at_most:
                    o.at_most = before
        if now > self._high:
            self._high = now
        return now, reserved

    def _open_measure(self, kind: str, name: str, step: Optional[int], now: int) -> _Open:
        o = _Open(kind, name, step, now)
        self._books.open.append(o)
        return o

    def _drop(self, o: Optional[_Open]) -> None:
        """Forgets a measure, written or not, so that nothing keeps it open."""
        if o is None:
            return
        self._books.open = [x for x in self._books.open if x is not o]
        self._books.phases = [x for x in self._books.phases if x is not o]
        if o is self._books.stage:
            self._books.stage = None
        if o is self._books.step_open:
            self._books.step_open = None

    def _close(self, o: _Open, end: int, reserved: int) -> None:
        """Writes a finished measure; `end` and `reserved` come from the sample just taken."""
        self._drop(o)
        peak = o.peak if o.peak > end else end
        rec: dict[str, Any] = {
            "type": o.kind,
            "step": o.step,
            "name": o.name,
            "start_bytes": o.start,
            "end_bytes": end,
            "peak_bytes": peak,
            "reserved_bytes": reserved,
            "seconds": time.perf_counter() - o.t0,
        }
        if o.at_most > peak:
            # Part of it ran under an earlier peak: its own is between the two.
            rec["peak_at_most_bytes"] = o.at_most
        if o.auto:
            rec["auto"] = True
        self._write(rec)
        if o.kind == "stage" and o.name == "optimizer" and not self._components_after_first_step:
            # The optimizer's state exists only after its first step.
            self._components_after_first_step = True
            self._write_components()
        if o.kind == "step" and self._probe:
            self._write_probe(peak, reserved)

    def _write_components(self) -> None:
        try:
            with _torch().no_grad():
                rec = holdings.components(self._core)
            rec["type"] = "components"
            rec["step"] = self._current_step
            self._write(rec)
        except Exception as exc:  # noqa: BLE001
            self._error("components", exc)

    def _write_probe(self, peak: int, reserved: int) -> None:
        """Writes the run's peak so far for `oomkit find-batch`, whole or not at all."""
        # The process's high-water mark is the run's peak so far; the caching
        # allocator rarely returns memory, so reserved bytes at the end of a
        # step are its peak; the device also holds the CUDA context.
        need = max(self._probe_peak, peak, self._high, reserved)
        record: dict[str, Any] = {"device": self.device, "steps": self._books.steps_done + 1}
        if self._meter.cuda:
            free, total = _torch().cuda.mem_get_info(self._meter.index)
            baseline = int(os.environ.get(_plan.BASELINE_USED_BYTES_ENV, "0") or 0)
            outside = max(0, (total - free) - baseline - reserved)
            record["nonpytorch_bytes"] = outside
            need = max(need, reserved + outside)
        self._probe_peak = need
        record["peak_bytes"] = need
        probe = self._probe
        if probe is None:
            return
        tmp = f"{probe}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, probe)

    # ----- plumbing ---------------------------------------------------------

    def _new_log_path(self, log_dir: str | os.PathLike[str]) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = os.path.join(os.fspath(log_dir), f"run-{stamp}-rank{self.rank}")
        path = base + ".jsonl"
        n = 1
        while os.path.exists(path):
            path = f"{base}-{n}.jsonl"
            n += 1
        return path

    def _write(self, record: dict[str, Any]) -> None:
        if self._books.closed and record.get("type") != "end":
            return
        self._log.write(record)

    def _say(self, msg: str) -> None:
        if self.console:
            sys.stderr.write(f"oomkit: {msg}\n")

    def _error(self, where: str, exc: BaseException) -> None:
        """Logs a failure of the tracker itself; never raises."""
        self._errors += 1
        with contextlib.suppress(Exception):
            self._log.write({"type": "error", "where": where, "message": f"{type(exc).__name__}: {exc}"})
        if self._errors == 1:
            with contextlib.suppress(Exception):
                self._say(f"tracker error in {where} (training continues): {exc}")


class _Core:
    """The tracker as its parts see it (``core.TrackerCore``): its books, its
    settings, and what they may ask of it, each answered by the tracker itself."""

    def __init__(self, tracker: Tracker) -> None:
        self._t = tracker
        self.books = tracker._books

    @property
    def rank(self) -> int:
        return self._t.rank

    @property
    def stage_hooks(self) -> bool:
        return self._t.stage_hooks

    @property
    def grad_every(self) -> int:
        return self._t.grad_every

    @property
    def log_path(self) -> str:
        return self._t.log_path

    @property
    def meter(self) -> _Meter:
        return self._t._meter

    @property
    def log(self) -> Any:
        return self._t._log

    @property
    def current_step(self) -> Optional[int]:
        return self._t._current_step

    @property
    def current_phase(self) -> Optional[str]:
        return self._t.current_phase

    def begin_stage(self, name: str) -> None:
        self._t.begin_stage(name)

    def end_stage(self) -> None:
        self._t.end_stage()

    def open_step(self, index: int, auto: bool) -> None:
        self._t._begin_step(index, auto)

    def end_step(self) -> None:
        self._t.end_step()

    def record_oom(self, exc: BaseException) -> bool:
        return self._t.record_oom(exc)

    def find_duplicates(self, when: str = "manual") -> dict[str, Any]:
        return self._t.find_duplicates(when)

    def sample(self) -> tuple[int, int]:
        return self._t._sample()

    def write(self, record: dict[str, Any]) -> None:
        self._t._write(record)

    def say(self, msg: str) -> None:
        self._t._say(msg)

    def report_error(self, where: str, exc: BaseException) -> None:
        self._t._error(where, exc)


# Set while an integration builds its tracker: it writes the plan it applied
# itself, so the tracker does not write the one `oomkit run` handed down.
_INTEGRATION_PLAN = False


@contextlib.contextmanager
def _integration_writes_plan() -> Iterator[None]:
    """Inside it, a new tracker leaves the plan record to the integration that builds it."""
    global _INTEGRATION_PLAN
    before = _INTEGRATION_PLAN
    _INTEGRATION_PLAN = True
    try:
        yield
    finally:
        _INTEGRATION_PLAN = before


# Open trackers, which hear each plan `auto_batch` starts a try with.
_LIVE: weakref.WeakSet[Tracker] = weakref.WeakSet()
# The `framework` of a plan record written for a plain training loop.
PLAIN_FRAMEWORK = "pytorch"


def note_plan(plan: _plan.Plan) -> None:
    """Writes ``plan`` to every open tracker's log, as `auto_batch` starts a try with it."""
    for t in list(_LIVE):
        if not t.closed:
            t.note("plan", **plan.record(PLAIN_FRAMEWORK))


def note_oom(exc: BaseException) -> None:
    """Records an OOM that ``oom_guard`` caught in the first open tracker that takes it."""
    for t in list(_LIVE):
        if not t.closed and t.record_oom(exc):
            return


_AT_EXIT_REGISTERED = False


def _close_at_exit_once() -> None:
    """Registers, once per process, the handler that closes trackers the program left open."""
    global _AT_EXIT_REGISTERED
    if not _AT_EXIT_REGISTERED:
        atexit.register(_close_at_exit)
        _AT_EXIT_REGISTERED = True


def _close_at_exit() -> None:
    """Closes every tracker still open when the interpreter exits, saying how the run ended.

    An uncaught exception is what ended it (Python keeps it as
    ``sys.last_exc``, ``sys.last_value`` before 3.12): an OOM is recorded
    as one; anything else is named in the end record. A kill by a signal
    such as the kernel's OOM killer runs no Python: ``oomkit run`` writes
    that end record instead.
    """
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    for t in list(_LIVE):
        if t.closed:
            continue
        with contextlib.suppress(Exception):
            if isinstance(exc, BaseException):
                t.record_oom(exc)
                t._ended = {"ended": "exception", "exception": f"{type(exc).__name__}: {str(exc)[:500]}"}
            else:
                t._ended = {"ended": "exit"}
            t.close()


__all__ = ["LOG_VERSION", "PLAIN_FRAMEWORK", "Tracker", "note_oom", "note_plan", "record_history", "unwrap_optimizer"]
