"""``PagePool``: the pages under every cache of one manager, and the one place plans are applied.

The pool owns the tiers, the reuse tree, the residency record (who holds which page), the
planner (what to move), the mover (the copies), the layer groups' rules and the counters.
Caches (``kvtier.cache``) and the manager (``kvtier.manager``) both stand on it. Every
operation that moves pages fills a ``MovePlan`` through the planner and hands it to ``apply``:
the mover copies the data, ordered before later work on the caller's stream, then the planner
finishes the bookkeeping. A plan whose planning or copies raise is abandoned (``_moving``): the
pages it was to write are never served.

``guard`` is the lock that ``kvtier.exclusive`` claims (one thread at a time changes the pool);
``holders`` are the open caches, which the invariant check counts (held weakly: a cache dropped
without ``close`` queues itself in ``dropped`` and is closed at the pool's next ``release_let_go``,
which runs only inside claimed calls, never in the middle of another operation).
"""

from __future__ import annotations

import logging
import threading
import weakref
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvtier.config import TIER_NAMES, CacheConfig, DiskTier, HostTier, ReuseScope, write_behind_enabled
from kvtier.errors import InvariantError, OutOfPagesError
from kvtier.invariants import PageHolder, check_pages
from kvtier.knobs import debug_enabled
from kvtier.layout import PageGeometry
from kvtier.lifecycle import GroupRule
from kvtier.pages import Page
from kvtier.reuse.matching import ReuseMatch, find_reuse
from kvtier.reuse.reuse_points import reuse_points
from kvtier.reuse.tokens import encode_tokens
from kvtier.reuse.tree import RadixTree
from kvtier.spec import GroupId, GroupKind, ModelSpec
from kvtier.stats import CacheStats, Counters, TierStats
from kvtier.tiering.background import BackgroundWork
from kvtier.tiering.build import build_tiers
from kvtier.tiering.disk_restore import restore_disk_tier
from kvtier.tiering.disk_speed import sample_disk_speed
from kvtier.tiering.disk_write_behind import DiskWriteBehind
from kvtier.tiering.disk_writes import DiskWritePlanner
from kvtier.tiering.host_prefetch import HostPrefetch, HostPrefetcher
from kvtier.tiering.load_cost import LoadCost
from kvtier.tiering.mover import Mover
from kvtier.tiering.plan import MovePlan
from kvtier.tiering.planner import MovePlanner
from kvtier.tiering.residency import PRIMARY, Residency

log = logging.getLogger(__name__)


