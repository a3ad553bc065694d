"""``HitCount``: the part of a request's reuse that the manager counts as hits, by tier.

A cache's reuse is counted in ``stats().hit_tokens`` when the cache is created, each reused block
for the tier it was found on. Reuse given up later (a checksum failure on the way in, a shortened
reuse, a caller that recomputes part of it) leaves ``hit_tokens`` for ``recomputed_tokens``, so
the two always add up to what the request was offered, and the hits to what it used.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvtier.stats import Counters


class HitCount:
    """The first ``end`` reused tokens of one request, counted as hits for the tiers ``block_tiers``
    gives per block (tier indices; None: every block on the one tier ``names[0]``)."""

    __slots__ = ("_block_tiers", "_counters", "_names", "_tpb", "end", "used")

    def __init__(
        self, counters: Counters, names: Sequence[str], tokens_per_block: int, end: int, block_tiers: list[int] | None
    ) -> None:
        self._counters = counters
        self._names = names
        self._tpb = tokens_per_block
        self.end = end
        self._block_tiers = block_tiers
        self.used = False  # the request took the reuse (its first resume is over): a loss now is no lost hit

    def keep(self, kept: int, block_tiers: list[int] | None) -> int:
        """Only the first ``kept`` tokens are used, their blocks now found on ``block_tiers``: the hits
        counted move to those tiers, the tokens past ``kept`` to ``recomputed_tokens``. Returns the
        tokens moved to recomputed (0, changing nothing, when ``kept`` covers the count)."""
        end = self.end
        if kept >= end:
            return 0
        hits = self._counters.hit_tokens
        for name, n in self._by_tier(self._block_tiers, end).items():
            hits[name] -= n
        for name, n in self._by_tier(block_tiers, kept).items():
            hits[name] += n
        self._counters.recomputed_tokens += end - kept
        self.end, self._block_tiers = kept, block_tiers
        return end - kept

    def cut(self, kept: int) -> int:
        """Only the first ``kept`` tokens are used, as counted: the tokens past ``kept`` move to
        ``recomputed_tokens``, each from the tier it was counted for. Returns the tokens moved."""
        return self.keep(kept, self._block_tiers)

    def counted(self) -> tuple[list[int] | None, dict[str, int]]:
        """The blocks' tiers the count follows, and the counted tokens per tier name (those with any)."""
        return self._block_tiers, self._by_tier(self._block_tiers, self.end)

    def _by_tier(self, block_tiers: list[int] | None, end: int) -> dict[str, int]:
        """The first ``end`` tokens per tier name, each block counted for its tier in ``block_tiers``."""
        if block_tiers is None:
            return {self._names[0]: end}
        full, rest = divmod(end, self._tpb)
        counts = {self._names[tier]: blocks * self._tpb for tier, blocks in Counter(block_tiers[:full]).items()}
        if rest:
            name = self._names[block_tiers[full]]
            counts[name] = counts.get(name, 0) + rest
        return counts


def fill_from_later(block_tiers: list[int]) -> None:
    """Give each block without a page (-1) the coldest tier of the blocks after it: a stale
    sliding-window block, or one between recurrent snapshots, is reused through their pages."""
    later = 0
    for block in range(len(block_tiers) - 1, -1, -1):
        if block_tiers[block] < 0:
            block_tiers[block] = later
        elif block_tiers[block] > later:
            later = block_tiers[block]
