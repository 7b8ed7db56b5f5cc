"""The runs after the first, forked from one warm interpreter: each is the script as a fresh ``python train.py`` runs it.

``oomkit preflight`` runs a ``python train.py`` command more than once where
fixes or a search follow the first run; those runs are forked from one Python
that imported torch once (``oomkit.preflight.warm``). Whatever the script can
see of how it was started must be what a fresh process shows it, and every
figure what a fresh run measures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from preflight_cli import OOMKIT, TRAIN_TWO_STEPS

#: A script that writes down what it can see of how it was started, then trains a step a batch wide.
FACTS = textwrap.dedent(
    """\
    import json, os, pickle, sys, threading
    import torch

    class Made:
        pass

    batch = int(sys.argv[sys.argv.index("--batch") + 1])
    main = sys.modules["__main__"]
    facts = {
        "argv": sys.argv,
        "name": __name__,
        "file": __file__,
        "main_file": main.__file__,
        "path0": sys.path[0],
        "scratch_on_path": sys.path[1] == os.environ["PYTHONPATH"].split(os.pathsep)[0],
        "pickled_by": pickle.dumps(Made()).split(b"\\x94")[0][-8:].decode("latin-1"),
        "stdin": sys.stdin.read(),
        "spec": getattr(main.__spec__, "name", None),
        "cwd": os.getcwd(),
        "threads": threading.active_count(),
    }
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"facts-{batch}-{sys.argv[-1]}.json"), "w") as f:
        json.dump(facts, f)
    """
) + TRAIN_TWO_STEPS


def _preflight(
    script: Path, *flags: str, args: tuple[str, ...], command: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess[str]:
    """``oomkit preflight --json FLAGS -- COMMAND ARGS`` in the script's folder (COMMAND: ``python SCRIPT``),
    without the suite's shared warm Python: its own is what these tests set beside fresh runs."""
    env = {k: v for k, v in os.environ.items() if k != "OOMKIT_PREFLIGHT_SERVER"}
    return subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "1GiB", *flags, "--", *(command or (sys.executable, script.name)), *args],
        capture_output=True, text=True, timeout=300, cwd=script.parent, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["python train.py", "python -m train", "a program that starts Python on itself"])
def test_a_forked_run_sees_what_a_fresh_python_shows_the_script(tmp_path: Path, form: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(FACTS)
    command: tuple[str, ...] | None = None
    if form == "python -m train":
        command = (sys.executable, "-m", "train")
    elif form != "python train.py":
        # As pip writes a console script: the interpreter on its first line, the file executable.
        program = tmp_path / "trainer"
        program.write_text(f"#!{sys.executable}\n{FACTS}")
        program.chmod(0o755)
        command = (str(program),)
    # A search asks for more than one run from the start: every run of it is forked.
    searched = _preflight(script, "--micro-batch", "1", "--max-micro-batch", "2", args=("--batch", "{batch}", "warm"), command=command)
    assert searched.returncode == 0, searched.stderr
    # The answer alone (--no-fixes) is one run, started as a fresh process.
    fresh = _preflight(script, "--no-fixes", "--micro-batch", "2", args=("--batch", "{batch}", "fresh"), command=command)
    assert fresh.returncode == 0, fresh.stderr
    warm_facts = json.loads((tmp_path / "facts-2-warm.json").read_text())
    fresh_facts = json.loads((tmp_path / "facts-2-fresh.json").read_text())
    warm_facts["argv"][-1] = fresh_facts["argv"][-1] = "-"
    assert warm_facts == fresh_facts, (warm_facts, fresh_facts)
    assert fresh_facts["name"] == "__main__" and fresh_facts["pickled_by"].endswith("__main__"), fresh_facts
    assert dict(json.loads(searched.stdout)["tried"])[2] == json.loads(fresh.stdout)["run"]["fits"]


def test_each_figure_of_a_forked_run_is_the_fresh_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(FACTS)
    one = json.loads(_preflight(script, "--no-fixes", "--micro-batch", "2", args=("--batch", "{batch}", "x")).stdout)["run"]
    # --fixes: the first run too is forked, the fixes after it.
    forked = json.loads(_preflight(script, "--fixes", "--micro-batch", "2", args=("--batch", "{batch}", "x")).stdout)["run"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "by_role", "by_line", "phase_peaks", "step_peaks", "allocations", "notes"):
        assert forked[key] == one[key], key


def test_a_script_that_sets_a_compiler_setting_is_run_fresh_where_it_is_read(tmp_path: Path) -> None:
    # The compiler reads its settings when torch._dynamo is imported, which the warm
    # interpreter has done: a script that sets one first gets a fresh process, and the figure
    # the setting makes.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os, sys
            if "--tune" in sys.argv:
                os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"
            import torch
            import torch._inductor.config as config

            # 64 MiB more where the setting was read.
            held = torch.empty(16 << 20 if config.max_autotune else 1, device="cuda")
            model = torch.nn.Linear(64, 64).cuda()
            opt = torch.optim.SGD(model.parameters())
            for _ in range(2):
                model(torch.randn(4, 64, device="cuda")).sum().backward()
                opt.step()
            """
        )
    )
    peaks = {}
    for args in (("--tune",), ()):
        fresh = json.loads(_preflight(script, "--no-fixes", args=args).stdout)["run"]["peak_allocated_bytes"]
        forked = json.loads(_preflight(script, "--fixes", args=args).stdout)["run"]["peak_allocated_bytes"]
        assert forked == fresh, (args, forked, fresh)
        peaks[args] = fresh
    # The setting's 64 MiB, less the one element's 512-byte block it replaces.
    assert peaks[("--tune",)] - peaks[()] == (64 << 20) - 512, peaks


def test_a_forked_run_that_fails_says_what_a_fresh_one_says(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """\
            import sys
            import torch
            batch = int(sys.argv[-1])
            model = torch.nn.Linear(64, 64).cuda()
            if batch == 2:
                raise ValueError("a batch of two is refused")
            opt = torch.optim.SGD(model.parameters())
            for _ in range(2):
                model(torch.randn(batch, 64, device="cuda")).sum().backward()
                opt.step()
            """
        )
    )
    fresh = _preflight(script, "--no-fixes", "--micro-batch", "2", args=("{batch}",))
    searched = _preflight(script, "--micro-batch", "1", "--max-micro-batch", "2", args=("{batch}",))
    assert fresh.returncode == searched.returncode != 0, (fresh.stderr, searched.stderr)
    said = [line for line in searched.stderr.splitlines() if line.startswith("oomkit: preflight:")]
    assert said and said == [line for line in fresh.stderr.splitlines() if line.startswith("oomkit: preflight:")], (
        searched.stderr,
        fresh.stderr,
    )
    assert "a batch of two is refused" in said[-1], said
    # The traceback the script's own stderr shows begins at the script, as a fresh Python's does.
    assert 'File "' + str(script) + '", line 6' in searched.stderr, searched.stderr
    assert "warm.py" not in searched.stderr, searched.stderr
