"""Runs a training script unchanged on the GPU and prints its peak memory, for `oomkit preflight` to be checked against.

    python scripts/measure_script.py examples/preflight/train.py --batch-size 8 --steps 2
    torchrun --standalone --nproc_per_node 1 scripts/measure_script.py examples/preflight/fsdp_train.py --steps 2

    python scripts/measure_script.py --memory-fraction 0.3 examples/preflight/train.py --ctx 4096
    python scripts/measure_script.py --steps 2 train_gpt2.py

The script runs as `python SCRIPT ARGS` would run it (as `__main__`, with
its own arguments); when it ends, rank 0 prints one line
`RESULT {"peak_allocated_bytes", "peak_reserved_bytes", "device", "oom"}`, from
`torch.cuda.max_memory_allocated()` and `max_memory_reserved()`: the
figures `oomkit preflight` predicts for the same command, and whether it
ran out of memory. `--memory-fraction F` caps the process at that share of
the GPU first (`torch.cuda.set_per_process_memory_fraction`), as a GPU of
that capacity would. `--steps N` ends the script after its N-th optimizer
step, as `oomkit preflight --steps N` does, for a script that trains for
hours (the peaks are those of the steps that ran).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys

#: Whether the script ran out of memory, for the result line.
_RAN_OUT = {"oom": False}


class _Enough(BaseException):
    """Raised after the last optimizer step to measure: a BaseException, so that the script's own
    `except Exception` does not swallow it."""


def _stop_after(steps: int) -> None:
    """Ends the script after its ``steps``-th optimizer step (of any optimizer)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    done = [0]

    def count(_optimizer: object, _args: object, _kwargs: object) -> None:
        done[0] += 1
        if done[0] >= steps:
            raise _Enough

    register_optimizer_step_post_hook(count)


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
                "oom": _RAN_OUT["oom"],
            }
        ),
        flush=True,
    )


def main() -> None:
    args = sys.argv[1:]
    fraction, steps = None, None
    while args[:1] in (["--memory-fraction"], ["--steps"]) and len(args) >= 2:
        if args[0] == "--steps":
            steps = int(args[1])
        else:
            fraction = float(args[1])
        args = args[2:]
    if not args:
        sys.exit("usage: measure_script.py [--memory-fraction F] [--steps N] SCRIPT [ARGS...]")
    script = args[0]
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if fraction is not None:
        import torch

        torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
    if steps is not None:
        _stop_after(steps)
    # Registered before the script's own exit handlers, so it runs after them: the peaks are final.
    atexit.register(_report)
    try:
        runpy.run_path(script, run_name="__main__")
    except _Enough:
        pass
    except Exception as e:
        import torch

        _RAN_OUT["oom"] = isinstance(e, torch.OutOfMemoryError)
        raise


if __name__ == "__main__":
    main()
