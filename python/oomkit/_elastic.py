"""The plan every rank of a torchrun job agrees on after an OOM, kept where it outlives a restart.

Under torchrun with ``--max-restarts``, a rank that runs out of memory
writes the next plan (a smaller micro-batch, more accumulation) and exits;
torch elastic then restarts every worker on every node, and each reads the
plan at start. The plan lives in torch elastic's own rendezvous store (the
c10d TCPStore that the agent on the endpoint host keeps alive across
restarts), so nothing of oomkit's listens on a port. On one node, where the
workers cannot learn the store's port (``--standalone`` picks it at run
time), a file in the temporary folder keyed by the agent's process does the
same job. Writes are compare-and-set against the plan that failed, so two
ranks running out at once step down once.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Optional

# The store key (or file) holds one JSON plan per torchrun job.
_KEY = "oomkit/plan"
# How long a worker waits to reach the rendezvous store before doing without it.
_STORE_TIMEOUT = timedelta(seconds=15)
# How many ancestors of a worker are searched for torchrun's command line
# (torchrun itself, or a shell script it started that runs Python).
_ANCESTORS = 4
# Compare-and-set rounds before giving up on agreeing (each loses only to
# another rank's write for the same failure).
_CAS_ROUNDS = 8
# How much of an OOM message travels with the plan to the other ranks.
MESSAGE_CHARS = 1000
# torchrun's own environment: set for every worker of every round.
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
# torchrun reads each flag from PET_<FLAG> too, and workers inherit it.
ENDPOINT_ENV = "PET_RDZV_ENDPOINT"


@dataclass(frozen=True)
class Agreed:
    """A plan the ranks agreed on after an OOM, or the verdict that no smaller one is allowed."""

    micro_batch: int
    grad_accum: int
    effective_batch: int
    # 1 for the first run of the job; each step down adds one.
    attempt: int
    # The rank whose OOM led here, the micro-batch it ran out at, and its message.
    rank: Optional[int] = None
    failed_micro_batch: Optional[int] = None
    message: str = ""
    # True when the rank ran out at the smallest micro-batch allowed: every rank stops.
    stop: bool = False

    def encode(self) -> str:
        """The JSON text kept in the store."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def decode(raw: str) -> Optional[Agreed]:
        """Reads a stored plan; None for an empty or foreign value."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return Agreed(
                micro_batch=int(d["micro_batch"]),
                grad_accum=int(d["grad_accum"]),
                effective_batch=int(d["effective_batch"]),
                attempt=int(d["attempt"]),
                rank=None if d.get("rank") is None else int(d["rank"]),
                failed_micro_batch=None if d.get("failed_micro_batch") is None else int(d["failed_micro_batch"]),
                message=str(d.get("message") or ""),
                stop=bool(d.get("stop")),
            )
        except (ValueError, KeyError, TypeError):
            return None


def stop_text(agreed: Agreed, min_batch_size: int = 1) -> str:
    """Why every rank stops: who ran out, where, and that nothing smaller is allowed."""
    who = "a rank" if agreed.rank is None else f"rank {agreed.rank}"
    at = agreed.failed_micro_batch if agreed.failed_micro_batch is not None else agreed.micro_batch
    said = f": {agreed.message}" if agreed.message else ""
    return (
        f"{who} ran out of memory at micro-batch {at} (attempt {agreed.attempt - 1}), and no smaller "
        f"micro-batch is allowed (min_batch_size={min_batch_size}); lower min_batch_size, or make each sample "
        f"cheaper (activation checkpointing, a shorter sequence, sharding){said}"
    )


class _StoreChannel:
    """The plan in torch elastic's rendezvous store, reached as a client."""

    def __init__(self, host: str, port: int) -> None:
        import torch.distributed as dist

        self.where = f"the rendezvous store at {host}:{port}"
        self._store = dist.TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)

    def read(self) -> str:
        if not self._store.check([_KEY]):
            return ""
        return bytes(self._store.get(_KEY)).decode("utf-8", "replace")

    def compare_set(self, expected: str, desired: str) -> str:
        return bytes(self._store.compare_set(_KEY, expected, desired)).decode("utf-8", "replace")


class _FileChannel:
    """The plan in a file that every worker of one node's torchrun shares."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.where = path

    def read(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read()
        except OSError:
            return ""

    def compare_set(self, expected: str, desired: str) -> str:
        import fcntl

        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.read()
            if current != expected:
                return current
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(desired)
            # A reader sees the old plan or the new one, never half of one.
            os.replace(tmp, self.path)
            return desired


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name, empty where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            # The command name may hold spaces and parentheses: fields start after the last ")".
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent(pid: int) -> Optional[int]:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _start_time(pid: int) -> str:
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else "0"


def _flag(argv: list[str], *names: str) -> Optional[str]:
    """The value of ``--name value`` or ``--name=value`` in ``argv``, for any spelling in ``names``."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def _is_torchrun(argv: list[str]) -> bool:
    return any(os.path.basename(a) == "torchrun" or a in ("torch.distributed.run", "torch.distributed.launch") for a in argv[:3])


