"""Figures computed from a snapshot with CPython's own pickle, independently
of oomkit's Rust code, for the fixture tests to compare against.

Definitions (README, "How the figures are computed"):
- reserved/active bytes: sums of the segments' total_size / active_size;
- the trace replay starts from the bytes live before the first entry
  (active blocks at the end minus allocs plus completed frees in the trace,
  the blocks the trace allocated and never freed counted at the size it
  recorded rather than their rounded block size)
  and adds each alloc, subtracts each free_completed; the peak is the first
  maximum, and its index is null if nothing in the trace exceeds the start.

- recorded segments (what `oomkit whatif` checks its model against): each
  segment_alloc or segment_map entry with the index of the alloc or oom
  entry after it, which it served, and its size.

Prints one JSON object: {device: {...}}."""
import json
import pickle
import sys

with open(sys.argv[1], "rb") as f:
    snap = pickle.load(f)
if isinstance(snap, list):
    snap = {"segments": snap, "device_traces": []}

devices = {s.get("device", 0) for s in snap["segments"]}
devices |= {i for i, t in enumerate(snap.get("device_traces", [])) if t}
out = {}
for dev in sorted(devices):
    segs = [s for s in snap["segments"] if s.get("device", 0) == dev]
    traces = snap.get("device_traces", [])
    trace = traces[dev] if dev < len(traces) else []
    active_blocks = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] != "inactive")
    reserved = sum(s["total_size"] for s in segs)
    alloc = sum(e["size"] for e in trace if e["action"] == "alloc")
    freed = sum(e["size"] for e in trace if e["action"] == "free_completed")
    seg_in = sum(e["size"] for e in trace if e["action"] in ("segment_alloc", "segment_map"))
    seg_out = sum(e["size"] for e in trace if e["action"] in ("segment_free", "segment_unmap"))
    # Blocks the trace allocated and never freed count at the size it
    # recorded (the bytes asked for), not at their rounded block size.
    still_open = {}
    for e in trace:
        if e["action"] == "alloc":
            still_open[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            still_open.pop(e["addr"], None)
    rounding = sum(max(b["size"] - still_open[b["address"]], 0)
                   for s in segs for b in s["blocks"]
                   if b["state"] != "inactive" and b["address"] in still_open)
    start = max(active_blocks - rounding - (alloc - freed), 0)
    res = max(reserved - (seg_in - seg_out), 0)
    cur, peak, peak_index, res_peak = start, start, None, res
    ooms = []
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "oom":
            ooms.append({"event_index": i, "requested_bytes": e["size"],
                         "free_bytes": e.get("device_free", e.get("addr")),
                         "live_bytes": cur})
        elif a == "alloc":
            cur += e["size"]
        elif a == "free_completed":
            cur = max(cur - e["size"], 0)
        elif a in ("segment_alloc", "segment_map"):
            res += e["size"]
        elif a in ("segment_free", "segment_unmap"):
            res = max(res - e["size"], 0)
        if cur > peak:
            peak, peak_index = cur, i
        res_peak = max(res_peak, res)
    if not trace:
        peak = max(peak, active_blocks)
    segments, waiting = [], []
    for i, e in enumerate(trace):
        if e["action"] in ("segment_alloc", "segment_map"):
            waiting.append((i, e["size"]))
        elif e["action"] in ("alloc", "oom"):
            segments += [[i, size] for _, size in waiting]
            waiting = []
    segments += [[j, size] for j, size in waiting]
    out[str(dev)] = {
        "events": len(trace),
        "reserved_bytes": reserved,
        "active_bytes": sum(s["active_size"] for s in segs),
        "allocated_bytes": sum(s["allocated_size"] for s in segs),
        "peak_active_bytes": peak,
        "peak_event_index": peak_index,
        "peak_reserved_bytes": res_peak,
        "ooms": ooms,
        "recorded_segments": segments,
    }
print(json.dumps(out))
