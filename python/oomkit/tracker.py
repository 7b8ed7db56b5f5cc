"""The in-training memory tracker: stages by hooks, components, gradients, duplicates, OOM capture.

The tracker keeps numbers only, never a reference to a tensor, and every
hook body is guarded: a failure inside the tracker is logged and reported
once, never raised into the training loop. Records go to the Rust run-log
writer, which flushes at every step boundary.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from oomkit import _native
from oomkit._oom import is_oom, requested_bytes

LOG_VERSION = 1


def _torch() -> Any:
    import torch

    return torch


def _rank() -> Tuple[int, int]:
    torch = _torch()
    try:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _storage_key(t: Any) -> Tuple[str, int]:
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
    """Reads memory in use and the peak since the last reset, on CUDA or CPU."""

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        if self.cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.capacity: Optional[int] = torch.cuda.get_device_properties(self.index).total_memory
            self.can_reset = True
        else:
            try:
                self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                self.capacity = None
            self.can_reset = _native.reset_process_peak_rss()

    def now(self) -> int:
        if self.cuda:
            return _torch().cuda.memory_allocated(self.index)
        return _native.process_rss()

    def reserved(self) -> int:
        if self.cuda:
            return _torch().cuda.memory_reserved(self.index)
        return 0

    def peak_and_reset(self) -> int:
        """Returns the peak since the last call, and starts a new interval."""
        if self.cuda:
            torch = _torch()
            p = torch.cuda.max_memory_allocated(self.index)
            torch.cuda.reset_peak_memory_stats(self.index)
            return p
        if self.can_reset:
            p = _native.process_peak_rss()
            _native.reset_process_peak_rss()
            return p
        return _native.process_rss()


class _Open:
    """A measure in progress: stage, step or phase."""

    __slots__ = ("kind", "name", "step", "start", "peak", "t0")

    def __init__(self, kind: str, name: str, step: Optional[int], start: int) -> None:
        self.kind = kind
        self.name = name
        self.step = step
        self.start = start
        self.peak = start
        self.t0 = time.perf_counter()


class Tracker:
    """Records memory per training stage, component costs, gradient health and OOMs to a run log.

    Example::

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
        log_dir: "str | os.PathLike[str]" = "oomkit-logs",
        *,
        grad_every: int = 50,
        record_history: bool = False,
        max_entries: int = 100_000,
        console: Optional[bool] = None,
        check_duplicates: bool = True,
    ) -> None:
        torch = _torch()
        self._model_ref = weakref.ref(model)
        self._opt_ref = weakref.ref(optimizer) if optimizer is not None else None
        self._ema_ref = weakref.ref(ema) if ema is not None else None
        self.grad_every = max(1, int(grad_every))
        self.rank, self.world_size = _rank()
        self.console = (self.rank == 0) if console is None else bool(console)
        self._errors = 0
        self._closed = False
        self._open: List[_Open] = []
        self._step: Optional[int] = None
        self._steps_done = 0
        self._phase: Optional[str] = None
        self._stage: Optional[_Open] = None
        self._components_after_first_step = False
        self._hooks: List[Any] = []
        # `oomkit find-batch` names a file for this run's peak; only rank 0 writes it.
        probe = os.environ.get("OOMKIT_PROBE_FILE")
        self._probe = probe if probe and self.rank == 0 else None
        self._probe_peak = 0
        device = None
        for p in model.parameters():
            device = p.device
            break
        self._meter = _Meter(device)
        self.device = f"cuda:{self._meter.index}" if self._meter.cuda else "cpu"
        self.log_path = self._new_log_path(log_dir)
        self._log = _native.RunLog(self.log_path)
        self._history = False
        if record_history:
            self._start_history(max_entries)
        with torch.no_grad():
            self._write(
                {
                    "type": "start",
                    "version": LOG_VERSION,
                    "time": time.time(),
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "device": self.device,
                    "capacity_bytes": self._meter.capacity,
                    "pid": os.getpid(),
                    "torch": str(torch.__version__),
                    "grad_every": self.grad_every,
                    "components": self._components(),
                }
            )
        self._install_hooks(model, optimizer)
        if check_duplicates:
            self.find_duplicates(when="start")

    # ----- public API -------------------------------------------------------

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Measures one training step; forward, backward and optimizer stages are found by hooks."""
        self._begin("step", "step", index)
        self._step = index
        try:
            yield
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._end_stage()
            self._finish("step")
            self._steps_done += 1
            self._step = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measures a named phase such as "eval", inside or outside a step."""
        outer = self._phase
        self._begin("phase", name, self._step)
        self._phase = name
        try:
            yield
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._finish("phase")
            self._phase = outer

    def find_duplicates(self, when: str = "manual") -> Dict[str, Any]:
        """Finds live tensors that mirror the model's parameters but belong to nothing tracked."""
        result: Dict[str, Any] = {"type": "duplicates", "when": when, "step": self._step, "bytes": 0, "groups": []}
        try:
            torch = _torch()
            with torch.no_grad():
                result = self._duplicates(when)
            self._write(result)
        except Exception as exc:  # noqa: BLE001
            self._error("find_duplicates", exc)
        return result

    def close(self) -> None:
        """Removes the hooks, writes the final record and closes the log."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            with contextlib.suppress(Exception):
                h.remove()
        self._hooks.clear()
        with contextlib.suppress(Exception):
            self._write({"type": "end", "time": time.time(), "steps": self._steps_done})
        with contextlib.suppress(Exception):
            self._log.close()
        if self._history:
            with contextlib.suppress(Exception):
                _torch().cuda.memory._record_memory_history(enabled=None)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- measuring --------------------------------------------------------

    def _fold(self) -> None:
        """Reads the peak since the last reset into every open measure, then resets."""
        p = self._meter.peak_and_reset()
        for o in self._open:
            if p > o.peak:
                o.peak = p

    def _begin(self, kind: str, name: str, step: Optional[int]) -> None:
        try:
            self._fold()
            o = _Open(kind, name, step, self._meter.now())
            self._open.append(o)
            if kind == "stage":
                self._stage = o
        except Exception as exc:  # noqa: BLE001
            self._error(f"begin {name}", exc)

    def _finish(self, kind: str) -> None:
        try:
            idx = max(i for i, o in enumerate(self._open) if o.kind == kind)
        except ValueError:
            return
        try:
            self._fold()
            o = self._open.pop(idx)
            end = self._meter.now()
            if kind == "stage":
                self._stage = None
            reserved = self._meter.reserved()
            peak = max(o.peak, end)
            self._write(
                {
                    "type": kind,
                    "step": o.step,
                    "name": o.name,
                    "start_bytes": o.start,
                    "end_bytes": end,
                    "peak_bytes": peak,
                    "reserved_bytes": reserved,
                    "seconds": time.perf_counter() - o.t0,
                }
            )
            if kind == "step" and self._probe:
                self._write_probe(peak, reserved)
        except Exception as exc:  # noqa: BLE001
            self._error(f"finish {kind}", exc)

    def _write_probe(self, peak: int, reserved: int) -> None:
        """Writes the run's peak so far for `oomkit find-batch`, whole or not at all."""
        # The caching allocator rarely returns memory, so reserved bytes at the
        # end of a step are its peak; the device also holds the CUDA context.
        need = max(self._probe_peak, peak, reserved)
        record: Dict[str, Any] = {"device": self.device, "steps": self._steps_done + 1}
        if self._meter.cuda:
            free, total = _torch().cuda.mem_get_info(self._meter.index)
            baseline = int(os.environ.get("OOMKIT_BASELINE_USED_BYTES", "0") or 0)
            outside = max(0, (total - free) - baseline - reserved)
            record["nonpytorch_bytes"] = outside
            need = max(need, reserved + outside)
        self._probe_peak = need
        record["peak_bytes"] = need
        tmp = f"{self._probe}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, self._probe)

    def _end_stage(self) -> None:
        if self._stage is not None:
            self._finish("stage")

    def _in_step(self) -> bool:
        return self._step is not None

    # ----- hooks ------------------------------------------------------------

    def _install_hooks(self, model: Any, optimizer: Any) -> None:
        self._hooks.append(model.register_forward_pre_hook(self._on_forward_pre))
        self._hooks.append(model.register_forward_hook(self._on_forward))
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._on_opt_pre))
            self._hooks.append(optimizer.register_step_post_hook(self._on_opt_post))

    def _on_forward_pre(self, module: Any, args: Any) -> None:
        if not self._in_step() or self._phase is not None:
            return
        self._end_stage()
        self._begin("stage", "forward", self._step)

    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        if not self._in_step() or self._phase is not None:
            return
        if self._stage is None or self._stage.name != "forward":
            return
        self._finish("stage")
        try:
            torch = _torch()
            if torch.is_grad_enabled():
                t = _first_grad_tensor(output)
                if t is not None:
                    t.register_hook(self._on_backward_start)
        except Exception as exc:  # noqa: BLE001
            self._error("forward hook", exc)

    def _on_backward_start(self, grad: Any) -> None:
        try:
            if self._in_step() and self._stage is None:
                self._begin("stage", "backward", self._step)
                from torch.autograd import Variable

                Variable._execution_engine.queue_callback(self._on_backward_end)
        except Exception as exc:  # noqa: BLE001
            self._error("backward hook", exc)
        return None

    def _on_backward_end(self) -> None:
        if self._stage is not None and self._stage.name == "backward":
            self._finish("stage")
            if self._opt_ref is None and self._due():
                self._grad_health()

    def _on_opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._in_step():
            return
        self._end_stage()
        if self._due():
            self._grad_health()
        self._begin("stage", "optimizer", self._step)

    def _on_opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._stage is not None and self._stage.name == "optimizer":
            self._finish("stage")
        if not self._components_after_first_step:
            # The optimizer's state exists only after its first step.
            self._components_after_first_step = True
            try:
                with _torch().no_grad():
                    rec = self._components()
                rec["type"] = "components"
                rec["step"] = self._step
                self._write(rec)
            except Exception as exc:  # noqa: BLE001
                self._error("components", exc)

    def _due(self) -> bool:
        return self._step is not None and self._step % self.grad_every == 0

    # ----- accounting -------------------------------------------------------

    def _params(self) -> List[Any]:
        model = self._model_ref()
        return list(model.parameters()) if model is not None else []

    def _components(self) -> Dict[str, Any]:
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

    def _ema_tensors(self) -> List[Any]:
        ema = self._ema_ref() if self._ema_ref is not None else None
        if ema is None:
            return []
        torch = _torch()
        if isinstance(ema, torch.nn.Module):
            return list(ema.parameters()) + list(ema.buffers())
        out: List[Any] = []
        for v in vars(ema).values():
            _collect_tensors(v, out, 3)
        return out

    def _ema_cost(self) -> Tuple[int, Optional[str]]:
        tensors = self._ema_tensors()
        seen: set = set()
        total = sum(_add_unique(t, seen) for t in tensors)
        return total, (str(tensors[0].device) if tensors else None)

    def _optimizer_tensors(self) -> List[Any]:
        opt = self._opt_ref() if self._opt_ref is not None else None
        if opt is None:
            return []
        out: List[Any] = []
        for state in opt.state.values():
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

    def _duplicates(self, when: str) -> Dict[str, Any]:
        params = self._params()
        want: Dict[Tuple[int, ...], int] = {}
        for p in params:
            want[tuple(p.shape)] = want.get(tuple(p.shape), 0) + 1
        # Tiny shapes (biases of 10 classes) match stray tensors by chance,
        # so only larger parameters decide whether a group is a copy.
        large = {tuple(p.shape) for p in params if p.numel() >= 64}
        n_large = sum(1 for p in params if p.numel() >= 64)
        tracked = self._tracked_storages()
        groups: Dict[Tuple[str, str], Dict[str, Any]] = {}
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
            "step": self._step,
            "bytes": sum(g["bytes"] for g in out),
            "groups": out,
        }

    def _grad_health(self) -> None:
        try:
            torch = _torch()
            with torch.no_grad():
                grads = [p.grad for p in self._params() if p.grad is not None]
                rec: Dict[str, Any] = {
                    "type": "grad",
                    "step": self._step,
                    "params_with_grad": len(grads),
                    "grad_bytes": sum(_nbytes(g) for g in grads),
                }
                if grads:
                    by_dev: Dict[Tuple[Any, Any], List[Any]] = {}
                    for g in grads:
                        by_dev.setdefault((g.device, g.dtype), []).append(g)
                    norms = []
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

    def _failed(self, exc: BaseException) -> None:
        """Records an OOM leaving a step or phase; the caller re-raises it."""
        try:
            if not is_oom(exc) or getattr(exc, "_oomkit_seen", False):
                return
            with contextlib.suppress(Exception):
                exc._oomkit_seen = True  # type: ignore[attr-defined]
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            stage = self._stage.name if self._stage is not None else None
            snapshot = None
            if self._history:
                snapshot = os.path.join(
                    os.path.dirname(str(self.log_path)),
                    f"oom-step{self._step}-rank{self.rank}-{int(time.time())}.pickle",
                )
                try:
                    _torch().cuda.memory._dump_snapshot(snapshot)
                except Exception as e:  # noqa: BLE001
                    self._error("dump snapshot", e)
                    snapshot = None
            peak = max([o.peak for o in self._open] + [0])
            self._write(
                {
                    "type": "oom",
                    "time": time.time(),
                    "step": self._step,
                    "stage": stage or self._phase,
                    "phase": self._phase,
                    "requested_bytes": requested_bytes(str(exc)),
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
            self.find_duplicates(when="oom")
            self._log.flush()
            report = _native.analyze_run_text(self.log_path)
            sys.stderr.write(f"\noomkit (rank {self.rank}): out of memory, diagnosis\n{report}\n")
            sys.stderr.flush()
        except Exception as e:  # noqa: BLE001
            self._error("oom capture", e)

    # ----- plumbing ---------------------------------------------------------

    def _new_log_path(self, log_dir: "str | os.PathLike[str]") -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = os.path.join(os.fspath(log_dir), f"run-{stamp}-rank{self.rank}")
        path = base + ".jsonl"
        n = 1
        while os.path.exists(path):
            path = f"{base}-{n}.jsonl"
            n += 1
        return path

    def _write(self, record: Dict[str, Any]) -> None:
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


def _collect_tensors(v: Any, out: List[Any], depth: int) -> None:
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


def _first_grad_tensor(output: Any, depth: int = 4) -> Any:
    """Finds a tensor in a model's output through which backward will pass."""
    if depth < 0:
        return None
    if _is_tensor(output):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    elif hasattr(output, "__dict__"):
        items = list(vars(output).values())
    else:
        return None
    for v in items:
        t = _first_grad_tensor(v, depth - 1)
        if t is not None:
            return t
    return None


@contextlib.contextmanager
def record_history(path: "str | os.PathLike[str]", max_entries: int = 100_000) -> Iterator[None]:
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
