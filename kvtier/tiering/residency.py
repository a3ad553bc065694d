"""Who holds which page: caches' holds and locks, the tree's publication, freeing and dropping.

A page's state follows from its holders (``Page.state``): LOCKED while an ACTIVE cache (or an
operation's pin) locks it, HELD while only suspended caches hold it, DROPPABLE while only the
tree publishes it, FREE with no holder at all, when its slot goes back to its tier at once.
``Residency`` changes holders and keeps each tier's eviction index in step with the state
(``Tier.may_evict``): a page that becomes evictable is indexed at once; one that stops being
evictable (a cache holds or locks it) keeps its entry until a victim search passes it (a stale
entry, ``kvtier.tiering.eviction``), so that holding a long cached prompt touches no index.
What moves where is the planner's (``kvtier.tiering.planner``).

A page pinned by an operation that loses its last holder meanwhile (unpublished while a prefetch
pins it) is freed by the last ``unlock``, never under the pin.
"""

from __future__ import annotations

from kvtier.errors import InvariantError
from kvtier.pages import Node, Page, PageState
from kvtier.reuse.tree import RadixTree
from kvtier.spec import GroupId
from kvtier.stats import Counters
from kvtier.tiering.tier import Tier

PRIMARY = 0


class Residency:
    """The holders of every page across all tiers."""

    def __init__(self, tiers: list[Tier], tree: RadixTree, counters: Counters) -> None:
        self.tiers = tiers
        self.tree = tree
        self.counters = counters
        self._copy_tiers = [t for t in tiers if t.keeps_copies]
        self.count_hits = False  # count each reuse in ``Page.hits`` (a write-through policy reads them)

    # -- caches' holds and locks -------------------------------------------------------------------

    def new_page(self, group: GroupId, priority: int, locked: bool) -> Page | None:
        """A page in a free primary slot, held by one cache (locked if it is ACTIVE); None when full."""
        page = Page(group, PRIMARY, -1, priority, 1, 1 if locked else 0)
        if not self.tiers[PRIMARY].place(page):
            return None
        if not locked:
            self.tiers[PRIMARY].reindex(page)
        return page

    def hold(self, page: Page) -> None:
        """One more cache holds ``page`` (it is not locked by that; on the last tier it can no longer
        be dropped, and its index entry goes stale)."""
        page.refs += 1

    def hold_all(self, pages: list[Page | None]) -> None:
        """``hold`` for every page of a list (None entries skipped), in one pass."""
        for page in pages:
            if page is not None:
                page.refs += 1

    def add_hits(self, pages: list[Page]) -> None:
        """A cache reuses these pages (at its first resume): one more hit each (called only while
        ``count_hits``)."""
        for page in pages:
            page.hits += 1

    def release(self, page: Page, locked: bool) -> None:
        """A cache lets go of ``page``; it is freed when nobody, not even the tree, holds it."""
        if locked:
            page.locks -= 1
        page.refs -= 1
        if page.locks:  # still LOCKED (another active cache, or a pin)
            return
        if page.refs == 0 and page.node is None:  # FREE (Page.state, inlined: this runs per page at close)
            self.tiers[page.tier].vacate(page)
        else:
            self.tiers[page.tier].reindex(page)

    def release_all(self, pages: list[Page], locked: bool) -> None:
        """``release`` for distinct pages of a list, in order: one pass over the holds, then the
        pages nobody locks any more are freed or indexed in bulk (``_settle``)."""
        if locked:
            for page in pages:
                page.locks -= 1
                page.refs -= 1
        else:
            for page in pages:
                page.refs -= 1
        self._settle([page for page in pages if not page.locks])

    def lock(self, page: Page) -> None:
        """Pin ``page`` where it is: it may not leave its tier (its index entry goes stale)."""
        page.locks += 1

    def lock_all(self, pages: list[Page]) -> tuple[dict[int, int], bool]:
        """``lock`` every page; returns (pages outside the primary tier per group, any damaged)."""
        groups: list[int] = []  # of the pages outside the primary tier
        cold_group = groups.append
        damaged = False
        for page in pages:  # one pass: each page is read once
            page.locks += 1
            if page.tier != PRIMARY:
                cold_group(page.group)
            if page.damaged:
                damaged = True
        cold: dict[int, int] = {}
        if groups and groups.count(groups[0]) == len(groups):
            cold[groups[0]] = len(groups)
        else:
            for group in groups:
                cold[group] = cold.get(group, 0) + 1
        return cold, damaged

    def unlock(self, page: Page) -> None:
        """Drop a lock or a pin; a page that nobody holds any more (unpublished while pinned) is freed now."""
        page.locks -= 1
        state = page.state
        if state is PageState.FREE:
            self.tiers[page.tier].vacate(page)
        elif state is not PageState.LOCKED:
            self.tiers[page.tier].reindex(page)

    def unlock_all(self, pages: list[Page]) -> None:
        """``unlock`` for distinct pages of a list, in order, as ``release_all`` does."""
        for page in pages:
            page.locks -= 1
        self._settle([page for page in pages if not page.locks])

    def _settle(self, pages: list[Page]) -> None:
        """Pages that just lost their last lock: those nobody holds any more are freed, the others
        indexed as the most recently used of their tiers, in order (``Tier.reindex_all``)."""
        kept = [page for page in pages if page.refs or page.node is not None]
        if len(kept) < len(pages):
            for page in pages:
                if not page.refs and page.node is None:
                    self.tiers[page.tier].vacate(page)
        tiers = {page.tier for page in kept}
        if len(tiers) == 1:
            self.tiers[tiers.pop()].reindex_all(kept)
            return
        for index in sorted(tiers):
            self.tiers[index].reindex_all([page for page in kept if page.tier == index])

    # -- the tree's publication -------------------------------------------------------------------

    def unpublish(self, page: Page) -> None:
        """Take ``page`` out of the tree; it is freed unless a cache holds it or an operation pins it
        (then the last ``release`` or ``unlock`` frees it)."""
        node = page.node
        if node is None:
            raise InvariantError(f"{page} is not published")
        tier = self.tiers[page.tier]
        tier.forget(page)
        _unlink(page, node, self._copy_tiers)
        if page.state is PageState.FREE:
            tier.vacate(page)
        else:
            tier.reindex(page)
        self.tree.prune(node)

    def drop(self, page: Page) -> None:
        """Discard a DROPPABLE page (only the tree holds it): unpublish it and free its slot."""
        if page.state is not PageState.DROPPABLE:
            raise InvariantError(f"{page} is {page.state.value}: only droppable pages are dropped")
        self.counters.drops += 1
        self.unpublish(page)

    def forget_below(self, root: Node) -> int:
        """Take every page published under ``root`` out of the tree, in every tier: those only the
        tree holds are dropped (slots freed, disk rows removed), the others are freed by their
        last ``release`` or ``unlock``. Emptied nodes are pruned; the root stays. Returns the pages dropped."""
        nodes: list[Node] = []
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        dropped = 0
        for node in reversed(nodes):  # children first: each prune then climbs only through emptied nodes
            for page in [*node.snapshots.values(), *(p for p in node.pages if p is not None)]:
                if page.state is PageState.DROPPABLE:
                    self.drop(page)
                    dropped += 1
                else:
                    self.unpublish(page)
        return dropped

    def drop_for_room(self, tier_index: int, group: int, count: int) -> bool:
        """Free slots in the last tier until ``count`` are free by dropping droppable pages in eviction
        order (a disk copy goes first, its original stays); all or none. Returns whether they are free."""
        tier = self.tiers[tier_index]
        slots = tier.storage.slots[group]
        index = tier.evictable[group]
        short = count - slots.num_free
        if short <= 0:
            return True
        if short > len(index):
            return False
        self.drop_some(tier_index, group, short)
        return slots.num_free >= count

    def drop_some(self, tier_index: int, group: int, count: int) -> None:
        """Drop ``count`` pages only the tree holds from a tier, in eviction order, or none if there are fewer.
        On the disk tier a chain goes from its deepest block up (``_chain_ends``)."""
        tier = self.tiers[tier_index]
        # (on the last tier every evictable page is one no cache holds)
        last = tier.is_last
        if tier.chain_groups:
            victims = self._chain_ends(tier, group, count)
        else:
            victims = tier.evictable[group].take(count, held_stale=last, unheld_only=not last)
        if len(victims) < count:
            return
        orphans = tier.orphans(victims)
        originals = tier.originals
        if not originals:
            self.counters.evictions += count
            self._drop_all(tier, group, victims)
        else:
            for page in victims:
                if page in originals:
                    tier.remove_copy(page)  # a copy: its original stays where it is
                    continue
                self.counters.evictions += 1
                self._drop_all(tier, group, [page])
        if orphans:
            self._drop_orphans(tier, orphans)

    def _drop_orphans(self, tier: Tier, orphans: list[Page]) -> None:
        """Drop ``Tier.orphans`` from the disk tier: copies are freed, originals dropped."""
        by_group: dict[int, list[Page]] = {}
        for page in orphans:
            if page in tier.originals:
                tier.remove_copy(page)
            elif page.node is not None:
                by_group.setdefault(page.group, []).append(page)
        for group, pages in by_group.items():
            self.counters.evictions += len(pages)
            self._drop_all(tier, group, pages)

    @staticmethod
    def _chain_ends(tier: Tier, group: int, count: int) -> list[Page]:
        """Up to ``count`` droppable pages of the disk tier in eviction order, deepest first, none
        that a block below needs unless that block's pages go too (its pages of other groups go
        with its full-attention page: ``Tier.orphans``), so that a restart after any drop still
        reaches every page left on disk, and a match every block below in memory
        (``Tier.holds_chain_below``). A page that holds a chain below is kept and the search runs
        again: a spare copy (a promotion left it above blocks it did not promote) with the pages
        of the search above it, the chain below keeping its places (``Tier.keep_above_chain``);
        any other page (the chain below is behind it: a higher priority, or restored top first)
        moves behind the chain, which moves deepest first (``Tier.keep_for_chain``)."""
        index = tier.evictable[group]
        spare = tier.spare_copies
        kept_before: set[int] = set()
        for _ in range(count + len(index) + 1):  # each pass keeps a page or a chain
            victims = index.take(count, held_stale=True)
            if len(victims) < count:
                return victims  # too few: nothing is dropped
            leaving = {id(page) for page in victims}
            leaving.update(map(id, tier.orphans(victims)))  # they go along (``drop_some``)
            chained = [page for page in victims if tier.holds_chain_below(page, leaving)]
            if not chained:
                return sorted(victims, key=lambda page: -page.node.block)  # blocks below go first
            kept: set[int] = set()
            above: dict[int, Page] = {}
            for page in chained:  # from the highest block of the search above it: each chain walked once
                path = tier.path_above(page, leaving)
                if page in spare:
                    above.update((id(p), p) for p in path)
                elif id(path[-1]) not in kept:
                    kept.update(map(id, tier.keep_for_chain(path[-1])))
            tier.keep_above_chain([page for key, page in above.items() if key not in kept])
            kept.update(above)
            if kept <= kept_before:
                return []  # the search came round to pages it kept already: every page is needed
            kept_before |= kept
        return []

    def _drop_all(self, tier: Tier, group: int, pages: list[Page]) -> None:
        """``drop`` for droppable pages of one tier and group, in order: unpublished, their slots freed,
        then their emptied nodes pruned from the tree (the tree ends as page-by-page drops leave it)."""
        on_disk = tier.disk_index is not None
        keepers = [k for k in self._copy_tiers if k.copies]  # a page here has its copies in colder tiers
        owners = tier.owners[group]
        nodes = []
        slots = []
        for page in pages:
            node = page.node
            if node is None or page.refs or page.locks:
                raise InvariantError(f"{page} is {page.state.value}: only droppable pages are dropped")
            if on_disk:
                tier.forget(page)
            if keepers:
                _unlink(page, node, keepers)
            elif page.snapshot_offset:
                del node.snapshots[page.snapshot_offset]
                page.node = None
            else:  # ``_unlink`` without copies to free, inlined: this runs for every page dropped
                node.pages[group] = None
                page.node = None
            slot = page.slot
            owners[slot] = None
            slots.append(slot)
            nodes.append(node)
        tier.evictable[group].discard_all(pages)
        tier.storage.slots[group].free_all(slots)
        self.counters.drops += len(nodes)
        self.tree.prune_all(nodes)

    def mark_damaged(self, page: Page, failed_checksum: bool = True) -> None:
        """``page``'s bytes failed their checksum (or, ``failed_checksum`` False, may never have
        arrived): never reuse it; its holders start over on resume."""
        if page.damaged:
            return
        page.damaged = True
        self.counters.checksum_failures += failed_checksum
        if page.node is not None:
            self.unpublish(page)


def _unlink(page: Page, node: Node, keepers: list[Tier]) -> None:
    """Take published ``page`` off its ``node`` and free its copies in ``keepers`` (its slot stays)."""
    for keeper in keepers:
        copy = keeper.copies.get(page)
        if copy is not None:
            keeper.remove_copy(copy)
    if page.snapshot_offset:
        del node.snapshots[page.snapshot_offset]
    else:
        node.pages[page.group] = None
    page.node = None
