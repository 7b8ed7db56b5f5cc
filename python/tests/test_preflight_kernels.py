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


def _samples() -> list[tuple[str, tuple[object, ...], dict[str, object]]]:
    """Calls of each operator given a sizes-only kernel: dtypes, layouts (contiguous, transposed,
    channels-last, expanded) and broadcasts, each as (operator, args, kwargs) on meta."""
    m = "meta"
    calls: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        base = torch.empty(4, 6, 8, device=m, dtype=dtype)
        layouts = [base, base.transpose(0, 2), base[:, :1].expand(4, 6, 8), torch.empty(2, 3, 4, 5, device=m, dtype=dtype).to(memory_format=torch.channels_last)]
        for x in layouts:
            floating = x.is_floating_point()
            for scalar in (2, 2.5, True):
                for op in ("add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar"):
                    if op == "sub.Scalar" and (dtype == torch.bool or scalar is True):
                        continue  # ATen refuses to subtract booleans, on every device
                    calls.append((op, (x, scalar), {}))
            calls.append(("div.Scalar_mode", (x, 3), {"rounding_mode": "floor"}))
            if dtype != torch.bool:
                calls.append(("relu", (x,), {}))
            calls += [("isnan", (x,), {}), ("fill.Scalar", (x, 1), {})]
            for like in ("empty_like", "zeros_like", "ones_like"):
                calls += [(like, (x,), {}), (like, (x,), {"dtype": torch.float16}), (like, (x,), {"memory_format": torch.contiguous_format})]
            mask = torch.empty(x.shape[-1], device=m, dtype=torch.bool)
            calls += [("masked_fill.Scalar", (x, mask, 0), {}), ("masked_fill.Tensor", (x, mask, torch.empty((), device=m, dtype=dtype)), {})]
            # A mask wider than the input: the result takes the broadcast shape.
            calls.append(("masked_fill.Scalar", (x[..., :1], mask, 0), {}))
            if floating:
                calls += [("mean", (x,), {}), ("mean", (x,), {"dtype": torch.float32})]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape, normalized in (((4, 16, 32), [32]), ((4, 16, 32), [16, 32]), ((8, 32), [32])):
            x = torch.empty(shape, device=m, dtype=dtype)
            for affine in (True, False):
                w = torch.empty(normalized, device=m, dtype=dtype) if affine else None
                b = torch.empty(normalized, device=m, dtype=dtype) if affine else None
                calls.append(("native_layer_norm", (x, normalized, w, b, 1e-5), {}))
                if x.dim() == 3 and len(normalized) == 1:  # a transposed input, normalized over its last dim
                    calls.append(("native_layer_norm", (x.transpose(0, 1), normalized, w, b, 1e-5), {}))
    for dtype in (torch.float32, torch.bfloat16):
        for spatial in (1, 2, 3):
            x = torch.empty(2, 8, *[9, 11, 7][:spatial], device=m, dtype=dtype)
            inputs = [x] + ([x.to(memory_format=torch.channels_last)] if spatial == 2 else [])
            for groups in (1, 2, 8):
                w = torch.empty(16, 8 // groups, *[3, 2, 1][:spatial], device=m, dtype=dtype)
                for stride, padding, dilation in (([1], [0], [1]), ([2] * spatial, [1] * spatial, [1] * spatial), ([1], [2], [2])):
                    for bias in (None, torch.empty(16, device=m, dtype=dtype)):
                        for inp in inputs:
                            calls.append(("convolution", (inp, w, bias, stride, padding, dilation, False, [0], groups), {}))
            # Transposed: handed to PyTorch's own kernel.
            wt = torch.empty(8, 4, *[3, 3, 3][:spatial], device=m, dtype=dtype)
            calls.append(("convolution", (x, wt, None, [2], [1], [1], True, [1], 1), {}))
    return calls


def _op(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def test_the_sizes_only_kernels_give_what_pytorchs_python_kernels_give() -> None:
    # Each operator swapped for a kernel that only sizes its result must give the sizes, dtypes
    # and strides PyTorch's own Python meta kernel gives, on every layout and dtype tried.
    samples = _samples()
    python = [_described(_op(name)(*args, **kwargs)) for name, args, kwargs in samples]
    with native_meta_kernels_current() as handle:
        assert handle.kernels, "PyTorch registered no Python meta kernels here"
        swapped = {name for name, _, _ in samples if "preflight/world/kernels.py" in _meta_kernel(f"aten::{name}")}
        sized = [_described(_op(name)(*args, **kwargs)) for name, args, kwargs in samples]
    assert swapped == {name for name, _, _ in samples}
    for (name, args, kwargs), want, got in zip(samples, python, sized):
        assert got == want, (name, [getattr(a, "shape", a) for a in args], kwargs)


def test_layer_norms_backward_makes_what_it_is_asked_for() -> None:
    backward = torch.ops.aten.native_layer_norm_backward.default
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.empty(4, 16, 32, device="meta", dtype=dtype)
        w, b = torch.empty(32, device="meta", dtype=dtype), torch.empty(32, device="meta", dtype=dtype)
        _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], w, b, 1e-5)
        for mask in ([True, True, True], [True, False, False], [False, True, True]):
            args = (x, x, [32], mean, rstd, w, b, mask)
            python = backward(*args)
            with native_meta_kernels_current():
                sized = backward(*args)
            asked = [d if wanted else None for d, wanted in zip(_described(python), mask)]
            assert _described(sized) == asked, (dtype, mask)


