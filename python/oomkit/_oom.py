"""Recognising out-of-memory errors and reading what they asked for."""

from __future__ import annotations

from typing import Optional

from oomkit import _native


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
    return isinstance(exc, (RuntimeError, MemoryError)) and _native.oom_kind(str(exc)) is not None


def requested_bytes(message: str) -> Optional[int]:
    """Parses the bytes the failed allocation asked for from an OOM message."""
    # The same reader as `oomkit explain`, so every message form agrees.
    result: Optional[int] = _native.oom_requested_bytes(message)
    return result
