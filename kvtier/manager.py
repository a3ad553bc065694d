"""``KVCacheManager``: the public front of one model's KV cache: caches, views, layout, stats.

The manager checks what it is given, builds the ``PagePool`` the caches stand on, creates the
caches, and answers for the pool: views into its primary tier, its layout, its stats, its
invariant check, and closing it (persisting to a disk tier).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import weakref

import numpy as np
import torch

from kvtier.cache import KVCache
from kvtier.config import (
    DEFAULT_SCOPE,
    CacheConfig,
    DiskTier,
    PrimaryTier,
    ReuseScope,
    check_device_usable,
    check_fits_in_memory,
    concrete_device,
)
from kvtier.errors import CacheStateError
from kvtier.exclusive import exclusive
from kvtier.layout import GroupLayout, KvCacheLayout, Region, page_geometries, part_views
from kvtier.pool import PagePool
from kvtier.process_bound import ProcessBound
from kvtier.reuse.matching import ReuseMatch
from kvtier.reuse.tokens import as_token_array
from kvtier.spec import ModelSpec
from kvtier.stats import CacheStats
from kvtier.storage.disk_dir import DiskDirectory
from kvtier.tiering.eviction import check_priority
from kvtier.tiering.host_prefetch import HostPrefetch
from kvtier.tiering.residency import PRIMARY

log = logging.getLogger(__name__)


class KVCacheManager(ProcessBound):
    """Pages for every layer group of one model, over a primary tier and optional host/disk tiers.

    One thread at a time drives it and its caches (any thread, handed over between calls); a
    call from a second thread while one is inside raises ``CacheStateError`` (``kvtier.exclusive``).
    After ``close`` every method but ``close`` raises ``CacheStateError``; a manager never closed
    is closed when the interpreter exits, so its pages still reach its disk tier. One with a disk
    tier dropped without ``close()`` (collected) is closed too, caches and all, on a thread of its
    own, its pages persisted; a WARNING says so.
    ``KVTIER_DEBUG=1`` checks every invariant after each cache operation that changes residency
    (slow; for tests and debugging).
    """

    remedy = "build a manager in each process (they share pages through a disk tier or a connector)"

    def __init__(self, spec: ModelSpec, config: CacheConfig) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a kvtier.ModelSpec, got {type(spec).__name__}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a kvtier.CacheConfig, got {type(config).__name__}")
        check_device_usable(config.device)  # type: ignore[arg-type]
        # a bare "cuda" is the device current now: the pages and every copy stay on it
        config = dataclasses.replace(config, device=concrete_device(config.device))  # type: ignore[arg-type]
        _check_quotas_fit(config)
        self.spec = spec
        self.config = config
        self.device: torch.device = config.device  # type: ignore[assignment]
        self.tokens_per_block = config.tokens_per_block
        self.layer_groups = list(spec.groups)
        self._geometries = page_geometries(spec, self.tokens_per_block)
        if spec.model_id is None and any(isinstance(t, DiskTier) for t in config.tiers):
            log.warning(
                "kvtier: a DiskTier with ModelSpec.model_id=None: its pages would be served to any model of the "
                "same shape after a restart; set model_id to the checkpoint's name or "
                "kvtier.weights_fingerprint(model), with any rotary settings changed from the checkpoint's"
            )
        self._pool = PagePool(spec, config, self._geometries)
        disk = self._pool.tiers[self._pool.disk_tier] if self._pool.disk_tier is not None else None
        self._dropped: weakref.finalize
        if disk is not None and disk.disk_index is not None:  # dropped without close(): closed all the same
            self._dropped = weakref.finalize(self, _close_dropped, self._pool, disk.disk_index.directory)
        else:  # dropped without close(): its caches dropped unclosed never keep the pool alive in a cycle
            self._dropped = weakref.finalize(self, _orphan, self._pool)
        self._dropped.atexit = False  # at exit ``_close_at_exit`` closes the managers still open
        self._guard = self._pool.guard  # claimed by calls that change the pool (kvtier.exclusive)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._closed = False
        self._closing = False  # ``close`` has begun (it may release the tiers before it ends)
        self._made_by: int | None = None  # in a forked child: the pid of the process that made it
        _OPEN_MANAGERS.add(self)

    # -- caches ----------------------------------------------------------------------------------

    @exclusive
    def create_cache(self, input_tokens, scope: ReuseScope = DEFAULT_SCOPE, priority: int = 35) -> KVCache:
        """A SUSPENDED cache for a request, holding the longest reusable prefix of its input.

        Matching takes ownership of the prefix's pages on whatever tier they are (they can no
        longer be dropped) and needs no memory, so it cannot fail for lack of pages.
        """
        self._check_open()
        tokens = as_token_array(input_tokens)
        priority = check_priority(priority)
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        self._pool.release_let_go()
        cache = KVCache(self._pool, tokens, scope, priority)
        self._pool.counters.lookup_tokens += len(tokens)  # its hits once it commits or closes (HitCount)
        self._pool.debug_check()
        return cache

    @exclusive
    def cached_tokens(self, tokens, scope: ReuseScope = DEFAULT_SCOPE, in_memory: bool = False) -> int:
        """How many leading tokens of ``tokens`` a cache created now would find cached, on any tier,
        before any cut for load cost (``create_cache`` may reuse fewer: ``set_prefill_rate``);
        ``in_memory``: only those before the first block with a page on the disk tier (loading them
        reads nothing from disk). Holds no page and counts no lookup or hit; like any match, it
        first lands the prefetches from disk whose reads are over (``prefetch_to_host``)."""
        if not isinstance(in_memory, bool | np.bool_):
            raise TypeError(f"in_memory must be a bool, got {in_memory!r}")
        match = self._match(tokens, scope, weigh_load_cost=False, count_recomputed=False)
        if match is None:
            return 0
        return self._pool.tokens_in_memory(match) if in_memory else match.tokens

    @exclusive
    def prefetch(self, tokens, scope: ReuseScope = DEFAULT_SCOPE, stream=None) -> int:
        """Start promoting the reusable prefix of ``tokens`` toward the primary tier.

        Pages are moved as room allows (evicting colder pages, never locked or held ones below
        their due); they stay evictable, as recently used. Returns the number of pages promoted.
        """
        match = self._match(tokens, scope, count_recomputed=False)
        if match is None:
            return 0
        moved = self._pool.prefetch(match, stream)
        self._pool.debug_check()
        return moved

    @exclusive
    def prefetch_to_host(self, tokens, scope: ReuseScope = DEFAULT_SCOPE, hold: bool = False) -> HostPrefetch | None:
        """Start reading the cached prefix of ``tokens`` from the disk tier into host memory on a
        background thread (for a request that waits in a queue: its disk hit then costs a host hit).

        Host memory is the host tier, or the primary tier of a manager on the CPU without one. Room
        is made there now, as for a promotion (its coldest pages go to disk). Returns a handle with
        ``done()``, ``wait(timeout)``, ``cancel()`` and ``num_pages``, or None when there is nothing
        to read (no disk tier or no host memory above it, no match, nothing of it on disk). Pages
        read are moved into host memory by the manager's next call (``maintain``,
        ``create_cache``); those not read by a cancel stay on disk. ``close`` cancels what is still
        running. The whole cached prefix is read, however slow the disk: the request waits anyway
        (``create_cache`` weighs loads against recomputing; pass fewer tokens to read less).

        ``hold=True`` keeps the pages read where they landed (host memory: neither demoted nor
        dropped; a resume may still promote them) until the handle is cancelled, for a request that
        waits its turn: cancel it once the request's cache is resumed, or when it is given up, else
        they stay pinned for the manager's life. They are let go at the manager's next call that
        lands reads or makes room (``create_cache``, ``resume``, ``resize``, ``maintain``).
        """
        self._check_open()
        if not isinstance(hold, bool | np.bool_):
            raise TypeError(f"hold must be a bool, got {hold!r}")
        match = self._match(tokens, scope, weigh_load_cost=False)
        if match is None:
            return None
        job = self._pool.prefetch_to_host(match, bool(hold))
        self._pool.debug_check()
        return job

    def _match(
        self, tokens, scope: ReuseScope, weigh_load_cost: bool = True, count_recomputed: bool = True
    ) -> ReuseMatch | None:
        """The reusable prefix of ``tokens`` in ``scope`` (checked first: open manager, tokens, scope)."""
        self._check_open()
        token_array = as_token_array(tokens)
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        return self._pool.match(token_array, scope, weigh_load_cost=weigh_load_cost, count_recomputed=count_recomputed)

    @exclusive
    def maintain(self) -> int:
        """Background work, to call between steps: keep the primary tier's free reserve
        (``PrimaryTier.free_reserve``) and copy published pages to host memory (``HostTier.write_through``).

        Copies are queued on a low-priority stream and this returns at once; a new batch starts only
        when the previous one has finished. Later copies and allocations are ordered after it. It
        also lands the prefetches from disk whose reads are over (``prefetch_to_host``) and starts
        the disk tier's next write-behind batch. Returns the number of pages the reserve and the
        write-through planned (0 with neither on; the other work is not counted).
        """
        self._check_open()
        planned = self._pool.maintain()
        self._pool.debug_check()
        return planned

    @exclusive
    def forget_scope(self, scope: ReuseScope) -> int:
        """Drop every block published under ``scope``, in every tier, when its pages can never be
        right again (the weights they were computed with were replaced in place).

        Pages only the tree holds are freed now (a disk tier's rows go too); pages an open cache
        holds stay with it and are freed when it lets go, and such a cache publishes nothing more
        (what it computes was started with the old weights). Later requests of ``scope`` start
        from nothing. Returns the number of pages freed now.
        """
        self._check_open()
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        for cache in list(self._pool.holders):
            if isinstance(cache, KVCache) and cache.scope == scope:
                cache._stop_publishing()
        dropped = self._pool.forget_scope(scope)
        self._pool.debug_check()
        return dropped

    @exclusive
    def set_prefill_rate(self, tokens_per_second: float) -> None:
        """Tell the manager how fast the engine computes prompt tokens (measured, tokens/s).

        From then on, ``create_cache`` reuses a cached block only where loading it from its tier
        (at the bandwidth measured on this manager's own copies) is estimated faster than
        recomputing it; the tokens left to recompute are counted in ``stats().recomputed_tokens``
        and the decision is logged at DEBUG. ``TypeError`` for a rate that is not a number,
        ``ValueError`` for one that is not finite and > 0.
        """
        self._check_open()
        self._pool.set_prefill_rate(tokens_per_second)

    @property
    def remembered_prefill_rate(self) -> float | None:
        """The prefill rate (tokens/s) last told to a manager on this disk tier's directory and kind of
        device, as its index kept it; None without a disk tier or such a rate. Not used by itself:
        an engine that trusts it passes it to ``set_prefill_rate`` until it measured its own."""
        self._check_open()
        return self._pool.load_cost.remembered_prefill_rate

    # -- views -----------------------------------------------------------------------------------

    def kv_views(self, layer_id: int) -> dict[str, torch.Tensor]:
        """Strided views of one layer's roles into its group's primary buffer.

        Attention: ``{role: [num_slots, tokens_per_block, heads, dim]}`` of the model dtype;
        recurrent: ``{"state": uint8 [num_slots, state_bytes]}``. Index the first dimension with
        ``cache.page_indices(group_id)``.
        """
        self._check_open()
        if isinstance(layer_id, np.integer):  # an id read from an array
            layer_id = int(layer_id)
        views = self._views.get(layer_id) if type(layer_id) is int else None  # (not True: layer 1's views)
        if views is None:
            group = self.spec.group_of(layer_id)  # ValueError for what is not a layer id
            try:
                buffer = self._pool.tiers[PRIMARY].storage.buffers[group.group_id]
            except IndexError:  # ``close`` on another thread released them since the check
                self._check_open(closing=True)
                raise
            with torch.inference_mode(False):  # kept: later calls write through them, inside inference mode or not
                views = self._views[layer_id] = part_views(self._geometries[group.group_id], buffer, layer_id)
        return views

    def layout(self) -> KvCacheLayout:
        """Where each group's pages live in the primary tier (one whole-slot region per group)."""
        self._check_open()
        storage = self._pool.tiers[PRIMARY].storage
        groups = []
        for geometry in self._geometries:
            g = geometry.group_id
            try:
                buffer, num_slots = storage.buffers[g], storage.slots[g].num_slots
            except IndexError:  # ``close`` on another thread released them since the check
                self._check_open(closing=True)
                raise
            region = Region(buffer.data_ptr(), geometry.page_bytes, geometry.page_bytes, num_slots, buffer)
            group = geometry.group
            groups.append(GroupLayout(g, group.layer_ids, group.window, [region], group.kind, group.sink_tokens))
        return KvCacheLayout(self.tokens_per_block, groups, self.spec.fingerprint())

    def page_bytes(self, group_id: int) -> int:
        """Bytes of one page of a layer group."""
        self._check_open()
        return self._geometries[self._pool.rule(group_id).group_id].page_bytes

    # -- stats and checks ------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """The tiers' occupancy and the counters since construction (any thread may read them)."""
        self._check_open()
        return self._pool.stats()

    @exclusive
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every internal invariant holds (slow: walks everything)."""
        self._check_open()
        self._pool.check()

    @exclusive
    def close(self, persist: bool = True) -> None:
        """Close every cache and release the tiers' memory and files. Idempotent.

        With a disk tier and ``persist``, published pages still in memory are first written to
        the disk's free slots (parents first), so a later manager on the same path finds them.
        In a forked child, a manager its parent made counts as closed there: nothing is done.
        """
        if self._closed:
            return
        self._closing = True
        self._dropped.detach()
        _close_pool(self._pool, persist)
        self._closed = True
        self._views.clear()
        _OPEN_MANAGERS.discard(self)

    def _check_open(self, closing: bool = False) -> None:
        """``CacheStateError`` once closed (``closing``: or while ``close`` runs, for a read that
        another thread's ``close`` got ahead of)."""
        if self._closed or (closing and self._closing):
            if self._made_by is not None:
                raise CacheStateError(_inherited_message(self._made_by))
            raise CacheStateError("the KVCacheManager is closed")

    def __enter__(self) -> KVCacheManager:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_quotas_fit(config: CacheConfig) -> None:
    """``ValueError`` for a memory tier larger than all the memory it would live in (it can never be had)."""
    for tier in config.tiers:
        if not isinstance(tier, DiskTier):
            device = config.device if isinstance(tier, PrimaryTier) else torch.device("cpu")
            what = f"{type(tier).__name__}({tier.bytes})"
            check_fits_in_memory(what, tier.bytes, device, "configure a smaller quota")  # type: ignore[arg-type]


def _close_pool(pool: PagePool, persist: bool) -> None:
    """Close a manager's caches, persist its published pages in memory (``persist``), release its pool."""
    pool.release_let_go()
    for cache in list(pool.holders):
        cache.close()
    if persist:
        pool.persist()
    pool.close()


def _orphan(pool: PagePool) -> None:
    """The finalizer of a manager without a disk tier dropped without ``close()``: nothing is left to
    persist; caches dropped unclosed, now or later, no longer queue themselves in the pool (which
    they would keep alive in a reference cycle with its memory)."""
    pool.orphaned = True
    pool.dropped.clear()


def _close_dropped(pool: PagePool, directory: DiskDirectory) -> None:
    """The finalizer of a manager with a disk tier dropped without ``close()``: its pool is closed as
    ``close()`` would, persisting its pages, so that they still reach the disk.

    Never inside the garbage collector, which may run in the middle of any call, the collected
    manager's own caches' included: on a thread of its own, once no call on one of its caches is
    running (the pool's guard). Meanwhile a new manager of this process on the directory waits for
    it (``DiskDirectory.abandon``)."""
    directory.abandon()
    try:
        threading.Thread(target=_close_dropped_now, args=(pool, directory), name="kvtier-close-dropped").start()
    except RuntimeError:  # no new thread at interpreter shutdown: nothing else runs any more
        _close_dropped_now(pool, directory)


def _close_dropped_now(pool: PagePool, directory: DiskDirectory) -> None:
    with pool.guard:
        try:
            _close_pool(pool, persist=True)
        except Exception:
            log.exception("kvtier: closing a KVCacheManager dropped without close() failed")
            return
    log.warning(
        "kvtier: a KVCacheManager was dropped without close(); it has been closed on a thread of its own and "
        "its published pages written to its disk tier %s. Call close() (or use it in a with block) to release "
        "its memory and files when you choose",
        directory.path,
    )


# Managers not closed yet, weakly: the registry never keeps a dropped manager alive.
_OPEN_MANAGERS: weakref.WeakSet[KVCacheManager] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Close every manager still open at interpreter exit, so published pages reach its disk tier.

    Runs after the interpreter has joined its non-daemon threads. Bounded: ``close`` never waits
    on another thread (a manager still inside a daemon thread's call is refused and skipped).
    """
    for mgr in list(_OPEN_MANAGERS):
        try:
            mgr.close()
        except Exception:
            log.exception("kvtier: closing a KVCacheManager at interpreter exit failed")


atexit.register(_close_at_exit)


def _inherited_message(pid: int) -> str:
    return (
        f"this KVCacheManager was made by process {pid}, of which this process is a forked child: its tiers' "
        "memory, disk files and threads are that process's. Build a manager (or a PrefixCache, an LLMEngine) "
        "in the child"
    )


class _Inherited:
    """The guard of the caches of a manager a forked child inherited: their calls that would change
    the pool are refused (``kvtier.exclusive`` claims the guard first, and never releases a guard
    it did not acquire). The disk tier's threads do not exist in the child (a read waited for them
    forever), and its files and index are the parent's, who holds their lock (a child's writes
    damaged the parent's pages)."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def acquire(self, blocking: bool = True) -> bool:
        raise CacheStateError(_inherited_message(self.pid))


def _disown_after_fork() -> None:
    """In a forked child: the managers open in the parent stay the parent's. There they count as
    closed (their calls raise ``CacheStateError`` naming the fork, ``close`` does nothing), their
    caches' calls that change the pool are refused, and neither the child's exit nor its collection
    of them closes them (which would write the child's pages into the parent's files)."""
    parent = os.getppid()
    for mgr in list(_OPEN_MANAGERS):
        mgr._made_by = parent
        mgr._closed = True
        mgr._dropped.detach()
        refused = _Inherited(parent)
        for holder in list(mgr._pool.holders):
            if hasattr(holder, "_guard"):
                holder._guard = refused
    _OPEN_MANAGERS.clear()


os.register_at_fork(after_in_child=_disown_after_fork)
