"""Checkpoints the script saves under preflight: kept in preflight's own folder, never written where it says.

A script saves as it trains (``torch.save`` of its model and optimizer
each epoch, a Trainer's checkpoint folder, ``save_pretrained``). Under
preflight its tensors have no data, so what it would write is not its
model: written where it says, it would replace the user's own checkpoint
(the one a resuming script loads) with one of empty tensors. So nothing is
written there: ``torch.save`` to a path, and safetensors' ``save_file`` and
``save_model`` (which cannot save a tensor without data at all), write
what they are given into this run's own folder with ``torch.save``
(tensors without data take a few bytes), and a later load of that path
(``torch.load``, safetensors' ``load_file``, ``safe_open``) reads it back
from there onto the device asked for, as a resuming or evaluating script
expects.

A file the script opens and writes itself (``torch.save`` into an open
file) is the script's own doing and is not redirected.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from oomkit.preflight.notes import Notes

#: The folder, inside this run's own, that the script's saves are kept in.
SAVED_FOLDER = "saved"


def saved_note(first: str) -> str:
    """What an answer says of the checkpoints the script saved."""
    return (
        f"checkpoints the script saves were not written where it says (the first: {first}), as they hold tensors "
        "without data; a load of one reads what preflight kept of it for the run instead"
    )


class _KeptSafeOpen:
    """``safe_open`` of a file the script saved with safetensors: the tensors kept of it."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        self._tensors = tensors
        self._metadata = metadata or {}

    def __enter__(self) -> _KeptSafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        """The names of the tensors saved, in the order saved."""
        return list(self._tensors)

    def offset_keys(self) -> list[str]:
        """The same names (safetensors orders them by their place in the file)."""
        return list(self._tensors)

    def metadata(self) -> dict[str, str]:
        """The metadata the script saved with them."""
        return dict(self._metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor saved as ``name``."""
        return self._tensors[name]

    def get_slice(self, name: str) -> torch.Tensor:
        """The tensor saved as ``name``, to be sliced."""
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)


class SavedAside:
    """The stand-ins of one preflight run for saving checkpoints, and where what was saved is kept."""

    def __init__(self, notes: Notes, run_dir: str | None = None) -> None:
        self.notes = notes
        # This run's own folder (removed after the run), or None: a temporary one, made when first needed.
        self._run_dir = run_dir
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        #: Each path the script saved to (absolute), and the file kept in its place.
        self.kept: dict[str, str] = {}
        # The paths of those saved with safetensors, with the metadata saved with them.
        self._safetensors: dict[str, dict[str, str] | None] = {}
        # torch.save and torch.load as the ledger has them, for the files kept.
        self._save: Callable[..., Any] = torch.serialization.save
        self._load: Callable[..., Any] = torch.serialization.load
        #: Whether the preflight is running. A library imported during it keeps the stand-ins under
        #: the names it imported (transformers' ``safe_save_file``), so after it each one is the
        #: function it stands in for again: a save after an in-process preflight is written.
        self.active = True

    def close(self) -> None:
        """Ends the stand-ins, and removes a temporary folder of saves (a run's own folder is removed with the run)."""
        self.active = False
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None

    def _keep(self, obj: Any, path: Any, *args: Any, **kwargs: Any) -> str:
        """Saves ``obj`` with ``torch.save`` where the script's ``path`` is kept, noting the first; its absolute path."""
        key = os.path.abspath(os.fspath(path))
        if not self.kept:
            self.notes.add(saved_note(os.fspath(path)))
        target = self.kept.get(key)
        if target is None:
            # Named as torch.save writes it: torch.load reads a name ending in .safetensors as that format.
            target = os.path.join(self._folder(), f"{len(self.kept)}-{os.path.basename(key)}.pt")
        self._save(obj, target, *args, **kwargs)
        self.kept[key] = target
        self._safetensors.pop(key, None)
        return key

    def _folder(self) -> str:
        """The folder the saves are kept in, made at the first."""
        if self._run_dir is None and self._temporary is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="oomkit-preflight-saved-")
        base = self._run_dir if self._run_dir is not None else self._temporary.name  # type: ignore[union-attr]
        folder = os.path.join(base, SAVED_FOLDER)
        os.makedirs(folder, exist_ok=True)
        return folder

    def _kept(self, path: Any) -> str | None:
        """The file kept for ``path``, if the script saved to it."""
        if not isinstance(path, (str, os.PathLike)) or not self.kept:
            return None
        return self.kept.get(os.path.abspath(os.fspath(path)))

    def torch_save(self, save: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.save`` that keeps a save to a path in this run's folder in its place."""
        self._save = save

        def save_aside(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not self.active or not isinstance(f, (str, os.PathLike)):
                save(obj, f, *args, **kwargs)
                return
            self._keep(obj, f, *args, **kwargs)

        return save_aside

    def torch_load(self, load: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.load`` (``load``: the ledger's) that reads a path the script saved to from where it was kept."""

        def load_kept(f: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return torch.serialization.load(f, *args, **kwargs)
            return load(self._kept(f) or f, *args, **kwargs)

        self._load = load_kept
        return load_kept

    def safetensors_stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """safetensors' savers (of ``safetensors.torch``) that keep what they are given, and its
        loaders (of the package or ``safetensors.torch``) that read what was kept."""
        found: list[tuple[Any, str, Any]] = []
        save_file_as_is = getattr(module, "save_file", None)
        if save_file_as_is is not None:

            def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None) -> None:
                if not self.active:
                    return save_file_as_is(tensors, filename, metadata)
                key = self._keep(dict(tensors), filename)
                self._safetensors[key] = metadata
                return None

            found.append((module, "save_file", save_file))
        save_model_as_is = getattr(module, "save_model", None)
        if save_model_as_is is not None:

            def save_model(model: torch.nn.Module, filename: Any, metadata: dict[str, str] | None = None, *args: Any, **kwargs: Any) -> Any:
                if not self.active:
                    return save_model_as_is(model, filename, metadata, *args, **kwargs)
                key = self._keep(dict(model.state_dict()), filename)
                self._safetensors[key] = metadata
                return None

            found.append((module, "save_model", save_model))
        load_file = getattr(module, "load_file", None)
        if load_file is not None:

            def load_file_kept(filename: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
                kept = self._kept(filename) if self.active else None
                if kept is None:
                    return load_file(filename, device, *args, **kwargs)
                return self._load(kept, map_location=_location(device))

            found.append((module, "load_file", load_file_kept))
        safe_open = getattr(module, "safe_open", None)
        if safe_open is not None:

            def safe_open_kept(filename: Any, framework: Any = "pt", device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
                kept = self._kept(filename) if self.active else None
                if kept is None:
                    return safe_open(filename, framework, device, *args, **kwargs)
                key = os.path.abspath(os.fspath(filename))
                return _KeptSafeOpen(self._load(kept, map_location=_location(device)), self._safetensors.get(key))

            found.append((module, "safe_open", safe_open_kept))
        return found


def _location(device: Any) -> Any:
    """safetensors' ``device`` as ``torch.load``'s ``map_location`` (an index is a CUDA device)."""
    return f"cuda:{device}" if isinstance(device, int) else device
