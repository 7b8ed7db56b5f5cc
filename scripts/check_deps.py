#!/usr/bin/env python3
"""Fails on a dependency nobody uses, an import circle, an import back up the Python side's layers, or a long function with no word on why it stays whole.

Run by scripts/test.sh; each rule is one that docs/architecture.md states:

- **Dependencies.** A crate that declares a dependency its code never uses,
  or the workspace one no crate uses. A dependency counts as used when its
  name (with `-` as `_`) appears as a path (`name::`) or in a `use` line in
  the crate's src/, tests/, examples/ or benches/ (and build.rs); crates
  used through derives alone are listed in MACRO_ONLY.
- **Import circles** between the modules of one crate (`crate::a` in b.rs
  and `crate::b` in a.rs, `super::` followed too) or of the Python package
  (`from oomkit._a import ...`, at any depth, `TYPE_CHECKING` imports
  included: a circle in the types is one in the design). Test code (a
  `#[cfg(test)]` module, tests.rs) is left out, and so is the crate's root
  (lib.rs re-exports every module: it is the crate's face, not a module).
- **The Python side's layers** (PYTHON_LAYERS): a module of the package
  that imports one of a layer above its own, or that no layer names.
- **Long functions.** A function over LONG_FUNCTION lines (Rust in crates/,
  Python in python/oomkit) needs a comment right above it (or, in Python,
  in its docstring) that says why it stays whole: "Long on purpose: ..."
  or words with "whole" in them.
"""

from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = os.path.join(ROOT, "crates")
PACKAGE = os.path.join(ROOT, "python", "oomkit")

# Used by a derive or attribute, so no `name::` appears.
MACRO_ONLY = {"serde", "thiserror"}

#: A function longer than this needs a comment saying why it stays whole
#: (docs/architecture.md: "no function over about 150 lines without ...").
LONG_FUNCTION = 150


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# ----- dependencies --------------------------------------------------------


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


def unused_dependencies() -> list[str]:
    problems = []
    all_declared = set()
    for crate in sorted(os.listdir(CRATES)):
        path = os.path.join(CRATES, crate)
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
    return problems


# ----- import circles ------------------------------------------------------


def _matching_brace(text: str, open_at: int) -> int:
    """The index just past the brace that closes the one at `open_at`."""
    depth, j = 0, open_at
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(text)


def rust_without_tests(text: str) -> str:
    """A Rust file without comments and without its `#[cfg(test)]` modules."""
    text = re.sub(r"//[^\n]*", "", text)
    out, at = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < at:
            continue
        out.append(text[at : m.start()])
        at = _matching_brace(text, m.end() - 1)
    out.append(text[at:])
    return "".join(out)


def rust_modules(crate_dir: str) -> dict[str, str]:
    """Each module of a crate (`a::b`; the root is ``""``) and its file, test modules left out."""
    src = os.path.join(crate_dir, "src")
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].replace(os.sep, "/")
            if rel in ("lib", "main") or rel.startswith("bin/"):
                name = ""
            elif rel.endswith("/mod"):
                name = rel[:-4].replace("/", "::")
            else:
                name = rel.replace("/", "::")
            if name.rsplit("::", 1)[-1] != "tests":
                mods[name] = os.path.join(dirpath, f)
    return mods


def _rust_paths(text: str) -> list[tuple[str, str]]:
    """Every `crate::`/`super::` path in the code, as (its head, the rest), groups (`crate::{a, b::c}`) opened."""
    found = []
    for m in re.finditer(r"\b(crate|super)((?:::\w+)*)::\{", text):
        end = _matching_brace(text, m.end() - 1)
        body, depth, item, items = text[m.end() : end - 1], 0, "", []
        for ch in body:
            depth += ch == "{"
            depth -= ch == "}"
            if ch == "," and depth == 0:
                items.append(item)
                item = ""
            else:
                item += ch
        items.append(item)
        prefix = m.group(2).lstrip(":")
        for it in items:
            head = re.match(r"\s*(\w+(?:::\w+)*)", it)
            if head:
                found.append((m.group(1), f"{prefix}::{head.group(1)}" if prefix else head.group(1)))
    for m in re.finditer(r"\b(crate|super)((?:::\w+)+)", text):
        found.append((m.group(1), m.group(2).lstrip(":")))
    return found


