"""`oomkit preflight --json` on a script, for the tests that check what a script's run holds."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

#: The installed console script, beside this Python.
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")

#: The caching allocator's rounding of a request (``kMinBlockSize``).
BLOCK = 512

#: The end of a test script that has ``batch`` and ``torch``: two AdamW steps of a Linear(512, 512) on the GPU.
TRAIN_TWO_STEPS = textwrap.dedent(
    """\
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(batch, 512, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    """
)

#: Where scripts/test.sh installs torchvision and timm, apart from the other tests' libraries.
VISION_SITE = Path(sys.prefix) / "vision-site"


def pythonpath_with(*folders: Path | str) -> str:
    """The ``PYTHONPATH`` the tests run with, then ``folders``: for a child that needs a library
    installed in a folder of its own, which this process must not see."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *map(str, folders)) if p)


def allocator_bytes(tensors: Iterable[Any]) -> int:
    """What the allocator hands out for these tensors, each rounded up to its 512-byte blocks."""
    return sum(-(-t.nbytes // BLOCK) * BLOCK for t in tensors)


def preflight_run(
    script: Path, *flags: str, args: tuple[str, ...] = (), cwd: Path | None = None, launcher: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Runs ``oomkit preflight --json FLAGS -- python LAUNCHER SCRIPT ARGS`` (``LAUNCHER``: ``-m
    torch.distributed.run --nproc-per-node 2``), checks it answered, and returns its ``run``."""
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", *flags, "--", sys.executable, *launcher, str(script), *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["run"]


@contextlib.contextmanager
def warm_python(env: Optional[dict[str, str]] = None) -> Iterator[Optional[str]]:
    """A shared warm Python started with ``env`` (this process's environment by default),
    serving commands whose environment is the same: its socket, or None where it cannot
    start (the tests hold without it, each run fresh: only slower, and said so), or where
    OOMKIT_TEST_FRESH=1 asks for every run fresh."""
    if os.environ.get("OOMKIT_TEST_FRESH") == "1":
        yield None
        return
    folder = tempfile.mkdtemp(prefix="oomkit-test-warm-")
    socket_path = os.path.join(folder, "preflight.sock")
    # What it refused, and why, goes to OOMKIT_TEST_SERVER_LOG where that names a file.
    with open(os.environ.get("OOMKIT_TEST_SERVER_LOG", os.devnull), "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "oomkit.preflight.warm", "--serve", socket_path, "--ignore", "PYTEST_CURRENT_TEST"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )  # fmt: skip
    ready = server.stdout.readline() if server.stdout else ""
    try:
        if '"ready": true' not in ready:
            server.kill()
            server.wait()
            warnings.warn(f"the shared warm Python did not start (exit {server.returncode}): every preflight run starts fresh", stacklevel=3)
            yield None
            return
        yield socket_path
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(folder, True)


@contextlib.contextmanager
def warm_python_for(env: dict[str, str], into: dict[str, str]) -> Iterator[None]:
    """While open, ``into`` names a warm Python started with ``env`` (OOMKIT_PREFLIGHT_SERVER),
    for a module whose commands run with ``env`` and ``into`` added: a library's folder on
    ``PYTHONPATH``, which the suite's own warm Python, started without it, refuses."""
    with warm_python(env) as socket_path:
        if socket_path is not None:
            into["OOMKIT_PREFLIGHT_SERVER"] = socket_path
        try:
            yield
        finally:
            into.clear()
