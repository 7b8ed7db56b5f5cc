"""A warm interpreter for the runs of one ``oomkit preflight`` after its first: each run a fork of it.

``oomkit preflight`` runs the user's script once, then again for each fix it
tries and each micro-batch it searches. A fresh Python spends several seconds
importing torch before the script's first line (more than the whole run of a
small script on tensors without data), so the command starts this module once
(``python -m oomkit.preflight.warm``), with the script's own interpreter and
environment, and asks it for each run. It imports what the hook of a run imports
before the script (``oomkit.preflight.script``, and torch with it) and
``torch._dynamo`` (which every optimizer's constructor imports), nothing more, so a
run forked from it starts where a fresh one would: the script is ``__main__``,
``sys.argv`` and ``sys.path`` are what ``python train.py`` gives, the preflight is
installed from the run's ``OOMKIT_PREFLIGHT`` before its first line, and at its end
the interpreter exits as Python does (exit hooks, exit code).

PyTorch's compiler reads its settings from the environment once, when
``torch._dynamo`` is imported: a run whose script sets one of them
(:data:`COMPILER_SETTINGS`) stops at once, leaving :data:`FRESH` in its folder,
and the command runs it again as a fresh process, where the script's setting
is read as it would be.

The protocol, a line of JSON each way: the command writes a run on stdin
(``{"id", "script" or "module", "args", "env", "quiet"}``); this process answers ``{"ready": true}``
once imported, then ``{"id", "code"}`` when that run's process has ended (its exit
code, or minus the signal that ended it). At the end of stdin it waits for the runs
still going and exits. Where it cannot import, it exits with
:data:`EXIT_CANNOT_WARM` and the command starts each run as a fresh process.
"""

from __future__ import annotations

import json
import os
import select
import sys
import types
from typing import Any

#: The exit code where the imports a run needs fail here: the command starts each run itself.
EXIT_CANNOT_WARM = 3

#: The environment variables PyTorch's compiler reads when ``torch._dynamo`` is
#: imported (its config modules: dynamo, inductor, functorch), by how they begin.
COMPILER_SETTINGS = (
    "TORCHDYNAMO", "TORCH_DYNAMO", "TORCHINDUCTOR", "TORCH_INDUCTOR", "INDUCTOR", "AOT_INDUCTOR", "AOTINDUCTOR",
    "TORCH_COMPILE", "TORCHFUNCTORCH", "TORCH_FAKE",
)  # fmt: skip

#: The file a run leaves in its folder where it must run again as a fresh process.
FRESH = "fresh"

#: How long the loop waits for a request before it reaps the runs that ended (seconds).
POLL_SECONDS = 0.05


def main() -> None:
    """Imports what a run needs, serves runs until stdin ends, and in each forked run, runs the script."""
    shown = os.dup(2)  # where a run that is shown writes (the command's stderr)
    answers = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    # This process's own output (an import's warnings) is nobody's: the runs' is theirs.
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        import torch._dynamo  # noqa: F401  (what every optimizer's constructor imports)

        import oomkit.preflight.script  # noqa: F401  (what the hook of every run imports first)
    except Exception:  # noqa: BLE001  (whatever stops the imports, each run starts fresh and says it)
        os._exit(EXIT_CANNOT_WARM)
    request = _serve(answers, shown, null)
    if request is None:
        os._exit(0)
    _run(request)


def _serve(answers: int, shown: int, null: int) -> dict[str, Any] | None:
    """Forks a process for each run asked for and says when each ends; returns the run in a
    forked process, None in this one once stdin has ended and every run with it."""
    os.write(answers, b'{"ready": true}\n')
    running: dict[int, Any] = {}
    pending = b""
    open_ = True
    while open_ or running:
        if open_ and select.select([0], [], [], POLL_SECONDS)[0]:
            data = os.read(0, 1 << 16)
            open_ = bool(data)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _as_a_run(request, answers, shown, null)
                    return request
                running[pid] = request["id"]
        elif not open_:
            # Nothing more will be asked: wait for the runs still going.
            pid, status = os.waitpid(-1, 0)
            _ended(answers, running, pid, status)
            continue
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _ended(answers, running, pid, status)
    return None


