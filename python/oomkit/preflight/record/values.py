"""The values of small tensors without data, where the step itself makes them known.

A ``meta`` tensor has a shape and no values, and a script that reads one
(``.item()``, ``bool(t)``, ``.tolist()``) decides what to do next by it:
Hugging Face's ``generate()`` loops ``while not this_peer_finished``, where
``this_peer_finished`` is ``unfinished.max() == 0`` and ``unfinished`` is
cleared by its stopping criteria (``cur_len >= max_length``, an EOS token).
Read as zero, "not finished" never turns true and the loop never ends.

So every small tensor on ``meta`` carries a shadow on the CPU, computed by
running the same operation on the shadows of its inputs: values the step
makes itself (a counter, ``torch.full((B,), cur_len >= max_length)``,
``arange``, a batch uploaded from the host) are then known exactly, and a
bounded loop runs to its bound. A value that depends on data the step
does not have (the argmax of logits, which are too large to shadow and
have no values) is taken as zero, as ``.item()`` always took it, and the
shadows computed from it are marked assumed, so that reading them is noted
in the answer. Zero token ids rarely match an end-of-sequence token, so a
generation runs to its ``max_new_tokens``: the worst case, which is what
memory is planned for.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

#: Tensors with more elements than this get no shadow: control values
#: (flags per sequence, counters, positions) are small, and activations
#: and weights are far too large to compute twice.
SHADOW_MAX_ELEMENTS = 4096

#: A larger result still gets a shadow, up to this size, where the script builds it from values
#: it knows: a mask (``~torch.eye(n).bool()``, a contrastive loss's pairs, indexing a batch's
#: similarities, ``sim[~mask].view(n, n - 1)``) or a table made from no tensor (``torch.eye``,
#: ``torch.ones``), made when first read. Never an upload from the host: weights copied to the
#: GPU would then be copied again on the CPU, and a forward on them computed there twice.
LARGE_SHADOW_MAX_BYTES = 16 << 20

#: The device tensors without data live on (as ``recorder.FAKE_DEVICE``).
_META = "meta"

#: Comparisons with a value the step does not have, and what they give:
#: such a value is taken to equal no particular one (a generated token is
#: not the end-of-sequence token, so a generation runs to its bound),
#: which zero, a common token id, would not be.
_NO_MATCH = {"eq": False, "isin": False, "ne": True}

#: Operators that return their input's values under another tensor, of the same shape.
_SAME_VALUES = frozenset({"detach", "alias", "lift_fresh"})

#: Factories of new memory whose values are zeros, or undefined (``empty``: zeros, which no
#: correct script reads before writing): their shadow is zeros, made when first read, with
#: no operation run on the CPU (most are never read).
_FRESH_ZEROS = frozenset(
    {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted", "zeros", "zeros_like", "new_zeros"}
)


#: Indexing operators that take a list of index tensors, boolean masks among them.
_INDEXING = frozenset(
    {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._index_put_impl_.default,
    }
)


def _factories() -> frozenset[Any]:
    """The operators that make a tensor from no tensor, whose values their arguments decide."""
    names = ("eye", "ones", "zeros", "full", "arange", "linspace", "logspace", "scalar_tensor", "tril_indices", "triu_indices")
    found: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


#: Factories whose large results get a shadow made when first read (``LARGE_SHADOW_MAX_BYTES``).
_FACTORIES = _factories()


class Shadow:
    """A small meta tensor's values on the CPU, and how far they are known."""

    __slots__ = ("_make", "_values", "_zeros_of", "assumed", "opaque")

    def __init__(
        self,
        values: torch.Tensor | None,
        assumed: bool,
        opaque: bool,
        zeros_of: torch.Tensor | None = None,
        make: Callable[[], Any] | None = None,
    ) -> None:
        # The values, or (for values taken as zero) the tensor whose shape and dtype the zeros
        # take, or the call that makes them, made when first read: most of a step's small
        # results, and the tables it builds, are never read.
        self._values = values
        self._zeros_of = (tuple(zeros_of.shape), zeros_of.dtype) if zeros_of is not None else None
        self._make = make
        #: They rest on a value taken as zero: reading them is noted.
        self.assumed = assumed
        #: They stand for data the step does not have (zeros in its place,
        #: and what arithmetic and indexing make of them), rather than values
        #: computed from such data by a comparison.
        self.opaque = opaque

    @property
    def values(self) -> torch.Tensor:
        """The values on the CPU."""
        if self._values is None and self._zeros_of is not None:
            shape, dtype = self._zeros_of
            self._values = torch.zeros(shape, dtype=dtype)
        if self._values is None and self._make is not None:
            self._values, self._make = self._make(), None
        assert self._values is not None
        return self._values


