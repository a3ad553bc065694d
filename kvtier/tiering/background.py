"""Work done between requests (``PagePool.maintain``): write-through copies and the free reserve.

*Write-through*: published primary pages that became evictable (``Tier.watch``, oldest first),
of priority and reuse count high enough (``HostTier.write_through_min_priority``,
``HostTier.write_through_min_hits``),
are copied to free host slots, or to slots of copies whose originals left the primary tier,
never pushing a page out (pages waiting for room stay watched). Once its copy has run, the copy
is owned by the host tier (the plan's ``kept_copies``, spare: the first to go when room is wanted
there), so evicting the original later takes the copy's slot and moves no byte.

*Free reserve*: each layer group keeps ``PrimaryTier.free_reserve`` of its slots free by
demoting its coldest pages (those with a copy below move no byte), as many as can be had. It
never drops a page (none is kept without a writable tier below, and none is dropped when the
tiers below cannot take the victims): a request needing room drops one on demand as cheaply.

Both are planned into one ``MovePlan`` that the pool runs on the mover's background stream; a
new batch is planned only when the previous one has finished (the link is left to requests in
between). Published pages never change, so a copy taken while its original is in use is exact.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from kvtier.tiering.plan import MovePlan
from kvtier.tiering.planner import MovePlanner
from kvtier.tiering.residency import PRIMARY
from kvtier.tiering.tier import Tier

BATCH_BYTES = 256 << 20  # write-through bytes per batch: a few ms of the link
WATCH_PAGES = 1 << 16  # pages remembered for write-through; older ones fall off (they stay uncopied)


class BackgroundWork:
    """Plans write-through copies to ``host`` (None: off) and the primary tier's free reserve."""

    def __init__(
        self,
        tiers: list[Tier],
        planner: MovePlanner,
        host: Tier | None,
        reserve_share: float,
        min_priority: int,
        min_hits: int = 0,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self.primary = tiers[PRIMARY]
        self.planner = planner
        self.host = host
        self.min_priority = min_priority
        self.min_hits = min_hits  # reuses a page needs before it is copied (``Page.hits``, counted by residency)
        self.batch_bytes = batch_bytes
        # Rounded up, but never past half of a group's slots (0.5 of one slot keeps none free, not all).
        slots = [s.num_slots for s in self.primary.storage.slots]
        if not any(tier.writable for tier in tiers[PRIMARY + 1 :]):
            reserve_share = 0.0  # nowhere to demote to (the pool warns)
        self.reserve = [min(math.ceil(reserve_share * n), n // 2) for n in slots]
        if host is not None:
            self.primary.watch = OrderedDict()
            self.primary.watch_limit = WATCH_PAGES

    @property
    def enabled(self) -> bool:
        return self.host is not None or any(self.reserve)

    def plan(self, plan: MovePlan) -> int:
        """Plan one batch: the reserve first, then write-through copies. Returns pages planned."""
        return self.keep_reserve(plan) + self.write_through(plan)

    def keep_reserve(self, plan: MovePlan) -> int:
        """Demote the coldest primary pages of each group until its reserve is free, or as many as
        may leave now when fewer do (the others are locked by active caches)."""
        moved = 0
        for group, want in enumerate(self.reserve):
            free = self.primary.storage.slots[group].num_free
            if want and free < want:
                found = len(self.primary.evictable[group].take(want - free))  # (``make_room`` frees all or none)
                if found:
                    self.planner.make_room(PRIMARY, group, free + found, plan, drop=False)
                    moved += self.primary.storage.slots[group].num_free - free
        return moved

    def write_through(self, plan: MovePlan) -> int:
        """Plan copies of watched pages into host slots, up to ``batch_bytes``; returns how many."""
        host = self.host
        watch = self.primary.watch
        if host is None or not watch:
            return 0
        page_bytes = self.primary.storage.page_bytes
        budget = self.batch_bytes
        full: set[int] = set()
        planned = 0
        for _ in range(len(watch)):
            if budget <= 0 or len(full) == len(page_bytes):
                break
            page = watch.popitem(last=False)[0]
            group = page.group
            if (
                page.tier != PRIMARY
                or page.node is None
                or page.damaged
                or page.priority < self.min_priority
                or page.hits < self.min_hits
                or page in host.copies
            ):
                continue  # nothing to copy (a page reused again later is watched again when let go)
            # never in place of another copy of a primary page: those are as good, and older ones
            # are nearer to eviction (a copy's slot is taken only from pages gone from the GPU)
            slot = None if group in full else host.slot_for_copy(group, unless_original_in=PRIMARY)
            if slot is None:
                full.add(group)
                watch[page] = None  # kept for a later batch, when host memory has room again
                continue
            plan.add(PRIMARY, host.index, group, page.slot, slot)
            copies, slots = plan.kept_copies[host.index]  # owned by the host once written (``finish``)
            copies.append(page)
            slots.append(slot)
            budget -= page_bytes[group]
            planned += 1
        return planned
