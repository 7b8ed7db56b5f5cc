"""Results whose size depends on values the step does not have, made at their largest.

``nonzero``, ``unique``, a boolean mask's selection and torchvision's
``nms`` return as many rows as the data selects. Where the values are
known (labels, positions, flags the step made) the recorder runs them on
the CPU (``Values.run_on_cpu``); where they rest on data the step does
not have (an object detector's proposals scored by its weights) no size
is right, and the largest one is what memory is planned for: every
element selected, every box kept, every value distinct. A step on real
data holds at most that, as a generation run to its ``max_new_tokens``
holds at most what its longest run would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The dtypes of a boolean mask, as indexing takes them.
_MASKS = (torch.bool, torch.uint8)


def _empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _nonzero(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Every element nonzero: one row of coordinates each.
    return _empty((x.numel(), x.dim()), torch.long, x)


def _masked_select(x: torch.Tensor, mask: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    return _empty((int(torch.Size(shape).numel()),), x.dtype, x)


def _unique2(
    x: torch.Tensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every value distinct.
    n = x.numel()
    inverse = _empty(x.shape if return_inverse else (0,), torch.long, x)
    counts = _empty((n,) if return_counts else (0,), torch.long, x)
    return _empty((n,), x.dtype, x), inverse, counts


def _unique_dim(
    x: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[dim]
    inverse = _empty((n,) if return_inverse else (0,), torch.long, x)
    counts = _empty((n,) if return_counts else (0,), torch.long, x)
    return _empty(x.shape, x.dtype, x), inverse, counts


def _unique_consecutive(
    x: torch.Tensor, return_inverse: bool = False, return_counts: bool = False, dim: int | None = None, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dim is not None:
        return _unique_dim(x, dim, True, return_inverse, return_counts)
    return _unique2(x, True, return_inverse, return_counts)


def _nms(boxes: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Every box kept.
    return _empty((boxes.shape[0],), torch.long, boxes)


def _worst_indices(indices: list[Any]) -> list[Any] | None:
    """Indices with each boolean mask made the positions of all its elements (one index per
    dimension it covers); None where there is no mask."""
    out: list[Any] = []
    changed = False
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in _MASKS:
            out += [_empty((index.numel(),), torch.long, index)] * max(index.dim(), 1)
            changed = True
        else:
            out.append(index)
    return out if changed else None


def _index(func: Any) -> Callable[..., Any]:
    def run(x: torch.Tensor, indices: list[Any], *rest: Any, **kwargs: Any) -> Any:
        worst = _worst_indices(list(indices))
        if worst is None:
            raise NotImplementedError
        return func(x, worst, *rest, **kwargs)

    return run


def _by_operator() -> dict[Any, Callable[..., Any]]:
    aten = torch.ops.aten
    table: dict[Any, Callable[..., Any]] = {
        aten.nonzero.default: _nonzero,
        aten.argwhere.default: _nonzero,
        aten.masked_select.default: _masked_select,
        aten._unique2.default: _unique2,
        aten.unique_dim.default: _unique_dim,
        aten.unique_consecutive.default: _unique_consecutive,
    }
    for name in ("index.Tensor", "index_put.default", "index_put_.default", "_index_put_impl_.default"):
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet), overload)
        table[op] = _index(op)
    return table


_WORST = _by_operator()


def worst_case(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any | None:
    """``func``'s result at its largest, on the device of its inputs, for an operation whose
    size depends on values none of its inputs has here; None for any other operation."""
    run = _WORST.get(func)
    if run is None and getattr(func, "namespace", None) == "torchvision" and func.overloadpacket.__name__ == "nms":
        run = _nms
    if run is None:
        return None
    try:
        return run(*args, **kwargs)
    except (NotImplementedError, RuntimeError, TypeError, IndexError):
        # Not a shape the worst case can stand for (values that must match a count the data sets).
        return None
