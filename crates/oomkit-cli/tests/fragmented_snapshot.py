"""Writes a snapshot of a fragmentation OOM, as PyTorch's allocator records one, with CPython's pickle.

Six 8 MiB tensors fill three 20 MiB segments, every other one is freed (36
MiB free in 8 and 4 MiB pieces), and a 12 MiB request fails: the flush
frees nothing (every segment is split) and the driver had 2 MiB free.
Replayed with expandable segments, the same requests pack one growing
segment and the 12 MiB one finds room.

    python3 fragmented_snapshot.py OUT.pickle
"""
import pickle
import sys

MIB = 1 << 20
BASE = 0x7F0000000000
trace, segments = [], []


def entry(action, addr, size):
    e = {"action": action, "size": size, "stream": 0}
    e["device_free" if action == "oom" else "addr"] = addr
    trace.append(e)


for s in range(3):
    seg = BASE + s * 32 * MIB
    entry("segment_alloc", seg, 20 * MIB)
    entry("alloc", seg, 8 * MIB)
    entry("alloc", seg + 8 * MIB, 8 * MIB)
for s in range(3):
    seg = BASE + s * 32 * MIB
    entry("free_requested", seg, 8 * MIB)
    entry("free_completed", seg, 8 * MIB)
entry("oom", 2 * MIB, 12 * MIB)
for s in range(3):
    seg = BASE + s * 32 * MIB
    blocks = [
        {"address": seg, "size": 8 * MIB, "requested_size": 0, "state": "inactive", "frames": []},
        {"address": seg + 8 * MIB, "size": 8 * MIB, "requested_size": 8 * MIB, "state": "active_allocated", "frames": []},
        {"address": seg + 16 * MIB, "size": 4 * MIB, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    segments.append({
        "device": 0, "address": seg, "total_size": 20 * MIB, "allocated_size": 8 * MIB,
        "active_size": 8 * MIB, "requested_size": 8 * MIB, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
    })
with open(sys.argv[1], "wb") as f:
    pickle.dump({"segments": segments, "device_traces": [trace]}, f, protocol=4)