def _ended(answers: int, running: dict[int, Any], pid: int, status: int) -> None:
    """Says that run ``pid`` ended, with its exit code (minus the signal that ended it)."""
    ident = running.pop(pid, None)
    if ident is None:
        return
    code = os.waitstatus_to_exitcode(status)
    os.write(answers, json.dumps({"id": ident, "code": code}).encode() + b"\n")


def _as_a_run(request: dict[str, Any], answers: int, shown: int, null: int) -> None:
    """In the forked process: the files, environment and ``sys`` a fresh ``python SCRIPT ARGS``
    (or ``python -m MODULE ARGS``) has."""
    os.close(answers)
    # The requests are this process's to read, not the script's: its stdin is empty (a fresh
    # run has the command's; a script that asks for input under preflight waits either way).
    os.dup2(null, 0)
    out = null if request["quiet"] else shown
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(shown)
    os.close(null)
    # Python buffers stdout by line only where it is a terminal, deciding at start: decide again.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=os.isatty(stream.fileno()))
    env = request["env"]
    os.environ.update(env)
    # sys.argv and sys.path as Python makes them: the script as given (``-m`` until runpy names the
    # module's file), then the script's folder (the working one for ``-m``), PYTHONPATH's, the rest.
    module = request.get("module")
    sys.argv = ["-m" if module else request["script"], *request["args"]]
    rest = sys.path[1:]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in rest]
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(request["script"]))
    sys.path[:] = [first, *extra, *rest]
    _fresh_where_the_compiler_is_set(env)


def _fresh_where_the_compiler_is_set(env: dict[str, str]) -> None:
    """Stops the run, for the command to run it fresh, where the script (or a library it
    imports, not PyTorch) sets a variable the compiler read before the script began."""
    from oomkit.preflight.record.frames import RUNTIME, TORCH, classify

    try:
        folder = os.path.dirname(json.loads(env["OOMKIT_PREFLIGHT"])["result"])
    except (KeyError, TypeError, ValueError):
        return
    setitem = os._Environ.__setitem__

    def watched(self: Any, key: Any, value: Any) -> None:
        if self is os.environ and isinstance(key, str) and key.startswith(COMPILER_SETTINGS):
            frame: types.FrameType | None = sys._getframe(1)
            while frame is not None and classify(frame.f_code.co_filename) == RUNTIME:
                frame = frame.f_back
            if frame is not None and classify(frame.f_code.co_filename) != TORCH:
                with open(os.path.join(folder, FRESH), "w") as f:
                    f.write(key)
                # The code is not read: the mark says what happened.
                os._exit(EXIT_CANNOT_WARM)
        setitem(self, key, value)

    os._Environ.__setitem__ = watched  # type: ignore[method-assign]


def _run(request: dict[str, Any]) -> None:
    """Runs the script (or ``-m`` module) as ``__main__`` under the preflight and exits as Python would after it."""
    import builtins
    import importlib.machinery
    import runpy

    from oomkit.preflight.script import install

    here = _run.__code__.co_filename
    install()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # The script is __main__ for the rest of the process (its classes pickle by that name).
    sys.modules["__main__"] = main
    code = 0
    try:
        module = request.get("module")
        if module:
            # What ``python -m`` itself calls, in the fresh ``__main__`` above.
            runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
        else:
            # Python names the script's file in full (``__file__``, its frames), whatever ``sys.argv[0]`` says.
            script = os.path.abspath(request["script"])
            main.__file__ = script
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
            main.__spec__ = None
            main.__dict__["__cached__"] = None
            with open(script, "rb") as f:
                source = f.read()
            exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (what Python does with any: print it, exit 1)
        # As Python prints it: from the script's first frame (runpy's, for -m), not this module's.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == here:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
