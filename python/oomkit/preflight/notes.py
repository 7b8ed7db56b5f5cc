"""What a preflight run assumed or could not do, in words, as the parts of its world say it.

Each run makes one :class:`Notes` and hands it to the parts that may have
something to say (the memory queries, the compiler, the data loader's
stand-in, the sharding); the answer collects them with its own, where it
is made. A note said twice is kept once, in the order first said.
"""

from __future__ import annotations

from collections.abc import Iterable


class Notes:
    """One run's notes: each kept once, in the order first said."""

    def __init__(self) -> None:
        self._said: list[str] = []

    def add(self, note: str) -> None:
        """Says ``note``, unless it was said already."""
        if note not in self._said:
            self._said.append(note)

    def extend(self, notes: Iterable[str]) -> None:
        """Says each of ``notes``."""
        for note in notes:
            self.add(note)

    def said(self) -> list[str]:
        """Everything said so far, in order."""
        return list(self._said)

    def __contains__(self, note: object) -> bool:
        return note in self._said
