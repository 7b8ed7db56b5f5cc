"""CPython side of the differential test: build a described value, pickle it,
and render pickle.loads() of it canonically (the format of Document::repr).

Reads one JSON request per line on stdin, writes one JSON reply per line."""
import json
import pickle
import struct
import sys


def build(desc, shared):
    (tag, arg), = desc.items()
    if tag == "n":
        return None
    if tag == "b":
        return bool(arg)
    if tag == "i":
        return int(arg)
    if tag == "f":
        return struct.unpack("<d", bytes.fromhex(arg))[0]
    if tag == "s":
        return arg
    if tag == "k":
        # One object per distinct text, so that the pickler memoizes it as
        # PyTorch's repeated dict keys are.
        return sys.intern(arg)
    if tag == "y":
        return bytes.fromhex(arg)
    if tag == "ba":
        return bytearray.fromhex(arg)
    if tag == "share":
        return shared[arg % len(shared)] if shared else None
    if tag == "l":
        out = [build(x, shared) for x in arg]
        shared.append(out)
        return out
    if tag == "t":
        return tuple(build(x, shared) for x in arg)
    if tag == "d":
        out = {build(k, shared): build(v, shared) for k, v in arg}
        shared.append(out)
        return out
    if tag == "set":
        return {build(x, shared) for x in arg}
    if tag == "fs":
        return frozenset(build(x, shared) for x in arg)
    raise ValueError(tag)


def canon(o, depth=1000, path=()):
    if o is None:
        return "None"
    if o is True:
        return "True"
    if o is False:
        return "False"
    if isinstance(o, int):
        return str(o)
    if isinstance(o, float):
        return "f%016x" % struct.unpack("<Q", struct.pack("<d", o))[0]
    if isinstance(o, str):
        return "s:" + o.encode("utf-8").hex()
    if isinstance(o, bytes):
        return "b:" + o.hex()
    if isinstance(o, bytearray):
        return "ba:" + o.hex()
    if depth == 0 or id(o) in path:
        return "..."
    path = path + (id(o),)
    sub = lambda x: canon(x, depth - 1, path)
    if isinstance(o, list):
        return "[" + ",".join(sub(x) for x in o) + "]"
    if isinstance(o, tuple):
        return "(" + ",".join(sub(x) for x in o) + ")"
    if isinstance(o, dict):
        return "{" + ",".join(sub(k) + ":" + sub(v) for k, v in o.items()) + "}"
    if isinstance(o, (set, frozenset)):
        name = "set" if isinstance(o, set) else "frozenset"
        return name + "{" + ",".join(sorted(set(sub(x) for x in o))) + "}"
    raise TypeError(type(o))


for line in sys.stdin:
    req = json.loads(line)
    try:
        if "special" in req:
            obj = eval(req["special"], {})  # test-authored expressions only
        else:
            obj = build(req["value"], [])
        data = pickle.dumps(obj, protocol=req["proto"])
        text = "" if req.get("raw") else canon(pickle.loads(data))
        reply = {"pickle": data.hex(), "canon": text}
    except Exception as e:  # reported to the Rust side as a test failure
        reply = {"error": repr(e)}
    print(json.dumps(reply), flush=True)
