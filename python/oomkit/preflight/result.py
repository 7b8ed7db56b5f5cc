"""What a preflight measured: :class:`Preflight`, the answer ``oomkit.preflight()`` returns.

Its fields are what ``oomkit preflight --json`` prints under ``result``
(docs/commands.md), and its text is the command's, from the one renderer
(``oomkit-report``'s ``preflight.rs``, through the binding). Nothing here
imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from oomkit import _native

#: The roles an answer tells memory by, in the order a report lists them (docs/roles.md;
#: ``ema``: a copy of the weights the script keeps in step with them between steps, an EMA
#: or averaged model; ``kv_cache``: held across the forwards of one generation and read by a
#: later one: its cache).
ROLES = ("parameters", "gradients", "optimizer_state", "ema", "activations", "kv_cache", "temporaries", "inputs", "other")


@dataclass
class Preflight:
    """What a preflight measured for one micro-batch, and the search's answer."""

    #: The micro-batch each step ran with.
    micro_batch: int | None
    #: Micro-batches accumulated per optimizer step.
    grad_accum: int
    #: Optimizer steps run.
    steps: int
    #: The most memory handed out at once, in the allocator's rounded blocks.
    peak_allocated_bytes: int
    #: The most memory the allocator reserved from the device.
    peak_reserved_bytes: int
    #: Reserved but not handed out when reserved peaked (fragmentation and cache).
    free_in_segments_at_peak_bytes: int
    #: What the allocator may hold: the capacity given, less the CUDA context for a GPU's name.
    capacity_bytes: int
    #: The capacity as given (``80GiB``, ``H100``).
    capacity: str
    #: No allocation failed when the allocator was limited to the capacity.
    fits: bool
    #: The capacity less the peak reserved (negative when it does not fit).
    margin_bytes: int
    #: Bytes live at the allocated peak, by role (``parameters``, ``gradients``,
    #: ``optimizer_state``, ``ema``, ``activations``, ``kv_cache``, ``temporaries``, ``inputs``, ``other``).
    by_role: dict[str, int]
    #: The user's lines holding the most at the allocated peak: ``{"line", "bytes", "role"}``.
    by_line: list[dict[str, Any]]
    #: Allocations recorded and trace entries written.
    allocations: int
    #: What the preflight assumed or could not do, in words.
    notes: list[str] = field(default_factory=list)
    #: The snapshot written, if one was asked for.
    snapshot: str | None = None
    #: Micro-batches tried by the search and whether each fitted.
    tried: list[tuple[int, bool]] = field(default_factory=list)
    #: The largest micro-batch that fits, when a search ran (None: not even the smallest).
    largest_micro_batch: int | None = None
    #: The accumulation that keeps the effective batch at the largest micro-batch.
    largest_grad_accum: int | None = None
    #: ``training`` (optimizer steps, or backward passes) or ``inference`` (forwards alone, the whole run measured).
    mode: str = "training"
    #: Top-level forwards of the model run (a module's forward called outside any other's).
    forwards: int = 0
    #: The most allocated while each phase ran (``setup``, ``inputs``, ``forward``,
    #: ``backward``, ``optimizer``, and ``eval``: forwards without gradients in a
    #: script that trains), in the allocator's blocks.
    phase_peaks: dict[str, int] = field(default_factory=dict)
    #: The most allocated during each optimizer step (set-up left out of the first), in the
    #: allocator's blocks: the first often runs without the optimizer's state. Empty where
    #: no optimizer stepped (inference, or backward passes alone).
    step_peaks: list[int] = field(default_factory=list)
    #: The most host memory the script held for the GPU at once: pinned buffers and copies
    #: of GPU tensors (offloads), outside the GPU's figures.
    host_peak_bytes: int = 0
    #: Of it, the most that was pinned (page-locked) at once.
    host_pinned_peak_bytes: int = 0
    #: The most unified (paged) memory held at once: bitsandbytes' paged optimizer state, on the
    #: GPU while there is room and on the host when not; outside PyTorch's allocator, so in
    #: neither the GPU's figures nor ``host_peak_bytes``.
    host_paged_peak_bytes: int = 0
    #: Where the GPU ran out as the script ran and the script went on (a search that halves its
    #: batch): ``{"raised", "first_bytes", "first_at", "went_on", "ended"}``; else None. Only
    #: ``oomkit preflight``'s first run of a script raises CUDA's error where the GPU would.
    out_of_memory: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The answer as plain data (what ``json.dumps`` writes)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def __str__(self) -> str:
        # The same report `oomkit preflight` prints, from the one renderer.
        return _native.preflight_text(json.dumps(self.as_dict()))
