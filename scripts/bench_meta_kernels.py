"""What one operation on a ``meta`` tensor costs: PyTorch's Python meta kernel, then preflight's.

For the operators given a sizes-only kernel (``SIZES_ONLY`` in
``oomkit/preflight/world/kernels.py``), each called 200 times while a
preflight's kernels are current (the C++ meta kernels wherever PyTorch has
one): PyTorch's own Python kernel for the operator called directly, as
preflight ran it before it had the sizes-only one, then the operator
through the dispatcher, side by side in one run (BENCHMARKS.md):

    python scripts/bench_meta_kernels.py
"""

import time
from collections.abc import Callable
from typing import Any

import torch
from oomkit.preflight.world.kernels import SIZES_ONLY, native_meta_kernels_current

CALLS = 200


def _cases() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Each operator's overload and its arguments."""
    m, aten = "meta", torch.ops.aten
    x, w, b = torch.empty(8, 512, 768, device=m), torch.empty(768, device=m), torch.empty(768, device=m)
    stat = torch.empty(8, 512, 1, device=m)
    mask = torch.empty(8, 512, 768, dtype=torch.bool, device=m)
    return {
        "relu": (aten.relu.default, (x,)),
        "native_layer_norm": (aten.native_layer_norm.default, (x, [768], w, b, 1e-5)),
        "native_layer_norm_backward": (aten.native_layer_norm_backward.default, (x, x, [768], stat, stat, w, b, [True, True, True])),
        "mul.Scalar": (aten.mul.Scalar, (x, 2.0)),
        "add.Scalar": (aten.add.Scalar, (x, 2.0)),
        "div.Scalar": (aten.div.Scalar, (x, 2.0)),
        "masked_fill.Scalar": (aten.masked_fill.Scalar, (x, mask, 0.0)),
        "mean": (aten.mean.default, (x,)),
        "isnan": (aten.isnan.default, (x,)),
        "empty_like": (aten.empty_like.default, (x,)),
        "zeros_like": (aten.zeros_like.default, (x,)),
        "ones_like": (aten.ones_like.default, (x,)),
    }


def _microseconds(call: Callable[..., Any], args: tuple[Any, ...]) -> float:
    call(*args)
    start = time.perf_counter()
    for _ in range(CALLS):
        call(*args)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    print(f"{'operator':28s} {'Python kernel':>14s} {'preflight':>10s}")
    with native_meta_kernels_current() as handle:
        python_kernels = dict(handle.kernels)
        for name, (op, args) in _cases().items():
            assert f"aten::{name}" in SIZES_ONLY, name
            python = _microseconds(python_kernels[f"aten::{name}"], args)
            ours = _microseconds(op, args)
            print(f"{name:28s} {python:11.1f} us {ours:7.1f} us")


if __name__ == "__main__":
    main()
