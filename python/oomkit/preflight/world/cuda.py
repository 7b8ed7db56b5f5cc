"""What a step does differently on CUDA than on ``meta`` tensors, put back.

A ``TorchFunctionMode`` sits above autograd, so what it changes is what
autograd records and saves for backward, as on the GPU:

- ``cuda`` devices become ``meta`` (``.cuda()``, ``.to("cuda")``,
  ``device="cuda"``), so a step written for a GPU runs as written;
- ``torch.autocast("cuda", ...)`` is done here, after the lists of
  ``aten/src/ATen/autocast_mode.cpp`` (CUDA's lower-precision, float32 and
  promote lists, and the cache of casts of weights held until the
  outermost autocast region exits), since PyTorch applies autocast only to
  tensors of a device that has it, which ``meta`` does not;
- ``scaled_dot_product_attention`` takes the kernel CUDA would choose
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: flash
  attention for 16-bit inputs without a mask, else memory-efficient
  attention, else the math path), because the kernels save different
  tensors for backward (flash keeps the output and a float32 log-sum-exp
  per row; the math path keeps the whole attention matrix);
- PyTorch's default of foreach kernels, which it takes for CUDA tensors
  only (optimizers and ``clip_grad_norm_``, whose foreach forms hold a
  temporary for every tensor at once), is taken for ``meta`` ones too
  (:func:`foreach_stand_ins`).

A mode is switched off while it handles a call, so the functions a
composite written in Python calls inside (``multi_head_attention_forward``
calls ``linear`` and ``scaled_dot_product_attention``) would pass it
unseen, while CUDA's autocast and kernel choice, made at the dispatcher,
see every one: those composites run here with the mode on again.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from types import FunctionType
from typing import Any, cast

import torch
import torch.amp.autocast_mode as _autocast_mode
import torch.utils._device as _default_device
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map

from oomkit.preflight.record.recorder import FAKE_DEVICE
from oomkit.preflight.world.memory import MemoryQueries, rng_answers

#: cuBLAS's workspace per handle, allocated through the caching allocator
#: at the first matrix multiply on a stream (``getChosenWorkspaceSize`` in
#: ``aten/src/ATen/cuda/CublasHandlePool.cpp``, after the sizes the cuBLAS
#: documentation recommends for ``cublasSetWorkspace``): 32 MiB from
#: Hopper (compute capability 9) on, 4096 KiB x 2 + 16 KiB x 8 before.
CUBLAS_WORKSPACE_HOPPER = 32 << 20
CUBLAS_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8

#: GPUs by name before Hopper; any other (a size, an H100) is taken as Hopper or later.
PRE_HOPPER = ("A100", "A10", "A40", "L4", "L40", "V100", "T4", "RTX")

#: Functions CUDA autocast runs in the lower precision (by name, as
#: ``torch.nn.functional``, ``torch`` and ``Tensor`` call them).
LOWER_PRECISION = frozenset(
    {
        "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm",
        "baddbmm", "addbmm", "addmv", "addr", "mv", "einsum", "chain_matmul",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "conv_tbc", "prelu", "scaled_dot_product_attention",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    }
)  # fmt: skip

#: Functions CUDA autocast runs in float32.
FLOAT32 = frozenset(
    {
        "layer_norm", "group_norm", "batch_norm", "softmax", "log_softmax",
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
        "huber_loss", "kl_div", "binary_cross_entropy_with_logits",
        "cosine_similarity", "cosine_embedding_loss", "margin_ranking_loss",
        "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
        "poisson_nll_loss", "hinge_embedding_loss", "exp", "log", "log2",
        "log10", "log1p", "expm1", "pow", "rsqrt", "reciprocal", "softplus",
        "cumsum", "cumprod", "prod", "sum", "norm", "logsumexp", "dist",
        "pdist", "cdist", "renorm", "erfinv", "acos", "asin", "cosh", "sinh",
        "tan",
    }
)  # fmt: skip

#: Functions that run in the widest floating type among their inputs.
PROMOTE = frozenset({"cat", "stack", "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "tensordot", "index_put", "scatter_add"})

#: The device types whose autocast is emulated.
EMULATED = ("cuda", FAKE_DEVICE)

#: Composites written in Python whose inner calls the mode must see (by name).
OPENED = frozenset({"multi_head_attention_forward"})

#: Modules that hold PyTorch's list of devices with foreach kernels under their own name (imported by name).
FOREACH_LISTS = ("torch.utils._foreach_utils", "torch.optim.optimizer", "torch.optim.swa_utils")

#: Flash attention's largest head dimension (``check_head_dim_size_flash``).
FLASH_MAX_HEAD_DIM = 256


class _Event:
    """A CUDA event that is always complete: one stream has nothing to wait for."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def record(self, *_: Any, **__: Any) -> None:
        pass

    def wait(self, *_: Any, **__: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, _other: Any) -> float:
        return 0.0


