"""A request's kvtier cache while vLLM holds its blocks: the scheduler half's unit of bookkeeping.

States, in order:

    OFFERED   a SUSPENDED cache holding the longest cached prefix (on any tier, no memory yet);
              its pages on disk may be on their way to host memory in the background (``reads``),
              and those read stay there for it (``held``) until it is ACTIVE or let go
    ACTIVE    resumed: the prefix's pages locked in the host tier. Loads read them; saves give it
              new pages (``grow``) that a worker job fills (or, for blocks fetched from the
              store, a background write into host memory, planned and committed as a save).
              Once no load runs, its committed blocks that no store write reads are released
              (``release_used``): vLLM holds their KV on its GPU, and the tree keeps them for
              reuse, demotable like any cached page, so a running request locks in host
              memory only the blocks its jobs fill or read.
    CLOSING   vLLM let go of the request (finished, aborted, preempted); closed once no job of
              it (nor a store write of its pages) is in flight, so no page is unlocked
              (demotable, reusable) under a copy
    CLOSED

Invariants: ``committed <= planned``; a page is committed (published in the tree, so other
requests may reuse it) only after the job that filled it completed, jobs commit in the order they
were planned, a failed save stops the lease's saving for good (later blocks cannot be committed
past a hole), and a committed page stays locked while a load of the lease or a store write of it
may read it. Imports nothing of vLLM.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvtier.cache import KVCache
from kvtier.tiering.host_prefetch import HostPrefetch

log = logging.getLogger(__name__)

# A request's place in vLLM's queue of waiting requests, lowest first: (priority, arrival time,
# request id), the priority 0 for every request unless vLLM schedules by priority. A request vLLM
# preempted keeps its arrival time, so it comes before the requests that arrived after it.
QueuePlace = tuple[float, float, str]


class LeaseState(str, enum.Enum):
    OFFERED = "offered"
    ACTIVE = "active"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True)
class _Commit:
    job_id: int
    tokens: list[int]  # the tokens the job's blocks hold, from the previous planned end
    done: bool = False


class Lease:
    """One request's cache; see the module docstring for its states."""

    __slots__ = (
        "_commits",
        "bound",
        "cache",
        "held",
        "loads",
        "local_tokens",
        "place",
        "planned",
        "preemptions",
        "puts",
        "ran",
        "read_from",
        "reads",
        "saves",
        "saves_seen",
        "saving",
        "state",
        "store_asked",
        "store_blocks",
        "store_fetch",
        "store_keys",
        "store_more",
        "store_pages",
        "store_tokens",
        "wait_since",
    )

    def __init__(self, cache: KVCache, place: QueuePlace, bound: int | None = None, preemptions: int = 0) -> None:
        self.cache = cache
        self.place = place
        self.bound = bound  # tokens whose KV the token ids decide (before the first image); None: all
        self.preemptions = preemptions  # the request's preemptions when it was made: one more makes it stale
        self.state = LeaseState.OFFERED
        self.local_tokens = 0  # tokens vLLM had computed itself when the offer was made
        self.planned = 0
        self.ran = False  # vLLM scheduled the request since the lease became ACTIVE (before: its load
        # may be under way, its prefix locked here, or over with the request waiting for a slot)
        self.saving = True
        self.loads: set[int] = set()
        self.saves: set[int] = set()
        self.puts: list[int] = []  # per write to the store in flight, the token it reads the lease's pages from
        # the blocks past the match that the store holds, by chain key (fetched only once vLLM's own
        # cache lacks some of them; ``store_blocks`` of them are offered: being fetched or fetched)
        self.store_keys: list[bytes] = []
        # the blocks after those, from the first the store lacked at its last check (``store_asked``,
        # monotonic seconds; before the first ask, every block past the match): another engine may
        # store them while the request waits
        self.store_more: list[bytes] = []
        self.store_asked = -math.inf
        self.store_blocks = 0
        self.store_fetch: Future[list[list[bytes]]] | None = None  # their pages, on their way
        self.store_pages: list[list[bytes]] = []  # per block, per group, the pages fetched
        self.store_tokens = 0  # tokens the store actually supplied
        self.reads: list[HostPrefetch] = []  # background reads bringing the prefix's disk pages to host memory
        self.held: list[HostPrefetch] = []  # every read started for it: what they landed stays in host memory
        self.read_from: int | None = None  # tokens in memory when its last read started (None: none did)
        # when the request's wait for its pages on disk began (``disk_read_wait_s`` counts from it): its
        # first ask, or the last one at which vLLM's own cache held all that kvtier could offer
        self.wait_since = time.monotonic()
        self.saves_seen = 0  # the scheduler's count of saves landed when the match was last made or grown
        self._commits: deque[_Commit] = deque()

    @property
    def matched(self) -> int:
        """Tokens of the prefix the cache holds (the offer's reach)."""
        return self.cache.num_reused_tokens

    @property
    def committed(self) -> int:
        return self.cache.num_committed_tokens

    @property
    def busy(self) -> bool:
        """A job of this lease is in flight."""
        return bool(self.loads or self.saves or self.puts)

    def activate(self) -> bool:
        """OFFERED -> ACTIVE: lock the prefix's pages in the host tier (reading them from disk if needed).

        A page that fails its checksum shortens the prefix (``committed`` drops to what is
        intact). False, and the lease is closed, when the host tier cannot hold the pages.
        """
        assert self.state is LeaseState.OFFERED
        if not self.cache.resume():
            self.close()
            return False
        self.let_go_of_reads()  # the pages they landed are locked by the cache now
        self.state = LeaseState.ACTIVE
        self.planned = self.committed
        return True

    def hold_read(self, read: HostPrefetch) -> None:
        """Wait for ``read`` (started with ``hold``), and keep what it lands in host memory until
        the lease is ACTIVE or let go."""
        self.reads.append(read)
        self.held.append(read)

    def let_go_of_reads(self) -> None:
        """Cancel every read started for the lease: one still running stops after the part it is
        reading, and the pages they landed may leave host memory again (at the manager's next call
        that lands reads or makes room)."""
        for read in self.held:
            read.cancel()
        self.held = []
        self.reads = []

    @property
    def waiting(self) -> bool:
        """Pages of the prefix are still on their way: from disk into host memory, or from the store."""
        fetch = self.store_fetch
        return (fetch is not None and not fetch.done()) or not all(read.done() for read in self.reads)

    def fetched(self) -> None:
        """The store fetch is over: keep the pages that arrived (none if it failed)."""
        fetch = self.store_fetch
        if fetch is None:
            return
        self.store_fetch = None
        failure = fetch.exception()
        if failure is not None:
            log.warning("kvtier.vllm: a store fetch failed (%r); its blocks are recomputed", failure)
        self.store_pages = [] if failure is not None else fetch.result()
        self.store_blocks = len(self.store_pages)
        del self.store_keys[self.store_blocks :]  # the rest did not arrive: not asked for again
        self.store_more = []

    def unfetch_store_blocks(self) -> None:
        """Offer none of the store's blocks for now (vLLM's own cache holds them): let go of their
        fetch and pages; they stay known, to be fetched if vLLM evicts some before the request runs."""
        self.store_fetch = None
        self.store_pages = []
        self.store_blocks = 0

    def drop_store_blocks(self) -> None:
        """Forget the store's blocks: they no longer follow the prefix (it was shortened)."""
        self.unfetch_store_blocks()
        self.store_keys = []
        self.store_more = []

    def host_slots(self, group_id: int, first_block: int, end_block: int) -> np.ndarray:
        """Host slots of blocks ``[first_block, end_block)`` of a group (``BAD_PAGE_INDEX`` where none)."""
        return self.cache.page_indices(group_id)[first_block:end_block].astype(np.int64)

    def grow(self, end: int, history: int | None = None, make_room: Callable[[], bool] | None = None) -> bool:
        """Pages up to token ``end`` for a save; False (saving stops) when the host tier has no room.

        ``history``: the tokens vLLM computed before this step, given while no job of the lease is in
        flight. The cache's history is raised to it, so that the blocks vLLM let go of past a sliding
        window are stale here too (published with the other groups' pages only), not pages no save
        could fill. ``make_room``: called while there is no room, to let go of something that
        holds host memory (True when it did); tried again after each."""
        assert self.state is LeaseState.ACTIVE and end > self.planned
        if history is not None:
            history = min(max(history, self.cache.history_length), end)
        if not self.saving:
            return False
        while not self.cache.resize(end, history):
            if make_room is None or not make_room():
                self.saving = False
                return False
        return True

    def plan_save(self, job_id: int, tokens: list[int]) -> None:
        """A job fills the pages of ``tokens`` (the next ones after ``planned``)."""
        self.saves.add(job_id)
        self._commits.append(_Commit(job_id, tokens))
        self.planned += len(tokens)

    def stop_saving(self) -> None:
        self.saving = False

    def save_done(self, job_id: int, ok: bool) -> None:
        """The save ``job_id`` completed: commit every completed job at the front, in order."""
        self.saves.discard(job_id)
        if self.state is LeaseState.CLOSED:
            return
        for commit in self._commits:
            if commit.job_id == job_id:
                commit.done = True
        if not ok:
            self.saving = False
            self._commits.clear()
        while self._commits and self._commits[0].done:
            self.cache.commit(self._commits.popleft().tokens)
        self.release_used()
        self._close_if_idle()

    def put_started(self, start: int) -> None:
        """A write to the store reads this lease's pages of the blocks from token ``start`` on."""
        self.puts.append(start)

    def put_done(self, start: int) -> None:
        """The write to the store started at ``start`` finished."""
        self.puts.remove(start)
        self.release_used()
        self._close_if_idle()

    def load_done(self, job_id: int) -> None:
        """The load ``job_id`` completed (its pages were read)."""
        self.loads.discard(job_id)
        self.release_used()
        self._close_if_idle()

    def release_used(self) -> None:
        """Release the pages of the committed blocks before the first one a store write in flight
        reads, unless a load runs (it reads the prefix): vLLM holds their KV on its GPU."""
        if self.state is LeaseState.ACTIVE and not self.loads:
            self.cache.release_prefix(min([self.committed, *self.puts]))

    def release(self) -> None:
        """vLLM let go: close now, or once the jobs in flight are done."""
        if self.state is LeaseState.CLOSED:
            return
        self.state = LeaseState.CLOSING
        if not self.busy:
            self.close()

    def _close_if_idle(self) -> None:
        if self.state is LeaseState.CLOSING and not self.busy:
            self.close()

    def close(self) -> None:
        """Close the cache: committed blocks stay in the tree for reuse, the rest is freed. Its reads
        are let go of (``let_go_of_reads``): a lease that waited for one of them starts its own."""
        self.let_go_of_reads()
        self.store_fetch = None
        self.store_pages = []
        self._commits.clear()
        self.cache.close()
        self.state = LeaseState.CLOSED
