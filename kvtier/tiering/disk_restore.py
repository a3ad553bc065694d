"""Rebuilding the reuse tree from a disk tier's index when a manager starts on an existing path.

Every row is checked before it is believed. A block row's parent must be a restored block one
level up, and its tokens must hash (under the parent's key) to its key; a top block waits under
the dormant root of its scope's tag (``RadixTree.dormant_root``) and is checked against the
scope's root key when the scope is first used. A page row must name a restored block, a group,
slot and snapshot offset that fit this manager, and no slot or (block, group) another row took.
A row that fails is deleted, and an ERROR line says how many were lost; rows of slots past a
quota that shrank since are dropped with a WARNING that says so (they are not damage). Pages no
match could reach (below a block left without a full-attention page) are dropped too. Page bytes
are verified against their checksum when they are first read.

The page files are checked against the index too (``DiskStorage.found``: their sizes before they
were sized again). A page file that holds none of the pages the index names in it (deleted,
emptied, cut before the first of them) means the directory's files cannot be read: an ERROR
line, every row is removed and the directory starts empty (``disk_resets``), as for an index that
cannot be read. A page file cut short elsewhere loses only the rows whose slots lie past its end,
and the blocks below them (no match could reach those): an ERROR line says how many; if no page
is left at all, the directory is reported as started empty too.
"""

from __future__ import annotations

import logging

from kvtier.errors import InvariantError
from kvtier.lifecycle import GroupRule
from kvtier.pages import Node, Page
from kvtier.reuse.block_keys import block_key
from kvtier.reuse.tree import RadixTree
from kvtier.spec import GroupKind
from kvtier.stats import Counters
from kvtier.storage.disk_index import DiskIndex, NodeRow, PageRow
from kvtier.storage.page_files import DiskStorage
from kvtier.tiering.tier import Tier

log = logging.getLogger(__name__)

KEY_BYTES = 16  # the tree's block keys


def restore_disk_tier(tier: Tier, tree: RadixTree, rules: list[GroupRule], counters: Counters) -> int:
    """Publish the disk tier's indexed pages in ``tree`` as droppable pages; returns how many.

    ``counters.disk_resets`` counts a directory whose index could not be read, or whose page files
    no longer hold its pages (a file deleted or emptied, or no page left): it starts empty.
    """
    index = _index_of(tier)
    counters.disk_resets += index.resets
    tree.scope_tag = index.scope_tag
    storage = tier.storage
    lost_files = _lost_page_files(storage, index, len(rules))
    nodes: dict[bytes, Node] = {}
    rejected_nodes = 0
    for row in index.nodes:
        node = _restore_node(row, tree, nodes)
        if node is None:
            rejected_nodes += 1
            index.delete_node(row.block_key)
        else:
            nodes[row.block_key] = node
            tier.written[row.block_key] = node
    taken: list[set[int]] = [set() for _ in rules]
    restored = rejected_pages = past_quota = dropped = 0
    past_end = [0] * len(rules)  # per group: rows whose slot its page file no longer holds
    for row in index.pages:
        if 0 <= row.group < len(rules) and row.slot >= storage.slots[row.group].num_slots:
            past_quota += 1  # written under a larger disk_bytes: not damage
            index.delete(row.block_key, row.group, row.snapshot_offset)
        elif 0 <= row.group < len(rules) and not _held(storage, row):
            past_end[row.group] += 1  # its bytes are gone: never read, never counted as damage
            index.delete(row.block_key, row.group, row.snapshot_offset)
        elif lost_files:  # the directory starts empty
            dropped += 1
            index.delete(row.block_key, row.group, row.snapshot_offset)
        elif _restore_page(row, tier, tree, rules, nodes, taken) is None:
            rejected_pages += 1
            index.delete(row.block_key, row.group, row.snapshot_offset)
        else:
            restored += 1
    unreachable = _drop_unreachable(tree, tier, rules, index, taken)
    for group, slots in enumerate(taken):
        tier.storage.slots[group].reserve(sorted(slots))
    for group in range(len(rules)):
        for page in tier.owners[group]:
            if page is not None:
                tier.reindex(page)
    _prune(tree, tier)
    index.flush()
    if sum(past_end):
        reset = _report_lost_page_files(storage, index, lost_files, past_end, dropped + restored, unreachable)
        counters.disk_resets += reset
        unreachable = 0 if reset else unreachable  # said in that ERROR line
    lost = index.rejected + rejected_nodes + rejected_pages
    if lost:
        log.error(
            "kvtier disk tier: %d of %d index rows of %s did not check out and were removed (%d block rows, "
            "%d page rows; the pages they named are lost); %d pages restored",
            lost,
            index.rejected + len(index.nodes) + len(index.pages),
            index.path,
            index.rejected + rejected_nodes,
            rejected_pages,
            restored,
        )
    if past_quota:
        log.warning(
            "kvtier disk tier: %d pages of %s lay past its quota (disk_bytes is smaller than when they were "
            "written) and were dropped; %d pages restored",
            past_quota,
            index.path,
            restored,
        )
    if unreachable:
        log.warning(
            "kvtier disk tier: %d pages of %s lay below blocks with no page left (lost, past the quota, or "
            "still in memory when the process ended) and could never be reused; they were dropped",
            unreachable,
            index.path,
        )
    if not tier.writable and index.directory.readable:
        log.warning(
            "kvtier disk tier: %s is read-only (%s): its %d pages are served, nothing new is written there",
            index.directory.path,
            index.directory.why_not_writable,
            restored,
        )
    index.nodes, index.pages = [], []  # read once; the tree holds them now
    return restored


