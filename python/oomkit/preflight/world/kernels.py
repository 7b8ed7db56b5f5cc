"""Which kernels compute a ``meta`` tensor's shape: PyTorch's C++ ones, where it has them.

Every operation of a preflight runs on ``meta`` tensors, so what it costs
is the meta kernel's. PyTorch registers a Python meta kernel (its
reference implementations in ``torch._refs``, through
``torch._meta_registrations``) over the C++ one for more than six
hundred operators that have both, ``add``, ``mul`` and ``cat`` among
them: the Python ones exist for symbolic sizes, which a preflight's
tensors do not have (the tracer of a ``torch.compile`` capture, which
has them, uses PyTorch's Python dispatcher and reads the Python kernels
from the operator itself, untouched here). The C++ kernels are the ones a
CUDA tensor's operation runs to size its output, and about a hundred times
faster: a 7B model's generation spent a third of its time in the Python
ones.

While a preflight runs, the library holding those registrations is
emptied, which makes the C++ kernels current again, and the Python
kernels of operators without a C++ one are registered again at once; on
exit the library is made again as it was, kernel for kernel. Where this
PyTorch's library has another shape, nothing is changed (the Python
kernels are only slower).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

#: The dispatch key of the kernels swapped.
META = "Meta"


class NativeMetaKernels:
    """The C++ meta kernels current while entered; ``remove()`` puts PyTorch's Python ones back."""

    def __init__(self) -> None:
        #: The library PyTorch registered its Python meta kernels in, or None where it has none.
        self.library: Any = None
        #: Each operator's name and its Python meta kernel, as registered when entered.
        self.kernels: list[tuple[str, Any]] = []
        #: The registrations made while entered: the Python kernels of operators without a C++ one.
        self.kept: Any = None

    def install(self) -> NativeMetaKernels:
        """Makes the C++ meta kernels current (a no-op where PyTorch's library is not as expected)."""
        library = _python_meta_library()
        if library is None:
            return self
        kernels = _registered(library)
        if kernels is None:
            return self
        self.library, self.kernels = library, kernels
        library.m.reset()
        self.kept = _new_library(__file__)
        library.m = self.kept
        for name, fn in kernels:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, META):
                self.kept.impl(name, META, SIZES_ONLY.get(name, fn), False)
        for name, fn in CUDA_ONLY.items():
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, META):
                self.kept.impl(name, META, fn, False)
        return self

    def remove(self) -> None:
        """Registers PyTorch's Python meta kernels again, each as it was."""
        library, self.library = self.library, None
        if library is None:
            return
        # PyTorch registers into this library only when torch._meta_registrations is
        # imported, so the kernels taken at install are all it held.
        library.m.reset()
        # Named as PyTorch's own registrations are, by the file that makes them.
        restored = _new_library(getattr(sys.modules.get("torch._meta_registrations"), "__file__", __file__))
        for name, fn in self.kernels:
            restored.impl(name, META, fn, False)
        library.m = restored
        self.kept = None


def _batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_batch_norm``'s outputs as CUDA's kernel makes them: the output like the input,
    and the mean and inverse deviation per channel in the accumulation type; the running
    statistics are updated in place, taking nothing."""
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    channels = input.shape[1]
    return (
        torch.empty_like(input),
        input.new_empty((channels,), dtype=acc),
        input.new_empty((channels,), dtype=acc),
    )


def _batch_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``native_batch_norm_backward``'s gradients, those asked for: the input's, like it, and
    the weight's and bias's, one per channel."""
    dtype = weight.dtype if weight is not None else input.dtype
    return (
        torch.empty_like(input) if output_mask[0] else None,
        input.new_empty((input.shape[1],), dtype=dtype) if output_mask[1] else None,
        input.new_empty((input.shape[1],), dtype=dtype) if output_mask[2] else None,
    )


def _accumulated(dtype: torch.dtype) -> torch.dtype:
    """The type CUDA's batch norm kernels keep statistics in (``at::toAccumulateType`` on CUDA)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sync_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_norm_stats`` (SyncBatchNorm's local statistics): a mean and an inverse
    deviation per channel, in the accumulation type, as CUDA's kernel makes them."""
    channels = input.shape[1]
    acc = _accumulated(input.dtype)
    return input.new_empty((channels,), dtype=acc), input.new_empty((channels,), dtype=acc)