def _finite(c: Any) -> Any:
    """Values resting on zeros taken for data the step does not have, without the infinities
    and NaNs that arithmetic on those zeros makes (a gradient clipped by a norm taken as zero,
    a loss scaled past float16's range), which the data would not: taken as zero too. A script
    that skips a step on a non-finite norm, or GradScaler's check, would otherwise skip it."""
    if isinstance(c, torch.Tensor) and (c.is_floating_point() or c.is_complex()):
        return torch.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0)
    return c


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == _META


def _small(t: torch.Tensor) -> bool:
    return t.numel() <= SHADOW_MAX_ELEMENTS


def _on_host(a: Any) -> Any:
    """An operation's argument with the CPU in place of ``meta`` where it names a device (a factory's ``device=``)."""
    return torch.device("cpu") if isinstance(a, torch.device) and a.type == _META else a


def _storage_id(t: torch.Tensor) -> int | None:
    """The id of ``t``'s storage, or None for a wrapper without one of its own (a DTensor)."""
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensors_in(*values: Any) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments or results: tensors, lists and tuples of them,
    and the values of a dict (an ATen operator nests no deeper), without pytree's general walk,
    which costs more than the rest of recording an operation."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v
                elif isinstance(v, (list, tuple, dict)):
                    yield from tensors_in(v)
        elif isinstance(value, dict):
            yield from tensors_in(*value.values())


