"""``BlockTable``: the pages one cache holds, positional per layer group, and their primary slots.

For an attention group, entry ``b`` of ``blocks[g]`` is the page of block ``b`` (one entry per
block of the cache's capacity), None where a sliding-window block went stale (its page
released: ``GroupRule.is_live``) or where a partly reused block waits for its private copy. A
recurrent group holds one live state page instead (``state_page``). ``slots[g]`` mirrors
``blocks[g]`` as primary-tier slots (``BAD_PAGE_INDEX`` for None) once the cache is ACTIVE; it
grows by doubling and is only handed out as copies. Blocks ``[sink_blocks, stale_end[g])`` of a
sliding-window group have been released as stale, and blocks ``[0, released_end)`` of every
attention group were released at the caller's word (``KVCache.release_prefix``): no block there
holds a page.
"""

from __future__ import annotations

import numpy as np

from kvtier.errors import InvariantError
from kvtier.lifecycle import GroupRule
from kvtier.pages import BAD_PAGE_INDEX, Page
from kvtier.reuse.matching import ReuseMatch
from kvtier.spec import GroupKind
from kvtier.tiering.residency import PRIMARY, Residency


class BlockTable:
    """One cache's pages per layer group and block."""

    __slots__ = (
        "_attention",
        "_res",
        "_rules",
        "_windows",
        "blocks",
        "released_end",
        "slots",
        "stale_end",
        "state_page",
    )

    def __init__(self, rules: list[GroupRule], residency: Residency) -> None:
        self._rules = rules
        self._attention = [r for r in rules if r.kind is not GroupKind.RECURRENT]
        self._windows = [r for r in rules if r.kind is GroupKind.SLIDING_WINDOW]
        self._res = residency
        self.blocks: list[list[Page | None]] = [[] for _ in rules]
        self.slots = [np.full(16, BAD_PAGE_INDEX, dtype=np.int32) for _ in rules]
        self.stale_end = [rule.sink_blocks for rule in rules]
        self.released_end = 0
        self.state_page: Page | None = None

    def live_pages(self) -> list[Page]:
        """Every page compute uses: the blocks' pages and the state page."""
        pages: list[Page] = []
        for blocks in self.blocks:
            pages.extend(filter(None, blocks))  # drops the None entries (a Page is always true)
        if self.state_page is not None:
            pages.append(self.state_page)
        return pages

    def page_indices(self, group: int, num_blocks: int) -> np.ndarray:
        """A copy of the group's primary slots (the state page's alone for a recurrent group)."""
        if self._rules[group].kind is GroupKind.RECURRENT:
            if self.state_page is None:
                raise InvariantError("an ACTIVE cache of a recurrent model has no state page")
            return np.array([self.state_page.slot], dtype=np.int32)
        return self.slots[group][:num_blocks].copy()

    # -- filling ---------------------------------------------------------------------------------

    def adopt(self, match: ReuseMatch, num_blocks: int) -> None:
        """Hold the pages of a matched prefix: its full blocks, and an entry for a partly reused block."""
        p = match.tokens
        for rule in self._attention:
            g = rule.group_id
            blocks = match.blocks(rule)
            self._res.hold_all(blocks)
            if num_blocks > len(blocks):
                blocks.append(None)  # the partly reused block: its private copy comes on first resume
            self.blocks[g] = blocks
            self.stale_end[g] = rule.first_live_block(p)

    def add_blocks(self, old_blocks: int, new_blocks: int, history: int, priority: int) -> None:
        """Blocks ``[old_blocks, new_blocks)`` with a new locked page where live at ``history``.

        The room was made before: a missing slot is a broken invariant.
        """
        res = self._res
        for rule in self._attention:
            g = rule.group_id
            blocks = self.blocks[g]
            slots = self._slot_array(g, new_blocks)
            for b in range(old_blocks, new_blocks):
                page = None
                if rule.is_live(b, history):
                    page = res.new_page(g, priority, locked=True)
                    if page is None:
                        raise InvariantError(f"no free primary slot in group {g} after room was made for it")
                blocks.append(page)
                slots[b] = BAD_PAGE_INDEX if page is None else page.slot
            self.stale_end[g] = max(self.stale_end[g], min(rule.first_live_block(history), new_blocks))

    def remove_blocks(self, count: int) -> None:
        """Release the last ``count`` blocks' pages (locked: the cache is ACTIVE)."""
        res = self._res
        for rule in self._attention:
            blocks = self.blocks[rule.group_id]
            for _ in range(count):
                page = blocks.pop()
                if page is not None:
                    res.release(page, locked=True)

    def release_stale(self, history: int, num_blocks: int, locked: bool) -> None:
        """Release the sliding-window blocks that are stale at ``history``, newest first."""
        for rule in self._windows:
            g = rule.group_id
            new_end = min(rule.first_live_block(history), num_blocks)
            old_end = self.stale_end[g]
            if new_end > old_end:
                self._release_blocks(g, old_end, new_end, locked)
                self.stale_end[g] = new_end

    def release_before(self, end: int, locked: bool) -> None:
        """Release every attention group's pages of blocks ``[released_end, end)``, newest first."""
        for rule in self._attention:
            self._release_blocks(rule.group_id, self.released_end, end, locked)
        self.released_end = end

    def _release_blocks(self, group: int, start: int, end: int, locked: bool) -> None:
        """Release the group's pages of blocks ``[start, end)``, newest first, ``BAD_PAGE_INDEX`` in place."""
        res = self._res
        blocks = self.blocks[group]
        slots = self.slots[group]
        for b in range(end - 1, start - 1, -1):
            page = blocks[b]
            if page is not None:
                blocks[b] = None
                slots[b] = BAD_PAGE_INDEX
                res.release(page, locked)

    def release_all(self, locked: bool) -> None:
        """Empty the table, then release every page it held, newest first (an interrupt in between
        never leaves the table holding pages already released)."""
        pages = self.live_pages()[::-1]
        self.blocks = [[] for _ in self._rules]
        self.state_page = None
        self.stale_end = [rule.sink_blocks for rule in self._rules]
        self.released_end = 0
        self._res.release_all(pages, locked)

    def refresh_slots(self) -> None:
        """Rewrite every slot array from the blocks (after pages moved)."""
        for g, blocks in enumerate(self.blocks):
            slots = self._slot_array(g, len(blocks))
            slots[: len(blocks)] = [BAD_PAGE_INDEX if p is None else p.slot for p in blocks]

    def _slot_array(self, group: int, num_blocks: int) -> np.ndarray:
        """The group's slot array, grown (doubling) to hold at least ``num_blocks`` entries."""
        slots = self.slots[group]
        if len(slots) < num_blocks:
            grown = np.full(max(num_blocks, 2 * len(slots)), BAD_PAGE_INDEX, dtype=np.int32)
            grown[: len(slots)] = slots
            slots = self.slots[group] = grown
        return slots

    # -- checks ----------------------------------------------------------------------------------

    def check(self, num_blocks: int, history: int, waiting: dict[int, int], active: bool) -> None:
        """``InvariantError`` unless every attention group has ``num_blocks`` positional entries, a page
        exactly where a block is live and not released (block ``waiting[g]`` may wait for its private
        copy), and, while ``active``, every page in the primary tier with current slots."""
        for rule in self._rules:
            if rule.kind is GroupKind.RECURRENT:
                if active and (self.state_page is None or self.state_page.tier != PRIMARY):
                    raise InvariantError(f"active without a state page in the primary tier: {self.state_page}")
                continue
            g = rule.group_id
            blocks = self.blocks[g]
            if len(blocks) != num_blocks:
                raise InvariantError(f"group {g} has {len(blocks)} entries for {num_blocks} blocks")
            released = self.released_end
            for b, page in enumerate(blocks):
                live = b >= released and rule.is_live(b, history)
                if live and page is None and waiting.get(g) != b:
                    raise InvariantError(f"group {g} block {b} has no page")
                if not live and page is not None:
                    raise InvariantError(f"stale or released block {b} of group {g} still holds {page}")
                if active and page is not None and page.tier != PRIMARY:
                    raise InvariantError(f"active but {page} is not in the primary tier")
            if active:
                expect = [BAD_PAGE_INDEX if p is None else p.slot for p in blocks]
                if self.slots[g][:num_blocks].tolist() != expect:
                    raise InvariantError(f"page_indices({g}) is stale")
