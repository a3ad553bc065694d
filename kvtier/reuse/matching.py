"""Finding the longest reusable prefix of a prompt in the tree, under every layer group's hit rule.

At a reuse point ``p`` (tokens whose KV is taken from the cache), a hit needs:

- a full-attention group: a page for every block overlapping ``[0, p)``;
- a sliding-window group with window ``W`` and ``s`` sink blocks: pages for the sink blocks and
  for blocks ``[max(s, (p + 1 - W) // tpb), ceil(p / tpb))`` (the rest are stale at ``p``);
- a recurrent group: a state snapshot taken after exactly ``p`` tokens.

``p`` never exceeds ``len(tokens) - 1``: the last input token is always computed, since it
produces the first output. A ``p`` inside a block (a partial hit) reuses the first
``p % tpb`` tokens of a cached block whose page is copied into a private page on first resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.errors import InvariantError
from kvtier.lifecycle import GroupRule
from kvtier.pages import Node, Page
from kvtier.reuse.tokens import TOKEN_BYTES
from kvtier.reuse.tree import RadixTree
from kvtier.spec import GroupKind


@dataclass(slots=True)
class ReuseMatch:
    """A reuse point and the tree entries that back it.

    ``path_pages[g]``, where present, lists full-attention group ``g``'s pages of the walked path
    (at least as long as ``full_nodes``; None where a node has no page), as matching found them.
    """

    tokens: int  # p, the reused prefix length
    full_nodes: list[Node]  # nodes of the p // tpb full blocks
    partial: Node | None  # the node whose block is partly reused when p % tpb != 0
    path_pages: dict[int, list[Page | None]] = field(default_factory=dict)

    def blocks(self, rule: GroupRule) -> list[Page | None]:
        """An attention group's pages of the full blocks, positional: None where stale at ``p``."""
        g = rule.group_id
        if rule.window is None:
            known = self.path_pages.get(g)
            if known is not None:
                return known[: len(self.full_nodes)]
            return [node.pages[g] for node in self.full_nodes]
        p = self.tokens
        return [node.pages[g] if rule.is_live(b, p) else None for b, node in enumerate(self.full_nodes)]

    def copy_source(self, rule: GroupRule) -> Page | None:
        """What a cache copies into a private page on first resume: the partly reused block's page
        (attention groups), the snapshot at ``p`` (recurrent groups), or None."""
        if rule.kind is GroupKind.RECURRENT:
            return snapshot_at(self, rule.tokens_per_block)
        if self.partial is None:
            return None
        page = self.partial.pages[rule.group_id]
        if page is None:
            raise InvariantError(f"{self.partial} was matched without a page of group {rule.group_id}")
        return page

    def pages(self, rules: list[GroupRule]) -> list[Page]:
        """Every page a cache created for this match would use (deduplicated, group by group in block order)."""
        found: dict[int, Page] = {}
        for rule in rules:
            if rule.kind is not GroupKind.RECURRENT:
                for page in self.blocks(rule):
                    if page is not None:
                        found[id(page)] = page
            source = self.copy_source(rule)
            if source is not None:
                found[id(source)] = source
        return list(found.values())


def find_reuse(
    tree: RadixTree,
    root: Node,
    token_bytes: bytes,
    num_tokens: int,
    rules: list[GroupRule],
    partial_reuse: bool,
) -> ReuseMatch | None:
    """The longest prefix of ``token_bytes`` that every group can reuse, or None."""
    tpb = tree.tokens_per_block
    limit = num_tokens - 1
    if limit <= 0:
        return None
    path = tree.walk(root, token_bytes, limit)
    attention = [r for r in rules if r.kind is not GroupKind.RECURRENT]
    recurrent = [r for r in rules if r.kind is GroupKind.RECURRENT]
    # Full-attention groups need every block: no reuse point past their first missing page.
    path_pages = {r.group_id: [node.pages[r.group_id] for node in path] for r in rules if r.kind is GroupKind.ATTENTION}
    max_blocks = min((_first_missing(pages) for pages in path_pages.values()), default=len(path))

    candidates: list[tuple[int, Node | None]] = []
    if partial_reuse:
        start = max_blocks * tpb
        tail_end = min(start + tpb, limit)
        if tail_end > start:
            parent = path[max_blocks - 1] if max_blocks else root
            tail = token_bytes[start * TOKEN_BYTES : tail_end * TOKEN_BYTES]
            for k, node in tree.partial_children(parent, tail):
                offsets = {k} if not recurrent else {j for j in node.snapshots if j <= k and j < tpb}
                candidates.extend((start + j, node) for j in offsets)
        if recurrent:
            # A snapshot inside a fully matched block (e.g. at the end of an earlier prompt) is a
            # reuse point too: its block is then reused partly, like a partial match.
            for b in range(min(len(path), max_blocks + 1)):
                candidates.extend((b * tpb + j, path[b]) for j in path[b].snapshots if j < tpb and b * tpb + j <= limit)
    candidates.sort(key=lambda c: -c[0])
    # Block boundaries max_blocks * tpb, ..., tpb merged in: every point is tried from the longest down.
    boundary = max_blocks
    for p, partial in candidates:
        while boundary > 0 and boundary * tpb > p:
            if _hit(boundary * tpb, None, path, attention, recurrent, tpb):
                return ReuseMatch(boundary * tpb, path[:boundary], None, path_pages)
            boundary -= 1
        if _hit(p, partial, path, attention, recurrent, tpb):
            return ReuseMatch(p, path[: p // tpb], partial, path_pages)
    for b in range(boundary, 0, -1):
        if _hit(b * tpb, None, path, attention, recurrent, tpb):
            return ReuseMatch(b * tpb, path[:b], None, path_pages)
    return None


def _first_missing(pages: list[Page | None]) -> int:
    """The index of the first None in ``pages``, or ``len(pages)``."""
    try:
        return pages.index(None)
    except ValueError:
        return len(pages)


def _hit(
    p: int, partial: Node | None, path: list[Node], attention: list[GroupRule], recurrent: list[GroupRule], tpb: int
) -> bool:
    full_blocks = p // tpb
    for rule in attention:
        gid = rule.group_id
        if partial is not None and partial.pages[gid] is None:
            return False
        if rule.kind is GroupKind.ATTENTION:
            continue  # full blocks were checked against max_blocks
        for b in range(min(rule.sink_blocks, full_blocks)):
            if path[b].pages[gid] is None:
                return False
        for b in range(rule.first_live_block(p), full_blocks):
            if path[b].pages[gid] is None:
                return False
    for _ in recurrent:
        if partial is not None:
            if p % tpb not in partial.snapshots:
                return False
        elif path[full_blocks - 1].snapshots.get(tpb) is None:
            return False
    return True


def snapshot_at(match: ReuseMatch, tpb: int) -> Page:
    """The recurrent snapshot backing ``match`` (which must satisfy a recurrent group)."""
    if match.partial is not None:
        return match.partial.snapshots[match.tokens % tpb]
    return match.full_nodes[-1].snapshots[tpb]
