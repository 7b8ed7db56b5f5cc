"""`oomkit preflight --json` on a script, for the tests that check what a script's run holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