def _on_cpu(a: object) -> object:
    """A meta argument as a CPU tensor of the same layout (an expanded one expanded again)."""
    if not isinstance(a, torch.Tensor):
        return a
    if 0 in a.stride():
        base = [1 if stride == 0 else size for size, stride in zip(a.shape, a.stride())]
        return torch.zeros(base, dtype=a.dtype).expand(a.shape)
    return torch.zeros_like(a, device="cpu")


def test_the_sizes_only_kernels_are_cpus_results_in_shape_dtype_and_strides() -> None:
    # Where CPU and CUDA share the implementation (everything here but layer norm, whose
    # statistics CPU keeps in the input's dtype), the real CPU result is the layout check.
    # (Nor convolution, which the CPU lays out as its input is laid out, where CUDA's kernel
    # suggests its own format and a meta kernel, PyTorch's and preflight's, lays out contiguous.)
    samples = [(name, args, kwargs) for name, args, kwargs in _samples() if name not in ("native_layer_norm", "convolution")]
    on_cpu = []
    for name, args, kwargs in samples:
        cpu_args = [_on_cpu(a) for a in args]
        on_cpu.append([d[:3] for d in _described(_op(name)(*cpu_args, **kwargs)) if d is not None])
    with native_meta_kernels_current():
        sized = [[d[:3] for d in _described(_op(name)(*args, **kwargs)) if d is not None] for name, args, kwargs in samples]
    for (name, args, kwargs), cpu, meta in zip(samples, on_cpu, sized):
        assert meta == cpu, (name, [getattr(a, "shape", a) for a in args], kwargs)


def test_a_convolution_that_cannot_run_fails_as_pytorchs_kernel_fails() -> None:
    # A kernel wider than the padded input, or channels that do not match the weight, are the
    # step's own errors: the sizes-only kernel must refuse them as PyTorch's kernel does.
    m = "meta"
    conv = torch.ops.aten.convolution.default
    wide = (torch.empty(1, 4, 2, 2, device=m), torch.empty(8, 4, 5, 5, device=m), None, [1], [0], [1], False, [0], 1)
    mismatched = (torch.empty(1, 3, 8, 8, device=m), torch.empty(8, 4, 3, 3, device=m), None, [1], [0], [1], False, [0], 1)
    for args in (wide, mismatched):
        with native_meta_kernels_current():
            try:
                conv(*args)
            except RuntimeError as e:
                assert "kernels.py" not in str(e)
            else:
                raise AssertionError(f"a convolution of {[getattr(a, 'shape', a) for a in args]} ran")


def test_sync_batch_norms_cuda_only_operators_are_sized_as_cuda_allocates_them() -> None:
    # PyTorch has no meta kernel for SyncBatchNorm's operators at all: CUDA's, in
    # aten/src/ATen/native/cuda/Normalization.cu, keep statistics in float32 for a
    # half-precision input and make the elementwise results like the input.
    m = torch.device("meta")
    x = torch.empty(8, 16, 10, 10, device=m, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    weight = torch.empty(16, device=m, dtype=torch.bfloat16)
    with native_meta_kernels_current():
        mean, invstd = torch.batch_norm_stats(x, 1e-5)
        assert (mean.shape, mean.dtype, invstd.shape, invstd.dtype) == ((16,), torch.float32, (16,), torch.float32)
        gathered = torch.empty(4, 16, device=m)
        counts = torch.empty(4, device=m)
        g_mean, g_invstd = torch.batch_norm_gather_stats_with_counts(x, gathered, gathered, None, None, 0.1, 1e-5, counts)
        assert (g_mean.shape, g_invstd.shape, g_mean.dtype) == ((16,), (16,), torch.float32)
        out = torch.batch_norm_elemt(x, weight, weight, g_mean, g_invstd, 1e-5)
        assert (out.shape, out.dtype, out.stride()) == (x.shape, x.dtype, x.stride())
        sum_dy, sum_dy_xmu, grad_w, grad_b = torch.batch_norm_backward_reduce(x, x, g_mean, g_invstd, weight, True, True, False)
        assert (sum_dy.shape, sum_dy_xmu.dtype, grad_w.shape, grad_w.dtype) == ((16,), torch.float32, (16,), torch.bfloat16)
        assert grad_b is None
        grad = torch.batch_norm_backward_elemt(x, x, g_mean, g_invstd, weight, sum_dy, sum_dy_xmu, counts.int())
        assert (grad.shape, grad.dtype, grad.stride()) == (x.shape, x.dtype, x.stride())
    # Outside a preflight the operators are PyTorch's again: CUDA's alone.
    assert "Meta:" not in torch._C._dispatch_dump("aten::batch_norm_stats")
