"""The changes preflight can make to a script without editing it, each run on the script itself.

``oomkit preflight`` asks "what would make it fit?" by running the user's
own script again with one change at a time (and then all of them), on
tensors without data, so that each answer is a measurement of their code:

- ``checkpoint``: activation checkpointing of the model's repeated blocks
  (:func:`repeated_blocks`), with PyTorch's
  ``torch.utils.checkpoint`` (non-reentrant), as one would add it by hand;
- ``autocast``: every top-level forward run under ``torch.autocast("cuda",
  torch.bfloat16)``, for a script that runs in float32;
- ``adamw8bit``: bitsandbytes' 8-bit ``AdamW8bit`` (``Adam8bit``) made
  wherever the script makes ``torch.optim.AdamW`` (``Adam``).

The allocator's ``expandable_segments`` and a smaller micro-batch with more
accumulation need no change inside the script: the command reruns it with
other settings or another ``{batch}``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit._preflight_cuda import Autocast

#: The changes made inside the script, by name.
INSIDE = ("checkpoint", "autocast", "adamw8bit")


def optimizer_stand_ins(fixes: list[str]) -> list[tuple[Any, str, Any]]:
    """The optimizers replaced for ``adamw8bit``, as (owner, name, value) for the fake GPU's ledger."""
    if "adamw8bit" not in fixes:
        return []
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise PreflightError("8-bit AdamW is bitsandbytes': install bitsandbytes where preflight runs") from None
    return [(torch.optim, "AdamW", _eight_bit(bnb.optim.AdamW8bit)), (torch.optim, "Adam", _eight_bit(bnb.optim.Adam8bit))]


def _eight_bit(cls: Any) -> Any:
    """``cls`` taking the arguments ``torch.optim``'s class takes (those it has no use for, as ``fused``, dropped)."""
    accepted = set(inspect.signature(cls).parameters)

    class InPlace(cls):
        def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(params, *args, **{k: v for k, v in kwargs.items() if k in accepted})

    InPlace.__name__ = InPlace.__qualname__ = cls.__name__
    return InPlace


class Fixer:
    """The changes made at the model's forwards: checkpointing its blocks, and autocast around each."""

    def __init__(self, fixes: list[str], autocast: Autocast) -> None:
        self.fixes = fixes
        self.autocast = autocast
        self._wrapped: set[int] = set()
        self._in_autocast = False
        self._autocast_applied = False

    def top_forward_begins(self, module: torch.nn.Module) -> None:
        """A forward of a module called outside any other's begins."""
        if "checkpoint" in self.fixes and id(module) not in self._wrapped:
            self._wrapped.add(id(module))
            for block in repeated_blocks(module):
                if id(block) not in self._wrapped:
                    self._wrapped.add(id(block))
                    block.forward = functools.partial(_checkpointed, block.forward)
        if "autocast" in self.fixes and not self._in_autocast:
            if self.autocast.dtype() is None:
                self.autocast.enter(True, torch.bfloat16)
                self._in_autocast = True
                self._autocast_applied = True
            elif not self._autocast_applied:
                # The script's own autocast is in force at its first forward: the
                # change would change nothing. (Later, a checkpointed block's
                # forward run again in backward is under the autocast it ran in.)
                raise PreflightError("the script already runs its model's forward under autocast")

    def top_forward_ends(self) -> None:
        """That forward has returned."""
        if self._in_autocast:
            self.autocast.exit()
            self._in_autocast = False


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of the ``ModuleList`` or ``Sequential``
    holding the most parameters whose children are two or more of one class (a
    transformer's layers, a ResNet's stages' blocks), as one checkpoints by hand."""
    found: list[torch.nn.Module] = []
    most = -1
    for m in model.modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(m.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > most:
            found, most = children, size
    return found


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """A block's forward under activation checkpointing where gradients are on (its activations recomputed in backward)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
