"""``KVCacheManager``: wires spec, tiers, tree, residency and copier, and creates caches."""

from __future__ import annotations

import logging
import os

import torch

from kvtier.cache import KVCache, as_token_array
from kvtier.config import DEFAULT_SCOPE, CacheConfig, DiskTier, ReuseScope
from kvtier.disk_restore import restore_disk_tier
from kvtier.errors import InvariantError
from kvtier.eviction import check_priority
from kvtier.invariants import check_manager
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

    Not thread-safe: one engine thread drives it. ``KVTIER_DEBUG=1`` checks every invariant
    after each cache operation that changes residency (slow; for tests and debugging).
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a kvtier.ModelSpec, got {type(spec).__name__}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a kvtier.CacheConfig, got {type(config).__name__}")
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
        self._snapshot_tokens = config.snapshot_interval_blocks * self.tokens_per_block
        if spec.model_id is None and any(isinstance(t, DiskTier) for t in config.tiers):
            log.warning(
                "kvtier: a DiskTier with ModelSpec.model_id=None: its pages would be served to any model of the "
                "same shape after a restart; set model_id to the checkpoint's name or kvtier.weights_fingerprint(model)"
            )
        self._tiers = build_tiers(spec, config, self._geometries)
        self._tier_names = tuple(t.name for t in self._tiers)
        self._counters = Counters()
        self._tree = RadixTree(len(self.layer_groups), self.tokens_per_block, spec.fingerprint().encode())
        self._residency = Residency(self._tiers, self._tree, self._counters)
        self._mover = Mover(self._tiers, self._residency, self._counters, self.device)
        for tier in self._tiers:
            if tier.is_disk:
                restore_disk_tier(tier, self._tree, self._rules)
        self._caches: set[KVCache] = set()
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._debug = os.environ.get("KVTIER_DEBUG") == "1"
        self._closed = False

    # -- caches ----------------------------------------------------------------------------------

    def create_cache(self, input_tokens, scope: ReuseScope = DEFAULT_SCOPE, priority: int = 35) -> KVCache:
        """A SUSPENDED cache for a request, holding the longest reusable prefix of its input.

        Matching takes ownership of the prefix's pages on whatever tier they are (they can no
        longer be dropped) and needs no memory, so it cannot fail for lack of pages.
        """
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
        root = self._tree.roots.get(scope)
        if root is None:
            return None
        return find_reuse(
            self._tree, root, encode_tokens(tokens), num_tokens, self._rules, self.config.enable_partial_reuse
        )

    def prefetch(self, tokens, scope: ReuseScope = DEFAULT_SCOPE, stream=None) -> int:
        """Start promoting the reusable prefix of ``tokens`` toward the primary tier.

        Pages are moved as room allows (evicting colder pages, never locked or held ones below
        their due); they stay evictable, as recently used. Returns the number of pages promoted.
        """
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
        views = self._views.get(layer_id)
        if views is None:
            group = self.spec.group_of(layer_id)
            buffer = self._tiers[PRIMARY].storage.buffers[group.group_id]
            views = self._views[layer_id] = part_views(self._geometries[group.group_id], buffer, layer_id)
        return views

    def layout(self) -> KvCacheLayout:
        """Where each group's pages live in the primary tier (one whole-slot region per group)."""
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
        return self._geometries[self._rule(group_id).group_id].page_bytes

    # -- stats and checks ------------------------------------------------------------------------

    def stats(self) -> CacheStats:
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
            bytes_copied=dict(c.bytes_copied),
        )

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every internal invariant holds (slow: walks everything)."""
        try:
            check_manager(self)
        except AssertionError as exc:
            if isinstance(exc, InvariantError):
                raise
            raise InvariantError(str(exc)) from exc

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

    def _debug_check(self) -> None:
        """With ``KVTIER_DEBUG=1``, check every invariant (called after residency changes)."""
        if self._debug:
            self.check_invariants()

    def _rule(self, group_id: int) -> GroupRule:
        if isinstance(group_id, bool) or not isinstance(group_id, int) or not 0 <= group_id < len(self._rules):
            raise ValueError(f"unknown layer group id {group_id!r}: the model has groups 0..{len(self._rules) - 1}")
        return self._rules[group_id]

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
