"""Which tensors without data are the fake GPU's, which the script's own ``meta`` tensors, and
which stand for the host's.

Under preflight all are ``meta`` tensors underneath, but they stand for
different things. A tensor the script puts on the GPU is device memory,
and the script must be told it is on ``cuda:0``, as on a GPU. A tensor
the script makes on ``meta`` itself (a model initialised on meta before
``to_empty``, as FSDP2 and torchtitan do; ``torch.device("meta")``;
``.to("meta")``) holds no memory anywhere, and must say ``meta``. The
weights a module's constructor makes without a device are made on
``meta`` too, so that a model built on the CPU and moved never allocates
them on the host; until it is moved they are the host's: they say
``cpu``, hold no device memory, and what is computed from them alone (a
feature extractor left on the CPU, run on the data) is the host's too.
Moved to the GPU, each becomes a new tensor there, as a copy would.

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
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: The dispatch key every tensor without data has, whatever device the fake GPU tells the script.
_META_KEY = torch._C.DispatchKey.Meta

#: What a call asked for: a place named explicitly (``device="meta"``, ``.to("meta")``).
ASKED_META = "meta"
#: What a call asked for: the GPU (``device="cuda"``, ``.cuda()``, ``.to("cuda")``).
ASKED_GPU = "gpu"
#: What a call asked for: the host, without data (a module's weights made without a device).
ASKED_HOST = "host"


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
    """The storages the script made on ``meta`` itself and those standing for the host's, and what the running call asked for."""

    def __init__(self) -> None:
        # By the storage's id, a weak reference that takes it off when the storage dies.
        self._script_meta: dict[int, weakref.ref[Any]] = {}
        # The same for the storages standing for the host's, and by id the stack (the recorder's
        # id for it) that made each one a module's constructor made: where its copy on the GPU
        # is said to be made, the layer that holds it, as when the model was built there.
        self._host: dict[int, weakref.ref[Any]] = {}
        self._born_at: dict[int, int] = {}
        #: While a tensor of the host's is moved to the GPU: the stack its copy is said to be made at.
        self.moving_from: int | None = None
        # Storages preflight made on meta for the GPU itself, outside any operation.
        self._claimed: dict[int, weakref.ref[Any]] = {}
        #: Whether the script is told its GPU tensors are on ``cuda:0`` (not while torch.compile's tracer reads them).
        self.telling = True
        #: How many compiled graphs are running: what torch.compile's machinery makes on ``meta`` is the GPU's.
        self.compiled = 0
        #: What the function call running asked for (``ASKED_META``, ``ASKED_GPU``), or None: decided by its inputs.
        self.asked: str | None = None

    def on_gpu(self, t: Any) -> bool:
        """Whether ``t`` is on the fake GPU: a tensor without data that the script did not make on ``meta``, nor the host's."""
        if not on_meta(t):
            return False
        if not self._script_meta and not self._host:
            return True
        return self._kind(t) is None

    def script_meta(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a tensor without data) is one the script made on ``meta`` itself."""
        return bool(self._script_meta) and on_meta(t) and self._kind(t) == ASKED_META

    def on_host(self, t: Any) -> bool:
        """Whether ``t`` is a tensor without data standing for the host's (a module's weights made without a device)."""
        return bool(self._host) and on_meta(t) and self._kind(t) == ASKED_HOST

    def born_at(self, t: torch.Tensor) -> int | None:
        """The stack that made ``t``'s storage in a module's constructor, for the host, if it was made so."""
        return self._born_at.get(id(t.untyped_storage())) if self._born_at else None

    def _kind(self, t: torch.Tensor) -> str | None:
        """``ASKED_META`` or ``ASKED_HOST`` for a tensor without data of the script's meta or the host's; None for the GPU's."""
        if is_traceable_wrapper_subclass(t):
            kinds = {self._kind(inner) for inner in plain_tensors(t)}
            return None if None in kinds or not kinds else kinds.pop() if len(kinds) == 1 else ASKED_META
        key = id(t.untyped_storage())
        return ASKED_META if key in self._script_meta else ASKED_HOST if key in self._host else None

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
        """Whether new storages may be other than the GPU's now (a call asked for a place, or the script holds meta or host tensors)."""
        return self.asked is not None or bool(self._script_meta) or bool(self._host)

    def made_where(self, inputs: Iterable[torch.Tensor]) -> str | None:
        """Where what an operation makes now is, if not on the GPU: ``ASKED_META`` or ``ASKED_HOST``
        where the call asked for it, or asked for no place and every tensor without data among
        its ``inputs`` is the script's meta or the host's (both: the script's meta); else None."""
        if self.asked is not None:
            return None if self.asked == ASKED_GPU else self.asked
        if not self._script_meta and not self._host:
            return None
        found: str | None = None
        for t in inputs:
            if on_meta(t):
                kind = self._kind(t)
                if kind is None:
                    return None
                found = kind if found in (None, kind) else ASKED_META
        return found

    def holds_script_meta(self, st: Any) -> bool:
        """Whether storage ``st`` is one the script made on ``meta`` itself."""
        return bool(self._script_meta) and id(st) in self._script_meta

    def holds(self, st: Any) -> bool:
        """Whether storage ``st`` is the script's meta or the host's: no device memory."""
        return self.holds_script_meta(st) or (bool(self._host) and id(st) in self._host)

    def mark(self, st: Any, kind: str = ASKED_META, born_at: int | None = None) -> None:
        """Notes storage ``st`` as the script's meta or (``ASKED_HOST``) the host's, for as long as it
        lives; ``born_at``: the stack a module's constructor made it at."""
        if kind == ASKED_HOST:
            _note(self._host, st, self._born_at)
            if born_at is not None:
                self._born_at[id(st)] = born_at
        else:
            _note(self._script_meta, st)

    def claim(self, st: Any) -> None:
        """Notes storage ``st``, made on meta by preflight itself (a checkpoint's storage bound for the GPU), as the GPU's."""
        _note(self._claimed, st)

    def set_storage(self, t: torch.Tensor, st: Any) -> None:
        """``t.set_(st)`` is about to run: a storage made on meta outside any operation (a lazy
        loader's, ``torch.load``'s) takes the place of the tensor it is set into, unless it is the GPU's."""
        if (self._script_meta or self._host) and id(st) not in self._claimed and on_meta(t):
            kind = self._kind(t)
            if kind is not None:
                self.mark(st, kind, self.born_at(t))


def _note(table: dict[int, weakref.ref[Any]], st: Any, beside: dict[int, Any] | None = None) -> None:
    """Puts storage ``st`` in ``table`` by its id, for as long as it lives (and takes it off ``beside`` then too)."""
    key = id(st)
    if key in table:
        return

    def gone(_ref: Any) -> None:
        table.pop(key, None)
        if beside is not None:
            beside.pop(key, None)

    table[key] = weakref.ref(st, gone)
