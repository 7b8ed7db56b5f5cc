"""Autocast under preflight is PyTorch's own CUDA autocast: every operator its test lists name, and a network under AMP.

PyTorch checks its CUDA autocast against the lists in
``torch/testing/_internal/autocast_test_lists.py``: which operators run in
float16, which in float32, which in the widest type of their inputs, and
which autocast refuses. Preflight asks PyTorch's own autocast what it does
to each call (``oomkit.preflight.world.autocast``), so each operator those
lists name must come out of preflight's emulation in the dtype the lists
say, on ``meta`` tensors, without a GPU. And a convolutional network with
batch norms holds less under AMP than in float32: batch norm, which
autocast leaves alone, keeps the 16-bit tensors it is given.
"""

from __future__ import annotations

import warnings
from typing import Any

import oomkit
import pytest
import torch
from torch import nn

pytest.importorskip("expecttest", reason="PyTorch's autocast test lists import expecttest (scripts/test.sh installs it)")

from oomkit.preflight.world.autocast import Autocast
from oomkit.preflight.world.cuda import CudaFunctions
from torch.testing._internal.autocast_test_lists import AutocastTestLists

#: Where each of PyTorch's lists takes its operators from, and the dtype it expects of them
#: ("widest": the widest floating type among the inputs; "builtin": what the operator gives without autocast).
LISTS: dict[str, tuple[Any, Any]] = {
    "torch_fp16": (torch, torch.float16),
    "torch_fp32": (torch, torch.float32),
    "nn_fp16": (torch._C._nn, torch.float16),
    "nn_fp32": (torch._C._nn, torch.float32),
    "linalg_fp16": (torch._C._linalg, torch.float16),  # type: ignore[attr-defined]
    "methods_fp16": (None, torch.float16),
    "methods_fp32": (None, torch.float32),
    "torch_need_autocast_promote": (torch, "widest"),
    "torch_expect_builtin_promote": (torch, "builtin"),
    "methods_expect_builtin_promote": (None, "builtin"),
}


def _entries() -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """Every (list, operator, arguments, keyword arguments) PyTorch's lists hold, made on ``meta``."""
    lists = AutocastTestLists(torch.device("meta"))
    found = []
    for name in LISTS:
        for entry in getattr(lists, name):
            op = entry[0]
            if isinstance(entry[1], str):
                # einsum's equation comes first among its arguments.
                args, kwargs = tuple(entry[1:]), {}
            else:
                args = tuple(entry[1])
                kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            found.append((name, op, args, kwargs))
    return found


def _callable(name: str, op: str, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    source = LISTS[name][0]
    if source is None:
        return getattr(args[0], op), args[1:]
    return getattr(source, op), args


def _under_autocast(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    """``fn`` called as preflight runs it inside ``torch.autocast("cuda", dtype)``."""
    autocast = Autocast()
    autocast.enter(True, dtype)
    try:
        with CudaFunctions(autocast):
            return fn(*args, **kwargs)
    finally:
        autocast.exit()


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("mode", ["autograd", "inference"])
def test_every_operator_pytorchs_autocast_lists_name_comes_out_as_they_say(mode: str) -> None:
    # Under inference_mode (a predictor's, as YOLO's AMP check runs) autocast's casts are ``to``
    # calls seen whole, not the ``_to_copy`` they become elsewhere.
    checked, unrunnable, wrong = 0, [], []
    with warnings.catch_warnings(), torch.inference_mode(mode == "inference"):
        warnings.simplefilter("ignore")
        for name, op, args, kwargs in _entries():
            fn, call_args = _callable(name, op, args)
            want = LISTS[name][1]
            if want == "widest":
                floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
                want = max(floats, key=lambda d: torch.finfo(d).bits)
            try:
                if want == "builtin":
                    want = _first(fn(*call_args, **kwargs)).dtype
                got = _first(_under_autocast(fn, call_args, kwargs, torch.float16)).dtype
            except (NotImplementedError, RuntimeError) as e:
                try:
                    # Cast by hand as the list says: if that fails too, nothing of it runs on meta.
                    fn(*[a.to(want) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in call_args], **kwargs)
                except (NotImplementedError, RuntimeError):
                    unrunnable.append(f"{op}: {str(e).splitlines()[0][:80]}")
                    continue
                wrong.append(f"{name} {op}: raised {type(e).__name__}: {e}")
                continue
            checked += 1
            if got != want:
                wrong.append(f"{name} {op}: {got}, PyTorch's list says {want}")
    assert not wrong, wrong
    # The lists hold about 120 calls; all but the few without a meta kernel run here.
    assert checked >= 100 and len(unrunnable) <= 5, (checked, unrunnable)


def test_what_autocast_refuses_raises_its_own_error() -> None:
    for op, args, *_ in AutocastTestLists(torch.device("meta")).banned:
        fn = getattr(torch._C._nn, op)
        fn(*args)  # runs without autocast
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            _under_autocast(fn, args, {}, torch.float16)


def test_mixed_inputs_that_run_only_under_autocast_are_cast_as_autocast_casts_them() -> None:
    # Attention with 16-bit queries and float32 values runs only under autocast, which casts the
    # values down; its math kernel then computes 16-bit inputs in float32 itself, a cast of its own.
    q = torch.empty(2, 4, 16, 16, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 4, 16, 16, device="meta")
    mask = torch.ones(2, 1, 16, 16, device="meta", dtype=torch.bool)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = _under_autocast(sdpa, (q, q, v), {"attn_mask": mask, "scale": 0.25}, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_a_16_bit_input_to_float32_weights_under_inference_mode_is_cast_as_autocast_casts_it() -> None:
    # YOLO's AMP check: a fused convolution (with a bias) given a half-precision image, its weights
    # float32, all under inference_mode; autocast casts the weight and bias down, or it fails.
    x = torch.empty(8, 3, 64, 64, device="meta", dtype=torch.float16)
    w, b = torch.empty(16, 3, 3, 3, device="meta"), torch.empty(16, device="meta")
    with torch.inference_mode():
        out = _under_autocast(torch.conv2d, (x, w, b, (1, 1), (1, 1)), {}, torch.float16)
    assert out.dtype == torch.float16 and out.shape == (8, 16, 64, 64)


def test_casts_are_made_above_autograd_and_weights_cast_once_per_region() -> None:
    # A linear layer under autocast keeps the 16-bit copies of its input and
    # weight for backward, as on a GPU; the weight's copy is cached for the region.
    layer = nn.Linear(64, 32, device="meta")
    x = torch.empty(8, 64, device="meta")
    autocast = Autocast()
    autocast.enter(True, torch.bfloat16)
    with CudaFunctions(autocast):
        a = layer(x)
        b = layer(x)
    assert a.dtype == b.dtype == torch.bfloat16
    assert len(autocast.cache) == 2 and all(c.dtype == torch.bfloat16 for c in autocast.cache.values())  # weight and bias
    assert a.grad_fn is not None and "ToCopy" in str(a.grad_fn.next_functions)
    autocast.exit()
    assert not autocast.cache
    # Asked of PyTorch once for each kind of call, not once per call.
    assert autocast.policies.asked == 1


def _convnet() -> nn.Module:
    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))

    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        *[block(64) for _ in range(8)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 1000),
    )  # fmt: skip


