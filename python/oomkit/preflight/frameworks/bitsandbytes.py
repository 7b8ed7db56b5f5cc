"""bitsandbytes under preflight: its 8-bit optimizers, made by name or in place of PyTorch's.

bitsandbytes (0.46 and later) gives the kernels of its 8-bit optimizers
and 4-bit layers fake implementations, so they run on tensors without
data as they are, and hold what they hold on a GPU: an 8-bit optimizer's
state is one byte per element in blocks of 256 with an fp32 scale each,
and tensors under 4096 elements keep fp32 state (``min_8bit_size``).

Its paged optimizers (``PagedAdamW8bit``, ``PagedAdamW``) keep the state
of each tensor of 100,000 elements or more in CUDA's unified memory, which
its native library allocates and prefetches (``cget_managed_ptr``,
``cprefetch``); without a GPU the library exits the process. On a GPU that
state is a host tensor whose pages the driver moves to the GPU while there
is room and back when there is not, outside PyTorch's caching allocator:
never in the GPU's peaks, never the cause of an out-of-memory. Under
preflight it is host memory that costs nothing until touched, counted as
paged beside the GPU's figures.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from oomkit._native import PreflightError
from oomkit.preflight.notes import Notes
from oomkit.preflight.record.host import HostMemory, host_zeros
from oomkit.preflight.record.placement import on_meta

#: The module whose paged buffers are stood in for, once the script imports it.
FUNCTIONAL = "bitsandbytes.functional"


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


def paged_stand_ins(host: HostMemory) -> Any:
    """What to set on ``bitsandbytes.functional`` once imported: paged buffers made as host
    memory counted as paged, their prefetches and fills without the native library."""

    def make(functional: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        elementwise = functional.elementwise_func

        def get_paged(*shape: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
            out = host_zeros(tuple(shape), dtype)
            out.is_paged = True  # type: ignore[attr-defined]
            out.page_deviceid = getattr(device, "index", None) or 0  # type: ignore[attr-defined]
            host.hold_paged(out)
            return out

        def prefetch_tensor(a: torch.Tensor, to_cpu: bool = False) -> None:
            # Moving pages between host and GPU changes no figure preflight gives.
            del a, to_cpu

        def elementwise_func(func_name: str, a: torch.Tensor, b: Any, value: Any, prefetch: bool = True) -> Any:
            if not getattr(a, "is_paged", False):
                return elementwise(func_name, a, b, value, prefetch)
            # A paged buffer is new zeros; filling it with zeros (all its optimizer does) leaves it so.
            if func_name == "fill" and value:
                a.fill_(value)
            return None

        return [
            (functional, "get_paged", get_paged),
            (functional, "prefetch_tensor", prefetch_tensor),
            (functional, "elementwise_func", elementwise_func),
        ]

    return make


#: Said where an 8-bit layer's outlier columns were taken as none.
OUTLIERS_NOTE = (
    "bitsandbytes' 8-bit layers (LLM.int8, threshold above 0) hold back the input's outlier columns, whose number "
    "depends on the activations' values: taken as none (each would add a 16-bit copy of that column of the input)"
)


def outlier_stand_ins(notes: Notes) -> Any:
    """What to set on ``bitsandbytes.functional`` once imported: the quantization of an 8-bit
    layer's input on the fake GPU, with its outlier columns (a count that only values give)
    taken as none, instead of a fake kernel that cannot size them without values."""

    def make(functional: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        quant = getattr(functional, "int8_vectorwise_quant", None)
        if quant is None:
            return []

        def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> Any:
            if not threshold or not on_meta(A):
                return quant(A, threshold)
            out_row, row_stats, _ = quant(A, 0.0)
            notes.add(OUTLIERS_NOTE)
            return out_row, row_stats, torch.empty(0, dtype=torch.int64, device=A.device)

        ops = torch.ops.bitsandbytes
        mixed = getattr(ops, "int8_mixed_scaled_mm", None)
        scaled = getattr(ops, "int8_scaled_mm", None)
        found: list[tuple[Any, str, Any]] = [(functional, "int8_vectorwise_quant", int8_vectorwise_quant)]
        if mixed is None or scaled is None:
            return found

        def int8_mixed_scaled_mm(A: torch.Tensor, CA: Any, CB: Any, SCA: Any, SCB: Any, outlier_cols: Any = None, bias: Any = None) -> Any:
            if not on_meta(A) or outlier_cols is None or outlier_cols.numel():
                return mixed(A, CA, CB, SCA, SCB, outlier_cols, bias)
            # No outlier columns: the int8 multiply alone, and an empty 16-bit part, as its CUDA kernel gives.
            return scaled.default(CA, CB, SCA, SCB, bias=bias, dtype=A.dtype), torch.empty(0, device=A.device, dtype=A.dtype)

        # bitsandbytes' 8-bit layers call the operator by its name in PyTorch's namespace, at each call.
        return [*found, (ops, "int8_mixed_scaled_mm", int8_mixed_scaled_mm)]

    return make
