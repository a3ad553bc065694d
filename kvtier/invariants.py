"""The debug invariant check: walks every tier, holder and tree node (slow, for tests).

Checked here:
- slots are owned once: every allocated slot has exactly one owner page (or is reserved for
  bytes on their way), every free slot none, and each page's (tier, slot) points back at its
  owner entry;
- holders match counts: ``refs`` equals the caches holding a page, ``locks`` the ACTIVE ones
  plus the pins of background work (a prefetch from disk); no other pin outlives an operation;
  a page nobody holds is published in the tree;
- eviction indexes hold exactly the pages that may be evicted;
- the tree is consistent: parents, chained keys, published pages pointing back, user counts;
- then each holder checks its own (``PageHolder._check_invariants``: a cache's lengths in order,
  blocks positional, every live page of an ACTIVE cache in the primary tier).

A broken invariant raises ``InvariantError``: explicit checks, which ``python -O`` keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.errors import InvariantError
from kvtier.pages import Node, Page
from kvtier.reuse.block_keys import block_key
from kvtier.reuse.tree import RadixTree
from kvtier.tiering.tier import Tier


@dataclass(slots=True)
class Holdings:
    """What one holder holds: ``pages`` (locked too while ``active``), ``unlocked`` pages it holds
    without ever locking them, and the deepest tree node it uses (it counts as that node's user)."""

    pages: list[Page]
    active: bool
    unlocked: list[Page] = field(default_factory=list)
    deepest: Node | None = None


class PageHolder(Protocol):
    """Something that holds pages of a pool: a ``KVCache`` (its two checks are internal to kvtier)."""

    def _holdings(self) -> Holdings: ...

    def _check_invariants(self) -> None:
        """Raise ``InvariantError`` unless the holder's own invariants hold."""
        ...

    def close(self) -> None:
        """Let go of every page it holds."""
        ...


def check_pages(tiers: list[Tier], tree: RadixTree, holders: Iterable[PageHolder], pins: Counter | None = None) -> None:
    """Raise ``InvariantError`` describing the first broken invariant.

    ``pins``: locks held by background work rather than caches (``id(page)`` -> count).
    """
    holders = list(holders)
    pages = _check_slots(tiers)
    refs, locks, users = _count_holders(holders)
    pins = pins or Counter()
    for page in pages:
        if not 0 <= page.locks - pins[id(page)] <= page.refs:
            raise InvariantError(f"{page}: more locks than holders ({pins[id(page)]} background pins)")
        if refs[id(page)] != page.refs:
            raise InvariantError(f"{page}: refs {page.refs} but {refs[id(page)]} caches hold it")
        if locks[id(page)] + pins[id(page)] != page.locks:
            raise InvariantError(f"{page}: locks {page.locks} but {locks[id(page)]} active holders")
        if not page.refs and page.node is None and not pins[id(page)]:  # a pin frees it when it goes
            raise InvariantError(f"{page} is held by nobody but was not freed")
        tier = tiers[page.tier]
        if tier.may_evict(page) and page not in tier.evictable[page.group]:
            raise InvariantError(f"{page} may be evicted but is not in its tier's eviction index")
    owned = {id(p) for p in pages}
    if not all(key in owned for key in refs):
        raise InvariantError("a cache holds a page that no tier owns")
    for tier in tiers:
        for group, index in enumerate(tier.evictable):
            for page in index:
                if page.tier != tier.index or page.group != group:
                    raise InvariantError(f"{page} indexed in the wrong tier/group")
    _check_tree(tree, users)
    for holder in holders:
        holder._check_invariants()


def _check_slots(tiers: list[Tier]) -> list[Page]:
    pages = []
    for tier in tiers:
        for group, allocator in enumerate(tier.storage.slots):
            allocator.check()
            owners = tier.owners[group]
            for slot, page in enumerate(owners):
                if page is None:
                    if not allocator.is_free(slot) and slot not in tier.reserved[group]:
                        raise InvariantError(f"{tier.name} group {group} slot {slot} used but owned by no page")
                    continue
                if allocator.is_free(slot):
                    raise InvariantError(f"{page} owns a free slot")
                if (page.tier, page.slot, page.group) != (tier.index, slot, group):
                    raise InvariantError(f"{page} misplaced")
                pages.append(page)
    if len({id(p) for p in pages}) != len(pages):
        raise InvariantError("a page owns two slots")
    return pages


def _count_holders(holders: list[PageHolder]) -> tuple[Counter, Counter, Counter]:
    refs: Counter = Counter()
    locks: Counter = Counter()
    users: Counter = Counter()
    for holder in holders:
        held = holder._holdings()
        for page in held.pages:
            refs[id(page)] += 1
            locks[id(page)] += held.active
        for page in held.unlocked:
            refs[id(page)] += 1
        if held.deepest is not None:
            users[id(held.deepest)] += 1  # a cache counts as a user of its deepest node only
    return refs, locks, users


def _check_tree(tree: RadixTree, users: Counter) -> None:
    tree.check_runs()
    for root in tree.roots.values():
        stack = [root]
        while stack:
            node = stack.pop()
            if node.users != users[id(node)]:
                raise InvariantError(f"{node}: users {node.users}, caches using it {users[id(node)]}")
            for tokens, child in node.children.items():
                if child.parent is not node or child.tokens != tokens:
                    raise InvariantError(f"{child} detached from its parent")
                if child.key != block_key(node.key, tokens):
                    raise InvariantError(f"{child}: key is not chained from its parent")
                if child.block != node.block + 1:
                    raise InvariantError(f"{child}: block {child.block} under block {node.block}")
                stack.append(child)
            for group, page in enumerate(node.pages):
                if page is not None and (page.node is not node or page.group != group or page.snapshot_offset):
                    raise InvariantError(f"{page} vs {node}")
            for offset, page in node.snapshots.items():
                if page.node is not node or page.snapshot_offset != offset:
                    raise InvariantError(f"snapshot {page} vs {node}")
            if node.parent is not None and node.is_empty():
                raise InvariantError(f"{node} is empty but was not pruned")
