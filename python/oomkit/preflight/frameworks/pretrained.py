"""A hub model's ``from_pretrained`` under preflight: built from its config, no weight file read.

The question asked before renting a GPU is whether a fine-tune of a hub
model fits, and its weights (15 GB for a 7B model, 140 GB for a 70B) are
the last thing that answer needs: every tensor on the fake GPU is sizes
without data. So transformers' ``from_pretrained`` runs as it is, resolving
the config through ``huggingface_hub`` with the user's cache, token and
offline mode, building the class, its quantized layers and its device map,
and only where it would look for weight files and read them does preflight
stand in: no file is looked for, and each tensor the model expects is given
as zeros of its own shape and dtype, on the host, mapped but never touched
(:func:`host_zeros`), so that transformers' own loading (dtype, quantization,
tied weights, ``device_map``) places and converts them as it would the
checkpoint's. A folder holding only ``config.json`` is enough, and a hub id
downloads nothing but its config.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from oomkit.preflight.notes import Notes
from oomkit.preflight.record.host import host_zeros

#: transformers' module that finds, reads and loads a checkpoint's weight files.
MODELING = "transformers.modeling_utils"

#: PEFT's module whose ``PeftModel.from_pretrained`` / ``load_adapter`` read an adapter's weights.
PEFT_MODEL = "peft.peft_model"

#: The weight files of a PEFT adapter, safetensors first, as PEFT looks for them.
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")

#: The weight files a folder or hub repository can hold, whose header says the weights' dtype.
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")

#: The dtype transformers gives weights when neither the config nor a weight file names one.
DEFAULT_DTYPE = torch.float32

#: The longest safetensors header read for its dtype (safetensors' own limit): a longer one is not a header.
MAX_HEADER_BYTES = 100_000_000


class WeightsFromConfig:
    """Stands in for transformers' weight files: their loading gets zeros of the model's own tensors."""

    def __init__(self, notes: Notes) -> None:
        self.notes = notes
        # The weight file a model being loaded would have had, where it is on this machine (its header only is read).
        self._local_weights: str | None = None

    def stand_ins(self, modeling: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """What to set on ``transformers.modeling_utils`` once imported; nothing where this
        transformers loads weights through functions preflight does not know (they are read)."""
        resolve = getattr(modeling, "_get_resolved_checkpoint_files", None)
        get_dtype = getattr(modeling, "_get_dtype", None)
        base = getattr(modeling, "PreTrainedModel", None)
        load = inspect.getattr_static(base, "_load_pretrained_model", None) if base is not None else None
        if resolve is None or get_dtype is None or not isinstance(load, staticmethod):
            self.notes.add(
                "this transformers loads weights in a way preflight does not know: from_pretrained reads the weight files"
            )
            return []
        notes = self.notes

        def _get_resolved_checkpoint_files(pretrained_model_name_or_path: Any = None, *args: Any, **kwargs: Any) -> Any:
            if pretrained_model_name_or_path is None or kwargs.get("gguf_file"):
                # A state dict given, or a GGUF file: its header is what transformers reads the model from.
                return resolve(pretrained_model_name_or_path, *args, **kwargs)
            self._local_weights = _local_weights(str(pretrained_model_name_or_path), kwargs.get("download_kwargs") or {})
            # No weight file is looked for, so none is downloaded: the loading below stands in for them all.
            return None, None

        def _get_dtype(dtype: Any, checkpoint_files: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
            if dtype == "auto" and checkpoint_files is None and getattr(config, "dtype", None) is None:
                # transformers would read the dtype off the first weight; a local header says it without the data.
                dtype = _first_float_dtype(self._local_weights) if self._local_weights else None
                if dtype is None:
                    dtype = DEFAULT_DTYPE
                    notes.add(
                        "the config names no dtype and no local weight file says one: the weights are taken as "
                        f"{str(DEFAULT_DTYPE).removeprefix('torch.')}, transformers' default"
                    )
            return get_dtype(dtype, checkpoint_files, config, *args, **kwargs)

        def _load_pretrained_model(model: Any, state_dict: Any, checkpoint_files: Any, *args: Any, **kwargs: Any) -> Any:
            if state_dict is None and checkpoint_files is None:
                state_dict = zeros_like_model(model)
                notes.add(
                    f"{type(model).__name__} was built from its config; no weight file was read "
                    f"(its {sized(state_dict)}, stand as zeros of their shapes and dtypes)"
                )
            return load.__func__(model, state_dict, checkpoint_files, *args, **kwargs)

        return [
            (modeling, "_get_resolved_checkpoint_files", _get_resolved_checkpoint_files),
            (modeling, "_get_dtype", _get_dtype),
            (base, "_load_pretrained_model", staticmethod(_load_pretrained_model)),
        ]


class AdapterWithoutWeights:
    """Stands in for a PEFT adapter's weight file where there is none: the adapter is built from
    its ``adapter_config.json`` (as PEFT builds it before loading), its weights left as made."""

    def __init__(self, notes: Notes) -> None:
        self.notes = notes

    def stand_ins(self, peft_model: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """What to set on ``peft.peft_model`` once imported."""
        load = getattr(peft_model, "load_peft_weights", None)
        if load is None:
            return []
        notes = self.notes

        def load_peft_weights(model_id: str, *args: Any, **kwargs: Any) -> Any:
            folder = os.path.join(str(model_id), kwargs.get("subfolder") or "")
            if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, f)) for f in ADAPTER_FILES):
                # A folder with the adapter's config alone: its weights are what PEFT initialised, on the fake GPU.
                notes.add(f"the PEFT adapter {str(model_id)!r} was built from its adapter_config.json alone; it has no weight file to read")
                return {}
            return load(model_id, *args, **kwargs)

        return [(peft_model, "load_peft_weights", load_peft_weights)]


def zeros_like_model(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint for ``model``: each tensor of its state dict as untouched host zeros of its
    shape and dtype, without the tensors tied to another (a checkpoint holds those once, and
    transformers ties them only where the checkpoint lacks them)."""
    # transformers 5 names the tied tensors, as {tied: the one it is tied to}; a tensor held under two names is one too.
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in tied or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = host_zeros(tuple(tensor.shape), tensor.dtype)
    return out


