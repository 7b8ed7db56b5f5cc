"""The micro-batch plan that `oomkit run` hands a training command through its environment."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from oomkit import _elastic

# The variables `oomkit run` and `oomkit find-batch` set for the command they
# run, mirrored from crates/oomkit-supervise/src/child_env.rs (a test checks
# that both hold the same names); docs/commands.md's "Environment" lists them all.
#
# Set by `oomkit run` for every attempt (docs/commands.md, "oomkit run").
MICRO_BATCH_ENV = "OOMKIT_MICRO_BATCH"
GRAD_ACCUM_ENV = "OOMKIT_GRAD_ACCUM"
EFFECTIVE_BATCH_ENV = "OOMKIT_EFFECTIVE_BATCH"
ATTEMPT_ENV = "OOMKIT_ATTEMPT"
# Set by `oomkit run` (unless --no-auto-callback) so that Lightning's entry
# point adds oomkit's callback; never set otherwise.
AUTO_CALLBACK_ENV = "OOMKIT_AUTO_CALLBACK"
# Where integrations write run logs when no log_dir is given.
LOG_DIR_ENV = "OOMKIT_LOG_DIR"
# Set by `oomkit run` for every attempt: a file where the tracker and the
# integrations append, one JSON line each, what `oomkit run` must know of the
# attempt: each OOM they record (so that the retry policy reads the real
# message even when a framework prints something else or swallows it), each
# run log's path (so that a log the kernel killed is closed), and whether the
# plan was applied.
EVENTS_FILE_ENV = "OOMKIT_EVENTS_FILE"
# Set by `oomkit run` to `cuda` or `cpu` where it chose the device.
DEVICE_ENV = "OOMKIT_DEVICE"
# Set by `oomkit find-batch`: where the tracker writes the trial's peak, and
# the GPU memory in use before the trial, which the tracker subtracts.
PROBE_FILE_ENV = "OOMKIT_PROBE_FILE"
BASELINE_USED_BYTES_ENV = "OOMKIT_BASELINE_USED_BYTES"


@dataclass(frozen=True)
class Plan:
    """Micro-batch and gradient accumulation for one process, and where they came from."""

    micro_batch: int
    grad_accum: int
    effective_batch: Optional[int] = None
    attempt: Optional[int] = None
    source: str = "oomkit run"

    def record(self, framework: str) -> dict[str, Any]:
        """The fields of the run log's ``plan`` record."""
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "effective_batch": self.effective_batch or self.micro_batch * self.grad_accum,
            "attempt": self.attempt,
            "source": self.source,
            "framework": framework,
        }


