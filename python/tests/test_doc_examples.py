"""Every example in the README and docs/ runs as written, in the order shown, with its output checked.

The pages are read as a newcomer would copy them, the way cargo's and uv's
docs are tested:

- a ``sh`` block runs in bash (``set -e``) and must exit 0;
- a ``console`` block is a transcript: each ``$ `` line is run (a line
  ending in ``\\`` goes on) and what it prints, standard output and error
  together, must match the lines below it, where a line ``...`` stands for
  any number of lines and ``[..]`` for any text within a line (what varies
  between runs: times, dates, sizes of files with times in them);
- a ``python`` block is an excerpt of a complete file under examples/ (its
  lines appear there in the same order, indented or not), which a runnable
  block of the docs runs;
- a plain block is text (a diagram, messages); it holds no ``$ `` command.

An HTML comment on the line before a block changes that, as
``<!-- doc-test: KEY=VALUE; ... -->``: ``file=PATH`` names the file the block
shows, ``exit=N`` the exit code of the block's last command, ``cwd=repo``
runs it in the repository root instead of the page's scratch folder, and
``skip=REASON`` leaves it unrun with the reason (the test checks the
reason names the test that runs it instead, or why nothing can).

The blocks of one page run in order in one scratch folder where
``examples/``, ``scripts/`` and ``crates/`` of the repository are reachable,
so a file one example writes is there for the next; ``oomkit`` is the
installed console script; `cargo install` installs into the scratch folder,
built unoptimized (RELEASE_UNOPTIMIZED), and what it installed must run.
The torchrun port of the examples is replaced by a free one.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# What the examples reach in the repository from the page's scratch folder.
LINKED = ("examples", "scripts", "crates")
# The port the multi-node examples name; each run gets a free one instead.
DOC_PORT = "29500"
COMMAND_TIMEOUT_S = 300
DIRECTIVE = re.compile(r"^<!-- doc-test: (.*) -->$")
FENCE = re.compile(r"^( *)```(\w*)$")


@dataclass
class Block:
    """One fenced block of a page, with the directives on the line before it."""

    page: str
    line: int
    lang: str
    body: str
    directives: dict[str, str] = field(default_factory=dict)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, in order."""
    lines = (ROOT / page).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        indent = m.group(1)
        j = i + 1
        while j < len(lines) and lines[j] != indent + "```":
            j += 1
        directives: dict[str, str] = {}
        d = DIRECTIVE.match(lines[start - 1].strip()) if start > 0 else None
        if d:
            for part in d.group(1).split(";"):
                key, _, value = part.strip().partition("=")
                directives[key] = value
        # A block inside a list item is indented as a whole.
        body = "\n".join(line[len(indent) :] for line in lines[start + 1 : j]) + "\n"
        out.append(Block(page, start + 1, m.group(2), body, directives))
        i = j + 1
    return out


def commands(transcript: str) -> list[tuple[str, list[str]]]:
    """A console block's commands, each with the lines it is shown to print."""
    out: list[tuple[str, list[str]]] = []
    lines = transcript.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        assert line.startswith("$ "), f"a transcript starts with a `$ ` command, not {line!r}"
        cmd = line[2:]
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd + "\n" + lines[i]
        i += 1
        shown: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        out.append((cmd, shown))
    return out


def pattern(shown: list[str]) -> re.Pattern[str]:
    """The output a transcript shows, as a pattern: `...` lines and `[..]` match what varies."""
    parts = []
    for line in shown:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(r"[^\n]*".join(re.escape(p) for p in line.rstrip().split("[..]")) + r"\n")
    return re.compile("".join(parts))


