"""What to move: making room in a tier (the demotion cascade), promotion, and a plan's bookkeeping.

Operations first *plan*: the bookkeeping moves at once (slots are reassigned, pages dropped) and
the copies still to do are recorded in a ``MovePlan``; the pool then has the mover copy the data
in an order that never overwrites a slot before its old contents have been read, and ``finish``
completes the bookkeeping:

    1. demotions, deepest edge first (host->disk before primary->host);
    2. promotions and private copies into warmer tiers;
    3. slots read by step 2 are freed, moved pages become evictable again.

A page the plan is moving is not in any eviction index until its data has landed, so a plan
never picks it as a victim, and a page pinned by the operation (``locks``) is never a victim.

Writes to the disk tier happen while planning (``kvtier.tiering.disk_writes``). A published page
promoted from disk (or, with write-through, from host memory) leaves its bytes there as a copy
(``Tier.add_copy``). A read-only disk tier is never a destination.
"""

from __future__ import annotations

from itertools import chain, compress, groupby
from operator import attrgetter

import numpy as np

from kvtier.errors import InvariantError
from kvtier.pages import Page
from kvtier.stats import Counters
from kvtier.tiering.disk_writes import DiskWritePlanner
from kvtier.tiering.duplex import swap_lag
from kvtier.tiering.plan import MovePlan
from kvtier.tiering.residency import PRIMARY, Residency
from kvtier.tiering.swap_scratch import SwapScratch
from kvtier.tiering.tier import Tier