class _Stream:
    """A CUDA stream that is the one stream every operation runs on."""

    #: What FSDP reads of a stream to record a buffer's use on it (CUDA's device type is 1).
    stream_id = 0
    device_index = 0
    device_type = 1
    priority = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, _stream: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_ONE_STREAM = _Stream()


def stream_stand_ins() -> dict[str, Any]:
    """``torch.cuda`` attributes for streams and events, as one stream that never waits."""
    return {
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda *_, **__: _ONE_STREAM,
        "default_stream": lambda *_, **__: _ONE_STREAM,
        "stream": lambda *_, **__: contextlib.nullcontext(),
        "set_stream": lambda *_, **__: None,
    }


#: Compute capability reported for the GPU: Hopper, unless the capacity names an older GPU.
HOPPER = (9, 0)
AMPERE = (8, 0)


class _DeviceContext:
    """``torch.cuda.device(i)`` and ``device_of(t)``: the one GPU is current already."""

    def __init__(self, *_: Any) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def device_answers(capacity: str, capacity_bytes: int, rec: Any, memory: MemoryQueries) -> dict[str, Any]:
    """What ``torch.cuda`` answers under preflight: one GPU of the capacity, whose memory is the recorder's (through ``memory``)."""
    major, minor = AMPERE if cublas_workspace(capacity) != cublas_workspace("H100") else HOPPER

    def properties(*_: Any, **__: Any) -> Any:
        return types.SimpleNamespace(
            name=f"oomkit preflight ({capacity})", total_memory=capacity_bytes, major=major, minor=minor, multi_processor_count=132
        )

    def nothing() -> Any:
        # A new function each time: torch._dynamo refuses one object under two names.
        return lambda *_, **__: None

    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": nothing(),
        "synchronize": nothing(),
        "manual_seed": nothing(),
        "manual_seed_all": nothing(),
        "empty_cache": rec.empty_cache,
        "device": _DeviceContext,
        "device_of": _DeviceContext,
        "is_bf16_supported": lambda *a, **k: True,
        # torch.compile's tracer asks, as the optimizers do: no CUDA graph is being captured.
        "is_current_stream_capturing": lambda: False,
        "get_device_name": lambda *a, **k: f"oomkit preflight ({capacity})",
        "get_device_capability": lambda *a, **k: (major, minor),
        "get_device_properties": properties,
        **memory.cuda_answers(),
        **rng_answers(),
        **stream_stand_ins(),
    }


def accelerator_answers(rec: Any, memory: MemoryQueries) -> dict[str, Any]:
    """What ``torch.accelerator`` (PyTorch's device-agnostic API) answers under preflight: CUDA, one GPU, as ``torch.cuda`` does.

    Without these a PyTorch built for the CPU has no accelerator at all, and
    a script written for ``torch.accelerator`` would train on the CPU.
    """
    queries = memory.cuda_answers()
    streams = stream_stand_ins()
    return {
        "current_accelerator": lambda *_, **__: torch.device("cuda"),
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device_index": lambda: 0,
        "current_device_idx": lambda: 0,
        "set_device_index": lambda *_, **__: None,
        "set_device_idx": lambda *_, **__: None,
        "device_index": _DeviceContext,
        "synchronize": lambda *_, **__: None,
        "current_stream": streams["current_stream"],
        "set_stream": streams["set_stream"],
        "empty_cache": rec.empty_cache,
        "get_memory_info": queries["mem_get_info"],
        **{name: queries[name] for name in ACCELERATOR_MEMORY},
    }


#: The memory queries ``torch.accelerator`` has under the names ``torch.cuda`` gives them.
ACCELERATOR_MEMORY = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
)


def no_graph_capture() -> dict[str, Any]:
    """``torch.optim.Optimizer``'s checks whether a CUDA graph is being captured (none is), answered without a GPU."""
    checks = ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check")
    return {name: (lambda self: None) for name in checks if hasattr(torch.optim.Optimizer, name)}


