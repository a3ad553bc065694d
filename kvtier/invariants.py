"""The debug invariant check: walks every tier, cache and tree node (slow, for tests).

Checked:
- slots are owned once: every allocated slot has exactly one owner page, every free slot none,
  and each page's (tier, slot) points back at its owner entry;
- holders match counts: ``refs`` equals the caches holding a page, ``locks`` the ACTIVE ones
  (no pin outlives an operation); a page nobody holds is published in the tree;
- eviction indexes hold exactly the pages that may be evicted;
- ACTIVE caches have every live page in the primary tier, lengths in order, blocks positional;
- the tree is consistent: parents, chained keys, published pages pointing back, user counts.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvtier.pages import BAD_PAGE_INDEX, Page
from kvtier.residency import PRIMARY
from kvtier.spec import GroupKind
from kvtier.tree import block_key

if TYPE_CHECKING:
    from kvtier.manager import KVCacheManager


def check_manager(mgr: KVCacheManager) -> None:
    """Raise AssertionError describing the first broken invariant."""
    pages = _check_slots(mgr)
    refs, locks, users = _count_holders(mgr)
    for page in pages:
        assert refs[id(page)] == page.refs, f"{page}: refs {page.refs} but {refs[id(page)]} caches hold it"
        assert locks[id(page)] == page.locks, f"{page}: locks {page.locks} but {locks[id(page)]} active holders"
        assert page.refs or page.node is not None, f"{page} is held by nobody but was not freed"
        tier = mgr._tiers[page.tier]
        indexed = page in tier.evictable[page.group]
        assert indexed == tier.may_evict(page), f"{page}: in eviction index={indexed}, may evict={not indexed}"
    owned = {id(p) for p in pages}
    assert all(key in owned for key in refs), "a cache holds a page that no tier owns"
    for tier in mgr._tiers:
        for group, index in enumerate(tier.evictable):
            for page in index:
                assert page.tier == tier.index and page.group == group, f"{page} indexed in the wrong tier/group"
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
                    assert allocator.is_free(slot), f"{tier.name} group {group} slot {slot} used but owned by no page"
                    continue
                assert not allocator.is_free(slot), f"{page} owns a free slot"
                assert (page.tier, page.slot, page.group) == (tier.index, slot, group), f"{page} misplaced"
                assert 0 <= page.locks <= page.refs or page.refs == 0 == page.locks, f"{page}: locks > refs"
                pages.append(page)
    assert len({id(p) for p in pages}) == len(pages), "a page owns two slots"
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
            assert node.users == users[id(node)], f"{node}: users {node.users}, caches using it {users[id(node)]}"
            for tokens, child in node.children.items():
                assert child.parent is node and child.tokens == tokens, f"{child} detached from its parent"
                assert child.key == block_key(node.key, tokens), f"{child}: key is not chained from its parent"
                assert child.block == node.block + 1
                stack.append(child)
            for group, page in enumerate(node.pages):
                if page is not None:
                    assert page.node is node and page.group == group and not page.snapshot_offset, f"{page} vs {node}"
            for offset, page in node.snapshots.items():
                assert page.node is node and page.snapshot_offset == offset, f"snapshot {page} vs {node}"
            if node.parent is not None:
                assert not node.is_empty(), f"{node} is empty but was not pruned"


def _check_cache(mgr: KVCacheManager, cache) -> None:
    tpb = mgr.tokens_per_block
    assert cache._committed <= cache._history <= cache._capacity, f"{cache}: lengths out of order"
    assert len(cache._tokens) == cache._committed, f"{cache}: {len(cache._tokens)} tokens kept"
    nb = -(-cache._capacity // tpb)
    assert cache._num_blocks == nb, f"{cache}: {cache._num_blocks} blocks for capacity {cache._capacity}"
    active = cache._state.value == "active"
    if mgr.config.enable_reuse:
        assert len(cache._nodes) == cache._committed // tpb, f"{cache}: {len(cache._nodes)} published blocks"
    pending_groups = {g for g, _ in cache._pending}
    for rule in mgr._rules:
        g = rule.group_id
        if rule.kind is GroupKind.RECURRENT:
            assert cache._state_page is not None or not active, f"{cache}: active without a state page"
            continue
        blocks = cache._blocks[g]
        assert len(blocks) == nb, f"{cache}: group {g} has {len(blocks)} entries for {nb} blocks"
        live_from = rule.first_live_block(cache._history, tpb)
        for b, page in enumerate(blocks):
            live = b < rule.sink_blocks or b >= live_from
            if live and page is None:
                partial_pending = g in pending_groups and b == cache._committed // tpb
                assert partial_pending, f"{cache}: group {g} block {b} has no page"
            if not live:
                assert page is None, f"{cache}: stale block {b} of group {g} still holds {page}"
            if active and page is not None:
                assert page.tier == PRIMARY, f"{cache}: active but {page} is not in the primary tier"
        if active:
            slots = cache.page_indices(g)
            expect = [BAD_PAGE_INDEX if p is None else p.slot for p in blocks]
            assert slots.tolist() == expect, f"{cache}: page_indices({g}) is stale"
    if active:
        assert not cache._pending, f"{cache}: active with pending copies"
        if cache._state_page is not None:
            assert cache._state_page.tier == PRIMARY