class MovePlanner:
    """Plans moves between the tiers; ``disk_writes`` lands demotions on the disk tier (None: no disk);
    ``scratch``: the mover's swap scratch, where a swap's victims may wait instead of taking a head
    start (``kvtier.tiering.swap_scratch``)."""

    def __init__(
        self,
        tiers: list[Tier],
        residency: Residency,
        counters: Counters,
        disk_writes: DiskWritePlanner | None,
        scratch: SwapScratch,
    ) -> None:
        self.tiers = tiers
        self.residency = residency
        self.counters = counters
        self.disk_writes = disk_writes
        self.scratch = scratch

    def make_room(
        self,
        tier_index: int,
        group: int,
        count: int,
        plan: MovePlan,
        leaving: list[Page] | None = None,
        drop: bool = True,
    ) -> bool:
        """Free slots in a tier until ``count`` are free, demoting or dropping victims.

        Victims go spare copies first, then lowest priority, then least recently used. Copies
        are freed; the other victims are demoted together to the next tier that can make room
        for them (normally the next one), where a victim with a copy takes the copy's slot. From
        the last tier, or when nothing below can take them, only pages held by the tree alone are
        dropped. Returns False when the room cannot be had; evictions already done stay valid
        (they lose nothing a cache holds).

        ``leaving``: locked pages of ``group`` in the memory tier below, to be promoted into this
        (the primary) tier. Victims bound there swap places with them (``_swap``): they are moved
        up with the victims at once, into free slots or the victims' slots.

        ``drop=False``: no page of this tier is dropped when the tiers below cannot take the victims
        (the free reserve's demotions: a request needing room drops one on demand as cheaply).
        """
        tier = self.tiers[tier_index]
        if tier.is_last:
            return self.residency.drop_for_room(tier_index, group, count)
        slots = tier.storage.slots[group]
        index = tier.evictable[group]
        short = count - slots.num_free
        if short <= 0:
            return True
        if short > len(index):  # entries: an upper bound on the evictable pages
            return False
        victims = index.take(short)
        if len(victims) < short:
            return False
        if tier.originals:
            originals = tier.originals
            kept = [p for p in victims if p not in originals]
            for copy in victims:
                if copy in originals:
                    tier.remove_copy(copy)  # its bytes are elsewhere too: nothing is lost
            victims = kept
        if victims:
            for dst_index in range(tier_index + 1, len(self.tiers)):
                # The next tier first; a colder one when the next is full of pinned pages (a swap).
                dst = self.tiers[dst_index]
                if dst.copies:  # victims with a copy there take its slot, unwritten: no room is made for them
                    victims = self._take_copies(victims, dst) if not dst.is_disk else self._land_on_disk(victims, dst)
                    if not victims:
                        break
                if not dst.writable:  # a read-only disk takes no other page
                    continue
                if leaving and leaving[0].tier == dst_index and self._swap(victims, leaving, plan):
                    count -= len(leaving)  # they hold primary slots of the room asked for now
                    break
                if dst.is_disk and self.disk_writes is not None:
                    if not drop and not self.disk_writes.blocking:
                        break  # it would drop the victims only the tree holds
                    victims = self.disk_writes.to_write(victims)  # no room is made for those it drops
                    if not victims:
                        break
                    self.disk_writes.keep_ancestors(victims)
                if self.make_room(dst_index, group, len(victims), plan):
                    self._demote(victims, dst_index, plan)
                    break
        if drop and slots.num_free < count:
            self.residency.drop_some(tier_index, group, count - slots.num_free)
        return slots.num_free >= count

    def has_victims(self, tier_index: int, group: int, count: int) -> bool:
        """Whether ``make_room`` finds the victims that would free ``count`` slots of a group in a tier
        (not whether the tiers below take them). Changes nothing but stale index entries."""
        tier = self.tiers[tier_index]
        short = count - tier.storage.slots[group].num_free
        return short <= 0 or len(tier.evictable[group].take(short, held_stale=tier.is_last)) >= short

    def primary_has_victims(self, need: dict[int, int]) -> bool:
        """``has_victims`` in the primary tier for ``need[g]`` slots of every group: asked before
        making room for several groups, so that one group found short leaves the others' pages
        where they are (one group needs no asking: ``make_room`` fails before it moves any)."""
        return len(need) < 2 or all(self.has_victims(PRIMARY, g, n) for g, n in need.items())

    def _swap(self, victims: list[Page], leaving: list[Page], plan: MovePlan) -> bool:
        """Demote primary ``victims`` into the slots that ``leaving`` (locked pages of the same group
        in the memory tier below) vacate, and move those up into free primary slots or the victims'
        slots, in one pass: the tier below keeps its other pages. False, with nothing swapped, when
        the tier below cannot free the slots the swap starts with.

        Victims land, in order: in slots free below, freed there if need be (at least the
        ``swap_lag`` head start, or as many as no leaving page makes room for); in the slots of
        leaving pages bound for free primary slots; then victim ``seeds + donors + j`` in the slot
        of the leaving page that takes victim ``j``'s slot. So a victim waits only for a promotion
        that waits for an earlier victim, an order the mover's parts follow
        (``kvtier.tiering.duplex``). Victims that the mover's swap scratch holds need no head
        start: they wait there (``kvtier.tiering.swap_scratch``), and no page below is dropped for
        them; the head start shrinks to the victims it cannot hold when that is less than
        ``swap_lag``. Leaving pages' slots that no victim takes are left as
        ``_move_up`` leaves them. Slots handed over count as freed (``count_as_freed``): a disk
        write-behind batch that read one must not land what it read as the new holder's bytes.
        """
        primary, lower = self.tiers[PRIMARY], self.tiers[leaving[0].tier]
        group = victims[0].group
        n, m = len(victims), len(leaving)
        up_slots, down_slots = primary.storage.slots[group], lower.storage.slots[group]
        ready = min(m, up_slots.num_free)  # leaving pages that go to free primary slots: no wait
        page_bytes = primary.storage.page_bytes[group]
        lag = min(n, swap_lag(n, page_bytes))
        unparked = max(0, n - self.scratch.pages(page_bytes))  # victims the scratch cannot hold
        if unparked < lag and self.scratch.allocate():
            lag = unparked
        have = min(n, down_slots.num_free)  # victims that land in slots free below, then
        donors = min(ready, n - have)  # in the slots of leaving pages bound for free slots, then
        least = n - have - donors - min(n - have - donors, m - ready)  # in slots freed below for them,
        for more in (max(least, lag - have - donors), max(least, 1 - have - donors)):  # the least head start
            if self.make_room(lower.index, group, have + more, plan):
                break
        else:
            return False
        seeds = have + more
        chained = n - seeds - donors  # and the rest in slots of leaving pages bound for victims' slots
        plan.landed += (victims, leaving)  # in their order: the order they become evictable in where they land
        # paired in slot order: runs of slots stay runs
        victim_slots, victims = _by_slot(victims, [page.slot for page in victims], primary.owners[group])
        leaving_slots, leaving = _by_slot(leaving, [page.slot for page in leaving], lower.owners[group])
        seed_slots = sorted(down_slots.allocate_many(seeds))
        ready_slots = sorted(up_slots.allocate_many(ready))
        down_to = seed_slots + leaving_slots[:donors] + leaving_slots[ready : ready + chained]
        up_to = ready_slots + victim_slots[: m - ready]
        # the same slots as arrays, read once each: the copies and the freed counts take them whole
        victim_at, leaving_at = _slot_array(victim_slots), _slot_array(leaving_slots)
        seed_at, ready_at = _slot_array(seed_slots), _slot_array(ready_slots)
        down_at = np.concatenate((seed_at, leaving_at[:donors], leaving_at[ready : ready + chained]))
        up_at = np.concatenate((ready_at, victim_at[: m - ready]))
        kept = leaving[donors:ready] + leaving[ready + chained :]  # leaving pages whose slots no victim takes
        kept_slots = leaving_slots[donors:ready] + leaving_slots[ready + chained :]
        primary.evictable[group].discard_all(victims)
        lower.evictable[group].discard_all(leaving)
        _empty(primary, group, victim_slots[m - ready :])  # the slots taken over are owned anew below
        _empty(lower, group, kept_slots)
        _place(victims, lower, down_to)
        _place(leaving, primary, up_to)
        up_slots.free_all(victim_slots[m - ready :])
        up_slots.count_as_freed(victim_at[: m - ready])  # other bytes under the same slots
        down_slots.count_as_freed(down_at[seeds:])
        self._leave_behind(lower, group, kept, kept_slots, plan)
        plan.edges[(PRIMARY, lower.index, group)].add_batch(victim_at, down_at)
        plan.edges[(lower.index, PRIMARY, group)].add_batch(leaving_at, up_at)
        self.counters.evictions += n
        self.counters.demotions += n
        self.counters.promotions += m
        return True

    def _land_on_disk(self, victims: list[Page], disk: Tier) -> list[Page]:
        """``DiskWritePlanner.land_on_copies`` on the disk tier ``disk``: returns the victims without a copy."""
        if self.disk_writes is None or disk is not self.disk_writes.disk:
            raise InvariantError(f"copies on {disk.name}, which has no disk writes")
        return self.disk_writes.land_on_copies(victims)

    def _demote(self, victims: list[Page], dst_index: int, plan: MovePlan) -> None:
        """Move victims one tier down; the next tier has a free slot for each."""
        dst = self.tiers[dst_index]
        if not dst.is_disk:
            self.counters.evictions += len(victims)
            self.counters.demotions += len(victims)
            self._move_down(victims, dst, plan)
            return
        if self.disk_writes is None or dst is not self.disk_writes.disk:
            raise InvariantError(f"demotion to {dst.name}, which has no disk writes")
        self.disk_writes.demote(victims, plan)

    def _move_down(self, pages: list[Page], dst: Tier, plan: MovePlan) -> None:
        """``move`` for pages of one memory tier and group into a colder memory tier ``dst`` that has
        a free slot for each, in one pass: their slots here are freed at once, the copies planned."""
        src = self.tiers[pages[0].tier]
        old_slots = self._relocate(pages, src, dst, plan)
        src.storage.slots[pages[0].group].free_all(old_slots)

    def _relocate(self, pages: list[Page], src: Tier, dst: Tier, plan: MovePlan) -> list[int]:
        """Move pages of one group from ``src`` into free slots of ``dst`` in the bookkeeping (their
        index entries and disk rows in ``src`` go, stale ones included) and plan their copies.
        Returns the slots they left in ``src``, in the pages' order, still allocated: freeing them
        is the caller's. Pages and free slots are paired in slot order, so that runs of slots on
        both sides stay runs (one copy each)."""
        group = pages[0].group
        new_slots = dst.storage.slots[group].allocate_many(len(pages))
        if new_slots is None:
            raise InvariantError(f"{len(pages)} pages moved to {dst.name}, which had fewer free slots")
        new_slots.sort()
        src.evictable[group].discard_all(pages)
        if src.disk_index is not None:
            for page in pages:
                src.forget(page)
        old_slots = [page.slot for page in pages]
        sources, moved = _by_slot(pages, old_slots, src.owners[group])  # before their slots are emptied
        _empty(src, group, old_slots)
        plan.landed.append(pages)  # in their order: the order they become evictable in where they land
        _place(moved, dst, new_slots)
        plan.edges[(src.index, dst.index, group)].add_batch(sources, new_slots)
        return old_slots

    def _take_copies(self, victims: list[Page], dst: Tier) -> list[Page]:
        """Demote the victims that have a copy in memory tier ``dst`` into their copy's slot (the
        bytes are there, or on their way on the background stream, which later copies wait for):
        nothing is copied. Returns the other victims."""
        copies = dst.copies
        rest = [page for page in victims if page not in copies]
        if len(rest) == len(victims):
            return victims
        for page in [page for page in victims if page in copies]:
            slot = copies[page].slot
            dst.take_copy(page)  # the copy's slot is handed over to ``page``
            self.counters.evictions += 1
            self.counters.demotions += 1
            self.tiers[page.tier].vacate(page)
            page.tier, page.slot = dst.index, slot
            dst.owners[page.group][slot] = page
            dst.reindex(page)
        return rest

    def move(self, page: Page, dst_index: int, plan: MovePlan) -> None:
        """Plan moving ``page`` to a tier that has a free slot for it.

        Demotions free the source slot at once (a deeper edge runs first, so its contents are
        read before anything lands there); promotions free it only after the plan ran, except
        where the source tier keeps copies (the disk; the host with write-through) and the page
        is published: the slot then holds its copy (a disk chain's rows stay restorable, and
        demoting the page again moves no byte).
        """
        src = self.tiers[page.tier]
        src_index, src_slot = page.tier, page.slot
        demotion = dst_index > src_index
        src.vacate(page, free_slot=demotion)
        if not self.tiers[dst_index].place(page):
            raise InvariantError(f"{page} moved to {self.tiers[dst_index].name}, which had no free slot")
        plan.add(src_index, dst_index, page.group, src_slot, page.slot)
        plan.landed.append([page])
        if not demotion and src.keeps_copies and page.node is not None:
            kept_pages, kept_slots = plan.kept_copies[src_index]  # its bytes stay there, as a copy
            kept_pages.append(page)
            kept_slots.append(src_slot)
        elif not demotion:
            plan.deferred_frees[(src_index, page.group)].append(src_slot)

    def promote(self, pages: list[Page], plan: MovePlan, need: dict[int, int]) -> bool:
        """Plan moving every page of ``pages`` into the primary tier, with room for ``need[g]`` pages.

        ``need`` counts the pages outside the primary tier plus any new pages to allocate. The
        pages must be pinned (locked) by the caller so that making room cannot evict them. Pages
        in the memory tier right below swap places with the victims (``make_room``'s ``leaving``).
        Returns False when the primary tier cannot hold them all: when a group lacks the victims,
        before any page of another group was moved (a tier below too full of held pages to take
        them may still stop it midway; pages swapped up by then stay there, still locked by the
        caller, as the others stay where they are).
        """
        if not self.primary_has_victims(need):
            return False
        tiers = [page.tier for page in pages]  # the one pass that reads where they are
        cold = pages
        if PRIMARY in tiers:
            cold = list(compress(pages, tiers))  # (the primary tier's index is 0)
            tiers = [tier for tier in tiers if tier != PRIMARY]
        leaving = self._below_primary(cold, tiers)
        for group, count in need.items():
            if not self.make_room(PRIMARY, group, count, plan, leaving.get(group)):
                return False
        cold = _not_swapped(cold, leaving)
        self.counters.promotions += len(cold)
        self._move_up(cold, plan)
        return True

    def _below_primary(self, pages: list[Page], tiers: list[int]) -> dict[int, list[Page]]:
        """Per group, the pages of a list (in tiers ``tiers``, in step) in the memory tier right below
        the primary one, in order."""
        if len(self.tiers) < 2 or self.tiers[1].is_disk:
            return {}
        below = pages if tiers.count(1) == len(tiers) else list(compress(pages, [tier == 1 for tier in tiers]))
        if len(self.tiers[PRIMARY].owners) == 1:  # one layer group: no page to sort out
            return {0: below} if below else {}
        groups: dict[int, list[Page]] = {}
        for group, run in groupby(below, key=attrgetter("group")):
            groups.setdefault(group, []).extend(run)
        return groups

    def _move_up(self, pages: list[Page], plan: MovePlan) -> None:
        """``move`` into the primary tier for locked pages of lower tiers, one pass per run of pages
        of one (tier, group); the primary tier has a free slot for each."""
        primary = self.tiers[PRIMARY]
        for (src_index, group), run in groupby(pages, key=attrgetter("tier", "group")):
            run = list(run)
            src = self.tiers[src_index]
            old_slots = self._relocate(run, src, primary, plan)
            self._leave_behind(src, group, run, old_slots, plan)

    @staticmethod
    def _leave_behind(src: Tier, group: int, pages: list[Page], slots: list[int], plan: MovePlan) -> None:
        """The slots in ``src`` that promoted ``pages`` left: a published page's bytes stay there as a
        copy where the tier keeps copies; the others are freed once the plan ran."""
        frees = slots
        if src.keeps_copies:
            kept_pages, kept_slots = plan.kept_copies[src.index]
            if all([page.node is not None for page in pages]):
                kept_pages += pages
                kept_slots += slots
                frees = []
            else:
                frees = []
                for page, slot in zip(pages, slots, strict=True):
                    if page.node is not None:
                        kept_pages.append(page)
                        kept_slots.append(slot)
                    else:
                        frees.append(slot)
        if frees:
            plan.deferred_frees[(src.index, group)].extend(frees)

    def persist(self, plan: MovePlan) -> int:
        """Write published pages held in memory tiers to the disk tier, parents first (at close).

        So that a manager started later on the same path finds the hot prefixes too, with
        unbroken chains. Returns the number of pages it tried to write.
        """
        return 0 if self.disk_writes is None else self.disk_writes.persist(plan)

    def finish(self, plan: MovePlan) -> None:
        """After the plan's copies ran: free the slots they read, index the pages they moved, commit
        the disk index."""
        residency = self.residency
        tiers = self.tiers
        for (tier_index, group), slots in plan.deferred_frees.items():
            tiers[tier_index].storage.slots[group].free_all(slots)
        for tier_index, run in _runs_by_tier(plan.landed):
            tiers[tier_index].index_arrivals(run)
        for page in plan.damaged:
            residency.mark_damaged(page)
        for page in plan.lost:
            residency.mark_damaged(page, failed_checksum=False)
        for tier_index, (pages, slots) in plan.kept_copies.items():
            tiers[tier_index].add_spare_copies(pages, slots)
        plan.kept_copies.clear()
        plan.deferred_frees.clear()
        plan.landed.clear()
        plan.edges.clear()
        plan.damaged.clear()
        plan.lost.clear()
        if self.disk_writes is not None:
            self.disk_writes.disk.disk_index.commit_soon()

    def abandon(self, plan: MovePlan) -> None:
        """``finish`` a plan whose copies were cut short by an exception (any number of them ran).

        Every page a copy of the plan was to write is lost (marked damaged: never reused, its
        holders start over), and so is every copy the plan was to leave in a slot it wrote
        (a write-through copy); copies left behind in slots the plan only read stay valid.
        """
        written: set[tuple[int, int, int]] = set()
        for (_, dst_index, group), copies in plan.edges.items():
            owners = self.tiers[dst_index].owners[group]
            for slot in copies.pairs()[:, 1].tolist():
                written.add((dst_index, group, slot))
                if owners[slot] is not None:
                    plan.lost.append(owners[slot])
        for tier_index, (pages, slots) in plan.kept_copies.items():
            kept_pages, kept_slots = [], []
            for page, slot in zip(pages, slots, strict=True):
                if (tier_index, page.group, slot) in written:
                    self.tiers[tier_index].storage.slots[page.group].free(slot)
                else:
                    kept_pages.append(page)
                    kept_slots.append(slot)
            pages[:], slots[:] = kept_pages, kept_slots
        self.finish(plan)


