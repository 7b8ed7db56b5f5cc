"""A checkpoint the script loads that is not on disk: what it is loaded into keeps the tensors it has.

A script that fine-tunes, resumes or samples loads weights by path
(``torch.load``, safetensors' ``load_file`` and ``safe_open``) or by URL
(``torch.hub.load_state_dict_from_url``, which torchvision's ``weights=``
goes through). Asked before the file is downloaded or written, it would
stop at the missing file, though loading weights into a model changes no
size on the GPU: they take the places of tensors the model already has.
Under preflight a file that is not there loads as :class:`AbsentStateDict`,
an empty state dict standing for it. A module or optimizer it is loaded
into keeps what it has (so the model's own tensors stand for the file's
sizes), a key read from it is another stand-in (``ckpt["model"]``), and an
empty dict made from one (keys renamed in a comprehension) loads as one
too. Where the file would have been loaded onto the GPU (``map_location``,
safetensors' ``device``), the stand-in is filled, when a module is loaded
from it, with a copy of each of the module's tensors there, and holds them
as long as the script holds it, as the loaded file would.

Nothing that holds weights is downloaded: a URL that is not in torch's hub
cache is not fetched (nor announced as being fetched, nor given a folder
there: ``load_state_dict_from_url`` stands in for it at once, wherever
torchvision or timm hold it under their own name), and a weight file asked of the Hugging Face hub
(``hf_hub_download``, as timm's ``pretrained=True`` does) is read from the
hub's cache where it is there, and otherwise given a path that is not
there, which loads as a stand-in. A note names the folder, the URL or the
repository's file, so the answer says what its figures stand on.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from oomkit.preflight.notes import Notes
from oomkit.preflight.world.cuda import is_cuda

#: huggingface_hub's modules that hand out ``hf_hub_download``: the package (how timm and most
#: scripts import it) and the module that defines it.
HUB = ("huggingface_hub", "huggingface_hub.file_download")

#: The endings of weight files, which are looked for in the hub's cache but never downloaded.
WEIGHT_FILES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".gguf", ".msgpack", ".h5")

#: safetensors' modules: the package (``safe_open``) and its PyTorch side (``load_file``, ``safe_open`` as it imported it).
SAFETENSORS = ("safetensors", "safetensors.torch")

#: The URLs a hub would fetch over the network, and not here.
REMOTE = ("http://", "https://")

#: The modules that hold ``torch.hub.load_state_dict_from_url`` under their own name, bound when they
#: were imported: torchvision's weights' ``get_state_dict`` and timm's loading of weights by URL.
URL_LOADERS = ("torchvision.models._api", "timm.models._builder")


#: Said where a checkpoint that is not there would have been loaded onto the GPU: only what a
#: module is loaded from is known, not what else the file holds there.
GPU_BOUND_NOTE = (
    "a checkpoint that is not there was loaded onto the GPU: a copy of each tensor of the module loaded from it is "
    "counted while the script holds it; what else the file would put there (an optimizer's state the script "
    "does not restore) is not known, and not counted"
)


def _keeps(them: str, theirs: str) -> str:
    """What a note says of a stood-in checkpoint, after naming it."""
    return f"what is loaded from {them} keeps the tensors the model was built with, whose sizes stand for {theirs}"


class AbsentStateDict(dict[Any, Any]):
    """A state dict standing for a checkpoint that is not there: empty, and any key read from it is
    another, kept in it as a loaded file keeps what it holds."""

    def __init__(self, source: str, gpu: Any = None, uploaded: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        #: The file or URL it stands for.
        self.source = source
        #: The GPU its tensors would have been loaded onto, or None.
        self.gpu = gpu
        # Told of each tensor held on the GPU: a copy from the host, as the file's would have been.
        self._uploaded = uploaded

    def __missing__(self, key: Any) -> AbsentStateDict:
        part = AbsentStateDict(self.source, self.gpu, self._uploaded)
        self[key] = part
        return part

    def fill_from(self, module: torch.nn.Module) -> None:
        """Holds a copy of each of ``module``'s tensors on the GPU it would have been loaded onto."""
        if self.gpu is None or self:
            return
        with torch.no_grad():
            for name, tensor in module.state_dict().items():
                self[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.gpu)
                if self._uploaded is not None:
                    self._uploaded(self[name])

    def __repr__(self) -> str:
        return f"AbsentStateDict({self.source!r})"


