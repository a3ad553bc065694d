"""The two records of the pool: a ``Page`` (where one page lives, who holds it) and a tree ``Node``.

They point at each other: a node of the reuse tree (``kvtier.reuse.tree``) holds, per layer
group, the page published for its block, and a published page points back at its node. Neither
is scanned by the cyclic garbage collector (``kvtier.gc_untrack``): the tree breaks their cycles
itself, block by block as blocks leave and all at once when its pool dies.

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
from typing import Final

from kvtier.config import ReuseScope
from kvtier.gc_untrack import untrack
from kvtier.spec import GroupId

BAD_PAGE_INDEX: Final = -1
"""``page_indices`` entry for a block with no page (e.g. a stale sliding-window block)."""


class PageState(str, enum.Enum):
    """A page's state, computed from its holders (``Page.state``)."""

    LOCKED = "locked"
    HELD = "held"
    DROPPABLE = "droppable"
    FREE = "free"


@dataclass(slots=True, eq=False)
class Page:
    """One page of layer group ``group`` in slot ``slot`` of tier ``tier`` (an index, 0 = primary).

    Invariants: ``0 <= locks <= refs`` (plus one lock per prefetch from disk reading it); a page
    with ``refs == 0`` is published in the tree (``node`` is set), otherwise it has been freed.
    ``snapshot_offset`` is 0 for a block page and
    ``k`` (1..tokens_per_block) for a recurrent state snapshot taken after the first ``k`` tokens
    of ``node``'s block. ``checksum`` is meaningful while the page is on disk. ``damaged`` marks a
    page whose bytes failed their checksum when read back: it is never published again, and a
    cache holding it starts over from its longest intact prefix on its next resume. ``hits``
    counts the caches that reused the page (each once, at its first resume), while the pool counts
    them (``HostTier.write_through_min_hits``), else it stays 0.
    """

    group: GroupId
    tier: int
    slot: int
    priority: int
    refs: int = 0
    locks: int = 0
    node: Node | None = None
    snapshot_offset: int = 0
    checksum: int = 0
    damaged: bool = False
    hits: int = 0

    def __post_init__(self) -> None:
        untrack(self)  # (its one reference, ``node``, closes a cycle only while that node holds it)

    @property
    def state(self) -> PageState:
        """LOCKED, HELD, DROPPABLE or FREE, from ``locks``, ``refs`` and ``node``."""
        if self.locks:
            return PageState.LOCKED
        if self.refs:
            return PageState.HELD
        return PageState.DROPPABLE if self.node is not None else PageState.FREE


class Node:
    """One published block of the reuse tree, or a scope's root (``block == -1``).

    ``pages[g]`` is the page published for the block in layer group ``g`` (or None);
    ``snapshots[k]`` a recurrent state snapshot taken after the block's first ``k`` tokens.
    ``users`` counts the caches whose deepest block this node is (their ancestors all have a child).
    A node with no page, no snapshot, no child and no user is pruned.
    """

    __slots__ = ("block", "children", "key", "pages", "parent", "scope", "snapshots", "tokens", "users")

    def __init__(
        self, parent: Node | None, tokens: bytes, key: bytes, num_groups: int, scope: ReuseScope | None
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.key = key
        self.scope = scope
        self.block = -1 if parent is None else parent.block + 1
        self.children: dict[bytes, Node] = {}
        self.pages: list[Page | None] = untrack([None] * num_groups)
        self.snapshots: dict[int, Page] = {}
        self.users = 0
        untrack(self)

    # The dicts of children and snapshots stay out of the cyclic collector's sight as the node does:
    # CPython tracks a dict again whenever a trackable value goes in, so each insert untracks it.

    def add_child(self, block_tokens: bytes, child: Node) -> None:
        """``children[block_tokens] = child``."""
        self.children[block_tokens] = child
        untrack(self.children)

    def put_snapshot(self, offset: int, page: Page) -> None:
        """``snapshots[offset] = page``."""
        self.snapshots[offset] = page
        untrack(self.snapshots)

    def is_empty(self) -> bool:
        pages = self.pages
        return not self.children and not self.snapshots and self.users == 0 and pages.count(None) == len(pages)

    def __repr__(self) -> str:
        return f"Node(block={self.block}, key={self.key.hex()[:12]})"
