"""The radix tree of reusable blocks, one root per reuse scope.

A node is one full block of ``tokens_per_block`` tokens under its parent (the root is the empty
prefix of a scope). Children are found by the block's exact token bytes, so matching a prompt
needs no cryptographic hash; every node also carries its chained block key
(``kvtier.reuse.block_keys``), which names the block outside the process (disk index, connectors).

A node (``kvtier.pages.Node``) holds, per layer group, the page published for its block (or
None), and recurrent state snapshots keyed by the offset inside the block after which they were
taken. A node with no page, no snapshot, no child and no cache using it is pruned; a scope's
root with no child left is dropped (created again when the scope is used again). Nodes, their
pages and their dicts of children and snapshots are not scanned by the cyclic garbage collector
(``kvtier.gc_untrack``): a pruned node leaves no cycle behind, and ``dismantle`` takes the whole
tree apart when its pool dies.

Walking a long prompt compares whole runs of ``JUMP_BLOCKS`` blocks at once where it can: an
*anchor* (a root, or a node whose depth is a multiple of ``JUMP_BLOCKS``) remembers the run of
``JUMP_BLOCKS`` nodes below it that a walk last followed, with their tokens' bytes. A later walk
through the anchor takes the whole run with one comparison of bytes when the prompt has the same
bytes there, and goes block by block otherwise (remembering the run it found instead). Invariant
(``check_runs``): a remembered run is a chain of attached nodes under its anchor; ``prune`` and
``prune_all`` forget the run of the anchor above each node they detach (the anchor whose run
would hold it, whether or not it does). So a run is exactly what the block-by-block walk would
find for its bytes.

Blocks restored from a disk tier whose scope is not known yet (the index stores a scope only as
a keyed hash, its *tag*) wait under a *dormant* root per tag, outside ``roots``: nothing matches
them. The first use of a scope whose tag has a dormant root claims it: each top block whose key
chains from the scope's real root key moves under that root (with its subtree); a block that
does not stays unreachable, and its pages age out like any other droppable page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.config import ReuseScope
from kvtier.errors import InvariantError
from kvtier.pages import Node
from kvtier.reuse.block_keys import block_key, scope_key
from kvtier.reuse.tokens import TOKEN_BYTES

JUMP_BLOCKS = 32  # blocks in a run that a walk compares at once (512 tokens at 16 tokens per block)


class RadixTree:
    """Blocks published for reuse, per scope."""

    def __init__(self, num_groups: int, tokens_per_block: int, namespace: bytes = b"") -> None:
        self.num_groups = num_groups
        self.namespace = namespace
        self.tokens_per_block = tokens_per_block
        self.block_bytes = tokens_per_block * TOKEN_BYTES
        self.roots: dict[ReuseScope, Node] = {}
        self.dormant: dict[bytes, Node] = {}  # tag -> root of restored blocks whose scope was not used yet
        self.scope_tag: Callable[[bytes], bytes] | None = None  # an encoded scope's tag (set with ``dormant``)
        self._jumps: dict[Node, tuple[bytes, tuple[Node, ...]]] = {}  # anchor -> (run's bytes, run's nodes)

    def root(self, scope: ReuseScope) -> Node:
        """The root of ``scope`` (created on first use, claiming the scope's restored blocks)."""
        node = self.roots.get(scope)
        if node is None:
            node = self.roots[scope] = Node(None, b"", scope_key(scope, self.namespace), self.num_groups, scope)
            if self.dormant:
                self._claim(node)
        return node

    def find_root(self, scope: ReuseScope) -> Node | None:
        """The root of ``scope`` if it has one or restored blocks wait for it; else None (nothing to match)."""
        node = self.roots.get(scope)
        if node is None and self.dormant and self._tag(scope) in self.dormant:
            node = self.root(scope)
        return node

    def dormant_root(self, tag: bytes) -> Node:
        """The root under which restored blocks of the scope with this tag wait (created if absent)."""
        node = self.dormant.get(tag)
        if node is None:
            node = self.dormant[tag] = Node(None, b"", b"", self.num_groups, None)
        return node

    def restored_child(self, parent: Node, block_tokens: bytes, key: bytes) -> Node:
        """A new child of a dormant root with the key its index row gives (checked when claimed)."""
        node = Node(parent, block_tokens, key, self.num_groups, None)
        parent.add_child(block_tokens, node)
        return node

    def _tag(self, scope: ReuseScope) -> bytes:
        if self.scope_tag is None:
            raise InvariantError("dormant roots come with their tag function")
        return self.scope_tag(scope.encode())

    def _claim(self, root: Node) -> None:
        """Move the restored blocks of ``root``'s scope under it; those whose key does not chain stay out."""
        waiting = self.dormant.pop(self._tag(root.scope), None)  # type: ignore[arg-type]
        if waiting is None:
            return
        for tokens, node in list(waiting.children.items()):
            if node.key != block_key(root.key, tokens):
                continue
            del waiting.children[tokens]
            node.parent = root
            root.add_child(tokens, node)
            stack = [node]
            while stack:
                n = stack.pop()
                n.scope = root.scope
                stack.extend(n.children.values())

    def child(self, parent: Node, block_tokens: bytes) -> Node:
        """The child of ``parent`` for these block tokens, created if absent."""
        node = parent.children.get(block_tokens)
        if node is None:
            key = block_key(parent.key, block_tokens)
            node = Node(parent, block_tokens, key, self.num_groups, parent.scope)
            parent.add_child(block_tokens, node)
        return node

    def walk(self, root: Node, token_bytes: bytes, limit: int) -> list[Node]:
        """Nodes of the longest chain of full blocks under ``root`` matching ``token_bytes[: limit tokens]``.

        Whole runs of ``JUMP_BLOCKS`` blocks are compared at once where their anchor remembers a
        run with the same bytes (see the module's docstring); the rest block by block.
        """
        path: list[Node] = []
        bb = self.block_bytes
        end = (limit // self.tokens_per_block) * bb
        span = JUMP_BLOCKS * bb
        jumps = self._jumps
        node = root
        off = 0
        while off + span <= end:
            jump = jumps.get(node)
            if jump is not None and token_bytes.startswith(jump[0], off):
                path.extend(jump[1])
            elif self._step(node, token_bytes, off, off + span, path):
                jumps[node] = (token_bytes[off : off + span], tuple(path[-JUMP_BLOCKS:]))
            else:
                return path
            node = path[-1]
            off += span
        self._step(node, token_bytes, off, end, path)
        return path

    def _step(self, node: Node, token_bytes: bytes, off: int, end: int, path: list[Node]) -> bool:
        """Append to ``path`` the nodes below ``node`` matching ``token_bytes[off:end]`` block by block;
        whether every block there matched."""
        bb = self.block_bytes
        children = node.children
        for o in range(off, end, bb):
            node = children.get(token_bytes[o : o + bb])
            if node is None:
                return False
            path.append(node)
            children = node.children
        return True

    def partial_children(self, parent: Node, tail: bytes) -> list[tuple[int, Node]]:
        """Children of ``parent`` whose block starts with some of ``tail``: (matched tokens, node), best first."""
        found = []
        for node in parent.children.values():
            k = _common_tokens(node.tokens, tail)
            if k:
                found.append((k, node))
        found.sort(key=lambda x: -x[0])
        return found

    def prune(self, node: Node) -> None:
        """Remove ``node`` and then its ancestors while they are empty (a scope's root, once
        emptied, is dropped too)."""
        if node.parent is not None and node.is_empty():  # (else nothing to remove: no batch to set up)
            self.prune_all((node,))

    def prune_all(self, nodes: Iterable[Node]) -> None:
        """``prune`` each of ``nodes``; the tree and its remembered runs end the same in any order.

        Every run through a detached node is forgotten (the module's invariant): its anchor is the
        nearest anchor at or above the node's parent. A chain detached in one climb forgets the
        anchors it climbs past as it goes, then the one above the node where it stopped, found by
        one walk up after the batch; walks up share the nodes they pass, so each node is walked
        through at most once per batch, not once per detached node below it.
        """
        jumps = self._jumps
        stops: list[Node] = []  # attached nodes that are not anchors, where a climb stopped
        for node in nodes:
            parent = node.parent
            # (``Node.is_empty``, inlined here and below: this runs for every page dropped)
            if parent is None or node.children or node.snapshots or node.users or any(node.pages):
                continue
            while True:
                del parent.children[node.tokens]
                node.parent = None
                if (parent.block + 1) % JUMP_BLOCKS == 0:  # an anchor (a root's block is -1)
                    jumps.pop(parent, None)
                node, parent = parent, parent.parent
                if parent is None or node.children or node.snapshots or node.users or any(node.pages):
                    break
            if parent is None and not node.children:
                self.forget_root(node)
            if (node.block + 1) % JUMP_BLOCKS:
                stops.append(node)
        walked: set[Node] = set()
        for node in stops:
            if node.parent is None:
                continue  # detached later in the batch, which forgot the same anchor's run
            while (node.block + 1) % JUMP_BLOCKS and node not in walked:
                walked.add(node)
                node = node.parent  # type: ignore[assignment]  # (attached below an anchor)
            jumps.pop(node, None)  # the anchor, or a node walked from before (its anchor is gone)

    def dismantle(self) -> None:
        """Take every node apart (its children, parent, pages and snapshots, each page's node), for
        a tree whose pool died. Its records are not scanned by the cyclic garbage collector
        (``kvtier.gc_untrack``), so the cycles among them are broken here; reference counting then
        frees them."""
        stack = [*self.roots.values(), *self.dormant.values()]
        self.roots.clear()
        self.dormant.clear()
        self._jumps.clear()
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.children.clear()
            node.parent = None
            for page in (*node.pages, *node.snapshots.values()):
                if page is not None:
                    page.node = None
            node.pages[:] = [None] * len(node.pages)
            node.snapshots.clear()

    def forget_root(self, root: Node) -> None:
        """Drop an emptied scope root (not a dormant one), so that a scope used once costs nothing
        after its blocks are gone (no cache holds a root: each publishes under its scope's current one)."""
        if root.scope is not None and self.roots.get(root.scope) is root:
            del self.roots[root.scope]
            self._jumps.pop(root, None)

    def check_runs(self) -> None:
        """``InvariantError`` unless every remembered run is ``JUMP_BLOCKS`` attached nodes chained
        from its anchor whose tokens are the run's bytes (slow: ``check_invariants``)."""
        for anchor, (data, run) in self._jumps.items():
            parent = anchor
            for node in run:
                if node.parent is not parent or parent.children.get(node.tokens) is not node:
                    raise InvariantError(f"the run below {anchor} holds {node}, which is not in the tree there")
                parent = node
            if len(run) != JUMP_BLOCKS or data != b"".join(node.tokens for node in run):
                raise InvariantError(f"the run below {anchor} does not match its bytes")

    def nodes(self, dormant: bool = False) -> list[Node]:
        """Every node except the roots, and with ``dormant`` those waiting for their scope (not for hot paths)."""
        out = []
        stack = list(self.roots.values()) + (list(self.dormant.values()) if dormant else [])
        while stack:
            node = stack.pop()
            for c in node.children.values():
                out.append(c)
                stack.append(c)
        return out


def _common_tokens(a: bytes, b: bytes) -> int:
    """Number of whole leading tokens that ``a`` and ``b`` share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    k = 0
    while k < n and a[k * TOKEN_BYTES : (k + 1) * TOKEN_BYTES] == b[k * TOKEN_BYTES : (k + 1) * TOKEN_BYTES]:
        k += 1
    return k
