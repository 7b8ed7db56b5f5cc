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
(``Placement.compiled``), or ``flex_attention`` compiled on its own, as
torchtune and torchtitan compile it: that is the fused kernel whatever it
is given, so it is not traced but called with a kernel option
(:data:`FUSED`) that autograd hands its backward too. While
``torch.compile``'s tracer captures a graph, its tensors are on ``meta`` as
they are, which FlexAttention's check of the device is told is the GPU.
"""

from __future__ import annotations

import functools
import importlib
import inspect
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
            compiled = recorder.placement.compiled or _marked_fused(args, kwargs)
            run = fused if compiled or unfused is None else unfused
            # Run with the recorder on again: what the kernel allocates is recorded as any operation's.
            with mode:
                return run(*args, **kwargs)

        return rule

    rules = (
        _Rule(hops.flex_attention, ruled(fused_forward, dense_forward)),
        _Rule(hops.flex_attention_backward, ruled(fused_backward, dense_backward)),
    )
    return [(rule.register, rule.rule) for rule in rules]


#: The kernel option a call of ``flex_attention`` compiled on its own carries under preflight.
#: Autograd gives the backward the forward's kernel options, so both are sized as the fused kernel.
FUSED = "OOMKIT_COMPILED_ALONE"


def _marked_fused(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a FlexAttention operator's kernel options (a dict among its arguments) carry :data:`FUSED`."""
    return any(isinstance(a, dict) and a.get(FUSED) for a in (*args, *kwargs.values()))


def compiled_alone(target: Any, recorder: Recorder) -> Callable[..., Any] | None:
    """``flex_attention`` as ``torch.compile(flex_attention)`` makes it under preflight: called, not
    traced, with :data:`FUSED` among its kernel options; inside a graph being captured, one opaque
    operator (:func:`_fused_operator`). None for any other ``target``."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    if target is not flex_attention:
        return None
    signature = inspect.signature(flex_attention)

    @functools.wraps(flex_attention)
    def fused(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if recorder.capturing:
            return _traced_as_one(bound.arguments)
        bound.arguments["kernel_options"] = {**(bound.arguments.get("kernel_options") or {}), FUSED: True}
        return flex_attention(*bound.args, **bound.kwargs)

    return fused


def _traced_as_one(arguments: dict[str, Any]) -> Any:
    """A compiled ``flex_attention`` call inside a graph being captured: the fused kernel as one
    operator on the queries, keys and values (the block mask and score function decide values,
    not sizes), its outputs given back in the form the call asked for."""
    from torch.nn.attention.flex_attention import AuxOutput

    out, lse = _fused_operator()(arguments["query"], arguments["key"], arguments["value"])
    aux = arguments.get("return_aux")
    if aux is not None:
        return out, AuxOutput(lse=lse if aux.lse else None, max_scores=torch.empty_like(lse) if aux.max_scores else None)
    if arguments.get("return_lse"):
        return out, lse
    return out


#: The fused kernel's forward as one operator, defined at its first use (an operator is defined once a process).
_FUSED_OPERATOR: list[Any] = []


def _fused_outputs(query: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused forward allocates: the output (the queries' shape, the values' last size)
    and a float32 log-sum-exp per row."""
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


def _fused_grads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the fused backward allocates: the gradients of queries, keys and values, and a float32
    sum per row of the output times its gradient (freed as the kernel ends)."""
    delta = out.new_empty(out.shape[:-1], dtype=torch.float32)
    del delta
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def is_fused_operator(func: Any) -> bool:
    """Whether ``func`` is the fused kernel's forward operator as dispatch gives it, once defined."""
    return bool(_FUSED_OPERATOR) and func is torch.ops.oomkit_preflight.flex_fused.default


def _fused_operator() -> Any:
    """The fused kernel as an operator AOTAutograd traces as one call, with its backward another."""
    if _FUSED_OPERATOR:
        return _FUSED_OPERATOR[0]
    forward_schema = "(Tensor query, Tensor key, Tensor value) -> (Tensor, Tensor)"
    backward_schema = "(Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, Tensor grad_out) -> (Tensor, Tensor, Tensor)"

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _fused_outputs(query, value)

    def backward_kernel(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        query, key, value, out = tensors[:4]
        return _fused_grads(query, key, value, out)

    fwd = torch.library.custom_op("oomkit_preflight::flex_fused", forward, mutates_args=(), schema=forward_schema)
    fwd.register_fake(forward)
    bwd = torch.library.custom_op("oomkit_preflight::flex_fused_backward", backward_kernel, mutates_args=(), schema=backward_schema)
    bwd.register_fake(backward_kernel)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        ctx.save_for_backward(*inputs, *output)

    def gradient(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        return tuple(bwd(query, key, value, out, lse, grad_out))

    fwd.register_autograd(gradient, setup_context=setup_context)
    _FUSED_OPERATOR.append(fwd)
    return fwd


def eager_wrapper(target: Any) -> bool:
    """Whether ``target`` is the wrapper through which uncompiled ``flex_attention`` runs its
    operator (compiled with a debugging backend): left as it is, and not noted."""
    return getattr(target, "__module__", None) == "torch.nn.attention.flex_attention" and getattr(
        target, "__name__", ""
    ) == "_flex_attention_hop_wrapper"


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
