"""A warm interpreter for the runs of one ``oomkit preflight`` after its first: each run a fork of it.

``oomkit preflight`` runs the user's script once, then again for each fix it
tries and each micro-batch it searches. A fresh Python spends several seconds
importing torch before the script's first line (more than the whole run of a
small script on tensors without data), so the command starts this module's
:func:`main` once (from ``python -c``, which exits quietly where this module does
not import), with the script's own interpreter and environment, and asks it for
each run. It imports what the hook of a run imports
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

Started as ``python -m oomkit.preflight.warm --serve SOCKET``, the same
interpreter serves every ``oomkit preflight`` whose environment names it
(``OOMKIT_PREFLIGHT_SERVER=SOCKET``), first runs included, until it is stopped:
for a machine that runs many (CI, a sweep). A command asks on a connection of
its own (a line of JSON: the run as above, with ``python``, ``cwd`` and
``environ``, the command's whole environment) and is answered a line
(``{"accepted": true}``, or ``{"refused": why}`` where the run would not see what
a fresh Python shows it: another interpreter, or an environment that differs
in anything but :data:`IGNORED_ALWAYS` and the names given to ``--ignore``, as
the imports here read it), then the run's output in frames (``O``, a 4-byte
length, the bytes) and its end (``E``, its code as 4 signed bytes). A run whose
command goes away is killed, with what it started.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
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

#: The exit code where the server's socket cannot be made (a file already there, a folder missing).
EXIT_CANNOT_LISTEN = 2

#: What may differ between a served command's environment and the server's: the shell's
#: own bookkeeping, the server's name, what the command sets for each run itself, and the
#: interpreter pip's ``oomkit`` names for the command (the run is given the command's own).
IGNORED_ALWAYS = frozenset({"PWD", "OLDPWD", "_", "SHLVL", "OOMKIT_PREFLIGHT_SERVER", "OOMKIT_PREFLIGHT", "OOMKIT_PYTHON"})

#: How many commands may wait to be accepted by the shared server at once.
BACKLOG = 64

#: The most reads of a served run's output after it ended (a process it started may still
#: write there): what the pipe held is read in one or two, and a writer without end is left.
LAST_OUTPUT_READS = 16


def main() -> None:
    """Imports what a run needs, serves runs until stdin ends (or, with ``--serve``, every
    command that asks on the socket), and in each forked run, runs the script."""
    if len(sys.argv) > 1:
        serve_shared(sys.argv[1:])
        return
    shown = os.dup(2)  # where a run that is shown writes (the command's stderr)
    answers = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    # This process's own output (an import's warnings) is nobody's: the runs' is theirs.
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        _import_what_runs_need()
    except Exception:  # noqa: BLE001  (whatever stops the imports, each run starts fresh and says it)
        os._exit(EXIT_CANNOT_WARM)
    request = _serve(answers, shown, null)
    if request is None:
        os._exit(0)
    _run(request)


def _import_what_runs_need() -> None:
    """Imports what every run would import first: the hook of a run (``oomkit.preflight.script``,
    and torch with it) and ``torch._dynamo``, which every optimizer's constructor imports."""
    import torch._dynamo  # noqa: F401

    import oomkit.preflight.script  # noqa: F401


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
    (or ``python -m MODULE ARGS``) has; ``answers`` is closed where there is one (-1: none)."""
    if answers >= 0:
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
    if "cwd" in request:
        os.chdir(request["cwd"])
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


def serve_shared(argv: list[str]) -> None:
    """``--serve SOCKET [--ignore NAME,...]``: imports once, then serves every command that asks, until stopped."""
    ap = argparse.ArgumentParser(prog="python -m oomkit.preflight.warm", description=serve_shared.__doc__)
    ap.add_argument("--serve", required=True, metavar="SOCKET", help="the Unix socket to listen on (made here; removed at the end)")
    ap.add_argument("--ignore", default="", metavar="NAME,...", help="environment variables a command may set otherwise")
    args = ap.parse_args(argv)
    ignored = IGNORED_ALWAYS | {n for n in args.ignore.split(",") if n}
    # What a command's must match: the environment as started (the imports add to it, as a fresh run's do).
    environ = dict(os.environ)
    try:
        _import_what_runs_need()
    except Exception as e:  # noqa: BLE001
        print(f"oomkit preflight server: cannot import what a run needs: {e}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_WARM)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(args.serve)
    except OSError as e:
        print(f"oomkit preflight server: cannot listen on {args.serve}: {e.strerror or e}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_LISTEN)
    listener.listen(BACKLOG)
    # The commands' handlers are reaped as they end; each handler waits for its own run.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"ready": True, "socket": args.serve}), flush=True)
    server = os.getpid()
    try:
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    _handle(conn, environ, ignored)
                except Exception as e:  # noqa: BLE001  (a request it cannot read: one line, this command only)
                    print(f"oomkit preflight server: a command's request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    os._exit(1)
                os._exit(0)
            conn.close()
    except KeyboardInterrupt:
        pass
    finally:
        # A run ends by leaving through here too (SystemExit): only the server takes its socket away.
        if os.getpid() == server:
            listener.close()
            if os.path.exists(args.serve):
                os.unlink(args.serve)


def _refusal(request: dict[str, Any], environ: dict[str, str], ignored: frozenset[str] | set[str]) -> str | None:
    """Why a command's run would not see here what a fresh Python shows it, or None where it would."""
    if not _same_python(str(request.get("python")), sys.executable):
        return f"it runs {request.get('python')}, this server {sys.executable}"
    theirs = request.get("environ")
    if not isinstance(theirs, dict):
        return "the command sent no environment"
    differ = sorted(k for k in set(environ) | set(theirs) if k not in ignored and environ.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
        return f"its environment differs from the server's in {shown}"
    return None


def _same_python(theirs: str, mine: str) -> bool:
    """Whether two interpreters' paths start the same Python with the same packages: the same
    file, or two names for one file in one folder (a virtual environment's ``python`` and ``python3``)."""
    if theirs == mine:
        return True
    same_folder = os.path.dirname(theirs) == os.path.dirname(mine)
    return same_folder and os.path.realpath(theirs) == os.path.realpath(mine)


def _handle(conn: socket.socket, environ: dict[str, str], ignored: frozenset[str] | set[str]) -> None:
    """One command: its run checked, forked, its output and end sent back; killed if the command goes."""
    stream = conn.makefile("rb")
    try:
        request = json.loads(stream.readline())
    except ValueError:
        return
    why = _refusal(request, environ, ignored)
    if why is not None:
        # Said to the command, and to whoever watches the server.
        print(f"oomkit preflight server: refused {request.get('script') or request.get('module')}: {why}", file=sys.stderr, flush=True)
        conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
        return
    conn.sendall(b'{"accepted": true}\n')
    read, write = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    pid = os.fork()
    if pid == 0:
        # The run and what it starts are a group of their own, killed together if the command goes.
        os.setpgid(0, 0)
        stream.close()
        conn.close()
        os.close(read)
        # The rest is the server's already (with what the imports set): what may differ is the command's.
        theirs = request["environ"]
        for name in ignored:
            if name in theirs:
                os.environ[name] = theirs[name]
            else:
                os.environ.pop(name, None)
        _as_a_run(request, -1, write, null)
        _run(request)
        return
    os.close(write)
    os.close(null)

    def send(frame: bytes) -> bool:
        try:
            conn.sendall(frame)
            return True
        except OSError:
            return False

    def send_output(data: bytes) -> bool:
        return send(b"O" + struct.pack(">I", len(data)) + data)

    code: int | None = None
    gone = False
    command = conn.fileno()
    while code is None:
        ready = select.select([read, command], [], [], POLL_SECONDS)[0]
        if read in ready:
            data = os.read(read, 1 << 16)
            if data and not gone:
                gone = not send_output(data)
        if command in ready and not gone:
            try:
                gone = not conn.recv(1, socket.MSG_PEEK)
            except OSError:
                gone = True
        if gone:
            # The command is gone: so is its run, with what it started.
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
    # What the run wrote last, before it ended.
    for _ in range(LAST_OUTPUT_READS):
        if not select.select([read], [], [], 0)[0]:
            break
        data = os.read(read, 1 << 16)
        if not data or not send_output(data):
            break
    send(b"E" + struct.pack(">i", code))


if __name__ == "__main__":
    main()