def _not_swapped(cold: list[Page], leaving: dict[int, list[Page]]) -> list[Page]:
    """The pages of ``cold`` still outside the primary tier after room was made with ``leaving`` (per
    group, pages of ``cold``): a swap moves up every page of its group's list, or none."""
    up = sum([len(run) for run in leaving.values() if run[0].tier == PRIMARY])
    if not up:
        return cold
    if up == len(cold):
        return []
    return [page for page in cold if page.tier != PRIMARY]


def _runs_by_tier(batches: list[list[Page]]) -> list[tuple[int, list[Page]]]:
    """Batches of pages, each in one tier, as runs of one tier in order: consecutive batches of a
    tier are joined (the batches are left as they are)."""
    runs: list[tuple[int, list[list[Page]]]] = []
    for batch in batches:
        tier = batch[0].tier
        if runs and runs[-1][0] == tier:
            runs[-1][1].append(batch)
        else:
            runs.append((tier, [batch]))
    return [(tier, run[0] if len(run) == 1 else list(chain.from_iterable(run))) for tier, run in runs]


def _by_slot(pages: list[Page], slots: list[int], owners: list[Page | None]) -> tuple[list[int], list[Page]]:
    """The slots of ``pages`` (of one tier and group, their slots ``slots`` in step; ``owners``:
    that group's owners there) in ascending order, and the pages in them. A list already
    ascending or descending is sorted in one pass and its pages taken as they are, reversed for
    descending slots (a prefix's pages and a run of victims usually are), not looked up slot by
    slot."""
    ordered = sorted(slots)
    if ordered == slots:
        return ordered, pages
    if ordered == slots[::-1]:
        return ordered, pages[::-1]
    return ordered, list(map(owners.__getitem__, ordered))


def _slot_array(ordered: list[int]) -> np.ndarray:
    """Distinct slots in ascending order as an int64 array; consecutive ones (a promoted prefix's
    slots usually are) are made as a range, not read one by one."""
    if ordered and ordered[-1] - ordered[0] == len(ordered) - 1:
        return np.arange(ordered[0], ordered[-1] + 1, dtype=np.int64)
    return np.array(ordered, dtype=np.int64)


def _empty(tier: Tier, group: int, slots: list[int]) -> None:
    """Clear the owners of these slots of a tier (the slots stay allocated)."""
    owners = tier.owners[group]
    for slot in slots:
        owners[slot] = None


def _place(pages: list[Page], tier: Tier, slots: list[int]) -> None:
    """Make each page the owner of its slot of ``tier`` (allocated, owned by none)."""
    owners = tier.owners[pages[0].group] if pages else []
    index = tier.index
    for page, slot in zip(pages, slots, strict=True):
        page.tier = index
        page.slot = slot
        owners[slot] = page
