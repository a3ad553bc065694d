"""``MovePlan``: the copies an operation still has to perform after it planned its moves.

Planning (``kvtier.tiering.planner``) changes the bookkeeping at once (slots are reassigned, pages
dropped) and records here what the data still has to do; the pool applies the plan: the mover
copies the data (``kvtier.tiering.mover``), then the planner finishes the bookkeeping (``finish``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvtier.pages import Page


@dataclass(slots=True)
class MovePlan:
    """Copies keyed by (src tier, dst tier, group); each edge a flat ``[src_slot, dst_slot, ...]`` list.

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

    edges: defaultdict[tuple[int, int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    landed: list[list[Page]] = field(default_factory=list)
    deferred_frees: defaultdict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    kept_copies: defaultdict[int, tuple[list[Page], list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: ([], []))
    )
    damaged: list[Page] = field(default_factory=list)
    lost: list[Page] = field(default_factory=list)

    def add(self, src_tier: int, dst_tier: int, group: int, src_slot: int, dst_slot: int) -> None:
        edge = self.edges[(src_tier, dst_tier, group)]
        edge.append(src_slot)
        edge.append(dst_slot)
