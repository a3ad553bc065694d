"""Scratch memory on the primary tier's device through which a small swap's victims pass.

In a swap (``MovePlanner._swap``) a victim may land in the host slot of a promoted page only
after that page was read, and the page may land in the victim's slot only after the victim was
read. Without scratch the first victims go to free host slots (``duplex.swap_lag``'s head start,
pages dropped from a full host tier to free them) so that the demotion runs ahead. A swap whose
victims fit in the scratch needs no head start: the mover copies them into the scratch (device
to device), promotes the pages, then copies the victims from the scratch to the slots the
promoted pages left (``ScratchSwap``; in turn, as any race of at most ``DUPLEX_MIN_PART_BYTES``
runs in one part).

A swap with more victims than the scratch holds parks as many as it can and takes a head start
for the rest, when that is smaller than its usual one (``MovePlanner._swap``). The buffer is
allocated by the first swap that parks victims, at most ``SWAP_SCRATCH_BYTES``, never more than
the primary tier's largest group (no swap has more victims); when that allocation fails, swaps
keep their head start. Plans reuse it one after another: each plan's copies start after the
previous plan's (``Mover``'s chain of events).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import InvariantError
from kvtier.tiering.duplex import DUPLEX_MIN_PART_BYTES

log = logging.getLogger(__name__)

SWAP_SCRATCH_BYTES = DUPLEX_MIN_PART_BYTES  # the most scratch memory a mover allocates, in bytes


class SwapScratch:
    """At most ``limit_bytes`` of scratch on ``device``, allocated by the first swap that needs it."""

    def __init__(self, device: torch.device, limit_bytes: int) -> None:
        self.device = device
        self.limit_bytes = max(0, limit_bytes)
        self._buffer: torch.Tensor | None = None
        self._failed = False

    def pages(self, page_bytes: int) -> int:
        """How many pages of ``page_bytes`` the scratch holds, or would once allocated (0 after an
        allocation failed: swaps keep their head start)."""
        return 0 if self._failed else self.limit_bytes // page_bytes

    def allocate(self) -> bool:
        """Allocate the scratch unless it is; False (logged once, and for good) when that fails."""
        if self._buffer is None and not self._failed:
            try:
                with torch.inference_mode(False):  # written in place by later calls, as the tiers' buffers are
                    self._buffer = torch.empty(self.limit_bytes, dtype=torch.uint8, device=self.device)
            except (MemoryError, RuntimeError) as exc:  # (torch.OutOfMemoryError is a RuntimeError)
                self._failed = True
                log.warning(
                    "kvtier: no %d bytes of swap scratch (%s); swaps take a head start instead", self.limit_bytes, exc
                )
        return self._buffer is not None

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    @property
    def buffer(self) -> torch.Tensor:
        """The scratch bytes (``allocate`` made them)."""
        if self._buffer is None:
            raise InvariantError("the swap scratch is used before any swap asked for it")
        return self._buffer

    def release(self) -> None:
        """Give the memory back (after every copy finished); a later swap allocates it again."""
        self._buffer = None


@dataclass(frozen=True, slots=True)
class ScratchSwap:
    """The copies of a swap through the scratch, run in this order on one stream:

    ``park``: chained victims (primary slot, scratch slot), into scratch slots 0, 1, ...;
    ``direct``: the other victims (primary slot, lower slot), into slots nothing reads;
    ``up``: the promotions (lower slot, primary slot), into slots the victims left or free ones;
    ``unpark``: the chained victims (scratch slot, lower slot), into the slots promotions left.
    """

    park: np.ndarray
    direct: np.ndarray
    up: np.ndarray
    unpark: np.ndarray

    @property
    def parked(self) -> int:
        return len(self.park)


def through_scratch(down: np.ndarray, up: np.ndarray) -> ScratchSwap | None:
    """The demotion pairs ``down`` (primary slot, lower slot) and promotion pairs ``up`` (lower
    slot, primary slot) of one group as a ``ScratchSwap``, or None when no victim lands in a slot
    a promotion reads (no swap: the pairs race as ``kvtier.tiering.duplex`` cuts them)."""
    if not len(up) or not len(down):
        return None
    chained = _found_in(down[:, 1], up[:, 0])
    count = int(np.count_nonzero(chained))
    if not count:
        return None
    waiting, direct = (down, down[:0]) if count == len(down) else (down[chained], down[~chained])
    park, unpark = np.empty((count, 2), dtype=np.int64), np.empty((count, 2), dtype=np.int64)
    park[:, 0] = waiting[:, 0]
    park[:, 1] = unpark[:, 0] = np.arange(count, dtype=np.int64)
    unpark[:, 1] = waiting[:, 1]
    return ScratchSwap(park=park, direct=direct, up=up, unpark=unpark)


def _found_in(slots: np.ndarray, read: np.ndarray) -> np.ndarray:
    """Which of ``slots`` are among ``read`` (non-empty): a binary search of each in ``read``
    sorted: 40 us for 2,048 pages (``np.isin`` sorts both together once the slots spread over a
    large tier, 200 us; a mask over slots would cost a host tier's whole slot count per call).
    ``read`` already ascending (a swap's promotions, which ``MovePlanner._swap`` pairs in slot
    order) is searched as it is: telling costs a sixth of the sort. A swap with neither free slots
    nor a head start pairs every victim with a promoted page's slot, in the same order: ``slots``
    equal to ``read`` are all found, with no search."""
    if len(slots) == len(read) and (slots == read).all():
        return np.ones(len(slots), dtype=bool)
    ordered = read if (read[1:] > read[:-1]).all() else np.sort(read)
    at = np.searchsorted(ordered, slots)
    np.minimum(at, len(ordered) - 1, out=at)
    return ordered[at] == slots
