"""What the tests ask of processes they started."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (one whose parent died waits to be reaped by
    whoever adopted it, which in a container may be slow to; it holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
