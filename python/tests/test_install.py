"""The README's install paths, tried from a clean virtual environment."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_installs_with_its_torch_extra_into_a_fresh_environment(tmp_path: Path) -> None:
    # README, "Quick start": `python3 -m venv .venv && . .venv/bin/activate; pip install '.[torch]'`.
    # The fresh environment sees this one's packages through a .pth file, so
    # that the torch extra is satisfied by the PyTorch already here (nothing
    # is downloaded) and maturin builds from the same target/ folder. It has
    # no pip of its own (this one's runs in it), so that no older setuptools
    # of its own hides the one torch needs.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # This environment's own packages first, in a fixed order: listed after
    # the system's, the system's older setuptools would hide the one torch
    # needs (a set here made that a coin toss per run).
    paths = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    here = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    Path(purelib, "outer.pth").write_text("\n".join(here) + "\n")
    p = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-build-isolation", "--no-index", f"{ROOT}[torch]"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target")),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Requirement already satisfied: torch" in p.stdout, p.stdout[-3000:]
    # The package is the fresh environment's own, with its console script.
    where = subprocess.run([str(py), "-c", "import oomkit; print(oomkit.__file__)"], capture_output=True, text=True, check=True)
    assert where.stdout.startswith(purelib), where.stdout
    demo = subprocess.run([str(venv / "bin" / "oomkit"), "demo"], capture_output=True, text=True)
    assert demo.returncode == 0 and demo.stdout.startswith("== demo_snapshot.pickle (bundled)"), demo.stderr