def cublas_workspace(capacity: str | None) -> int:
    """The cuBLAS workspace for the GPU a capacity names."""
    name = (capacity or "").upper()
    return CUBLAS_WORKSPACE_OLDER if name.startswith(PRE_HOPPER) else CUBLAS_WORKSPACE_HOPPER


def is_cuda(device: Any) -> bool:
    """Whether ``device`` (a device, a name, an index) is a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, str) and device.split(":")[0] == "cuda"


#: Functions that make a tensor on the default device when given none.
_FACTORIES = frozenset(
    {"empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "eye", "linspace", "tensor", "empty_strided"}
)

#: How far up the stack a module's constructor is looked for.
_CONSTRUCTOR_DEPTH = 12


def _building_module() -> bool:
    """Whether a ``torch.nn.Module``'s ``__init__`` is on the stack (near the call)."""
    f: Any = sys._getframe(2)
    for _ in range(_CONSTRUCTOR_DEPTH):
        if f is None:
            return False
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), torch.nn.Module):
            return True
        f = f.f_back
    return False


#: Tensor methods that read a device tensor's values back to the host.
_READ_BACK = frozenset({"cpu", "to", "tolist", "numpy"})


def _is_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to``'s arguments name the CPU."""
    for a in (*args, kwargs.get("device")):
        if (isinstance(a, torch.device) and a.type == "cpu") or (isinstance(a, str) and a.split(":")[0] == "cpu"):
            return True
    return False


def _cuda_by_default() -> bool:
    """Whether ``torch.set_default_device`` or ``with torch.device(...)`` made CUDA the default device."""
    return is_cuda(getattr(_default_device, "CURRENT_DEVICE", None))


def _to_meta(value: Any) -> Any:
    return FAKE_DEVICE if is_cuda(value) else value


class Autocast:
    """The autocast regions entered with ``device_type="cuda"``, emulated."""

    def __init__(self) -> None:
        self.stack: list[tuple[bool, torch.dtype]] = []
        #: Casts of weights, held until the outermost region exits (CUDA's cast cache).
        self.cache: dict[int, torch.Tensor] = {}

    def dtype(self) -> torch.dtype | None:
        """The lower precision in force, or None outside autocast."""
        if self.stack and self.stack[-1][0]:
            return self.stack[-1][1]
        return None

    def enter(self, enabled: bool, dtype: torch.dtype) -> None:
        """Enters a region."""
        self.stack.append((enabled, dtype))

    def exit(self) -> None:
        """Leaves a region; the cast cache goes with the outermost."""
        if self.stack:
            self.stack.pop()
        if not self.stack:
            self.cache.clear()

    def cast(self, t: Any, dtype: torch.dtype, *, cache: bool) -> Any:
        """``cached_cast``: floating tensors of the device (not float64) to ``dtype``."""
        if not (
            isinstance(t, torch.Tensor)
            and t.device.type == FAKE_DEVICE
            and t.is_floating_point()
            and t.dtype not in (dtype, torch.float64)
        ):
            return t
        # Only leaves that require grad (weights) are cached, as in autocast_mode.cpp.
        if cache and t.is_leaf and t.requires_grad:
            hit = self.cache.get(id(t))
            if hit is None:
                hit = t.to(dtype)
                self.cache[id(t)] = hit
            return hit
        return t.to(dtype)


