"""Writing pages to the disk tier: demotions, copies of their ancestors, and the close-time persist.

Writes happen while an operation plans (synchronously, batched), before any copy of the plan
reuses the slots they free, so a failed write leaves its page where it was (or drops it if only
the tree held it). Before a disk slot is rewritten, the index commits the removal of the row that
named it; if it cannot, nothing is written (a row never names a slot holding other bytes).

A block written to disk brings along copies of its ancestors (same layer group) that are not on
disk yet (``Tier.add_copy``): a hot prefix that is never demoted is on disk with its first child,
so a process killed at any point leaves chains that restore whole. Ancestors on disk or copied
are refreshed in the disk's LRU order, at the priority of the blocks below if higher, before room
is made for a descendant and with every descendant written, so a chain's upper blocks outlive its
lower ones there; the disk drops a chain from its deepest block up (``Residency.drop_some``).

A page that no match can reach is not written (a match needs a full-attention page in its block
and in every block above): a victim only the tree holds whose block, or a block above, has no
full-attention page is dropped instead, before the disk makes room (``to_write``). The
close-time persist goes further, as nothing left in memory outlives it: it writes a block's
pages of other groups (disk slots are counted per group) only once the block's full-attention
pages, and its parent's chain, are on disk (``persist``). A restart would drop such pages
again, with a WARNING.

The bytes are written by a ``DiskWriter`` handed over at construction (the mover, which knows
where the bytes of a page are and when they have landed).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Protocol

from kvtier.pages import Node, Page
from kvtier.tiering.plan import MovePlan
from kvtier.tiering.residency import Residency
from kvtier.tiering.tier import Tier

log = logging.getLogger(__name__)

PERSIST_CHUNK_BYTES = 64 << 20  # the close-time persist commits the index after each part of this size


class DiskWriter(Protocol):
    """Writes the bytes of pages to disk slots now."""

    def write_pages(self, pages: list[Page], disk_slots: list[int]) -> list[int | None]:
        """Write pages (all of one tier and one layer group) to these disk slots, in order.

        Returns a checksum per page, None where the write failed (that slot holds nothing valid).
        """
        ...


class DiskWritePlanner:
    """Decides what is written to the disk tier and lands it there; ``writer`` writes the bytes.

    Not ``blocking``: a demoted page without a disk copy that only the tree holds is dropped, not
    written, and no ancestor copies are written (``DiskTier.blocking_writes``).
    """

    def __init__(self, residency: Residency, disk: Tier, writer: DiskWriter, blocking: bool = True) -> None:
        self.residency = residency
        self.disk = disk
        self.writer = writer
        self.blocking = blocking

    def to_write(self, victims: list[Page]) -> list[Page]:
        """Of victims bound for the disk (one tier, one group, none with a copy there), those
        ``demote`` will write; the others, held by the tree alone, are dropped now, before the disk
        makes room for any: when not ``blocking`` (the caller does not wait for the disk), and
        those no match can reach (their block, or one above, has no full-attention page)."""
        if not self.blocking:
            dropped = [page for page in victims if not page.refs]
        else:
            whole: dict[int, bool] = {}
            dropped = [page for page in victims if not page.refs and not self.disk.chain_whole(page.node, whole)]
        if not dropped:
            return victims
        self._not_written(dropped)
        gone = {id(page) for page in dropped}
        return [page for page in victims if id(page) not in gone]

    def demote(self, victims: list[Page], plan: MovePlan) -> None:
        """Write victims (one tier, one group, as ``to_write`` left them) to disk, then copies of
        their ancestors not there yet. A victim whose copy is on disk already takes the copy's slot
        without a write."""
        self._write_down(victims, plan, blocking=self.blocking)

    def keep_ancestors(self, victims: list[Page]) -> None:
        """Before the disk makes room for ``victims`` (one group, as ``to_write`` left them): their
        ancestors there outlive them (``Tier.keep_ancestors``)."""
        self.disk.keep_ancestors(victims)

    def _write_down(self, victims: list[Page], plan: MovePlan, blocking: bool) -> None:
        """``demote``, writing (``blocking``) or dropping the victims without a disk copy."""
        disk = self.disk
        if not disk.still_writable() or not disk.disk_index.flush():  # freed slots' rows go before a rewrite
            self._not_written(victims)
            return
        allocator = disk.storage.slots[victims[0].group]
        pending: list[Page] = []
        slots: list[int] = []
        for page in self.land_on_copies(victims):
            if not blocking and page.refs == 0:
                self._not_written([page])  # dropped: the caller does not wait for the disk
                continue
            slot = allocator.allocate()
            if slot is None:
                self._not_written([page])
                continue
            pending.append(page)
            slots.append(slot)
        if pending:
            checksums = self._write(pending, slots)
            for page, slot, checksum in zip(pending, slots, checksums, strict=True):
                if checksum is None:
                    allocator.free(slot)
                    self._not_written([page])
                else:
                    self._land(page, slot, checksum)
        if blocking:
            self._copy_ancestors(victims, plan)
            self._copy_chain_pages(victims, plan)

    def _write(self, pages: list[Page], slots: list[int]) -> list[int | None]:
        """``DiskWriter.write_pages`` into slots allocated for them. An error on the way (a failing
        device copy into the staging buffer) fails every write (None each, logged); an interrupt
        frees the slots again and goes on."""
        try:
            return self.writer.write_pages(pages, slots)
        except Exception:
            log.exception("kvtier disk tier: writing %d pages failed; they are not written", len(pages))
            return [None] * len(pages)
        except BaseException:
            self.disk.storage.slots[pages[0].group].free_all(slots)
            raise

    def land_on_copies(self, victims: list[Page]) -> list[Page]:
        """Demote the victims (one tier, one group) whose copy is on disk into the copy's slot, with no
        write (all that a read-only disk takes); returns the others, in order."""
        rest = []
        for page in victims:
            copied = self.disk.take_copy(page)
            if copied is None:
                rest.append(page)
            else:
                self._land(page, *copied)
        return rest

    def _land(self, page: Page, slot: int, checksum: int) -> None:
        """``page`` now lives in a disk slot holding its bytes: index it there."""
        disk = self.disk
        self.residency.counters.evictions += 1
        self.residency.counters.demotions += 1
        self.residency.tiers[page.tier].vacate(page)
        page.tier, page.slot, page.checksum = disk.index, slot, checksum
        disk.owners[page.group][slot] = page
        disk.record(page)
        disk.reindex(page)

    def _not_written(self, pages: list[Page]) -> None:
        """Pages that could not go to disk stay where they are; those only the tree held are dropped."""
        for page in pages:
            if page.refs == 0 and page.node is not None:
                self.residency.counters.evictions += 1
                self.residency.drop(page)

    def _copy_ancestors(self, victims: list[Page], plan: MovePlan, with_pages: bool = False) -> None:
        """Write copies of the victims' ancestors (same group) that have no page or copy on disk
        (``with_pages``: and of the victims themselves, pages in memory, after their ancestors).

        Their bytes are final (published blocks never change); pages this plan is still moving
        are skipped (their bytes have not landed). Best effort: an ancestor that finds no room is
        left out, and the index still restores its descendants' chain (without its page).
        """
        disk = self.disk
        group = victims[0].group
        moving = {id(p) for batch in plan.landed for p in batch}

        if with_pages:  # (parents first; a victim above another is written once, as itself)
            victims = sorted(victims, key=lambda page: page.node.block)
            moving |= {id(page) for page in victims}

        def uncopied() -> list[Page]:
            return disk.uncopied_ancestors(victims, moving) + (victims if with_pages else [])

        wanted = uncopied()
        if not wanted or not self.residency.drop_for_room(disk.index, group, len(wanted)):
            wanted = uncopied()[: disk.storage.slots[group].num_free]
        if wanted and not disk.disk_index.flush():  # the drops' rows go before their slots are rewritten
            return
        by_tier: dict[int, list[Page]] = defaultdict(list)
        for page in wanted:
            by_tier[page.tier].append(page)
        allocator = disk.storage.slots[group]
        priority = max(p.priority for p in victims)
        for pages in by_tier.values():
            slots = [allocator.allocate() for _ in pages]
            for page, slot, checksum in zip(pages, slots, self._write(pages, slots), strict=True):
                if checksum is None:
                    allocator.free(slot)
                else:
                    disk.add_copy(page, slot, checksum, max(priority, page.priority))

    def _copy_chain_pages(self, victims: list[Page], plan: MovePlan) -> None:
        """For victims of a group no restart walks by (sliding-window pages, recurrent snapshots):
        copies of their blocks' full-attention pages (``Tier.chain_groups``) that are in memory
        only, and of those pages' ancestors, as ``_copy_ancestors`` copies a victim's own: a
        restart reaches a block only through them, so a process killed later keeps the victims."""
        disk = self.disk
        if victims[0].group in disk.chain_groups:
            return
        moving = {id(p) for batch in plan.landed for p in batch}
        for group in disk.chain_groups:
            anchors = {}
            for victim in victims:
                page = victim.node.pages[group] if victim.node is not None else None
                if page is not None and not page.damaged and id(page) not in moving and disk.here(page) is None:
                    anchors[id(page)] = page
            if anchors:
                self._copy_ancestors(list(anchors.values()), plan, with_pages=True)

    def persist(self, plan: MovePlan) -> int:
        """Write published pages held in memory tiers to free disk slots, parents first.

        Used when the manager closes, so that a manager started later on the same path finds
        the hot prefixes too, with unbroken chains. Only blocks a restart could reach are written:
        a block's pages go only if its full-attention pages (``Tier.chain_groups``) are on disk or
        find a slot now, each of them, and so did its parent's. Those pages are written first;
        then the other groups' pages (sliding-window pages, recurrent snapshots) of the blocks
        whose chain landed (a failed write leaves its block, and the blocks below, out): a page
        that no match could reach after a restart would only take a slot there (the restore would
        drop it with a WARNING). Returns the number of pages written.
        """
        disk = self.disk
        if not disk.still_writable():
            return 0
        chain = disk.chain_groups
        free = [s.num_free for s in disk.storage.slots]
        batches: dict[tuple[int, int], list[Page]] = defaultdict(list)
        unreached: set[int] = set()  # ids of blocks whose chain will not be whole on disk
        for node in sorted(self.residency.tree.nodes(), key=lambda n: n.block):
            if id(node.parent) in unreached or not self._take_chain(node, free, batches):
                unreached.add(id(node))
                continue
            for page in [*node.pages, *node.snapshots.values()]:
                if page is None or page.group in chain or page.tier == disk.index or page.locks:
                    continue
                if page not in disk.copies:
                    if not free[page.group]:
                        continue
                    free[page.group] -= 1
                batches[(page.tier, page.group)].append(page)
        written = 0
        for (_, group), pages in sorted(batches.items(), key=lambda item: item[0][1] not in chain):  # chains first
            if group not in chain:  # the blocks whose chain landed (a write may have failed)
                landed: dict[int, bool] = {}
                pages = [page for page in pages if self.disk.chain_whole(page.node, landed, on_disk=True)]
            step = max(1, PERSIST_CHUNK_BYTES // disk.storage.page_bytes[group])
            for start in range(0, len(pages), step):  # each part's rows commit as the next one starts
                self._write_down(pages[start : start + step], plan, blocking=True)  # closing: every page
            written += len(pages)
        return written

    def _take_chain(self, node: Node, free: list[int], batches: dict[tuple[int, int], list[Page]]) -> bool:
        """For ``persist``: add ``node``'s full-attention pages not on disk to ``batches``, a free slot
        counted off ``free`` for each without a disk copy, if every one of them can go; returns
        whether they are all on disk then (False, with nothing taken, otherwise)."""
        disk = self.disk
        wanted: list[Page] = []
        need = [0] * len(free)
        for group in disk.chain_groups:
            page = node.pages[group]
            if page is None:
                return False  # no restart reaches the block
            if page.tier == disk.index:
                continue
            if page.locks:
                return False  # a pinned page is not written: the block stays off disk
            wanted.append(page)
            need[group] += page not in disk.copies
        if any(n > room for n, room in zip(need, free, strict=True)):
            return False
        for group, n in enumerate(need):
            free[group] -= n
        for page in wanted:
            batches[(page.tier, page.group)].append(page)
        return True
