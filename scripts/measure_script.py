"""Runs a training script unchanged on the GPU and prints its peak memory, for `oomkit preflight` to be checked against.

    python scripts/measure_script.py examples/preflight/train.py --batch-size 8 --steps 2
    torchrun --standalone --nproc_per_node 1 scripts/measure_script.py examples/preflight/fsdp_train.py --steps 2

The script runs as `python SCRIPT ARGS` would run it (as `__main__`, with
its own arguments); when it ends, rank 0 prints one line
`RESULT {"peak_allocated_bytes", "peak_reserved_bytes", "device"}`, from
`torch.cuda.max_memory_allocated()` and `max_memory_reserved()`: the
figures `oomkit preflight` predicts for the same command.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys


def _report() -> None:
    import torch

    if os.environ.get("RANK", "0") != "0" or not torch.cuda.is_available():
        return
    print(
        "RESULT "
        + json.dumps(
            {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "device": torch.cuda.get_device_name(),
            }
        ),
        flush=True,
    )


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: measure_script.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # Registered before the script's own exit handlers, so it runs after them: the peaks are final.
    atexit.register(_report)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