class CudaFunctions(TorchFunctionMode):
    """Maps ``cuda`` to ``meta``, and does autocast and attention as CUDA does."""

    def __init__(
        self,
        autocast: Autocast,
        on_upload: Callable[[torch.Tensor], None] | None = None,
        read_back: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.autocast = autocast
        #: Told of every copy from the host to the device: the batch, as the loop uploads it.
        self.on_upload = on_upload
        #: Gives a device tensor's values on the host (``Recorder.read_back``): known where the
        #: step made them, else zeros, noted; without it, zeros.
        self.read_back = read_back
        #: Told when a backward pass (``Tensor.backward``, ``torch.autograd.backward``) has run.
        self.on_backward: Callable[[], None] | None = None
        #: Make the tensors a module's constructor makes without a device on meta.
        self.build_on_meta = False
        #: Composites run with their check for a mode skipped, made once each (``_opened``).
        self._opened: dict[Any, FunctionType] = {}

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        reads_back = name in _READ_BACK and isinstance(args[0], torch.Tensor) and args[0].device.type == FAKE_DEVICE
        if reads_back and (name != "to" or _is_cpu(args[1:], kwargs)):
            # Values read back to the host (a loss logged, a metric, a
            # generation's tokens): those the step made known, else zeros,
            # as the scalars read with item() are.
            if self.read_back is not None:
                host = self.read_back(args[0], f"Tensor.{name}()")
            else:
                host = torch.zeros(args[0].shape, dtype=args[0].dtype, device="cpu")
            return host if name in ("cpu", "to") else getattr(host, name)()
        if name == "_parse_to":
            # ``Tensor.to`` overrides written in Python (bitsandbytes' 4-bit
            # parameters quantize when moved to the GPU) must see the device
            # asked for; the tensor operations they then call are mapped.
            return func(*args, **kwargs)
        if name == "pin_memory":
            # Page-locked host memory needs a GPU; the copy it speeds up is the same.
            return args[0]
        if name == "cuda" or (name == "to" and any(is_cuda(a) for a in (*args[1:], kwargs.get("device")))):
            source = args[0]
            if name == "cuda":
                moved = source.to(FAKE_DEVICE)
            else:
                moved = func(*(_to_meta(a) for a in args), **{k: _to_meta(v) for k, v in kwargs.items()})
            uploaded = isinstance(source, torch.Tensor) and source.device.type == "cpu" and isinstance(moved, torch.Tensor)
            if self.on_upload is not None and uploaded:
                self.on_upload(moved)
            return moved
        if kwargs.get("device") is None and _cuda_by_default() and func in _default_device._device_constructors():
            # torch.set_default_device("cuda") (or `with torch.device("cuda")`)
            # puts its mode below this one, where it would add a real CUDA device.
            kwargs["device"] = FAKE_DEVICE
        if kwargs.get("device") is not None:
            kwargs["device"] = _to_meta(kwargs["device"])
        elif self.build_on_meta and name in _FACTORIES and _building_module():
            # A module's weights made without a device would be made on the
            # CPU and moved; on meta they are never allocated at all.
            kwargs["device"] = FAKE_DEVICE
        if name == "to":
            args = tuple(_to_meta(a) for a in args)
        dtype = self.autocast.dtype()
        if dtype is not None:
            if name in LOWER_PRECISION:
                args, kwargs = tree_map(lambda t: self.autocast.cast(t, dtype, cache=True), (args, kwargs))
            elif name in FLOAT32:
                args, kwargs = tree_map(lambda t: self.autocast.cast(t, torch.float32, cache=False), (args, kwargs))
            elif name in PROMOTE:
                widest = _widest((args, kwargs))
                if widest is not None:
                    args, kwargs = tree_map(lambda t: self.autocast.cast(t, widest, cache=False), (args, kwargs))
        if name == "scaled_dot_product_attention":
            routed = _cuda_attention(*args, **kwargs)
            if routed is not None:
                return routed
        if name in OPENED and isinstance(func, FunctionType):
            with self:
                return _opened(func, self._opened)(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # What runs in Python during backward (a checkpoint's recomputed
            # forward, FSDP's hooks gathering parameters, a custom Function's
            # backward) must see the mode, as CUDA's dispatcher sees it.
            with self:
                done = _backward(func, args, kwargs, self._opened)
            if self.on_backward is not None:
                self.on_backward()
            return done
        return func(*args, **kwargs)


def _backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cache: dict[Any, FunctionType]) -> Any:
    """``Tensor.backward`` or ``torch.autograd.backward`` run with the mode on, as the latter."""
    if func is torch.Tensor.backward:
        # Tensor.backward(gradient, retain_graph, create_graph, inputs) is
        # autograd.backward(tensors, grad_tensors, retain_graph, create_graph, inputs=).
        if "gradient" in kwargs:
            kwargs["grad_tensors"] = kwargs.pop("gradient")
        if len(args) > 4:
            kwargs["inputs"] = args[4]
            args = args[:4]
    return _opened(cast(FunctionType, torch.autograd.backward), cache)(*args, **kwargs)


def _opened(func: FunctionType, cache: dict[Any, FunctionType]) -> FunctionType:
    """``func`` without its check for a mode, so that called with the mode on it runs its body
    instead of handing itself back; made once per mode, in ``cache``."""
    found = cache.get(func)
    if found is None:
        scope = dict(func.__globals__, has_torch_function=lambda *_: False)
        found = FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        found.__kwdefaults__ = func.__kwdefaults__
        cache[func] = found
    return found


def _widest(tree: Any) -> torch.dtype | None:
    found = [t.dtype for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not found:
        return None
    return max(found, key=lambda d: torch.finfo(d).bits)


def _cuda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The kernel CUDA's ``select_sdp_backend`` picks, called directly; None for the math path."""
    if query.device.type != FAKE_DEVICE or query.dim() != 4 or key.dim() != 4:
        return None
    if key.shape[1] != query.shape[1]:
        # Grouped keys: left to the math path, which repeats them as CUDA's does.
        return None
    head_dim = query.shape[-1]
    same_dtype = query.dtype == key.dtype == value.dtype
    sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
    if (
        torch.backends.cuda.flash_sdp_enabled()
        and attn_mask is None
        and same_dtype
        and sixteen_bit
        and head_dim <= FLASH_MAX_HEAD_DIM
        and head_dim % 8 == 0
        and value.shape[-1] == head_dim
    ):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and same_dtype
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and head_dim % (8 if sixteen_bit else 4) == 0
    ):
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            # The memory-efficient kernel takes an additive bias; CUDA converts a boolean mask the same way.
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill(~bias, float("-inf"))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
        )
        return out[0]
    return None


