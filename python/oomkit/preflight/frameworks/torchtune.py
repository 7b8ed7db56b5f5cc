"""torchtune's recipes under preflight: the memory switches their config sets, read as the recipe starts.

A torchtune recipe (``tune run full_finetune_single_device --config ...``)
is configured by a YAML file and ``key=value`` overrides, and saves memory
by switches of its own: activation checkpointing, offloading, compiling,
a chunked loss, the optimizer step fused into backward, an 8-bit
optimizer, a smaller batch with more accumulation. When such a run does
not fit, the changes worth measuring are those switches, each as the
override a user would add. Every recipe logs its final config through
``torchtune.config.log_config`` before it builds anything; preflight reads
the switches there (:class:`RecipeSeen`), and the command reruns the recipe
with each one changed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: The module whose ``log_config`` every recipe calls with its config.
CONFIG = "torchtune.config"

#: The module that finds a checkpoint's files (``get_path``).
CHECKPOINT_UTILS = "torchtune.training.checkpointing._utils"

#: The module whose checkpointers read them (``safe_torch_load``, as it imported it).
CHECKPOINTER = "torchtune.training.checkpointing._checkpointer"

#: The files of a checkpoint that hold weights, by how their names end.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

#: The settings read off a recipe's config, by their dotted names (absent ones are None).
SWITCHES = (
    "enable_activation_checkpointing",
    "enable_activation_offloading",
    "compile",
    "optimizer_in_bwd",
    "dataset.packed",
    "loss._component_",
    "optimizer._component_",
    "batch_size",
    "gradient_accumulation_steps",
)


class RecipeSeen:
    """The recipe the script ran, once it logged its config: ``{"framework", "name", "settings"}``."""

    def __init__(self, on_bound: Any = None) -> None:
        self.recipe: dict[str, Any] | None = None
        #: Told the longest sequence the recipe keeps, and what says it: ``on_bound(n, by)``.
        self.on_bound = on_bound

    def stand_ins(self, config: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``torchtune.config.log_config`` that reads the recipe's switches and the longest
        sequence its tokenizer keeps, then logs as before."""
        log = config.log_config

        def log_config(recipe_name: str, cfg: Any) -> None:
            self.recipe = {"framework": "torchtune", "name": recipe_name, "settings": settings_of(cfg)}
            if self.on_bound is not None:
                from omegaconf import OmegaConf

                self.on_bound(OmegaConf.select(cfg, "tokenizer.max_seq_len", default=None), "the recipe's tokenizer.max_seq_len")
            log(recipe_name=recipe_name, cfg=cfg)

        return [(config, "log_config", log_config)]


class CheckpointFromConfig:
    """A Hugging Face checkpoint folder that holds its ``config.json`` but no weight file, read as
    if it held them: the first missing file gives every tensor of the model its config describes,
    as host zeros of their shapes and dtype (never touched), the others nothing. torchtune's
    checkpointer then converts and loads them as it would the downloaded weights."""

    def __init__(self, notes: Any) -> None:
        self.notes = notes
        # The missing weight files stood in for, and the folders whose tensors were given already.
        self._missing: set[str] = set()
        self._given: set[str] = set()

    def path_stand_ins(self, utils: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``get_path`` that lets a missing weight file of a folder with a config through."""
        get_path = utils.get_path

        def stand_in(input_dir: Any, filename: str, missing_ok: bool = False) -> Any:
            path = os.path.join(str(input_dir), filename)
            if not os.path.exists(path) and filename.endswith(WEIGHT_SUFFIXES) and _has_config(str(input_dir)):
                self._missing.add(os.path.abspath(path))
                return get_path(input_dir, filename, missing_ok=True)
            return get_path(input_dir, filename, missing_ok)

        return [(utils, "get_path", stand_in)]

    def load_stand_ins(self, checkpointer: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``safe_torch_load`` that reads a stood-in file as the model its folder's config describes."""
        load = checkpointer.safe_torch_load

        def safe_torch_load(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            path = os.path.abspath(str(checkpoint_path))
            if path not in self._missing:
                return load(checkpoint_path, *args, **kwargs)
            folder = os.path.dirname(path)
            if folder in self._given:
                return {}
            self._given.add(folder)
            from oomkit.preflight.frameworks.pretrained import checkpoint_from_config, sized

            tensors = checkpoint_from_config(folder)
            self.notes.add(
                f"the checkpoint {folder} has a config.json and no weight file: its {sized(tensors)} "
                "stand as zeros of the shapes and dtype the config gives"
            )
            return tensors

        return [(checkpointer, "safe_torch_load", safe_torch_load)]


def _has_config(folder: str) -> bool:
    """Whether ``folder`` holds a Hugging Face ``config.json`` naming its model type."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("model_type"))
    except (OSError, ValueError, AttributeError):
        return False


def settings_of(cfg: Any) -> dict[str, Any]:
    """The :data:`SWITCHES` of an OmegaConf config as plain values, with the optimizer's own
    arguments by name (``optimizer_args``: another optimizer would be given them too), and
    those of them the config file sets (``optimizer_args_in_file``: a change removes those
    with ``~optimizer.NAME``; one given on the command line is taken off it instead)."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in SWITCHES:
        value = OmegaConf.select(cfg, key, default=None)
        out[key] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
    out["optimizer_args"] = _optimizer_args(cfg)
    out["optimizer_args_in_file"] = _optimizer_args(_config_file(sys.argv))
    return out


def _optimizer_args(cfg: Any) -> list[str]:
    """The names the optimizer's node of ``cfg`` gives its optimizer (none where there is none)."""
    from omegaconf import OmegaConf

    if cfg is None:
        return []
    optimizer = OmegaConf.select(cfg, "optimizer", default=None)
    if not OmegaConf.is_dict(optimizer):
        return []
    return sorted(str(k) for k in optimizer if k != "_component_")


def _config_file(argv: Sequence[str]) -> Any:
    """The config file the recipe was started with (``tune run`` passes its path as
    ``--config``), loaded; None where there is none or it does not load."""
    from omegaconf import OmegaConf

    for i, word in enumerate(argv):
        if word == "--config":
            path = argv[i + 1] if i + 1 < len(argv) else None
        elif word.startswith("--config="):
            path = word.partition("=")[2]
        else:
            continue
        if path and os.path.isfile(path):
            try:
                return OmegaConf.load(path)
            except Exception:  # noqa: BLE001 - a file that does not load says nothing of the recipe's arguments
                return None
    return None
