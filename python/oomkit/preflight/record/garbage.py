"""Python's cyclic garbage collected at fixed points of the step, so that one script gives one answer.

A tensor held in a reference cycle (FlexAttention's traced graph holds its
example values; an exception's traceback holds a forward's frames) is freed
when Python's collector next runs, and that frees its memory on the GPU as on
the fake one. Python runs the collector after a count of allocations, and a
script's count is not the same from run to run: a progress bar formats its
line only when enough time has passed. So the same script's peak came out a
few kilobytes apart from run to run, and two runs meant to be compared (a
checkpoint folder with and without its weights, a fix beside the script as
it is) differed by noise. While the recorder runs, the young generations are
collected after a fixed number of the step's operations instead, which the
script's own code decides, and Python's own trigger is raised far enough
that only a long stretch of pure Python (a data set tokenised in place)
reaches it, where it still bounds the host memory garbage can take.
"""

from __future__ import annotations

import gc

#: Operations between two collections of the youngest generation. A training step on a GPU
#: makes a few Python objects per operation (its result, the module calls' arguments), so
#: Python's own trigger of 700 allocations comes every hundred or two operations: about as
#: late as here, so that garbage lives about as long as on a GPU.
COLLECT_EVERY_OPS = 128

#: Python's allocation trigger while the recorder runs: no step's operations reach it between
#: two collections here, and it still bounds garbage in a long stretch without operations.
ALLOCATIONS_BEFORE_PYTHON_COLLECTS = 200_000


class Collector:
    """Collects young garbage every ``COLLECT_EVERY_OPS`` operations while installed, in
    Python's own order: the middle generation after as many young collections as its threshold."""

    def __init__(self) -> None:
        self._saved: tuple[int, ...] | None = None
        self._depth = 0
        self._young = 0
        # The operation the schedule counts from.
        self._start = 0

    def install(self) -> None:
        """Takes the trigger over from Python (nested installs are counted, the first one acts)."""
        self._depth += 1
        if self._depth == 1:
            self._saved = gc.get_threshold()
            gc.set_threshold(ALLOCATIONS_BEFORE_PYTHON_COLLECTS, *self._saved[1:])

    def uninstall(self) -> None:
        """Gives the trigger back as it was found (at the outermost install's end)."""
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def restart(self, ops: int) -> None:
        """The step begins after ``ops`` operations: the schedule counts from here, after one whole
        collection, so that the set-up (a model built from its config, or loaded from a
        checkpoint, in a different number of operations) moves no collection of the step."""
        self._start = ops
        self._young = 0
        if self._saved is not None and gc.isenabled():
            gc.collect()

    def after_op(self, ops: int) -> None:
        """The ``ops``-th operation has run: collects where the schedule says, unless the script
        has turned collection off itself (a trainer that collects at its own steps)."""
        if self._saved is None or (ops - self._start) % COLLECT_EVERY_OPS or not gc.isenabled():
            return
        self._young += 1
        # Python collects the middle generation when the young one has been collected more
        # times than the middle's threshold, and leaves the oldest to its own trigger.
        if self._young > self._saved[1]:
            self._young = 0
            gc.collect(1)
        else:
            gc.collect(0)
