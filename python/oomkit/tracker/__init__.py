"""The in-training memory tracker: ``oomkit.Tracker`` and ``oomkit.record_history``.

The tracker itself is ``tracker.py``; its parts live beside it and see it
only through what ``core.py`` declares: how memory is read
(``measure.py``), the hooks that find a step's stages (``hooks.py``),
what the model holds (``holdings.py``) and the writing of OOMs
(``oom_capture.py``). The run log it writes is read by the Rust crate
``oomkit-runlog`` (docs/run-log.md). Importing it starts no thread and
touches no GPU.
"""

from __future__ import annotations

from oomkit.tracker.oom_capture import record_history
from oomkit.tracker.tracker import LOG_VERSION, Tracker

__all__ = ["LOG_VERSION", "Tracker", "record_history"]
