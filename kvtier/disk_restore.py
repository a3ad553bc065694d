"""Rebuilding the reuse tree from a disk tier's index when a manager starts on an existing path.

Every row is checked before it is believed: its scope must decode, its parent must be a root
or an already restored node, its tokens must hash (with the parent's key) to its block key, its
group, slot and snapshot offset must fit this manager, and no two rows may claim one slot or one
(node, group). A row that fails is deleted; the page bytes themselves are verified against the
row's checksum when they are first read.
"""

from __future__ import annotations

import logging

from kvtier.config import ReuseScope
from kvtier.pages import Page
from kvtier.reuse import GroupRule
from kvtier.spec import GroupKind
from kvtier.storage.disk_index import IndexRow
from kvtier.tiers import Tier
from kvtier.tree import Node, RadixTree

log = logging.getLogger(__name__)


def restore_disk_tier(tier: Tier, tree: RadixTree, rules: list[GroupRule]) -> int:
    """Publish the disk tier's indexed pages in ``tree`` as droppable pages; returns how many."""
    index = tier.disk_index
    assert index is not None
    nodes: dict[bytes, Node] = {}
    taken: list[set[int]] = [set() for _ in rules]
    restored = rejected = 0
    for row in index.rows():
        page = _restore_row(row, tier, tree, rules, nodes, taken)
        if page is None:
            rejected += 1
            index.delete(row.block_key, row.group, row.snapshot_offset)
            continue
        restored += 1
    for group, slots in enumerate(taken):
        tier.storage.slots[group].reserve(sorted(slots))
    for group in range(len(rules)):
        for page in tier.owners[group]:
            if page is not None:
                tier.reindex(page)
    for node in sorted(tree.nodes(), key=lambda n: -n.block):
        tree.prune(node)  # restored nodes left holding nothing (their rows were rejected)
    index.flush()
    if rejected:
        log.warning("kvtier disk tier: %d index rows did not check out and were removed", rejected)
    return restored


def _restore_row(
    row: IndexRow, tier: Tier, tree: RadixTree, rules: list[GroupRule], nodes: dict[bytes, Node], taken: list[set[int]]
) -> Page | None:
    if not 0 <= row.group < len(rules) or not 0 <= row.slot < tier.storage.slots[row.group].num_slots:
        return None
    if row.slot in taken[row.group] or len(row.tokens) != tree.block_bytes or not 0 <= row.priority <= 100:
        return None
    recurrent = rules[row.group].kind is GroupKind.RECURRENT
    if recurrent != (row.snapshot_offset > 0) or row.snapshot_offset > tree.tokens_per_block:
        return None
    try:
        scope = ReuseScope.decode(row.scope)
    except ValueError:
        return None
    if row.depth == 0:
        parent = tree.root(scope)
        if row.parent_key != parent.key:
            return None
    else:
        parent = nodes.get(row.parent_key)
        if parent is None or parent.block != row.depth - 1 or parent.scope != scope:
            return None
    node = tree.child(parent, row.tokens)
    if node.key != row.block_key:
        tree.prune(node)
        return None
    occupied = node.snapshots.get(row.snapshot_offset) if recurrent else node.pages[row.group]
    if occupied is not None:
        return None
    page = Page(
        row.group,
        tier.index,
        row.slot,
        row.priority,
        node=node,
        snapshot_offset=row.snapshot_offset,
        checksum=row.checksum,
    )
    if recurrent:
        node.snapshots[row.snapshot_offset] = page
    else:
        node.pages[row.group] = page
    tier.owners[row.group][row.slot] = page
    taken[row.group].add(row.slot)
    nodes[row.block_key] = node
    return page
