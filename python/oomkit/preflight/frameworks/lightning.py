"""Lightning's batch-size finder under preflight: its trials run as on the GPU, and the run is measured after it.

``Tuner(trainer).scale_batch_size(model)`` and the ``BatchSizeFinder``
callback try the training step at growing batch sizes, a few steps each
(``steps_per_trial``), until the GPU runs out (``mode="power"``), or then
search between the last that fitted and the first that did not
(``"binsearch"``); the model is restored and the run trains at the batch
found. Preflight raises CUDA's error where the GPU of the capacity would
run out (``record/out_of_memory.py``), so the search ends where it would
on that GPU; while it runs, its trials' optimizer steps are not the steps
preflight counts (it would stop at the first trial's second step and
answer for batch 2), and the answer is what the run holds after it, at the
batch it found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: The modules whose ``BatchSizeFinder`` runs the search (Lightning's two packages).
BATCH_SIZE_FINDERS = ("lightning.pytorch.callbacks.batch_size_finder", "pytorch_lightning.callbacks.batch_size_finder")


class BatchSizeSearch:
    """Whether the script's own batch-size search is running, and what it found."""

    def __init__(self) -> None:
        #: How deep in searches the script is (0: none running).
        self.depth = 0
        #: The batch size each search found, in order.
        self.found: list[int | None] = []
        #: Called when a search ends (the run is measured from there).
        self.on_end: Callable[[], None] | None = None

    def stand_ins(self, module: ModuleType) -> Sequence[tuple[Any, str, Any]]:
        """``BatchSizeFinder.scale_batch_size`` that says when the search runs and what it found."""
        finder = module.BatchSizeFinder
        search = finder.scale_batch_size

        def scale_batch_size(finder_self: Any, trainer: Any, pl_module: Any) -> None:
            self.depth += 1
            try:
                search(finder_self, trainer, pl_module)
            finally:
                # (The Tuner's own finder ends by raising: it leaves the fit it ran the search in.)
                self.depth -= 1
                self.found.append(getattr(finder_self, "optimal_batch_size", None))
                if self.on_end is not None and self.depth == 0:
                    self.on_end()

        return [(finder, "scale_batch_size", scale_batch_size)]

    def note(self) -> str | None:
        """What the answer says of the searches, where the script ran any."""
        if not self.found:
            return None
        found = ", ".join("none" if b is None else str(b) for b in self.found)
        return (
            f"the script's own batch-size search (Lightning's BatchSizeFinder) ran first and found {found}: "
            "its trials ran as on a GPU of the capacity, and the figures are of the run after it"
        )
