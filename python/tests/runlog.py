"""Reading a run log's records in tests."""

from __future__ import annotations

import json


def records(path, kind):
    """The records of one type, in order."""
    return [r for r in map(json.loads, open(path)) if r["type"] == kind]


def stages_by_step(path):
    """Each step's stage names, in order."""
    out = {}
    for r in records(path, "stage"):
        out.setdefault(r["step"], []).append(r["name"])
    return out
