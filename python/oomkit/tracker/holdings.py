"""What the tracked model holds.

Its components (parameters, buffers, gradients, optimizer state, EMA),
copies of its weights that nothing tracks, and the health of its gradients.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, Optional

from oomkit.tracker.measure import _torch

if TYPE_CHECKING:
    from oomkit.tracker.core import TrackerCore


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


def model_params(tracker: TrackerCore) -> list[Any]:
    model = tracker.books.model_ref()
    return list(model.parameters()) if model is not None else []

def components(tracker: TrackerCore) -> dict[str, Any]:
    model = tracker.books.model_ref()
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
    grads = sum(_add_unique(p.grad, grads_seen) for p in model_params(tracker) if p.grad is not None)
    opt_seen: set = set()
    opt_bytes = sum(_add_unique(t, opt_seen) for t in optimizer_tensors(tracker))
    ema_bytes, ema_device = ema_cost(tracker)
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

def ema_tensors(tracker: TrackerCore) -> list[Any]:
    ema = tracker.books.ema_ref() if tracker.books.ema_ref is not None else None
    if ema is None:
        return []
    torch = _torch()
    if isinstance(ema, torch.nn.Module):
        return list(ema.parameters()) + list(ema.buffers())
    out: list[Any] = []
    for v in vars(ema).values():
        _collect_tensors(v, out, 3)
    return out

def ema_cost(tracker: TrackerCore) -> tuple[int, Optional[str]]:
    tensors = ema_tensors(tracker)
    seen: set = set()
    total = sum(_add_unique(t, seen) for t in tensors)
    return total, (str(tensors[0].device) if tensors else None)

def optimizer_tensors(tracker: TrackerCore) -> list[Any]:
    opt = tracker.books.opt_ref() if tracker.books.opt_ref is not None else None
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

def tracked_storages(tracker: TrackerCore) -> set:
    keys = set()
    model = tracker.books.model_ref()
    if model is not None:
        for t in list(model.parameters()) + list(model.buffers()):
            keys.add(_storage_key(t))
            if t.grad is not None:
                keys.add(_storage_key(t.grad))
    for t in optimizer_tensors(tracker):
        keys.add(_storage_key(t))
    for t in ema_tensors(tracker):
        keys.add(_storage_key(t))
    return keys

def duplicates(tracker: TrackerCore, when: str) -> dict[str, Any]:
    params = model_params(tracker)
    want: dict[tuple[int, ...], int] = {}
    for p in params:
        want[tuple(p.shape)] = want.get(tuple(p.shape), 0) + 1
    # Tiny shapes (biases of 10 classes) match stray tensors by chance,
    # so only larger parameters decide whether a group is a copy.
    large = {tuple(p.shape) for p in params if p.numel() >= 64}
    n_large = sum(1 for p in params if p.numel() >= 64)
    tracked = tracked_storages(tracker)
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
        "step": tracker.current_step,
        "bytes": sum(g["bytes"] for g in out),
        "groups": out,
    }

def grad_health(tracker: TrackerCore) -> None:
    try:
        torch = _torch()
        with torch.no_grad():
            grads = [p.grad for p in model_params(tracker) if p.grad is not None]
            rec: dict[str, Any] = {
                "type": "grad",
                "step": tracker.current_step,
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
            tracker.write(rec)
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("gradient health", exc)
