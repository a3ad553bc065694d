"""Keys a connector has lately seen in its store (written there, or found there), in bounded memory.

A save writes the blocks its request's ask found missing without asking the store again. When
requests that share a prefix all ask before the first of them has saved it, each would write the
shared blocks again. A key in ``RecentKeys`` is asked about instead (within the batch's one
existence check), which also notices a block the store has evicted since.

Bounded: two generations of at most ``per_generation`` entries; when the newer one fills it
becomes the older, and the older is forgotten. A key is kept as its hash, so two keys may share
an entry: that costs an existence check, never a missed write. Not thread-safe: callers hold their
own lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

PER_GENERATION: Final = 1 << 15  # entries per generation: two generations hold 32K-64K keys, a few MB


class RecentKeys:
    """Hashes of the keys ``add``-ed lately (the last ``per_generation`` to ``2 * per_generation``)."""

    def __init__(self, per_generation: int = PER_GENERATION) -> None:
        if per_generation < 1:
            raise ValueError(f"per_generation must be >= 1, got {per_generation}")
        self._per_generation = per_generation
        self._newer: set[int] = set()
        self._older: set[int] = set()

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._newer.add(hash(key))
            if len(self._newer) >= self._per_generation:
                self._older, self._newer = self._newer, set()

    def __contains__(self, key: str) -> bool:
        entry = hash(key)
        return entry in self._newer or entry in self._older
