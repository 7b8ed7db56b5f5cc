"""Which line of a stack is the user's, and how to show it.

A preflight names lines twice: the lines holding the most memory at the
peak, and the line where a script failed or stopped. Both are the
innermost frame in the user's own code: not PyTorch, not a package
installed in site-packages, not the standard library. The frames are
told apart as ``oomkit analyze`` tells them apart in a snapshot
(``oomkit_snapshot::classify``), so that the answer and the snapshot it
writes name the same lines. Where a library's function did the
allocating under the user's line (``einops.einsum``, a Hugging Face
model's ``forward``), that frame is shown beside it.
"""

from __future__ import annotations

import os
import sys

#: The kinds of frame, innermost wins in this order of preference.
USER, LIBRARY, TORCH, RUNTIME = "user", "library", "torch", "runtime"

#: Folders of installed packages, on every platform.
_INSTALLED = ("site-packages", "dist-packages")

#: oomkit's own files (the preflight's driver, the tracker): machinery, never the user's line.
#: The package's folder, read off the package (always imported before this module), not off this file's place in it.
_OWN = os.path.dirname(os.path.abspath(sys.modules["oomkit"].__file__ or "")).replace("\\", "/") + "/"

#: Marks of code PyTorch's compilers generate (an FX graph's ``forward``, inductor's
#: output code in the temporary folder): PyTorch's, not the user's, as the snapshot reader has them.
_GENERATED_BY_TORCH = ("<eval_with_key>", "/torchinductor_")

#: Stacks are given innermost frame first: (filename, line, function).
Stack = tuple[tuple[str, int, str], ...]


def classify(filename: str) -> str:
    """Whether a frame's file is the user's, a library's, PyTorch's or the interpreter's (oomkit's own count as the latter)."""
    f = filename.replace("\\", "/")
    if f.startswith("<frozen") or f.startswith(_OWN):
        return RUNTIME
    if "/torch/" in f or f.startswith("torch/") or "/functorch/" in f or any(g in f for g in _GENERATED_BY_TORCH):
        return TORCH
    if any(f"/{p}/" in f for p in _INSTALLED):
        return LIBRARY
    if "/lib/python3" in f or "/lib/python2" in f or "/Lib/" in f:
        return RUNTIME
    return USER


def _library_path(filename: str) -> str:
    """An installed file as its package names it: ``einops/_backends.py``."""
    f = filename.replace("\\", "/")
    for p in _INSTALLED:
        mark = f"/{p}/"
        if mark in f:
            return f.split(mark, 1)[1]
    return f


def script_dir() -> str:
    """The folder of the script running (``python train.py``), else the working folder."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and os.path.isfile(argv0) and classify(os.path.abspath(argv0)) == USER:
        return os.path.dirname(os.path.abspath(argv0))
    return os.getcwd()


def shown_path(filename: str) -> str:
    """A user's file as they would type it: relative to the script's folder, else the working folder, when inside it."""
    if filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    for base in (script_dir(), os.getcwd()):
        try:
            rel = os.path.relpath(path, base)
        except ValueError:
            continue
        if not rel.startswith(os.pardir):
            return rel
    return path


def _show(frame: tuple[str, int, str]) -> str:
    filename, line, name = frame
    kind = classify(filename)
    path = shown_path(filename) if kind == USER else _library_path(filename) if kind == LIBRARY else filename
    return f"{path}:{line} ({name})"


def user_line(stack: Stack) -> str:
    """The innermost frame of the user's own code, as ``FILE:LINE (FUNCTION)``, with the
    library frame under it that allocated (``train.py:9 (<module>), in einops/einops.py:916 (einsum)``).

    Without a frame of the user's, the innermost library frame, then PyTorch's.
    """
    kinds = [classify(f[0]) for f in stack]
    for want in (USER, LIBRARY, TORCH):
        at = next((i for i, k in enumerate(kinds) if k == want), None)
        if at is None:
            continue
        shown = _show(stack[at])
        if want == USER:
            # The library function nearest the allocation, under the user's line.
            inner = next((stack[i] for i in range(at) if kinds[i] == LIBRARY), None)
            if inner is not None:
                shown += f", in {_show(inner)}"
        return shown
    return f"{stack[0][0]}:{stack[0][1]} ({stack[0][2]})" if stack else "(no Python frame)"
