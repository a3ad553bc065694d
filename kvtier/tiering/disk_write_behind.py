"""Copies of the coldest host pages written to the disk tier on a background thread.

Demoting a host page to disk writes it while the demotion is planned, on the caller's thread: a
resume that has to push pages out of a full host tier waits for the disk. With write-behind on,
``start`` (called between steps, ``PagePool.maintain``) picks, while a layer group's host slots
are nearly all used (fewer free than a batch), the pages in the cold end of that group's
eviction order (``CLEAN_SHARE`` of its host slots, at least ``SCAN_BATCHES`` batches, at most
``MAX_SCAN`` pages: about what a large resume pushes out) that are published, intact and not on
disk yet, a batch of them (``BATCH_BYTES``, at most ``BATCH_PAGES``) after their ancestors in
host memory not on disk yet (parents first: a chain lands whole), none that a restart could not
reach once written (a block above only in the primary tier, or its block's full-attention page
not on disk: a crash would leave it there unreachable), and a disk slot for each: a free one, a
spare copy's, or one freed by dropping the disk's least recently used droppable pages (what
demoting these pages would drop anyway). The removal of the dropped pages' rows is committed (on
the index's committing thread) before any byte is written into their slots. A worker thread
waits for that commit and for the device copies issued so far (the bytes of a page just demoted
may still be landing in its host slot), writes the pages and checksums them. ``poll`` lands a
finished batch on the pool's thread: a page still the owner of its host slot, a slot never freed
since the batch started (``SlotAllocator.times_freed``), still published and without another
disk copy, gets a disk copy (``Tier.add_copy``, its row recorded, so a restart finds it); every
other page's disk slot is freed. Demoting a page with a disk copy later takes the copy's slot
and writes nothing (``DiskWritePlanner.demote``).

Nothing is pinned: a page may be promoted, demoted or dropped while its bytes are written. Its
host slot keeps the same bytes for as long as it is allocated to it (published pages never
change; only a freed slot is written again), which the free count tells.

Invariant: a disk slot of an unlanded batch is allocated and owned by no page (``Tier.reserved``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

from kvtier.pages import Page
from kvtier.stats import Counters
from kvtier.tiering.residency import Residency
from kvtier.tiering.tier import Tier

BATCH_BYTES = 64 << 20  # bytes of one batch: tens of milliseconds of a disk
BATCH_PAGES = 128  # and at most this many pages: landing one costs the pool's thread 10-20 us (its index rows)
CLEAN_SHARE = 0.25  # the coldest share of a group's host slots kept on disk too; then writing waits
SCAN_BATCHES = 4  # but at least these many batches' worth
MAX_SCAN = 4096  # and at most these many pages (a victim search's cost on the pool's thread)


@dataclass
class WriteBatch:
    """Pages of one layer group being written: their host slots, the slots' free counts when the
    batch started, and their disk slots; ``checksums`` are filled by the worker (None: not written)."""

    group: int
    pages: list[Page]
    host_slots: list[int]
    times_freed: list[int]
    disk_slots: list[int]
    committed: Future | None = None  # the commit that removes the rows naming the disk slots before
    checksums: list[int | None] = field(default_factory=list)
    future: Future | None = None

    def done(self) -> bool:
        return self.future is None or self.future.done()


class DiskWriteBehind:
    """Starts, runs and lands background writes of host pages to the disk tier, one batch at a time.

    ``device_waiter()`` gives a function that blocks until every device copy issued before the
    call has finished (``Mover.waiter``): taken when a batch starts, run on the worker thread.
    """

    def __init__(
        self,
        host: Tier,
        disk: Tier,
        residency: Residency,
        counters: Counters,
        device_waiter: Callable[[], Callable[[], None]],
    ) -> None:
        self.host = host
        self.disk = disk
        self.residency = residency
        self.counters = counters
        self.device_waiter = device_waiter
        self.active: WriteBatch | None = None
        self._group = 0  # groups take turns, one batch each
        self._idle_at: tuple[int, ...] | None = None  # pages moved and made evictable when nothing was found
        self._worker: ThreadPoolExecutor | None = None

    def start(self) -> WriteBatch | None:
        """Start a batch unless one is running (land it first with ``poll``); None when there is
        nothing to write or no room on disk."""
        if self.active is not None or not self.disk.writable:
            return None
        c = self.counters
        moves = (c.demotions, c.promotions, c.drops, *(index.additions for index in self.host.evictable))
        if moves == self._idle_at:
            return None  # no page moved or became evictable since nothing was found to write
        if not self.disk.still_writable():  # (a look at the directory: only when there may be work)
            return None
        groups = len(self.host.storage.slots)
        for turn in range(groups):
            group = (self._group + turn) % groups
            batch = self._plan(group)
            if batch is not None:
                self._group = (group + 1) % groups
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-write-behind")
                batch.future = self._worker.submit(self._write, batch, self.device_waiter())
                self.active = batch
                return batch
        self._idle_at = moves
        return None

    def _plan(self, group: int) -> WriteBatch | None:
        """The batch of ``group``, its disk slots reserved; None when the group has nothing to write."""
        host, disk = self.host, self.disk
        want = max(1, min(BATCH_PAGES, BATCH_BYTES // host.storage.page_bytes[group]))
        slots = host.storage.slots[group]
        if slots.num_free >= want:
            return None  # room enough for the next demotions: nothing to hurry
        window = min(MAX_SCAN, max(SCAN_BATCHES * want, int(CLEAN_SHARE * slots.num_slots)))
        candidates = (
            page
            for page in islice(host.evictable[group], window)
            if not page.locks
            and page.node is not None
            and not page.damaged
            and page not in host.originals
            and page not in disk.copies
        )
        pages: list[Page] = []
        landing: set[int] = set()  # ids of ``pages``
        whole: dict[int, bool] = {}  # (a block reached stays reached as more pages are chosen)
        while len(pages) < want:  # a part of the window at a time, each after its ancestors in host memory
            part = list(islice(candidates, want - len(pages)))
            if not part:
                break
            part = [page for page in part if id(page) not in landing]  # (not an ancestor chosen already)
            if not part:
                continue
            part = self._with_ancestors(part, pages)
            landing.update(map(id, part))
            kept = self._restorable(part, landing, whole)
            landing.difference_update(id(page) for page in part if page not in kept)
            pages += kept
        if len(pages) > want:  # cut: a page may have needed one cut off
            pages = self._restorable(pages[:want])
        if not pages:
            return None
        disk_slots = self._disk_slots(group, len(pages))
        if len(disk_slots) < len(pages):  # cut short: only what a restart reaches without the rest
            pages = self._restorable(pages[: len(disk_slots)])
            disk.storage.slots[group].free_all(disk_slots[len(pages) :])
            disk_slots = disk_slots[: len(pages)]
        if not disk_slots:
            return None
        disk.reserved[group].update(disk_slots)
        host_slots = [page.slot for page in pages]
        times_freed = [slots.times_freed(slot) for slot in host_slots]
        return WriteBatch(group, pages, host_slots, times_freed, disk_slots, disk.disk_index.commit_soon())

    def _with_ancestors(self, pages: list[Page], chosen: list[Page]) -> list[Page]:
        """``pages`` after their ancestors in host memory that have nothing on disk yet and are not
        ``chosen`` already, parents first (``Tier.uncopied_ancestors``, which also keeps the
        ancestors already on disk the most recently used there): a chain lands whole. The hot
        prefix above cold pages stays in memory, locked, and would otherwise never be written."""
        moving = {id(page) for page in (*chosen, *pages)}
        ancestors = self.disk.uncopied_ancestors(pages, moving)
        return [page for page in ancestors if page.tier == self.host.index and not page.damaged] + pages

    def _restorable(
        self, pages: list[Page], landing: set[int] | None = None, whole: dict[int, bool] | None = None
    ) -> list[Page]:
        """Of pages to be written together, those a restart could reach once they landed: their
        block and every block above have a page of each full-attention group on disk or among the
        pages whose ids are in ``landing`` (default: ``pages``; ``Tier.chain_whole``, memoized in
        ``whole``). Not the others: below a block held in the primary tier only (the blocking
        demotion copies it to disk with its first child), or of another group in a block whose
        full-attention page is not on disk yet (that group's turn comes)."""
        if landing is None:
            landing = {id(page) for page in pages}
        whole = {} if whole is None else whole
        return [page for page in pages if self.disk.chain_whole(page.node, whole, on_disk=True, landing=landing)]

    def _disk_slots(self, group: int, count: int) -> list[int]:
        """Up to ``count`` disk slots for copies: free ones, spare copies', then ones of dropped
        droppable pages (their old rows' removal is committed before the worker writes: ``_plan``)."""
        disk = self.disk
        if disk.storage.slots[group].num_free < count:
            self.residency.drop_for_room(disk.index, group, count)  # all or none: a spare copy goes first
        found = []
        while len(found) < count:
            slot = disk.slot_for_copy(group)
            if slot is None:
                break
            found.append(slot)
        return found

    def _write(self, batch: WriteBatch, wait_for_device: Callable[[], None]) -> None:
        """On the worker thread: wait for the removal of the disk slots' old rows to be committed
        (a failed commit fails the batch: nothing is written) and for the device, then write and
        checksum the batch's pages."""
        if batch.committed is not None:
            batch.committed.result()
        wait_for_device()
        page_bytes = self.host.storage.page_bytes[batch.group]
        host = self.host.storage.buffers[batch.group].numpy()
        views = [host[slot * page_bytes : (slot + 1) * page_bytes] for slot in batch.host_slots]
        batch.checksums = self.disk.storage.write(batch.group, batch.disk_slots, views)

    def poll(self, wait: bool = False) -> int:
        """Land the running batch if it has finished (waiting for it if ``wait``); returns the
        pages that got a disk copy."""
        batch = self.active
        if batch is None:
            return 0
        if wait and batch.future is not None:
            batch.future.exception()  # waits; a failed worker lands as nothing written
        if not batch.done():
            return 0
        self.active = None
        return self._land(batch)

    def _land(self, batch: WriteBatch) -> int:
        """On the pool's thread: a disk copy for each page written whose host bytes stayed put."""
        host, disk, group = self.host, self.disk, batch.group
        failed = batch.future is not None and batch.future.exception() is not None
        checksums = [None] * len(batch.pages) if failed or not batch.checksums else batch.checksums
        allocator = host.storage.slots[group]
        owners = host.owners[group]
        page_bytes = disk.storage.page_bytes[group]
        landed = 0
        for page, host_slot, times_freed, disk_slot, checksum in zip(
            batch.pages, batch.host_slots, batch.times_freed, batch.disk_slots, checksums, strict=True
        ):
            disk.reserved[group].discard(disk_slot)
            if (
                checksum is not None
                and owners[host_slot] is page
                and allocator.times_freed(host_slot) == times_freed
                and page.node is not None
                and not page.damaged
                and page not in disk.copies
            ):
                disk.add_copy(page, disk_slot, checksum)
                landed += 1
            else:
                disk.storage.slots[group].free(disk_slot)
        if landed:
            self.counters.add_copy(host.name, disk.name, "file", landed * page_bytes)
        disk.disk_index.commit_soon()
        return landed

    def close(self) -> None:
        """Wait for the running batch, land it, stop the worker."""
        self.poll(wait=True)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