def _batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, 64, 64), torch.randint(0, 1000, (b,))


def _loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(data[0]), data[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_convolutional_network_under_amp_holds_less_than_in_float32(dtype: torch.dtype) -> None:
    fp32 = oomkit.preflight(_convnet, _batch, micro_batch=64, loss=_loss, optimizer="sgd", capacity="80GiB")
    amp = oomkit.preflight(_convnet, _batch, micro_batch=64, loss=_loss, optimizer="sgd", capacity="80GiB", autocast=dtype)
    # By hand: each of the 9 convolution + batch norm + ReLU blocks saves two
    # activations of 64 x 64 x 64 x 64 elements for backward (the convolution's
    # input, which is the previous ReLU's output, and the batch norm's input):
    # 64 MiB each in float32, 32 MiB in 16 bits.
    per = 64 * 64 * 64 * 64
    assert fp32.by_role["activations"] == pytest.approx(9 * 2 * per * 4, rel=0.02)
    assert amp.by_role["activations"] == pytest.approx(9 * 2 * per * 2, rel=0.02)
    assert amp.peak_allocated_bytes < 0.6 * fp32.peak_allocated_bytes


def _saved_dtype(out: torch.Tensor, node: str) -> torch.dtype:
    """The dtype of what autograd's ``node`` (``LogSoftmaxBackward0``) keeps for backward, found from ``out``."""
    todo, seen = [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == node:
            saved: torch.Tensor = getattr(fn, "_saved_result")  # noqa: B009 - autograd's nodes declare no such attribute
            return saved.dtype
        todo += [n for n, _ in fn.next_functions]
    raise AssertionError(f"no {node} behind {out.grad_fn}")


def test_what_autograd_keeps_is_what_cuda_autocast_keeps() -> None:
    # Checked against PyTorch's CUDA autocast itself on fake CUDA tensors: softmax of a
    # float16 input keeps its float32 result (autocast asks for dtype=float32), while
    # cross_entropy, which passes its input's own dtype to log_softmax, keeps the
    # bfloat16 log-probabilities and casts them to float32 only for nll_loss.
    x = torch.empty(8, 1000, device="meta", dtype=torch.float16, requires_grad=True)
    out = _under_autocast(nn.functional.softmax, (x,), {"dim": -1}, torch.float16)
    assert out.dtype == torch.float32 and _saved_dtype(out, "SoftmaxBackward0") == torch.float32
    logits = torch.empty(8, 1000, device="meta", dtype=torch.bfloat16, requires_grad=True)
    target = torch.zeros(8, dtype=torch.long, device="meta")
    loss = _under_autocast(nn.functional.cross_entropy, (logits, target), {}, torch.bfloat16)
    assert loss.dtype == torch.float32 and _saved_dtype(loss, "LogSoftmaxBackward0") == torch.bfloat16
