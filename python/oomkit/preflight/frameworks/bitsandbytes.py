"""bitsandbytes under preflight: its 8-bit optimizers, made by name or in place of PyTorch's.

bitsandbytes (0.46 and later) gives the kernels of its 8-bit optimizers
and 4-bit layers fake implementations, so they run on tensors without
data as they are, and hold what they hold on a GPU: an 8-bit optimizer's
state is one byte per element in blocks of 256 with an fp32 scale each,
and tensors under 4096 elements keep fp32 state (``min_8bit_size``).
"""

from __future__ import annotations

import inspect
from typing import Any

from oomkit._native import PreflightError


def _bitsandbytes(what: str) -> Any:
    """bitsandbytes, or the one line saying ``what`` needs it."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise PreflightError(f"{what}: install bitsandbytes where preflight runs") from None
    return bnb


def adamw8bit(params: Any) -> Any:
    """bitsandbytes' 8-bit AdamW over ``params``, with its defaults (``oomkit.preflight(optimizer="adamw8bit")``)."""
    return _bitsandbytes("optimizer 'adamw8bit' is bitsandbytes' AdamW8bit").optim.AdamW8bit(params)


def eight_bit_in_place_of_torch() -> list[tuple[Any, str, Any]]:
    """``torch.optim.AdamW`` and ``Adam`` made bitsandbytes' 8-bit ones, as (owner, name, value)
    for the fake GPU's ledger: the fix that tries 8-bit AdamW inside a script."""
    import torch

    bnb = _bitsandbytes("8-bit AdamW is bitsandbytes'")
    return [
        (torch.optim, "AdamW", _taking_torchs_arguments(bnb.optim.AdamW8bit)),
        (torch.optim, "Adam", _taking_torchs_arguments(bnb.optim.Adam8bit)),
    ]


def _taking_torchs_arguments(cls: Any) -> Any:
    """``cls`` taking the arguments ``torch.optim``'s class takes (those it has no use for, as ``fused``, dropped)."""
    accepted = set(inspect.signature(cls).parameters)

    class InPlace(cls):
        def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(params, *args, **{k: v for k, v in kwargs.items() if k in accepted})

    InPlace.__name__ = InPlace.__qualname__ = cls.__name__
    return InPlace