def _agent() -> tuple[Optional[int], list[str]]:
    """The torchrun process above this worker and its arguments, where /proc shows them."""
    pid: Optional[int] = os.getppid()
    for _ in range(_ANCESTORS):
        if pid is None or pid <= 1:
            break
        argv = _cmdline(pid)
        if _is_torchrun(argv):
            return pid, argv
        pid = _parent(pid)
    return None, []


def _endpoint(argv: list[str]) -> Optional[tuple[str, int]]:
    raw = os.environ.get(ENDPOINT_ENV) or _flag(argv, "--rdzv-endpoint", "--rdzv_endpoint")
    if not raw or "--standalone" in argv:
        return None
    host, _, port = raw.strip().rpartition(":")
    if not host:
        # torchrun's default port for an endpoint given without one.
        host, port = raw.strip(), "29400"
    try:
        number = int(port)
    except ValueError:
        return None
    if number <= 0:
        # Port 0: torchrun picked one at run time, which workers cannot see.
        return None
    return host.strip("[]"), number


def under_torchrun() -> bool:
    """True in a worker that torchrun (torch elastic) started."""
    return bool(os.environ.get(RUN_ID_ENV))


def restarts_left() -> int:
    """How many more times torch elastic will restart this worker's group; 0 outside torchrun."""
    try:
        return int(os.environ.get(MAX_RESTARTS_ENV, "0")) - int(os.environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


class Channel:
    """Where this torchrun job's agreed plan is read and written."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.where: str = inner.where

    def read(self) -> tuple[str, Optional[Agreed]]:
        """The stored text (for compare-and-set) and the plan it holds."""
        raw = self._inner.read()
        return raw, Agreed.decode(raw)

    def propose(self, failed: str, plan: Agreed) -> Agreed:
        """Stores ``plan`` in place of ``failed`` unless another rank already stepped down from it; returns what holds now.

        Two ranks that ran out under the same plan both propose from it: the
        first write stands, and the second replaces it only with a smaller
        micro-batch for the same attempt, so the job steps down once.
        """
        expected = failed
        desired = plan.encode()
        for _ in range(_CAS_ROUNDS):
            got = self._inner.compare_set(expected, desired)
            if got == desired:
                return plan
            there = Agreed.decode(got)
            if there is None or there.attempt != plan.attempt:
                # Another failure moved the job on already; that plan stands.
                return there if there is not None else plan
            if there.stop or there.micro_batch <= plan.micro_batch:
                return there
            expected = got
        return plan


def step_down(
    ch: Channel,
    failed: str,
    plan: tuple[int, int, int, int],
    rank: int,
    message: str,
    min_batch_size: int = 1,
    earlier: tuple[tuple[int, str], ...] = (),
) -> Agreed:
    """Proposes the plan after an OOM under ``plan`` (micro-batch, accumulation, effective batch, attempt); returns what holds now.

    ``failed`` is the stored text of the plan that ran out ("" before any
    agreed one). The next micro-batch is the one `oomkit run` and
    ``auto_batch`` step to (``back_off``, fitted from the OOM's figures); at
    ``min_batch_size`` the proposal is that every rank stops.
    """
    from oomkit import _native

    micro, accum, effective, attempt = plan
    text = " ".join(message.split())[:MESSAGE_CHARS]
    nxt = _native.back_off(micro, effective, min_batch_size, text, list(earlier))
    if nxt is None:
        proposal = Agreed(micro, accum, effective, attempt + 1, rank, micro, text, stop=True)
    else:
        proposal = Agreed(nxt[0], nxt[1], effective, attempt + 1, rank, micro, text)
    return ch.propose(failed, proposal)


_CACHED: dict[str, Optional[Channel]] = {}


def channel() -> Optional[Channel]:
    """The channel of this torchrun job, or None outside torchrun or where none can be reached.

    The rendezvous store when its endpoint is known (``--rdzv-endpoint`` on
    torchrun's command line, or ``PET_RDZV_ENDPOINT``); else, on a single
    node, a file keyed by the torchrun process. Looked up once per process.
    """
    if not under_torchrun():
        return None
    run_id = os.environ.get(RUN_ID_ENV, "")
    if run_id in _CACHED:
        return _CACHED[run_id]
    found: Optional[Channel] = None
    agent_pid, argv = _agent()
    endpoint = _endpoint(argv)
    if endpoint is not None:
        with contextlib.suppress(Exception):
            found = Channel(_StoreChannel(*endpoint))
    if found is None and _single_node():
        agent = agent_pid or os.getppid()
        # The agent's pid and start time make the key unique to this torchrun,
        # even where the run id is torchrun's default ("none").
        name = f"elastic-{_safe(run_id)}-{agent}-{_start_time(agent)}.json"
        folder = os.path.join(tempfile.gettempdir(), f"oomkit-{os.getuid()}")
        found = Channel(_FileChannel(os.path.join(folder, name)))
    _CACHED[run_id] = found
    return found


def _single_node() -> bool:
    world = os.environ.get("WORLD_SIZE")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return os.environ.get("GROUP_WORLD_SIZE") == "1" or (world is not None and world == local)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:64]
