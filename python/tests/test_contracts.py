"""Contracts scripts and type checkers rely on: exception names, the stub of the native module."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import oomkit
import pytest


def test_every_exception_oomkit_exports_is_an_oomkit_error_named_under_oomkit():
    errors = [v for v in vars(oomkit).values() if inspect.isclass(v) and issubclass(v, BaseException)]
    assert {e.__name__ for e in errors} >= {"OomkitError", "RunLogError", "BatchSizeError", "UsageError"}
    for e in errors:
        assert issubclass(e, oomkit.OomkitError), e
        assert e.__module__ == "oomkit", e
        assert repr(e) == f"<class 'oomkit.{e.__name__}'>"
    # The older bases stay, so existing handlers still catch them.
    assert issubclass(oomkit.BatchSizeError, RuntimeError) and issubclass(oomkit.UsageError, ValueError)
    with pytest.raises(oomkit.UsageError, match="at least 1"):
        oomkit.auto_batch(batch_size=0)


#: stubtest's mypy settings: the stub names no torch type, and following the package's imports
#: into torch took 32 of the check's 34 s. What the stub says of the module is checked as before.
STUBTEST_CONFIG = "[mypy]\n[mypy-torch.*]\nfollow_imports = skip\n"


def test_the_stub_matches_the_extension(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (scripts/test.sh installs it): the stub is not checked")
    config = tmp_path / "stubtest.ini"
    config.write_text(STUBTEST_CONFIG)
    p = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config), "oomkit._native"], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_the_child_environment_is_mirrored_once_in_python():
    import os
    import re

    from oomkit import _plan

    rust = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "oomkit-supervise", "src", "child_env.rs")
    if not os.path.exists(rust):
        pytest.skip("the Rust sources are not beside the tests")
    with open(rust) as f:
        names = set(re.findall(r'pub const [A-Z_]+: &str = "(OOMKIT_[A-Z_]+)";', f.read()))
    mirrored = {v for k, v in vars(_plan).items() if k.endswith("_ENV") and isinstance(v, str)}
    # OOMKIT_LOG_DIR is the user's to set, not oomkit run's.
    assert names == mirrored - {"OOMKIT_LOG_DIR"}, (names, mirrored)


def _documented_names() -> tuple[set[str], set[tuple[str, str]]]:
    """Every ``oomkit.x.y`` the README, docs/ and examples/ name, and every ``from oomkit... import name`` they show."""
    import glob
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    files = [os.path.join(root, "README.md")]
    files += glob.glob(os.path.join(root, "docs", "*.md")) + glob.glob(os.path.join(root, "examples", "**", "*.py"), recursive=True)
    dotted: set[str] = set()
    imported: set[tuple[str, str]] = set()
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        # Not a path (python/oomkit/...) or a file name (oomkit-logs): a dotted Python name.
        dotted.update(m.group(0) for m in re.finditer(r"(?<![\w/.-])oomkit(?:\.[A-Za-z_]\w*)+", text))
        for m in re.finditer(r"^\s*from (oomkit(?:\.\w+)*) import \(?([\w ,]+)", text, re.M):
            imported.update((m.group(1), n.split(" as ")[0].strip()) for n in m.group(2).split(",") if n.strip())
    return dotted, imported


def _resolve(dotted: str) -> object:
    """``dotted`` as Python finds it: the longest prefix that is a module, then attributes."""
    import importlib

    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_every_documented_name_imports() -> None:
    # The public imports stay as they are whatever moves inside the package:
    # every name the docs and examples use, and every name a package exports.
    import importlib

    dotted, imported = _documented_names()
    assert "oomkit.preflight" in dotted and ("oomkit.integrations.lightning", "OomkitCallback") in imported, (dotted, imported)
    for name in sorted(dotted):
        _resolve(name)
    for module, name in sorted(imported):
        assert hasattr(importlib.import_module(module), name), (module, name)
    for package in ("oomkit", "oomkit.preflight", "oomkit.tracker"):
        face = importlib.import_module(package)
        for name in face.__all__:
            assert getattr(face, name) is not None, (package, name)
    # `oomkit.preflight` is the function; its package is importable beside it.
    from oomkit.preflight import Preflight, PreflightError, preflight

    assert oomkit.preflight is preflight and callable(oomkit.preflight)
    # ... and a module of the package imports under a name of its own, through the function.
    import oomkit.preflight.world.cuda as cuda

    assert cuda.__name__ == "oomkit.preflight.world.cuda"
    assert PreflightError is oomkit.PreflightError and Preflight.__name__ == "Preflight"


def test_importing_oomkit_imports_no_torch_and_starts_no_thread() -> None:
    code = (
        "import sys, threading; import oomkit, oomkit.preflight, oomkit.tracker; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')), threading.active_count())"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["[]", "1"], p.stdout
