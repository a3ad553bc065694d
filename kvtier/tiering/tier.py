"""A tier at run time: its storage, which page owns each slot, and its evictable pages.

Invariants (checked by ``KVCacheManager.check_invariants``): ``owners[g][s]`` is the page in
slot ``s`` of group ``g`` or None; a page for which ``may_evict`` holds is in ``evictable[g]`` once
its data has landed (pages a plan is still moving are left out until it has run). The index may
also keep entries of pages held or locked since (``kvtier.tiering.eviction``: stale entries),
never of pages outside this tier and group.

On the disk tier, every published page has a row in the persistent index (``record``), removed
when the page leaves the tier or the tree, and every row's chain of blocks back to its scope's
root has rows too (written before or with it): whatever the index holds can be restored. The
disk tier also keeps *copies*: pages whose original is published in a memory tier (an ancestor
of blocks on disk, e.g. a hot system prompt that is never demoted), written so that a restart
finds the whole chain. A copy is a page of this tier owned by no cache and published nowhere
(``copies[original]`` / ``originals[copy]``); it is evictable like a dropped page, is taken over
when its original is demoted here, and goes when its original leaves the tree.

The host tier keeps copies too when write-through is on (``keeps_copies``): bytes of published
primary pages written in the background, and bytes a promotion to the primary tier left behind.
A page with a copy here is demoted by taking the copy's slot, without moving a byte.

``reserved[g]``: slots allocated for bytes still on their way (a prefetch from disk), owned by
no page until they land.

``watch`` (the primary tier, write-through on): published pages that became evictable here, in
that order, oldest first; the write-through copies them below. Bounded: the oldest fall off.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Set

from kvtier.errors import InvariantError
from kvtier.pages import Node, Page
from kvtier.storage.disk_index import DiskIndex, NodeRow, PageRow
from kvtier.tiering.eviction import EvictionIndex

log = logging.getLogger(__name__)

SWEEP_MIN = 4096  # index rows of blocks that left the tree are removed in sweeps, when this many are known


class Tier:
    """One tier (0 = primary) with per-group slot owners and eviction indexes."""

    __slots__ = (
        "_sweep_at",
        "chain_groups",
        "copies",
        "disk_index",
        "evictable",
        "index",
        "is_last",
        "keeps_copies",
        "name",
        "originals",
        "owners",
        "reserved",
        "spare_copies",
        "storage",
        "watch",
        "watch_limit",
        "writable",
        "written",
    )

    def __init__(
        self,
        name: str,
        index: int,
        storage,
        is_last: bool,
        disk_index: DiskIndex | None = None,
        keeps_copies: bool | None = None,
        chain_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.name = name
        self.index = index
        self.storage = storage
        self.is_last = is_last
        self.disk_index = disk_index
        self.writable = disk_index is None or storage.writable  # a read-only disk tier serves, takes nothing
        self.keeps_copies = disk_index is not None if keeps_copies is None else keeps_copies
        self.watch: OrderedDict[Page, None] | None = None
        self.watch_limit = 0
        self.owners: list[list[Page | None]] = [[None] * s.num_slots for s in storage.slots]
        self.evictable = [EvictionIndex() for _ in storage.slots]
        self.reserved: list[set[int]] = [set() for _ in storage.slots]  # allocated, owned by none yet
        self.copies: dict[Page, Page] = {}
        self.originals: dict[Page, Page] = {}
        self.spare_copies: set[Page] = set()  # copies no restore needs: the first to go when room is wanted
        self.chain_groups = chain_groups  # on the disk tier: groups whose page a restore needs above each block
        self.written: dict[bytes, Node] = {}  # blocks with an index row: key -> the node it was written for
        self._sweep_at = SWEEP_MIN

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

    def still_writable(self) -> bool:
        """``writable``, checked again on the disk tier: a directory removed or replaced under the
        manager (``DiskDirectory.gone``) makes the tier read-only from then on, with a WARNING. Its
        pages are still served from the files it holds open; nothing more is written, neither as
        demotions nor at close, where it would be lost (or land in another's directory)."""
        if not self.writable or self.disk_index is None or not self.disk_index.directory.gone():
            return self.writable
        self.writable = False
        log.warning(
            "kvtier disk tier: its directory %s was removed or replaced while this manager used it; the pages "
            "written there before are still served, nothing more is written (a manager made again uses the path "
            "anew)",
            self.disk_index.directory.path,
        )
        return False

    def vacate(self, page: Page, free_slot: bool = True) -> None:
        """Take ``page`` out of this tier; its slot is freed now, or later by the caller."""
        self.evictable[page.group].discard(page)
        self.owners[page.group][page.slot] = None
        if free_slot:
            self.storage.slots[page.group].free(page.slot)
        self.forget(page)

    # -- the persistent index (disk tier) --------------------------------------------------------

    def record(self, page: Page) -> None:
        """On the disk tier, persist the index row of a published page (or copy) that is here."""
        node = page.node
        if self.disk_index is None or node is None or node.parent is None:
            return
        self._write_chain(node)
        self.disk_index.put(
            PageRow(node.key, page.group, page.snapshot_offset, page.slot, page.checksum, page.priority)
        )

    def _write_chain(self, node: Node) -> None:
        """Rows for ``node`` and each ancestor that has none yet, so the page row's chain restores."""
        index = self._index()
        while node.parent is not None and self.written.get(node.key) is not node:
            parent = node.parent
            if parent.parent is None:
                if parent.scope is None:
                    break  # a restored block whose scope was not used yet: its rows are there already
                row = NodeRow(node.key, b"", index.scope_tag(parent.scope.encode()), node.tokens, node.block)
            else:
                row = NodeRow(node.key, parent.key, b"", node.tokens, node.block)
            index.put_node(row)
            self.written[node.key] = node
            node = parent
        if len(self.written) > self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Remove the rows of blocks pruned from the tree (no page, no descendant: nothing depends on them)."""
        index = self._index()
        for key, node in list(self.written.items()):
            if node.parent is None:
                index.delete_node(key)
                del self.written[key]
        self._sweep_at = max(SWEEP_MIN, 2 * len(self.written))

    def _index(self) -> DiskIndex:
        if self.disk_index is None:
            raise InvariantError(f"the {self.name} tier has no disk index")
        return self.disk_index

    def forget(self, page: Page) -> None:
        """On the disk tier, drop the index row of a page (before it leaves the tier or the tree)."""
        if self.disk_index is not None and page.node is not None:
            self.disk_index.delete(page.node.key, page.group, page.snapshot_offset)

    # -- copies (disk tier) ----------------------------------------------------------------------

    def add_copy(
        self, original: Page, slot: int, checksum: int, priority: int | None = None, spare: bool = False
    ) -> None:
        """Own a copy of ``original`` (published in a memory tier) written to ``slot``, and index it.

        A ``spare`` copy (bytes a promotion left behind, so a later demotion needs no write) is
        evicted before any other page here; a copy of an ancestor, which keeps the chains below
        it restorable after a crash, is evicted by its priority like any page."""
        if original in self.copies or original.tier == self.index:
            raise InvariantError(f"{original} has its bytes in the {self.name} tier already: no second copy")
        copy = Page(
            original.group,
            self.index,
            slot,
            original.priority if priority is None else priority,
            node=original.node,
            snapshot_offset=original.snapshot_offset,
            checksum=checksum,
        )
        self.owners[copy.group][slot] = copy
        self.copies[original] = copy
        self.originals[copy] = original
        if spare:
            self.spare_copies.add(copy)
        self.record(copy)
        self.reindex(copy)

    def add_spare_copies(self, originals: list[Page], slots: list[int]) -> None:
        """``add_copy(original, slot, original.checksum, spare=True)`` for each original and its slot
        here, in one pass; an original that needs no copy any more (damaged, unpublished meanwhile,
        or with a copy here already) has its slot freed instead."""
        index = self.index
        owners, copies_of, originals_of, spare = self.owners, self.copies, self.originals, self.spare_copies
        on_disk = self.disk_index is not None
        made = []
        for original, slot in zip(originals, slots, strict=True):
            if original.damaged or original.node is None or original in copies_of:
                self.storage.slots[original.group].free(slot)
                continue
            copy = Page(
                original.group,
                index,
                slot,
                original.priority,
                0,
                0,
                original.node,
                original.snapshot_offset,
                original.checksum,
            )
            owners[copy.group][slot] = copy
            copies_of[original] = copy
            originals_of[copy] = original
            spare.add(copy)
            if on_disk:
                self.record(copy)
            made.append(copy)
        if self.watch is not None:
            for copy in made:
                self.reindex(copy)
            return
        for g, evictable in enumerate(self.evictable):
            evictable.add_new(made if len(self.evictable) == 1 else [c for c in made if c.group == g], redundant=True)

    def slot_for_copy(
        self, group: int, keep: set[Page] | frozenset = frozenset(), unless_original_in: int | None = None
    ) -> int | None:
        """A free slot of ``group``, or else the slot of its least recently used spare copy, which is
        removed; None when neither exists (no page is ever pushed out). That copy is kept (None is
        returned) if it is one of ``keep`` or its original is in tier ``unless_original_in``. A spare
        copy that blocks below need (``holds_chain_below``) is spare no more (``keep_above_chain``)."""
        slots = self.storage.slots[group]
        slot = slots.allocate()
        while slot is None:
            first = self.evictable[group].first()
            if (
                first is None
                or first not in self.spare_copies
                or first in keep
                or self.originals[first].tier == unless_original_in
            ):
                break
            if self.holds_chain_below(first):
                self.keep_above_chain([first])
                continue
            self.remove_copy(first)
            slot = slots.allocate()
        return slot

    def here(self, page: Page | None) -> Page | None:
        """``page`` if it is in this tier, else its copy here, else None."""
        if page is None or page.tier == self.index:
            return page
        return self.copies.get(page)

    def holds_chain_below(self, page: Page, leaving: set[int] | frozenset = frozenset()) -> bool:
        """On the disk tier: whether pages here need ``page`` (here, an original or a copy of a group
        in ``chain_groups``) to be reached after a restart (``_dependents``), other than those whose
        ids are in ``leaving`` (on their way out with it): a restored block needs a page of each such
        group in itself and in every block above it. An original is also needed while a block right
        below it has a page of such a group in a memory tier (``_above_memory``): no match could
        reach that block without it."""
        if any(id(dependent) not in leaving for dependent in self._dependents(page)):
            return True
        return page not in self.originals and self._above_memory(page)

    def _above_memory(self, page: Page) -> bool:
        """Whether a block right below ``page``'s (a page of a chain group here) that a match could
        reach (``_reachable_below``) has a page of a chain group in a memory tier (a colder tier than
        this one is never a memory tier)."""
        node = page.node
        if node is None or page.group not in self.chain_groups or page.snapshot_offset:
            return False
        here = self.index
        for child in self._reachable_below(node):
            for group in self.chain_groups:
                below = child.pages[group]
                if below is not None and below.tier < here:
                    return True
        return False

    def keep_for_chain(self, page: Page) -> list[Page]:
        """Keep ``page`` (``holds_chain_below``) here: the pages here that need it, and those that
        need them, ``_outlive`` in turn from the deepest up, each at the highest priority below it,
        ``page`` last. Dropping that chain later goes from its deepest page up, one pass each.
        Returns the pages kept, ``page`` among them."""
        order: list[Page] = []  # the chain below ``page``, children before parents
        stack: list[tuple[Page, list[Page] | None]] = [(page, None)]
        while stack:
            top, below = stack.pop()
            if below is None:
                below = list(self._dependents(top))
                stack.append((top, below))
                stack.extend((dependent, None) for dependent in below)
            else:  # the pages below have outlived it already: their priorities are final
                self._outlive(top, max([top.priority, *(d.priority for d in below)]))
                order.append(top)
        return order

    def keep_above_chain(self, pages: list[Page]) -> None:
        """Keep pages here that blocks below need (``holds_chain_below``) without renewing those
        blocks: deepest block first, each ``_outlive``s at the highest priority of itself and the
        pages right below it, so each outlives what needs it, while the pages below keep their
        places in the eviction order (blocks a promotion left below its spare copies age as they
        would have)."""
        for page in sorted(pages, key=_deepest_first):
            self._outlive(page, max([page.priority, *(d.priority for d in self._dependents(page))]))

    def path_above(self, page: Page, among: set[int]) -> list[Page]:
        """``page``, then the pages here (originals or copies) of its group in the blocks above it,
        parent by parent, while each is here with its id in ``among``."""
        path = [page]
        node = page.node.parent if page.node is not None else None
        while node is not None and node.parent is not None:
            here = self.here(node.pages[page.group])
            if here is None or id(here) not in among:
                break
            path.append(here)
            node = node.parent
        return path

    def _dependents(self, page: Page) -> Iterator[Page]:
        """The pages here (originals or copies) that a restart reaches only through ``page``, a
        chain group's page here: those of the blocks right below its block that a match could reach
        (``_reachable_below``), and, when ``page`` is a copy, its block's pages of the other groups
        (when an original goes, they go with it: ``orphans``)."""
        node = page.node
        if node is None or page.group not in self.chain_groups or page.snapshot_offset:
            return
        blocks = self._reachable_below(node)
        if page in self.originals:
            blocks.append(node)
        for block in blocks:
            for other in (*block.pages, *block.snapshots.values()):
                here = self.here(other)
                if here is not None and here is not page:
                    yield here

    def _reachable_below(self, node: Node) -> list[Node]:
        """The blocks right below ``node`` that have a page of each chain group (in any tier): a
        match or a restart can reach only those, so only those need ``node``'s pages here."""
        groups = self.chain_groups
        return [child for child in node.children.values() if all([child.pages[g] is not None for g in groups])]

    def chain_whole(
        self, node: Node | None, whole: dict[int, bool], on_disk: bool = False, landing: Set[int] = frozenset()
    ) -> bool:
        """Whether ``node`` and every block above it have a page of each full-attention group
        (``chain_groups``), which a match needs (in any tier; ``on_disk``: here, an original or a
        copy, or among the pages whose ids are in ``landing``, about to be written here).
        Memoized in ``whole`` by the nodes' ids (for one ``on_disk`` and ``landing``). A page off
        the tree (None) has none."""
        groups = self.chain_groups
        if not groups:  # (no full-attention group: every block is reached)
            return node is not None
        path: list[Node] = []
        while node is not None and node.parent is not None and id(node) not in whole:
            path.append(node)
            node = node.parent
        ok = node is not None and (node.parent is None or whole[id(node)])
        for block in reversed(path):  # parents first
            if ok:
                pages = block.pages
                for group in groups:
                    page = pages[group]
                    if page is None or (on_disk and id(page) not in landing and self.here(page) is None):
                        ok = False
                        break
            whole[id(block)] = ok
        return ok

    def orphans(self, dropped: list[Page]) -> list[Page]:
        """On the disk tier, for chain-group originals about to be dropped from here: their blocks'
        pages of other groups here (copies, and originals no cache holds), which no match or
        restart could reach without them."""
        if len(self.owners) == 1 or not dropped or dropped[0].group not in self.chain_groups:
            return []  # (one layer group: a block has no other pages)
        originals = self.originals
        out = []
        for page in dropped:
            node = page.node
            if node is None or page in originals:
                continue
            for other in (*node.pages, *node.snapshots.values()):
                here = None if other is None or other.group == page.group else self.here(other)
                if here is not None and (here in originals or not (here.refs or here.locks)):
                    out.append(here)
        return out

    def keep_ancestors(self, arriving: list[Page]) -> None:
        """Before room is made here for ``arriving`` pages (one group): their ancestors here, or
        copied here, ``_outlive`` them, so that the room is not made by dropping the blocks that a
        restart needs above them."""
        self.uncopied_ancestors(arriving, set())

    def _outlive(self, page: Page, priority: int) -> None:
        """``page`` (here, an original or a copy) becomes the most recently used at ``priority``
        if that is higher than its own, and is a spare copy no more: pages below it in its chain
        leave this tier before it. Its index row records a new priority."""
        self.evictable[page.group].discard(page)
        self.spare_copies.discard(page)
        if priority > page.priority:
            page.priority = priority
            self.record(page)
        self.reindex(page)

    def take_copy(self, original: Page) -> tuple[int, int] | None:
        """(slot, checksum) of ``original``'s copy, handed over to it (it is being demoted here); or None."""
        copy = self.copies.pop(original, None)
        if copy is None:
            return None
        del self.originals[copy]
        self.spare_copies.discard(copy)
        self.evictable[copy.group].discard(copy)
        self.owners[copy.group][copy.slot] = None  # the slot stays allocated: ``original`` lands in it
        copy.node = None
        return copy.slot, copy.checksum

    def remove_copy(self, copy: Page) -> None:
        """Free a copy and its index row (its original left the tree, or the slot is wanted)."""
        del self.copies[self.originals.pop(copy)]
        self.spare_copies.discard(copy)
        self.vacate(copy)
        copy.node = None

    def uncopied_ancestors(self, victims: list[Page], moving: set[int]) -> list[Page]:
        """For the disk tier: ancestor pages of the victims (their group) with nothing here, parents
        first in each chain; pages whose ids are in ``moving`` are left out.

        Ancestors already here, or copied here, become the most recently used (a spare copy is
        spare no more) and take the priority of the blocks below them if higher (``_outlive``): a
        chain's upper blocks outlive its lower ones on disk. The walk covers the whole chain
        (each block once per call).
        """
        group = victims[0].group
        seen: set[int] = set()
        out: list[Page] = []
        # Deepest victims first: each walk refreshes a chain from the bottom up, so that a chain's
        # blocks end as the most recently used root last, whatever the victims' order.
        for victim in sorted(victims, key=_deepest_first):
            chain = []
            node = victim.node.parent if victim.node is not None else None
            while node is not None and node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                page = node.pages[group]
                if page is not None and id(page) not in moving:
                    present = self.here(page)
                    if present is None:
                        chain.append(page)
                    else:
                        self._outlive(present, victim.priority)  # a chain below needs it now
                node = node.parent
            out.extend(reversed(chain))
        return out

    # -- eviction --------------------------------------------------------------------------------

    def may_evict(self, page: Page) -> bool:
        """Unlocked pages may leave; from the last tier only pages no cache holds (they are dropped)."""
        return page.locks == 0 and (page.refs == 0 or not self.is_last)

    def index_arrivals(self, pages: list[Page]) -> None:
        """Index the pages of a list that just arrived in this tier (none has an entry here yet) and
        may leave it, in order; pages freed meanwhile (no holder, no node) are skipped."""
        is_last = self.is_last
        keep = [p for p in pages if not p.locks and (p.node is not None if not p.refs else not is_last)]
        if self.watch is not None:  # the watch keeps the order of every group's pages: one by one
            for page in keep:
                self.reindex(page)
            return
        evictable = self.evictable
        if len(evictable) == 1:
            evictable[0].add_new(keep)
            return
        for g, index in enumerate(evictable):
            index.add_new([p for p in keep if p.group == g])

    def reindex_all(self, pages: list[Page]) -> None:
        """``reindex`` for distinct pages of a list, in order: in bulk unless one of them is a spare
        copy (each index and the watch end as page by page would leave them)."""
        spare = self.spare_copies
        if spare and any([page in spare for page in pages]):
            for page in pages:
                self.reindex(page)
            return
        is_last = self.is_last
        leave = [page for page in pages if page.locks == 0 and (page.refs == 0 or not is_last)]
        stay = [page for page in pages if page.locks or (page.refs and is_last)] if len(leave) < len(pages) else []
        one = len(self.evictable) == 1
        for g, index in enumerate(self.evictable):
            mine = leave if one else [page for page in leave if page.group == g]
            index.discard_all(mine)  # re-added below as the most recently used, in order
            index.add_new(mine)
            index.discard_all(stay if one else [page for page in stay if page.group == g])
        watch = self.watch
        if watch is not None:
            limit = self.watch_limit
            for page in leave:
                if page.node is not None:
                    watch[page] = None
                    if len(watch) > limit:
                        watch.popitem(last=False)

    def reindex(self, page: Page) -> None:
        """Put ``page`` in or out of the eviction index; re-adding makes it the most recently used."""
        if self.may_evict(page):
            self.evictable[page.group].add(page, redundant=page in self.spare_copies)
            watch = self.watch
            if watch is not None and page.node is not None:
                watch[page] = None
                if len(watch) > self.watch_limit:
                    watch.popitem(last=False)
        else:
            self.evictable[page.group].discard(page)


def _deepest_first(page: Page) -> int:
    """Sort key: pages of deeper blocks first (a page off the tree counts as a root block's)."""
    return -page.node.block if page.node is not None else 0
