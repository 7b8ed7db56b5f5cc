"""Recognising out-of-memory errors and reading what they asked for."""

from __future__ import annotations

from typing import Optional

from oomkit import _native

# How far along __cause__ and __context__ an OOM is looked for; frameworks
# wrap it once or twice (the Hugging Face Trainer's evaluation, Lightning).
_CHAIN_DEPTH = 8


def _is_oom_here(exc: BaseException) -> bool:
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


def find_oom(exc: Optional[BaseException]) -> Optional[BaseException]:
    """Returns the out-of-memory error in ``exc`` or in what it was raised from (``__cause__``, ``__context__``), or None."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < _CHAIN_DEPTH:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if _is_oom_here(e):
            return e
        todo.extend((e.__cause__, e.__context__))
    return None


def is_oom(exc: BaseException) -> bool:
    """Returns True for torch.OutOfMemoryError and any error whose message, or whose cause's, is an OOM message."""
    return find_oom(exc) is not None


def requested_bytes(message: str) -> Optional[int]:
    """Parses the bytes the failed allocation asked for from an OOM message."""
    # The same reader as `oomkit explain`, so every message form agrees.
    result: Optional[int] = _native.oom_requested_bytes(message)
    return result
