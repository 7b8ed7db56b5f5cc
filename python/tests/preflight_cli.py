"""`oomkit preflight --json` on a script, for the tests that check what a script's run holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The installed console script, beside this Python.
OOMKIT = os.path.join(os.path.dirname(sys.executable), "oomkit")


def preflight_run(script: Path, *flags: str, args: tuple[str, ...] = (), cwd: Path | None = None) -> dict[str, Any]:
    """Runs ``oomkit preflight --json FLAGS -- python SCRIPT ARGS``, checks it answered, and returns its ``run``."""
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", *flags, "--", sys.executable, str(script), *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["run"]