def _sync_gather(
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_norm_gather_stats_with_counts``: every rank's statistics (one row each) made
    one per channel, like the gathered ones; the running statistics updated in place."""
    channels = mean.shape[-1]
    return mean.new_empty((channels,)), mean.new_empty((channels,))


def _sync_elementwise(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor, eps: float
) -> torch.Tensor:
    """``batch_norm_elemt``: the normalised output, like the input."""
    return torch.empty_like(input)


def _sync_backward_reduce(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    input_g: bool,
    weight_g: bool,
    bias_g: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``batch_norm_backward_reduce``: the sums the input's gradient needs, like the mean, and
    the weight's and bias's gradients, one per channel; each only where asked for."""
    channels = input.shape[1]
    dtype = weight.dtype if weight is not None else input.dtype
    return (
        torch.empty_like(mean) if input_g else None,
        torch.empty_like(mean) if input_g else None,
        input.new_empty((channels,), dtype=dtype) if weight_g else None,
        input.new_empty((channels,), dtype=dtype) if bias_g else None,
    )


def _sync_backward_elementwise(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    weight: torch.Tensor | None,
    sum_dy: torch.Tensor,
    sum_dy_xmu: torch.Tensor,
    count: torch.Tensor,
) -> torch.Tensor:
    """``batch_norm_backward_elemt``: the input's gradient, like the input."""
    return torch.empty_like(input)


def _layer_norm(
    input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_layer_norm``'s outputs as CUDA's ``layer_norm_cuda`` makes them: the output
    contiguous like the input, the mean and inverse deviation one per normalized row in the
    accumulation type, shaped to broadcast against the input."""
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    axis = input.dim() - len(normalized_shape)
    stat = [*input.shape[:axis], *([1] * len(normalized_shape))]
    return (
        torch.empty(input.shape, dtype=input.dtype, device=input.device),
        torch.empty(stat, dtype=acc, device=input.device),
        torch.empty(stat, dtype=acc, device=input.device),
    )


def _layer_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    normalized_shape: list[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: list[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``native_layer_norm_backward``'s gradients, those asked for, each contiguous like what it is the gradient of."""

    def like(t: torch.Tensor | None, wanted: bool) -> torch.Tensor | None:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device) if wanted and t is not None else None

    return like(input, output_mask[0]), like(weight, output_mask[1]), like(bias, output_mask[2])


def _convolution(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> torch.Tensor:
    """``convolution``'s output, sized as PyTorch's own kernel sizes it (batch, the weight's
    output channels, each spatial size from the input's, padding, dilation and stride), laid
    out contiguous as it lays it out; a transposed convolution or sizes that are not plain
    (a channel count that does not match, a kernel wider than the padded input) are handed to
    PyTorch's kernel, which says what is wrong."""
    spatial = input.dim() - 2
    plain = not transposed and spatial >= 1 and weight.dim() == input.dim() and weight.shape[1] * groups == input.shape[1]
    strides, pads, dilations = (_per_dim(x, spatial) for x in (stride, padding, dilation))
    if plain and strides is not None and pads is not None and dilations is not None:
        shape = [input.shape[0], weight.shape[0] if input.shape[1] else 0]
        for i in range(spatial):
            padded = input.shape[2 + i] + 2 * pads[i]
            reach = dilations[i] * (weight.shape[2 + i] - 1) + 1
            if padded < reach:
                break
            shape.append((padded - reach) // strides[i] + 1)
        else:
            return input.new_empty(shape)
    return _python_kernel("aten::convolution")(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def _per_dim(values: list[int], spatial: int) -> list[int] | None:
    """A convolution's stride, padding or dilation, one per spatial dimension (one value is
    every dimension's); None where the count matches neither."""
    if len(values) == spatial:
        return list(values)
    return [values[0]] * spatial if len(values) == 1 else None


def _relu(input: torch.Tensor) -> torch.Tensor:
    """``relu``, which ATen computes as ``clamp_min(input, 0)``: that operator's C++ meta kernel."""
    return torch.ops.aten.clamp_min.default(input, 0)


def _isnan(input: torch.Tensor) -> torch.Tensor:
    """``isnan``, which ATen computes as ``input != input``."""
    return torch.ops.aten.ne.Tensor(input, input)


def _masked_fill(input: torch.Tensor, mask: torch.Tensor, value: Any) -> torch.Tensor:
    """``masked_fill``, which ATen computes on a contiguous clone of the input expanded against the mask."""
    shape = torch.broadcast_shapes(mask.shape, input.shape)
    return torch.empty(shape, dtype=input.dtype, device=input.device)


def _like(
    input: torch.Tensor,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor | None:
    """``empty_like``'s allocation where it is plain (a strided tensor on this device, laid out
    densely): the input's strides kept, as ``preserve_format`` keeps them; else None."""
    if layout not in (None, torch.strided) or input.layout != torch.strided or pin_memory:
        return None
    if device is not None and torch.device(device) != input.device:
        return None
    dtype = dtype or input.dtype
    if memory_format is not None and memory_format != torch.preserve_format:
        return torch.empty(input.shape, dtype=dtype, device=input.device, memory_format=memory_format)
    if input.is_contiguous() or (input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last)):
        return torch.empty_strided(input.shape, input.stride(), dtype=dtype, device=input.device)
    return None


def _factory_like(python_kernel: str) -> Any:
    """``empty_like``, ``zeros_like`` and ``ones_like``: only their allocation (the values are
    the shadows' business); PyTorch's own kernel where the allocation is not plain."""

    def kernel(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        made = _like(input, *args, **kwargs)
        return made if made is not None else _python_kernel(python_kernel)(input, *args, **kwargs)

    return kernel


def _fill(input: torch.Tensor, value: Any) -> torch.Tensor:
    """Out-of-place ``fill``: a new tensor like the input (``empty_like`` and ``fill_``)."""
    made = _like(input)
    return made if made is not None else _python_kernel("aten::fill.Scalar")(input, value)


def _mean(input: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mean`` of a whole floating tensor: a 0-d result of its dtype, as ``sum`` makes it."""
    if not (dtype or input.dtype).is_floating_point and not (dtype or input.dtype).is_complex:
        return _python_kernel("aten::mean")(input, dtype=dtype)
    return torch.ops.aten.sum.default(input, dtype=dtype)


def _python_kernel(name: str) -> Any:
    """PyTorch's own Python meta kernel of ``name`` (``"aten::fill.Scalar"``), which PyTorch
    keeps on the operator as well as in the library swapped out: where a sizes-only kernel
    hands a case that is not plain back to it."""
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default").py_kernels[torch._C.DispatchKey.Meta]


#: Operators without a C++ meta kernel whose Python one is a whole decomposition (batch
#: norm's computes the statistics through a dozen reference operations; ``relu`` and
#: ``mul`` by a scalar take a hundred microseconds through the reference implementations),
#: each given a kernel that makes only the outputs' sizes, as CUDA's kernel allocates them,
#: most through the C++ meta kernel of the operator ATen itself computes them with.
SIZES_ONLY: dict[str, Any] = {
    "aten::native_batch_norm": _batch_norm,
    "aten::native_batch_norm_backward": _batch_norm_backward,
    "aten::native_layer_norm": _layer_norm,
    "aten::native_layer_norm_backward": _layer_norm_backward,
    "aten::convolution": _convolution,
    "aten::relu": _relu,
    # A ``.Scalar`` overload as ATen runs it: the ``.Tensor`` overload, given the scalar, which
    # the dispatcher wraps as a number (promoting types as a Python number does).
    "aten::add.Scalar": torch.ops.aten.add.Tensor,
    "aten::sub.Scalar": torch.ops.aten.sub.Tensor,
    "aten::mul.Scalar": torch.ops.aten.mul.Tensor,
    "aten::div.Scalar": torch.ops.aten.div.Tensor,
    "aten::div.Scalar_mode": torch.ops.aten.div.Tensor_mode,
    "aten::isnan": _isnan,
    "aten::masked_fill.Scalar": _masked_fill,
    "aten::masked_fill.Tensor": _masked_fill,
    "aten::empty_like": _factory_like("aten::empty_like"),
    "aten::zeros_like": _factory_like("aten::zeros_like"),
    "aten::ones_like": _factory_like("aten::ones_like"),
    "aten::fill.Scalar": _fill,
    "aten::mean": _mean,
}


#: CUDA operators PyTorch has no meta kernel for at all, each given one that makes its
#: outputs' sizes as CUDA's kernel allocates them: SyncBatchNorm's (detection and
#: segmentation trainers' ``--sync-bn``), which would otherwise stop the step.
CUDA_ONLY: dict[str, Any] = {
    "aten::batch_norm_stats": _sync_stats,
    "aten::batch_norm_gather_stats_with_counts": _sync_gather,
    "aten::batch_norm_elemt": _sync_elementwise,
    "aten::batch_norm_backward_reduce": _sync_backward_reduce,
    "aten::batch_norm_backward_elemt": _sync_backward_elementwise,
}


def native_meta_kernels() -> NativeMetaKernels:
    """The C++ meta kernels made current, with the handle that takes them back (for the ledger)."""
    return NativeMetaKernels().install()


def _python_meta_library() -> Any:
    """``torch._meta_registrations``' library of Python meta kernels, or None where it has none."""
    try:
        import torch._meta_registrations as registrations
    except ImportError:
        return None
    library = getattr(registrations, "_meta_lib_dont_use_me_use_register_meta", None)
    if not isinstance(getattr(library, "_op_impls", None), set) or getattr(library, "m", None) is None:
        return None
    if getattr(library, "dispatch_key", None) != META or getattr(library, "ns", None) != "aten":
        return None
    return library


def _registered(library: Any) -> list[tuple[str, Any]] | None:
    """Each operator the library holds a Python meta kernel for, with the kernel (the one
    PyTorch also keeps on the operator); None where one cannot be found, so that nothing is
    swapped that could not be put back."""
    found = []
    for key in sorted(library._op_impls):
        # A key reads "aten/add.Tensor/Meta".
        ns, _, rest = key.partition("/")
        name, _, key_name = rest.rpartition("/")
        if key_name != META:
            return None
        packet, _, overload = name.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")
        except AttributeError:
            return None
        fn = op.py_kernels.get(torch._C.DispatchKey.Meta)
        if fn is None:
            return None
        found.append((f"{ns}::{name}", fn))
    return found


def _new_library(file: str) -> Any:
    """An empty C++ library of ``aten`` kernels for the Meta key, registered by ``file``."""
    return torch._C._dispatch_library("IMPL", "aten", META, file, 0)


@contextlib.contextmanager
def native_meta_kernels_current() -> Any:
    """The C++ meta kernels current for the block (for a benchmark or a test)."""
    handle = native_meta_kernels()
    try:
        yield handle
    finally:
        handle.remove()
