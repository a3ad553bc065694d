"""A connector over a ``BlockStore``: both halves in one object, and the two shipped ones.

- Ask: the chained keys of the prompt's full blocks after the local prefix are looked up
  (``contains_many``), and the longest run that every attention group's hit rule accepts is
  fetched and verified (``get_many``) into a private read-ahead buffer:
  - by default on the engine's thread, and exactly what arrived intact is offered, so the load
    can never fail afterwards (a store that dies between ask and load costs nothing but the
    offer);
  - with ``load_async=True``, on a thread of the connector's while the engine goes on: the run is
    offered as an asynchronous load at once. A fetch that falls short (a page gone or damaged
    since the ask, the store down) copies nothing: the load is reported finished and failed
    (``get_failed_loads``), and the engine recomputes the offer. This pays when the store waits
    (a remote store's round trips); a fetch that costs CPU (many small files, parsing, checksums)
    competes with the engine's own thread for the interpreter, and the request waits a step or
    more (docs/benchmarks.md section 41).
- Deliver: ``update_state_after_alloc`` maps the staged blocks to their pages. Once the fetch is
  over (at ``start_load_kv``, else at a later ``get_finished``), the pages are copied in (one
  ``PageCopier`` call per layer group, on the stream ``start_load_kv`` was given) through a host
  staging buffer that the connector keeps across steps (grown when a step needs more).
- Save: ``request_finished`` lists the request's full blocks that the save policy wants
  (``SavePolicy``: default all), less those its ask read intact from the store, and returns
  True; a save thread (``SAVE_THREADS`` of them, so a distant store's round trips overlap) takes
  the saves queued by then as one batch (``kvtier.connector.save_batches``), asks the store which
  of their blocks it lacks (not those the asks found missing, unless this connector has written
  or found them in the store since: ``kvtier.connector.recent_keys``), copies those pages out and
  writes them in one call; ``get_finished`` reports each request once its batch is written, and only
  then does the engine release its pages. (So a store's round trips at a request's end never stall the
  engine's thread, and a prompt served whole by a synchronous load costs no save at all.)
- A store call on the engine's thread (an ask's existence check, a fetch with
  ``load_async=False``) that takes ``SLOW_CALL_S`` or more is logged (rate-limited WARNING, the
  engine's stall so far): a slow store stalls every step that asks it.
- Never slower than recomputing: given the engine's prefill rate (``set_prefill_rate``; the
  reference engine sets it when ``recompute_when_faster``), a prompt is not asked for when the
  store's measured speed makes its check and fetch slower than recomputing the tokens it could
  give (``kvtier.connector.store_speed``; counted in ``unasked_tokens``, a DEBUG line each).
- ``stats()``: what the connector did with its store (``ConnectorStats``); exported to
  Prometheus by ``kvtier.connector.store_metrics``.

Models with a recurrent layer group are not served (their reuse needs a state snapshot at the
offer's end, which the pages a request holds at the end do not give): such connectors offer
nothing and save nothing, and say so once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.connector.base import ConnectorRequest, KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput
from kvtier.connector.daemon_pool import DaemonPool
from kvtier.connector.fs_store import DEFAULT_MAX_BYTES, IO_TIMEOUT_S, FileSystemStore
from kvtier.connector.fs_store import RETRY_AFTER_S as FS_RETRY_AFTER_S
from kvtier.connector.keys import BlockKeyspace
from kvtier.connector.recent_keys import RecentKeys
from kvtier.connector.redis_store import RETRY_AFTER_S, SOCKET_TIMEOUT_S, RedisStore
from kvtier.connector.save_batches import Save, SaveBatches
from kvtier.connector.save_policy import PrefixSightings, SavePolicy
from kvtier.connector.store import BlockStore
from kvtier.connector.store_speed import StoreSpeed
from kvtier.connector.store_stats import ConnectorCounters, ConnectorStats
from kvtier.copy import PageCopier
from kvtier.errors import InvariantError
from kvtier.layout import GroupLayout, KvCacheLayout
from kvtier.lifecycle import GroupRule
from kvtier.pages import BAD_PAGE_INDEX
from kvtier.reuse.block_keys import block_chain
from kvtier.spec import GroupKind
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.storage.pinned import HostBuffer, allocate_host_buffer

log = logging.getLogger(__name__)

SLOW_CALL_S = 0.1  # a store call this long on the engine's thread is worth a WARNING
SAVE_THREADS = 4  # saves at once: the round trips of a distant store overlap (a store serves several threads)


@dataclass(slots=True)
class _Staged:
    """A request's offer from token ``start`` on: the (block, group) pages holding its tokens and
    their fetch (verified payloads, positional; None for a page that did not arrive intact). The
    first block may begin before ``start`` (a local prefix that ends inside a block); only its
    tokens from ``start`` on are offered. ``handed_back``: the offer's tokens from there on will
    not be loaded (``cancel_load``): pages holding none before it are not copied.
    ``asynchronous``: offered as an asynchronous load (else fetched, complete, in the ask)."""

    start: int
    pages: list[tuple[int, int]]
    fetch: Future
    handed_back: int
    asynchronous: bool


@dataclass(slots=True)
class _Load:
    """A delivered offer: its request, staged pages and the slots they go to (positional;
    ``BAD_PAGE_INDEX`` for a page not copied)."""

    request_id: int
    staged: _Staged
    slots: list[int]


@dataclass(slots=True)
class ConnectorMeta:
    """What the worker half does this step: offers to load."""

    loads: list[_Load]


class StoreConnector(KvCacheConnectorScheduler, KvCacheConnectorWorker):
    """Supplies prefixes from, and saves finished blocks to, one ``BlockStore``.

    ``save_policy``: which finished blocks to save, a ``SavePolicy`` or its text form
    (``"all"``, ``"priority>=P"``, ``"seen>=N"``); ``ValueError`` for a bad one. ``tp_rank`` /
    ``tp_world_size``: this process's tensor-parallel shard, ints with ``0 <= tp_rank <
    tp_world_size`` (``TypeError`` / ``ValueError`` at construction otherwise). ``load_async``:
    fetch an offer on the connector's thread and load it asynchronously (see the module docstring).
    """

    def __init__(
        self,
        store: BlockStore,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        *,
        save_policy: str | SavePolicy = "all",
        load_async: bool = False,
    ) -> None:
        _check_options(tp_rank, tp_world_size, load_async)
        self.load_async = load_async
        self.save_policy = SavePolicy.parse(save_policy)
        self.store = store
        self.tp_rank = tp_rank
        self.tp_world_size = tp_world_size
        self._staged: dict[int, _Staged] = {}
        self._pending_loads: list[_Load] = []
        self._meta = ConnectorMeta([])
        self._waiting: list[tuple[_Load, object]] = []  # delivered loads whose fetch runs, with their streams
        self._loaded: set[int] = set()  # requests whose loads finished, not reported yet
        self._failed: set[int] = set()  # of those, the ones whose fetch fell short (nothing copied)
        self._failed_reported: set[int] = set()  # failed loads reported finished, for ``get_failed_loads``
        self._reported: set[int] = set()  # loads reported finished that the engine still asks about
        self._saves: dict[int, Future] = {}
        self._writing: set[str] = set()  # keys a save batch is writing now
        self._seen_lately = RecentKeys()  # keys lately written to the store or found there
        self._save_batches = SaveBatches(
            SAVE_THREADS, "kvtier-connector-save", self._save_batch
        )  # waited for by close (and at exit, bounded)
        self._fetch_pool = DaemonPool(2, "kvtier-connector-fetch")  # the exit never waits for a hung read
        self._fetches: set[Future] = set()  # fetches not over yet
        self._lock = threading.Lock()
        self._layout: KvCacheLayout | None = None
        self._keyspace: BlockKeyspace | None = None
        self._copier: PageCopier | None = None
        self._staging: HostBuffer | None = None  # host bytes of the loads in flight, reused across steps
        self._servable = True
        self._closed = False
        self._sightings = PrefixSightings(self.save_policy.max_tracked)
        self._counters = ConnectorCounters()
        self._slow_calls = RateLimitedWarning(log, "connector: slow store calls on the engine's thread")
        self._speed = StoreSpeed()
        # per request not finished: by key, whether its ask read the value intact (True) or found it
        # missing (False); a key found but not read is not known (a save asks the store again)
        self._asked: dict[int, dict[str, bool]] = {}
        self._prefill_rate: float | None = None

    def set_prefill_rate(self, tokens_per_second: float | None) -> None:
        """The engine's prefill rate (None: unknown): from now on prompts whose ask is expected to take
        longer than recomputing are not asked for (``ValueError`` unless a finite rate > 0 or None)."""
        if tokens_per_second is not None:
            rate = float(tokens_per_second)
            if not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"the prefill rate must be a finite number > 0 tokens/s, got {tokens_per_second!r}")
            tokens_per_second = rate
        self._prefill_rate = tokens_per_second

    def stats(self) -> ConnectorStats:
        """A snapshot of what this connector did with its store."""
        return self._counters.snapshot()

    # -- worker: layout ---------------------------------------------------------------------------

    def register_kv_cache_layout(self, layout: KvCacheLayout) -> None:
        """Take an engine's layout; ``ValueError`` once closed (its store and threads are gone)."""
        if self._closed:
            raise ValueError("this connector was closed (with the engine it served): give each engine a new one")
        fingerprint = layout.model_fingerprint
        if not fingerprint:
            raise ValueError("the layout carries no model fingerprint: register the layout an engine hands over")
        self._layout = layout
        self._keyspace = BlockKeyspace(fingerprint, layout.tokens_per_block, self.tp_rank, self.tp_world_size)
        buffer = layout.groups[0].regions[0].buffer
        self._copier = PageCopier(buffer.device if buffer is not None else "cpu")
        if any(g.kind is GroupKind.RECURRENT for g in layout.groups):
            self._servable = False
            log.warning("kvtier connector: models with recurrent layers are not served; it will offer and save nothing")

    # -- scheduler: ask, deliver, cancel ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self._drop_staged(request.request_id)
        if not self._servable:
            return 0, False
        layout, keyspace = self._ready()
        tpb = layout.tokens_per_block
        first = num_computed_tokens // tpb
        full = len(request.prompt_token_ids) // tpb
        if full <= first:
            return 0, False
        groups = [GroupRule.of(g, tpb) for g in layout.groups if g.kind is not GroupKind.RECURRENT]
        usable = len(request.prompt_token_ids) - 1  # the engine computes the last prompt token itself
        most = min(full * tpb, usable) - num_computed_tokens  # tokens the longest offer could give
        nbytes = (full - first) * sum(self._page_bytes(g.group_id) for g in groups)
        if most > 0 and self._speed.faster_to_recompute(most, nbytes, self._prefill_rate):
            self._counters.add(unasked_tokens=most)
            log.debug(
                "kvtier connector: request %s not asked of the store: %d tokens recompute in %.4f s at %.0f tokens/s, "
                "the store's check and fetch of %d bytes are expected to take %.4f s",
                request.request_id, most, most / self._prefill_rate, self._prefill_rate, nbytes,
                self._speed.estimate(nbytes),
            )  # fmt: skip
            return 0, False
        chain = block_chain(request.prompt_token_ids, request.scope, tpb, full)
        wanted = [(b, g.group_id) for b in range(first, full) for g in groups]
        asked = [keyspace.key(request.scope, chain[b], g) for b, g in wanted]
        with self._engine_waits("an existence check", len(wanted)):
            found = self.store.contains_many(asked)
        known = {key: False for key, have in zip(asked, found, strict=True) if not have}
        self._asked[request.request_id] = known
        present = dict(zip(wanted, found, strict=True))
        used = set(_needed(groups, first, min(full * tpb, usable)))  # (a window's stale pages are never saved)
        self._counters.add(missed_pages=sum(not have and page in used for page, have in present.items()))
        end = _best_end(present, groups, first, full, tpb, num_computed_tokens, usable)
        if end <= num_computed_tokens:
            return 0, False
        if self.load_async:
            needed = _needed(groups, first, end)
            keys = [keyspace.key(request.scope, chain[b], g) for b, g in needed]
            sizes = [self._page_bytes(g) for _, g in needed]
            fetch = self._fetch_pool.submit(self._timed_fetch, keys, sizes)
            self._fetches.add(fetch)
            fetch.add_done_callback(self._fetches.discard)
            self._staged[request.request_id] = _Staged(num_computed_tokens, needed, fetch, end, True)
            return end - num_computed_tokens, True
        while end > num_computed_tokens:  # fetched here: what arrived intact is offered
            needed = _needed(groups, first, end)
            keys = [keyspace.key(request.scope, chain[b], g) for b, g in needed]
            sizes = [self._page_bytes(g) for _, g in needed]
            with self._engine_waits("a fetch", len(keys), sum(sizes)):
                payloads = self.store.get_many(keys, sizes)
            if len(payloads) != len(needed):  # a store breaking its contract: nothing it gave is trusted
                payloads = [None] * len(needed)
            known.update((key, payload is not None) for key, payload in zip(keys, payloads, strict=True))
            missing = [needed[i] for i, p in enumerate(payloads) if p is None]
            self._counters.add(missed_pages=len(missing), errors=len(missing))
            if not missing:
                fetched: Future = Future()
                fetched.set_result(payloads)
                self._staged[request.request_id] = _Staged(num_computed_tokens, needed, fetched, end, False)
                return end - num_computed_tokens, False
            for block_group in missing:
                present[block_group] = False
            end = _best_end(present, groups, first, min(b for b, _ in missing), tpb, num_computed_tokens, usable)
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids_by_layer_group: list[list[int]]) -> None:
        staged = self._staged.pop(request.request_id, None)
        if staged is None:
            return
        tpb = self._ready()[0].tokens_per_block
        slots = []
        for block, group in staged.pages:
            slot = block_ids_by_layer_group[group][block]
            # A page holding only tokens handed back, or a sliding-window block already stale at the
            # offer's end, is not copied.
            slots.append(slot if max(block * tpb, staged.start) < staged.handed_back else BAD_PAGE_INDEX)
        self._pending_loads.append(_Load(request.request_id, staged, slots))

    def cancel_load(self, request: ConnectorRequest, start: int, end: int) -> None:
        """An offer not yet delivered keeps the tokens before ``start``; a delivered one whose step
        failed (its load recorded, not yet built into a step's metadata) is dropped whole."""
        staged = self._staged.get(request.request_id)
        if staged is None:
            self._pending_loads = [load for load in self._pending_loads if load.request_id != request.request_id]
            return
        staged.handed_back = min(staged.handed_back, start)
        if staged.handed_back <= staged.start:  # the whole offer: nothing stays staged
            self._drop_staged(request.request_id)

    def _drop_staged(self, request_id: int) -> None:
        """Forget a request's staged offer; its fetch is cancelled if it has not started."""
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            staged.fetch.cancel()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        loads, self._pending_loads = self._pending_loads, []
        return ConnectorMeta(loads)

    # -- worker: loads ------------------------------------------------------------------------------

    def start_load_kv(self, stream: object) -> None:
        """Copy in the step's loads fetched in the ask, and the asynchronous ones whose fetch is over;
        the others are copied by a later ``get_finished`` once theirs is (on this ``stream``)."""
        loads = self._meta.loads if isinstance(self._meta, ConnectorMeta) else []
        for load in loads:
            if not load.staged.asynchronous and not self._land(load, stream):
                raise InvariantError(f"a page verified in the ask of request {load.request_id} went missing")
        self._waiting += [(load, stream) for load in loads if load.staged.asynchronous]
        self._land_fetched()

    def _land_fetched(self) -> None:
        """Copy in the waiting loads whose fetch is over, or mark them failed (a page that did not
        arrive intact: nothing of that offer is copied); both are finished, to be reported."""
        waiting, self._waiting = self._waiting, []
        for load, stream in waiting:
            if not load.staged.fetch.done():
                self._waiting.append((load, stream))
                continue
            try:
                landed = self._land(load, stream)
            except Exception as exc:  # a store or a copy breaking its contract: this load fails alone
                log.warning("kvtier connector: loading the offer of request %d failed: %s", load.request_id, exc)
                wanted = sum(slot != BAD_PAGE_INDEX for slot in load.slots)
                self._counters.add(missed_pages=wanted, errors=wanted)
                landed = False
            if not landed:
                self._failed.add(load.request_id)
            self._loaded.add(load.request_id)

    def _land(self, load: _Load, stream: object) -> bool:
        """Copy in one load whose fetch is over; False, copying nothing, when a page it needs did not
        arrive intact. Raises for a fetch that raised or answered another number of pages."""
        payloads = load.staged.fetch.result()
        copied = [(page, slot, p) for page, slot, p in zip(load.staged.pages, load.slots, payloads, strict=True)]
        missing = sum(p is None for _, slot, p in copied if slot != BAD_PAGE_INDEX)
        if missing:
            self._counters.add(missed_pages=missing, errors=missing)
            return False
        self._copy_in([(group, slot, p) for (_, group), slot, p in copied if slot != BAD_PAGE_INDEX], stream)
        return True

    def _copy_in(self, pages: list[tuple[int, int, bytes]], stream: object) -> None:
        """Copy (group, slot, payload) pages into the cache, one ``PageCopier`` call per group, on ``stream``."""
        by_group: dict[int, list[tuple[int, bytes]]] = {}
        for group, slot, payload in pages:
            by_group.setdefault(group, []).append((slot, payload))
        copier = self._ready_copier()
        for group, items in by_group.items():
            region = self._group(group).regions[0]
            buffer = region.as_tensor().reshape(-1)
            staging = self._staging_bytes(len(items) * region.size, buffer.device)
            host = staging.numpy()
            for i, (_, payload) in enumerate(items):
                host[i * region.size : (i + 1) * region.size] = np.frombuffer(payload, dtype=np.uint8)
            pairs = np.array([[i, slot] for i, (slot, _) in enumerate(items)], dtype=np.int64)
            copier.copy(staging, buffer, pairs, region.size, stream)
            self._counters.add(loaded_pages=len(items), loaded_bytes=len(items) * region.size)
            if buffer.device.type == "cuda":  # the staging buffer is written next: its copy must have read it
                copier.torch_stream(stream).synchronize()

    def _staging_bytes(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of the kept staging buffer (registered with CUDA as one range for a GPU cache, so
        any group's pages fit it), grown by doubling. Every copy from it has finished by then
        (``start_load_kv`` waits after each)."""
        if self._staging is None or self._staging.num_bytes < nbytes:
            size = max(nbytes, 2 * self._staging.num_bytes if self._staging is not None else 0)
            if self._staging is not None:
                self._staging.release()
                self._staging = None
            self._staging = allocate_host_buffer(size, size, device)
        return self._staging.tensor[:nbytes]

    def wait_for_layer_load(self, layer_id: int, stream: object) -> None:
        """Loads are whole pages, all enqueued on the engine's stream by ``start_load_kv``."""

    # -- scheduler + worker: saves ----------------------------------------------------------------

    def request_finished(self, request: ConnectorRequest, block_ids_by_layer_group: list[list[int]]) -> bool:
        asked = self._asked.pop(request.request_id, {})
        if not self._servable:
            return False
        layout, keyspace = self._ready()
        tpb = layout.tokens_per_block
        full = len(request.all_token_ids) // tpb
        if full == 0:
            return False
        chain = block_chain(request.all_token_ids, request.scope, tpb, full)
        wanted = self._blocks_to_save(request, chain)
        pages, skipped, nbytes = [], 0, 0
        for g in (g for g in layout.groups if g.kind is not GroupKind.RECURRENT):
            slots = block_ids_by_layer_group[g.group_id]
            page_bytes = self._page_bytes(g.group_id)
            for b in range(full):
                if slots[b] == BAD_PAGE_INDEX:
                    continue
                if not wanted[b]:
                    skipped += 1
                    continue
                key = keyspace.key(request.scope, chain[b], g.group_id)
                if not asked.get(key, False):  # (one the ask read intact is not written again)
                    pages.append((key, g.group_id, slots[b], key in asked))
                    nbytes += page_bytes
        self._counters.add(skipped_pages=skipped)
        if not pages:
            return False
        written = self._written_event(layout)
        with self._lock:
            self._saves[request.request_id] = self._save_batches.submit(pages, written, nbytes)
        return True

    def _timed_fetch(self, keys: list[str], sizes: list[int]) -> list[bytes | None]:
        """``store.get_many`` on a fetch thread, timed (``StoreSpeed``)."""
        start = time.perf_counter()
        payloads = self.store.get_many(keys, sizes)
        self._speed.fetched(time.perf_counter() - start, sum(sizes))
        return payloads

    @contextmanager
    def _engine_waits(self, what: str, keys: int, nbytes: int = 0) -> Iterator[None]:
        """Count the body (a store call on the engine's thread: an existence check, or a fetch of
        ``nbytes``) as stall time and time it for ``StoreSpeed``; a slow one is logged."""
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self._counters.add(stall_s=took)
        if nbytes:
            self._speed.fetched(took, nbytes)
        else:
            self._speed.checked(took)
        if took >= SLOW_CALL_S:
            self._slow_calls(
                f"{what} of {keys} pages took {took:.2f} s (the engine's stall so far "
                f"{self._counters.snapshot().stall_s:.1f} s): a slow store stalls every step that asks it; "
                "load_async=True fetches off the engine's thread"
            )

    @staticmethod
    def _written_event(layout: KvCacheLayout) -> torch.cuda.Event | None:
        """On CUDA, an event after the work queued so far on the current stream, where the engine's
        forwards wrote the pages (the save copies them out on another thread's stream)."""
        buffer = layout.groups[0].regions[0].buffer
        if buffer is None or buffer.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(buffer.device))
        return event

    def _blocks_to_save(self, request: ConnectorRequest, chain: list[bytes]) -> list[bool]:
        """Per full block whether the save policy wants it; every finished request counts as a sighting."""
        policy = self.save_policy
        seen = self._sightings.see(chain) if policy.min_seen > 1 else None
        if request.priority < policy.min_priority:
            return [False] * len(chain)
        return [True] * len(chain) if seen is None else [n >= policy.min_seen for n in seen]

    def _save_batch(self, saves: list[Save]) -> None:
        """Of the saves' pages (a key several hold, once), those the store lacks (asked now of those
        no ask found missing): copy them out of the cache (the engine keeps them locked meanwhile),
        once the forwards that wrote them are done (``written``), and write them in one call."""
        pages: dict[str, tuple[int, int, bool]] = {}
        for save in saves:
            for key, group, slot, missing in save.pages:
                known = pages.get(key)
                if known is None or (missing and not known[2]):
                    pages[key] = (group, slot, missing)
        with self._lock:  # keys another batch is writing now are left to it
            for key in self._writing.intersection(pages):
                del pages[key]
            for key, (group, slot, missing) in pages.items():
                if missing and key in self._seen_lately:  # written or found since the ask: asked again
                    pages[key] = (group, slot, False)
            self._writing.update(pages)
        try:
            self._write_missing(pages, [save.written for save in saves if save.written is not None])
        finally:
            with self._lock:
                self._writing.difference_update(pages)

    def _write_missing(self, pages: dict[str, tuple[int, int, bool]], written: list[torch.cuda.Event]) -> None:
        """``_save_batch`` for its pages by key (group, slot, whether an ask found the key missing),
        once the events ``written`` are done."""
        unknown = [key for key, (_, _, missing) in pages.items() if not missing]
        have = dict(zip(unknown, self.store.contains_many(unknown), strict=True)) if unknown else {}
        todo = [(key, group, slot) for key, (group, slot, _) in pages.items() if not have.get(key, False)]
        with self._lock:
            self._seen_lately.add(key for key, present in have.items() if present)
        if not todo:
            return
        for event in written:
            event.synchronize()
        items = []
        for key, group, slot in todo:
            page = self._group(group).regions[0].as_tensor()[slot]
            items.append((key, page.to("cpu").numpy().copy()))
        stored = self.store.put_many(items)
        with self._lock:
            self._seen_lately.add(key for (key, _), ok in zip(items, stored, strict=True) if ok)
        saved_bytes = sum(page.nbytes for (_, page), ok in zip(items, stored, strict=True) if ok)
        self._counters.add(saved_pages=sum(stored), saved_bytes=saved_bytes, errors=stored.count(False))

    def save_kv_layer(self, layer_id: int, stream: object) -> None:
        """Saves copy whole pages once their request has finished; nothing to do per layer."""

    def wait_for_save(self, stream: object) -> None:
        """Saves run on their own thread after the request finished; nothing to wait for here."""

    def get_finished(self, finished_gen_ids: Sequence[int], started_loading_ids: Sequence[int]) -> tuple[list, list]:
        """Saves written, and loads finished (copied in, or failed: ``get_failed_loads``), each reported
        once; a load asked about that this connector holds nowhere (dropped when a hook raised before
        it started) is reported finished and failed."""
        self._land_fetched()
        asked = set(started_loading_ids)
        self._reported &= asked  # (ids the engine no longer asks about are done with)
        meta = self._meta.loads if isinstance(self._meta, ConnectorMeta) else []
        held = [load for load, _ in self._waiting] + self._pending_loads + meta  # (a later step may start these)
        known = {load.request_id for load in held} | self._loaded | self._reported
        lost = asked - known
        self._loaded.update(lost)  # loads it dropped (a hook raised before they started): finished, failed
        self._failed.update(lost)
        with self._lock:
            done = [rid for rid, future in self._saves.items() if future.done()]
            for rid in done:
                error = self._saves.pop(rid).exception()
                if error is not None:
                    log.warning("kvtier connector: saving request %d failed: %s", rid, error)
        loaded = [rid for rid in started_loading_ids if rid in self._loaded]
        self._loaded.difference_update(loaded)
        self._reported.update(loaded)
        self._failed_reported.update(self._failed.intersection(loaded))
        self._failed.difference_update(loaded)
        return done, loaded

    def get_failed_loads(self) -> set[int]:
        failed, self._failed_reported = self._failed_reported, set()
        return failed

    def close(self) -> None:
        """Wait for the saves, then close the store; fetches still running (nothing reads them now)
        are not waited for: the store closes on a thread of its own once they are over (a hung
        read holds that thread, never the caller)."""
        self._closed = True
        self._fetch_pool.shutdown()
        self._save_batches.shutdown()
        self._slow_calls.flush()
        running = [fetch for fetch in list(self._fetches) if not fetch.done()]
        if running:
            threading.Thread(
                target=lambda: (wait(running), self.store.close()), name="kvtier-connector-close", daemon=True
            ).start()
        else:
            self.store.close()
        if self._staging is not None:
            self._staging.release()
            self._staging = None

    # -- helpers ----------------------------------------------------------------------------------

    def _ready(self) -> tuple[KvCacheLayout, BlockKeyspace]:
        if self._layout is None or self._keyspace is None:
            raise RuntimeError("register_kv_cache_layout must be called before the connector is used")
        return self._layout, self._keyspace

    def _ready_copier(self) -> PageCopier:
        if self._copier is None:
            raise RuntimeError("register_kv_cache_layout must be called before the connector is used")
        return self._copier

    def _group(self, group_id: int) -> GroupLayout:
        return next(g for g in self._ready()[0].groups if g.group_id == group_id)

    def _page_bytes(self, group_id: int) -> int:
        return self._group(group_id).regions[0].size


class FileSystemConnector(StoreConnector):
    """Blocks in a shared directory: one file per page, written atomically, checksummed, private (0600).

    The directory holds at most about ``max_bytes`` (default ``DEFAULT_MAX_BYTES``, 64 GiB; per
    process sharing it, up to 10% more between eviction passes): past it the least recently
    used blocks are evicted. ``timeout_s`` bounds what file I/O that hangs (a dead network mount)
    costs a call; then the store is left alone for ``retry_after_s``, its calls answering misses at
    once (``FileSystemStore``). ``save_policy``, ``load_async``: see ``StoreConnector``.
    """

    def __init__(
        self,
        path,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        timeout_s: float = IO_TIMEOUT_S,
        retry_after_s: float = FS_RETRY_AFTER_S,
        save_policy: str | SavePolicy = "all",
        load_async: bool = False,
    ) -> None:
        _check_options(tp_rank, tp_world_size, load_async)  # before the store makes its directory
        policy = SavePolicy.parse(save_policy)  # likewise
        store = FileSystemStore(path, max_bytes=max_bytes, timeout_s=timeout_s, retry_after_s=retry_after_s)
        super().__init__(store, tp_rank, tp_world_size, save_policy=policy, load_async=load_async)


class RedisConnector(StoreConnector):
    """Blocks in Redis, Redis Cluster, behind Sentinel, or Valkey (``RedisStore``'s URL forms; password in the URL).

    ``timeout_s`` bounds what a store that is down or hung costs a call (the socket timeouts);
    after a failure the server (or the cluster node) is left alone for ``retry_after_s`` and
    asked calls answer misses at once. ``ttl_seconds``: values expire after that long (None:
    never). ``save_policy``, ``load_async``: see ``StoreConnector``.
    """

    def __init__(
        self,
        url: str,
        ttl_seconds: float | None = None,
        tp_rank: int = 0,
        tp_world_size: int = 1,
        *,
        timeout_s: float = SOCKET_TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
        save_policy: str | SavePolicy = "all",
        load_async: bool = False,
    ) -> None:
        _check_options(tp_rank, tp_world_size, load_async)  # before the store connects
        store = RedisStore(url, ttl_seconds=ttl_seconds, socket_timeout_s=timeout_s, retry_after_s=retry_after_s)
        super().__init__(store, tp_rank, tp_world_size, save_policy=save_policy, load_async=load_async)


def _check_options(tp_rank: int, tp_world_size: int, load_async: bool) -> None:
    """``TypeError`` unless the shard's numbers are ints (not bools) and ``load_async`` a bool,
    ``ValueError`` unless ``0 <= tp_rank < tp_world_size``: the rules of ``BlockKeyspace``, checked
    where the connector is built rather than where an engine registers."""
    if not isinstance(load_async, bool):
        raise TypeError(f"load_async must be a bool, got {load_async!r}")
    for name, value in (("tp_rank", tp_rank), ("tp_world_size", tp_world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if tp_world_size <= 0:
        raise ValueError(f"tp_world_size must be > 0, got {tp_world_size}")
    if not 0 <= tp_rank < tp_world_size:
        raise ValueError(f"tp_rank must be in 0..{tp_world_size - 1}, got {tp_rank}")


def _needed(rules: list[GroupRule], first: int, end: int) -> list[tuple[int, int]]:
    """(block, group) pages from block ``first`` that an offer ending at token ``end`` must load: the
    blocks holding its tokens, every one of a full-attention group, the ones live at history ``end``
    of a sliding-window group."""
    out = []
    for rule in rules:
        blocks = -(-end // rule.tokens_per_block)
        out.extend((b, rule.group_id) for b in range(first, blocks) if rule.is_live(b, end))
    return sorted(out)


def _best_end(
    present: dict[tuple[int, int], bool],
    rules: list[GroupRule],
    first: int,
    limit: int,
    tpb: int,
    computed: int,
    usable: int,
) -> int:
    """The largest end in ``(computed, limit * tpb]`` whose needed pages are all present: a block
    boundary, or ``usable`` (the tokens the engine may take from a connector) where that is lower.

    The pages are those needed at the end the engine will take, not at the block boundary: one
    token less moves a sliding window back, so it may need one more block."""
    for blocks in range(limit, first, -1):
        end = min(blocks * tpb, usable)
        if end <= computed:
            break
        if all(present.get(bg, False) for bg in _needed(rules, first, end)):
            return end
    return computed
