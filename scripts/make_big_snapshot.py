#!/usr/bin/env python3
"""Build a large snapshot for benchmarks by tiling a real one.

Each tile is a copy of the source's segments and trace with addresses and
times shifted, so the tiled file stays self-consistent (the replay of every
tile starts from what that tile had live) and keeps PyTorch's sharing of
frame objects. Only the Python standard library is used.

    python3 scripts/make_big_snapshot.py SOURCE.pickle OUT.pickle --events 1000000
"""
import argparse
import pickle

ap = argparse.ArgumentParser()
ap.add_argument("source")
ap.add_argument("out")
ap.add_argument("--events", type=int, default=1_000_000, help="at least this many trace entries")
ap.add_argument(
    "--fresh-frames",
    action="store_true",
    help="give each tile its own frames lists, as a longer real run has (frame dicts stay shared)",
)
ap.add_argument(
    "--fresh-strings",
    action="store_true",
    help="give each entry its own copy of the strings that are its own in the source "
    "(PyTorch writes a new compile_context string for every entry)",
)
args = ap.parse_args()

with open(args.source, "rb") as f:
    src = pickle.load(f)
trace = src["device_traces"][0]
times = [e["time_us"] for e in trace if "time_us" in e]
span = (max(times) - min(times) + 1000) if times else 0
lo = min(s["address"] for s in src["segments"])
hi = max(s["address"] + s["total_size"] for s in src["segments"])
for e in trace:
    if e["action"] != "oom":
        lo, hi = min(lo, e["addr"]), max(hi, e["addr"] + e["size"])
stride = (hi - lo + (1 << 30)) // (1 << 21) * (1 << 21)
tiles = -(-args.events // len(trace))
# Strings that only one entry of the source refers to are that entry's own
# objects, which the pickler writes out again for every entry.
uses = {}
for e in trace:
    for v in e.values():
        if isinstance(v, str):
            uses[id(v)] = uses.get(id(v), 0) + 1

segments, events, annotations = [], [], []
for k in range(tiles):
    shift, dt = k * stride, k * span
    for s in src["segments"]:
        s2 = dict(s, address=s["address"] + shift)
        s2["blocks"] = [dict(b, address=b["address"] + shift) for b in s["blocks"]]
        segments.append(s2)
    # PyTorch writes one frames list per captured traceback and shares the
    # frame dicts; copying the lists per tile keeps that pattern.
    fresh = {}
    for e in trace:
        e2 = dict(e)
        if args.fresh_frames and "frames" in e:
            e2["frames"] = fresh.setdefault(id(e["frames"]), list(e["frames"]))
        if args.fresh_strings:
            for key, v in e.items():
                if isinstance(v, str) and uses[id(v)] == 1:
                    e2[key] = v.encode().decode()
        if e["action"] != "oom":
            e2["addr"] = e["addr"] + shift
        if "time_us" in e:
            e2["time_us"] = e["time_us"] + dt
        events.append(e2)
    for a in src.get("external_annotations", []):
        annotations.append(dict(a, time_us=a["time_us"] + dt))

out = dict(src, segments=segments, device_traces=[events], external_annotations=annotations)
with open(args.out, "wb") as f:
    pickle.dump(out, f, protocol=4)
print(f"{args.out}: {tiles} tiles, {len(events)} events, {len(segments)} segments")
