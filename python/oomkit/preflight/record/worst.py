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

Masks that partition one tensor select each of its elements once in all:
``idx == i`` for each expert ``i`` of a mixture of experts' router (its
top-k choices), or the slices of ``one_hot(idx)``. Each alone could take
every element, but not all of them together: the first takes what is
left of the source's elements, and the ones after it what remains
(``Selections``), so the experts' inputs add up to the router's choices,
as on a GPU, however unevenly spread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The dtypes of a boolean mask, as indexing takes them.
_MASKS = (torch.bool, torch.uint8)


def _empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


Count = Callable[[torch.Tensor, int], int]


def _nonzero(count: Count, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Every element nonzero (of those a partition leaves it): one row of coordinates each.
    return _empty((count(x, x.numel()), x.dim()), torch.long, x)


def _masked_select(count: Count, x: torch.Tensor, mask: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    n = int(torch.Size(shape).numel())
    return _empty((count(mask, n) if mask.shape == shape else n,), x.dtype, x)


def _unique2(
    _count: Count, x: torch.Tensor, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every value distinct.
    n = x.numel()
    inverse = _empty(x.shape if return_inverse else (0,), torch.long, x)
    counts = _empty((n,) if return_counts else (0,), torch.long, x)
    return _empty((n,), x.dtype, x), inverse, counts


def _unique_dim(
    _count: Count, x: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[dim]
    inverse = _empty((n,) if return_inverse else (0,), torch.long, x)
    counts = _empty((n,) if return_counts else (0,), torch.long, x)
    return _empty(x.shape, x.dtype, x), inverse, counts


def _unique_consecutive(
    count: Count, x: torch.Tensor, return_inverse: bool = False, return_counts: bool = False, dim: int | None = None, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dim is not None:
        return _unique_dim(count, x, dim, True, return_inverse, return_counts)
    return _unique2(count, x, True, return_inverse, return_counts)


def _nms(_count: Count, boxes: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Every box kept.
    return _empty((boxes.shape[0],), torch.long, boxes)


def _worst_indices(count: Count, indices: list[Any]) -> list[Any] | None:
    """Indices with each boolean mask made the positions of all its elements (of those a
    partition leaves it; one index per dimension it covers); None where there is no mask."""
    out: list[Any] = []
    changed = False
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in _MASKS:
            out += [_empty((count(index, index.numel()),), torch.long, index)] * max(index.dim(), 1)
            changed = True
        else:
            out.append(index)
    return out if changed else None


def _index(func: Any) -> Callable[..., Any]:
    def run(count: Count, x: torch.Tensor, indices: list[Any], *rest: Any, **kwargs: Any) -> Any:
        worst = _worst_indices(count, list(indices))
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

#: Operators whose result partitions their input's elements among the values compared with
#: (``idx == i``), and ``one_hot``, whose slices along its classes do.
_EQUALITY = frozenset({torch.ops.aten.eq.Scalar, torch.ops.aten.eq.Tensor})
_ONE_HOT = torch.ops.aten.one_hot.default
#: A mask's copy in another dtype (``one_hot`` on meta compares and copies to int64) selects as it does.
_COPY = torch.ops.aten._to_copy.default
#: Every operator ``Selections.made`` notes.
PARTITIONING = _EQUALITY | {_ONE_HOT, _COPY}


class Selections:
    """Results at their largest (``worst_case``), with the masks that partition one tensor
    sharing its elements: each allocation's source, and the elements each source has left.

    ``index_of`` gives a tensor's allocation (its storage, recorded), or None."""

    def __init__(self, index_of: Callable[[torch.Tensor], int | None]) -> None:
        self._index_of = index_of
        self._source_of: dict[int, tuple[int, Any]] = {}
        self._left: dict[tuple[int, Any], int] = {}

    def made(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """Notes a partitioning mask ``func`` made: ``idx == i`` of its source ``idx``, or a one-hot."""
        if func is _COPY:
            if args[0].dtype == torch.bool:
                copied = self._index_of(args[0])
                key = self._source_of.get(copied) if copied is not None else None
                made = self._index_of(out)
                if key is not None and made is not None:
                    self._source_of[made] = key
            return
        if func in _EQUALITY:
            source, total = args[0], args[0].numel()
        elif func is _ONE_HOT:
            source, total = out, args[0].numel()
        else:
            return
        mask, of = self._index_of(out), self._index_of(source)
        if mask is not None and of is not None:
            # (A source's masks of one kind are one partition: ``idx == i`` for each i, or a one-hot's classes.)
            key = (of, func)
            self._source_of[mask] = key
            self._left.setdefault(key, total)

    def _count(self, mask: torch.Tensor, most: int) -> int:
        """How many of ``mask``'s ``most`` elements it selects at its largest: all, or what its source has left."""
        index = self._index_of(mask)
        key = self._source_of.get(index) if index is not None else None
        if key is None:
            return most
        n = min(most, self._left[key])
        self._left[key] -= n
        return n

    def worst_case(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any | None:
        """``func``'s result at its largest, on the device of its inputs, for an operation whose
        size depends on values none of its inputs has here; None for any other operation."""
        run = _WORST.get(func)
        if run is None and getattr(func, "namespace", None) == "torchvision" and func.overloadpacket.__name__ == "nms":
            run = _nms
        if run is None:
            return None
        try:
            return run(self._count, *args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, IndexError):
            # Not a shape the worst case can stand for (values that must match a count the data sets).
            return None
