"""Which pages of one tier and layer group to evict first: redundant copies, then lowest
priority, then least recently used.

The index holds every page that may leave the tier now (the residency layer decides which:
unlocked pages, and on the last tier only droppable ones), and may still hold pages that a cache
held or locked since they were indexed: taking a hold or a lock does not touch the index (a
cached prompt holds thousands of pages at once), so such *stale* entries are skipped, and
removed, by the victim search that passes them (``take``), or go when the page is indexed again
or leaves the tier. Updates are O(1): one ordered dict per priority level, in the order pages
became evictable, so the first evictable entry of the lowest non-empty level is the victim. A
*redundant* page (a disk copy of a page whose original is in a memory tier) goes before every
level: evicting it loses no bytes, evicting anything else on the last tier drops data (the disk
tier keeps one that blocks below it need: ``Tier.holds_chain_below``).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import compress, islice, repeat

import numpy as np

from kvtier.pages import Page

MIN_PRIORITY = 0
MAX_PRIORITY = 100
TAKE_WINDOW = 64  # a victim search reads at least this many entries at a time


def check_priority(priority: object) -> int:
    """``priority`` as a Python int in 0..100 (a numpy integer too), else ``TypeError``/``ValueError``."""
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
        raise TypeError(f"priority must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority}")
    return int(priority)


class EvictionIndex:
    """Evictable pages of one tier and group, ordered by (priority, time they became evictable),
    among stale entries (see the module's docstring); ``len`` counts entries, an upper bound.
    ``additions`` counts the calls that (re)added pages: it changes whenever a page may have
    become evictable."""

    __slots__ = ("_levels", "_size", "additions")

    def __init__(self) -> None:
        # level 0: redundant pages; level p + 1: pages of priority p
        self._levels: list[dict[Page, None]] = [{} for _ in range(MAX_PRIORITY + 2)]
        self._size = 0
        self.additions = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, page: Page) -> bool:
        return page in self._levels[page.priority + 1] or page in self._levels[0]

    def add(self, page: Page, redundant: bool = False) -> None:
        """Make ``page`` the most recently used of its level (idempotent); ``redundant`` pages go first."""
        self.additions += 1
        own, spare = self._levels[page.priority + 1], self._levels[0]
        target, other = (spare, own) if redundant else (own, spare)
        if page in target:
            del target[page]
        elif other and page in other:  # the redundant level is empty on most tiers: one lookup
            del other[page]
        else:
            self._size += 1
        target[page] = None

    def discard(self, page: Page) -> None:
        """Remove ``page`` if present."""
        own, spare = self._levels[page.priority + 1], self._levels[0]
        if page in own:
            del own[page]
            self._size -= 1
        elif spare and page in spare:
            del spare[page]
            self._size -= 1

    def add_new(self, pages: list[Page], redundant: bool = False) -> None:
        """``add`` for pages of a list that have no entry here (they just arrived in the tier, or
        were just made), in order: appended as the most recently used of their levels."""
        if not pages:
            return
        self.additions += 1
        levels = self._levels
        priorities = {page.priority for page in pages}
        if redundant or len(priorities) == 1:  # one level
            level = levels[0 if redundant else pages[0].priority + 1]
            before = len(level)
            for page in pages:  # (cheaper than ``update(dict.fromkeys(pages))``, which builds a dict first)
                level[page] = None
            self._size += len(level) - before
            return
        before = sum(len(levels[p + 1]) for p in priorities)
        for page in pages:
            levels[page.priority + 1][page] = None
        self._size += sum(len(levels[p + 1]) for p in priorities) - before

    def discard_all(self, pages: list[Page]) -> None:
        """``discard`` for every page of a list, in one pass.

        The pages are popped from the level of the first one's priority in one C-level pass (a
        call's pages nearly always share it); those not there are popped from the redundant level
        in another, and looked up one by one in their own levels only while a third level holds
        entries. So a call whose pages have no entry (a cache letting go of pages it locked, which
        were never indexed) costs at most two C-level passes, not a Python loop."""
        if not pages:
            return
        levels = self._levels
        first = levels[pages[0].priority + 1]
        missed = list(map(first.pop, pages, repeat(1)))  # an entry holds None: 1 marks a page not there
        removed = missed.count(None)
        if removed < len(pages):
            rest = list(compress(pages, missed))
            spare = levels[0]
            if spare:
                missed = list(map(spare.pop, rest, repeat(1)))
                removed += missed.count(None)
                rest = list(compress(rest, missed))
            if rest and sum(map(bool, levels)) > bool(first) + bool(spare):  # a third level holds entries
                for page in rest:
                    if levels[page.priority + 1].pop(page, 1) is None:
                        removed += 1
        self._size -= removed

    def take(self, count: int, held_stale: bool = False, unheld_only: bool = False) -> list[Page]:
        """Up to ``count`` pages that may leave now, in eviction order; nothing is removed for them.

        A locked entry is stale, and so is a held one when ``held_stale`` (on the last tier a held
        page may not leave); ``unheld_only`` skips held entries without calling them stale. Stale
        entries passed on the way (and maybe a few just past the last page found) are removed;
        skipped ones stay.
        """
        found: list[Page] = []
        stale: list[Page] = []
        if count > 0 and self._size:
            for level in self._levels:
                if not level:
                    continue
                entries = iter(level)  # read in windows: the pages are checked in C-speed comprehensions
                while len(found) < count:
                    want = count - len(found)
                    window = list(islice(entries, max(want, TAKE_WINDOW)))
                    if not window:
                        break
                    if held_stale or unheld_only:
                        fit = [p for p in window if not (p.locks or p.refs)]
                    else:
                        fit = [p for p in window if not p.locks]
                    if len(fit) < len(window):
                        stale += [p for p in window if p.locks or (held_stale and p.refs)]
                    found += fit[:want]
                if len(found) == count:
                    break
        if stale:
            self.discard_all(stale)
        return found

    def __iter__(self) -> Iterator[Page]:
        """Entries in eviction order, stale ones included. Do not change the index while iterating."""
        if self._size:
            for level in self._levels:
                yield from level

    def first(self) -> Page | None:
        """The first entry (a redundant page when there is one: those are never stale), or None."""
        if self._size:
            for level in self._levels:
                if level:
                    return next(iter(level))
        return None