def foreach_stand_ins() -> list[tuple[Any, str, Any]]:
    """What makes PyTorch choose foreach kernels for ``meta`` tensors by default, as it
    does for CUDA ones: (owner, name, value) for the fake GPU's ledger."""
    import importlib

    import torch.utils._foreach_utils as foreach_utils

    original = foreach_utils._get_foreach_kernels_supported_devices

    def with_meta() -> list[str]:
        return [*original(), FAKE_DEVICE]

    found = []
    for name in FOREACH_LISTS:
        module = importlib.import_module(name)
        if getattr(module, "_get_foreach_kernels_supported_devices", None) is original:
            found.append((module, "_get_foreach_kernels_supported_devices", with_meta))
    return found


def autocast_stand_ins(autocast: Autocast, functions: CudaFunctions | None = None) -> list[tuple[Any, str, Any]]:
    """What makes ``torch.autocast("cuda", ...)`` enter the emulated regions:
    (owner, name, value) for the fake GPU's ledger.

    ``functions`` is pushed again for a region entered where function modes
    are not active (activation checkpointing's recompute inside backward:
    autograd's engine carries dispatch modes into backward, not function
    modes), so that the recompute casts as the forward did.
    """
    cls = _autocast_mode.autocast
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__

    def new_init(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        # "meta": activation checkpointing re-enters autocast for the device its tensors are on.
        if device_type in EMULATED:
            self.device = "cuda"
            self.fast_dtype = dtype or torch.float16
            self._enabled = enabled
            self._cache_enabled = cache_enabled
            self._oomkit_emulated = True
            return
        init(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def new_enter(self: Any) -> Any:
        if getattr(self, "_oomkit_emulated", False):
            autocast.enter(self._enabled, self.fast_dtype)
            self._oomkit_pushed = False
            if functions is not None and functions not in _get_current_function_mode_stack():
                functions.__enter__()
                self._oomkit_pushed = True
            return self
        return enter(self)

    def new_exit(self: Any, *exc: Any) -> Any:
        if getattr(self, "_oomkit_emulated", False):
            if functions is not None and getattr(self, "_oomkit_pushed", False):
                functions.__exit__(None, None, None)
            autocast.exit()
            return False
        return exit_(self, *exc)

    # torch.utils.checkpoint records the autocast state of the device its
    # tensors are on when forward runs and restores it for the recompute in
    # backward; for "meta" (and "cuda") that state is the emulated one.
    available, is_enabled, get_dtype = torch.amp.is_autocast_available, torch.is_autocast_enabled, torch.get_autocast_dtype

    def new_available(device_type: str) -> bool:
        return device_type in EMULATED or available(device_type)

    def new_is_enabled(*args: Any) -> bool:
        if args and args[0] in EMULATED:
            return autocast.dtype() is not None
        return bool(is_enabled(*args))

    def new_get_dtype(device_type: str) -> torch.dtype:
        if device_type in EMULATED:
            return autocast.dtype() or torch.float16
        return get_dtype(device_type)

    return [
        (cls, "__init__", new_init),
        (cls, "__enter__", new_enter),
        (cls, "__exit__", new_exit),
        (torch.amp, "is_autocast_available", new_available),
        (torch, "is_autocast_enabled", new_is_enabled),
        (torch, "get_autocast_dtype", new_get_dtype),
    ]
