"""A stand-in for a Python training script under `oomkit preflight`, for the CLI's tests.

It answers as `oomkit.preflight.script` does, with the answer a real run of
examples/preflight/train.py --batch-size 8 gave (2026-11-25, torch 2.15,
CPU only), scaled by the micro-batch given (argv[1]), so that the command's
rendering, search and exit codes are tested without PyTorch.
"""

import json
import os
import sys

RUN = json.loads(
    r"""
{
    "allocations": 2434,
    "by_line": [
        {
            "bytes": 3296723456,
            "line": "examples/preflight/train.py:66 (main)",
            "role": "temporaries"
        },
        {
            "bytes": 3020685312,
            "line": "examples/preflight/train.py:28 (forward)",
            "role": "activations"
        },
        {
            "bytes": 1648361984,
            "line": "examples/preflight/train.py:44 (forward)",
            "role": "activations"
        },
        {
            "bytes": 1304875008,
            "line": "examples/preflight/train.py:68 (main)",
            "role": "optimizer_state"
        },
        {
            "bytes": 1208745984,
            "line": "examples/preflight/train.py:25 (forward)",
            "role": "activations"
        },
        {
            "bytes": 306720768,
            "line": "examples/preflight/train.py:26 (forward)",
            "role": "activations"
        },
        {
            "bytes": 301989888,
            "line": "examples/preflight/train.py:27 (forward)",
            "role": "activations"
        },
        {
            "bytes": 226676736,
            "line": "examples/preflight/train.py:21 (__init__)",
            "role": "parameters"
        },
        {
            "bytes": 154533888,
            "line": "examples/preflight/train.py:34 (__init__)",
            "role": "parameters"
        },
        {
            "bytes": 154533888,
            "line": "examples/preflight/train.py:38 (__init__)",
            "role": "parameters"
        }
    ],
    "by_role": {
        "activations": 6536909312,
        "gradients": 0,
        "inputs": 0,
        "optimizer_state": 1304875008,
        "other": 33554432,
        "parameters": 652437504,
        "temporaries": 3296854528
    },
    "capacity": "24GiB",
    "capacity_bytes": 25769803776,
    "fits": true,
    "free_in_segments_at_peak_bytes": 399668224,
    "margin_bytes": 13543407616,
    "micro_batch": null,
    "notes": [
        "sizes are the CUDA allocator's, modelled; the CUDA context is outside them (a GPU's name as the capacity takes it off)",
        "includes cuBLAS's workspace, allocated at the first matrix multiply",
        "1 value(s) read from tensors without data were taken as 0 (first at examples/preflight/train.py:71 (main)); a step whose memory depends on data may differ"
    ],
    "peak_allocated_bytes": 11826727936,
    "peak_reserved_bytes": 12226396160,
    "snapshot": null,
    "steps": 2
}
"""
)

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 8
if batch == 0:
    sys.exit(3)  # a script that fails before preflight can answer
settings = json.loads(os.environ["OOMKIT_PREFLIGHT"])
# Activations and temporaries grow with the micro-batch; the rest does not.
scale = batch / 8
for role in ("activations", "temporaries"):
    RUN["by_role"][role] = int(RUN["by_role"][role] * scale)
peak = sum(RUN["by_role"].values())
RUN["peak_allocated_bytes"] = peak
RUN["peak_reserved_bytes"] = int(peak * 1.04)
RUN["capacity"] = settings["capacity"]
RUN["margin_bytes"] = RUN["capacity_bytes"] - RUN["peak_reserved_bytes"]
RUN["fits"] = RUN["margin_bytes"] >= 0
print(f"stand-in: micro-batch {batch}")
with open(settings["result"], "w") as f:
    json.dump({"result": RUN}, f)
