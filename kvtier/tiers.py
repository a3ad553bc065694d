"""A tier at run time: its storage, which page owns each slot, and its evictable pages.

Invariants (checked by ``KVCacheManager.check_invariants``): ``owners[g][s]`` is the page in
slot ``s`` of group ``g`` or None; a page is in ``evictable[g]`` exactly when ``may_evict`` holds
and its data has landed (pages a plan is still moving are left out until it has run). On the
disk tier, every published page has a row in the persistent index (``record``), removed when
the page leaves the tier or the tree.
"""

from __future__ import annotations

from kvtier.eviction import EvictionIndex
from kvtier.pages import Page
from kvtier.storage.disk_index import DiskIndex, IndexRow


class Tier:
    """One tier (0 = primary) with per-group slot owners and eviction indexes."""

    __slots__ = ("disk_index", "evictable", "index", "is_last", "name", "owners", "storage")

    def __init__(self, name: str, index: int, storage, is_last: bool, disk_index: DiskIndex | None = None) -> None:
        self.name = name
        self.index = index
        self.storage = storage
        self.is_last = is_last
        self.disk_index = disk_index
        self.owners: list[list[Page | None]] = [[None] * s.num_slots for s in storage.slots]
        self.evictable = [EvictionIndex() for _ in storage.slots]

    def place(self, page: Page) -> bool:
        """Give ``page`` a free slot here (not yet indexed); False when the group is full."""
        slot = self.storage.slots[page.group].allocate()
        if slot is None:
            return False
        page.tier = self.index
        page.slot = slot
        self.owners[page.group][slot] = page
        return True

    @property
    def is_disk(self) -> bool:
        return self.disk_index is not None

    def vacate(self, page: Page, free_slot: bool = True) -> None:
        """Take ``page`` out of this tier; its slot is freed now, or later by the caller."""
        self.evictable[page.group].discard(page)
        self.owners[page.group][page.slot] = None
        if free_slot:
            self.storage.slots[page.group].free(page.slot)
        self.forget(page)

    def record(self, page: Page) -> None:
        """On the disk tier, persist the index row of a published page that is here."""
        node = page.node
        if self.disk_index is None or node is None or node.parent is None:
            return
        self.disk_index.put(
            IndexRow(
                node.key,
                page.group,
                page.snapshot_offset,
                page.slot,
                page.checksum,
                node.parent.key,
                node.scope.encode(),
                node.tokens,
                node.block,
                page.priority,
            )
        )

    def forget(self, page: Page) -> None:
        """On the disk tier, drop the index row of a page (before it leaves the tier or the tree)."""
        if self.disk_index is not None and page.node is not None:
            self.disk_index.delete(page.node.key, page.group, page.snapshot_offset)

    def may_evict(self, page: Page) -> bool:
        """Unlocked pages may leave; from the last tier only pages no cache holds (they are dropped)."""
        return page.locks == 0 and (page.refs == 0 or not self.is_last)

    def reindex(self, page: Page) -> None:
        """Put ``page`` in or out of the eviction index; re-adding makes it the most recently used."""
        if self.may_evict(page):
            self.evictable[page.group].add(page)
        else:
            self.evictable[page.group].discard(page)
