"""FlexAttention on the fake GPU: the kernel CUDA would run, recorded as it allocates.

``flex_attention`` is a higher-order operator, which a dispatch mode must
give a rule of its own. Compiled (as torchtitan and torchtune call it), it
is one fused kernel: its forward allocates the output and, per row, the
log-sum-exp and the largest score (float32), and its backward the gradients
of queries, keys and values; no matrix of scores. Those are the sizes
PyTorch's own fake implementations give, run here through the recorder.
Called without ``torch.compile``, PyTorch runs its dense implementation,
which holds the whole matrix of scores, on a GPU as here: that is run,
recorded. A compiled call is one whose graph preflight runs
(``Placement.compiled``). While ``torch.compile``'s tracer captures a graph,
its tensors are on ``meta`` as they are, which FlexAttention's check of
the device is told is the GPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from oomkit.preflight.record.recorder import FAKE_DEVICE, Recorder


class _Rule:
    """A rule for a higher-order operator under the recorder, registered while the fake GPU is entered."""

    def __init__(self, hop: Any, rule: Callable[..., Any]) -> None:
        self.hop, self.rule = hop, rule

    def register(self, _fn: Any) -> _Rule:
        self.hop.python_key_table[Recorder] = self.rule
        return self

    def remove(self) -> None:
        self.hop.python_key_table.pop(Recorder, None)


def flex_rules(recorder: Recorder) -> list[tuple[Callable[[Any], Any], Callable[..., Any]]]:
    """The rules for FlexAttention's forward and backward under ``recorder``, as (register, hook)
    for the fake GPU's ledger; none where this PyTorch has no FlexAttention."""
    try:
        # The module (its package's attribute of that name is the operator itself).
        hops = importlib.import_module("torch._higher_order_ops.flex_attention")
    except ImportError:
        return []
    fused_forward = getattr(hops, "flex_attention_fake_impl", None)
    fused_backward = getattr(hops, "flex_attention_backward_fake_tensor_mode", None)
    if fused_forward is None or fused_backward is None:
        return []
    dense = torch._C.DispatchKey.CompositeExplicitAutograd
    dense_forward = hops.flex_attention.py_kernels.get(dense)
    dense_backward = hops.flex_attention_backward.py_kernels.get(dense)

    def ruled(fused: Callable[..., Any], unfused: Callable[..., Any] | None) -> Callable[..., Any]:
        def rule(mode: Recorder, *args: Any, **kwargs: Any) -> Any:
            run = fused if recorder.placement.compiled or unfused is None else unfused
            # Run with the recorder on again: what the kernel allocates is recorded as any operation's.
            with mode:
                return run(*args, **kwargs)

        return rule

    rules = (
        _Rule(hops.flex_attention, ruled(fused_forward, dense_forward)),
        _Rule(hops.flex_attention_backward, ruled(fused_backward, dense_backward)),
    )
    return [(rule.register, rule.rule) for rule in rules]


def device_check_stand_in() -> list[tuple[Any, str, Any]]:
    """FlexAttention's check of its inputs' device, for the fake GPU's ledger: tensors on ``meta``
    underneath (a graph's capture reads the fake GPU's tensors as they are) pass, as CUDA ones do."""
    try:
        import torch.nn.attention.flex_attention as flex
    except ImportError:
        return []
    check = getattr(flex, "_validate_device", None)
    if check is None:
        return []

    def validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != FAKE_DEVICE:
            check(query, key, value)

    return [(flex, "_validate_device", validate)]
