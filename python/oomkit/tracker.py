"""The in-training memory tracker: stages by hooks, components, gradients, duplicates, OOM capture.

The tracker keeps numbers only, never a reference to a tensor, and every
hook body is guarded: a failure inside the tracker is logged and reported
once, never raised into the training loop. Records go to the Rust run-log
writer, which flushes at every stage boundary.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any, Optional

from oomkit import _native, _plan
from oomkit._oom import find_oom, requested_bytes

LOG_VERSION = 1


def _torch() -> Any:
    import torch

    return torch


def _rank() -> tuple[int, int]:
    torch = _torch()
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _storage_key(t: Any) -> tuple[str, int]:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse)
        return (str(t.device), id(t))


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _add_unique(t: Any, seen: set) -> int:
    """Returns the tensor's bytes the first time its storage is seen, else 0."""
    k = _storage_key(t)
    if k in seen:
        return 0
    seen.add(k)
    return _nbytes(t)


class _Meter:
    """Reads memory in use, reserved, and the process's high-water mark, on CUDA or CPU.

    The high-water mark is the process-wide counter other tools read too
    (``torch.cuda.max_memory_allocated()``; on CPU the kernel's VmHWM, which
    ``getrusage`` and ``/usr/bin/time`` report), so it is never reset unless
    the user asks for exact per-stage peaks with ``reset_peaks=True``.
    """

    def __init__(self, device: Any, reset_peaks: bool = False) -> None:
        torch = _torch()
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self.capacity_source: Optional[str] = None
        if self.cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.capacity: Optional[int] = torch.cuda.get_device_properties(self.index).total_memory
            self.capacity_source = "device"
            self.resets = bool(reset_peaks)
        else:
            # The memory cgroup's limit where one is set below the machine's
            # memory: in containers and SLURM jobs that is where the kernel kills.
            host = _native.host_capacity()
            self.capacity = host[0] if host else None
            self.capacity_source = host[1] if host else None
            self.resets = bool(reset_peaks) and _native.reset_process_peak_rss()

    def sample(self) -> tuple[int, int, int]:
        """Returns (the high-water mark, in use now, reserved now); with resets, the mark starts again from now.

        One call per boundary between stages: on CUDA one query of the
        allocator's statistics; on CPU one native call (statm and status
        through open handles, see oomkit_runlog::process::sample_rss).
        """
        if self.cuda:
            torch = _torch()
            try:
                # The allocator's own nested statistics: what memory_allocated(),
                # max_memory_allocated() and memory_reserved() each rebuild and flatten.
                stats = torch._C._cuda_memoryStats(self.index)
                allocated = stats["allocated_bytes"]["all"]
                peak, now = allocated["peak"], allocated["current"]
                reserved = stats["reserved_bytes"]["all"]["current"]
            except Exception:  # noqa: BLE001 - a torch without the private call
                flat = torch.cuda.memory_stats(self.index)
                peak = flat.get("allocated_bytes.all.peak", 0)
                now = flat.get("allocated_bytes.all.current", 0)
                reserved = flat.get("reserved_bytes.all.current", 0)
            if self.resets:
                torch.cuda.reset_peak_memory_stats(self.index)
            return peak, now, reserved
        peak, now = _native.process_sample(self.resets)
        return peak, now, 0

    def now(self) -> int:
        """Memory in use now, without touching the peak."""
        if self.cuda:
            return _torch().cuda.memory_allocated(self.index)
        return _native.process_rss()

    def reserved(self) -> int:
        """Memory the allocator holds now (0 on CPU)."""
        if self.cuda:
            return _torch().cuda.memory_reserved(self.index)
        return 0