class _AbsentSafeOpen:
    """``safe_open`` of a file that is not there: a file with no tensors."""

    def __enter__(self) -> _AbsentSafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return []

    def offset_keys(self) -> list[str]:
        return []

    def metadata(self) -> dict[str, str]:
        return {}

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def __iter__(self) -> Iterator[str]:
        return iter(())


class AbsentCheckpoints:
    """The stand-ins of one preflight run for checkpoints that are not there, and what they note."""

    def __init__(self, notes: Notes, uploaded: Callable[[torch.Tensor], None] | None = None) -> None:
        self.notes = notes
        # Told of each tensor a checkpoint bound for the GPU holds there (an input: a copy from the host).
        self._uploaded = uploaded
        #: Whether a checkpoint was stood in for in this run.
        self.seen = False
        # Where a hub would have written what it did not download: noted by URL or file, not by folder.
        self._not_downloaded: set[str] = set()
        #: Whether the preflight is running. A library imported during it keeps the stand-ins under
        #: the names it imported (transformers' ``hf_hub_download``), so after it each one does what
        #: it stands in for again: a download after an in-process preflight downloads.
        self.active = True

    def close(self) -> None:
        """Ends the stand-ins: each does what it stands in for from now on."""
        self.active = False

    def _absent(self, path: Any) -> bool:
        """Whether ``path`` names a file (not an open one) that is not there, while the preflight runs."""
        return self.active and isinstance(path, (str, os.PathLike)) and not os.path.exists(os.fspath(path))

    def _not_fetched(self, what: str, path: str) -> None:
        """Notes the file ``what`` (a URL, a hub repository's file) as not downloaded to ``path``, whose
        stand-in then says no more of its folder."""
        self._not_downloaded.add(path)
        self.notes.add(f"{what} was not downloaded; {_keeps('it', 'its own')}")

    def stand_in(self, path: Any, device: Any = None) -> AbsentStateDict:
        """The stand-in of the file ``path`` loaded onto ``device``, noted once per folder."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        first = os.path.basename(path)
        if path not in self._not_downloaded:
            said = f"checkpoint files the script loads from {folder} are not there (the first: {first})"
            self.notes.add(f"{said}; {_keeps('them', 'theirs')}")
        self.seen = True
        if is_cuda(device):
            self.notes.add(GPU_BOUND_NOTE)
        return AbsentStateDict(path, device if is_cuda(device) else None, self._uploaded)

    def _loaded_from_absent(self, state_dict: Any) -> bool:
        """Whether ``state_dict`` stands for a checkpoint that is not there, or is an empty one made from one."""
        if isinstance(state_dict, AbsentStateDict):
            return True
        return self.seen and isinstance(state_dict, dict) and not state_dict

    def torch_load(self, load: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.load`` that stands in for a file that is not there, and is ``load`` otherwise."""

        def absent_or_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self._absent(f):
                return self.stand_in(f, map_location)
            return load(f, map_location, *args, **kwargs)

        return absent_or_load

    def torch_stand_ins(self) -> list[tuple[Any, str, Any]]:
        """What loads into modules and optimizers leaves as it is when the load stands for a missing
        checkpoint, and torch's hub that downloads no checkpoint."""
        import torch.hub
        from torch.nn.modules.module import _IncompatibleKeys

        module_load = torch.nn.Module.load_state_dict
        optimizer_load = torch.optim.Optimizer.load_state_dict
        download = torch.hub.download_url_to_file

        def load_into_module(module: torch.nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            if self._loaded_from_absent(state_dict):
                if isinstance(state_dict, AbsentStateDict):
                    state_dict.fill_from(module)
                return _IncompatibleKeys([], [])
            return module_load(module, state_dict, *args, **kwargs)

        def load_into_optimizer(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
            if not self._loaded_from_absent(state_dict):
                optimizer_load(optimizer, state_dict)

        def not_downloaded(url: str, dst: str, *args: Any, **kwargs: Any) -> None:
            if not self.active or not str(url).startswith(REMOTE):
                download(url, dst, *args, **kwargs)
                return
            # torch.hub then loads the file it would have written, which is not there: a stand-in.
            self._not_fetched(str(url), os.fspath(dst))

        return [
            (torch.nn.Module, "load_state_dict", load_into_module),
            (torch.optim.Optimizer, "load_state_dict", load_into_optimizer),
            (torch.hub, "download_url_to_file", not_downloaded),
        ]

    def url_stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``load_state_dict_from_url``, as ``module`` holds it, that loads a URL not in torch's hub
        cache as a stand-in, and does not say it is downloading it (torch.hub says so first)."""
        import torch.hub

        load_url = getattr(module, "load_state_dict_from_url", None)
        if load_url is None:
            return []

        def from_url_or_absent(url: str, model_dir: Any = None, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            name = kwargs.get("file_name") or os.path.basename(urllib.parse.urlparse(str(url)).path)
            cached = os.path.join(os.fspath(model_dir or os.path.join(torch.hub.get_dir(), "checkpoints")), name)
            if not self.active or not str(url).startswith(REMOTE) or os.path.exists(cached):
                return load_url(url, model_dir, map_location, *args, **kwargs)
            self._not_fetched(str(url), cached)
            return self.stand_in(cached, map_location)

        return [(module, "load_state_dict_from_url", from_url_or_absent)]

    def safetensors_stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """safetensors' ``safe_open`` (of the package, or of ``safetensors.torch``) and ``load_file``
        that stand in for a file that is not there."""
        found: list[tuple[Any, str, Any]] = []
        safe_open = getattr(module, "safe_open", None)
        if safe_open is not None:

            def safe_open_or_absent(filename: Any, *args: Any, **kwargs: Any) -> Any:
                if self._absent(filename):
                    self.stand_in(filename)
                    return _AbsentSafeOpen()
                return safe_open(filename, *args, **kwargs)

            found.append((module, "safe_open", safe_open_or_absent))
        load_file = getattr(module, "load_file", None)
        if load_file is not None:

            def load_file_or_absent(filename: Any, device: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
                if self._absent(filename):
                    return self.stand_in(filename, device)
                return load_file(filename, device, *args, **kwargs)

            found.append((module, "load_file", load_file_or_absent))
        return found

    def hub_stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``hf_hub_download`` that downloads no weight file: one in the cache is its path there,
        one that is not is a path that is not there, which loads as a stand-in."""
        download = getattr(module, "hf_hub_download", None)
        if download is None:
            return []
        from huggingface_hub.errors import LocalEntryNotFoundError

        def hf_hub_download(repo_id: str, filename: str, *args: Any, **kwargs: Any) -> Any:
            if not self.active or not str(filename).endswith(WEIGHT_FILES) or kwargs.get("dry_run"):
                return download(repo_id, filename, *args, **kwargs)
            try:
                return download(repo_id, filename, *args, **{**kwargs, "local_files_only": True})
            except LocalEntryNotFoundError:
                pass
            name = "/".join(p for p in (kwargs.get("subfolder"), str(filename)) if p)
            where = kwargs.get("local_dir") or os.path.join(
                os.fspath(kwargs.get("cache_dir") or _hub_cache()), "models--" + repo_id.replace("/", "--"), "not-downloaded"
            )
            path = os.path.join(os.fspath(where), name)
            self._not_fetched(f"{repo_id}/{name}", path)
            return path

        return [(module, "hf_hub_download", hf_hub_download)]


def _hub_cache() -> str:
    """The hub's cache folder, as huggingface_hub reads it from the environment."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
