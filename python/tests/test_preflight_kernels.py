"""The meta kernels a preflight runs: PyTorch's C++ ones while it runs, its Python ones again after.

Every operation of a preflight sizes its result with a meta kernel, and
PyTorch registers Python ones over the C++ ones for hundreds of operators
(about a hundred times slower). `oomkit.preflight.world.kernels` makes the C++
ones current for the run and puts PyTorch's back after; these tests check
both ways and that the two agree on what a result looks like.
"""

from __future__ import annotations

import torch
from oomkit.preflight.world.kernels import native_meta_kernels_current


def _meta_kernel(op: str) -> str:
    """Where the Meta kernel current for ``op`` was registered, as PyTorch's dispatcher says."""
    lines = [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("Meta:")]
    assert len(lines) == 1, torch._C._dispatch_dump(op)
    return lines[0]


def test_the_cpp_kernels_are_current_inside_and_pythons_again_after() -> None:
    before = _meta_kernel("aten::add.Tensor")
    assert "_meta_registrations.py" in before, before
    with native_meta_kernels_current() as handle:
        assert handle.kernels, "PyTorch registered no Python meta kernels here"
        inside = _meta_kernel("aten::add.Tensor")
        assert "RegisterMeta" in inside, inside
        # An operator with no C++ meta kernel keeps its Python one.
        python_only = [name for name, _ in handle.kernels if "RegisterMeta" not in _meta_kernel(name)]
        assert python_only and all("preflight/world/kernels.py" in _meta_kernel(n) for n in python_only[:20])
    assert "_meta_registrations.py" in _meta_kernel("aten::add.Tensor")
    for name, _ in handle.kernels[:50]:
        assert "_meta_registrations.py" in _meta_kernel(name), name


def _results() -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """What a step's usual operations give on meta tensors: each result's sizes, strides and type."""
    m = torch.device("meta")
    x = torch.empty(4, 16, 32, device=m, dtype=torch.bfloat16)
    w = torch.empty(64, 32, device=m, dtype=torch.bfloat16)
    img = torch.empty(2, 8, 16, 16, device=m).to(memory_format=torch.channels_last)
    ids = torch.empty(4, 16, device=m, dtype=torch.long)
    out = [
        x + x[0],
        x * 2.0,
        torch.rsqrt(x.float()),
        torch.cat([x, x], dim=1),
        torch.cat([img, img], dim=1),
        x.mean(-1, keepdim=True),
        torch.softmax(x.float(), -1),
        torch.nn.functional.linear(x, w),
        torch.nn.functional.layer_norm(x, (32,)),
        torch.nn.functional.conv2d(img, torch.empty(4, 8, 3, 3, device=m).to(memory_format=torch.channels_last)),
        img + 1,
        torch.nn.functional.embedding(ids, torch.empty(100, 32, device=m)),
        torch.where(x > 0, x, 0.0),
        x.transpose(1, 2) * 3,
        torch.nn.functional.cross_entropy(torch.empty(64, 100, device=m), ids.view(-1)),
    ]
    return [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in out]


def test_the_cpp_and_python_kernels_give_the_same_results() -> None:
    python = _results()
    with native_meta_kernels_current():
        cpp = _results()
    assert cpp == python


def _described(out: object) -> list[tuple[object, ...] | None]:
    """Each output's shape, dtype, strides and device (None for one not asked for)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [None if t is None else (tuple(t.shape), t.dtype, t.stride(), t.device.type) for t in outs]


def test_batch_norms_sizes_only_kernels_give_what_pytorchs_decomposition_gives() -> None:
    # Batch norm has no C++ meta kernel; its Python one decomposes into a dozen reference
    # operations. The kernel that makes only the outputs must give the same outputs.
    forward, backward = torch.ops.aten.native_batch_norm.default, torch.ops.aten.native_batch_norm_backward.default
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for channels_last in (False, True):
            for training in (True, False):
                for affine in (True, False):
                    cases.append((dtype, channels_last, training, affine))
    for dtype, channels_last, training, affine in cases:
        x = torch.empty(4, 16, 8, 8, device="meta", dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        weight = torch.empty(16, device="meta") if affine else None
        bias = torch.empty(16, device="meta") if affine else None
        mean, var = torch.empty(16, device="meta"), torch.empty(16, device="meta")
        args = (x, weight, bias, mean, var, training, 0.1, 1e-5)
        python = forward(*args)
        with native_meta_kernels_current():
            sized = forward(*args)
        assert _described(sized) == _described(python), (dtype, channels_last, training, affine)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            back = (x, x, weight, mean, var, python[1], python[2], training, 1e-5, mask)
            python_grads = backward(*back)
            with native_meta_kernels_current():
                sized_grads = backward(*back)
            # The gradients asked for are the decomposition's; one not asked for is not made, as
            # CUDA's kernel makes none (the decomposition computes every one).
            asked = [d if m else None for d, m in zip(_described(python_grads), mask)]
            assert _described(sized_grads) == asked, (dtype, channels_last, training, affine, mask)