class _Open:
    """A measure in progress: stage, step or phase.

    ``peak`` is the most memory seen in use while it ran; ``at_most`` is set
    where part of it ran while the process stayed under an earlier
    high-water mark, so its true peak lies between ``peak`` and that mark.
    """

    __slots__ = ("at_most", "auto", "kind", "name", "peak", "start", "step", "t0")

    def __init__(self, kind: str, name: str, step: Optional[int], start: int) -> None:
        self.kind = kind
        self.name = name
        self.step = step
        self.start = start
        self.peak = start
        self.at_most = 0
        # A step the tracker opened itself, in a loop that marks none.
        self.auto = False
        self.t0 = time.perf_counter()


# Attributes through which wrappers reach the optimizer they wrap:
# accelerate's AcceleratedOptimizer and DeepSpeed's wrappers (`optimizer`),
# Lightning's LightningOptimizer (`_optimizer`), ZeroRedundancyOptimizer (`optim`).
_INNER_OPTIMIZER = ("optimizer", "_optimizer", "optim")
# How many wrappers deep an optimizer is looked for.
_WRAPPER_DEPTH = 8


def unwrap_optimizer(optimizer: Any) -> Any:
    """Returns the torch optimizer inside framework wrappers (accelerate, Lightning, DeepSpeed), or the object itself."""
    opt = optimizer
    for _ in range(_WRAPPER_DEPTH):
        inner = None
        for attr in _INNER_OPTIMIZER:
            try:
                cand = opt.__dict__.get(attr) if hasattr(opt, "__dict__") else None
            except Exception:  # noqa: BLE001
                cand = None
            if cand is not None and cand is not opt and hasattr(cand, "param_groups"):
                inner = cand
                break
        if inner is None:
            return opt
        opt = inner
    return opt


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
        self._model_ref = weakref.ref(model)
        self._opt_ref: Optional[Any] = None
        self._ema_ref = weakref.ref(ema) if ema is not None else None
        self.grad_every = max(1, int(grad_every))
        self.stage_hooks = bool(stage_hooks)
        self.rank, self.world_size = _rank()
        if rank is not None:
            self.rank = int(rank)
        self.console = (self.rank == 0) if console is None else bool(console)
        self._errors = 0
        self._closed = False
        self._open: list[_Open] = []
        self._step_open: Optional[_Open] = None
        self._stage: Optional[_Open] = None
        self._phases: list[_Open] = []
        self._steps_done = 0
        # Until the code marks a step itself, each optimizer step is one (see _on_forward_pre).
        self._user_steps = False
        self._auto_backward = False
        self._backward_pending = False
        # What the hooks saw, inside steps or not: the end record says it, so
        # that a log with no steps still tells what ran.
        self._seen = {"forward": 0, "backward": 0, "optimizer": 0}
        # The process's high-water mark at the last sample, and the highest seen.
        self._counter = 0
        self._high = 0
        # How the run ended, where the tracker learns it before closing.
        self._ended: dict[str, Any] = {}
        self._components_after_first_step = False
        self._model_hooks: list[Any] = []
        self._opt_hooks: list[Any] = []
        # The last plan record, where an integration or auto_batch wrote one.
        self._plan_fields: Optional[dict[str, Any]] = None
        # An OOM seen by the CUDA allocator's observer, before its exception exists.
        self._observed_oom = False
        # Set while an OOM is being written: an allocation that fails inside
        # (another thread's, or one made while dumping) is not written again.
        self._writing_oom = False
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
        self.log_path = self._new_log_path(log_dir)
        self._log = _native.RunLog(self.log_path)
        self._history = False
        if record_history:
            self._start_history(max_entries)
        if self._meter.cuda:
            _watch_allocator_ooms(self)
        # Before the start record, so that a resumed optimizer's state is counted in it.
        self.set_optimizer(optimizer)
        components: dict[str, Any] = {}
        try:
            with torch.no_grad():
                components = self._components()
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
        self._install_model_hooks(model)
        if check_duplicates:
            self.find_duplicates(when="start")

    # ----- public API -------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        """The torch optimizer whose state is counted (wrappers removed), or None."""
        return self._opt_ref() if self._opt_ref is not None else None

    def set_optimizer(self, optimizer: Any, hooks: Optional[bool] = None) -> None:
        """Tracks ``optimizer`` (unwrapped from accelerate, Lightning or DeepSpeed) instead of the current one.

        With ``hooks`` (default: the tracker's ``stage_hooks``), its step marks
        the optimizer stage. A framework that builds a new optimizer on a
        retry (the Hugging Face Trainer's ``auto_find_batch_size``) calls this
        again; the old optimizer's hooks are removed.
        """
        try:
            for h in self._opt_hooks:
                with contextlib.suppress(Exception):
                    h.remove()
            self._opt_hooks.clear()
            self._opt_ref = None
            if optimizer is None:
                return
            inner = unwrap_optimizer(optimizer)
            self._opt_ref = weakref.ref(inner)
            # A new optimizer's state appears after its own first step.
            self._components_after_first_step = False
            if self.stage_hooks if hooks is None else hooks:
                self._opt_hooks.append(inner.register_step_pre_hook(self._on_opt_pre))
                self._opt_hooks.append(inner.register_step_post_hook(self._on_opt_post))
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
        self._user_steps = True
        self._begin_step(index, auto=False)

    def _begin_step(self, index: int, auto: bool) -> None:
        try:
            if self._step_open is not None:
                self.end_step()
            now, _ = self._sample()
            self._step_open = self._open_measure("step", "step", int(index), now)
            self._step_open.auto = auto
            self._auto_backward = False
        except Exception as exc:  # noqa: BLE001
            self._error("begin step", exc)

    def end_step(self) -> None:
        """Ends the open step (and its open stage) and writes them; does nothing when no step is open."""
        step = self._step_open
        if step is None:
            return
        try:
            now, reserved = self._sample()
            if self._stage is not None:
                self._close(self._stage, now, reserved)
            self._close(step, now, reserved)
        except Exception as exc:  # noqa: BLE001
            self._drop(self._stage)
            self._drop(step)
            self._error("end step", exc)
        self._steps_done += 1

    def begin_stage(self, name: str) -> None:
        """Starts stage ``name`` (forward, backward, optimizer) of the open step, ending the stage before it.

        For integrations that mark stages from a framework's events; create
        the tracker with ``stage_hooks=False`` so hooks do not mark them too.
        Outside a step, or inside a phase, it does nothing.
        """
        if self._step_open is None or self._phases:
            return
        try:
            if name == "optimizer" and self._due():
                self._grad_health()
            now, reserved = self._sample()
            if self._stage is not None:
                self._close(self._stage, now, reserved)
            self._stage = self._open_measure("stage", name, self._step_open.step, now)
        except Exception as exc:  # noqa: BLE001
            self._error(f"begin {name}", exc)

    def end_stage(self) -> None:
        """Ends the open stage and writes it; does nothing when none is open."""
        stage = self._stage
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
            self._phases.append(self._open_measure("phase", str(name), self._current_step, now))
        except Exception as exc:  # noqa: BLE001
            self._error(f"begin {name}", exc)

    def end_phase(self) -> None:
        """Ends the innermost open phase and writes it; does nothing when none is open."""
        if not self._phases:
            return
        phase = self._phases[-1]
        try:
            now, reserved = self._sample()
            self._close(phase, now, reserved)
        except Exception as exc:  # noqa: BLE001
            self._drop(phase)
            self._error("end phase", exc)

    @property
    def _current_step(self) -> Optional[int]:
        """The open step's index, or None outside a step."""
        return self._step_open.step if self._step_open is not None else None

    @property
    def closed(self) -> bool:
        """True once the tracker is closed."""
        return self._closed

    @property
    def in_step(self) -> bool:
        """True while a step is open."""
        return self._step_open is not None

    @property
    def current_phase(self) -> Optional[str]:
        """The innermost open phase's name, or None."""
        return self._phases[-1].name if self._phases else None

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
            if self._closed:
                return True
            text = str(oom).strip()
            message = text.splitlines()[0] if text else type(oom).__name__
            if self._observed_oom:
                # The allocator's observer already wrote this one, at the failing allocation;
                # `oomkit run` still gets the exception's message, which has the figures.
                self._observed_oom = False
                _plan.report_oom(message, self._current_step, self.current_phase)
                return True
            self._write_oom(message, requested_bytes(text))
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
                self._plan_fields = dict(fields)
        except Exception as exc:  # noqa: BLE001
            self._error(f"note {record_type}", exc)

    def find_duplicates(self, when: str = "manual") -> dict[str, Any]:
        """Finds live tensors that mirror the model's parameters but belong to nothing tracked."""
        step = self._current_step
        result: dict[str, Any] = {"type": "duplicates", "when": when, "step": step, "bytes": 0, "groups": []}
        try:
            torch = _torch()
            with torch.no_grad():
                result = self._duplicates(when)
            self._write(result)
        except Exception as exc:  # noqa: BLE001
            self._error("find_duplicates", exc)
        return result

    def close(self) -> None:
        """Ends what is open, removes the hooks, writes the final record and closes the log."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            while self._phases:
                self.end_phase()
            self.end_step()
        self._closed = True
        _forget_tracker(self)
        for h in self._model_hooks + self._opt_hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._model_hooks.clear()
        self._opt_hooks.clear()
        with contextlib.suppress(Exception):
            end: dict[str, Any] = {
                "type": "end",
                "time": time.time(),
                "steps": self._steps_done,
                "ended": "closed",
                "seen": dict(self._seen),
                "peak_bytes": self._high,
            }
            end.update(self._ended)
            self._write(end)
        with contextlib.suppress(Exception):
            self._log.close()
        if self._history:
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
            for o in self._open:
                if mark > o.peak:
                    o.peak = mark
            self._high = max(self._high, mark)
        else:
            # Below the mark (or another tool reset the counter since): a bound, not a figure.
            # A counter that fell was reset inside this interval, so what it
            # reached since is this interval's too.
            low = mark if mark < before else now
            for o in self._open:
                if max(now, low) > o.peak:
                    o.peak = max(now, low)
                if before > o.at_most:
                    o.at_most = before
        if now > self._high:
            self._high = now
        return now, reserved

    def _open_measure(self, kind: str, name: str, step: Optional[int], now: int) -> _Open:
        o = _Open(kind, name, step, now)
        self._open.append(o)
        return o

    def _drop(self, o: Optional[_Open]) -> None:
        """Forgets a measure, written or not, so that nothing keeps it open."""
        if o is None:
            return
        self._open = [x for x in self._open if x is not o]
        self._phases = [x for x in self._phases if x is not o]
        if o is self._stage:
            self._stage = None
        if o is self._step_open:
            self._step_open = None

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
                rec = self._components()
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
        record: dict[str, Any] = {"device": self.device, "steps": self._steps_done + 1}
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

    def _hooks_mark(self) -> bool:
        """Whether stage hooks should mark a stage now: inside a step, outside any phase."""
        return self.stage_hooks and self._step_open is not None and not self._phases

    # ----- hooks ------------------------------------------------------------

    def _install_model_hooks(self, model: Any) -> None:
        try:
            if self.stage_hooks:
                self._model_hooks.append(model.register_forward_pre_hook(self._on_forward_pre))
            try:
                # Called also when the forward raises, so an OOM there is
                # recorded before anything unwinds, even if a framework
                # catches it (accelerate's batch finder does).
                self._model_hooks.append(model.register_forward_hook(self._on_forward, always_call=True))
            except TypeError:  # torch without always_call
                self._model_hooks.append(model.register_forward_hook(self._on_forward))
        except Exception as exc:  # noqa: BLE001
            self._error("model hooks", exc)

    def _on_forward_pre(self, module: Any, args: Any) -> None:
        self._auto_step(module)
        if self._hooks_mark():
            self.begin_stage("forward")

    def _auto_step(self, module: Any) -> None:
        """Opens a step at a training forward when the code marks none, so that its optimizer steps count as steps.

        The step ends at the optimizer's step (``_on_opt_post``); with no
        optimizer tracked, where the next training forward starts after a
        backward. Forwards in eval mode or without gradients open nothing.
        """
        if self._user_steps or self._phases or self._closed:
            return
        try:
            if not getattr(module, "training", True) or not _torch().is_grad_enabled():
                return
            step = self._step_open
            if step is not None and step.auto and self._opt_ref is None and self._auto_backward:
                self.end_step()
                step = None
            if step is None:
                self._begin_step(self._steps_done, auto=True)
        except Exception as exc:  # noqa: BLE001
            self._error("automatic step", exc)

    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        failing = sys.exc_info()[1]
        if failing is not None and output is None:
            self.record_oom(failing)
            return
        self._seen["forward"] += 1
        # A new forward means any backward before it has ended, even one that raised.
        self._backward_pending = False
        if self._hooks_mark() and self._stage is not None and self._stage.name == "forward":
            self.end_stage()
        # The backward is watched inside steps, and everywhere while the code
        # marks no step (it may be the only sign of training); a loop that
        # marks its own steps pays nothing for forwards outside them.
        if not self.stage_hooks or (self._user_steps and self._step_open is None):
            return
        try:
            if _torch().is_grad_enabled():
                for t in _grad_tensors(output):
                    t.register_hook(self._on_backward_start)
        except Exception as exc:  # noqa: BLE001
            self._error("forward hook", exc)

    def _on_backward_start(self, grad: Any) -> None:
        try:
            # Each output's hook fires; the first one of a backward pass marks it.
            if self._backward_pending:
                return None
            self._backward_pending = True
            if self._hooks_mark() and self._stage is None:
                self.begin_stage("backward")
            from torch.autograd import Variable

            Variable._execution_engine.queue_callback(self._on_backward_end)
        except Exception as exc:  # noqa: BLE001
            self._error("backward hook", exc)
        return None

    def _on_backward_end(self) -> None:
        self._backward_pending = False
        self._seen["backward"] += 1
        self._auto_backward = True
        if self._stage is not None and self._stage.name == "backward":
            self.end_stage()
            if self._opt_ref is None and self._due():
                self._grad_health()

    def _on_opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._hooks_mark():
            self.begin_stage("optimizer")

    def _on_opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._seen["optimizer"] += 1
        if self._stage is not None and self._stage.name == "optimizer":
            self.end_stage()
        if self._step_open is not None and self._step_open.auto:
            self.end_step()

    def _due(self) -> bool:
        return self._step_open is not None and (self._step_open.step or 0) % self.grad_every == 0

    # ----- accounting -------------------------------------------------------

    def _params(self) -> list[Any]:
        model = self._model_ref()
        return list(model.parameters()) if model is not None else []

    def _components(self) -> dict[str, Any]:
        model = self._model_ref()
        seen: set = set()
        params_bytes = trainable = frozen = count = 0
        for p in model.parameters() if model is not None else []:
            b = _add_unique(p, seen)
            params_bytes += b
            count += p.numel() if b else 0
            if p.requires_grad:
                trainable += b
            else:
                frozen += b
        buffers = sum(_add_unique(b, seen) for b in (model.buffers() if model is not None else []))
        grads_seen: set = set()
        grads = sum(_add_unique(p.grad, grads_seen) for p in self._params() if p.grad is not None)
        opt_seen: set = set()
        opt_bytes = sum(_add_unique(t, opt_seen) for t in self._optimizer_tensors())
        ema_bytes, ema_device = self._ema_cost()
        by_module = []
        if model is not None:
            for name, child in model.named_children():
                ps = list(child.parameters())
                mseen: set = set()
                pb = sum(_add_unique(p, mseen) for p in ps)
                tb = sum(_nbytes(p) for p in ps if p.requires_grad)
                by_module.append(
                    {
                        "name": name,
                        "params_bytes": pb,
                        "trainable_bytes": tb,
                        "frozen": bool(ps) and not any(p.requires_grad for p in ps),
                    }
                )
        return {
            "params_bytes": params_bytes,
            "params_count": count,
            "trainable_bytes": trainable,
            "frozen_bytes": frozen,
            "buffers_bytes": buffers,
            "grads_bytes": grads,
            "optimizer_state_bytes": opt_bytes,
            "ema_bytes": ema_bytes,
            "ema_device": ema_device,
            "by_module": by_module,
        }

    def _ema_tensors(self) -> list[Any]:
        ema = self._ema_ref() if self._ema_ref is not None else None
        if ema is None:
            return []
        torch = _torch()
        if isinstance(ema, torch.nn.Module):
            return list(ema.parameters()) + list(ema.buffers())
        out: list[Any] = []
        for v in vars(ema).values():
            _collect_tensors(v, out, 3)
        return out

    def _ema_cost(self) -> tuple[int, Optional[str]]:
        tensors = self._ema_tensors()
        seen: set = set()
        total = sum(_add_unique(t, seen) for t in tensors)
        return total, (str(tensors[0].device) if tensors else None)

    def _optimizer_tensors(self) -> list[Any]:
        opt = self._opt_ref() if self._opt_ref is not None else None
        if opt is None:
            return []
        out: list[Any] = []
        states = getattr(opt, "state", None)
        if not isinstance(states, dict):  # an optimizer-like object without torch's state table
            return out
        for state in states.values():
            if isinstance(state, dict):
                out.extend(v for v in state.values() if _is_tensor(v))
        return out

    def _tracked_storages(self) -> set:
        keys = set()
        model = self._model_ref()
        if model is not None:
            for t in list(model.parameters()) + list(model.buffers()):
                keys.add(_storage_key(t))
                if t.grad is not None:
                    keys.add(_storage_key(t.grad))
        for t in self._optimizer_tensors():
            keys.add(_storage_key(t))
        for t in self._ema_tensors():
            keys.add(_storage_key(t))
        return keys

    def _duplicates(self, when: str) -> dict[str, Any]:
        params = self._params()
        want: dict[tuple[int, ...], int] = {}
        for p in params:
            want[tuple(p.shape)] = want.get(tuple(p.shape), 0) + 1
        # Tiny shapes (biases of 10 classes) match stray tensors by chance,
        # so only larger parameters decide whether a group is a copy.
        large = {tuple(p.shape) for p in params if p.numel() >= 64}
        n_large = sum(1 for p in params if p.numel() >= 64)
        tracked = self._tracked_storages()
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        torch = _torch()
        for obj in gc.get_objects():
            try:
                if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
                    continue
                shape = tuple(obj.shape)
                if shape not in want:
                    continue
                key = _storage_key(obj)
                if key in tracked:
                    continue
                size = _nbytes(obj)
            except Exception:  # noqa: BLE001 - exotic tensor subclasses
                continue
            g = groups.setdefault((str(obj.dtype), str(obj.device)), {"storages": set(), "shapes": {}})
            if key in g["storages"]:
                continue
            g["storages"].add(key)
            g["shapes"].setdefault(shape, []).append(size)
        out = []
        for (dtype, device), g in groups.items():
            matched = sum(min(len(v), want[s]) for s, v in g["shapes"].items() if s in large)
            if matched < max(2, (n_large + 1) // 2):
                continue
            kept = [sorted(v, reverse=True)[: want[s]] for s, v in g["shapes"].items()]
            out.append(
                {
                    "dtype": dtype,
                    "device": device,
                    "tensors": sum(len(k) for k in kept),
                    "bytes": sum(sum(k) for k in kept),
                    "params_matched": sum(min(len(v), want[s]) for s, v in g["shapes"].items()),
                    "params_total": len(params),
                }
            )
        return {
            "type": "duplicates",
            "when": when,
            "step": self._current_step,
            "bytes": sum(g["bytes"] for g in out),
            "groups": out,
        }

    def _grad_health(self) -> None:
        try:
            torch = _torch()
            with torch.no_grad():
                grads = [p.grad for p in self._params() if p.grad is not None]
                rec: dict[str, Any] = {
                    "type": "grad",
                    "step": self._current_step,
                    "params_with_grad": len(grads),
                    "grad_bytes": sum(_nbytes(g) for g in grads),
                }
                if grads:
                    by_dev: dict[tuple[Any, Any], list[Any]] = {}
                    for g in grads:
                        by_dev.setdefault((g.device, g.dtype), []).append(g)
                    norms: list[Any] = []
                    for gs in by_dev.values():
                        norms.extend(n.float() for n in torch._foreach_norm(gs))
                    dev = grads[0].device
                    stacked = torch.stack([n.to(dev) for n in norms])
                    summary = torch.stack(
                        [
                            stacked.norm(),
                            stacked.isnan().sum().float(),
                            stacked.isinf().sum().float(),
                        ]
                    ).tolist()  # the one host sync
                    rec["total_norm"] = summary[0]
                    rec["nan_params"] = int(summary[1])
                    rec["inf_params"] = int(summary[2])
                self._write(rec)
        except Exception as exc:  # noqa: BLE001
            self._error("gradient health", exc)

    # ----- OOM capture ------------------------------------------------------

    def _start_history(self, max_entries: int) -> None:
        torch = _torch()
        if not self._meter.cuda:
            self._say("record_history needs CUDA; not recording on this device")
            return
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        self._history = True

    def _write_oom(self, message: str, requested: Optional[int]) -> None:
        """Writes an OOM record for the open step, stage and phase, checks duplicates, dumps a snapshot, and prints the diagnosis."""
        if self._writing_oom:
            return
        self._writing_oom = True
        try:
            self._write_oom_now(message, requested)
        finally:
            self._writing_oom = False

    def _write_oom_now(self, message: str, requested: Optional[int]) -> None:
        step = self._current_step
        phase = self.current_phase
        stage = self._stage.name if self._stage is not None else None
        snapshot = None
        if self._history:
            snapshot = os.path.join(
                os.path.dirname(str(self.log_path)),
                f"oom-step{step}-rank{self.rank}-{int(time.time())}.pickle",
            )
            try:
                _torch().cuda.memory._dump_snapshot(snapshot)
            except Exception as e:  # noqa: BLE001
                self._error("dump snapshot", e)
                snapshot = None
        with contextlib.suppress(Exception):
            # What the failing stage reached up to now, into its open measures.
            self._sample()
        peak = max([o.peak for o in self._open] + [0])
        self._write(
            {
                "type": "oom",
                "time": time.time(),
                "step": step,
                "stage": stage or phase,
                "phase": phase,
                "requested_bytes": requested,
                "message": message[:2000],
                "memory": {
                    "allocated_bytes": self._meter.now(),
                    "reserved_bytes": self._meter.reserved(),
                    "peak_bytes": peak,
                    "capacity_bytes": self._meter.capacity,
                },
                "snapshot": snapshot,
            }
        )
        _plan.report_oom(message, step, stage or phase)
        # Under torchrun, a trainer's plan steps down for every rank's restart
        # (auto_batch does its own, from the exception it sees).
        if _plan.active() is None and self._plan_fields:
            _plan.elastic_step_down(self._plan_fields, message, self.rank)
        self.find_duplicates(when="oom")
        self._log.flush()
        report = _native.analyze_run_text(self.log_path)
        sys.stderr.write(f"\noomkit (rank {self.rank}): out of memory, diagnosis\n{report}\n")
        sys.stderr.flush()

    def _on_allocator_oom(self, device: int, alloc: int, device_limit: int, device_free: int) -> None:
        """Records an OOM the CUDA allocator reports, at the failing allocation, even if a framework swallows the error.

        The allocator passes the device, the bytes asked for, the memory the
        process may use (the device's, or the cap a memory fraction sets)
        and the bytes the driver reports free; it releases its lock first.
        """
        try:
            if self._closed or device != getattr(self._meter, "index", None):
                return
            self._write_oom(
                f"CUDA out of memory (seen by the allocator): tried to allocate {alloc} bytes "
                f"with {device_free} bytes free of {device_limit} on GPU {device}",
                int(alloc),
            )
            # The exception that follows is this same OOM.
            self._observed_oom = True
        except Exception as e:  # noqa: BLE001
            self._error("allocator oom observer", e)

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
        if self._closed and record.get("type") != "end":
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


def _is_tensor(v: Any) -> bool:
    try:
        return isinstance(v, _torch().Tensor)
    except Exception:  # noqa: BLE001
        return False


def _collect_tensors(v: Any, out: list[Any], depth: int) -> None:
    if depth < 0:
        return
    if _is_tensor(v):
        out.append(v)
    elif isinstance(v, dict):
        for x in v.values():
            _collect_tensors(x, out, depth - 1)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _collect_tensors(x, out, depth - 1)


# How many tensors of a model's output get a hook that marks the start of backward.
_BACKWARD_MARKS = 4


def _grad_tensors(output: Any, depth: int = 4, out: Optional[list[Any]] = None) -> list[Any]:
    """Finds up to a few tensors in a model's output through which backward may pass.

    Several, because the loss a framework backpropagates is not always the
    first tensor of the output (a custom loss on the logits, say); the first
    hook to fire starts the backward stage.
    """
    found: list[Any] = [] if out is None else out
    if depth < 0 or len(found) >= _BACKWARD_MARKS:
        return found
    if _is_tensor(output):
        if output.requires_grad:
            found.append(output)
        return found
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    elif hasattr(output, "__dict__"):
        items = list(vars(output).values())
    else:
        return found
    for v in items:
        _grad_tensors(v, depth - 1, found)
        if len(found) >= _BACKWARD_MARKS:
            break
    return found


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
        if not t._closed:
            t.note("plan", **plan.record(PLAIN_FRAMEWORK))


def note_oom(exc: BaseException) -> None:
    """Records an OOM that ``oom_guard`` caught in the first open tracker that takes it."""
    for t in list(_LIVE):
        if not t._closed and t.record_oom(exc):
            return


# Trackers on CUDA that hear the allocator's OOM observer; the observer
# cannot be removed once attached, so one is attached per process.
_WATCHERS: weakref.WeakSet[Tracker] = weakref.WeakSet()
_OBSERVER_ATTACHED = False


def _allocator_oom(device: int, alloc: int, device_limit: int, device_free: int) -> None:
    for t in list(_WATCHERS):
        t._on_allocator_oom(device, alloc, device_limit, device_free)


def _watch_allocator_ooms(tracker: Tracker) -> None:
    """Has the CUDA allocator tell ``tracker`` of every OOM, where torch offers the (private) observer."""
    global _OBSERVER_ATTACHED
    _WATCHERS.add(tracker)
    if _OBSERVER_ATTACHED:
        return
    try:
        attach = getattr(_torch()._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(_allocator_oom)
            _OBSERVER_ATTACHED = True
    except Exception as exc:  # noqa: BLE001
        tracker._error("allocator oom observer", exc)


def _forget_tracker(tracker: Tracker) -> None:
    _WATCHERS.discard(tracker)


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


@contextlib.contextmanager
def record_history(path: str | os.PathLike[str], max_entries: int = 100_000) -> Iterator[None]:
    """Records CUDA allocation history inside the block and dumps a snapshot to `path` when it ends."""
    torch = _torch()
    if not torch.cuda.is_available():
        sys.stderr.write("oomkit: record_history needs CUDA; nothing is recorded\n")
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
    finally:
        try:
            torch.cuda.memory._dump_snapshot(os.fspath(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
