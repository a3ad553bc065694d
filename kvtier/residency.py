"""Page residency: holding and locking pages, making room, the demotion cascade, promotion.

Everything that changes where a page lives goes through ``Residency``. Operations first *plan*
(bookkeeping moves at once: slots are reassigned, pages dropped), then the plan is executed
(``kvtier.mover``), which copies the data in an order that never overwrites a slot before its
old contents have been read:

    1. demotions, deepest edge first (host->disk before primary->host);
    2. promotions and private copies into warmer tiers;
    3. slots read by step 2 are freed, moved pages become evictable again.

A page the plan is moving is not in any eviction index until its data has landed, so a plan
never picks it as a victim, and a page pinned by the operation (``locks``) is never a victim.

Writes to the disk tier happen while planning (``kvtier.disk_writes``). A published page
promoted from disk leaves its bytes there as a copy (``Tier.add_copy``). A read-only disk tier
is never a destination.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from kvtier.disk_writes import DiskWrites
from kvtier.pages import Page
from kvtier.stats import Counters
from kvtier.tiers import Tier
from kvtier.tree import RadixTree

PRIMARY = 0


@dataclass(slots=True)
class MovePlan:
    """Copies an operation still has to perform, keyed by (src tier, dst tier, group).

    Each edge holds a flat list ``[src_slot, dst_slot, src_slot, dst_slot, ...]``.
    """

    edges: defaultdict[tuple[int, int, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    landed: list[Page] = field(default_factory=list)
    deferred_frees: list[tuple[int, int, int]] = field(default_factory=list)  # (tier, group, slot)
    kept_on_disk: list[tuple[Page, int]] = field(default_factory=list)  # promoted from disk: (page, its disk slot)
    damaged: list[Page] = field(default_factory=list)  # pages whose bytes failed their checksum on the way

    def add(self, src_tier: int, dst_tier: int, group: int, src_slot: int, dst_slot: int) -> None:
        edge = self.edges[(src_tier, dst_tier, group)]
        edge.append(src_slot)
        edge.append(dst_slot)


class Residency:
    """Where pages live and who holds them, across all tiers."""

    def __init__(self, tiers: list[Tier], tree: RadixTree, counters: Counters) -> None:
        self.tiers = tiers
        self.tree = tree
        self.counters = counters
        self._last = len(tiers) - 1
        self._disk = next((t for t in tiers if t.is_disk), None)
        self._disk_writes = None if self._disk is None else DiskWrites(self, self._disk)
        # Writes pages (all in one tier and group) to disk slots; a checksum per page, None if it failed.
        self.write_to_disk: Callable[[list[Page], list[int]], list[int | None]] = _no_disk

    # -- holders -------------------------------------------------------------------------

    def new_page(self, group: int, priority: int, locked: bool) -> Page | None:
        """A page in a free primary slot, held by one cache (locked if it is ACTIVE)."""
        page = Page(group, PRIMARY, -1, priority, 1, 1 if locked else 0)
        if not self.tiers[PRIMARY].place(page):
            return None
        if not locked:
            self.tiers[PRIMARY].reindex(page)
        return page

    def hold(self, page: Page) -> None:
        """One more cache holds ``page`` (it is not locked by that).

        Only on the last tier does a first holder change evictability (held pages cannot be dropped).
        """
        page.refs += 1
        if page.refs == 1 and page.tier == self._last and page.locks == 0:
            self.tiers[page.tier].evictable[page.group].discard(page)

    def release(self, page: Page, locked: bool) -> None:
        """A cache lets go of ``page``; it is freed when nobody, not even the tree, holds it."""
        if locked:
            page.locks -= 1
        page.refs -= 1
        if page.refs == 0 and page.node is None:
            self.tiers[page.tier].vacate(page)
        elif page.locks == 0:
            self.tiers[page.tier].reindex(page)

    def lock(self, page: Page) -> None:
        page.locks += 1
        if page.locks == 1:
            self.tiers[page.tier].evictable[page.group].discard(page)

    def unlock(self, page: Page) -> None:
        """Drop a pin; a page that nobody holds any more (unpublished while pinned) is freed now."""
        page.locks -= 1
        if page.locks == 0:
            if page.refs == 0 and page.node is None:
                self.tiers[page.tier].vacate(page)
            else:
                self.tiers[page.tier].reindex(page)

    # -- dropping ------------------------------------------------------------------------

    def drop(self, page: Page) -> None:
        """Discard a page only the tree holds: unpublish it and free its slot."""
        assert page.node is not None and page.refs == 0, "only tree-held pages are dropped"
        self.counters.drops += 1
        self.unpublish(page)

    def unpublish(self, page: Page) -> None:
        """Take ``page`` out of the tree; it is freed unless a cache holds it or an operation pins it
        (then the last ``unlock`` frees it)."""
        node = page.node
        assert node is not None
        tier = self.tiers[page.tier]
        tier.forget(page)
        if self._disk is not None and page in self._disk.copies:
            self._disk.remove_copy(self._disk.copies[page])
        if page.snapshot_offset:
            del node.snapshots[page.snapshot_offset]
        else:
            node.pages[page.group] = None
        page.node = None
        if page.refs == 0 and page.locks == 0:
            tier.vacate(page)
        else:
            tier.reindex(page)
        self.tree.prune(node)

    def mark_damaged(self, page: Page) -> None:
        """``page``'s bytes failed their checksum: never reuse it; its holders start over on resume."""
        if page.damaged:
            return
        page.damaged = True
        self.counters.checksum_failures += 1
        if page.node is not None:
            self.unpublish(page)

    # -- making room -----------------------------------------------------------------------

    def make_room(self, tier_index: int, group: int, count: int, plan: MovePlan) -> bool:
        """Free slots in a tier until ``count`` are free, demoting or dropping victims.

        Victims go lowest priority first, then least recently used, all demoted together to the
        next tier that can make room for them (normally the next one). From the last tier, or
        when nothing below can take them, only pages held by the tree alone are dropped. Returns
        False when the room cannot be had; evictions already done stay valid (they lose nothing
        a cache holds).
        """
        tier = self.tiers[tier_index]
        slots = tier.storage.slots[group]
        index = tier.evictable[group]
        short = count - slots.num_free
        if short <= 0:
            return True
        if short > len(index):
            return False
        if tier.is_last:
            self._drop_some(index, short)
        else:
            victims = list(islice(index, short))
            for dst_index in range(tier_index + 1, len(self.tiers)):
                # The next tier first; a colder one when the next is full of pinned pages (a swap).
                if self.tiers[dst_index].writable and self.make_room(dst_index, group, short, plan):
                    self._demote(victims, dst_index, plan)
                    break
            if slots.num_free < count:
                self._drop_some(index, count - slots.num_free)
        return slots.num_free >= count

    def _drop_some(self, index, count: int) -> None:
        """Drop ``count`` tree-only pages in eviction order, or none if there are fewer."""
        victims = list(islice((p for p in index if p.refs == 0), count))
        if len(victims) < count:
            return
        for page in victims:
            if self._disk is not None and page in self._disk.originals:
                self._disk.remove_copy(page)  # a copy: its original stays where it is
                continue
            self.counters.evictions += 1
            self.drop(page)

    def _demote(self, victims: list[Page], dst_index: int, plan: MovePlan) -> None:
        """Move victims one tier down; the next tier has a free slot for each."""
        dst = self.tiers[dst_index]
        if not dst.is_disk:
            for page in victims:
                self.counters.evictions += 1
                self.counters.demotions += 1
                self.move(page, dst_index, plan)
            return
        assert self._disk_writes is not None and dst is self._disk_writes.disk
        self._disk_writes.demote(victims, plan)

    def persist(self, plan: MovePlan) -> int:
        """Write published pages held in memory tiers to the disk tier, parents first (at close).

        So that a manager started later on the same path finds the hot prefixes too, with
        unbroken chains. Returns the number of pages it tried to write.
        """
        return 0 if self._disk_writes is None else self._disk_writes.persist(plan)

    def move(self, page: Page, dst_index: int, plan: MovePlan) -> None:
        """Plan moving ``page`` to a tier that has a free slot for it.

        Demotions free the source slot at once (a deeper edge runs first, so its contents are
        read before anything lands there); promotions free it only after the plan ran, except a
        published page's disk slot, which then holds its copy (its chain's rows stay restorable,
        and demoting it again needs no write).
        """
        src = self.tiers[page.tier]
        src_index, src_slot = page.tier, page.slot
        demotion = dst_index > src_index
        src.vacate(page, free_slot=demotion)
        placed = self.tiers[dst_index].place(page)
        assert placed, "move() needs a free slot in the destination"
        plan.add(src_index, dst_index, page.group, src_slot, page.slot)
        plan.landed.append(page)
        if not demotion and src.is_disk and page.node is not None:
            plan.kept_on_disk.append((page, src_slot))  # its bytes stay there, as a copy
        elif not demotion:
            plan.deferred_frees.append((src_index, page.group, src_slot))

    def hold_all(self, pages: list[Page | None]) -> None:
        """``hold`` for every page of a list (None entries skipped), in one pass."""
        last = self._last
        evictable = self.tiers[last].evictable
        for page in pages:
            if page is not None:
                page.refs += 1
                if page.refs == 1 and page.tier == last and not page.locks:
                    evictable[page.group].discard(page)

    def lock_all(self, pages: list[Page]) -> tuple[dict[int, int], bool]:
        """``lock`` every page; returns (pages outside the primary tier per group, any damaged)."""
        tiers = self.tiers
        cold: dict[int, int] = {}
        damaged = False
        for page in pages:
            page.locks += 1
            if page.locks == 1:
                tiers[page.tier].evictable[page.group].discard(page)
            if page.tier != PRIMARY:
                cold[page.group] = cold.get(page.group, 0) + 1
            damaged = damaged or page.damaged
        return cold, damaged

    def promote(self, pages: list[Page], plan: MovePlan, need: dict[int, int]) -> bool:
        """Plan moving every page of ``pages`` into the primary tier, with room for ``need[g]`` pages.

        ``need`` counts the pages outside the primary tier plus any new pages to allocate. The
        pages must be pinned (locked) by the caller so that making room cannot evict them.
        Returns False, with nothing promoted, when the primary tier cannot hold them all.
        """
        for group, count in need.items():
            if not self.make_room(PRIMARY, group, count, plan):
                return False
        for page in pages:
            if page.tier != PRIMARY:
                self.counters.promotions += 1
                self.move(page, PRIMARY, plan)
        return True

    def finish(self, plan: MovePlan) -> None:
        """After the plan's copies ran: free the slots they read, index the pages they moved."""
        for tier_index, group, slot in plan.deferred_frees:
            self.tiers[tier_index].storage.slots[group].free(slot)
        for page in plan.landed:
            if page.refs or page.node is not None:
                self.tiers[page.tier].reindex(page)
        for page in plan.damaged:
            self.mark_damaged(page)
        for page, slot in plan.kept_on_disk:
            assert self._disk is not None
            if page.damaged or page.node is None:
                self._disk.storage.slots[page.group].free(slot)
            else:
                self._disk.add_copy(page, slot, page.checksum)
        plan.kept_on_disk.clear()
        plan.deferred_frees.clear()
        plan.landed.clear()
        plan.edges.clear()
        plan.damaged.clear()


def _no_disk(pages: list[Page], slots: list[int]) -> list[int | None]:
    raise AssertionError("this manager has no disk tier")
