"""The parts in which a demotion from the primary tier and a promotion back into it share the link.

When a plan demotes primary pages to a memory tier below and promotes pages of the same layer
group from there (a resume on a full GPU), the two copies depend on each other:

- a promoted page whose primary slot a victim vacates may land only after that victim was read;
- in a *swap* (``MovePlanner``: victims take the host slots that promoted pages vacate, so the
  host keeps its other pages), a victim may land in such a slot only after the promoted page was
  read out of it.

``schedule`` cuts the demotion into parts and attaches to each part the promotions it unblocks,
so that each direction runs one part after another while both directions run at once. A swap
needs a head start: the first victims land in free slots (``swap_lag``), so that the demotion
never waits for a promotion that waits for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.errors import InvariantError

DUPLEX_CHUNKS = 16  # a demotion racing a promotion is cut into at most this many parts
DUPLEX_MIN_PART_BYTES = 32 << 20  # and none smaller, unless it is the only one (its submit hides behind the link)
SWAP_PARTS = 4  # a swap that fits in one such part is still cut into this many, each waiting for the one before
NO_WAIT = -2  # a part's ``after_up`` when it waits for no promotion
READY = -1  # the promotions that wait for no demotion (into slots that were free) run before any part


def part_pages(pages: int, page_bytes: int) -> int:
    """Pages per part of a ``pages``-page demotion that races a promotion (no swap)."""
    parts = max(1, min(DUPLEX_CHUNKS, pages, pages * page_bytes // DUPLEX_MIN_PART_BYTES))
    return -(-pages // parts)


def swap_lag(pages: int, page_bytes: int) -> int:
    """How many of a swap's ``pages`` victims land in free slots before the first one takes the slot
    of a promoted page: two parts, so that each part's demotion runs beside the promotion of the part
    before it, or a ``SWAP_PARTS``-th of the victims when that is fewer (a small swap, in turn)."""
    return max(1, min(2 * part_pages(pages, page_bytes), math.ceil(pages / SWAP_PARTS)))


@dataclass(frozen=True, slots=True)
class DuplexPart:
    """``down``: demotion pairs (primary slot, lower slot), run after the promotion part ``after_up``
    (``NO_WAIT``: none; ``READY``: the ready ones); ``up``: promotion pairs (lower slot, primary slot)
    that may run once ``down`` has been read out."""

    down: np.ndarray
    after_up: int
    up: np.ndarray


@dataclass(frozen=True, slots=True)
class DuplexSchedule:
    """``ready`` promotions first, then ``parts`` in order; each part's demotion waits for the
    promotion part named by its ``after_up``, always an earlier one, and its promotions for it."""

    ready: np.ndarray
    parts: list[DuplexPart]

    @property
    def swaps(self) -> bool:
        """Whether any demotion waits for a promotion (a promotion part must tell when it is done)."""
        return any(part.after_up != NO_WAIT for part in self.parts)


def schedule(down: np.ndarray, up: np.ndarray, page_bytes: int, overlap: bool) -> DuplexSchedule:
    """Parts for demotion pairs ``down`` and promotion pairs ``up`` of one group (``(n, 2)`` arrays).

    ``overlap``: both directions run at once (streams of their own); else one copy after another,
    where the fewest parts the order allows are best. Parts follow ``down``'s order. Raises
    ``InvariantError`` when the pairs wait on each other in a circle, or a victim lands in a
    promoted page's slot before that promotion can have run.
    """
    n = len(down)
    if not n:
        return DuplexSchedule(up, [])
    up_after = _reader(down[:, 0], up[:, 1])  # the demotion that vacates each promotion's destination
    down_after = _reader(up[:, 0], down[:, 1])  # the promotion that vacates each victim's destination
    waits = down_after >= 0
    chained = np.zeros(n, dtype=bool)
    chained[waits] = up_after[down_after[waits]] >= 0
    if chained.any():
        lags = np.flatnonzero(chained) - up_after[down_after[chained]]
        lag = int(lags.min())
        if lag <= 0:
            raise InvariantError(f"a swap whose victims wait for promotions that wait for them (lag {lag})")
    else:
        lag = n
    whole = part_pages(n, page_bytes)
    if not overlap or whole >= n:
        size = min(whole if overlap else n, lag)
    else:
        size = min(whole, max(1, lag // 2))
    up_part = np.where(up_after >= 0, up_after // size, READY)
    down_waits = np.full(n, NO_WAIT, dtype=np.int64)
    down_waits[waits] = up_part[down_after[waits]]
    order = np.argsort(up_part, kind="stable")
    ups = up[order]  # the ready promotions, then each part's, in ``up``'s order within each
    bounds = np.searchsorted(up_part[order], np.arange(READY, -(-n // size) + 1)).tolist()
    starts = np.arange(0, n, size)
    afters = np.maximum.reduceat(down_waits, starts).tolist()  # the promotion part each part waits for
    parts = []
    for k, (start, after) in enumerate(zip(starts.tolist(), afters, strict=True)):
        if after >= k:
            raise InvariantError(f"duplex part {k} would wait for promotion part {after}")
        parts.append(DuplexPart(down[start : start + size], after, ups[bounds[k + 1] : bounds[k + 2]]))
    return DuplexSchedule(ups[bounds[0] : bounds[1]], parts)


def _reader(reads: np.ndarray, writes: np.ndarray) -> np.ndarray:
    """For each slot of ``writes``, the index in ``reads`` of the pair that reads it first, or -1.

    (Within one copy no slot is read twice.)"""
    if not len(reads) or not len(writes):
        return np.full(len(writes), -1, dtype=np.int64)
    order = np.argsort(reads, kind="stable")
    ranked = reads[order]
    at = np.minimum(np.searchsorted(ranked, writes), len(ranked) - 1)
    return np.where(ranked[at] == writes, order[at], -1)
