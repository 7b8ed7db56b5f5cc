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

import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: The module whose ``log_config`` every recipe calls with its config.
CONFIG = "torchtune.config"

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

    def __init__(self) -> None:
        self.recipe: dict[str, Any] | None = None

    def stand_ins(self, config: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``torchtune.config.log_config`` that reads the recipe's switches, then logs as before."""
        log = config.log_config

        def log_config(recipe_name: str, cfg: Any) -> None:
            self.recipe = {"framework": "torchtune", "name": recipe_name, "settings": settings_of(cfg)}
            log(recipe_name=recipe_name, cfg=cfg)

        return [(config, "log_config", log_config)]


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
