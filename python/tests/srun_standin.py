"""A stand-in for SLURM's `srun` where SLURM is absent: runs one command as N tasks of a job step.

It does what oomkit relies on from `srun` (sbatch(1), srun(1)): each task
gets `SLURM_PROCID`, `SLURM_NTASKS` and the caller's environment; the
tasks' output goes to srun's own; `-K`/`--kill-on-bad-exit` stops every
other task as soon as one exits non-zero; srun exits with the highest exit
code of its tasks.

    python srun_standin.py [-K] [-n N | --ntasks N] CMD ARGS...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# How long a task has to exit after SIGTERM before it is killed, as srun's KillWait.
KILL_WAIT_S = 2.0


def main(argv: list[str]) -> int:
    kill_on_bad_exit = False
    ntasks = 1
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        if a in ("-K", "--kill-on-bad-exit", "--kill-on-bad-exit=1"):
            kill_on_bad_exit = True
        elif a in ("-n", "--ntasks"):
            i += 1
            ntasks = int(argv[i])
        elif a.startswith("--ntasks="):
            ntasks = int(a.split("=", 1)[1])
        else:
            sys.stderr.write(f"srun_standin: unknown option {a}\n")
            return 2
        i += 1
    command = argv[i:]
    if not command:
        sys.stderr.write("srun_standin: no command\n")
        return 2
    tasks = [
        subprocess.Popen(command, env=dict(os.environ, SLURM_PROCID=str(n), SLURM_NTASKS=str(ntasks)))
        for n in range(ntasks)
    ]
    codes: dict[int, int] = {}
    while len(codes) < len(tasks):
        for n, t in enumerate(tasks):
            if n not in codes and t.poll() is not None:
                codes[n] = t.returncode
                if t.returncode != 0 and kill_on_bad_exit:
                    sys.stderr.write(f"srun_standin: task {n} exited with {t.returncode}; stopping the step (-K)\n")
                    _stop([u for m, u in enumerate(tasks) if m not in codes])
        time.sleep(0.05)
    # Signals read as 128 + n, as a shell reports them.
    return max(c if c >= 0 else 128 - c for c in codes.values())


def _stop(tasks: list[subprocess.Popen]) -> None:
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + KILL_WAIT_S
    for t in tasks:
        try:
            t.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            t.kill()
            t.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