def checkpoint_from_config(folder: str) -> dict[str, torch.Tensor]:
    """The tensors a Hugging Face checkpoint of the model ``folder``'s ``config.json`` describes
    would hold, as untouched host zeros in the config's dtype (:data:`DEFAULT_DTYPE` where it
    names none): a framework's own checkpointer reads them in place of the weight files."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or DEFAULT_DTYPE
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # Built on the script's meta: its shapes are all that is read.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return zeros_like_model(model)


def sized(tensors: dict[str, torch.Tensor]) -> str:
    """How many tensors a checkpoint holds and their bytes: "254 tensors, 5.98 GiB" (MiB below one GiB)."""
    n = sum(t.numel() * t.element_size() for t in tensors.values())
    size = f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
    return f"{len(tensors)} tensors, {size}"


def _local_weights(name: str, download: dict[str, Any]) -> str | None:
    """The first safetensors file of a model that is on this machine already (a folder, or the
    hub's cache), or None; nothing is downloaded."""
    subfolder = download.get("subfolder") or ""
    for filename in SAFETENSORS_FILES:
        if os.path.isdir(name):
            path: Any = os.path.join(name, subfolder, filename)
        else:
            try:
                from huggingface_hub import try_to_load_from_cache

                path = try_to_load_from_cache(
                    name,
                    os.path.join(subfolder, filename) if subfolder else filename,
                    cache_dir=download.get("cache_dir"),
                    revision=download.get("revision"),
                )
            except Exception:  # noqa: BLE001 - a cache that cannot be read holds nothing to read
                path = None
        if not isinstance(path, str) or not os.path.isfile(path):
            continue
        if not filename.endswith(".index.json"):
            return path
        try:
            with open(path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        except (OSError, ValueError, AttributeError):
            return None
        shard = os.path.join(os.path.dirname(path), shards[0]) if shards else ""
        return shard if os.path.isfile(shard) else None
    return None


#: safetensors' dtype names of floating tensors, as PyTorch's dtypes.
_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _first_float_dtype(path: str) -> torch.dtype | None:
    """The dtype of the first floating tensor of a safetensors file, read from its header alone;
    None where the header does not read."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(length))
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _SAFETENSORS_FLOATS:
                return _SAFETENSORS_FLOATS[entry["dtype"]]
    except (OSError, ValueError, AttributeError):
        return None
    return None

