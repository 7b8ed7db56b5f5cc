"""The host memory a script holds for the GPU: pinned buffers and copies of GPU tensors.

On a GPU, a script pins host memory for fast copies (``pin_memory=True``,
``Tensor.pin_memory()``, a data loader's pinning) and offloads tensors to
the host (``.cpu()``, ``.to("cpu")``: weights or activations kept off the
GPU). Under preflight none of this needs a GPU or the data: pinning is
plain host memory, and a copy from the GPU is memory the kernel fills with
zeros only as it is touched, so a 7B model offloaded costs the machine
nothing it does not read. What the script would hold is counted here, as
the host memory beside the GPU's figures.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: Copies from the GPU at least this large are mapped anonymous memory, which
#: the kernel zero-fills page by page as it is touched: never resident unless read.
LAZY_ZEROS_BYTES = 1 << 20


def host_zeros(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of zeros of ``shape``; a large one takes no memory until its pages are touched."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # Anonymous and private: zero pages, mapped as read or written (the buffer lives as long as the tensor).
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class HostMemory:
    """The host memory the script holds for the GPU, live and at its most: all of it, pinned, and paged.

    Paged memory is CUDA's unified memory (bitsandbytes' paged optimizer
    state): allocated outside PyTorch's caching allocator, resident on the
    GPU while there is room and moved to the host when there is not, so it
    is never in the GPU's peaks and never the cause of an out-of-memory.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.pinned_live_bytes = 0
        self.pinned_peak_bytes = 0
        self.paged_live_bytes = 0
        self.paged_peak_bytes = 0
        # Each storage counted once: [its bytes, whether pinned].
        self._held: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # The storages of values read back from tensors without data, taken as zero.
        self._zeros: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def taken_as_zero(self, t: torch.Tensor) -> torch.Tensor:
        """Marks ``t`` as values read back that no step made known (zeros standing in); returns it."""
        self._zeros[t.untyped_storage()] = True
        return t

    def is_taken_as_zero(self, t: Any) -> bool:
        """Whether ``t`` holds values read back that no step made known."""
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage() in self._zeros

    def hold(self, t: Any, pinned: bool) -> None:
        """Counts the storage of ``t`` (a host tensor) as held until it is freed; pinned, if
        ``pinned`` (a copy pinned after it was made is pinned from then on)."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        st = t.untyped_storage()
        entry = self._held.get(st)
        if entry is None:
            # [bytes, pinned], read again when it is freed.
            entry = self._held[st] = [st.nbytes(), False]
            self._change(entry[0], 0)
            weakref.finalize(st, self._freed, entry)
        if pinned and not entry[1]:
            entry[1] = True
            self._change(0, entry[0])

    def _freed(self, entry: list[Any]) -> None:
        self._change(-entry[0], -entry[0] if entry[1] else 0)

    def hold_paged(self, t: torch.Tensor) -> None:
        """Counts ``t``'s storage as paged (unified) memory until it is freed."""
        nbytes = t.untyped_storage().nbytes()
        self._change_paged(nbytes)
        weakref.finalize(t.untyped_storage(), self._change_paged, -nbytes)

    def _change_paged(self, nbytes: int) -> None:
        self.paged_live_bytes += nbytes
        self.paged_peak_bytes = max(self.paged_peak_bytes, self.paged_live_bytes)

    def pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is counted as pinned (what ``Tensor.is_pinned()`` says of it)."""
        held = self._held.get(t.untyped_storage())
        return held is not None and held[1]

    def _change(self, held: int, pinned: int) -> None:
        self.live_bytes += held
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.pinned_live_bytes += pinned
        self.pinned_peak_bytes = max(self.pinned_peak_bytes, self.pinned_live_bytes)
