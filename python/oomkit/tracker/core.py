"""What the tracker offers its parts: its bookkeeping, and the few things they may ask of it.

The tracker's hooks (``hooks.py``), what the model holds
(``holdings.py``) and the writing of OOMs (``oom_capture.py``) are parts
of one tracker, kept in their own modules. They see it through
:class:`TrackerCore`, which the tracker hands them (``Tracker._core``),
never through its private fields, and they import this module, never the
tracker's: the tracker imports them, so nothing points back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol


@dataclass
class Books:
    """The tracker's running state, read and updated by the tracker and its parts alike."""

    #: The model, the optimizer (the innermost, unwrapped) and the EMA copy, weakly held.
    model_ref: Any = None
    opt_ref: Any = None
    ema_ref: Any = None
    #: The tracker was closed.
    closed: bool = False
    #: Every measure open now, and the step, stage and phases among them.
    open: list[Any] = field(default_factory=list)
    step_open: Optional[Any] = None
    stage: Optional[Any] = None
    phases: list[Any] = field(default_factory=list)
    #: Steps ended so far.
    steps_done: int = 0
    #: The code marks its own steps; until it does, each optimizer step is one.
    user_steps: bool = False
    #: A backward ended in the step open now, and one is under way.
    auto_backward: bool = False
    backward_pending: bool = False
    #: What the hooks saw, inside steps or not, for the end record.
    seen: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0, "optimizer": 0})
    #: The handles of the hooks on the model and on the optimizer, removed at close.
    model_hooks: list[Any] = field(default_factory=list)
    opt_hooks: list[Any] = field(default_factory=list)
    #: The last plan record, where an integration or auto_batch wrote one.
    plan_fields: Optional[dict[str, Any]] = None
    #: An OOM seen by the CUDA allocator's observer, before its exception exists.
    observed_oom: bool = False
    #: Set while an OOM is being written: one that fails inside is not written again.
    writing_oom: bool = False
    #: The CUDA allocator's history is being recorded for a snapshot at an OOM.
    history: bool = False


class TrackerCore(Protocol):
    """The tracker as its parts see it: its books, its settings, and what they may ask of it."""

    books: Books

    @property
    def rank(self) -> int:
        """The process's rank in its job (0 alone)."""

    @property
    def stage_hooks(self) -> bool:
        """Hooks mark the forward, backward and optimizer stages."""

    @property
    def grad_every(self) -> int:
        """Gradients are checked every this many steps."""

    @property
    def log_path(self) -> str:
        """The run log's path."""

    @property
    def meter(self) -> Any:
        """How the tracker reads memory (``measure._Meter``)."""

    @property
    def log(self) -> Any:
        """The run log being written (``_native.RunLog``)."""

    @property
    def current_step(self) -> Optional[int]:
        """The index of the step open now, if any."""

    @property
    def current_phase(self) -> Optional[str]:
        """The innermost phase open now, if any."""

    def begin_stage(self, name: str) -> None:
        """Opens a stage of the step open now."""

    def end_stage(self) -> None:
        """Closes the stage open now."""

    def open_step(self, index: int, auto: bool) -> None:
        """Opens a step (``auto``: one the tracker opens where the code marks none)."""

    def end_step(self) -> None:
        """Closes the step open now."""

    def record_oom(self, exc: BaseException) -> bool:
        """Writes an OOM the code raised; whether it was one."""

    def find_duplicates(self, when: str = "manual") -> dict[str, Any]:
        """Looks for tensors held twice."""

    def sample(self) -> tuple[int, int]:
        """Reads memory now: the process's mark and its reserved bytes."""

    def write(self, record: dict[str, Any]) -> None:
        """Writes one record to the run log."""

    def say(self, msg: str) -> None:
        """Tells the user, on the console where the tracker writes."""

    def report_error(self, where: str, exc: BaseException) -> None:
        """Notes a failure of the tracker's own, which never stops the training."""
