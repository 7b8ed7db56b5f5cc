"""``torch.cuda``'s memory queries answered under preflight, from the model of the caching allocator.

A script that logs ``torch.cuda.memory_reserved()``, resets the peak
before a phase and reads ``max_memory_allocated()`` after it, or caps
itself with ``set_per_process_memory_fraction`` gets what the GPU's
counters would say at that point of the script: the allocations recorded
so far, served through the same model of the allocator as the answer
(rounded blocks, segments), so the script's own figures and the report's
agree. Calls that would need the GPU itself and have no figure to give
(recording a memory history, dumping its snapshot) do nothing and say so
in a note, rather than writing a file that claims an empty GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from oomkit import _native
from oomkit.preflight.notes import Notes

#: What the notes say when the script records or dumps its own memory history.
OWN_HISTORY = (
    "the script's torch.cuda.memory._record_memory_history() and _dump_snapshot() did nothing under preflight "
    "(--snapshot PATH writes preflight's snapshot)"
)

#: Bytes of one CUDA generator's state (a Philox seed and offset), as ``torch.cuda.get_rng_state()`` returns it.
RNG_STATE_BYTES = 16


class MemoryQueries:
    """The allocator's counters at each point of the script, from what the recorder recorded so far."""

    def __init__(self, rec: Any, alloc_conf: Callable[[], str | None], capacity_bytes: int, notes: Notes) -> None:
        self.rec = rec
        #: The allocator's settings in force (asked each time: a script may set them before its first allocation).
        self.alloc_conf = alloc_conf
        self.capacity_bytes = capacity_bytes
        self.notes = notes
        #: The share of the capacity the script allowed the allocator (``set_per_process_memory_fraction``).
        self.fraction: float | None = None
        # The operations after which the peaks, and the cumulative counters, were last reset.
        self._since = 0
        self._totals_since = 0
        self._cached: tuple[tuple[int, int], tuple[list[int], list[int], list[int], list[int]]] | None = None
        self._real_snapshot = torch.cuda.memory._snapshot

    # ---- the series ----

    def _series(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """After each operation so far: bytes allocated, reserved, retries after releasing the cache; and the OOMs' operations.

        Served within what the allocator may hold (the capacity, or the
        script's share of it), as the GPU's allocator serves them, with the
        set-up's storages still alive before the step begins (the recorder
        defers them; they are on the GPU now).
        """
        tr = self.rec.trace
        kinds, args = list(tr.kinds), list(tr.args)
        held = self.rec.held_before_step()
        kinds += [0] * len(held)
        args += held
        key = (len(kinds), self.allowed_bytes())
        if self._cached is not None and self._cached[0] == key and not held:
            return self._cached[1]
        streams = tr.streams() + [0] * len(held)
        realized = _native.realize_ops(kinds, args, streams, self.alloc_conf(), self.allowed_bytes())
        allocated, reserved, retries = realized[3]
        series = (allocated, reserved, retries, realized[2][4])
        if not held:
            self._cached = (key, series)
        return series

    def _operations(self) -> int:
        """How many operations the series have now (without serving them)."""
        return len(self.rec.trace.kinds) + len(self.rec.held_before_step())

    def _peak(self, series: list[int]) -> int:
        """The most in ``series`` since the peaks were last reset, starting from the value then."""
        since = min(self._since, len(series))
        window = series[since:] + ([series[since - 1]] if since > 0 else [])
        return max(window, default=_last(series))

    def _figures(self) -> dict[str, int]:
        allocated, reserved, retries, ooms = self._series()
        # Where the accumulated counts start (reset_accumulated_memory_stats).
        first = min(self._totals_since, len(allocated))

        def moved(series: list[int], up: bool) -> int:
            # Each operation moves the counter once, up or down.
            before = [series[first - 1] if first > 0 else 0, *series[first:-1]]
            return sum(abs(b - a) for a, b in zip(before, series[first:]) if (b > a if up else b < a))

        return {
            "allocated": _last(allocated),
            "allocated_peak": self._peak(allocated),
            "allocated_total": moved(allocated, True),
            "freed_total": moved(allocated, False),
            "reserved": _last(reserved),
            "reserved_peak": self._peak(reserved),
            "reserved_total": moved(reserved, True),
            "released_total": moved(reserved, False),
            # Counted since the accumulated statistics were last reset, as PyTorch counts them.
            "alloc_retries": _last(retries) - (retries[first - 1] if first > 0 else 0),
            "ooms": sum(1 for op in ooms if op >= self._totals_since),
        }

    # ---- torch.cuda's functions ----

    def memory_allocated(self, device: Any = None) -> int:
        """``torch.cuda.memory_allocated()``."""
        return _last(self._series()[0])

    def max_memory_allocated(self, device: Any = None) -> int:
        """``torch.cuda.max_memory_allocated()``: the peak since the last reset."""
        return self._peak(self._series()[0])

    def memory_reserved(self, device: Any = None) -> int:
        """``torch.cuda.memory_reserved()``."""
        return _last(self._series()[1])

    def max_memory_reserved(self, device: Any = None) -> int:
        """``torch.cuda.max_memory_reserved()``: the peak since the last reset."""
        return self._peak(self._series()[1])

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peaks start again from what is held now."""
        self._since = self._operations()

    def reset_accumulated_memory_stats(self, device: Any = None) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the counts of bytes allocated and freed start again."""
        self._totals_since = self._operations()

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: the counters of all pools together that the model keeps."""
        f = self._figures()
        stats: dict[str, int] = {}
        for name, now, top, up, down in (
            ("allocated_bytes", f["allocated"], f["allocated_peak"], f["allocated_total"], f["freed_total"]),
            # One stream: nothing freed waits on another stream, so active is allocated.
            ("active_bytes", f["allocated"], f["allocated_peak"], f["allocated_total"], f["freed_total"]),
            ("reserved_bytes", f["reserved"], f["reserved_peak"], f["reserved_total"], f["released_total"]),
        ):
            stats[f"{name}.all.current"] = now
            stats[f"{name}.all.peak"] = top
            stats[f"{name}.all.allocated"] = up
            stats[f"{name}.all.freed"] = down
        stats["num_alloc_retries"] = f["alloc_retries"]
        stats["num_ooms"] = f["ooms"]
        return stats

    def nested_stats(self, device: Any = None) -> dict[str, Any]:
        """``torch._C._cuda_memoryStats``: the same counters nested by name, pool and figure, as the allocator returns them."""
        nested: dict[str, Any] = {}
        for key, value in self.memory_stats().items():
            if key.count(".") != 2:
                nested[key] = value
                continue
            name, pool, figure = key.split(".")
            nested.setdefault(name, {}).setdefault(pool, {})[figure] = value
        return nested

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary()``, as the few lines the model can fill."""
        f = self._figures()
        mib = 1 << 20
        return (
            "oomkit preflight: the CUDA caching allocator modelled, without a GPU\n"
            f"  allocated: {f['allocated'] / mib:.1f} MiB now, {f['allocated_peak'] / mib:.1f} MiB at the peak\n"
            f"  reserved:  {f['reserved'] / mib:.1f} MiB now, {f['reserved_peak'] / mib:.1f} MiB at the peak\n"
        )

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction()``: the answer is against that share of the capacity."""
        # PyTorch's own checks, in its words.
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def allowed_bytes(self) -> int:
        """What the allocator may hold: the capacity, or the script's share of it."""
        if self.fraction is None:
            return self.capacity_bytes
        return int(self.capacity_bytes * self.fraction)

    def own_history(self, *_: Any, **__: Any) -> None:
        """``_record_memory_history`` and ``_dump_snapshot``: nothing to record without a GPU; a note says so."""
        self.notes.add(OWN_HISTORY)

    def own_snapshot(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.cuda.memory._snapshot()``: PyTorch's (empty, without a GPU), with the note that it is not the step's."""
        self.own_history()
        return self._real_snapshot(*args, **kwargs)

    # ---- the answers, by name ----

    def cuda_answers(self) -> dict[str, Any]:
        """The functions of ``torch.cuda`` (and ``torch.cuda.memory``) answered here."""
        return {
            "memory_allocated": self.memory_allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": self.memory_reserved,
            "max_memory_reserved": self.max_memory_reserved,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "reset_max_memory_allocated": self.reset_peak_memory_stats,
            "reset_max_memory_cached": self.reset_peak_memory_stats,
            "reset_accumulated_memory_stats": self.reset_accumulated_memory_stats,
            "memory_stats": self.memory_stats,
            "memory_summary": self.memory_summary,
            "set_per_process_memory_fraction": self.set_per_process_memory_fraction,
            # The driver's free memory knows nothing of the fraction.
            "mem_get_info": lambda *a, **k: (max(0, self.capacity_bytes - self.memory_reserved()), self.capacity_bytes),
        }

    def history_answers(self) -> dict[str, Any]:
        """The functions of ``torch.cuda.memory`` that record and dump a memory history."""
        return {"_record_memory_history": self.own_history, "_dump_snapshot": self.own_history, "_snapshot": self.own_snapshot}


def _last(series: list[int]) -> int:
    """A counter's value now: after the last operation (0 before any)."""
    return series[-1] if series else 0


def rng_answers() -> dict[str, Any]:
    """``torch.cuda``'s random-number state, answered without a GPU (a script saving a checkpoint asks for it)."""

    def state(*_: Any, **__: Any) -> torch.Tensor:
        return torch.zeros(RNG_STATE_BYTES, dtype=torch.uint8)

    def nothing(*_: Any, **__: Any) -> None:
        return None

    return {
        "get_rng_state": state,
        "get_rng_state_all": lambda: [state()],
        "set_rng_state": nothing,
        "set_rng_state_all": nothing,
        "seed": nothing,
        "seed_all": nothing,
        "initial_seed": torch.initial_seed,
    }
