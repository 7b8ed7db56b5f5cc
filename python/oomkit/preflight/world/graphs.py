"""CUDA graphs on the fake GPU: a capture runs its code as it is, allocating from the graph's
private pool, and a replay allocates nothing.

While a CUDA graph captures, PyTorch's caching allocator serves the
capture from a pool of the graph's own (``graph_pool_handle()``, or a new
one), which shares no cached block with the default pools and keeps its
segments while the graph lives: a step captured after an eager warm-up
(torchtitan's way) holds the warm-up's cached memory beside the graph's.
Here the capture runs the code on the fake GPU, its allocations recorded
as the private pool's (the allocator model serves each pool apart); a
replay reruns kernels into memory the capture took, so it allocates
nothing and computes nothing here. Creating a graph or a pool handle on
CUDA starts the driver, which is not there: these stand in for
``torch.cuda.CUDAGraph``, ``torch.cuda.graph`` and ``graph_pool_handle``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from oomkit.preflight.notes import Notes
from oomkit.preflight.record.recorder import Recorder

#: What an answer with a captured CUDA graph says of it.
CAPTURED = (
    "a CUDA graph was captured: its capture ran as the code runs, allocating from the graph's private pool "
    "(kept beside the default pools), and its replays allocate nothing"
)


class GraphPool(tuple[str, int]):
    """A private pool's handle, as ``graph_pool_handle()`` gives one: an opaque pair."""

    __slots__ = ()


class CudaGraphs:
    """The stand-ins for CUDA graphs, recording each capture's allocations in its private pool."""

    def __init__(self, recorder: Recorder, notes: Notes) -> None:
        self.recorder = recorder
        self.notes = notes
        self._numbers = itertools.count(1)

    def pool_handle(self) -> GraphPool:
        """A new private pool's handle (``torch.cuda.graph_pool_handle()``)."""
        return GraphPool(("oomkit_graph_pool", next(self._numbers)))

    def stand_ins(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, value) for the fake GPU's ledger: the graph class, the capture's context
        manager and the pool handle, on ``torch.cuda`` and on ``torch.cuda.graphs``."""
        graphs = self

        class CUDAGraph:
            """A CUDA graph on the fake GPU: a capture in its private pool, replays that do nothing."""

            def __init__(self, keep_graph: bool = False) -> None:
                self._pool: GraphPool | None = None
                self._outer = 0

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
                self._pool = pool if isinstance(pool, GraphPool) else graphs.pool_handle()
                self._outer = graphs.recorder.graph_pool
                graphs.recorder.graph_pool = self._pool[1]
                graphs.notes.add(CAPTURED)

            def capture_end(self) -> None:
                graphs.recorder.graph_pool = self._outer

            def replay(self) -> None:
                """Reruns kernels into the memory the capture took: nothing to allocate or compute."""

            def instantiate(self) -> None:
                """Nothing to instantiate without a driver."""

            def reset(self) -> None:
                self._pool = None

            def pool(self) -> GraphPool:
                if self._pool is None:
                    self._pool = graphs.pool_handle()
                return self._pool

            def enable_debug_mode(self) -> None:
                """Nothing to debug: no graph is built."""

            def debug_dump(self, _path: str) -> None:
                """Nothing to dump: no graph is built."""

        class graph:  # torch.cuda.graph's own (lower-case) name
            """``torch.cuda.graph``: frees the cache as PyTorch does before a capture, and captures."""

            def __init__(self, cuda_graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global", **_: Any) -> None:
                self.cuda_graph = cuda_graph
                self.pool = pool
                self.capture_error_mode = capture_error_mode

            def __enter__(self) -> None:
                torch.cuda.empty_cache()
                self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)

            def __exit__(self, *exc: Any) -> None:
                self.cuda_graph.capture_end()

        changes: list[tuple[Any, str, Any]] = []
        for owner in (torch.cuda, torch.cuda.graphs):
            changes += [(owner, "CUDAGraph", CUDAGraph), (owner, "graph", graph), (owner, "graph_pool_handle", self.pool_handle)]
        return changes