def _held(storage: DiskStorage, row: PageRow) -> bool:
    """Whether the row's page file held its slot's bytes when the tier opened (a bad slot is left to
    the row's other checks)."""
    return row.slot < 0 or storage.found[row.group].holds(row.slot, storage.page_bytes[row.group])


def _lost_page_files(storage: DiskStorage, index: DiskIndex, groups: int) -> list[int]:
    """The groups whose page file holds none of the pages the index names in it (deleted, emptied,
    or cut before the first of them): the directory's files cannot be read."""
    named, held = set(), set()
    for row in index.pages:
        if 0 <= row.group < groups and 0 <= row.slot < storage.slots[row.group].num_slots:
            named.add(row.group)
            if _held(storage, row):
                held.add(row.group)
    return sorted(named - held)


def _report_lost_page_files(
    storage: DiskStorage, index: DiskIndex, lost_files: list[int], past_end: list[int], others: int, unreachable: int
) -> int:
    """One ERROR line for the pages whose page file lost them (``past_end``, per group); of the
    ``others``, ``unreachable`` were dropped after (below a lost block). Returns 1 when the directory
    starts empty (a page file holds none of its pages: every other page goes too; or none is left),
    else 0."""
    what = ", ".join(
        f"{found.name} deleted" if found.missing else f"{found.name} cut to {found.size} bytes"
        for found in storage.found
        if past_end[found.group]
    )
    if lost_files or others == unreachable:
        log.error(
            "kvtier disk tier: the page files of %s do not hold the pages its index names (%s): its %d pages "
            "lost, the directory starts empty",
            index.directory.path,
            what,
            sum(past_end) + others,
        )
        return 1
    log.error(
        "kvtier disk tier: the page files of %s do not hold every page its index names (%s): %d pages whose "
        "bytes are gone were dropped; %d pages restored",
        index.directory.path,
        what,
        sum(past_end),
        others - unreachable,
    )
    return 0


def _restore_node(row: NodeRow, tree: RadixTree, nodes: dict[bytes, Node]) -> Node | None:
    if len(row.block_key) != KEY_BYTES or len(row.tokens) != tree.block_bytes:
        return None
    if row.depth == 0:
        if row.parent_key or len(row.scope_tag) != KEY_BYTES:
            return None
        parent = tree.dormant_root(row.scope_tag)
        if row.tokens in parent.children:
            return None
        return tree.restored_child(parent, row.tokens, row.block_key)
    parent = nodes.get(row.parent_key)
    if parent is None or parent.block != row.depth - 1 or row.scope_tag or row.tokens in parent.children:
        return None
    if block_key(parent.key, row.tokens) != row.block_key:
        return None
    return tree.child(parent, row.tokens)


def _restore_page(
    row: PageRow, tier: Tier, tree: RadixTree, rules: list[GroupRule], nodes: dict[bytes, Node], taken: list[set[int]]
) -> Page | None:
    node = nodes.get(row.block_key)
    if node is None or not 0 <= row.group < len(rules):
        return None
    if row.slot < 0 or row.slot in taken[row.group]:  # (slots past the quota were dropped before)
        return None
    if not 0 <= row.priority <= 100:
        return None
    recurrent = rules[row.group].kind is GroupKind.RECURRENT
    if recurrent != (row.snapshot_offset > 0) or row.snapshot_offset > tree.tokens_per_block:
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
        node.put_snapshot(row.snapshot_offset, page)
    else:
        node.pages[row.group] = page
    tier.owners[row.group][row.slot] = page
    taken[row.group].add(row.slot)
    return page


def _drop_unreachable(
    tree: RadixTree, tier: Tier, rules: list[GroupRule], index: DiskIndex, taken: list[set[int]]
) -> int:
    """Drop the restored pages no match can reach: those of a block, and of every block below it,
    when the block has no page of a full-attention group (a match needs every earlier block's).
    Their rows are deleted and their slots left free. Returns how many were dropped."""
    full = [rule.group_id for rule in rules if rule.kind is GroupKind.ATTENTION]
    if not full:
        return 0
    dropped = 0
    roots = [*tree.roots.values(), *tree.dormant.values()]
    stack = [(child, True) for root in roots for child in root.children.values()]
    while stack:
        node, reachable = stack.pop()
        reachable = reachable and all(node.pages[g] is not None for g in full)
        if not reachable:
            for page in [*node.snapshots.values(), *(p for p in node.pages if p is not None)]:
                index.delete(node.key, page.group, page.snapshot_offset)
                tier.owners[page.group][page.slot] = None
                taken[page.group].discard(page.slot)
                page.node = None
                dropped += 1
            node.pages[:] = [None] * len(node.pages)  # (the same list: the collector does not scan it)
            node.snapshots = {}
        stack.extend((child, reachable) for child in node.children.values())
    return dropped


def _prune(tree: RadixTree, tier: Tier) -> None:
    """Remove restored blocks left holding nothing (no page below them), and their rows."""
    index = _index_of(tier)
    for node in sorted(tree.nodes(dormant=True), key=lambda n: -n.block):
        tree.prune(node)
        if node.parent is None:
            index.delete_node(node.key)
            tier.written.pop(node.key, None)
    for tag, root in list(tree.dormant.items()):
        if not root.children:
            del tree.dormant[tag]


def _index_of(tier: Tier) -> DiskIndex:
    if tier.disk_index is None:
        raise InvariantError(f"the {tier.name} tier is not a disk tier")
    return tier.disk_index
