"""The scheduler half: kvtier's index below vLLM's GPU blocks, and the jobs that move blocks.

One ``KVCacheManager`` whose primary tier is host memory (then the disk tier) keeps every block
vLLM computed, by a radix tree of its tokens per reuse scope (LoRA, cache salt), under the
model's identity. While host memory is nearly full, copies of its coldest pages are written to
disk on a background thread (``DiskTier.write_behind``, driven each step), so that pushing them
out of host memory for a save or a read writes nothing on vLLM's scheduler thread; a page the
disk has not taken yet is dropped instead (``DiskTier.blocking_writes=False``): a slow disk
costs cache, not scheduler time. (The disk index's commits, on this thread, append to its SQLite
log and wait for no fsync: its checkpoints run on a thread of their own,
``kvtier.storage.wal_checkpoints``.) Each request gets a ``Lease`` (``kvtier.vllm.lease``):

- **ask** (``get_num_new_matched_tokens``): the lease's cache matches the longest cached prefix
  (no memory, no copy); tokens past vLLM's own hit are offered, loaded asynchronously. While the
  request waits for a slot, an ask after saves landed matches again (``KVCache.match_again``):
  requests sharing a prompt that arrive together reuse what the first of them computed. Pages of
  the prefix on disk are first read into host memory (checksum-verified) on the manager's
  background thread: until then the ask answers None, and vLLM asks again next step while it
  schedules the other requests. The pages read stay in host memory for it until it is scheduled.
  A read it cannot start itself (host memory has no room, requests before it in vLLM's queue
  wait for room first, or another request's read has the pages) it waits for up to
  ``disk_read_wait_s`` from its first ask. While vLLM's own cache holds all that kvtier could
  offer, the ask offers nothing and reads nothing, but the match stays: vLLM may evict blocks of
  its hit while the request waits for a slot, and a later ask offers them (the wait for their
  reads counts from the last ask at which vLLM held them all).
- **early** (``may_load_async``, vLLM 0.34's ``--max-num-inflight-kv-loads``): a request whose
  prefix is all in host memory, past vLLM's own hit, is asked while the running batch is full,
  and its load goes before a slot frees; a prefix with pages on disk (or any, with a store) waits
  for a slot, so its read's wait starts only when the request could run.
- **alloc** (``update_state_after_alloc``, right after the answer): the prefix is locked in host
  memory while a load job copies the offered blocks into vLLM's new blocks (with nothing to load,
  vLLM's own cache holds it all: released at once). The scheduler thread never
  reads the disk: a page still there when the ask answers (past that wait, or found damaged)
  ends the offer (``KVCache.shorten_to_memory``), and the rest is recomputed. Blocks whose
  pages turned out damaged are reported failed with the job, so vLLM recomputes them.
- **every step** (``build_connector_meta``): for each scheduled request the blocks that become
  full and computed by the end of the step get host pages and a save job; a page is published
  for reuse only when its job completed (``update_connector_output``), and then, vLLM holding its
  KV, released by the lease once no load or store write reads it (``Lease.release_used``): a
  running request locks in host memory only the blocks in flight. A save that finds no room
  takes the pages read for requests not scheduled yet, the last in vLLM's queue first (reads for
  them take at most ``queued_reads_share`` of host memory anyway); one that still finds none ends
  the request's saving (a DEBUG line says so).
- **finish** (``request_finished``): with saves in flight vLLM keeps the blocks until the worker
  reports them done; the lease closes when its last job completes.
- **reset** (``reset_cache``, vLLM's ``reset_prefix_cache(reset_connector=True)`` after a weight
  update): later requests match and save in a fresh weights epoch of every scope; offers made
  before are withdrawn and running requests save nothing more.

With a store (``store_url``) the first ask also counts the blocks past the tree that the store
holds; an ask of a request that still waits, ``STORE_ASK_AGAIN_S`` or more after its last check,
asks the store again about the blocks it lacked then (another engine may have stored them since).
An ask that offers them fetches them on a background thread (verified; the run stops
at the first miss, the rest is recomputed), answering None until they arrived. While vLLM's own
cache holds them all, they stay counted but unfetched, as the match does. Alloc gives them new host pages, which another
background thread fills (``StoreTier.place``); the load job goes to the worker, and the pages
are committed, at the first step after that. Every completed save is written through to the
store in the background.

Preempted requests flush their in-flight saves before the next forward (their blocks are freed
at once), and so does every save of a model with sliding-window layers (vLLM frees blocks that
leave the window).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import secrets
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.config import CacheConfig, DiskTier, PrimaryTier, ReuseScope
from kvtier.connector.keys import BlockKeyspace
from kvtier.errors import InvariantError, OutOfPagesError
from kvtier.manager import KVCacheManager
from kvtier.pages import BAD_PAGE_INDEX
from kvtier.storage.disk_replicas import open_first_free
from kvtier.tiering.host_prefetch import HostPrefetch
from kvtier.vllm import host_pool
from kvtier.vllm.file_stamp import files_stamp
from kvtier.vllm.kv_groups import ModelPlan
from kvtier.vllm.lease import Lease, LeaseState, QueuePlace
from kvtier.vllm.meta import KVTierMetadata, KVTierWorkerMeta
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.store_tier import BlockChain, StoreTier, check_store_url, open_store
from kvtier.vllm.transfer import Direction, GroupBlocks, GroupPlan, TransferJob

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

BlockIds = tuple[list[int], ...]  # vLLM block ids per KV cache group, positional per block


@dataclass(slots=True)
class _Placement:
    """Store pages being written into a lease's new host pages (a fill the lease commits in order,
    ``fill_id``), and the load job that reads them, held back until they are written."""

    future: Future[None]
    lease: Lease
    fill_id: int
    load: TransferJob | None = None


# A request that waits is asked about again each step; the store, about the blocks it lacked at
# the request's last check, at most this often (a check is a round trip on vLLM's scheduler thread).
STORE_ASK_AGAIN_S = 0.5

# The place in vLLM's queue that no request has: after every other.
_NO_PLACE: QueuePlace = (math.inf, math.inf, "")


@dataclass(slots=True)
class _ReadTurns:
    """Whose turn it is to read disk pages into host memory, as of this step
    (``KVTierScheduler._read_turns``): the places in vLLM's queue (``Lease.place``) of the first
    request short of room and of the first waiting, for reads or for a slot with its prefix
    loaded (``_NO_PLACE``: none), and the pages held in host memory for requests that have not
    run yet (``KVTierScheduler.queued_read_pages``). Kept up to date as reads start and requests
    join; taken anew at each step, and when reads are let go of or a request leaves. Between
    those, requests scheduled meanwhile may still count as holding reads: a read waits a step
    more, never one less."""

    first_short: QueuePlace
    first_waiting: QueuePlace
    held_pages: int


def _open_manager(plan: ModelPlan, settings: ConnectorSettings) -> KVCacheManager:
    """The engine's manager: host memory, then the disk tier in the first replica directory of
    ``disk_path`` that no other engine holds (``kvtier.storage.disk_replicas``)."""

    def manager(disk_path: str | None) -> KVCacheManager:
        tiers: list[PrimaryTier | DiskTier] = [PrimaryTier(settings.host_bytes)]
        if disk_path is not None and settings.disk_bytes is not None:
            tiers.append(DiskTier(settings.disk_bytes, disk_path, write_behind=True, blocking_writes=False))
        config = CacheConfig(plan.block_size, tiers, device="cpu", enable_partial_reuse=False)
        try:
            return KVCacheManager(plan.spec, config)
        except (ValueError, OutOfPagesError) as exc:  # the tiers' sizes: say which settings set them
            raise type(exc)(
                f"kvtier.vllm: host_bytes={settings.host_bytes} (the host memory tier, kvtier's primary one) and "
                f"disk_bytes={settings.disk_bytes} of kv_connector_extra_config: {exc}"
            ) from exc

    if settings.disk_path is None:
        return manager(None)
    return open_first_free(settings.disk_path, manager)


class KVTierScheduler:
    """Offers, leases and jobs of one engine; see the module docstring."""

    def __init__(self, plan: ModelPlan, settings: ConnectorSettings, engine_id: str, *, by_priority: bool) -> None:
        """``by_priority``: vLLM schedules by priority (its ``policy="priority"``), so requests
        take turns at reads by priority first (``queue_place``)."""
        self.plan = plan
        self._by_priority = by_priority
        if settings.store_url is not None:  # refused before the tiers are made (a disk directory)
            _check_store(plan, settings.store_url)
        self.manager = _open_manager(plan, settings)
        self._engine_id = engine_id
        layout = self.manager.layout()
        for group, plan_group in zip(layout.groups, plan.groups, strict=True):
            if group.regions[0].size != plan_group.host_page_bytes:
                raise InvariantError(f"kvtier's page of group {group.group_id} is not one block of each of its layers")
        buffers = tuple(g.regions[0].buffer for g in layout.groups)
        try:
            host_pool.publish(engine_id, host_pool.HostPool(buffers, tuple(g.host_page_bytes for g in plan.groups)))  # type: ignore[arg-type]
        except ValueError:
            self.manager.close()  # a construction that fails leaves nothing open (a retry may follow)
            raise
        self._tpb = plan.block_size
        self._host_pages = self.manager.stats().tiers["primary"].pages_total
        self._disk_read_wait_s = settings.disk_read_wait_s
        self._queued_reads_pages = settings.queued_reads_share * self._host_pages  # (the first reader's exempt)
        # With recompute_when_faster, blocks on a disk slower than the prefill rate are recomputed: the
        # rate given, or the worker's measured one (the one kept in the disk directory until then).
        self._measure_prefill = settings.recompute_when_faster and settings.prefill_tokens_per_s is None
        rate = settings.prefill_tokens_per_s if settings.recompute_when_faster else None
        if self._measure_prefill:
            rate = self.manager.remembered_prefill_rate
        if rate is not None:
            self.manager.set_prefill_rate(rate)
        self._prefill_rate = rate  # what the disk and the store are weighed against (None: not weighed)
        self._leases: dict[str, Lease] = {}
        self._requests: dict[str, Request] = {}
        self._jobs: dict[int, tuple[Lease | None, Direction]] = {}
        self._step_jobs: list[TransferJob] = []
        self._flush: set[int] = set()  # save jobs of preempted requests' leases: the next step's worker flushes them
        self._delayed: list[str] = []
        self._job_ids = itertools.count()
        self.null_block_id = 0
        self.block_ids_of: Any = None  # vLLM's KVCacheManager.get_block_ids, bound by the connector
        # vLLM's KVCacheManager.get_num_cached_tokens (0.34; a probe that holds nothing), bound likewise
        self.vllm_cached: Any = None
        self._store: StoreTier | None = None
        self._chains: dict[str, BlockChain] = {}
        # per save job, the store write of its pages: the token they start at, the chain, keys, slots
        self._put_plans: dict[int, tuple[int, BlockChain, list[bytes], list[np.ndarray]]] = {}
        self._puts: list[tuple[Future, Lease, int]] = []  # a store write, its lease, the token it reads from
        self._reads: list[HostPrefetch] = []  # background reads from disk that may still run
        self._readers: dict[str, Lease] = {}  # requests waiting for their disk pages to be read
        self._short_of_room: dict[str, Lease] = {}  # of those, the ones whose reads wait for host memory
        self._turns: _ReadTurns | None = None  # whose turn it is to read, this step (None: not taken yet)
        self._saves_landed = 0  # save jobs completed (blocks published): a waiting request may match more since
        self._placements: list[_Placement] = []  # store pages being written into host pages
        self._epoch: str | None = None  # the weights epoch since the last ``reset_cache`` (None: none yet)
        self._epoch_scopes: set[ReuseScope] = set()  # the scopes of that epoch's requests (none for epoch None)
        if settings.store_url is not None:
            try:
                self._store = _store_tier(plan, settings.store_url, buffers)
            except BaseException:
                self.shutdown()  # (the host pages are withdrawn: the engine id is free for a retry)
                raise

    # -- ask and alloc ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _keyable(request):
            return 0, False
        rid = request.request_id
        lease = self._leases.get(rid)
        if lease is not None and lease.preemptions != request.num_preemptions:
            self._let_go_preempted(rid)  # preempted between steps (``reset_prefix_cache``), asked again at once
            lease = None
        if lease is not None:
            self._match_again(request, lease)
        else:
            bound = token_bound(request)
            place = queue_place(request, self._by_priority)
            tokens = token_ids(request)
            cache = self.manager.create_cache(keyed_tokens(tokens, bound), self._scope(request))
            lease = Lease(cache, place, bound, request.num_preemptions)
            lease.saves_seen = self._saves_landed
            self._leases[rid] = lease
            self._requests[rid] = request
            if self._store is not None and not _skips_cache(request):
                chain = self._chain(rid, request)
                limit = (request.num_tokens - 1) // self._tpb  # a hit never covers the last token
                if bound is not None:
                    limit = min(limit, bound // self._tpb)
                lease.store_more = chain.upto(tokens, self._tpb, limit)[lease.matched // self._tpb :]
        if lease.state is not LeaseState.OFFERED:
            return 0, False
        if _skips_cache(request):  # vLLM computes all of it (prompt logprobs): no read, no wait; saved as usual
            lease.cache.shorten_to_memory()
            return 0, False
        if lease.store_more and not lease.store_blocks and time.monotonic() - lease.store_asked >= STORE_ASK_AGAIN_S:
            self._ask_store(rid, request, lease)
        if not lease.reads and self._reach(lease) <= num_computed_tokens:
            # vLLM's own cache has all kvtier could offer: no read, no fetch, no wait. The match
            # stays whole (alloc gives up its part on disk), and the store's blocks stay known:
            # while the request waits for a slot, vLLM may evict some of those blocks, and a later
            # ask offers them (reading and fetching them first, a wait that starts then).
            lease.unfetch_store_blocks()
            lease.local_tokens = num_computed_tokens
            lease.wait_since = time.monotonic()
            return 0, False
        if lease.store_keys and not lease.store_blocks:  # fetched while the disk's pages are read
            assert self._store is not None
            lease.store_blocks = len(lease.store_keys)
            lease.store_fetch = self._store.fetch(self._chain(rid, request), lease.store_keys)
        while True:  # the prefix's pages on disk are read into host memory in the background first
            if lease.waiting:
                return None, False  # asked again next step; vLLM schedules the other requests meanwhile
            if lease.reads:
                lease.reads = []
                self.manager.maintain()  # lands the pages read
            in_memory = lease.cache.reused_in_memory
            if in_memory == lease.matched:
                break
            if rid not in self._readers:
                self._readers[rid] = lease
                turns = self._read_turns()
                turns.first_waiting = min(turns.first_waiting, lease.place)
            stop = self._reason_to_stop_reading(request, lease, in_memory)
            if stop is not None:
                log.debug(
                    "kvtier.vllm: request %s: %d of its %d cached tokens in host memory; the rest, on disk, is "
                    "recomputed (%s)", rid, in_memory, lease.matched, stop,
                )  # fmt: skip
                break
            if not lease.reads:
                return None, False  # another read has its pages, or host memory has no room: asked again next step
        if self._readers.pop(rid, None) is not None:
            self._short_of_room.pop(rid, None)
            self._turns = None  # (it may have been the first)
        lease.fetched()  # the offer counts only the store's blocks that arrived whole
        if lease.cache.shorten_to_memory():  # vLLM allocates right after this answer: alloc reads no disk
            lease.drop_store_blocks()  # they followed the blocks given up
        lease.local_tokens = num_computed_tokens
        offer = lease.matched + lease.store_blocks * self._tpb - num_computed_tokens
        return (offer, True) if offer > 0 else (0, False)

    def _match_again(self, request: Request, lease: Lease) -> None:
        """A request still waiting reuses more of its prompt if saves that landed since its last ask
        published blocks of it (``KVCache.match_again``): several requests sharing a prompt arrive
        together, and those waiting for a slot were first asked while the first one still computed
        it. Only for an offer that started nothing: no read, fetch or store block of its own, no
        read it waits for; and only once saves landed since the last look."""
        if (
            lease.saves_seen == self._saves_landed
            or lease.state is not LeaseState.OFFERED
            or lease.held
            or lease.store_keys
            or lease.store_fetch is not None
            or request.request_id in self._readers
        ):
            return
        lease.saves_seen = self._saves_landed
        before = lease.matched // self._tpb
        if lease.cache.match_again(keyed_tokens(token_ids(request), lease.bound)):
            del lease.store_more[: lease.matched // self._tpb - before]  # (they follow the match)

    def _ask_store(self, rid: str, request: Request, lease: Lease) -> None:
        """Which of the blocks past those the store held at the lease's last check (``store_more``;
        at its first ask, every block past the match) it holds now: another engine may have written
        them while the request waited. Found ones join ``store_keys``; none is asked about when the
        store is expected to take longer than recomputing them."""
        assert self._store is not None
        more = lease.store_more
        if self._store.faster_to_recompute(len(more), self._tpb, self._prefill_rate):
            log.debug(
                "kvtier.vllm: request %s: %d tokens past the local match recomputed without asking the "
                "store (its check and fetch are expected to take longer at %.0f tokens/s)",
                rid, len(more) * self._tpb, self._prefill_rate,
            )  # fmt: skip
            lease.store_more = []
            return
        found = self._store.present(self._chain(rid, request), more)
        lease.store_keys += more[:found]
        lease.store_more = more[found:]
        lease.store_asked = time.monotonic()

    def _reach(self, lease: Lease) -> int:
        """Tokens an offer to the lease could reach: its match and the blocks after it that the
        store holds."""
        return lease.matched + len(lease.store_keys) * self._tpb

    def may_load_async(self, request: Request) -> bool:
        """Whether an ask will offer ``request`` a load that needs no wait (with
        ``--max-num-inflight-kv-loads``, vLLM 0.34 then lets the load start while the running batch is
        full, so the prefix is there when a slot frees): it reads caches, and the prefix kvtier holds
        for it is all in host memory and longer than what vLLM's own prefix cache holds
        (``vllm_cached``). A prefix partly on disk answers False: its read would start, and its
        ``disk_read_wait_s`` run, while no slot could take the request anyway (with host memory full
        of pages held or in flight, the wait runs out and the disk part is recomputed); so does
        every request with a store (blocks fetched past kvtier's own would need host room then
        too): they load once a slot frees, as without the flag. A wrong True (pages that left host
        memory since) holds back the other such loads until a slot frees."""
        if self._store is not None or not _keyable(request) or _skips_cache(request):
            return False
        keyed = keyed_tokens(token_ids(request), token_bound(request))
        scope = self._scope(request)
        in_memory = self.manager.cached_tokens(keyed, scope, in_memory=True)
        if in_memory == 0 or in_memory < self.manager.cached_tokens(keyed, scope):
            return False
        return self.vllm_cached is None or in_memory > self.vllm_cached(request)

    def _reason_to_stop_reading(self, request: Request, lease: Lease, in_memory: int) -> str | None:
        """Start reading the request's cached pages still on disk (past the ``in_memory`` tokens of
        its ``reused_in_memory``) into host memory on the manager's background thread; the lease
        waits for that read (``lease.reads``), and what it lands stays in host memory for the lease
        until the request is scheduled (``lease.held``): other requests' reads cannot push it back
        to disk before the ask sees it (a running request's save can: ``_let_go_of_a_queued_read``).
        None when one started, or when none could and it may still wait: it is not its turn,
        another read has its pages, or host memory has no room that other requests may free, and
        less than ``disk_read_wait_s`` passed since its wait began (``Lease.wait_since``). Why not,
        when none could and it may not: it is past that wait, or nothing stands in the way (its
        pages were found damaged, or its own pages fill host memory).

        Its turn: room goes to the requests in the order of vLLM's queue (``Lease.place``: by
        arrival, or by priority first under vLLM's priority policy). A request finding none is
        short of room (``_short_of_room``): no request after it starts a read meanwhile, and the reads
        of requests after it that do not have their whole prefix yet are let go of, so that what
        they hold comes back to it (without that, two requests each holding part of their
        prefixes could wait for each other for ever; with reads not held, they would push each
        other's pages back to disk instead, read after read). And the pages held for requests
        that have not run yet (``queued_read_pages``: reads held for requests not scheduled yet,
        and the prefixes of requests loaded that wait for a slot) take at most
        ``queued_reads_share`` of host memory, leaving the rest to the running requests' saves,
        except the read of the first request in line (of those waiting for reads or, loaded, for a
        slot), which is never kept back.

        Past the wait, a read that would follow one that brought no more of the prefix into host
        memory than there was when it started (it failed, or was let go of) is not started. A read
        that did bring more (it read what room there was) is followed by the next, wait or not."""
        self._reads = [read for read in self._reads if not read.done()]
        waited = time.monotonic() - lease.wait_since
        past_wait = waited >= self._disk_read_wait_s
        if past_wait and lease.read_from is not None and in_memory <= lease.read_from:
            return f"{waited:.2f} s into its wait, past disk_read_wait_s: its last read brought none to stay"
        turns = self._read_turns()
        not_its_turn = None
        if turns.first_short < lease.place:
            not_its_turn = "requests before it in vLLM's queue wait for host memory first"
        elif turns.first_waiting < lease.place and turns.held_pages >= self._queued_reads_pages:
            not_its_turn = "the pages held for requests that have not run yet fill their share of host memory"
        if not_its_turn is None:
            tokens = token_ids(request)[: lease.matched + 1]  # what the offer covers: read no block beyond
            read = self.manager.prefetch_to_host(tokens, self._scope(request), hold=True)
            if read is not None:
                self._reads.append(read)
                lease.hold_read(read)
                lease.read_from = in_memory
                turns.held_pages += read.num_pages
                return None
        if past_wait:
            why = not_its_turn or "no read of them can start"
            return f"{waited:.2f} s into its wait, past disk_read_wait_s: {why}"
        if not_its_turn is not None:
            return None
        if self._others_fill_host(lease):
            self._short_of_room[request.request_id] = lease
            self._reclaim_room_for(lease)
            self._turns = None
            return None
        if self._reads:
            return None
        return "no read of them can start: they were found damaged, or its own pages fill host memory"

    def _read_turns(self) -> _ReadTurns:
        """Whose turn it is to read (``_ReadTurns``), taken once a step: requests since scheduled,
        or let go, leave ``_readers`` and ``_short_of_room`` then."""
        if self._turns is None:
            for waiting in (self._readers, self._short_of_room):
                for rid, lease in list(waiting.items()):
                    if lease.state is not LeaseState.OFFERED or self._leases.get(rid) is not lease:
                        del waiting[rid]
            waiting = [*self._readers.values(), *self._loaded()]
            self._turns = _ReadTurns(
                min((lease.place for lease in self._short_of_room.values()), default=_NO_PLACE),
                min((lease.place for lease in waiting), default=_NO_PLACE),
                self.queued_read_pages(),
            )
        return self._turns

    def queued_read_pages(self) -> int:
        """Pages held in host memory for requests that have not run yet (what ``queued_reads_share``
        bounds): those of the reads held for requests not scheduled yet, and the prefixes locked
        for requests whose loads vLLM started and still run (a loading request takes no slot of
        the running batch, so vLLM starts the loads of every ready request while one slot is
        free; each lets go of its prefix once its load is over, ``Lease.release_used``)."""
        held = sum(read.num_pages for lease in self._queued() for read in lease.held)
        groups = len(self.plan.groups)
        return held + sum(lease.matched // self._tpb * groups for lease in self._loaded() if lease.loads)

    def _loaded(self) -> list[Lease]:
        """The leases of requests allocated (ACTIVE) that vLLM has not scheduled since."""
        return [lease for lease in self._leases.values() if lease.state is LeaseState.ACTIVE and not lease.ran]

    def _queued(self) -> list[Lease]:
        """The leases of requests not scheduled yet (offered, or waiting for reads) that hold reads."""
        return [lease for lease in self._leases.values() if lease.held and lease.state is LeaseState.OFFERED]

    def _reclaim_room_for(self, lease: Lease) -> None:
        """Let go of the reads of requests after ``lease`` in vLLM's queue whose prefixes are not all
        in host memory yet: the pages they hold may leave it for ``lease``'s read (from the
        manager's next call that makes room). They read again when their turn comes."""
        for other in self._queued():
            if other.place > lease.place and other.cache.reused_in_memory < other.matched:
                other.let_go_of_reads()

    def _let_go_of_a_queued_read(self) -> bool:
        """For a running request's save that finds no room: let go of the reads held for the request
        last in vLLM's queue of those not scheduled yet that hold pages landed in host memory (they
        may leave it at the manager's next call that makes room, as the save's retry; a read still
        running is left alone, since letting go of it makes no room now). A running request's
        blocks come before a queued one's prefix, which is read again in its turn (or, past its
        wait, recomputed). False when no request holds any."""
        queued = [lease for lease in self._queued() if any(read.held for read in lease.held)]
        if not queued:
            return False
        max(queued, key=lambda lease: lease.place).let_go_of_reads()
        self._turns = None
        return True

    def _others_fill_host(self, lease: Lease) -> bool:
        """Whether host memory has no free page (with several layer groups, none in any of them) while
        other requests hold some of it: only their letting go can make room (the lease's own pages
        filling it never do)."""
        tier = self.manager.stats().tiers["primary"]
        own = lease.cache.reused_in_memory // self._tpb * len(self.plan.groups)
        return own < tier.pages_used >= tier.pages_total

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external: int) -> None:
        rid = request.request_id
        lease = self._leases.get(rid)
        if lease is None or lease.state is not LeaseState.OFFERED:
            return  # not keyable, or the second call after an asynchronous load
        if num_external == 0:
            lease.cache.shorten_to_memory()  # an ask that offered nothing leaves a match that may reach the disk
        if not lease.activate():
            log.warning(
                "kvtier.vllm: the host tier cannot hold request %s's prefix; it is neither loaded nor saved", rid
            )
            self._leases.pop(rid)
            lease = None
        placement = None
        if lease is not None and lease.store_pages and lease.committed == lease.matched:
            placement = self._place_store_pages(request, lease)
        if num_external > 0:
            job = self._add_load(rid, lease, block_ids, num_external)
            if placement is not None:
                placement.load = job  # it reads the pages being written: it goes once they are
            else:
                self._step_jobs.append(job)
        if lease is not None:
            lease.release_used()  # with no load, vLLM's own cache holds the whole prefix

    def _place_store_pages(self, request: Request, lease: Lease) -> _Placement | None:
        """Give the blocks fetched from the store new host pages and start writing them there in
        the background; the lease commits them once written (``_land_placements``). None when the
        host tier has no room for them (they are recomputed)."""
        assert self._store is not None
        pages, lease.store_pages = lease.store_pages, []
        first = lease.committed // self._tpb
        end = first + len(pages)
        if not lease.grow(end * self._tpb, make_room=self._let_go_of_a_queued_read):
            return None
        future = self._store.place(pages, [lease.host_slots(plan.group_id, first, end) for plan in self.plan.groups])
        placement = _Placement(future, lease, next(self._job_ids))
        lease.plan_save(placement.fill_id, list(request.all_token_ids[first * self._tpb : end * self._tpb]))
        lease.store_tokens = len(pages) * self._tpb
        self._placements.append(placement)
        return placement

    def _land_placements(self) -> None:
        """Commit the store pages written into host pages, and send the loads that waited for them;
        a failed write fails its load (vLLM recomputes it) and ends its lease's saving."""
        running = []
        for placement in self._placements:
            if not placement.future.done():
                running.append(placement)
                continue
            failure = placement.future.exception()
            if failure is not None:
                log.warning("kvtier.vllm: writing store pages into host memory failed (%r); recomputed", failure)
            if placement.load is not None:
                placement.load.failed = placement.load.failed or failure is not None
                self._step_jobs.append(placement.load)
            placement.lease.save_done(placement.fill_id, failure is None)
            self._saves_landed += 1
        self._placements = running

    def hit_sources(self, request: Request, num_external: int) -> tuple[int, int, int]:
        """(host, disk, store) tokens of an external hit (the store's, then the disk's counted first)."""
        lease = self._leases.get(request.request_id)
        if lease is None:
            return num_external, 0, 0
        store = min(num_external, lease.store_tokens)
        disk = min(num_external - store, lease.cache.reused_by_tier.get("disk", 0))
        return num_external - store - disk, disk, store

    def _add_load(self, rid: str, lease: Lease | None, block_ids: BlockIds, num_external: int) -> TransferJob:
        """The job loading the offered blocks (registered here; the caller sends it)."""
        tpb = self._tpb
        start = 0 if lease is None else lease.local_tokens
        first, end = start // tpb, -(-(start + num_external) // tpb)
        job = TransferJob(next(self._job_ids), rid, Direction.LOAD)
        good_end = first
        if lease is not None:
            good_end = min(self._intact_end(lease, plan, block_ids, first, end) for plan in self.plan.groups)
            for plan in self.plan.groups:
                job.groups.append(self._rows(lease, plan, block_ids, first, good_end))
            lease.loads.add(job.job_id)
        if good_end < end:
            if self.plan.num_vllm_groups > 1:
                job.failed = True  # block ids are per group: vLLM recomputes the whole request
            else:
                job.failed_block_ids = [b for b in block_ids[0][good_end:end] if b != self.null_block_id]
            job.failed = job.failed or good_end == first
        self._jobs[job.job_id] = (lease, Direction.LOAD)
        return job

    def _intact_end(self, lease: Lease, plan: GroupPlan, block_ids: BlockIds, first: int, end: int) -> int:
        """The first block in ``[first, end)`` that vLLM wants and this group cannot supply (or ``end``).
        Pages the store's blocks are being written into count: the load waits for them."""
        slots = _padded(lease.host_slots(plan.group_id, first, end), end - first)
        wanted = self._device_blocks(plan, block_ids, first, end) != self.null_block_id
        intact_blocks = lease.planned // self._tpb
        for i in range(end - first):
            if wanted[i].any() and (slots[i] == BAD_PAGE_INDEX or first + i >= intact_blocks):
                return first + i
        return end

    # -- every step ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        self._turns = None  # taken anew at the next ask that reads
        self._land_placements()
        self._reap_puts()
        self.manager.maintain()  # lands background reads and disk writes, starts the next write
        for rid in scheduler_output.preempted_req_ids or ():
            lease = self._leases.get(rid)
            if lease is not None and lease.preemptions != self._requests[rid].num_preemptions:
                self._let_go_preempted(rid)  # (not a lease made since, when it was asked again in this step)
        flush, self._flush = self._flush, set()
        if self.plan.has_sliding_window:
            flush.update(j for j, (_, d) in self._jobs.items() if d is Direction.SAVE)
        for rid, num_tokens in scheduler_output.num_scheduled_tokens.items():
            lease = self._leases.get(rid)
            if lease is None or lease.state is not LeaseState.ACTIVE:
                continue
            lease.ran = True
            if not lease.saving:
                continue
            request = self._requests[rid]
            end = min(request.num_computed_tokens + num_tokens, request.num_tokens)
            if lease.bound is not None:  # past it the KV depends on more than tokens: never saved
                end = min(end, lease.bound)
            end = end // self._tpb * self._tpb
            if end > lease.planned:
                self._add_save(rid, lease, request, end)
        prefill = 0
        if self._measure_prefill:  # chunks of prompts: a decode step schedules one token a request,
            drafting = scheduler_output.scheduled_spec_decode_tokens  # or one more per draft token
            scheduled = scheduler_output.num_scheduled_tokens.items()
            prefill = sum(n for rid, n in scheduled if n > 1 and rid not in drafting)
        meta = KVTierMetadata(self._step_jobs, sorted(flush), self._delayed, prefill)
        self._step_jobs, self._delayed = [], []
        return meta

    def _add_save(self, rid: str, lease: Lease, request: Request, end: int) -> None:
        tpb = self._tpb
        start = lease.planned
        history = None if lease.busy else request.num_computed_tokens  # (a job may read the pages it would let go)
        if not lease.grow(end, history, make_room=self._let_go_of_a_queued_read):
            log.debug(
                "kvtier.vllm: request %s: host memory has no room for its blocks past %d tokens; they are not saved",
                rid, start,
            )  # fmt: skip
            return
        block_ids = self.block_ids_of(rid)
        first, stop = start // tpb, end // tpb
        for plan in self.plan.groups:  # a page kvtier keeps whose block vLLM already let go cannot be filled
            slots = lease.host_slots(plan.group_id, first, stop)
            gone = (self._device_blocks(plan, block_ids, first, stop) == self.null_block_id).any(axis=1)
            unfillable = np.flatnonzero((slots != BAD_PAGE_INDEX) & gone)
            if len(unfillable):
                stop = min(stop, first + int(unfillable[0]))
        if stop < end // tpb:
            lease.stop_saving()
        if stop <= first:
            return
        job = TransferJob(next(self._job_ids), rid, Direction.SAVE)
        job.groups = [self._rows(lease, plan, block_ids, first, stop) for plan in self.plan.groups]
        lease.plan_save(job.job_id, list(request.all_token_ids[start : stop * tpb]))
        if self._store is not None:
            chain = self._chain(rid, request)
            keys = chain.upto(token_ids(request), tpb, stop)[first:stop]
            slots = [lease.host_slots(plan.group_id, first, stop) for plan in self.plan.groups]
            self._put_plans[job.job_id] = (start, chain, keys, slots)
        self._jobs[job.job_id] = (lease, Direction.SAVE)
        self._step_jobs.append(job)

    def _rows(self, lease: Lease, plan: GroupPlan, block_ids: BlockIds, first: int, end: int) -> GroupBlocks:
        """The blocks of ``[first, end)`` that move for one group: a host page and a live vLLM block per column."""
        slots = _padded(lease.host_slots(plan.group_id, first, end), end - first)
        device = self._device_blocks(plan, block_ids, first, end)
        keep = (slots != BAD_PAGE_INDEX) & (device != self.null_block_id).all(axis=1)
        return GroupBlocks(plan.group_id, slots[keep], device[keep])

    def _device_blocks(self, plan: GroupPlan, block_ids: BlockIds, first: int, end: int) -> np.ndarray:
        """(end - first, columns) vLLM block ids of the plan's columns (null past a table's end)."""
        out = np.full((end - first, len(plan.columns)), self.null_block_id, dtype=np.int64)
        for c, vllm_group in enumerate(plan.columns):
            ids = block_ids[vllm_group][first:end]
            out[: len(ids), c] = ids
        return out

    # -- completion and finish -------------------------------------------------------------------

    def update_connector_output(self, worker_meta: object) -> None:
        if not isinstance(worker_meta, KVTierWorkerMeta):
            return
        if self._measure_prefill and worker_meta.prefill_rate is not None:
            self.manager.set_prefill_rate(worker_meta.prefill_rate)
            self._prefill_rate = worker_meta.prefill_rate
        for job_id, ok in worker_meta.done.items():
            lease, direction = self._jobs.pop(job_id, (None, Direction.LOAD))
            if lease is None:
                continue
            if direction is Direction.LOAD:
                lease.load_done(job_id)
                continue
            put = self._put_plans.pop(job_id, None)
            if ok and put is not None and self._store is not None:  # the pages are whole: write them through
                start, chain, keys, slots = put
                self._puts.append((self._store.put(chain, keys, slots), lease, start))
                lease.put_started(start)
            lease.save_done(job_id, ok)
            self._saves_landed += 1
        self._reap_puts()

    def wait_for_store_writes(self) -> None:
        """Block until every store write in flight is done, and let its lease go of the pages."""
        wait([future for future, _, _ in self._puts])  # a failed write is a later miss (``_reap_puts`` logs it)
        self._reap_puts()

    def _reap_puts(self) -> None:
        """Let leases go of pages whose store writes finished."""
        running = []
        for put in self._puts:
            future, lease, start = put
            if future.done():
                if future.exception() is not None:  # (a store's own failures are misses it has logged)
                    log.warning("kvtier.vllm: writing pages through to the store failed: %r", future.exception())
                lease.put_done(start)
            else:
                running.append(put)
        self._puts = running

    def _chain(self, rid: str, request: Request) -> BlockChain:
        chain = self._chains.get(rid)
        if chain is None:
            chain = self._chains[rid] = BlockChain(self._scope(request))
        return chain

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after its weights were updated in
        place: no block saved so far is served again.

        Later requests match and save in a fresh weights epoch (a random id in their scope), so
        blocks computed before are never matched again here, while they stay, for other processes
        of the old weights, in a shared disk directory or store, and leave by eviction. Offers made
        before are withdrawn (asked again, a request gets a new one), and requests still running
        save nothing more. False while a load is in flight: vLLM cannot take it back.

        The blocks of the epoch that ends, when it began with an earlier reset, are dropped from
        host memory and disk at once: their epoch's id was this process's own, nothing can match
        them again, and evicting them would only write them to disk."""
        for scope in self._epoch_scopes:
            self.manager.forget_scope(scope)
        self._epoch_scopes.clear()
        self._epoch = secrets.token_hex(8)
        for rid, lease in list(self._leases.items()):
            if lease.state is LeaseState.OFFERED:
                del self._leases[rid]
                self._chains.pop(rid, None)
                lease.release()
            else:
                lease.stop_saving()
        return not any(direction is Direction.LOAD for _, direction in self._jobs.values())

    def _scope(self, request: Request) -> ReuseScope:
        """The request's reuse scope (``scope_of``) in the current weights epoch."""
        scope = scope_of(request)
        if self._epoch is None:
            return scope
        scope = ReuseScope(scope.lora_id, f"{scope.salt or ''}\x00weights-epoch:{self._epoch}")
        self._epoch_scopes.add(scope)
        return scope

    def request_finished(self, request: Request) -> bool:
        """True when vLLM must keep the request's blocks until the worker reports its saves done."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._chains.pop(rid, None)
        lease = self._leases.pop(rid, None)
        if lease is None:
            return False
        if lease.preemptions != request.num_preemptions:  # preempted since (``reset_prefix_cache``): vLLM
            self._release_preempted(lease)  # freed its blocks then; its saves are fenced with the next step
            return False
        delay = bool(self._worker_saves(lease)) and not lease.loads  # during a load vLLM waits for the load itself
        lease.release()
        if delay:
            self._delayed.append(rid)
        return delay

    def _let_go_preempted(self, rid: str) -> None:
        """A preempted request's lease goes (``_release_preempted``); the request, resumed, is asked
        again: a new lease."""
        self._release_preempted(self._leases.pop(rid))

    def _release_preempted(self, lease: Lease) -> None:
        """The lease of a request vLLM preempted (its blocks freed): its saves on the worker are
        flushed with the next step, before any forward may write those blocks, and it closes once
        no job of it runs."""
        self._flush.update(self._worker_saves(lease))
        lease.release()

    def _worker_saves(self, lease: Lease) -> list[int]:
        """The lease's save jobs on the worker (its fills from the store are host-side only)."""
        return [job_id for job_id in lease.saves if job_id in self._jobs]

    def shutdown(self) -> None:
        """Close every lease and the manager (published pages still in host memory go to disk)."""
        if self._store is not None:
            self._store.close()  # waits for the placements and writes in flight
            self._store = None
            self._placements.clear()
        leases = {id(lease): lease for lease in self._leases.values()}
        leases.update({id(lease): lease for lease, _ in self._jobs.values() if lease is not None})
        for lease in leases.values():
            lease.close()
        self._leases.clear()
        self._jobs.clear()
        self.manager.close()
        host_pool.withdraw(self._engine_id)


def _check_store(plan: ModelPlan, url: str) -> None:
    """``NotImplementedError`` for a model with a sliding window, ``ValueError`` for a URL that names no store."""
    if plan.has_sliding_window:
        raise NotImplementedError("kvtier.vllm: store_url is served for full-attention models only")
    check_store_url(url)


def _store_tier(plan: ModelPlan, url: str, buffers: tuple[torch.Tensor, ...]) -> StoreTier:
    """The store ``store_url`` names over the host pages (``_check_store`` passed)."""
    keyspace = BlockKeyspace.for_model(plan.spec, plan.block_size)
    return StoreTier(open_store(url), keyspace, buffers, [g.host_page_bytes for g in plan.groups])


def queue_place(request: Request, by_priority: bool) -> QueuePlace:
    """The request's place in vLLM's queue of waiting requests (``QueuePlace``): by priority, then
    arrival, as vLLM's priority policy orders it; by arrival alone (its priority counts for nothing)
    otherwise. vLLM's first-come policy puts a preempted request at the head of its queue; its
    arrival puts it before the requests that arrived after it, which is where it stood."""
    return (request.priority if by_priority else 0, request.arrival_time, request.request_id)


def scope_of(request: Request) -> ReuseScope:
    """The reuse scope of a request: its LoRA adapter (``lora_identity``) and its cache salt."""
    lora = getattr(request, "lora_request", None)
    lora_id = None
    if lora is not None:
        lora_id = lora_identity(lora.lora_name, lora.lora_int_id, getattr(lora, "lora_path", "") or "")
    return ReuseScope(lora_id=lora_id, salt=getattr(request, "cache_salt", None))


@functools.lru_cache(maxsize=1024)
def lora_identity(name: str, int_id: int, path: str) -> str:
    """A LoRA adapter's part of a scope: its name and path, and for an adapter on local disk a stamp
    of its files, taken once per adapter id (the weights vLLM loaded under that id): an adapter
    retrained and saved at the same path is another scope in a later process, or under a new id.
    (vLLM's ``load_inplace`` swaps the weights under an id: ``reset_prefix_cache(reset_connector=True)``
    then, as for vLLM's own cache.)"""
    stamp = files_stamp(path)
    return f"{name}:{path}" if stamp is None else f"{name}:{path}@{stamp}"


def _keyable(request: Request) -> bool:
    """Whether a request's KV starts out decided by its token ids (it has them, not prompt embeddings)."""
    return request.prompt_token_ids is not None and getattr(request, "prompt_embeds", None) is None


def token_ids(request: Request) -> Sequence[int]:
    """The request's token ids, for kvtier's keys (read at once, never kept). ``all_token_ids`` is
    a read-only wrapper that yields them one by one (32K tokens: 0.64 ms over vLLM 0.34's
    ``array('i')``, 0.31 ms over 0.33's list); what it wraps is read instead: 0.34's array copied at
    once (a few us, then read through its buffer), 0.33's list as it is (read in C)."""
    held = getattr(request, "_all_token_ids", None)
    if isinstance(held, array):
        return array(held.typecode, held)
    if type(held) is list:
        return held
    return request.all_token_ids


def keyed_tokens(tokens: Sequence[int], bound: int | None) -> Sequence[int]:
    """The token ids a request's cache is made of: its ``tokens`` up to ``bound`` (``token_bound``)
    and one more, since a match never covers its last token."""
    return tokens if bound is None else tokens[: bound + 1]


def token_bound(request: Request) -> int | None:
    """How many leading tokens of a request have KV decided by the token ids alone: those before its
    first multimodal placeholder (an image's KV is not keyed by its placeholder tokens); None: all.
    Only these are matched, loaded and saved."""
    features = getattr(request, "mm_features", None)
    if not features:
        return None
    return min(int(feature.mm_position.offset) for feature in features)


def _skips_cache(request: Request) -> bool:
    """Whether vLLM reads no connector's KV for the request, whatever it is offered (prompt logprobs,
    whose positions it must compute, or a request that skips cache reads); kvtier then reads nothing
    for it. vLLM 0.34 names this ``skip_reading_external_kv``, 0.33 ``skip_reading_prefix_cache``."""
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skips)


def _padded(slots: np.ndarray, length: int) -> np.ndarray:
    if len(slots) >= length:
        return slots
    return np.concatenate([slots, np.full(length - len(slots), BAD_PAGE_INDEX, dtype=np.int64)])
