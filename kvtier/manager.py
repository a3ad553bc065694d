"""``KVCacheManager``: wires spec, tiers, tree, residency and copier, and creates caches."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref

import torch

from kvtier.cache import KVCache, as_token_array
from kvtier.config import DEFAULT_SCOPE, CacheConfig, DiskTier, PrimaryTier, ReuseScope
from kvtier.disk_restore import restore_disk_tier
from kvtier.errors import CacheStateError, InvariantError, OutOfPagesError
from kvtier.eviction import check_priority
from kvtier.exclusive import exclusive
from kvtier.invariants import check_manager
from kvtier.knobs import debug_enabled
from kvtier.layout import GroupLayout, KvCacheLayout, Region, page_geometries, part_views
from kvtier.mover import Mover
from kvtier.pages import Page
from kvtier.residency import PRIMARY, MovePlan, Residency
from kvtier.reuse import GroupRule, ReuseMatch, find_reuse, snapshot_at
from kvtier.spec import GroupKind, ModelSpec
from kvtier.stats import CacheStats, Counters, TierStats
from kvtier.tier_factory import build_tiers
from kvtier.tree import RadixTree, encode_tokens

log = logging.getLogger(__name__)


class KVCacheManager:
    """Pages for every layer group of one model, over a primary tier and optional host/disk tiers.

    One thread at a time drives it and its caches (any thread, handed over between calls); a
    call from a second thread while one is inside raises ``CacheStateError`` (``kvtier.exclusive``).
    After ``close`` every method but ``close`` raises ``CacheStateError``; a manager never closed
    is closed when the interpreter exits, so its pages still reach its disk tier.
    ``KVTIER_DEBUG=1`` checks every invariant after each cache operation that changes residency
    (slow; for tests and debugging).
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a kvtier.ModelSpec, got {type(spec).__name__}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a kvtier.CacheConfig, got {type(config).__name__}")
        _check_device(config.device)  # type: ignore[arg-type]
        _check_quotas_fit(config)
        self.spec = spec
        self.config = config
        self.device: torch.device = config.device  # type: ignore[assignment]
        self.tokens_per_block = config.tokens_per_block
        self.layer_groups = list(spec.groups)
        self._geometries = page_geometries(spec, self.tokens_per_block)
        self._rules = [GroupRule.of(g, self.tokens_per_block) for g in self.layer_groups]
        self._attention_rules = [r for r in self._rules if r.kind is not GroupKind.RECURRENT]
        self._window_rules = [r for r in self._rules if r.kind is GroupKind.SLIDING_WINDOW]
        self._recurrent_group = next((r.group_id for r in self._rules if r.kind is GroupKind.RECURRENT), None)
        self._attention_only = self._recurrent_group is None and not self._window_rules  # a commit's fast path
        self._snapshot_tokens = config.snapshot_interval_blocks * self.tokens_per_block
        if spec.model_id is None and any(isinstance(t, DiskTier) for t in config.tiers):
            log.warning(
                "kvtier: a DiskTier with ModelSpec.model_id=None: its pages would be served to any model of the "
                "same shape after a restart; set model_id to the checkpoint's name or kvtier.weights_fingerprint(model)"
            )
        try:
            self._tiers = build_tiers(spec, config, self._geometries)
        except (MemoryError, RuntimeError) as exc:
            if not _is_allocation_failure(exc):
                raise
            raise OutOfPagesError(
                f"cannot allocate the tiers' memory ({exc or 'out of memory'}): free memory or configure smaller quotas"
            ) from exc
        self._tier_names = tuple(t.name for t in self._tiers)
        self._counters = Counters()
        self._tree = RadixTree(len(self.layer_groups), self.tokens_per_block, spec.fingerprint().encode())
        self._residency = Residency(self._tiers, self._tree, self._counters)
        self._mover = Mover(self._tiers, self._residency, self._counters, self.device)
        for tier in self._tiers:
            if tier.is_disk:
                restore_disk_tier(tier, self._tree, self._rules, self._counters)
        self._caches: set[KVCache] = set()
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._debug = debug_enabled()
        self._guard = threading.RLock()  # claimed by calls that change shared state (kvtier.exclusive)
        self._closed = False
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
        check_priority(priority)
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        cache = KVCache(self, tokens, scope, priority)
        self._counters.lookup_tokens += len(tokens)
        match = self._match(tokens, scope)
        if match is not None:
            cache._adopt(match, tokens)
            for tier, n in cache.reused_by_tier.items():
                self._counters.hit_tokens[tier] += n
        self._caches.add(cache)
        self._debug_check()
        return cache

    def _match(self, tokens, scope: ReuseScope, whole: bool = False) -> ReuseMatch | None:
        """The reusable prefix of ``tokens``: up to ``len - 1`` tokens, or all of them if ``whole``."""
        num_tokens = len(tokens) + 1 if whole else len(tokens)
        if not self.config.enable_reuse or num_tokens < 2:
            return None
        root = self._tree.find_root(scope)
        if root is None:
            return None
        return find_reuse(
            self._tree, root, encode_tokens(tokens), num_tokens, self._rules, self.config.enable_partial_reuse
        )

    @exclusive
    def prefetch(self, tokens, scope: ReuseScope = DEFAULT_SCOPE, stream=None) -> int:
        """Start promoting the reusable prefix of ``tokens`` toward the primary tier.

        Pages are moved as room allows (evicting colder pages, never locked or held ones below
        their due); they stay evictable, as recently used. Returns the number of pages promoted.
        """
        self._check_open()
        token_array = as_token_array(tokens)
        if not isinstance(scope, ReuseScope):
            raise TypeError(f"scope must be a kvtier.ReuseScope, got {type(scope).__name__}")
        match = self._match(token_array, scope)
        if match is None:
            return 0
        pages = self._match_pages(match)
        res = self._residency
        for page in pages:
            res.lock(page)  # pinned: making room for one page of the prefix never evicts another
        plan = MovePlan()
        moved = 0
        for page in pages:
            if page.tier == PRIMARY:
                continue
            if not res.make_room(PRIMARY, page.group, 1, plan):
                break
            res.move(page, PRIMARY, plan)
            self._counters.promotions += 1
            moved += 1
        self._mover.run(plan, stream)
        for page in reversed(pages):
            res.unlock(page)
        self._debug_check()
        return moved

    def _match_pages(self, match: ReuseMatch) -> list[Page]:
        """Every page a cache created for ``match`` would use (deduplicated, in block order)."""
        pages: dict[int, Page] = {}
        tpb = self.tokens_per_block
        for rule in self._rules:
            g = rule.group_id
            if rule.kind is GroupKind.RECURRENT:
                page = snapshot_at(match, tpb)
                pages[id(page)] = page
                continue
            live_from = rule.first_live_block(match.tokens, tpb)
            for b, node in enumerate(match.full_nodes):
                page = node.pages[g]
                if page is not None and (b < rule.sink_blocks or b >= live_from):
                    pages[id(page)] = page
            if match.partial is not None and match.partial.pages[g] is not None:
                page = match.partial.pages[g]
                pages[id(page)] = page
        return list(pages.values())

    # -- views -----------------------------------------------------------------------------------

    def kv_views(self, layer_id: int) -> dict[str, torch.Tensor]:
        """Strided views of one layer's roles into its group's primary buffer.

        Attention: ``{role: [num_slots, tokens_per_block, heads, dim]}`` of the model dtype;
        recurrent: ``{"state": uint8 [num_slots, state_bytes]}``. Index the first dimension with
        ``cache.page_indices(group_id)``.
        """
        self._check_open()
        views = self._views.get(layer_id)
        if views is None:
            group = self.spec.group_of(layer_id)
            buffer = self._tiers[PRIMARY].storage.buffers[group.group_id]
            views = self._views[layer_id] = part_views(self._geometries[group.group_id], buffer, layer_id)
        return views

    def layout(self) -> KvCacheLayout:
        """Where each group's pages live in the primary tier (one whole-slot region per group)."""
        self._check_open()
        storage = self._tiers[PRIMARY].storage
        groups = []
        for geometry in self._geometries:
            g = geometry.group_id
            buffer = storage.buffers[g]
            region = Region(
                buffer.data_ptr(), geometry.page_bytes, geometry.page_bytes, storage.slots[g].num_slots, buffer
            )
            group = geometry.group
            groups.append(GroupLayout(g, group.layer_ids, group.window, [region], group.kind, group.sink_tokens))
        return KvCacheLayout(self.tokens_per_block, groups, self.spec.fingerprint())

    def page_bytes(self, group_id: int) -> int:
        """Bytes of one page of a layer group."""
        self._check_open()
        return self._geometries[self._rule(group_id).group_id].page_bytes

    # -- stats and checks ------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """The tiers' occupancy and the counters since construction (any thread may read them)."""
        self._check_open()
        c = self._counters
        tiers = {}
        for tier in self._tiers:
            storage = tier.storage
            total = sum(s.num_slots for s in storage.slots)
            used = sum(s.num_used for s in storage.slots)
            bytes_total = sum(s.num_slots * p for s, p in zip(storage.slots, storage.page_bytes, strict=True))
            bytes_used = sum(s.num_used * p for s, p in zip(storage.slots, storage.page_bytes, strict=True))
            tiers[tier.name] = TierStats(total, used, bytes_total, bytes_used)
        return CacheStats(
            tiers=tiers,
            hit_tokens={name: c.hit_tokens[name] for name in self._tier_names},
            lookup_tokens=c.lookup_tokens,
            evictions=c.evictions,
            demotions=c.demotions,
            promotions=c.promotions,
            drops=c.drops,
            checksum_failures=c.checksum_failures,
            disk_resets=c.disk_resets,
            bytes_copied=dict(c.bytes_copied),
        )

    @exclusive
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every internal invariant holds (slow: walks everything)."""
        self._check_open()
        try:
            check_manager(self)
        except AssertionError as exc:
            if isinstance(exc, InvariantError):
                raise
            raise InvariantError(str(exc)) from exc

    @exclusive
    def close(self, persist: bool = True) -> None:
        """Close every cache and release the tiers' memory and files. Idempotent.

        With a disk tier and ``persist``, published pages still in memory are first written to
        the disk's free slots (parents first), so a later manager on the same path finds them.
        """
        if self._closed:
            return
        for cache in list(self._caches):
            cache.close()
        if persist:
            plan = MovePlan()
            self._residency.persist(plan)
            self._mover.run(plan)
        self._closed = True
        self._mover.synchronize()
        self._mover.close()
        for tier in self._tiers:
            tier.storage.close()
            if tier.disk_index is not None:
                tier.disk_index.close()
        self._views.clear()
        _OPEN_MANAGERS.discard(self)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("the KVCacheManager is closed")

    def _debug_check(self) -> None:
        """With ``KVTIER_DEBUG=1``, check every invariant (called after residency changes)."""
        if self._debug:
            self.check_invariants()

    def _rule(self, group_id: int) -> GroupRule:
        if isinstance(group_id, bool) or not isinstance(group_id, int) or not 0 <= group_id < len(self._rules):
            raise ValueError(f"unknown layer group id {group_id!r}: the model has groups 0..{len(self._rules) - 1}")
        return self._rules[group_id]

    def __enter__(self) -> KVCacheManager:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_device(device: torch.device) -> None:
    """A clear error, before any allocation, for a CUDA device this process cannot use."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'}, sees no GPU): use device='cpu' or a CUDA machine"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r} but this process sees {torch.cuda.device_count()} GPU(s)")


def _check_quotas_fit(config: CacheConfig) -> None:
    """``ValueError`` for a memory tier larger than all the memory it would live in (it can never be had)."""
    device: torch.device = config.device  # type: ignore[assignment]
    for tier in config.tiers:
        if isinstance(tier, DiskTier):
            continue
        if isinstance(tier, PrimaryTier) and device.type == "cuda":
            where, have = str(device), torch.cuda.get_device_properties(device).total_memory
        else:
            where, have = "host memory", _host_memory_bytes()
        if have is not None and tier.bytes > have:
            raise ValueError(
                f"{type(tier).__name__}({tier.bytes}) cannot be allocated: it is more than all of {where} "
                f"({have / 2**30:.1f} GiB); configure a smaller quota"
            )


def _is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says memory could not be had (torch's CPU allocator raises a plain RuntimeError)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text


def _host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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
