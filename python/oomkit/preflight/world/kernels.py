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


#: Operators without a C++ meta kernel whose Python one is a whole decomposition (batch
#: norm's computes the statistics through a dozen reference operations), each given a
#: kernel that makes only the outputs' sizes, as CUDA's kernel allocates them.
SIZES_ONLY: dict[str, Any] = {
    "aten::native_batch_norm": _batch_norm,
    "aten::native_batch_norm_backward": _batch_norm_backward,
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
