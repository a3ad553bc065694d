"""``PublishedChain``: one cache's committed full blocks in the reuse tree, and its snapshots.

``nodes[b]`` is the tree node of the cache's committed full block ``b``. Only the deepest node
counts the cache as a user: every ancestor has a child, so none of the chain is pruned while
the cache uses it. Publishing a block puts the cache's pages of it in its node, where the node
has none for that group yet (the page then points back at the node); a page the node has
already (the cache computed the block again) is used as a match would use it (``PagePool.touch``).

A recurrent state snapshot taken where no block of the chain ends yet (the end of the input,
inside a block) waits as ``pending_snapshot``, held by the cache, until its block is published.
"""

from __future__ import annotations

from array import array

from kvtier.block_table import BlockTable
from kvtier.config import ReuseScope
from kvtier.errors import InvariantError
from kvtier.pages import Node, Page
from kvtier.pool import PagePool
from kvtier.reuse.tokens import encode_tokens


class PublishedChain:
    """The nodes of one cache's published blocks under the root of ``scope`` (None: reuse is off).

    The chain holds no root: the scope's root is made when its first block is published (a cache
    that publishes nothing leaves no root behind), and one emptied meanwhile is made anew.
    """

    __slots__ = ("_pool", "nodes", "pending_snapshot", "scope")

    def __init__(self, pool: PagePool, scope: ReuseScope | None) -> None:
        self._pool = pool
        self.scope = scope
        self.nodes: list[Node] = []
        self.pending_snapshot: Page | None = None

    @property
    def deepest(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None

    def adopt(self, nodes: list[Node]) -> None:
        """Use the chain of a matched prefix (the cache starts empty)."""
        self.nodes = list(nodes)
        if self.nodes:
            self.nodes[-1].users += 1  # protects the whole path: every ancestor has a child

    def publish(self, tokens: array, table: BlockTable, full_blocks: int, input_len: int) -> None:
        """Publish the committed full blocks ``len(nodes) .. full_blocks - 1`` of ``tokens``."""
        pool = self._pool
        tree = pool.tree
        tpb = pool.tokens_per_block
        deepest = self.deepest
        if self.scope is None:
            raise InvariantError("publishing needs a scope: reuse is off")
        parent = deepest or tree.root(self.scope)
        found: list[Page] = []  # pages the tree had for blocks computed again
        for b in range(len(self.nodes), full_blocks):
            node = tree.child(parent, encode_tokens(tokens[b * tpb : (b + 1) * tpb]))
            self.nodes.append(node)
            for rule in pool.attention_rules:
                g = rule.group_id
                page = table.blocks[g][b]
                there = node.pages[g]
                if there is not None and there is not page:
                    found.append(there)
                elif page is not None and page.node is None:
                    node.pages[g] = page
                    page.node = node
            pending = self.pending_snapshot
            if pending is not None and (input_len - 1) // tpb == b:
                self.pending_snapshot = None
                self._attach_snapshot(pending, node, input_len - b * tpb)
            parent = node
        self.nodes[-1].users += 1  # the use moves to the new deepest node; the old one has a child now
        if deepest is not None:
            deepest.users -= 1
        if found:
            pool.touch(found[::-1])  # deepest first: a block's parent ends the more recently used

    def snapshot(self, position: int, state_page: Page, priority: int, stream=None) -> None:
        """Keep a copy of the live recurrent state after ``position`` tokens, for reuse; the copy
        runs on ``stream``, where the cache writes the state.

        Skipped when the block already has one there, or when no room can be made (a snapshot is
        only for reuse: it never fails the commit).
        """
        tpb = self._pool.tokens_per_block
        block = (position - 1) // tpb
        offset = position - block * tpb
        node = self.nodes[block] if block < len(self.nodes) else None
        if node is not None and offset in node.snapshots:
            return
        page = self._pool.copy_page(state_page, priority, stream)
        if page is None:
            return
        if node is not None:
            self._attach_snapshot(page, node, offset)
            return
        if self.pending_snapshot is not None:
            self._pool.residency.release(self.pending_snapshot, locked=False)
        self.pending_snapshot = page

    def _attach_snapshot(self, page: Page, node: Node, offset: int) -> None:
        """Hand a snapshot page the cache holds over to the tree (or let it go if one is there)."""
        if offset not in node.snapshots:
            node.put_snapshot(offset, page)
            page.node = node
            page.snapshot_offset = offset
        self._pool.residency.release(page, locked=False)

    def stop(self) -> None:
        """Publish nothing more (the cache's scope was forgotten: what it computes from now on is of
        the weights that scope no longer serves); the chain is let go of, as by ``drop``."""
        self.drop()
        self.scope = None

    def drop(self) -> None:
        """Let go of the pending snapshot and of the chain (pruning what no one else uses)."""
        snapshot, nodes = self.pending_snapshot, self.nodes  # detached first: an interrupt never releases twice
        self.pending_snapshot, self.nodes = None, []
        try:
            if snapshot is not None:
                self._pool.residency.release(snapshot, locked=False)
        finally:
            if nodes:
                deepest = nodes[-1]
                deepest.users -= 1
                self._pool.tree.prune(deepest)
