"""``HitCount``: the part of a request's reuse that the manager counts as hits, by tier.

A cache's reuse is counted in ``stats().hit_tokens`` once it is settled: at the cache's first
``commit`` of a token (the request computed past its reuse) or at its ``close``, whichever comes
first, each reused block for the tier it was found on. A cache without reuse is settled from the
start, so its one-token commits take the decode step's path (which claims nothing) from the
first one. Reuse given up before (a checksum failure on the way in, a shortened reuse, a caller
that recomputes part of it) is counted in ``recomputed_tokens`` instead, so the two always add
up to what the request was offered, and the hits to what it used. Both only grow: a Prometheus
counter never goes down (a hit counted at creation and given up later did, and a scrape in
between read the decrease as a counter reset).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvtier.errors import InvariantError
from kvtier.stats import Counters


class HitCount:
    """The first ``end`` reused tokens of one request, counted as hits for the tiers ``block_tiers``
    gives per block (tier indices; None: every block on the one tier ``names[0]``)."""

    __slots__ = ("_block_tiers", "_counters", "_names", "_tpb", "end", "given_up", "settled", "used")

    def __init__(
        self, counters: Counters, names: Sequence[str], tokens_per_block: int, end: int, block_tiers: list[int] | None
    ) -> None:
        self._counters = counters
        self._names = names
        self._tpb = tokens_per_block
        self.end = end
        self._block_tiers = block_tiers
        self.used = False  # the request took the reuse (its first resume is over): a loss now is no lost hit
        self.given_up = 0  # tokens moved to ``recomputed_tokens`` so far (``keep``)
        self.settled = end == 0  # the hits are counted (``settle``; none to count: at once)

    def keep(self, kept: int, block_tiers: list[int] | None) -> int:
        """Only the first ``kept`` tokens will be counted, their blocks now found on ``block_tiers``;
        the tokens past ``kept`` go to ``recomputed_tokens``. Returns the tokens moved there (0,
        changing nothing, when ``kept`` covers the count). ``InvariantError`` once settled."""
        end = self.end
        if kept >= end:
            return 0
        if self.settled:
            raise InvariantError("reuse given up after its hits were counted")
        self._counters.recomputed_tokens += end - kept
        self.given_up += end - kept
        self.end, self._block_tiers = kept, block_tiers
        return end - kept

    def settle(self) -> None:
        """Count the reuse as hits, by tier (once: later calls do nothing)."""
        if self.settled:
            return
        self.settled = True
        hits = self._counters.hit_tokens
        for name, n in self._by_tier(self._block_tiers, self.end).items():
            hits[name] += n

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
