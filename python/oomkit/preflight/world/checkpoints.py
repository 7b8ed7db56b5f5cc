"""A checkpoint loaded onto the GPU under preflight: its tensors on the fake GPU, their data never read.

A sampling, resuming or generating script loads its weights with
``torch.load(path, map_location=device)``; on a GPU that puts each saved
tensor in device memory, and without one it stops ("Found no NVIDIA
driver"). Under preflight, every storage bound for a GPU (by
``map_location``, or saved from one where no ``map_location`` is given)
is made on ``meta`` with the size the file gives: the recorder counts it
as the GPU would, and no byte of it is copied. A checkpoint in PyTorch's
zip format is opened with ``mmap=True`` unless the script says otherwise,
so that what is bound for the GPU is never read from the disk either;
what the script loads onto the CPU is loaded as it asks. The small tensors
bound for the GPU (an optimizer's step counters, which its next step reads)
are given the values the file holds, read from a second pass over the
mapped file onto the CPU, so that a resumed run steps on as it would.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from oomkit.preflight.record.placement import Placement, on_meta
from oomkit.preflight.record.recorder import FAKE_DEVICE
from oomkit.preflight.record.values import SHADOW_MAX_ELEMENTS, Values
from oomkit.preflight.world.cuda import is_cuda


def load_stand_in(placement: Placement, values: Values) -> Callable[..., Any]:
    """``torch.load`` for the fake GPU's ledger: what would go to a GPU goes to the fake GPU (its
    storages claimed as the GPU's in ``placement``: they are made on meta outside any operation),
    the small tensors among it with their values known to ``values``."""
    load = torch.load

    def fake_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        mapped = isinstance(f, (str, os.PathLike)) and _zip_checkpoint(f)
        if "mmap" not in kwargs and mapped:
            # The file's pages mapped and left unread: the storages bound for the GPU become meta ones.
            kwargs["mmap"] = True
        loaded = load(f, _onto_fake_gpu(map_location, placement), *args, **kwargs)
        if not (mapped and kwargs.get("mmap")):
            return loaded
        leaves = tree_leaves(loaded)
        if any(_small_on_fake_gpu(t) for t in leaves):
            # The same file onto the CPU, mapped: only the pages of what is read are read.
            on_cpu = tree_leaves(load(f, "cpu", *args, **kwargs))
            for fake, real in zip(leaves, on_cpu):
                if _small_on_fake_gpu(fake) and isinstance(real, torch.Tensor):
                    values.know(fake, real)
        return loaded

    return fake_load


def _small_on_fake_gpu(t: Any) -> bool:
    """Whether ``t`` is a tensor on the fake GPU small enough to have its values kept."""
    return on_meta(t) and t.numel() <= SHADOW_MAX_ELEMENTS


def _onto_fake_gpu(map_location: Any, placement: Placement) -> Any:
    """``map_location`` with every GPU it names, or leaves to the file, made the fake GPU."""
    if map_location is None:
        return _restore(lambda _storage, location: location, placement)
    if isinstance(map_location, dict):
        named = dict(map_location)
        return _restore(lambda _storage, location: named.get(location, location), placement)
    if callable(map_location):
        return _restore(map_location, placement, own=True)
    if is_cuda(map_location):
        # Restored by a function, so that the GPU's storages are claimed as they are made.
        return _restore(lambda _storage, _location: map_location, placement)
    return map_location


def _restore(where: Callable[[Any, str], Any], placement: Placement, own: bool = False) -> Callable[[Any, str], Any]:
    """A ``map_location`` function: a storage whose place (``where`` says it, from the saved
    one) is a GPU is made on meta at its size; any other is restored as PyTorch restores it.
    ``own``: ``where`` is the script's own function, which may move the storage itself."""
    from torch.serialization import default_restore_location

    def restore(storage: Any, location: str) -> Any:
        try:
            placed = where(storage, location)
        except (RuntimeError, AssertionError):
            # The script's own function moved it to a GPU there is none of ("Found no NVIDIA driver").
            placed = FAKE_DEVICE
        if own and isinstance(placed, (torch.UntypedStorage, torch.TypedStorage)):
            return placed
        target = location if placed is None else placed
        if is_cuda(target) or target == FAKE_DEVICE:
            made = torch.UntypedStorage(storage.nbytes(), device=FAKE_DEVICE)
            placement.claim(made)
            return made
        return default_restore_location(storage, str(target))

    return restore


def _zip_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a checkpoint in PyTorch's zip format (the only one ``mmap`` opens)."""
    try:
        return zipfile.is_zipfile(os.fspath(path))
    except OSError:
        return False
