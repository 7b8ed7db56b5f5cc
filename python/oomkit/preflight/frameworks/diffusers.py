"""A diffusers model's ``from_pretrained`` under preflight: built from its config, no weight file read.

A diffusion fine-tune loads its UNet or transformer, its VAE and its text
encoders with ``from_pretrained``, each from a subfolder of one hub
repository (several GB of weights for Stable Diffusion, tens for the large
transformers). As with transformers' models (:mod:`.pretrained`), the
weights are the one thing the answer does not need: diffusers'
``ModelMixin.from_pretrained`` runs as it is, resolving the config through
``huggingface_hub`` with the user's cache, token and offline mode and
building the model (on ``meta`` first, as diffusers does), and only where it
would find and read the weight files does preflight stand in. No weight
file or shard index is looked for, and the state dict diffusers loads is
each tensor of the model it built, as untouched host zeros of its shape and
dtype; diffusers' own loading then places and converts them (``torch_dtype``,
the modules it keeps in float32, ``device_map``) as it would the checkpoint's.
A folder holding each component's ``config.json`` is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from oomkit.preflight.frameworks.pretrained import sized, zeros_like_model
from oomkit.preflight.notes import Notes

#: diffusers' module whose ``ModelMixin.from_pretrained`` finds, reads and loads a model's weight files.
DIFFUSERS_MODELING = "diffusers.models.modeling_utils"


class Unread(dict[str, Any]):
    """The checkpoint diffusers would have read, before the model it is for is known: empty until
    ``_fix_state_dict_keys_on_load`` (which diffusers calls with the model right after reading it) fills it."""


class DiffusersWeightsFromConfig:
    """Stands in for diffusers' weight files: its loading gets zeros of the model's own tensors."""

    def __init__(self, notes: Notes) -> None:
        self.notes = notes

    def stand_ins(self, modeling: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """What to set on ``diffusers.models.modeling_utils`` once imported; nothing where this
        diffusers loads weights through functions preflight does not know (they are read)."""
        mixin = getattr(modeling, "ModelMixin", None)
        fix_keys = getattr(mixin, "_fix_state_dict_keys_on_load", None)
        names = ("_get_model_file", "_fetch_index_file")
        if fix_keys is None or not all(callable(getattr(modeling, n, None)) for n in names):
            self.notes.add(
                "this diffusers loads weights in a way preflight does not know: from_pretrained reads the weight files"
            )
            return []
        notes = self.notes

        def _get_model_file(*_args: Any, **_kwargs: Any) -> Unread:
            # Asked only for a model's weight file: none is looked for, so none is downloaded.
            return Unread()

        def _fetch_index_file(*_args: Any, **_kwargs: Any) -> None:
            # No shard index either: the model is loaded as from one file, the stand-in above.
            return None

        def _fix_state_dict_keys_on_load(model: Any, state_dict: Any) -> Any:
            if isinstance(state_dict, Unread) and not state_dict:
                state_dict.update(zeros_like_model(model))
                notes.add(
                    f"{type(model).__name__} was built from its config; no weight file was read "
                    f"(its {sized(state_dict)}, stand as zeros of their shapes and dtypes)"
                )
            return fix_keys(model, state_dict)

        entries: list[tuple[Any, str, Any]] = [
            (modeling, "_get_model_file", _get_model_file),
            (modeling, "_fetch_index_file", _fetch_index_file),
            (mixin, "_fix_state_dict_keys_on_load", _fix_state_dict_keys_on_load),
        ]
        if callable(getattr(modeling, "_fetch_index_file_legacy", None)):
            entries.append((modeling, "_fetch_index_file_legacy", _fetch_index_file))
        return entries
