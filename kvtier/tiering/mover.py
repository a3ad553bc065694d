"""Copies a ``MovePlan``'s data: one copier call per (source tier, destination tier, layer group), or
one per part where a duplex move, a swap through the scratch or a disk read cuts it.

Order (see ``kvtier.tiering.planner``): demotions deepest edge first, then copies into warmer tiers.
On CUDA, copies are enqueued on the given stream after a wait for the previous plan's copies
if those ran on another stream; an event recorded after them lets CPU work on host memory
(disk I/O, staging) wait until the device is done with it. Background plans (write-through, the
free reserve) run on a low-priority stream of their own, in the same chain of events.

The caller's streams (CUDA). A cache is written on the stream it was resumed on (``attach``,
until it suspends or closes: ``detach``, which records the work queued there by then). Plans
move only pages no active cache has locked, or copy pages the tree shares:
- every plan's copies start after the work queued on a stream before a cache let go of its pages
  there (they may still be writing those pages, or reading the slots they free);
- plans that read pages active caches may share (a resume's private copies of published
  blocks, write-through, disk writes) also wait for the work queued so far on those caches'
  streams; others (a prefetch, the evictions of a ``resize``) do not, so a prefetch on a side
  stream overlaps the running requests' compute;
- after ``run``, later work on the plan's stream starts after every copy issued so far, even
  when the plan copies nothing (its pages may be ones an earlier plan on another stream is still
  bringing in, or its slots ones such a plan still reads); a resume with nothing to copy also
  waits for the other active caches' streams, which may still be writing the blocks it adopts.

When a plan demotes primary pages to host memory and promotes others into their slots (a full
GPU), both directions of the link run at once: the demotion in parts on a stream of its own,
each part's promotions, on another, starting as soon as it has vacated their slots; in a swap,
a part's victims land in host slots once the promotions that vacate them have been read
(``_duplex``, ``kvtier.tiering.duplex``). Without CUDA the same parts run in turn. A swap whose
victims fit in the swap scratch runs in turn through it instead (``kvtier.tiering.swap_scratch``).

Disk pages travel through host memory: read straight into a CPU destination buffer, or into a
pinned staging buffer and copied from there to the GPU part by part (``DISK_CHUNK_BYTES``), each
part's copy running while the next part is read; pages written to disk from the GPU come down
the same way, each part written while the next is copied. The staging buffer holds two parts,
used in turn: a half is filled again only once the copy of the part before last out of it (or
into it) is done, so it stays at two parts however large the call. Every page read from disk is
checked against its checksum; a mismatch is reported in ``plan.damaged``.

The mover is also the planner's ``DiskWriter`` (``write_pages``): it knows where a page's bytes
are and waits for them to land before writing them to disk.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np
import torch

from kvtier.copy import PageCopier
from kvtier.pages import Page
from kvtier.stats import Counters
from kvtier.storage.pinned import HostBuffer, allocate_host_buffer
from kvtier.tiering.duplex import NO_WAIT, READY, schedule
from kvtier.tiering.load_cost import LoadCost
from kvtier.tiering.plan import MovePlan
from kvtier.tiering.swap_scratch import SWAP_SCRATCH_BYTES, ScratchSwap, SwapScratch, through_scratch
from kvtier.tiering.tier import Tier

log = logging.getLogger(__name__)

TIMED_COPIES = 64  # copies into the primary tier kept for timing until ``measure`` asks (no prefill rate: never)
DISK_CHUNK_BYTES = 64 << 20  # disk I/O of a GPU tier goes through staging in parts of this size, two at a time


class Mover:
    """Copies the data of plans between the tiers of one pool."""

    def __init__(self, tiers: list[Tier], counters: Counters, device: torch.device, load_cost: LoadCost) -> None:
        self.tiers = tiers
        self.counters = counters
        self.device = device
        self.load_cost = load_cost
        # (tier, bytes, start, end) of the latest copies into the primary tier; older ones fall off unmeasured
        self._timed: deque[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=TIMED_COPIES)
        self.copier = PageCopier(device)
        if len(tiers) > 1:  # pages move between tiers: no request waits for the kernel path to be built
            self.copier.warm_up(tiers[0].storage.page_bytes)
        self._last_event: torch.cuda.Event | None = None
        self._last_stream: torch.cuda.Stream | None = None
        self._background: torch.cuda.Stream | None = None
        self._background_event: torch.cuda.Event | None = None
        self._background_pending = False
        self._two_way: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._active: dict[torch.cuda.Stream, int] = {}  # the streams of active caches: how many on each
        self._let_go: dict[torch.cuda.Stream, torch.cuda.Event] = {}  # recorded as a cache let go there, until done
        self._staging: HostBuffer | None = None
        self.scratch = SwapScratch(self.copier.device, _scratch_limit(tiers))  # (cuda:N, not cuda)

    def run(
        self, plan: MovePlan, stream: torch.cuda.Stream | None = None, background: bool = False, shared: bool = False
    ) -> int:
        """Copy the data of ``plan``, demotions deepest edge first, then copies into warmer tiers.

        ``stream``: where later work on the plan's pages goes (default: the current stream).
        ``shared``: the plan reads pages active caches may share (a resume's), so it waits for
        their streams (see the module's invariants). ``background``: on the mover's low-priority
        stream, after the work queued on active caches' streams; the next plan run on any other
        stream waits for it, even a plan without copies (its slots may be ones the background
        copies still read). Returns how many pages failed their checksum on the way (listed in
        ``plan.damaged``). An exception raised on the way (an interrupt, a failing copy) leaves no
        copy running; the caller abandons the plan.
        """
        damaged = 0
        if self._background_pending and not background and not self.background_busy():
            self._background_pending = False  # it has finished: nothing to wait for
        if not plan.edges and not self._background_pending:
            if not background:
                self._join(stream, shared)
        else:
            stream = self._stream(stream, background, shared)
            if plan.edges:
                try:
                    self._run_edges(plan, stream)
                except BaseException:
                    self._drain()
                    raise
            self._record(stream)
            self._background_pending = background and stream is not None
            if self._background_pending:
                self._background_event = self._last_event
            damaged = len(plan.damaged)
        return damaged

    def caller_stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
        """The stream a caller's later work on the pages goes to: ``stream``, else the current one
        (None without CUDA)."""
        if self.device.type != "cuda":
            return None
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def attach(self, stream: torch.cuda.Stream | None) -> None:
        """A cache became active on ``stream`` (it writes its pages there)."""
        if stream is not None:
            self._active[stream] = self._active.get(stream, 0) + 1

    def detach(self, stream: torch.cuda.Stream | None) -> None:
        """A cache active on ``stream`` let go of its pages (suspended or closed): later plans that
        move them wait for the work queued there by now. The stream itself is not touched again
        once no active cache is on it (the caller may destroy it)."""
        if stream is None:
            return
        count = self._active.get(stream, 0) - 1
        if count > 0:
            self._active[stream] = count
        else:
            self._active.pop(stream, None)
        self._let_go[stream] = _recorded(stream)  # (a later event on a stream covers an earlier one)

    def _wait_for_callers(self, stream: torch.cuda.Stream, shared: bool) -> None:
        """``stream`` waits for the work queued before caches let go of their pages (events not yet
        done), and with ``shared``, for the work queued so far on other active caches' streams."""
        if shared:
            for other in self._active:
                if other != stream:
                    stream.wait_stream(other)
        for where, event in list(self._let_go.items()):
            if event.query():
                del self._let_go[where]
            elif where != stream:
                stream.wait_event(event)

    def _join(self, stream: torch.cuda.Stream | None, shared: bool) -> None:
        """Order later work on ``stream`` (default: the current one) as ``_stream`` orders a plan's
        copies, for a plan that copies nothing; nothing to do once every copy issued has finished
        and nothing else is waited for (the common case stays one event query)."""
        if self.device.type != "cuda":
            return
        if self._last_event is not None and self._last_event.query():
            self._last_event = None  # finished: nothing to wait for, now or later
        if self._last_event is not None or self._let_go or (shared and self._active):
            self._stream(stream, shared=shared)

    def _drain(self) -> None:
        """After copies were cut short: wait for those already queued on the device, so that none
        writes a slot after the planner has handed it on (a device in error is left to the caller)."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                log.warning("kvtier: the device failed while copies were cut short", exc_info=True)

    def background_busy(self) -> bool:
        """Whether copies of the last background plan may still be running."""
        event = self._background_event
        if event is not None and event.query():
            self._background_event = event = None
        return event is not None

    def _run_edges(self, plan: MovePlan, stream) -> None:
        """Every edge of ``plan``, in ``edge_order``."""
        edges = plan.edges
        two_way = {t.index for t in self.tiers if t.index != 0 and not t.is_disk}
        demotions, duplex, others = edge_order(edges, two_way)
        for edge in demotions:
            self._edge(edge, edges[edge].pairs(), stream, plan.damaged)
        for down in duplex:
            up = (down[1], 0, down[2])
            self._duplex(down, edges[down].pairs(), edges[up].pairs(), stream)
        for edge in others:
            self._edge(edge, edges[edge].pairs(), stream, plan.damaged)

    def _edge(self, edge: tuple[int, int, int], pairs: np.ndarray, stream, damaged: list[Page]) -> None:
        if self.tiers[edge[0]].is_disk:
            self._read_edge(edge, pairs, stream, damaged)
        else:
            self._copy_edge(edge, pairs, stream)

    def _duplex(self, down: tuple[int, int, int], down_pairs: np.ndarray, up_pairs: np.ndarray, stream) -> None:
        """Demote and promote one group in the parts of ``kvtier.tiering.duplex.schedule``.

        On CUDA both directions run at once, on streams of the mover's own, after the work queued
        on ``stream``, which waits for both at the end (the caller's stream may be the legacy
        default stream, which would order the two directions one after the other): each part's
        promotions start as soon as its demotion has been read out, and a part's demotion that
        lands in slots promoted pages vacate (a swap) starts once those were read. Without CUDA
        the parts run one copy after another, in the same order. A swap whose chained victims fit
        in the swap scratch goes through it instead (``_swap_through_scratch``).
        """
        _, lower, group = down
        up = (lower, 0, group)
        page_bytes = self.tiers[0].storage.page_bytes[group]
        swap = through_scratch(down_pairs, up_pairs)
        if swap is not None and self.scratch.allocated and swap.parked <= self.scratch.pages(page_bytes):
            self._swap_through_scratch(down, swap, stream)
            return
        order = schedule(down_pairs, up_pairs, page_bytes, overlap=stream is not None)
        if stream is None:
            steps = [(up, order.ready)]
            for part in order.parts:
                steps += [(down, part.down), (up, part.up)]
            for edge, pairs in steps:
                if len(pairs):
                    self._copy_edge(edge, pairs, None)
            return
        down_stream, up_stream = self._duplex_streams()
        down_stream.wait_stream(stream)  # the victims' bytes are written by work queued there
        up_stream.wait_stream(stream)
        up_done: dict[int, torch.cuda.Event] = {}
        if len(order.ready):
            self._copy_edge(up, order.ready, up_stream)
        swaps = order.swaps
        if swaps:
            up_done[READY] = _recorded(up_stream)
        for k, part in enumerate(order.parts):
            if part.after_up != NO_WAIT:
                down_stream.wait_event(up_done[part.after_up])
            self._copy_edge(down, part.down, down_stream)
            up_stream.wait_event(_recorded(down_stream))
            if len(part.up):
                self._copy_edge(up, part.up, up_stream)
            if swaps:
                up_done[k] = _recorded(up_stream)
        stream.wait_stream(down_stream)
        stream.wait_stream(up_stream)

    def _swap_through_scratch(self, down: tuple[int, int, int], swap: ScratchSwap, stream) -> None:
        """The copies of ``swap``, in its order, on ``stream`` (``kvtier.tiering.swap_scratch``)."""
        _, lower, group = down
        primary, below = self.tiers[0], self.tiers[lower]
        page_bytes = primary.storage.page_bytes[group]
        scratch = self.scratch.buffer
        self.copier.copy(primary.storage.buffers[group], scratch, swap.park, page_bytes, stream)
        if len(swap.direct):
            self._copy_edge(down, swap.direct, stream)
        self._copy_edge((lower, 0, group), swap.up, stream)
        path = self.copier.copy(scratch, below.storage.buffers[group], swap.unpark, page_bytes, stream)
        self.counters.add_copy(primary.name, below.name, path, swap.parked * page_bytes)

    def _duplex_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._two_way is None:
            self._two_way = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
        return self._two_way

    def synchronize(self) -> None:
        """Wait until every copy issued so far has finished (before the CPU touches host memory)."""
        if self._last_event is not None:
            self._last_event.synchronize()

    def waiter(self) -> Callable[[], None]:
        """A function that waits until every copy issued before this call has finished; another
        thread may call it."""
        event = self._last_event
        return _nothing if event is None else event.synchronize

    def write_pages(self, pages: list[Page], disk_slots: list[int]) -> list[int | None]:
        """Write pages (one tier, one group) to disk slots now; a checksum per page, None if it failed."""
        src = self.tiers[pages[0].tier]
        group = pages[0].group
        disk = next(t for t in self.tiers if t.is_disk)
        page_bytes = src.storage.page_bytes[group]
        buffer = src.storage.buffers[group]
        self.synchronize()  # the bytes may still be landing from an earlier device copy
        if buffer.device.type == "cpu":
            views = _page_views(buffer.numpy(), [p.slot for p in pages], page_bytes)
            checksums = disk.storage.write(group, disk_slots, views)
        else:
            checksums = self._write_staged(pages, disk_slots, src, disk)
        written = sum(page_bytes for c in checksums if c is not None)
        self.counters.add_copy(src.name if buffer.device.type == "cpu" else "host", disk.name, "file", written)
        return checksums

    def _write_staged(self, pages: list[Page], disk_slots: list[int], src: Tier, disk: Tier) -> list[int | None]:
        """``write_pages`` from a GPU tier: each part of ``DISK_CHUNK_BYTES`` is copied down into one
        half of the staging buffer while the part before it, in the other half, is written."""
        group = pages[0].group
        page_bytes = src.storage.page_bytes[group]
        staging, step = self._staging_for(page_bytes, len(pages))
        host = staging.numpy()
        stream = self._stream(None, shared=True)
        parts = [(start, min(start + step, len(pages))) for start in range(0, len(pages), step)]
        slots = np.array([p.slot for p in pages], dtype=np.int64)

        def copy_down(part: int) -> torch.cuda.Event:
            start, end = parts[part]
            base = part % 2 * step
            pairs = np.stack([slots[start:end], np.arange(base, base + end - start)], axis=1)
            path = self.copier.copy(src.storage.buffers[group], staging, pairs, page_bytes, stream)
            self.counters.add_copy(src.name, "host", path, (end - start) * page_bytes)
            return _recorded(stream)

        checksums: list[int | None] = []
        pending = copy_down(0)
        try:
            for part, (start, end) in enumerate(parts):
                landed = pending
                if part + 1 < len(parts):
                    pending = copy_down(part + 1)  # the other half: its part was written already
                landed.synchronize()
                base = part % 2 * step
                views = _page_views(host, range(base, base + end - start), page_bytes)
                checksums += disk.storage.write(group, disk_slots[start:end], views)
        finally:
            pending.synchronize()  # no copy into the staging buffer outlives the call
        return checksums

    def _stream(
        self, stream: torch.cuda.Stream | None, background: bool = False, shared: bool = False
    ) -> torch.cuda.Stream | None:
        """The stream a plan's copies go on, ordered after the previous plan's copies and what
        ``_wait_for_callers`` names (a background plan reads shared pages: write-through)."""
        if self.device.type != "cuda":
            return None
        if background:
            if self._background is None:
                self._background = torch.cuda.Stream(device=self.device, priority=0)  # the lowest priority
            stream = self._background
        else:
            stream = self.caller_stream(stream)
        self._wait_for_callers(stream, shared or background)
        if self._last_event is not None and self._last_stream != stream:
            stream.wait_event(self._last_event)
        return stream

    def _record(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            self._last_event = torch.cuda.Event()
            self._last_event.record(stream)
            self._last_stream = stream

    def _copy_edge(self, edge: tuple[int, int, int], pairs: np.ndarray, stream) -> None:
        src_index, dst_index, group = edge
        src, dst = self.tiers[src_index], self.tiers[dst_index]
        page_bytes = src.storage.page_bytes[group]
        nbytes = len(pairs) * page_bytes
        timed = dst_index == 0 and src_index != 0
        if timed and stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        began = time.perf_counter()
        path = self.copier.copy(src.storage.buffers[group], dst.storage.buffers[group], pairs, page_bytes, stream)
        if timed and stream is not None:
            end.record(stream)
            self._timed.append((src_index, nbytes, start, end))
        elif timed:
            self.load_cost.observe(src_index, nbytes, time.perf_counter() - began)
        self.counters.add_copy(src.name, dst.name, path, nbytes)

    def measure(self) -> None:
        """Hand the bandwidth of timed copies into the primary tier that have finished to the load cost."""
        while self._timed and self._timed[0][3].query():
            tier, nbytes, start, end = self._timed.popleft()
            self.load_cost.observe(tier, nbytes, start.elapsed_time(end) / 1e3)

    def _read_edge(self, edge: tuple[int, int, int], pairs: np.ndarray, stream, damaged: list[Page]) -> None:
        """Disk -> memory: read and verify each page, through pinned staging when the target is a GPU."""
        src_index, dst_index, group = edge
        disk, dst = self.tiers[src_index], self.tiers[dst_index]
        page_bytes = disk.storage.page_bytes[group]
        buffer = dst.storage.buffers[group]
        # The page being read is still the slot's owner (a copy) or already the destination's (a move).
        sources = [disk.owners[group][s] or dst.owners[group][d] for s, d in pairs.tolist()]
        checksums = [p.checksum for p in sources]
        if buffer.device.type == "cpu":
            self.synchronize()
            began = time.perf_counter()
            views = _page_views(buffer.numpy(), pairs[:, 1].tolist(), page_bytes)
            ok = disk.storage.read(group, pairs[:, 0].tolist(), views, checksums)
            self.counters.add_copy(disk.name, dst.name, "file", len(pairs) * page_bytes)
        else:
            if stream is not None:
                stream.synchronize()  # the staging buffer may still feed an earlier copy
            staging, step = self._staging_for(page_bytes, len(pairs))
            began = time.perf_counter()
            host = staging.numpy()
            up_stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            sent: list[torch.cuda.Event | None] = [None, None]  # the last copy up from each half
            ok = []
            for part, start in enumerate(range(0, len(pairs), step)):  # each part goes up while the next is read
                end = min(start + step, len(pairs))
                base = part % 2 * step
                if sent[part % 2] is not None:
                    sent[part % 2].synchronize()  # the part before last has left this half
                views = _page_views(host, range(base, base + end - start), page_bytes)
                ok += disk.storage.read(group, pairs[start:end, 0].tolist(), views, checksums[start:end])
                staged = np.stack([np.arange(base, base + end - start), pairs[start:end, 1]], axis=1)
                path = self.copier.copy(staging, buffer, staged, page_bytes, stream)
                sent[part % 2] = _recorded(up_stream)
                self.counters.add_copy("host", dst.name, path, (end - start) * page_bytes)
            self.counters.add_copy(disk.name, "host", "file", len(pairs) * page_bytes)
        if dst_index == 0:  # reads and checks dominate; the last part's copy up is not waited for
            self.load_cost.observe(src_index, len(pairs) * page_bytes, time.perf_counter() - began)
        for d, fine, source in zip(pairs[:, 1].tolist(), ok, sources, strict=True):
            if not fine:
                damaged.append(source)
                target = dst.owners[group][d]
                if target is not None and target is not source:
                    damaged.append(target)

    def _staging_for(self, page_bytes: int, pages: int) -> tuple[torch.Tensor, int]:
        """Staging for ``pages`` pages of ``page_bytes`` moved in parts of ``step`` pages
        (``DISK_CHUNK_BYTES``, at least one page): room for two parts, one being filled while the
        other is copied, so it stays at two parts however large the call. Returns (the buffer's
        first ``min(pages, 2 * step)`` pages, ``step``); part ``k`` uses the half at page
        ``k % 2 * step``."""
        step = max(1, DISK_CHUNK_BYTES // page_bytes)
        return self._staging_bytes(min(pages, 2 * step) * page_bytes), step

    def _staging_bytes(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` (registered with CUDA for a GPU manager), reused.

        Before a larger one replaces it, every copy issued so far is waited for: the device may
        still be reading the old one.
        """
        if self._staging is None or self._staging.num_bytes < nbytes:
            if self._staging is not None:
                torch.cuda.synchronize(self.device)
                self._staging.release()
            size = max(nbytes, 2 * self._staging.num_bytes if self._staging is not None else 0)
            with torch.inference_mode(False):  # reused by later calls, inside inference mode or not
                self._staging = allocate_host_buffer(size, size, self.device)
        return self._staging.tensor[:nbytes]

    def close(self) -> None:
        """Release the staging buffer and the swap scratch (after every copy finished)."""
        if self.device.type == "cuda" and (self._staging is not None or self.scratch.allocated):
            torch.cuda.synchronize(self.device)
        if self._staging is not None:
            self._staging.release()
            self._staging = None
        self.scratch.release()


Edge = tuple[int, int, int]  # (source tier, destination tier, layer group)


def _scratch_limit(tiers: list[Tier]) -> int:
    """The swap scratch's size: ``SWAP_SCRATCH_BYTES``, at most the primary tier's largest group
    (no swap has more victims); none without a memory tier below the primary one to swap with."""
    if len(tiers) < 2 or tiers[1].is_disk:
        return 0
    storage = tiers[0].storage
    largest = max(
        slots.num_slots * page_bytes for slots, page_bytes in zip(storage.slots, storage.page_bytes, strict=True)
    )
    return min(SWAP_SCRATCH_BYTES, largest)


def edge_order(edges: Iterable[Edge], two_way: set[int]) -> tuple[list[Edge], list[Edge], list[Edge]]:
    """The order a plan's edges run in: (demotions, deepest first; demotions from the primary tier
    to a tier of ``two_way`` that race the promotions of their group back from there, each run
    with its promotion edge, both directions at once; every other edge: promotions and copies into
    a warmer tier or within one). Each group of edges runs after the one before it, so a slot that
    a demotion reads is never written before: a copy within the primary tier (a partly reused
    block's) may write a slot a demotion vacates. Every edge is in exactly one list (a raced
    promotion through its demotion)."""
    edges = list(edges)
    present = set(edges)
    duplex = sorted(e for e in edges if e[0] == 0 and e[1] in two_way and (e[1], 0, e[2]) in present)
    raced = {(e[1], 0, e[2]) for e in duplex}
    demotions = sorted((e for e in edges if e[1] > e[0] and e not in duplex), key=lambda e: -e[0])
    others = [e for e in edges if e[1] <= e[0] and e not in raced]
    return demotions, duplex, others


def _page_views(host: np.ndarray, slots: Iterable[int], page_bytes: int) -> list[np.ndarray]:
    """The pages in ``slots`` of a host buffer's bytes, as views (what the disk reads into or writes from)."""
    return [host[slot * page_bytes : (slot + 1) * page_bytes] for slot in slots]


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` now."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _nothing() -> None:
    """No copy to wait for."""