class PagePool:
    """Pages for every layer group of one model over its tiers, with the tree of reusable blocks."""

    def __init__(self, spec: ModelSpec, config: CacheConfig, geometries: Sequence[PageGeometry]) -> None:
        tpb = config.tokens_per_block
        self.config = config
        self.tokens_per_block = tpb
        self.rules = [GroupRule.of(g, tpb) for g in spec.groups]
        self.attention_rules = [r for r in self.rules if r.kind is not GroupKind.RECURRENT]
        self.window_rules = [r for r in self.rules if r.kind is GroupKind.SLIDING_WINDOW]
        self.recurrent_group = next((r.group_id for r in self.rules if r.kind is GroupKind.RECURRENT), None)
        self.attention_only = self.recurrent_group is None and not self.window_rules  # a commit's fast path
        self.full_attention = any(r.kind is GroupKind.ATTENTION for r in self.rules)  # every block has a page
        self.snapshot_tokens = config.snapshot_interval_blocks * tpb
        try:
            with torch.inference_mode(False):  # the tiers' buffers are written in place by any later call
                self.tiers = build_tiers(spec, config, geometries)
        except (MemoryError, RuntimeError) as exc:
            if not _is_allocation_failure(exc):
                raise
            why = str(exc) or "out of memory"
            raise OutOfPagesError(
                f"cannot allocate the tiers' memory ({why}): free memory or configure smaller quotas"
            ) from exc
        self.tier_names = tuple(t.name for t in self.tiers)
        self.counters = Counters()
        self.tree = RadixTree(len(self.rules), tpb, spec.fingerprint().encode())
        # the tree's records are not scanned by the cyclic collector: their cycles go with the pool
        # (not at exit, where the managers still open persist their trees first)
        weakref.finalize(self, self.tree.dismantle).atexit = False
        self.residency = Residency(self.tiers, self.tree, self.counters)
        disk = next((t for t in self.tiers if t.is_disk), None)
        remembered = None if disk is None or disk.disk_index is None else (disk.index, disk.disk_index)
        self.load_cost = LoadCost(len(self.tiers), remembered, torch.device(config.device).type)
        self.mover = Mover(self.tiers, self.counters, torch.device(config.device), self.load_cost)
        self.disk_tier = None if disk is None else disk.index
        disk_config = next((t for t in config.tiers if isinstance(t, DiskTier)), None)
        disk_writes = None
        if disk is not None and disk_config is not None:
            disk_writes = DiskWritePlanner(self.residency, disk, self.mover, disk_config.blocking_writes)
        self.planner = MovePlanner(self.tiers, self.residency, self.counters, disk_writes, self.mover.scratch)
        host_config = next((t for t in config.tiers if isinstance(t, HostTier)), None)
        self.background = BackgroundWork(
            self.tiers,
            self.planner,
            next((t for t in self.tiers if t.keeps_copies and not t.is_disk), None),
            config.tiers[PRIMARY].free_reserve,
            0 if host_config is None else host_config.write_through_min_priority,
            0 if host_config is None else host_config.write_through_min_hits,
        )
        self.residency.count_hits = self.background.host is not None and self.background.min_hits > 0
        if self.background.host is None and host_config is not None:
            _warn_unused_write_through_policy(host_config)
        if config.tiers[PRIMARY].free_reserve and not any(t.writable for t in self.tiers[PRIMARY + 1 :]):
            log.warning(
                "kvtier: PrimaryTier(free_reserve=%s) has no effect: no tier below takes demoted pages, so "
                "keeping slots free would only drop cached ones (add a HostTier or a DiskTier)",
                config.tiers[PRIMARY].free_reserve,
            )
        host_memory = next((t for t in self.tiers if t.index != PRIMARY and not t.is_disk), None)
        if host_memory is None and torch.device(config.device).type == "cpu":
            host_memory = self.tiers[PRIMARY]  # a CPU manager's primary tier is host memory
        self.prefetcher = None
        if disk is not None and host_memory is not None:
            self.prefetcher = HostPrefetcher(disk, host_memory, self.residency, self.counters, self.load_cost)
        self.write_behind = (
            DiskWriteBehind(host_memory, disk, self.residency, self.counters, self.mover.waiter)
            if disk is not None and host_memory is not None and write_behind_enabled(config)
            else None
        )
        if disk is not None:
            restore_disk_tier(disk, self.tree, self.rules, self.counters)
            sample_disk_speed(disk, self.load_cost)  # its speed is weighed from the first disk hit on
        self.holders: weakref.WeakSet[PageHolder] = weakref.WeakSet()  # a cache dropped unclosed leaves
        self.dropped: list[PageHolder] = []  # open caches dropped without close: released at ``release_let_go``
        self.orphaned = False  # its manager was dropped without close and nothing is left to persist
        self.guard = threading.RLock()
        self.debug = debug_enabled()
        self._warned_dropped = False

    # -- rules and reuse ---------------------------------------------------------------------------

    def rule(self, group_id: int) -> GroupRule:
        """The rule of a layer group; ``ValueError`` for an unknown group id."""
        if isinstance(group_id, np.integer):  # an id read from an array
            group_id = int(group_id)
        if isinstance(group_id, bool) or not isinstance(group_id, int) or not 0 <= group_id < len(self.rules):
            raise ValueError(f"unknown layer group id {group_id!r}: the model has groups 0..{len(self.rules) - 1}")
        return self.rules[group_id]

    def match(
        self,
        tokens: array,
        scope: ReuseScope,
        whole: bool = False,
        weigh_load_cost: bool = True,
        count_recomputed: bool = True,
    ) -> ReuseMatch | None:
        """The reusable prefix of ``tokens``: up to ``len - 1`` tokens, or all of them if ``whole``;
        cut where loading is slower than recomputing (``set_prefill_rate``) if ``weigh_load_cost``,
        the tokens cut counted in ``recomputed_tokens`` if ``count_recomputed`` (a cache will
        recompute them; a prefetch only moves less)."""
        num_tokens = len(tokens) + 1 if whole else len(tokens)
        if not self.config.enable_reuse or num_tokens < 2:
            return None
        root = self.tree.find_root(scope)
        if root is None:
            return None
        if self.prefetcher is not None and self.prefetcher.busy:
            self.prefetcher.poll()  # prefetches read by now are matched on the host tier
        token_bytes = encode_tokens(tokens)
        partial = self.config.enable_partial_reuse
        match = find_reuse(self.tree, root, token_bytes, num_tokens, self.rules, partial)
        if match is None or self.load_cost.prefill_rate is None or not weigh_load_cost:
            return match
        self.mover.measure()
        cost = self.load_cost
        points = reuse_points(match, self.rules, self.tiers[PRIMARY].storage.page_bytes, len(self.tiers))
        seconds = cost.point_seconds(points.tier_bytes)
        best = cost.best_point(points.tokens, seconds, len(tokens))
        point = cost.with_probe(best, points.tier_bytes)
        if point > best:
            log.debug(
                "loading %d cached tokens past the cut at %d: a tier's speed is measured again",
                points.tokens[point] - points.tokens[best],
                points.tokens[best],
            )
        reused = points.tokens[point]
        if reused == match.tokens:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("loading all %d cached tokens: no cut is faster (%s)", reused, self._cost_inputs())
            return match
        skipped = match.tokens - reused
        if count_recomputed:
            self.counters.recomputed_tokens += skipped
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "recomputing %d cached tokens of %d: loading more than %d is slower (%s)",
                skipped,
                match.tokens,
                reused,
                self._cost_inputs(),
            )
        if reused == 0:
            return None
        return find_reuse(self.tree, root, token_bytes, reused + 1, self.rules, partial)

    def tokens_in_memory(self, match: ReuseMatch) -> int:
        """Of a match's tokens, those before the first block with a page (or, at the match's end, a
        state snapshot) on the disk tier; a stale page there counts too (a cautious answer)."""
        disk = self.disk_tier
        if disk is None:
            return match.tokens
        nodes = match.full_nodes if match.partial is None else [*match.full_nodes, match.partial]
        for block, node in enumerate(nodes):
            if any(page is not None and page.tier == disk for page in node.pages):
                return block * self.tree.tokens_per_block
        if nodes and any(page.tier == disk for page in nodes[-1].snapshots.values()):
            return (len(nodes) - 1) * self.tree.tokens_per_block
        return match.tokens

    def set_prefill_rate(self, tokens_per_second: float) -> None:
        """The engine's measured prefill rate: from now on, cached blocks that would load slower than
        they recompute are recomputed (``kvtier.tiering.load_cost``)."""
        self.load_cost.set_prefill_rate(tokens_per_second)

    # -- moving pages ------------------------------------------------------------------------------

    def apply(
        self, plan: MovePlan, stream: torch.cuda.Stream | None = None, background: bool = False, shared: bool = False
    ) -> int:
        """Run the plan's copies (ordered before later work on ``stream``; ``shared``: after the work
        of active caches that may share its pages, ``Mover.run``), then finish its bookkeeping.

        Returns how many pages failed their checksum on the way (they are marked damaged).
        """
        damaged = self.mover.run(plan, stream, background, shared)
        self.planner.finish(plan)
        return damaged

    @contextmanager
    def _moving(self) -> Iterator[MovePlan]:
        """A new plan, for the body to fill and ``apply``. When the body raises (an interrupt, a
        failing copy or disk write) the plan is abandoned: the pages it was to write are lost,
        never served (``MovePlanner.abandon``), and the exception goes on."""
        plan = MovePlan()
        try:
            yield plan
        except BaseException:
            if plan.edges or plan.landed or plan.kept_copies or plan.deferred_frees:
                log.warning("kvtier: page moves cut short by an exception; the pages they were writing are dropped")
            self.planner.abandon(plan)
            raise

    def primary_slots(self, group: int) -> int:
        """Slots of a layer group in the primary tier: more pages than this can never be locked at once."""
        return self.tiers[PRIMARY].storage.slots[group].num_slots

    def caller_stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
        """The stream a caller works on: ``stream``, else the current one (None without CUDA)."""
        return self.mover.caller_stream(stream)

    def cache_active(self, stream: torch.cuda.Stream | None) -> None:
        """A cache was resumed on ``stream``, where it writes its pages (``Mover.attach``)."""
        self.mover.attach(stream)

    def cache_let_go(self, stream: torch.cuda.Stream | None) -> None:
        """A cache active on ``stream`` suspended or closed (``Mover.detach``)."""
        self.mover.detach(stream)

    def reserve(self, need: dict[int, int], stream: torch.cuda.Stream | None = None) -> bool:
        """Make room in the primary tier for ``need[g]`` new pages of each group (evictions run now,
        ordered before later work on ``stream``, which will write the new pages). False when it
        cannot; when a group lacks the victims, before any page of another group was evicted (a
        tier below too full of held pages to take them may still stop it midway)."""
        self.release_let_go()
        if not self.planner.primary_has_victims(need):
            return False
        with self._moving() as plan:
            ok = all(self.planner.make_room(PRIMARY, g, n, plan) for g, n in need.items())
            self.apply(plan, stream)
        return ok

    def new_page(self, group: GroupId, priority: int, locked: bool) -> Page:
        """A page in a free primary slot, held by one cache; the room was made before (``reserve``)."""
        page = self.residency.new_page(group, priority, locked)
        if page is None:
            raise InvariantError(f"no free primary slot in group {group} after room was made for it")
        return page

    def lock_in_primary(
        self, pages: list[Page], copies: list[Page], fresh: list[GroupId], priority: int, stream=None
    ) -> tuple[list[Page], bool] | None:
        """Lock ``pages`` into the primary tier with a private copy of each of ``copies`` and a new
        page per group of ``fresh``, all in one plan.

        ``copies`` are pages the caller holds; on success it holds the private copies instead.
        Returns the new locked pages (the copies in order, then the fresh ones) and whether a page
        involved is damaged (failed its checksum, now or before); None when the primary tier
        cannot hold them all, with nothing locked and the caller's holds unchanged.
        """
        self.release_let_go()
        res = self.residency
        need, damaged = res.lock_all(pages)
        cold = pages if need else []  # only pages outside the primary tier move
        _, damaged_copy = res.lock_all(copies)
        new: list[Page] = []
        try:
            for page in copies:
                need[page.group] = need.get(page.group, 0) + 1
            for group in fresh:
                need[group] = need.get(group, 0) + 1
            with self._moving() as plan:
                ok = self.planner.promote(cold, plan, need)
                if ok:
                    for source in copies:
                        page = self.new_page(source.group, priority, locked=True)
                        plan.add(source.tier, PRIMARY, source.group, source.slot, page.slot)
                        new.append(page)
                    new.extend(self.new_page(group, priority, locked=True) for group in fresh)
                damaged = self.apply(plan, stream, shared=True) > 0 or damaged or damaged_copy
            self._unpin_promoted()
        except BaseException:  # an interrupt or a failed copy: the caller's holds as they were
            res.release_all(new, locked=True)
            res.unlock_all(pages)
            res.unlock_all(copies)
            raise
        if not ok:
            res.unlock_all(pages)
            res.unlock_all(copies)
            return None
        damaged = damaged and any(page.damaged for page in copies + pages + new)
        res.release_all(copies, locked=True)
        return new, damaged

    def touch(self, pages: list[Page]) -> None:
        """Pages the tree already had for blocks that a cache computed again and then built on (its
        match stopped above them: a recurrent state resumes only at a snapshot; a reuse given up;
        a cache made before they were published): each page still in its tier's eviction order
        becomes the most recently used there, in order, as a match through them would have left
        it. The blocks published below them must not outlive them: no match reaches those without
        them."""
        for page in pages:
            tier = self.tiers[page.tier]
            if page in tier.evictable[page.group]:
                tier.reindex(page)

    def copy_page(self, source: Page, priority: int, stream: torch.cuda.Stream | None = None) -> Page | None:
        """A new primary page holding a copy of ``source`` (a primary page), held unlocked by the
        caller; None when no room can be made for it. The copy runs on ``stream``, where the
        caller writes ``source``."""
        group = source.group
        with self._moving() as plan:
            if not self.planner.make_room(PRIMARY, group, 1, plan):
                self.apply(plan, stream)
                return None
            page = self.new_page(group, priority, locked=False)
            plan.add(PRIMARY, PRIMARY, group, source.slot, page.slot)
            self.apply(plan, stream)
        return page

    def prefetch(self, match: ReuseMatch, stream=None) -> int:
        """Promote the pages of ``match`` toward the primary tier as room allows; returns how many moved.

        They are pinned meanwhile (making room for one never evicts another) and stay evictable,
        as recently used. All of them go in one promotion when the primary tier can hold them (its
        victims swap places with the pages coming up from host memory, as on resume); otherwise as
        many as fit, in prefix order.
        """
        pages = match.pages(self.rules)
        res = self.residency
        need, _ = res.lock_all(pages)
        cold = [page for page in pages if page.tier != PRIMARY]
        try:
            with self._moving() as plan:
                if not self.planner.promote(cold, plan, need):
                    self._promote_while_room([page for page in cold if page.tier != PRIMARY], plan)
                self.apply(plan, stream)
            self._unpin_promoted()
        finally:
            res.unlock_all(pages[::-1])
        return sum([page.tier == PRIMARY for page in cold])

    def _unpin_promoted(self) -> None:
        """Let go of the held prefetched pages a promotion just moved out of host memory (a hold
        keeps pages there only: pinned in the primary tier, they would take room from others)."""
        prefetcher = self.prefetcher
        if prefetcher is not None and prefetcher.holding:
            prefetcher.release_moved()

    def _promote_while_room(self, pages: list[Page], plan: MovePlan) -> None:
        """Plan moving locked ``pages`` into the primary tier one by one, until room runs out."""
        for page in pages:
            if not self.planner.make_room(PRIMARY, page.group, 1, plan):
                return
            self.planner.move(page, PRIMARY, plan)
            self.counters.promotions += 1

    def maintain(self) -> int:
        """Background work between steps: the free reserve and write-through copies, one batch, on
        the mover's background stream, unless the previous batch is still running. Returns the
        pages planned."""
        self.release_let_go()
        if self.prefetcher is not None and self.prefetcher.busy:
            self.prefetcher.poll()
        if self.write_behind is not None:
            self.write_behind.poll()
            self.write_behind.start()
        background = self.background
        if not background.enabled or self.mover.background_busy():
            return 0
        with self._moving() as plan:
            planned = background.plan(plan)
            self.apply(plan, background=True)
        return planned

    def forget_scope(self, scope: ReuseScope) -> int:
        """Drop every block published under ``scope`` (``Residency.forget_below``); the pages dropped."""
        root = self.tree.find_root(scope)
        if root is None:
            return 0
        dropped = self.residency.forget_below(root)
        if not root.children:
            self.tree.forget_root(root)
        if self.disk_tier is not None:
            disk_index = self.tiers[self.disk_tier].disk_index
            if disk_index is not None:
                disk_index.commit_soon()
        return dropped

    def _cost_inputs(self) -> str:
        """What a load-or-recompute decision weighed, for its DEBUG line: the prefill rate and each
        tier's bandwidth (unmeasured: assumed to win)."""
        speeds = ", ".join(
            f"{tier.name} {'unmeasured' if bw is None else f'{bw / 1e9:.3g} GB/s'}"
            for tier, bw in zip(self.tiers, self.load_cost.bandwidth, strict=True)
        )
        return f"prefill {self.load_cost.prefill_rate:.3g} tokens/s; {speeds}"

    def prefetch_to_host(self, match: ReuseMatch, hold: bool = False) -> HostPrefetch | None:
        """Start reading the pages of ``match`` that are on disk into host memory (the host tier, or
        the primary tier of a CPU manager without one) in the background
        (``kvtier.tiering.host_prefetch``), after making room there as a promotion would (the
        coldest pages there go to disk now); when there is room for only some, the first ones of
        each layer group are read. None without a disk tier and host memory above it, or with
        nothing to read. ``hold``: the pages landed stay there until the prefetch is cancelled."""
        prefetcher = self.prefetcher
        if prefetcher is None:
            return None
        pages = match.pages(self.rules)
        res = self.residency
        res.lock_all(pages)  # making room in host memory never evicts the prefix itself
        try:
            need: dict[int, int] = {}
            for page in pages:
                if page.tier == prefetcher.disk.index and not page.damaged and not prefetcher.pins[id(page)]:
                    need[page.group] = need.get(page.group, 0) + 1
            host = prefetcher.host
            with self._moving() as plan:
                for group, count in need.items():  # room for as many as can be had: the prefix's first pages
                    room = host.storage.slots[group].num_free + len(host.evictable[group])  # an upper bound
                    self.planner.make_room(host.index, group, min(count, room), plan)
                self.apply(plan)
            self.mover.synchronize()  # host slots it may take (a copy's) can still be landing from the device
            return prefetcher.start(pages, hold)
        finally:
            res.unlock_all(pages[::-1])

    def persist(self) -> None:
        """Write published pages still in memory to the disk tier's free slots, parents first (at close),
        so that a pool started later on the same path finds them."""
        if self.prefetcher is not None:
            self.prefetcher.close()  # its pins and reserved slots go before anything is written
        if self.write_behind is not None:
            self.write_behind.close()
        with self._moving() as plan:
            self.planner.persist(plan)
            self.apply(plan)

    def close(self) -> None:
        """Release the tiers' memory and files (every holder has let go)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.write_behind is not None:
            self.write_behind.close()
        self.mover.synchronize()
        self.mover.close()
        for tier in self.tiers:
            tier.storage.close()
            if tier.disk_index is not None:
                tier.disk_index.close()

    # -- stats and checks --------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """The tiers' occupancy and the counters since construction."""
        c = self.counters
        tiers = {}
        for tier in self.tiers:
            storage = tier.storage
            total = sum(s.num_slots for s in storage.slots)
            used = sum(s.num_used for s in storage.slots)
            bytes_total = sum(s.num_slots * p for s, p in zip(storage.slots, storage.page_bytes, strict=True))
            bytes_used = sum(s.num_used * p for s, p in zip(storage.slots, storage.page_bytes, strict=True))
            tiers[tier.name] = TierStats(total, used, bytes_total, bytes_used)
        return CacheStats(
            tiers=tiers,
            hit_tokens={name: c.hit_tokens[name] for name in TIER_NAMES},
            lookup_tokens=c.lookup_tokens,
            evictions=c.evictions,
            demotions=c.demotions,
            promotions=c.promotions,
            drops=c.drops,
            checksum_failures=c.checksum_failures,
            disk_resets=c.disk_resets,
            bytes_copied=dict(c.bytes_copied),
            recomputed_tokens=c.recomputed_tokens,
        )

    def release_let_go(self) -> None:
        """Let go of what holders gave up since the last call: close the caches dropped without
        ``close`` (one WARNING per pool) and the pages of held prefetches cancelled (their pins
        would keep a room-making call from them); called inside claimed calls only
        (``kvtier.exclusive``)."""
        prefetcher = self.prefetcher
        if prefetcher is not None and prefetcher.holding:
            prefetcher.release_cancelled()
        if not self.dropped:
            return
        if not self._warned_dropped:
            self._warned_dropped = True
            log.warning(
                "kvtier: a KVCache was dropped without close(); its pages were held until the manager's next "
                "call. Close every cache so that its pages are freed at once"
            )
        while self.dropped:
            self.dropped.pop().close()

    def check(self) -> None:
        """Raise ``InvariantError`` unless every invariant of the pool and its holders holds (slow).

        It only looks: caches dropped without ``close`` count as holders and cancelled holds as pins
        until the next ``release_let_go``, so a run checked after every call (``KVTIER_DEBUG=1``)
        lets go of them exactly when one unchecked does."""
        holders = {id(holder): holder for holder in [*self.holders, *self.dropped]}.values()  # one may be in both
        check_pages(self.tiers, self.tree, holders, None if self.prefetcher is None else self.prefetcher.pins)

    def debug_check(self) -> None:
        """With ``KVTIER_DEBUG=1``, ``check`` (called after operations that change residency)."""
        if self.debug:
            self.check()


def _is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says memory could not be had (torch's CPU allocator raises a plain RuntimeError)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text


def _warn_unused_write_through_policy(host: HostTier) -> None:
    """A WARNING when a write-through policy is set on a host tier that is not written through."""
    given = [
        f"{name}={getattr(host, name)}"
        for name in ("write_through_min_priority", "write_through_min_hits")
        if getattr(host, name)
    ]
    if given:
        log.warning(
            "kvtier: HostTier(%s) has no effect: write-through is off (HostTier.write_through=True turns it "
            "on; None, the default, turns it on for CUDA devices only)",
            ", ".join(given),
        )
