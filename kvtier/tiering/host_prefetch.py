"""Reading disk pages into host memory on a background thread, for requests that wait in a queue.

Host memory is the host tier, or the primary tier of a manager on the CPU without one (the vLLM
connector's scheduler half keeps its pages there); ``host`` below names whichever it is.

``start`` pins the pages (so nothing drops or moves their disk slots away while they are read)
and reserves a host slot for each: a free one, or the slot of a spare copy (the pool makes room
first, as for a promotion); pages that find none are not read. A worker thread reads and checks the
pages part by part, and stops between parts once cancelled. The reads change nothing the pool
knows of: the pages stay on disk in its records until ``poll`` lands a finished prefetch on the
calling thread, moving each page read intact into its host slot (its disk slot keeps a copy).

A page that meanwhile left its disk slot (a resume promoted it straight to the primary tier),
was found damaged elsewhere, or was not read (cancelled), is not moved: its host slot is freed.
A page whose bytes fail their checksum is marked damaged, as any disk read would.

A prefetch started with ``hold`` (for a request that waits its turn) keeps the pages it landed
locked in host memory, neither demoted nor dropped, until it is cancelled or a promotion moves
them out of host memory (another request's resume: ``release_moved``): otherwise the
requests admitted before it could push them back to disk, and its read was for nothing. The
release happens at the pool's next call after the cancel that lands reads or makes room
(``PagePool.release_let_go``).

The reads are timed: their bytes over their seconds tell the pool's load cost how fast the disk
reads (``LoadCost.observe``; the copy up from host memory, if any, is not counted).

Invariants: a reserved host slot is allocated and owned by no page until its prefetch lands
(``Tier.reserved``); each page of an unlanded prefetch holds one pin (``pins``), and so does
each page a held prefetch landed, until it is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvtier.pages import Page
from kvtier.stats import Counters
from kvtier.tiering.load_cost import LoadCost
from kvtier.tiering.residency import Residency
from kvtier.tiering.tier import Tier

log = logging.getLogger(__name__)

PART_BYTES = 64 << 20  # a cancelled prefetch stops after the part it is reading


class HostPrefetch:
    """One background read of disk pages into host memory; ``cancel`` stops it between parts."""

    def __init__(self, pages: list[Page], disk_slots: list[int], host_slots: list[int], hold: bool = False) -> None:
        self.pages = pages
        self.disk_slots = disk_slots
        self.host_slots = host_slots
        self.checksums = [p.checksum for p in pages]
        self.intact: list[bool | None] = [None] * len(pages)  # None: not read
        self.read_bytes = 0  # what the worker read, and the seconds its reads took
        self.read_seconds = 0.0
        self.started = time.monotonic()
        self.hold = hold
        self.held: list[Page] = []  # pages landed and still pinned in host memory (``hold``)
        self.future: Future | None = None
        self._cancelled = threading.Event()

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def done(self) -> bool:
        """Whether the reads are over (finished or stopped); the pool lands it on its next call."""
        return self.future is None or self.future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the reads; returns ``done()`` (reads that failed are
        done too: the pool lands nothing of them).

        None, or more than ``threading.TIMEOUT_MAX`` (centuries), waits without limit; 0 or less
        not at all. ``TypeError`` for a non-number, ``ValueError`` for nan."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
            if timeout != timeout:  # nan, the one number unequal to itself
                raise ValueError("timeout must be a number of seconds or None, got nan")
            if timeout > threading.TIMEOUT_MAX:
                timeout = None
        if self.future is not None:
            wait([self.future], timeout)
        return self.done()

    def cancel(self) -> None:
        """Stop after the part being read (pages not read stay on disk only), and let go of the
        pages a held prefetch landed (at the pool's next call)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class HostPrefetcher:
    """Starts, runs and lands prefetches from the disk tier into the host tier."""

    def __init__(self, disk: Tier, host: Tier, residency: Residency, counters: Counters, load_cost: LoadCost) -> None:
        self.disk = disk
        self.host = host
        self.residency = residency
        self.counters = counters
        self.load_cost = load_cost  # told the disk's read speed, as a load from disk would tell it
        self.active: list[HostPrefetch] = []
        self.holding: list[HostPrefetch] = []  # landed with pages still held (``hold``)
        self.pins: Counter[int] = Counter()  # id(page) -> pins held by unlanded prefetches and held ones
        self._worker: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        """Whether a prefetch waits to be landed or released (``poll`` has work)."""
        return bool(self.active or self.holding)

    def start(self, pages: list[Page], hold: bool = False) -> HostPrefetch | None:
        """Prefetch the pages of ``pages`` that are on disk (and not already being read), as far
        as host memory has room; None when there is nothing to read. ``hold``: keep the pages
        landed in host memory until the prefetch is cancelled."""
        disk, host = self.disk, self.host
        chosen, disk_slots, host_slots = [], [], []
        for page in pages:
            if page.tier != disk.index or page.damaged or self.pins[id(page)]:
                continue
            slot = host.slot_for_copy(page.group)
            if slot is None:
                continue
            self.residency.lock(page)
            self.pins[id(page)] += 1
            host.reserved[page.group].add(slot)
            chosen.append(page)
            disk_slots.append(page.slot)
            host_slots.append(slot)
        if not chosen:
            return None
        job = HostPrefetch(chosen, disk_slots, host_slots, hold)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-prefetch")
        job.future = self._worker.submit(self._read, job)
        self.active.append(job)
        return job

    def _read(self, job: HostPrefetch) -> None:
        """On the worker thread: read the pages group by group, part by part, until cancelled."""
        disk, host = self.disk, self.host
        by_group: dict[int, list[int]] = {}
        for i, page in enumerate(job.pages):
            by_group.setdefault(page.group, []).append(i)
        for group, indexes in by_group.items():
            page_bytes = disk.storage.page_bytes[group]
            buffer = host.storage.buffers[group].numpy()
            step = max(1, PART_BYTES // page_bytes)
            for start in range(0, len(indexes), step):
                if job.cancelled:
                    return
                part = indexes[start : start + step]
                views = [buffer[job.host_slots[i] * page_bytes : (job.host_slots[i] + 1) * page_bytes] for i in part]
                began = time.perf_counter()
                intact = disk.storage.read(
                    group, [job.disk_slots[i] for i in part], views, [job.checksums[i] for i in part]
                )
                job.read_seconds += time.perf_counter() - began
                job.read_bytes += len(part) * page_bytes
                for i, ok in zip(part, intact, strict=True):
                    job.intact[i] = ok

    def poll(self, wait: bool = False) -> int:
        """Land the prefetches whose reads are over (all of them, waiting, if ``wait``) and let go
        of the pages of held ones cancelled since; returns the pages moved to host memory."""
        moved = 0
        for job in list(self.active):
            if wait:
                job.wait()
            if job.done():
                self.active.remove(job)
                moved += self._land(job)
                if job.held:
                    self.holding.append(job)
        self.release_cancelled()
        return moved

    def release_moved(self) -> None:
        """Let go of held pages no longer in host memory (a resume promoted them: the hold was to
        keep them from going down, and pinned higher up they would take room from others)."""
        host = self.host.index
        for job in list(self.holding):
            moved = [page for page in job.held if page.tier != host]
            if moved:
                job.held = [page for page in job.held if page.tier == host]
                self._let_go(moved)
                if not job.held:
                    self.holding.remove(job)

    def release_cancelled(self) -> None:
        """Let go of the pages of held prefetches cancelled since the last call."""
        for job in [job for job in self.holding if job.cancelled]:
            self.holding.remove(job)
            self._let_go(job.held)
            job.held = []

    def close(self) -> None:
        """Cancel every prefetch, wait for the reads, land what was read, let go of every page
        held, stop the worker."""
        for job in self.active + self.holding:
            job.cancel()
        self.poll(wait=True)
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _land(self, job: HostPrefetch) -> int:
        """On the pool's thread: move each page read intact into its host slot; free the rest."""
        disk, host, residency = self.disk, self.host, self.residency
        failure = job.future.exception() if job.future is not None else None
        if failure is not None:
            log.error("kvtier: a prefetch from disk to host memory failed; its pages stay on disk", exc_info=failure)
            job.intact = [None] * len(job.pages)  # a failed worker: nothing it read is trusted
        elif job.read_bytes:
            self.load_cost.observe(disk.index, job.read_bytes, job.read_seconds)
        moved = 0
        keep = job.hold and not job.cancelled
        for page, disk_slot, host_slot, intact in zip(
            job.pages, job.disk_slots, job.host_slots, job.intact, strict=True
        ):
            group = page.group
            host.reserved[group].discard(host_slot)
            in_place = page.tier == disk.index and page.slot == disk_slot and not page.damaged
            if intact and in_place:
                disk.vacate(page, free_slot=False)
                page.tier, page.slot = host.index, host_slot
                host.owners[group][host_slot] = page
                if page.node is not None:
                    disk.add_copy(page, disk_slot, page.checksum, spare=True)
                else:
                    disk.storage.slots[group].free(disk_slot)
                self.counters.promotions += 1
                self.counters.add_copy(disk.name, host.name, "file", host.storage.page_bytes[group])
                moved += 1
                if keep:
                    job.held.append(page)  # its pin and lock stay until the job is cancelled
                    continue
            else:
                host.storage.slots[group].free(host_slot)
                if intact is False and in_place:
                    residency.mark_damaged(page)
            self._let_go([page])
        if disk.disk_index is not None:
            disk.disk_index.commit_soon()
        return moved

    def _let_go(self, pages: list[Page]) -> None:
        """Drop one pin and its lock from each page (wherever it is now)."""
        for page in pages:
            self.pins[id(page)] -= 1
            if not self.pins[id(page)]:
                del self.pins[id(page)]
            self.residency.unlock(page)
