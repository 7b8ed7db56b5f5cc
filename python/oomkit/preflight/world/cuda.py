"""What a step does differently on CUDA than on ``meta`` tensors, put back.

A ``TorchFunctionMode`` sits above autograd, so what it changes is what
autograd records and saves for backward, as on the GPU:

- ``cuda`` devices become ``meta`` (``.cuda()``, ``.to("cuda")``,
  ``device="cuda"``), so a step written for a GPU runs as written;
- ``torch.autocast("cuda", ...)`` is done here, each call cast as
  PyTorch's own CUDA autocast says it would (``autocast``), since PyTorch
  applies autocast only to tensors of a device that has it, which
  ``meta`` does not;
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
import torch.utils._device as _default_device
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from oomkit import _native
from oomkit.preflight.record.host import HostMemory, host_zeros
from oomkit.preflight.record.placement import ASKED_GPU, ASKED_HOST, ASKED_META, Placement
from oomkit.preflight.record.recorder import FAKE_DEVICE
from oomkit.preflight.record.values import tensors_in
from oomkit.preflight.world.autocast import UNTOUCHED, Autocast
from oomkit.preflight.world.memory import MemoryQueries, rng_answers

#: cuBLAS's workspace per handle, allocated through the caching allocator
#: at the first matrix multiply on a stream (``getChosenWorkspaceSize`` in
#: ``aten/src/ATen/cuda/CublasHandlePool.cpp``, after the sizes the cuBLAS
#: documentation recommends for ``cublasSetWorkspace``): 32 MiB from
#: Hopper (compute capability 9) on, 4096 KiB x 2 + 16 KiB x 8 before.
CUBLAS_WORKSPACE_HOPPER = 32 << 20
CUBLAS_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8

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


def record_stream_stand_in() -> list[tuple[Any, str, Any]]:
    """``Tensor.record_stream`` that does nothing for a tensor without data, as (owner, name, value).

    A buffer used on a side stream is recorded on it so that the allocator
    keeps it until that stream is done (FSDP's mixed precision frees its
    low-precision shards so); with one stream there is nothing to keep, and
    the stream given is one of ``stream_stand_ins``, which PyTorch's own
    method refuses ("unknown parameter type").
    """
    record = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type in ("cuda", FAKE_DEVICE) and isinstance(stream, _Stream):
            return None
        return record(self, stream)

    return [(torch.Tensor, "record_stream", record_stream)]


#: Compute capability reported for the GPU: Hopper, unless the capacity names an older GPU.
HOPPER = (9, 0)
AMPERE = (8, 0)
#: The first capability with float8 matrix multiplies (Ada); ``torch._scaled_mm`` refuses any before it.
FLOAT8_GEMM = (8, 9)
#: What CUDA's ``torch._scaled_mm`` says on a GPU before ``FLOAT8_GEMM`` (``aten/src/ATen/native/cuda/Blas.cpp``).
SCALED_MM_REFUSED = "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+"


def refused_kernels(capacity: str | None) -> dict[str, str]:
    """The operators the GPU a capacity names cannot run, by name, each with CUDA's message: float8
    training's matrix multiply (torchao's ``Float8Linear``) before Ada stops there, as on that GPU."""
    return {"_scaled_mm": SCALED_MM_REFUSED} if capability(capacity) < FLOAT8_GEMM else {}


def refusing_stand_ins(refused: dict[str, str]) -> list[tuple[Any, str, Any]]:
    """``torch.<name>`` for each refused operator, raising CUDA's error, for the ledger. A tensor
    subclass (torchao's float8 tensors) calls ``torch._scaled_mm`` from its own dispatch, below
    the recorder, which sees only the ``mm`` it was asked for."""

    def refusing(message: str) -> Any:
        def refuse(*_: Any, **__: Any) -> Any:
            raise RuntimeError(message)

        return refuse

    return [(torch, name, refusing(message)) for name, message in refused.items() if hasattr(torch, name)]


class _DeviceContext:
    """``torch.cuda.device(i)`` and ``device_of(t)``: the one GPU is current already."""

    def __init__(self, *_: Any) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def capability(capacity: str | None) -> tuple[int, int]:
    """The compute capability of the GPU a capacity names (oomkit's table of GPUs), Hopper's for a size."""
    found = _native.gpu_capability(capacity) if capacity else None
    return found if found is not None else HOPPER


def device_answers(capacity: str, capacity_bytes: int, rec: Any, memory: MemoryQueries, count: Callable[[], int]) -> dict[str, Any]:
    """What ``torch.cuda`` answers under preflight: one GPU of the capacity, whose memory is the recorder's (through ``memory``).

    The machine has ``count()`` of them (``--gpus``), as a script that chooses its
    devices counts them (Lightning's ``devices=4``, ``mp.spawn(nprocs=device_count())``);
    the script runs as rank 0 on the first, the one measured.
    """
    major, minor = capability(capacity)

    def properties(*_: Any, **__: Any) -> Any:
        return types.SimpleNamespace(
            name=f"oomkit preflight ({capacity})", total_memory=capacity_bytes, major=major, minor=minor, multi_processor_count=132
        )

    def nothing() -> Any:
        # A new function each time: torch._dynamo refuses one object under two names.
        return lambda *_, **__: None

    return {
        "is_available": lambda: True,
        "device_count": count,
        "current_device": lambda: 0,
        "set_device": nothing(),
        "synchronize": nothing(),
        "manual_seed": nothing(),
        "manual_seed_all": nothing(),
        "empty_cache": rec.empty_cache,
        "device": _DeviceContext,
        "device_of": _DeviceContext,
        # bfloat16 from Ampere on (a V100 or a T4 has none), as a script choosing its precision asks.
        "is_bf16_supported": lambda *a, **k: major >= AMPERE[0],
        # torch.compile's tracer asks, as the optimizers do: no CUDA graph is being captured.
        "is_current_stream_capturing": lambda: False,
        "get_device_name": lambda *a, **k: f"oomkit preflight ({capacity})",
        "get_device_capability": lambda *a, **k: (major, minor),
        "get_device_properties": properties,
        **memory.cuda_answers(),
        **rng_answers(),
        **stream_stand_ins(),
    }


def accelerator_answers(rec: Any, memory: MemoryQueries, count: Callable[[], int]) -> dict[str, Any]:
    """What ``torch.accelerator`` (PyTorch's device-agnostic API) answers under preflight: CUDA, ``count()`` GPUs, as ``torch.cuda`` does.

    Without these a PyTorch built for the CPU has no accelerator at all, and
    a script written for ``torch.accelerator`` would train on the CPU.
    """
    queries = memory.cuda_answers()
    streams = stream_stand_ins()
    return {
        "current_accelerator": lambda *_, **__: torch.device("cuda"),
        "is_available": lambda: True,
        "device_count": count,
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
    """The cuBLAS workspace for the GPU a capacity names: Hopper's and later's, or the older one's."""
    return CUBLAS_WORKSPACE_HOPPER if capability(capacity) >= HOPPER else CUBLAS_WORKSPACE_OLDER


def gpu_index(device: Any) -> int | None:
    """The index of the CUDA device ``device`` names (a device, a name, an index; the first where
    it names none), or None where it names no CUDA device."""
    if isinstance(device, torch.device):
        return (device.index or 0) if device.type == "cuda" else None
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        index = device.partition(":")[2]
        return int(index) if index.isdigit() else 0
    return None


def is_cuda(device: Any) -> bool:
    """Whether ``device`` (a device, a name, an index) is a CUDA device."""
    return gpu_index(device) is not None


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

#: ``Tensor`` methods that share a tensor's storage between processes, or ask whether it is.
_SHARED = frozenset({"share_memory_", "is_shared"})


def _dtype_asked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The type ``Tensor.to``'s arguments (after the tensor) convert to, if they name one."""
    return next((a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)


def _is_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to``'s arguments name the CPU."""
    return any(_names_cpu(a) for a in (*args, kwargs.get("device")))


def _names_cpu(device: Any) -> bool:
    """Whether ``device`` (a device or its name) is the CPU."""
    return (isinstance(device, torch.device) and device.type == "cpu") or (isinstance(device, str) and device.split(":")[0] == "cpu")


def _cuda_by_default() -> bool:
    """Whether ``torch.set_default_device`` or ``with torch.device(...)`` made CUDA the default device."""
    return is_cuda(getattr(_default_device, "CURRENT_DEVICE", None))


def _made_on_host_and_moved(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``torch.tensor(data, device="cuda")``, made on the host and moved, as its data is there
    already: made on meta, it would hold none, and a counter a script tests (an averaged model's
    ``n_averaged == 0``) would read as zero whatever it was made with."""
    device = kwargs.pop("device")
    requires_grad = bool(kwargs.pop("requires_grad", False))
    moved = func(*args, device="cpu", **kwargs).to(device)
    # (Asked for gradients on the host, the move would be no leaf.)
    return moved.requires_grad_() if requires_grad else moved


#: PyTorch's own random generator class, which ``torch.Generator`` names outside preflight.
_GENERATOR = torch.Generator


class _GeneratorClass(type):
    """``torch.Generator`` as the script sees it: a CUDA generator (``torch.Generator("cuda")``,
    diffusers' seeded pipelines, timm's EMA) is a host one, whose draws tensors without data
    take as CUDA's would, since a real one would start CUDA; every generator is still one."""

    def __call__(cls, device: Any = "cpu") -> Any:
        return _GENERATOR("cpu" if is_cuda(device) else device)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _GENERATOR)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _GENERATOR)


class CudaGenerator(metaclass=_GeneratorClass):
    """What ``torch.Generator`` names under preflight (``_GeneratorClass``)."""


def _to_meta(value: Any) -> Any:
    return FAKE_DEVICE if is_cuda(value) else value


def _cpu_as_meta(value: Any) -> Any:
    """``Tensor.to``'s argument with the CPU named as ``meta``, where the host's tensors without data are."""
    return FAKE_DEVICE if _names_cpu(value) else value


def _names_meta(device: Any) -> bool:
    """Whether ``device`` (a device or its name) is ``meta``, named by the script itself."""
    if isinstance(device, torch.device):
        return device.type == FAKE_DEVICE
    return isinstance(device, str) and device.split(":")[0] == FAKE_DEVICE


#: The GPU a tensor on the fake GPU says it is on, as a CUDA tensor on the first GPU says.
GPU = torch.device("cuda", 0)

#: The type of a property's getter as the function mode receives it (a tensor's ``device``).
_GETTER = type(torch.Tensor.device.__get__)

#: What a tensor on the fake GPU answers to the questions a script asks of where it lives
#: (each property's descriptor, read through the mode as its ``__get__``), as on the GPU.
_WHERE: dict[Any, Any] = {torch.Tensor.device: GPU, torch.Tensor.is_cuda: True, torch.Tensor.is_meta: False}

#: What a tensor standing for the host's (a module's weight made without a device, not yet
#: moved) answers to the same questions: as on the CPU, where it would be.
_ON_HOST: dict[Any, Any] = {
    torch.Tensor.device: torch.device("cpu"),
    torch.Tensor.is_cuda: False,
    torch.Tensor.is_meta: False,
    torch.Tensor.is_cpu: True,
}


#: A tensor's ``data`` attribute, whose setter swaps a tensor's contents in place.
_DATA = torch.Tensor.data


def _host_to_gpu(args: tuple[Any, ...]) -> bool:
    """Whether ``args`` of ``data``'s setter are a host tensor and a tensor on the fake GPU."""
    return (
        len(args) == 2
        and isinstance(args[0], torch.Tensor)
        and isinstance(args[1], torch.Tensor)
        and args[0].device.type == "cpu"
        and args[1].device.type == FAKE_DEVICE
    )


def _set_data_onto_gpu(t: torch.Tensor, value: torch.Tensor) -> bool:
    """``t.data = value`` where ``t`` is on the host and ``value`` on the fake GPU, done as CUDA does
    it: ``t`` keeps its object, class and attributes and holds ``value``'s storage. A host tensor and
    a ``meta`` one are not of one kind (``set_data`` refuses them), so their contents are swapped.
    False where PyTorch will not swap ``t`` (a weak reference to it): the setter then says why."""
    moved = torch.Tensor._make_subclass(type(t), value.detach(), t.requires_grad)
    moved.__dict__.update(t.__dict__)
    try:
        torch.utils.swap_tensors(t, moved)
    except RuntimeError:
        return False
    return True


def _asked(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Where the call puts what it makes, where it says: the GPU, the script's meta, or None (where its inputs are)."""
    device = kwargs.get("device")
    if device is not None:
        return ASKED_GPU if is_cuda(device) else ASKED_META if _names_meta(device) else None
    if name == "cuda":
        return ASKED_GPU
    if name == "to":
        for a in args[1:]:
            if is_cuda(a):
                return ASKED_GPU
            if _names_meta(a):
                return ASKED_META
    # A factory given no device makes its tensor on the fake GPU (CUDA the default device, a module
    # built on meta) or on the CPU; an operation on tensors, where they are: decided by its inputs.
    return None


#: ``Tensor.get_device``, as the function mode receives it: a fake GPU tensor's is 0.
_GET_DEVICE = torch.Tensor.get_device

#: ``Tensor.data_ptr``, as the function mode receives it: a fake GPU tensor's is an address of its own.
_DATA_PTR = torch.Tensor.data_ptr

#: The alignment of the addresses given to storages without data: the CUDA caching
#: allocator's block size, which kernels' alignment checks (16 bytes and more) pass.
ADDRESS_ALIGNMENT_BITS = 9

#: ``UntypedStorage.data_ptr`` as PyTorch has it (a meta storage's is 0).
_STORAGE_DATA_PTR = torch.UntypedStorage.data_ptr


def _address(st: Any) -> int:
    """The address a storage without data is given: its own while it lives, shared by its views, never 0.

    On a GPU every storage has its own address, and code tells shared
    weights apart by it (transformers' tied weights check before saving,
    safetensors' shared tensors, a tracker's count of unique storages); a
    ``meta`` storage's is 0, so every tensor would look like one. The
    storage's C++ object is unique while it lives, as an address is.
    """
    return int(st._cdata) << ADDRESS_ALIGNMENT_BITS


def _given_address(st: Any, placement: Placement) -> int | None:
    """The address ``st`` is given, if it is a storage without data of the fake GPU's or the host's
    that holds bytes; None for any other (the script's own meta storages keep PyTorch's 0)."""
    if st.device.type != FAKE_DEVICE or st.nbytes() == 0 or placement.holds_script_meta(st):
        return None
    return _address(st)


def storage_address_stand_in(placement: Placement) -> list[tuple[Any, str, Any]]:
    """``UntypedStorage.data_ptr`` giving the fake GPU's and the host's storages without data an
    address each, as (owner, name, value)."""

    def data_ptr(self: Any) -> int:
        given = _given_address(self, placement)
        return int(_STORAGE_DATA_PTR(self)) if given is None else given

    return [(torch.UntypedStorage, "data_ptr", data_ptr)]

#: Calls that CUDA does as ``meta`` does: they ask a tensor about itself, or set a flag, and
#: make nothing a device, autocast or a read back could change. Most calls that reach the
#: mode are these (PyTorch's own Python reads ``untyped_storage()``, ``dim()``, ``size()``
#: of every tensor it handles), so they skip its handling.
_AS_ON_META = frozenset(
    {
        torch.Tensor.untyped_storage,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.size,
        torch.Tensor.stride,
        torch.Tensor.storage_offset,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.is_contiguous,
        torch.Tensor.requires_grad_,
        torch.Tensor.detach,
        torch.Tensor.detach_,
        torch._C._set_grad_enabled,
        torch._has_compatible_shallow_copy_type,
    }
)


class CudaFunctions(TorchFunctionMode):
    """Maps ``cuda`` to ``meta``, and does autocast and attention as CUDA does."""

    def __init__(
        self,
        autocast: Autocast,
        on_upload: Callable[[torch.Tensor], None] | None = None,
        read_back: Callable[[torch.Tensor, str], torch.Tensor] | None = None,
        host: HostMemory | None = None,
        placement: Placement | None = None,
    ) -> None:
        super().__init__()
        #: Which tensors without data are the fake GPU's (told ``cuda:0``) and which the script's own meta ones.
        self.placement = placement or Placement()
        #: Counts the host memory the script holds for the GPU: pinned, and copies from it.
        self.host = host or HostMemory()
        self.autocast = autocast
        #: Told of every copy from the host to the device: the batch, as the loop uploads it.
        self.on_upload = on_upload
        #: Gives a device tensor's values on the host (``Recorder.read_back``): known where the
        #: step made them, else zeros, noted; without it, zeros.
        self.read_back = read_back
        #: Told when a backward pass (``Tensor.backward``, ``torch.autograd.backward``) has run.
        self.on_backward: Callable[[], None] | None = None
        #: Given the frame a backward pass runs below, for the block it runs in: the frames out
        #: of it do not change meanwhile (``Recorder.frames_fixed``).
        self.frames_fixed: Callable[[Any], contextlib.AbstractContextManager[None]] | None = None
        #: Make the tensors a module's constructor makes without a device on meta.
        self.build_on_meta = False
        #: Composites run with their check for a mode skipped, made once each (``_opened``).
        self._opened: dict[Any, FunctionType] = {}
        #: The CUDA devices the script has put tensors on, by index: all of them stand on one fake GPU.
        self.gpu_indices: set[int] = set()

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if type(func) is _GETTER:
            owner = getattr(func, "__self__", None)
            if owner in _ON_HOST:
                # Where a tensor lives: the fake GPU's say cuda:0, as on the GPU (torchtune's RoPE,
                # Fabric, FlexAttention and DataParallel check), the host's cpu, the script's own meta ones meta.
                if self._told(args[0]):
                    return _WHERE.get(owner, False)
                return _ON_HOST[owner] if self.placement.on_host(args[0]) else func(*args)
            if owner is _DATA and func.__name__ == "__set__" and _host_to_gpu(args) and _set_data_onto_gpu(args[0], args[1]):
                # ``t.data = gpu_tensor`` of a host tensor (bitsandbytes' 4-bit weights quantize so as they
                # move): on CUDA host and GPU tensors are of one kind and ``t`` becomes a GPU tensor in place.
                return None
            # Any other attribute read or set (``shape``, ``grad``, ``data``) is the same on CUDA.
            return func(*args)
        if func in _AS_ON_META:
            return func(*args, **(kwargs or {}))
        if func is _GET_DEVICE:
            return 0 if self._told(args[0]) else -1 if self.placement.on_host(args[0]) else func(*args)
        if func is _DATA_PTR:
            t = args[0]
            if self.placement.telling and isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) and t.numel():
                given = _given_address(t.untyped_storage(), self.placement)
                if given is not None:
                    # As on the GPU: the storage's address, past the tensor's offset into it.
                    return given + t.storage_offset() * t.element_size()
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        asked = _asked(name, args, kwargs)
        if asked is None and name == "to" and any(self.placement.on_gpu(a) for a in args[1:]):
            # ``t.to(other)``: where ``other`` is, the GPU.
            asked = ASKED_GPU
        if asked == ASKED_META and self.placement.compiled:
            # A compiled graph's own buffers, on the device its trace read: the GPU's.
            asked = None
        if asked is None:
            return self._call(func, name, args, kwargs)
        if asked == ASKED_GPU:
            self._named_gpu(name, args, kwargs)
        placement = self.placement
        before, placement.asked = placement.asked, asked
        try:
            out = self._call(func, name, args, kwargs)
            if asked == ASKED_META and name == "to" and out is args[0] and (placement.on_gpu(out) or placement.on_host(out)):
                # A GPU tensor sent to meta is a new tensor there, and the GPU's memory goes when it does;
                # so is the host's (accelerate's init_empty_weights sends each new weight there).
                out = out.clone()
            elif asked == ASKED_GPU and isinstance(out, torch.Tensor) and placement.on_host(out):
                # The host's tensor put on the GPU another way (``torch.as_tensor(t, device="cuda")``).
                out = self._moved_to_gpu(out)
        finally:
            placement.asked = before
        return out

    def _named_gpu(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Notes which GPU a call that puts its result on one names (``device=``, ``.to``, ``.cuda``)."""
        named = (kwargs.get("device"), *(args[1:] if name in ("to", "cuda") else ()))
        index = next((i for i in map(gpu_index, named) if i is not None), 0)
        self.gpu_indices.add(index)

    def _told(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is told it is on the GPU: it is on the fake GPU, and no tracer is reading it as it is."""
        placement = self.placement
        return placement.telling and placement.on_gpu(t)

    def _moved_to_gpu(self, t: torch.Tensor) -> torch.Tensor:
        """A copy on the fake GPU of ``t``, the host's: a new storage, said to be made where ``t`` was
        made if a module's constructor made it (the layer holding the weight)."""
        placement = self.placement
        before = placement.asked, placement.moving_from
        placement.asked, placement.moving_from = ASKED_GPU, placement.born_at(t)
        try:
            return t.clone()
        finally:
            placement.asked, placement.moving_from = before

    def _call(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call, done as on CUDA."""
        if name in ("cpu", "to") and self.placement.on_host(args[0]) and (name == "cpu" or _is_cpu(args[1:], kwargs)):
            # The host's tensor is on the host already: itself, or (``.to("cpu", dtype)``) converted there.
            if name == "cpu":
                return args[0]
            return func(*(_cpu_as_meta(a) for a in args), **{k: _cpu_as_meta(v) for k, v in kwargs.items()})
        reads_back = name in _READ_BACK and isinstance(args[0], torch.Tensor) and args[0].device.type == FAKE_DEVICE
        source = args[0] if reads_back else None
        if (
            reads_back
            and is_traceable_wrapper_subclass(source)
            and (name == "cpu" or (name == "to" and _is_cpu(args[1:], kwargs) and _dtype_asked(args[1:], kwargs) in (None, args[0].dtype)))
        ):
            # A sharded tensor's copy on the host (torchtune's CPU offload moves each DTensor there as it
            # loads it): of the same kind, each tensor it wraps read back as a plain one is.
            return self._copied_to_host(source)
        if reads_back and (name != "to" or _is_cpu(args[1:], kwargs)):
            # Values read back to the host (a loss logged, a metric, a
            # generation's tokens): those the step made known, else zeros,
            # as the scalars read with item() are.
            host = self._host(args[0], f"Tensor.{name}()")
            if name == "to":
                # ``t.to("cpu", torch.uint8)`` (an image saved from the GPU): the copy is of the type asked.
                host = self._converted(host, _dtype_asked(args[1:], kwargs))
            if name in ("cpu", "to"):
                # A copy kept on the host (an offload): host memory, without data until read.
                self.host.hold(host, pinned=False)
                return host
            return getattr(host, name)()
        if name == "__format__" and isinstance(args[0], torch.Tensor) and args[0].device.type == FAKE_DEVICE and args[0].dim() == 0:
            # f"{loss:.4f}", f"{grad_norm:.2f}": on a GPU a 0-d tensor formats as its value
            # (``Tensor.__format__`` reads it with ``item()``), known where the step made it, else 0, noted.
            return format(self._host(args[0], "format(tensor)").item(), args[1] if len(args) > 1 else "")
        if name == "_parse_to":
            # ``Tensor.to`` overrides written in Python (bitsandbytes' 4-bit
            # parameters quantize when moved to the GPU) must see the device
            # asked for; the tensor operations they then call are mapped.
            return func(*args, **kwargs)
        if name == "pin_memory":
            # Page-locked host memory needs a GPU; the copy it speeds up is the same. It is
            # counted as the pinned copy it would be (the tensor itself stands for it).
            self.host.hold(args[0], pinned=True)
            return args[0]
        if name == "multinomial" and self.host.is_taken_as_zero(args[0]):
            # Sampling from weights read back without data (a generator's word weights):
            # zeros are no distribution, so they are sampled as a uniform one, as weights are.
            args = (torch.ones_like(args[0]), *args[1:])
        if name == "is_pinned" and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            return self.host.pinned(args[0])
        if name in _SHARED and isinstance(args[0], torch.Tensor) and self.placement.on_gpu(args[0]):
            # ``model.share_memory()`` before training in processes of its own (Hogwild): a CUDA
            # tensor is shared between processes as it is, so sharing it is nothing, and it is shared.
            return args[0] if name == "share_memory_" else True
        if kwargs.get("pin_memory"):
            # A factory's pinned buffer (a data loader's, a script's own): plain host memory here,
            # counted as pinned. Answered here and not only by the recorder, which answers one
            # asked below Python's functions: ``torch.tensor(..., pin_memory=True)`` pins where
            # no dispatch mode sees it.
            kwargs["pin_memory"] = False
            out = func(*args, **kwargs)
            self.host.hold(out, pinned=True)
            return out
        if name == "cuda" or (name == "to" and any(is_cuda(a) for a in (*args[1:], kwargs.get("device")))):
            source = args[0]
            if name == "cuda":
                moved = source.to(FAKE_DEVICE)
            else:
                moved = func(*(_to_meta(a) for a in args), **{k: _to_meta(v) for k, v in kwargs.items()})
            uploaded = isinstance(source, torch.Tensor) and source.device.type == "cpu" and isinstance(moved, torch.Tensor)
            if isinstance(moved, torch.Tensor) and self.placement.on_host(moved):
                # The host's tensor (``to`` of a tensor on the device it is on returns it): its copy,
                # an upload of data where it is no module's weight (features computed on the host).
                uploaded = self.placement.born_at(moved) is None and not isinstance(moved, torch.nn.Parameter)
                moved = self._moved_to_gpu(moved)
            if self.on_upload is not None and uploaded:
                self.on_upload(moved)
            return moved
        named_gpu = is_cuda(kwargs.get("device"))
        if kwargs.get("device") is None and func in _default_device._device_constructors() and _cuda_by_default():
            # torch.set_default_device("cuda") (or `with torch.device("cuda")`)
            # puts its mode below this one, where it would add a real CUDA device.
            kwargs["device"] = FAKE_DEVICE
            named_gpu = True
        device = kwargs.get("device")
        if self.build_on_meta and name in _FACTORIES and name != "tensor" and (device is None or _names_cpu(device)) and _building_module():
            # A module's weights made without a device would be made on the CPU and moved; on
            # meta they are never allocated at all, and stand for the host's until they are moved.
            # So are those made on the CPU by name: a rotary table's positions made where its
            # frequencies are (``torch.arange(end, device=freqs.device)``) meet them there.
            # (``torch.tensor(data)``, data the module holds, is made on the host as it is.)
            kwargs["device"] = FAKE_DEVICE
            placement = self.placement
            before, placement.asked = placement.asked, ASKED_HOST
            try:
                return self._call(func, name, args, kwargs)
            finally:
                placement.asked = before
        if device is not None:
            kwargs["device"] = _to_meta(device)
        if name == "tensor" and named_gpu and args and next(tensors_in(args[0]), None) is None:
            # (Data holding tensors, a list of 0-d ones as torchtune's rotary scaling builds, has no
            # values on the host: it is made on the fake GPU as it is.)
            return _made_on_host_and_moved(func, args, kwargs)
        if name == "to":
            args = tuple(_to_meta(a) for a in args)
        policy = UNTOUCHED
        if self.autocast.casts_now():
            # As CUDA's autocast would, above autograd: what it casts, PyTorch says (``autocast``).
            policy = self.autocast.policy(func, args, kwargs)
            args, kwargs = self.autocast.apply(policy, args, kwargs)
        if name == "scaled_dot_product_attention":
            routed = _cuda_attention(*args, **kwargs)
            if routed is not None:
                return routed
        if name in OPENED and isinstance(func, FunctionType):
            with self:
                return _opened(func, self._opened)(*args, **kwargs)
        if func is torch.autograd.grad:
            # Gradients taken without .backward() (a gradient penalty): what runs in Python meanwhile
            # sees the mode too, as in any backward.
            with self:
                return _opened(cast(FunctionType, func), self._opened)(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # What runs in Python during backward (a checkpoint's recomputed
            # forward, FSDP's hooks gathering parameters, a custom Function's
            # backward) must see the mode, as CUDA's dispatcher sees it.
            fixed = self.frames_fixed(sys._getframe()) if self.frames_fixed is not None else contextlib.nullcontext()
            with self, fixed:
                done = _backward(func, args, kwargs, self._opened)
            if self.on_backward is not None:
                self.on_backward()
            return done
        out = func(*args, **kwargs)
        return self.autocast.outputs(policy, out)

    def _copied_to_host(self, t: Any) -> torch.Tensor:
        """A copy on the host of ``t``, a tensor subclass on the fake GPU (a DTensor): the same kind,
        each tensor it wraps read back as a plain one is (``.cpu()``), what else it holds (its mesh) kept."""
        names, context = t.__tensor_flatten__()
        inner = {}
        for name in names:
            value = getattr(t, name)
            if isinstance(value, torch.Tensor):
                value = self._host(value, "Tensor.cpu()")
                self.host.hold(value, pinned=False)
            inner[name] = value
        out: torch.Tensor = type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())
        return out

    def _converted(self, host: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """``host``, values read back, as ``dtype``: zeros stay zeros, and a large copy stays unread."""
        if dtype is None or dtype == host.dtype:
            return host
        if not self.host.is_taken_as_zero(host):
            # Values the step made known: few, so converted as they are.
            return host.to(dtype)
        return self.host.taken_as_zero(host_zeros(host.shape, dtype))

    def _host(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t``'s values on the host, as the script reads them (``what``): ``read_back``'s, else zeros."""
        if self.read_back is not None:
            return self.read_back(t, what)
        return host_zeros(t.shape, t.dtype)


def saved_tensor_hooks_in_mode(functions: CudaFunctions) -> list[tuple[Any, str, Any]]:
    """Saved-tensor hooks run with the function mode on, as (owner, name, value) for the fake GPU's ledger.

    Autograd packs a tensor inside the operation that saves it, where the
    mode is off while it handles the call, and unpacks it in backward, where
    it is on. On a GPU both see the tensor on cuda: checkpointing compares
    what each saw, and ``save_on_cpu`` copies back to the device it saw.
    """
    from torch.autograd.graph import saved_tensors_hooks

    depth, at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at

    def in_mode(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            # Looked for on the stack of modes by index (a few C calls: a checkpointed step packs
            # every tensor it saves, and PyTorch's own walk of the stack builds a list each time).
            if any(at(i) is functions for i in range(depth())):
                return hook(x)
            with functions:
                return hook(x)

        return run

    init = saved_tensors_hooks.__init__

    def new_init(self: Any, pack_hook: Callable[[Any], Any], unpack_hook: Callable[[Any], Any]) -> None:
        init(self, in_mode(pack_hook), in_mode(unpack_hook))

    return [(saved_tensors_hooks, "__init__", new_init)]


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
    if key.shape[1] != query.shape[1] and not _grouped(query, key, value, enable_gqa):
        # Heads that do not group: refused by every kernel, as on CUDA (the math path says why).
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


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> bool:
    """Whether keys and values shared by groups of query heads (grouped-query attention: Llama 3,
    Mistral, Qwen) go to flash or memory-efficient attention as they are: asked with
    ``enable_gqa``, as many key heads as value heads, and query heads a multiple of them
    (``check_batch_size_and_num_heads_dense`` with grouped-query support, which both kernels
    have on CUDA); neither repeats the keys, and neither holds the attention matrix."""
    return enable_gqa and key.shape[1] == value.shape[1] and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0


def wrapper_subclass_stand_in() -> list[tuple[Any, str, Any]]:
    """``Tensor._make_wrapper_subclass`` that makes a wrapper asked for on CUDA on the fake GPU, for
    the ledger. A quantized weight (torchao's ``NF4Tensor``) takes its device from the tensor it
    wraps, which says CUDA; a wrapper made on CUDA sends every operation on it through CUDA's
    device guard, which needs a driver, before any mode can see it ("CUDA driver version is
    insufficient" as a checkpoint is copied in). On ``meta`` it is the fake GPU's, as DTensor's are."""
    make = torch.Tensor._make_wrapper_subclass

    def on_fake_gpu(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if is_cuda(kwargs.get("device")):
            kwargs["device"] = FAKE_DEVICE
        return make(cls, *args, **kwargs)

    return [(torch.Tensor, "_make_wrapper_subclass", staticmethod(on_fake_gpu))]


def moved_in_place_stand_in(moved: Callable[[list[torch.Tensor]], None] | None = None) -> list[tuple[Any, str, Any]]:
    """``nn.Module._apply`` that keeps each parameter's object as a module moves from the host to
    the fake GPU, for the ledger. On CUDA, ``model.cuda()`` changes a host parameter in place
    (``param.data = ...``: host and CUDA tensors are of one kind), so tied weights stay one
    parameter and an optimizer made before the move still holds the model's parameters. A host
    tensor and a ``meta`` one are not of one kind, so ``_apply`` makes a new parameter for each
    module that holds it: a loaded model's tied embedding became two, each with its gradient
    and optimizer state. The new parameter's contents are swapped into the old object instead.
    ``moved`` is told each module's own parameters and buffers once moved: they are weights,
    whether or not that module's forward ever runs (a VAE's decoder in a training step)."""
    apply = torch.nn.Module._apply

    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> Any:
        own = dict(self._parameters)
        out = apply(self, fn, recurse)
        if torch.__future__.get_overwrite_module_params_on_conversion():
            return out  # New parameters are what the script asked for.
        for key, old in own.items():
            new = self._parameters.get(key)
            if old is None or new is None or new is old or type(new) is not type(old):
                continue
            try:
                torch.utils.swap_tensors(old, new)
            except RuntimeError:
                continue  # A tensor PyTorch will not swap keeps the new object, as before.
            self._parameters[key] = old
        if moved is not None:
            moved([t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None])
        return out

    return [(torch.nn.Module, "_apply", _apply)]


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
