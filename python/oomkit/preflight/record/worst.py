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

A mask made of zeros with chosen positions set holds at most that many:
an object detector's sampler keeps a fixed number of its proposals
(``mask = zeros_like(labels); mask[chosen] = 1``, torchvision's
``BalancedPositiveNegativeSampler``), however many the data would offer,
and the union of two such masks (``pos | neg``) at most both counts. Each
tensor's bound is kept from how it was made (``Selections.bounded``) and
a selection from it made no larger; written to in any other way, it is
bounded by its size again.

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

_aten = torch.ops.aten
#: Operators whose result holds no nonzero element.
_ZEROS = frozenset({_aten.zeros_like.default, _aten.zeros.default, _aten.new_zeros.default, _aten.zero_.default})
#: ``x.index_fill_(dim, index, value)``: at most ``index``'s positions along ``dim`` set, besides those already.
_INDEX_FILL = frozenset(
    {_aten.index_fill_.int_Scalar, _aten.index_fill_.int_Tensor, _aten.index_fill.int_Scalar, _aten.index_fill.int_Tensor}
)
#: ``x[indices] = values``: at most as many elements set as integer indices pick, besides those already.
_INDEX_PUT = frozenset({_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default})
#: A union holds at most what its operands hold together; an intersection at most what the fewer holds.
_UNION = frozenset({_aten.bitwise_or.Tensor, _aten.bitwise_or_.Tensor, _aten.logical_or.default, _aten.logical_or_.default})
_INTERSECTION = frozenset({_aten.bitwise_and.Tensor, _aten.bitwise_and_.Tensor, _aten.logical_and.default, _aten.logical_and_.default})
_CAT = _aten.cat.default
_FILL = _aten.fill_.Scalar
#: Every operator ``Selections.bounded`` takes the bound of its result from.
BOUNDING = _ZEROS | _INDEX_FILL | _INDEX_PUT | _UNION | _INTERSECTION | {_CAT, _COPY, _FILL}
#: Every operator either notes (one set, so that most operators are passed over with one lookup).
SELECTING = PARTITIONING | BOUNDING


def _scalar_zero(value: Any) -> bool:
    """Whether ``value`` is a Python number equal to zero (a fill that sets nothing)."""
    return isinstance(value, (bool, int, float)) and value == 0


def _mutates(func: Any) -> bool:
    """Whether ``func`` writes into one of its arguments (an in-place or ``out=`` operator)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.is_mutable


class Selections:
    """Results at their largest (``worst_case``), with the masks that partition one tensor
    sharing its elements: each allocation's source, and the elements each source has left.

    ``index_of`` gives a tensor's allocation (its storage, recorded), or None."""

    def __init__(self, index_of: Callable[[torch.Tensor], int | None]) -> None:
        self._index_of = index_of
        self._source_of: dict[int, tuple[int, Any]] = {}
        self._left: dict[tuple[int, Any], int] = {}
        #: The most nonzero elements a tensor can hold, by allocation, where how it was made bounds it.
        self._most: dict[int, int] = {}
        # Whether ``func`` writes into an argument, by operator (asked once each).
        self._mutating: dict[Any, bool] = {}

    @property
    def bounds(self) -> bool:
        """Whether any tensor is bounded now (every operator that writes into one must then be noted)."""
        return bool(self._most)

    def freed(self, index: int) -> None:
        """Forgets the bound of allocation ``index``, freed (so that a step without masks alive notes nothing)."""
        if self._most:
            self._most.pop(index, None)

    def _bound(self, t: Any) -> int:
        """The most nonzero elements ``t`` can hold: its bound, else its size."""
        if not isinstance(t, torch.Tensor):
            return 0
        index = self._index_of(t)
        n = t.numel()
        return min(n, self._most[index]) if index is not None and index in self._most else n

    def bounded(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Notes the bound of what ``func`` made or wrote, where it has one; called before the values
        are noted, with ``args`` as the operator took them (an in-place one's target as it was)."""
        if func in BOUNDING:
            most = self._made_at_most(func, args, kwargs, out)
            index = self._index_of(out) if isinstance(out, torch.Tensor) else None
            if index is not None:
                if most is None or most >= out.numel():
                    self._most.pop(index, None)
                else:
                    self._most[index] = most
            return
        if not self._most:
            return
        mutating = self._mutating.get(func)
        if mutating is None:
            mutating = self._mutating[func] = _mutates(func)
        if mutating:
            # Written to some other way: bounded by its size again.
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor):
                    index = self._index_of(t)
                    if index is not None:
                        self._most.pop(index, None)

    def _made_at_most(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int | None:
        """How many nonzero elements ``func``'s result holds at most; None where nothing bounds it."""
        if func in _ZEROS:
            return 0
        if func is _FILL:
            return 0 if _scalar_zero(args[1]) else None
        if func is _COPY:
            return self._bound(args[0])
        if func in _INDEX_FILL:
            x, dim, index, value = args[:4]
            if _scalar_zero(value):
                return self._bound(x)
            if x.dim() == 0 or not isinstance(index, torch.Tensor):
                return None
            return self._bound(x) + index.numel() * (x.numel() // max(x.shape[dim], 1))
        if func in _INDEX_PUT:
            x, indices = args[0], list(args[1])
            if not indices or any(not isinstance(i, torch.Tensor) or i.dtype in _MASKS for i in indices):
                return None
            picked = torch.broadcast_shapes(*(i.shape for i in indices)).numel()
            return self._bound(x) + picked * int(torch.Size(x.shape[len(indices) :]).numel())
        if not isinstance(out, torch.Tensor):
            return None
        if func is _CAT:
            return sum(self._bound(t) for t in args[0])
        operands = [t for t in args[:2] if isinstance(t, torch.Tensor)]
        if len(operands) != 2:
            return None
        # An operand broadcast over the result holds its elements once per copy.
        each = [self._bound(t) * (out.numel() // max(t.numel(), 1)) for t in operands]
        return sum(each) if func in _UNION else min(each)

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
        if index is not None and index in self._most and mask.untyped_storage().nbytes() >= mask.numel() * mask.element_size():
            # (A mask broadcast over more elements than it holds repeats them: its bound is not theirs.)
            most = min(most, self._most[index])
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
