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


def test_the_stub_matches_the_extension():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (scripts/test.sh installs it): the stub is not checked")
    p = subprocess.run([sys.executable, "-m", "mypy.stubtest", "oomkit._native"], capture_output=True, text=True)
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