def rust_graph(crate_dir: str) -> dict[str, set[str]]:
    """Which modules each module of a crate uses, by `crate::` and `super::` paths."""
    mods = rust_modules(crate_dir)

    def resolve(path: str) -> str | None:
        parts = path.split("::")
        for k in range(len(parts), 0, -1):
            if "::".join(parts[:k]) in mods:
                return "::".join(parts[:k])
        return None

    graph: dict[str, set[str]] = {m: set() for m in mods if m}
    for name, path in mods.items():
        if not name:
            continue
        for head, rest in _rust_paths(rust_without_tests(_read(path))):
            parent = name.rsplit("::", 1)[0] if head == "super" and "::" in name else ""
            target = resolve(f"{parent}::{rest}" if parent else rest)
            if target and target != name:
                graph[name].add(target)
    return graph


def python_graph(package: str) -> dict[str, set[str]]:
    """Which modules each module of the Python package imports (the package itself left out)."""
    top = os.path.basename(package)
    mods = {}
    for dirpath, _, files in os.walk(package):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(package))[:-3].replace(os.sep, ".")
                mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    graph: dict[str, set[str]] = {m: set() for m in mods if m != top}
    for name, path in mods.items():
        if name == top:
            continue
        here = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(_read(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                # `from pkg import mod` reaches the module alone; `from pkg import name`, the package.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                known = target
                while known and known not in mods:
                    known = known.rsplit(".", 1)[0] if "." in known else ""
                if known and known not in (name, top):
                    graph[name].add(known)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other (Tarjan's strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_circles() -> list[str]:
    problems = []
    for crate in sorted(os.listdir(CRATES)):
        if os.path.isdir(os.path.join(CRATES, crate, "src")):
            for group in circles(rust_graph(os.path.join(CRATES, crate))):
                problems.append(f"crates/{crate}: an import circle between {', '.join(group)}: move what they share to the module that owns it")
    for group in circles(python_graph(PACKAGE)):
        problems.append(f"python/oomkit: an import circle between {', '.join(group)}: move what they share to the module that owns it")
    return problems


# ----- the Python side's layers --------------------------------------------

#: The Python package's layers, bottom first, as docs/architecture.md draws
#: them: a module may import modules of its own layer and of those below it,
#: never of one above. An entry names a module, or with ``.*`` a package and
#: everything in it; every module of the package is in exactly one layer (the
#: package's own ``__init__``, the public face, imports what it re-exports and
#: is left out).
PYTHON_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the base (the binding's stubs, OOM recognition, the plan `oomkit run` hands down)", ("oomkit._oom", "oomkit._elastic", "oomkit._plan")),
    ("the tracker", ("oomkit.tracker.*",)),
    ("keeping a run going from inside it", ("oomkit.auto_batch",)),
    ("preflight's vocabulary (settings, result, notes; no torch)", ("oomkit.preflight.settings", "oomkit.preflight.result", "oomkit.preflight.notes")),
    ("preflight's recorder", ("oomkit.preflight.record.*",)),
    ("preflight's frameworks", ("oomkit.preflight.frameworks.*",)),
    ("preflight's world (the fake GPU and its stand-ins)", ("oomkit.preflight.world.*",)),
    ("preflight's driver and fixes", ("oomkit.preflight.driver", "oomkit.preflight.fixes")),
    ("preflight's answer", ("oomkit.preflight.answer", "oomkit.preflight.snapshot")),
    ("preflight's ways in", ("oomkit.preflight", "oomkit.preflight.api", "oomkit.preflight.script", "oomkit.preflight.config", "oomkit.preflight.warm")),
    ("the console script", ("oomkit._cli",)),
    ("the framework integrations (imported only when used, by nothing of the core)", ("oomkit.integrations.*",)),
]


def python_layer(module: str) -> int | None:
    """The index in PYTHON_LAYERS of the layer ``module`` is in, or None."""
    for i, (_name, entries) in enumerate(PYTHON_LAYERS):
        for entry in entries:
            if module == entry.removesuffix(".*") or (entry.endswith(".*") and module.startswith(entry[:-1])):
                return i
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs back up the layers, and every module no layer names."""
    problems = []
    for module in sorted(graph):
        here = python_layer(module)
        if here is None:
            problems.append(f"python/oomkit: {module} is in no layer: add it to PYTHON_LAYERS in scripts/check_deps.py, where it belongs")
            continue
        for target in sorted(graph[module]):
            there = python_layer(target)
            if there is not None and there > here:
                problems.append(
                    f"python/oomkit: {module} ({PYTHON_LAYERS[here][0]}) imports {target} ({PYTHON_LAYERS[there][0]}), "
                    "a layer above it: move what it needs down, or the import up"
                )
    return problems


def python_layers() -> list[str]:
    return layer_violations(python_graph(PACKAGE))


# ----- long functions ------------------------------------------------------


def _says_why(comment: str) -> bool:
    """Whether a comment says why its function stays whole: "Long on purpose: ..." (the project's words) or "... whole"."""
    text = " ".join(comment.lower().replace("///", " ").replace("//", " ").replace("#", " ").split())
    return "long on purpose" in text or "whole" in text


def rust_long_functions(path: str) -> list[tuple[str, int, int, bool]]:
    """Each function over LONG_FUNCTION lines outside tests: (name, line, length, says why it stays whole)."""
    lines = rust_without_tests_keeping_lines(_read(path)).split("\n")
    found = []
    for i, line in enumerate(lines):
        m = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)", line)
        if not m:
            continue
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j >= len(lines) or "{" not in lines[j]:
            continue
        depth, k = 0, j
        while k < len(lines):
            depth += lines[k].count("{") - lines[k].count("}")
            if depth <= 0:
                break
            k += 1
        length = k - i + 1
        if length <= LONG_FUNCTION:
            continue
        above, p = [], i - 1
        while p >= 0 and lines[p].strip().startswith(("//", "#[")):
            above.append(lines[p])
            p -= 1
        found.append((m.group(1), i + 1, length, _says_why(" ".join(above))))
    return found


def rust_without_tests_keeping_lines(text: str) -> str:
    """A Rust file with its `#[cfg(test)]` modules blanked, line numbers and comments kept."""
    out, at = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < at:
            continue
        end = _matching_brace(text, m.end() - 1)
        out.append(text[at : m.start()])
        out.append("\n" * text.count("\n", m.start(), end))
        at = end
    out.append(text[at:])
    return "".join(out)


def python_long_functions(path: str) -> list[tuple[str, int, int, bool]]:
    """Each Python function over LONG_FUNCTION lines: (name, line, length, says why it stays whole)."""
    text = _read(path)
    lines = text.split("\n")
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length <= LONG_FUNCTION:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            above, p = [], first - 1
            while p >= 0 and lines[p].strip().startswith("#"):
                above.append(lines[p])
                p -= 1
            why = " ".join(above) + " " + (ast.get_docstring(node) or "")
            found.append((node.name, node.lineno, length, _says_why(why)))
    return found


def long_functions() -> list[str]:
    problems = []
    for base, ext, finder in ((CRATES, ".rs", rust_long_functions), (PACKAGE, ".py", python_long_functions)):
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d not in ("tests", "target", "__pycache__")]
            for f in sorted(files):
                if not f.endswith(ext) or f == "tests.rs":
                    continue
                path = os.path.join(dirpath, f)
                for name, line, length, why in finder(path):
                    if not why:
                        problems.append(
                            f"{os.path.relpath(path, ROOT)}:{line}: `{name}` is {length} lines, over {LONG_FUNCTION}, "
                            "with no comment above it saying why it stays whole: split it into named steps, or say why"
                        )
    return problems


def main() -> int:
    problems = unused_dependencies() + import_circles() + python_layers() + long_functions()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
