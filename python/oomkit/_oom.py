"""Recognising out-of-memory errors and reading what they asked for."""

from __future__ import annotations

import re
from typing import Optional

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")
_CPU = re.compile(r"you tried to allocate (\d+) bytes")


def is_oom(exc: BaseException) -> bool:
    """Returns True for torch.OutOfMemoryError and any error whose message is an OOM message."""
    try:
        import torch

        oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
            torch.cuda, "OutOfMemoryError", None
        )
        if oom_type is not None and isinstance(exc, oom_type):
            return True
    except Exception:  # noqa: BLE001 - torch absent or broken: fall back to the text
        pass
    # One list of message forms, shared with `oomkit run` and `oomkit explain`.
    from oomkit import _native

    return isinstance(exc, (RuntimeError, MemoryError)) and _native.oom_kind(str(exc)) is not None


def requested_bytes(message: str) -> Optional[int]:
    """Parses the bytes the failed allocation asked for from an OOM message."""
    m = _TRIED.search(message)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    m = _CPU.search(message)
    if m:
        return int(m.group(1))
    return None