def _int(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        sys.stderr.write(f"oomkit: ignoring {name}={raw!r}: not a whole number\n")
        return None
    return value if value > 0 else None


def attempt_from_env() -> Optional[int]:
    """The attempt `oomkit run` (or `find-batch`) runs this process as, or None outside them."""
    return _int(ATTEMPT_ENV)


def env_record(framework: str) -> dict[str, Any]:
    """The run log's ``plan`` record for a process under `oomkit run`: its attempt, and the batch where oomkit manages it.

    Whether the process uses that batch is not known here (``applied`` is
    null): a script may read ``OOMKIT_MICRO_BATCH`` itself, or ignore it.
    """
    plan = from_env()
    if plan is not None:
        record = plan.record(framework)
    else:
        record = {
            "micro_batch": None,
            "grad_accum": None,
            "effective_batch": None,
            "attempt": attempt_from_env(),
            "source": "oomkit run",
            "framework": framework,
        }
    record["applied"] = None
    return record


def from_env() -> Optional[Plan]:
    """The plan `oomkit run` chose for this attempt, or None outside `oomkit run` (or without --batch-size)."""
    micro = _int(MICRO_BATCH_ENV)
    if micro is None:
        return None
    return Plan(
        micro_batch=micro,
        grad_accum=_int(GRAD_ACCUM_ENV) or 1,
        effective_batch=_int(EFFECTIVE_BATCH_ENV),
        attempt=_int(ATTEMPT_ENV),
    )


# The plan `auto_batch` is running now, for trackers started inside its function.
_ACTIVE: Optional[Plan] = None


def set_active(plan: Optional[Plan]) -> None:
    """Records the plan `auto_batch` is about to run, so that trackers log it."""
    global _ACTIVE
    _ACTIVE = plan


def active() -> Optional[Plan]:
    """The plan of the `auto_batch` try running now, or None outside one."""
    return _ACTIVE


def current() -> Optional[Plan]:
    """The plan this process runs: `auto_batch`'s current try, else the one torch elastic's ranks agreed on, else `oomkit run`'s."""
    return _ACTIVE if _ACTIVE is not None else handed_down()


# The `source` of a plan the ranks of a torchrun job agreed on after an OOM.
ELASTIC_SOURCE = "torch elastic restart"


def elastic_plan() -> Optional[_elastic.Agreed]:
    """The plan this torchrun job's ranks agreed on after an OOM, or None (never raises)."""
    try:
        ch = _elastic.channel()
        return ch.read()[1] if ch is not None else None
    except Exception:  # noqa: BLE001 - an unreachable store means no agreed plan
        return None


def handed_down() -> Optional[Plan]:
    """The plan an integration applies at start: torch elastic's agreed one after an OOM, else `oomkit run`'s."""
    agreed = elastic_plan()
    if agreed is not None and not agreed.stop:
        return Plan(agreed.micro_batch, agreed.grad_accum, agreed.effective_batch, agreed.attempt, ELASTIC_SOURCE)
    return from_env()


def elastic_stop() -> Optional[str]:
    """Why this torchrun job must stop, where a rank ran out at the smallest micro-batch; else None."""
    agreed = elastic_plan()
    return _elastic.stop_text(agreed) if agreed is not None and agreed.stop else None


def elastic_step_down(fields: dict[str, Any], message: str, rank: int) -> None:
    """After an OOM under torchrun, stores the plan every rank restarts with; never raises.

    For trainers whose plan an integration applied (``fields`` is the run
    log's ``plan`` record); ``auto_batch`` does the same for its own tries.
    """
    try:
        ch = _elastic.channel()
        micro = int(fields.get("micro_batch") or 0)
        if ch is None or micro < 1:
            return
        accum = int(fields.get("grad_accum") or 1)
        effective = int(fields.get("effective_batch") or micro * accum)
        attempt = int(fields.get("attempt") or 1)
        stored, agreed = ch.read()
        if agreed is not None and agreed.attempt > attempt and agreed.failed_micro_batch != micro:
            # A failure of another plan moved the job on already.
            return
        # The stored text of the plan that ran out; "" where another rank's
        # proposal for the same failure is there already, so that the
        # compare-and-set keeps the smaller of the two instead of replacing it.
        failed = stored if agreed is None or agreed.attempt == attempt else ""
        agreed_now = _elastic.step_down(ch, failed, (micro, accum, effective, attempt), rank, message)
        then = (
            "every rank stops: no smaller micro-batch is allowed"
            if agreed_now.stop
            else f"every rank restarts with micro-batch {agreed_now.micro_batch} x accumulation {agreed_now.grad_accum} "
            f"(attempt {agreed_now.attempt}, agreed in {ch.where})"
        )
        sys.stderr.write(f"oomkit: out of memory on rank {rank} at micro-batch {micro}; {then}\n")
    except Exception:  # noqa: BLE001 - the OOM is what the user must see; this only follows it
        pass


def auto_callback_requested() -> bool:
    """True when `oomkit run` asked frameworks with entry points to add oomkit's callback."""
    return os.environ.get(AUTO_CALLBACK_ENV, "") == "1"


def default_log_dir(framework_dir: str | os.PathLike[str] | None) -> str:
    """``$OOMKIT_LOG_DIR`` when set, else ``oomkit-logs`` under the framework's output folder."""
    env = os.environ.get(LOG_DIR_ENV)
    if env:
        return env
    return os.path.join(os.fspath(framework_dir) if framework_dir else ".", "oomkit-logs")


def say(message: str) -> None:
    """One line on stderr, from rank 0 only."""
    if os.environ.get("RANK", "0") in ("0", ""):
        sys.stderr.write(f"oomkit: {message}\n")
        sys.stderr.flush()


def report_oom(message: str, step: Optional[int], stage: Optional[str], snapshot: Optional[str] = None) -> None:
    """Tells `oomkit run` of an OOM (and the snapshot dumped at it, which it can replay), where it runs this process; never raises."""
    event: dict[str, Any] = {"message": message[:2000], "step": step, "stage": stage}
    if snapshot:
        event["snapshot"] = snapshot
    report_event(event)


def report_plan(plan: Plan, applied: bool, reason: Optional[str] = None, by: str = "") -> None:
    """Tells `oomkit run` whether its plan was applied (and why not), where it runs this process; never raises."""
    event: dict[str, Any] = {
        "plan": {"micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum, "attempt": plan.attempt},
        "applied": bool(applied),
        "by": by,
    }
    if reason:
        event["reason"] = reason
    report_event(event)


def report_event(event: dict[str, Any]) -> None:
    """Appends one JSON line to ``$OOMKIT_EVENTS_FILE`` for `oomkit run`, where it is set; never raises."""
    path = os.environ.get(EVENTS_FILE_ENV)
    if not path:
        return
    try:
        line = json.dumps(event) + "\n"
    except (TypeError, ValueError):
        return
    try:
        # One short write with O_APPEND: ranks sharing the file do not interleave lines.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass
