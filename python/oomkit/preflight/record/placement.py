"""Which tensors without data are the fake GPU's, and which are the script's own ``meta`` tensors.

Under preflight both are ``meta`` tensors underneath, but they stand for
different things. A tensor the script puts on the GPU is device memory,
and the script must be told it is on ``cuda:0``, as on a GPU. A tensor
the script makes on ``meta`` itself (a model initialised on meta before
``to_empty``, as FSDP2 and torchtitan do; ``torch.device("meta")``;
``.to("meta")``) holds no memory anywhere, and must say ``meta``.

What the script asked for is seen by the function mode, which maps
``cuda`` to ``meta``; it says so here (``asked``) around the call, and the
recorder gives each new storage its place: the script's meta where the
call asked for meta, or where every tensor without data it was made from
is the script's meta (a meta model's copy, its views); the fake GPU's
otherwise. Storages are known by the id of their Python object, which
PyTorch keeps alive exactly as long as the storage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: The dispatch key every tensor without data has, whatever device the fake GPU tells the script.
_META_KEY = torch._C.DispatchKey.Meta

#: What a call asked for: a place named explicitly (``device="meta"``, ``.to("meta")``).
ASKED_META = "meta"
#: What a call asked for: the GPU (``device="cuda"``, ``.cuda()``, ``.to("cuda")``).
ASKED_GPU = "gpu"


def on_meta(t: Any) -> bool:
    """Whether ``t`` is a tensor without data underneath (read past the function mode, which answers ``cuda`` for the GPU's)."""
    return isinstance(t, torch.Tensor) and torch._C._dispatch_keys(t).has(_META_KEY)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding memory under ``t``: itself, or what a wrapper subclass (DTensor) wraps."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ctx = t.__tensor_flatten__()
    inner = [getattr(t, a) for a in attrs]
    return [p for x in inner if isinstance(x, torch.Tensor) for p in plain_tensors(x)]


class Placement:
    """The storages the script made on ``meta`` itself, and what the running call asked for."""

    def __init__(self) -> None:
        # By the storage's id, a weak reference that takes it off when the storage dies.
        self._script_meta: dict[int, weakref.ref[Any]] = {}
        # Storages preflight made on meta for the GPU itself, outside any operation.
        self._claimed: dict[int, weakref.ref[Any]] = {}
        #: Whether the script is told its GPU tensors are on ``cuda:0`` (not while torch.compile's tracer reads them).
        self.telling = True
        #: How many compiled graphs are running: what torch.compile's machinery makes on ``meta`` is the GPU's.
        self.compiled = 0
        #: What the function call running asked for (``ASKED_META``, ``ASKED_GPU``), or None: decided by its inputs.
        self.asked: str | None = None

    def on_gpu(self, t: Any) -> bool:
        """Whether ``t`` is on the fake GPU: a tensor without data that the script did not make on ``meta``."""
        if not on_meta(t):
            return False
        if not self._script_meta:
            return True
        if is_traceable_wrapper_subclass(t):
            return any(self.on_gpu(inner) for inner in plain_tensors(cast(torch.Tensor, t)))
        return id(t.untyped_storage()) not in self._script_meta

    def script_meta(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a tensor without data) is one the script made on ``meta`` itself."""
        return bool(self._script_meta) and on_meta(t) and not self.on_gpu(t)

    @contextlib.contextmanager
    def running_compiled(self) -> Iterator[None]:
        """The block in which a compiled graph runs: its buffers, made on ``meta`` by name (the
        device its trace read), are the GPU's."""
        self.compiled += 1
        try:
            yield
        finally:
            self.compiled -= 1

    @property
    def deciding(self) -> bool:
        """Whether new storages may be the script's meta now (a call asked for a place, or the script holds meta tensors)."""
        return self.asked is not None or bool(self._script_meta)

    def made_as_meta(self, inputs: Iterable[torch.Tensor]) -> bool:
        """Whether what an operation makes now is the script's meta: the call asked for it, or
        asked for no place and every tensor without data among its ``inputs`` is the script's meta."""
        if self.asked is not None:
            return self.asked == ASKED_META
        if not self._script_meta:
            return False
        found = False
        for t in inputs:
            if on_meta(t):
                if self.on_gpu(t):
                    return False
                found = True
        return found

    def holds(self, st: Any) -> bool:
        """Whether storage ``st`` is the script's meta."""
        return bool(self._script_meta) and id(st) in self._script_meta

    def mark(self, st: Any) -> None:
        """Notes storage ``st`` as the script's meta, for as long as it lives."""
        _note(self._script_meta, st)

    def claim(self, st: Any) -> None:
        """Notes storage ``st``, made on meta by preflight itself (a checkpoint's storage bound for the GPU), as the GPU's."""
        _note(self._claimed, st)

    def set_storage(self, t: torch.Tensor, st: Any) -> None:
        """``t.set_(st)`` is about to run: a storage made on meta outside any operation (a lazy
        loader's, ``torch.load``'s) takes the place of the tensor it is set into, unless it is the GPU's."""
        if self._script_meta and id(st) not in self._claimed and self.script_meta(t):
            self.mark(st)


def _note(table: dict[int, weakref.ref[Any]], st: Any) -> None:
    """Puts storage ``st`` in ``table`` by its id, for as long as it lives."""
    key = id(st)
    if key in table:
        return

    def gone(_ref: Any) -> None:
        table.pop(key, None)

    table[key] = weakref.ref(st, gone)
