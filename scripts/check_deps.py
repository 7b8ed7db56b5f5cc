#!/usr/bin/env python3
"""Fails when a crate declares a dependency its code never uses, or the workspace one no crate uses.

Run by scripts/test.sh. A dependency counts as used when its name (with `-`
as `_`) appears as a path (`name::`) or in a `use` line in the crate's src/,
tests/, examples/ or benches/ (and build.rs). pyo3 and similar crates that
are used through macros are listed in MACRO_ONLY.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
# Used by a derive or attribute, so no `name::` appears.
MACRO_ONLY = {"serde", "thiserror"}


def declared(toml: str, table_prefix: str) -> list[str]:
    """Dependency names in the tables whose header starts with `table_prefix`."""
    names, on = [], False
    for line in toml.splitlines():
        header = re.match(r"^\[(.+)\]\s*$", line)
        if header:
            on = header.group(1).startswith(table_prefix)
            continue
        m = re.match(r"^([A-Za-z0-9_-]+)(?:\.workspace)?\s*=", line)
        if on and m:
            names.append(m.group(1))
    return names


def sources(crate_dir: str) -> str:
    text = []
    for sub in ("src", "tests", "examples", "benches"):
        for dirpath, _, files in os.walk(os.path.join(crate_dir, sub)):
            text += [_read(os.path.join(dirpath, f)) for f in files if f.endswith(".rs")]
    build = os.path.join(crate_dir, "build.rs")
    if os.path.exists(build):
        text.append(_read(build))
    return "\n".join(text)


def main() -> int:
    problems = []
    crates_dir = os.path.join(ROOT, "crates")
    all_declared = set()
    for crate in sorted(os.listdir(crates_dir)):
        path = os.path.join(crates_dir, crate)
        toml_path = os.path.join(path, "Cargo.toml")
        if not os.path.exists(toml_path):
            continue
        toml = _read(toml_path)
        code = sources(path)
        for name in declared(toml, "dependencies") + declared(toml, "dev-dependencies") + declared(toml, "build-dependencies"):
            all_declared.add(name)
            ident = name.replace("-", "_")
            if name in MACRO_ONLY:
                continue
            if not re.search(rf"\b{ident}::|\buse {ident}\b|extern crate {ident}\b", code):
                problems.append(f"crates/{crate}: declares `{name}` but never uses it")
    workspace = _read(os.path.join(ROOT, "Cargo.toml"))
    for name in declared(workspace, "workspace.dependencies"):
        if name not in all_declared:
            problems.append(f"Cargo.toml: [workspace.dependencies] lists `{name}`, which no crate uses")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
