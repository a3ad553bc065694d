"""The debug invariant check: walks every tier, cache and tree node (slow, for tests).

Checked:
- slots are owned once: every allocated slot has exactly one owner page, every free slot none,
  and each page's (tier, slot) points back at its owner entry;
- holders match counts: ``refs`` equals the caches holding a page, ``locks`` the ACTIVE ones
  (no pin outlives an operation); a page nobody holds is published in the tree;
- eviction indexes hold exactly the pages that may be evicted;
- ACTIVE caches have every live page in the primary tier, lengths in order, blocks positional;
- the tree is consistent: parents, chained keys, published pages pointing back, user counts.

A broken invariant raises ``InvariantError``: explicit checks, which ``python -O`` keeps.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvtier.errors import InvariantError
from kvtier.pages import BAD_PAGE_INDEX, Page
from kvtier.residency import PRIMARY
from kvtier.spec import GroupKind
from kvtier.tree import block_key

if TYPE_CHECKING:
    from kvtier.manager import KVCacheManager


def check_manager(mgr: KVCacheManager) -> None:
    """Raise ``InvariantError`` describing the first broken invariant."""
    pages = _check_slots(mgr)
    refs, locks, users = _count_holders(mgr)
    for page in pages:
        if refs[id(page)] != page.refs:
            raise InvariantError(f"{page}: refs {page.refs} but {refs[id(page)]} caches hold it")
        if locks[id(page)] != page.locks:
            raise InvariantError(f"{page}: locks {page.locks} but {locks[id(page)]} active holders")
        if not page.refs and page.node is None:
            raise InvariantError(f"{page} is held by nobody but was not freed")
        tier = mgr._tiers[page.tier]
        indexed = page in tier.evictable[page.group]
        if indexed != tier.may_evict(page):
            raise InvariantError(f"{page}: in eviction index={indexed}, may evict={not indexed}")
    owned = {id(p) for p in pages}
    if not all(key in owned for key in refs):
        raise InvariantError("a cache holds a page that no tier owns")
    for tier in mgr._tiers:
        for group, index in enumerate(tier.evictable):
            for page in index:
                if page.tier != tier.index or page.group != group:
                    raise InvariantError(f"{page} indexed in the wrong tier/group")
    _check_tree(mgr, users)
    for cache in mgr._caches:
        _check_cache(mgr, cache)


def _check_slots(mgr: KVCacheManager) -> list[Page]:
    pages = []
    for tier in mgr._tiers:
        for group, allocator in enumerate(tier.storage.slots):
            allocator.check()
            owners = tier.owners[group]
            for slot, page in enumerate(owners):
                if page is None:
                    if not allocator.is_free(slot):
                        raise InvariantError(f"{tier.name} group {group} slot {slot} used but owned by no page")
                    continue
                if allocator.is_free(slot):
                    raise InvariantError(f"{page} owns a free slot")
                if (page.tier, page.slot, page.group) != (tier.index, slot, group):
                    raise InvariantError(f"{page} misplaced")
                if not (0 <= page.locks <= page.refs or page.refs == 0 == page.locks):
                    raise InvariantError(f"{page}: locks > refs")
                pages.append(page)
    if len({id(p) for p in pages}) != len(pages):
        raise InvariantError("a page owns two slots")
    return pages


def _count_holders(mgr: KVCacheManager) -> tuple[Counter, Counter, Counter]:
    refs: Counter = Counter()
    locks: Counter = Counter()
    users: Counter = Counter()
    for cache in mgr._caches:
        active = cache._state.value == "active"
        held = [p for blocks in cache._blocks for p in blocks if p is not None]
        if cache._state_page is not None:
            held.append(cache._state_page)
        for page in held:
            refs[id(page)] += 1
            locks[id(page)] += active
        for _, source in cache._pending:
            refs[id(source)] += 1
        if cache._pending_snapshot is not None:
            refs[id(cache._pending_snapshot)] += 1
        if cache._nodes:
            users[id(cache._nodes[-1])] += 1  # a cache counts as a user of its deepest node only
    return refs, locks, users


def _check_tree(mgr: KVCacheManager, users: Counter) -> None:
    tree = mgr._tree
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


def _check_cache(mgr: KVCacheManager, cache) -> None:
    tpb = mgr.tokens_per_block
    if not cache._committed <= cache._history <= cache._capacity:
        raise InvariantError(f"{cache}: lengths out of order")
    if len(cache._tokens) != cache._committed:
        raise InvariantError(f"{cache}: {len(cache._tokens)} tokens kept")
    nb = -(-cache._capacity // tpb)
    if cache._num_blocks != nb:
        raise InvariantError(f"{cache}: {cache._num_blocks} blocks for capacity {cache._capacity}")
    active = cache._state.value == "active"
    if mgr.config.enable_reuse and len(cache._nodes) != cache._committed // tpb:
        raise InvariantError(f"{cache}: {len(cache._nodes)} published blocks")
    pending_groups = {g for g, _ in cache._pending}
    for rule in mgr._rules:
        g = rule.group_id
        if rule.kind is GroupKind.RECURRENT:
            if active and cache._state_page is None:
                raise InvariantError(f"{cache}: active without a state page")
            continue
        blocks = cache._blocks[g]
        if len(blocks) != nb:
            raise InvariantError(f"{cache}: group {g} has {len(blocks)} entries for {nb} blocks")
        live_from = rule.first_live_block(cache._history, tpb)
        for b, page in enumerate(blocks):
            live = b < rule.sink_blocks or b >= live_from
            if live and page is None:
                partial_pending = g in pending_groups and b == cache._committed // tpb
                if not partial_pending:
                    raise InvariantError(f"{cache}: group {g} block {b} has no page")
            if not live and page is not None:
                raise InvariantError(f"{cache}: stale block {b} of group {g} still holds {page}")
            if active and page is not None and page.tier != PRIMARY:
                raise InvariantError(f"{cache}: active but {page} is not in the primary tier")
        if active:
            slots = cache.page_indices(g)
            expect = [BAD_PAGE_INDEX if p is None else p.slot for p in blocks]
            if slots.tolist() != expect:
                raise InvariantError(f"{cache}: page_indices({g}) is stale")
    if active:
        if cache._pending:
            raise InvariantError(f"{cache}: active with pending copies")
        if cache._state_page is not None and cache._state_page.tier != PRIMARY:
            raise InvariantError(f"{cache}: active but its state page is not in the primary tier")
