"""Writes a preflight as a snapshot in PyTorch's own format.

The keys and entries are those ``torch.cuda.memory._snapshot()`` returns
(``segments``, ``device_traces``, ``allocator_settings``), with the
addresses and segments of the model of the caching allocator, so that
``oomkit analyze``, ``report``, ``diff`` and ``whatif`` (and PyTorch's
``memory_viz``) open it like a recorded one. The extra key
``oomkit_preflight`` says it was simulated and how; each allocation entry
carries ``oomkit_role``, the role preflight knows exactly.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

#: What the ``oomkit_preflight`` header's layout is; raised when it changes.
HEADER_VERSION = 1

#: The native frame of cuBLAS's workspace in a snapshot recorded with C++ stacks.
CUBLAS_FRAMES = ({"filename": "??", "line": 0, "name": "at::cuda::getCurrentCUDABlasHandle()"},)


def write_snapshot(
    path: str | os.PathLike[str],
    realized: tuple[Any, Any, Any, Any],
    stacks: list[tuple[tuple[str, int, str], ...]],
    stack_of: list[int],
    roles: dict[int, str],
    alloc_conf: str | None,
    header: dict[str, Any],
    library: set[int] | None = None,
) -> None:
    """Writes the snapshot to ``path``, refusing to replace a file that exists."""
    (actions, addrs, sizes, streams, ops), segments, _, _ = realized
    frames = [[{"filename": f, "line": line, "name": name} for f, line, name in s] for s in stacks]
    # The CUDA libraries' own allocations carry the native frame a real
    # snapshot (stacks="all") shows for them, above the Python ones.
    native = {i: [*CUBLAS_FRAMES, *frames[stack_of[i]]] for i in (library or set())}

    def frames_of(op: int) -> list[dict[str, Any]]:
        return native.get(op) or frames[stack_of[op]]

    entries = []
    for action, addr, size, stream, op in zip(actions, addrs, sizes, streams, ops):
        e: dict[str, Any] = {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "frames": frames_of(op),
        }
        if action == "alloc":
            e["oomkit_role"] = roles.get(op, "unknown")
        entries.append(e)
    out_segments = []
    for address, total, stream, kind, expandable, blocks in segments:
        out_blocks = []
        allocated = requested = 0
        for b_addr, b_size, b_req, b_alloc, b_op in blocks:
            out_blocks.append(
                {
                    "address": b_addr,
                    "size": b_size,
                    "requested_size": b_req,
                    "state": "active_allocated" if b_alloc else "inactive",
                    "frames": frames_of(b_op) if b_op is not None else [],
                }
            )
            if b_alloc:
                allocated += b_size
                requested += b_req
        out_segments.append(
            {
                "device": 0,
                "address": address,
                "total_size": total,
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": requested,
                "stream": stream,
                "segment_type": kind,
                "segment_pool_id": (0, 0),
                "is_expandable": expandable,
                "frames": [],
                "blocks": out_blocks,
            }
        )
    snapshot = {
        "segments": out_segments,
        "device_traces": [entries],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf or ""},
        "oomkit_preflight": {"version": HEADER_VERSION, **header},
    }
    # "x" mode: an existing file is never overwritten.
    with open(path, "xb") as f:
        pickle.dump(snapshot, f, protocol=4)
