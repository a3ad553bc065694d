"""``MovePlan``: the copies an operation still has to perform after it planned its moves.

Planning (``kvtier.tiering.planner``) changes the bookkeeping at once (slots are reassigned, pages
dropped) and records here what the data still has to do; the pool applies the plan: the mover
copies the data (``kvtier.tiering.mover``), then the planner finishes the bookkeeping (``finish``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from kvtier.pages import Page


class EdgeCopies:
    """The copies of one edge, as (src_slot, dst_slot) pairs in the order they were added: one at
    a time (``add``) or a batch at a time (``add_batch``, kept as an array: a batch of thousands of
    pages is never turned into Python pairs)."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[list[int] | np.ndarray] = []  # flat [src, dst, ...] runs of single pairs, or (n, 2) arrays

    def add(self, src_slot: int, dst_slot: int) -> None:
        parts = self._parts
        if not parts or not isinstance(parts[-1], list):
            parts.append([])
        parts[-1] += (src_slot, dst_slot)

    def add_batch(self, src_slots: list[int] | np.ndarray, dst_slots: list[int] | np.ndarray) -> None:
        """Pairs ``(src_slots[i], dst_slots[i])``, in step."""
        if len(src_slots):
            self._parts.append(np.column_stack((src_slots, dst_slots)).astype(np.int64, copy=False))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def pairs(self) -> np.ndarray:
        """Every pair, in order, as an (n, 2) int64 array."""
        arrays = [
            np.array(part, dtype=np.int64).reshape(-1, 2) if isinstance(part, list) else part for part in self._parts
        ]
        if not arrays:
            return np.empty((0, 2), dtype=np.int64)
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@dataclass(slots=True)
class MovePlan:
    """Copies keyed by (src tier, dst tier, group), each edge's in an ``EdgeCopies``.

    ``landed``: pages the plan moves, in batches of one destination tier each, in the order they
    moved (indexed for eviction again in that order once their data is there; a batch list is not
    changed once added);
    ``deferred_frees``: slots per (tier, group) read by the plan, freed after it ran;
    ``kept_copies``: per source tier, promoted pages whose bytes stay behind there as a copy, and
    their slots there (two lists in step);
    ``damaged``: pages whose bytes failed their checksum on the way (filled by the mover);
    ``lost``: pages whose bytes may not have arrived because the copies were cut short by an
    exception (filled by ``MovePlanner.abandon``).
    """

    edges: defaultdict[tuple[int, int, int], EdgeCopies] = field(default_factory=lambda: defaultdict(EdgeCopies))
    landed: list[list[Page]] = field(default_factory=list)
    deferred_frees: defaultdict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    kept_copies: defaultdict[int, tuple[list[Page], list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )
    damaged: list[Page] = field(default_factory=list)
    lost: list[Page] = field(default_factory=list)

    def add(self, src_tier: int, dst_tier: int, group: int, src_slot: int, dst_slot: int) -> None:
        self.edges[(src_tier, dst_tier, group)].add(src_slot, dst_slot)