def _leaves(value: Any) -> list[Any]:
    """What is not a list, tuple or dict in an operator's result or its CPU run, in order: the
    nesting ATen has (a tuple of tensors, a foreach op's list), walked without pytree's
    general walk, which costs more than the rest of an operation's recording."""
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _mapped(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` (an operator's arguments: tuples, lists and dicts of them) with ``fn`` applied
    to each of its leaves; a named tuple is walked as a tuple."""
    if type(value) is tuple or type(value) is list:
        return type(value)(_mapped(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(fn, v) for k, v in value.items()}
    return fn(value)


class Values:
    """The shadows of the small meta tensors alive, kept beside them and dropped with their memory.

    No weak reference to a tensor is held: ``torch.utils.swap_tensors`` (how
    ``nn.Module._apply`` replaces FSDP2's parameters in ``to_empty``) refuses
    a tensor that has one. A shadow is kept by the tensor's id with what
    the tensor is a view of (its storage, offset, shape and dtype), checked
    when read, since a dead tensor's id may be taken by another; all of a
    storage's shadows go when the storage does (a weak reference to it).
    """

    def __init__(self) -> None:
        # By the tensor's id: (its storage's id, (offset, shape, dtype), its shadow).
        self._shadows: dict[int, tuple[int, tuple[Any, ...], Shadow]] = {}
        # By a storage's id: the weak reference that drops its shadows, and the ids of the tensors shadowed.
        self._storages: dict[int, tuple[weakref.ref[Any], set[int]]] = {}
        # The ids of the storages a shadow larger than ``SHADOW_MAX_ELEMENTS`` is kept for: a view
        # of them, or one written in place, is computed too, so that their values stay true.
        self._large: set[int] = set()

    def get(self, t: torch.Tensor) -> Shadow | None:
        """The shadow of ``t``, if it has one."""
        entry = self._shadows.get(id(t))
        if entry is None:
            return None
        key = _storage_id(t)
        if key is None or entry[0] != key or entry[1] != (t.storage_offset(), t.shape, t.dtype):
            # Another tensor's, whose id this one took.
            return None
        return entry[2]

    def after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Gives the small meta tensors ``func`` returned their shadows."""
        large = False
        if isinstance(out, torch.Tensor):
            # Most operations return one tensor, most of them large: checked without a walk.
            if out.device.type != _META:
                return
            if out.numel() > SHADOW_MAX_ELEMENTS:
                if not self._large_kept(func, args, kwargs, out):
                    return
                large = True
            outs = [out]
        else:
            outs = [t for t in tensors_in(out) if _is_meta(t) and _small(t)]
            if not outs:
                return
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name in _SAME_VALUES and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            # The same values under another tensor (autograd detaches every tensor it saves):
            # one shadow for both, as one storage on the CPU would be.
            known = self.get(args[0])
            if known is not None and out.shape == args[0].shape:
                self._set(out, known)
                return
        if name in _FRESH_ZEROS and isinstance(out, torch.Tensor):
            # New memory whose values are zeros (or undefined, read as zeros): made when read.
            self._set(out, Shadow(None, False, False, zeros_of=out))
            return
        computed = None if self._some_input_unknown(args, kwargs) else self._on_cpu(func, args, kwargs)
        if computed is None and large:
            # A large result of values not known keeps no shadow, and those of its storage go.
            self._forget_storage_of(out)
            return
        if computed is None:
            # Some input has no values here (a large tensor, data the step
            # does not have): the result is taken as zero, and marked so.
            for t in outs:
                self._set(t, Shadow(None, True, True, zeros_of=t))
            return
        values, assumed, opaque = computed
        if assumed:
            values = tree_map(_finite, values)
        if name in _NO_MATCH and isinstance(values, torch.Tensor):
            # (A value is itself: ``x != x``, ``x == x``, are how ``isnan`` and ``isfinite`` ask.)
            if opaque and not (len(args) > 1 and args[1] is args[0]):
                match = _NO_MATCH[name] != bool(kwargs.get("invert", False))
                values = torch.full(values.shape, match, dtype=values.dtype)
            # What a comparison gives are flags, not data stood in for.
            opaque = False
        meta_leaves = _leaves(out)
        cpu_leaves = _leaves(values)
        if len(meta_leaves) != len(cpu_leaves):
            return
        for m, c in zip(meta_leaves, cpu_leaves):
            if _is_meta(m) and (large or _small(m)) and isinstance(c, torch.Tensor) and c.shape == m.shape:
                self._set(m, Shadow(c, assumed, opaque))

    def _large_kept(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> bool:
        """Whether a result larger than ``SHADOW_MAX_ELEMENTS`` is shadowed all the same: a mask,
        a factory's table (given its shadow here, made when read), or a view or in-place write of
        a storage that has one; else the storage's shadows go, where its values change unknown."""
        aliased = bool(self._large) and _storage_id(out) in self._large
        if not (aliased or out.dtype is torch.bool or func in _FACTORIES):
            return False
        if out.numel() * out.element_size() > LARGE_SHADOW_MAX_BYTES:
            if aliased:
                self._forget_storage_of(out)
            return False
        if func in _FACTORIES:
            cpu_args, cpu_kwargs = _mapped(_on_host, args), _mapped(_on_host, kwargs)
            self._set(out, Shadow(None, False, False, make=lambda: func(*cpu_args, **cpu_kwargs)))
            return False
        return True

    def _forget_storage_of(self, t: torch.Tensor) -> None:
        """Drops the shadows of every tensor of ``t``'s storage: its values are no longer known."""
        key = _storage_id(t)
        held = self._storages.get(key) if key is not None else None
        if key is None or held is None:
            return
        for tensor in held[1]:
            entry = self._shadows.get(tensor)
            if entry is not None and entry[0] == key:
                del self._shadows[tensor]
        held[1].clear()
        self._large.discard(key)

    def _some_input_unknown(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether an input on meta has no values here, told without pytree's walk (which costs
        more than the rest of recording an operation): a batch norm's small statistics of a
        large input, most small results of a step, are known at once to be unknown."""
        large = bool(self._large)
        return any(
            t.device.type == _META and ((not large and t.numel() > SHADOW_MAX_ELEMENTS) or self.get(t) is None)
            for t in tensors_in(args, kwargs)
        )

    def run_on_cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any | None:
        """An operation whose result's shape depends on values (``nonzero``), run on the
        shadows of its inputs and handed back on meta with shadows; None where an input has
        none, or rests on a value taken as zero."""
        computed = self._on_cpu(func, args, kwargs)
        if computed is None or computed[1]:
            # A shape from values taken as zero (an empty nonzero()) would be a false figure.
            return None
        values, assumed, opaque = computed

        def to_meta(c: Any) -> Any:
            if not isinstance(c, torch.Tensor):
                return c
            m = torch.empty(c.shape, dtype=c.dtype, device=_META)
            if _small(m):
                self._set(m, Shadow(c, assumed, opaque))
            return m

        return tree_map(to_meta, values)

    def masks_as_indices(self, func: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The arguments of an indexing by boolean masks (``x[mask]``, ``x[mask] = v``) with each
        mask made the positions it selects, where its values are known: the result's shape
        depends on the mask's values alone, not the indexed tensor's. None where no mask is
        known (or one rests on a value taken as zero, which would select a false count)."""
        if func not in _INDEXING or len(args) < 2 or not isinstance(args[1], (list, tuple)):
            return None
        indices: list[Any] = []
        changed = False
        for index in args[1]:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) and _is_meta(index):
                known = self.get(index)
                if known is None or known.assumed:
                    return None
                for positions in known.values.bool().nonzero().unbind(1):
                    m = torch.empty(positions.shape, dtype=positions.dtype, device=_META)
                    if _small(m):
                        self._set(m, Shadow(positions, False, known.opaque))
                    indices.append(m)
                changed = True
            else:
                indices.append(index)
        return (args[0], indices, *args[2:]) if changed else None

    def _on_cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool, bool] | None:
        """``func`` run on the inputs' shadows, whether any was assumed and whether any was opaque;
        None where one has no shadow or it fails."""
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            # Random draws would take from the script's own generator; theirs are data the step does not have.
            return None
        assumed = opaque = missing = False

        def to_cpu(a: Any) -> Any:
            nonlocal assumed, opaque, missing
            if _is_meta(a):
                s = self.get(a)
                if s is None:
                    missing = True
                    return a
                assumed = assumed or s.assumed
                opaque = opaque or s.opaque
                return s.values
            return _on_host(a)

        cpu_args, cpu_kwargs = _mapped(to_cpu, args), _mapped(to_cpu, kwargs)
        if missing:
            return None
        try:
            # (Factories of new memory never come here: ``after`` gives them lazy zeros.)
            values = func(*cpu_args, **cpu_kwargs)
        except Exception:  # noqa: BLE001 - any failure here only means the values stay unknown
            # An operation the CPU lacks (a float8 kernel), or one that refuses
            # the zeros standing in for data: its result is simply not known.
            return None
        return values, assumed, opaque

    def know(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """Makes ``values`` (on the CPU) known as those of ``t``, a small meta tensor made without
        an operation the recorder saw (a checkpoint's tensor restored onto the fake GPU)."""
        if _small(t) and values.shape == t.shape:
            self._set(t, Shadow(values.detach().to(t.dtype).clone(), assumed=False, opaque=False))

    def _set(self, t: torch.Tensor, s: Shadow) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            # A wrapper without a storage of its own (a DTensor): no shadow.
            return
        key = id(st)
        self._shadows[id(t)] = (key, (t.storage_offset(), t.shape, t.dtype), s)
        if not _small(t):
            self._large.add(key)
        held = self._storages.get(key)
        if held is not None:
            held[1].add(id(t))
            return
        shadows, storages, large = self._shadows, self._storages, self._large

        def gone(_ref: Any) -> None:
            large.discard(key)
            for tensor in storages.pop(key, (None, set()))[1]:
                entry = shadows.get(tensor)
                if entry is not None and entry[0] == key:
                    del shadows[tensor]

        storages[key] = (weakref.ref(st, gone), {id(t)})
