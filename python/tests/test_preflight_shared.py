"""A warm Python shared by many ``oomkit preflight`` commands (``python -m oomkit.preflight.warm --serve``).

Every run of a command whose environment names it (``OOMKIT_PREFLIGHT_SERVER``),
the first included, is forked there: what the script sees and every figure must
be what a fresh Python gives, where the command's interpreter and environment
are the server's; anything else is refused, said once, and runs fresh.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from preflight_cli import OOMKIT, TRAIN_TWO_STEPS
from procs import running

#: A script that writes down what it can see of how it was started (and whose process forked it),
#: then trains two steps a batch wide.
FACTS = textwrap.dedent(
    """\
    import json, os, sys
    import torch

    def parent_of(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    batch = int(sys.argv[1])
    facts = {
        "argv": sys.argv,
        "file": __file__,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env_here": os.environ.get("ONLY_HERE"),
        "grandparent": parent_of(os.getppid()),
    }
    with open(sys.argv[2], "w") as f:
        json.dump(facts, f)
    print("training", batch)
    """
) + TRAIN_TWO_STEPS


def _environ(**extra: str) -> dict[str, str]:
    """This process's environment without the suite's own shared Python, with ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "OOMKIT_PREFLIGHT_SERVER"}
    env.update(extra)
    return env


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A shared warm Python of this test's own, on a socket in its folder (pytest names the test
    running in the environment, one way while it sets up, another while it runs: let differ)."""
    sock = tmp_path / "warm.sock"
    p = subprocess.Popen(
        [sys.executable, "-m", "oomkit.preflight.warm", "--serve", str(sock), "--ignore", "PYTEST_CURRENT_TEST"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_environ(),
    )  # fmt: skip
    assert p.stdout is not None
    assert json.loads(p.stdout.readline()) == {"ready": True, "socket": str(sock)}
    yield p, sock
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    assert not sock.exists(), "the server takes its socket away when it stops"


def _preflight(cwd: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "1GiB", "--no-fixes", "--", sys.executable, *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )  # fmt: skip


def test_a_served_run_sees_what_a_fresh_python_shows_it_and_measures_the_same(tmp_path: Path, server) -> None:
    proc, sock = server
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(FACTS)
    served = _preflight(work, "train.py", "8", "served.json", env=_environ(OOMKIT_PREFLIGHT_SERVER=str(sock)))
    fresh = _preflight(work, "train.py", "8", "fresh.json", env=_environ())
    assert served.returncode == fresh.returncode == 0, (served.stderr, fresh.stderr)
    s, f = (json.loads((work / name).read_text()) for name in ("served.json", "fresh.json"))
    # The served run is a child of the handler the server forked for the command; the fresh one, of oomkit's child.
    assert s.pop("grandparent") == proc.pid
    assert f.pop("grandparent") != proc.pid
    s["argv"][-1] = f["argv"][-1] = "-"
    assert s == f, (s, f)
    assert s["cwd"] == str(work), "the run is in the command's folder, not the server's"
    assert json.loads(served.stdout)["run"] == json.loads(fresh.stdout)["run"]
    # Its output is the command's stderr, as a fresh run's is; and the server took it without a word.
    assert "training 8" in served.stderr and "did not take" not in served.stderr, served.stderr


def test_a_command_whose_environment_differs_is_refused_said_once_and_run_fresh(tmp_path: Path, server) -> None:
    proc, sock = server
    (tmp_path / "train.py").write_text(FACTS)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--capacity", "1GiB", "--micro-batch", "2", "--max-micro-batch", "8", "--",
         sys.executable, "train.py", "{batch}", "facts.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=_environ(OOMKIT_PREFLIGHT_SERVER=str(sock), ONLY_HERE="1"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    refusals = [line for line in p.stderr.splitlines() if "did not take" in line]
    assert refusals == [
        f"oomkit: preflight: the warm Python at {sock} (OOMKIT_PREFLIGHT_SERVER) did not take this command's runs: "
        "its environment differs from the server's in ONLY_HERE; they start here"
    ], p.stderr
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert facts["env_here"] == "1" and facts["grandparent"] != proc.pid
    # The search went on, through the command's own warm Python, to the largest micro-batch asked.
    assert dict(json.loads(p.stdout)["tried"])[8] is True, p.stdout


def test_a_server_that_cannot_be_reached_is_said_and_every_run_starts_here(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(FACTS)
    gone = tmp_path / "no-server.sock"
    p = _preflight(tmp_path, "train.py", "4", "facts.json", env=_environ(OOMKIT_PREFLIGHT_SERVER=str(gone)))
    assert p.returncode == 0, p.stderr
    assert f"the warm Python at {gone} (OOMKIT_PREFLIGHT_SERVER) did not take this command's runs: cannot reach it" in p.stderr
    assert json.loads(p.stdout)["run"]["fits"] is True


def test_a_served_run_that_starts_again_fresh_says_why_its_output_repeats(tmp_path: Path, server) -> None:
    """A script that sets a compiler setting after printing: the served run stops where it sets it
    and runs again fresh, so its first line shows twice, and the command says why between them."""
    _, sock = server
    (tmp_path / "train.py").write_text(
        "import os\nprint('starting', flush=True)\nos.environ['TORCHINDUCTOR_MAX_AUTOTUNE'] = '1'\nimport torch\nbatch = 4\n"
        + TRAIN_TWO_STEPS
    )
    p = _preflight(tmp_path, "train.py", env=_environ(OOMKIT_PREFLIGHT_SERVER=str(sock)))
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    said = (
        "oomkit: preflight: the script sets TORCHINDUCTOR_MAX_AUTOTUNE, which PyTorch reads as it is imported: "
        "the run starts again as a fresh process, and what it printed above is printed again"
    )
    assert lines.count("starting") == 2 and said in lines, p.stderr
    assert lines.index("starting") < lines.index(said) < len(lines) - 1 - lines[::-1].index("starting"), p.stderr
    assert json.loads(p.stdout)["run"]["fits"] is True


@pytest.mark.parametrize("how", ["served", "fresh", "fixes"])
def test_a_run_whose_command_is_killed_is_killed_with_it(tmp_path: Path, how: str, request) -> None:
    """A time limit or a scheduler that kills oomkit ends the script it was running: served by a
    shared Python, started fresh (one run, --no-fixes), or among the fixes' runs. SIGKILL, which
    oomkit cannot catch and pass on."""
    env = _environ()
    flags = ["--no-fixes"] if how == "fresh" else []
    if how == "served":
        _, sock = request.getfixturevalue("server")
        env["OOMKIT_PREFLIGHT_SERVER"] = str(sock)
    (tmp_path / "hang.py").write_text(
        "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    p = subprocess.Popen(
        [OOMKIT, "preflight", *flags, "--", sys.executable, "hang.py", "pid"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the run outlived its command")
        time.sleep(0.1)


def test_a_socket_already_there_is_refused_with_one_line(tmp_path: Path) -> None:
    sock = tmp_path / "taken.sock"
    sock.write_text("")
    p = subprocess.run(
        [sys.executable, "-m", "oomkit.preflight.warm", "--serve", str(sock)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"oomkit preflight server: cannot listen on {sock}: Address already in use"]
    assert sock.read_text() == "", "nothing there is lost"
