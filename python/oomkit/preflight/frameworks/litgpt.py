"""LitGPT's recipes from a checkpoint folder without its weights: the config and tokenizer alone.

``litgpt finetune_* CHECKPOINT_DIR`` checks that the folder holds
``lit_model.pth`` beside ``model_config.yaml`` and the tokenizer, builds
the model the config describes on the GPU (through Fabric), and then reads
the weights into it. Under preflight the weights were never going to be
read (every tensor on the fake GPU is sizes without data), so a folder
whose ``model_config.yaml`` is there but whose weight file is not is let
through, and loading that file leaves the model as it was built: the same
tensors, of the same shapes and dtypes, in the same place.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: LitGPT's module of helpers its recipes import ``check_valid_checkpoint_dir`` and ``load_checkpoint`` from.
UTILS = "litgpt.utils"

#: The config every LitGPT checkpoint folder holds, which builds its model.
MODEL_CONFIG = "model_config.yaml"


class CheckpointWithoutWeights:
    """Lets a LitGPT checkpoint folder without its weight file through, and its loading leave the model as built."""

    def __init__(self, notes: Any) -> None:
        self.notes = notes
        # The weight files let through, which loading then skips.
        self._missing: set[Path] = set()

    def stand_ins(self, utils: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """What to set on ``litgpt.utils`` once imported (before the recipes import its names)."""
        check = getattr(utils, "check_valid_checkpoint_dir", None)
        load = getattr(utils, "load_checkpoint", None)
        if check is None or load is None:
            return []

        def check_valid_checkpoint_dir(checkpoint_dir: Path, model_filename: str = "lit_model.pth", *args: Any, **kwargs: Any) -> Any:
            folder = Path(checkpoint_dir)
            weights = folder / model_filename
            if not weights.is_file() and (folder / MODEL_CONFIG).is_file():
                self._missing.add(weights.resolve())
                # The rest is checked as LitGPT checks it (the config twice, in the weights' place).
                return check(checkpoint_dir, MODEL_CONFIG, *args, **kwargs)
            return check(checkpoint_dir, model_filename, *args, **kwargs)

        def load_checkpoint(fabric: Any, model: Any, checkpoint_path: Path, *args: Any, **kwargs: Any) -> Any:
            if Path(checkpoint_path).resolve() in self._missing:
                self.notes.add(
                    f"LitGPT's checkpoint {checkpoint_path} is not there (the folder has its {MODEL_CONFIG}): "
                    "the model keeps the weights it was built with, of the shapes and dtype it would have loaded"
                )
                return None
            return load(fabric, model, checkpoint_path, *args, **kwargs)

        return [(utils, "check_valid_checkpoint_dir", check_valid_checkpoint_dir), (utils, "load_checkpoint", load_checkpoint)]