def normalised(text: str) -> str:
    """Output with trailing spaces and trailing blank lines removed, ending in one newline."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


def _ends(out: str) -> str:
    """The start and the end of a long output, where the cause and the outcome are."""
    return out if len(out) < 8000 else f"{out[:3000]}\n[...]\n{out[-5000:]}"


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        start_new_session=True,
    )


#: Cargo's settings, by environment, that build the release profile unoptimized (see `_scratch`).
RELEASE_UNOPTIMIZED = {
    "CARGO_PROFILE_RELEASE_OPT_LEVEL": "0",
    "CARGO_PROFILE_RELEASE_LTO": "off",
    "CARGO_PROFILE_RELEASE_CODEGEN_UNITS": "256",
    "CARGO_PROFILE_RELEASE_DEBUG": "false",
}


def _scratch(tmp_path: Path, page: str) -> tuple[Path, dict[str, str]]:
    scratch = tmp_path / Path(page).stem
    scratch.mkdir()
    for name in LINKED:
        (scratch / name).symlink_to(ROOT / name)
    env = dict(
        os.environ,
        OOMKIT_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        NO_COLOR="1",
        TERM="dumb",
        # `cargo install` goes to the scratch folder, not ~/.cargo. It builds the
        # release profile, which nothing else in the suite builds (the package is
        # built in the dev profile): with thin LTO, 227 s of a 2-core machine's
        # CPU, 68 s unoptimized. What the test shows is that the command installs
        # a working oomkit, so it builds unoptimized (the flags and the lock file
        # are the page's), in a folder of its own: target/release stays what the
        # benchmarks (scripts/bench_*.py) take to be an optimized build.
        CARGO_INSTALL_ROOT=str(tmp_path / "cargo-root"),
        CARGO_TARGET_DIR=str(ROOT / "target" / "doc-test"),
        **RELEASE_UNOPTIMIZED,
    )
    # What the pages show assumes none of these is set in the reader's shell.
    for name in ("OOMKIT_FAKE_GPUS", "OOMKIT_PREFLIGHT_SERVER", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        env.pop(name, None)
    return scratch, env


def _python_file(block: Block) -> Optional[Path]:
    name = block.directives.get("file")
    return ROOT / name if name else None


def is_excerpt(block: str, text: str) -> bool:
    """Whether every line of `block` appears in `text`, in the same order (indentation aside)."""
    lines = iter(line.strip() for line in text.splitlines())
    return all(any(have == want for have in lines) for want in (w.strip() for w in block.splitlines()) if want)


def run_page(page: str, tmp_path: Path) -> None:
    scratch, env = _scratch(tmp_path, page)
    port = _free_port()
    for block in blocks(page):
        where = block.where()
        if "skip" in block.directives:
            continue
        body = block.body.replace(DOC_PORT, port)
        cwd = ROOT if block.directives.get("cwd") == "repo" else scratch
        want = int(block.directives.get("exit", "0"))
        if block.lang == "sh":
            p = _run(body, cwd, env)
            assert p.returncode == want, f"{where}: exit {p.returncode}, expected {want}\n{_ends(p.stdout)}"
        elif block.lang == "console":
            steps = commands(body)
            for n, (cmd, shown) in enumerate(steps):
                p = _run(cmd, cwd, env)
                code = want if n == len(steps) - 1 else 0
                out = normalised(p.stdout)
                assert p.returncode == code, f"{where}: `{cmd}` exited {p.returncode}, expected {code}\n{_ends(out)}"
                if not pattern(shown).fullmatch(out):
                    pytest.fail(
                        f"{where}: `{cmd}` printed what the page does not show.\n"
                        f"--- the page shows:\n{chr(10).join(shown)}\n--- it printed:\n{out}"
                    )
    # What a page's `cargo install` installed is a working oomkit.
    installed = Path(env["CARGO_INSTALL_ROOT"]) / "bin" / "oomkit"
    if installed.exists():
        p = _run(f"{installed} demo --save demo.pickle && {installed} analyze demo.pickle", scratch, env)
        assert p.returncode == 0 and "OUT OF MEMORY on cuda:0" in p.stdout, _ends(p.stdout)


def test_the_pages_blocks_follow_the_rules() -> None:
    """Every block is of a known kind, every skip says why, every Python block is a file that is run."""
    problems: list[str] = []
    runnable = "\n".join(
        b.body for page in PAGES for b in blocks(page) if b.lang in ("sh", "console") and "skip" not in b.directives
    )
    tests = "\n".join(p.read_text() for p in (ROOT / "python" / "tests").glob("test_*.py"))
    for page in PAGES:
        for b in blocks(page):
            where = b.where()
            if b.lang == "python":
                path = _python_file(b)
                if path is None:
                    problems.append(f"{where}: a Python example names its file under examples/ (file=...)")
                elif not path.is_file():
                    problems.append(f"{where}: {path} does not exist")
                elif not is_excerpt(b.body, path.read_text()):
                    problems.append(f"{where}: the block is not an excerpt of {b.directives['file']}")
                elif b.directives["file"] not in runnable and "python/tests/" not in b.directives.get("skip", ""):
                    problems.append(f"{where}: no example of the docs runs {b.directives['file']}")
            elif b.lang in ("", "text") and any(line.startswith("$ ") for line in b.body.splitlines()):
                problems.append(f"{where}: a transcript is a `console` block, so that it is checked")
            elif b.lang not in ("sh", "console", "python", "", "text", "json"):
                problems.append(f"{where}: unknown block kind {b.lang!r}")
            skip = b.directives.get("skip")
            if skip is not None:
                named = re.findall(r"python/tests/(test_\w+\.py)(?:::(\w+))?", skip)
                if not named and "cannot run" not in skip:
                    problems.append(
                        f"{where}: skip= names the test that runs the block instead, or says why it cannot run"
                    )
                for file, test in named:
                    text = (ROOT / "python" / "tests" / file).read_text() if (ROOT / "python" / "tests" / file).exists() else ""
                    if not text or (test and f"def {test}(" not in text):
                        problems.append(f"{where}: skip= names python/tests/{file}::{test}, which does not exist")
            if b.lang == "sh" and "file" in b.directives:
                path = ROOT / b.directives["file"]
                if not path.is_file() or b.body not in path.read_text():
                    problems.append(f"{where}: the block is not the text of {b.directives['file']}")
    assert tests
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_examples_run_as_written(page: str, tmp_path: Path) -> None:
    if shutil.which("oomkit") is None:
        pytest.skip("the oomkit console script is not installed (scripts/test.sh installs it)")
    run_page(page, tmp_path)


def test_the_matcher_takes_what_varies_and_nothing_else() -> None:
    shown = ["== run-[..]-rank0.jsonl", "...", "peak 1.00 GiB"]
    assert pattern(shown).fullmatch("== run-20261124-1-rank0.jsonl\na\nb\npeak 1.00 GiB\n")
    assert pattern(shown).fullmatch("== run-x-rank0.jsonl\npeak 1.00 GiB\n")
    assert not pattern(shown).fullmatch("== run-x-rank0.jsonl\npeak 2.00 GiB\n")
    assert not pattern(["a [..] c"]).fullmatch("a b\nc\n"), "[..] stays within a line"
    assert commands("$ a \\\n  b\nout\n$ c\n") == [("a \\\n  b", ["out"]), ("c", [])]
    assert is_excerpt("a\n  c\n", "a\nb\n    c\n") and not is_excerpt("c\na\n", "a\nb\nc\n")
