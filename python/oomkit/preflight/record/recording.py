"""What one run recorded, handed to the answer: the trace, the roles known, the notes, and how the run went.

The driver (``oomkit.preflight()``) and the script runner (``oomkit
preflight``) each make one when their run ends; the answer reads nothing
else of the run. What the run was asked is the settings'
(``settings.Settings``); what it turned out to be is here: the steps it
measured (a script may end sooner, or measure inference), the allocator
settings in force (a script may set its own) and the memory the
allocator was allowed (a script may cap itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.preflight.record.recorder import Recorder
from oomkit.preflight.record.roles import Known

#: A run that took optimizer steps, or backward passes.
TRAINING = "training"

#: A run of forwards alone (inference, evaluation, generation), measured whole.
INFERENCE = "inference"


@dataclass(frozen=True)
class Recording:
    """One finished run: what it recorded and what it noted, for the answer."""

    #: The recorder, finished: its trace of allocations and frees, with their stacks and phases.
    recorder: Recorder
    #: The roles known from the objects the run held.
    known: Known
    #: What the run assumed or could not do, in words, in the order said.
    notes: list[str]
    #: Optimizer steps measured.
    steps: int
    #: What the allocator may hold (the capacity, or less where the script capped itself).
    capacity_bytes: int
    #: The allocator settings in force.
    alloc_conf: str | None
    #: ``TRAINING`` or ``INFERENCE``.
    mode: str = TRAINING
