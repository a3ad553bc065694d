"""The page record: where one page of one layer group lives and who holds it.

A page's state is computed from its holders, never stored:

    LOCKED     held by at least one ACTIVE cache: stays in the primary tier, never evicted
    HELD       held only by SUSPENDED caches: may be demoted to a lower tier, never dropped
    DROPPABLE  held only by the reuse tree: may be demoted, and dropped from the last tier
    (free)     no holder at all: its slot goes back to the tier at once

``locks`` also counts short-lived pins taken while an operation moves the cache's own pages, so
that making room for a cache never evicts the pages it is about to use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kvtier.tree import Node

BAD_PAGE_INDEX: Final = -1
"""``page_indices`` entry for a block with no page (e.g. a stale sliding-window block)."""


class PageState(str, enum.Enum):
    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"
    FREE = "free"


@dataclass(slots=True, eq=False)
class Page:
    """One page of layer group ``group`` in slot ``slot`` of tier ``tier`` (an index, 0 = primary).

    Invariants: ``0 <= locks <= refs``; a page with ``refs == 0`` is published in the tree
    (``node`` is set), otherwise it has been freed. ``snapshot_offset`` is 0 for a block page and
    ``k`` (1..tokens_per_block) for a recurrent state snapshot taken after the first ``k`` tokens
    of ``node``'s block. ``checksum`` is meaningful while the page is on disk. ``damaged`` marks a
    page whose bytes failed their checksum when read back: it is never published again, and a
    cache holding it starts over from its longest intact prefix on its next resume.
    """

    group: int
    tier: int
    slot: int
    priority: int
    refs: int = 0
    locks: int = 0
    node: Node | None = None
    snapshot_offset: int = 0
    checksum: int = 0
    damaged: bool = False

    @property
    def state(self) -> PageState:
        if self.locks:
            return PageState.LOCKED
        if self.refs:
            return PageState.HELD
        return PageState.DROPPABLE if self.node is not None else PageState.FREE
