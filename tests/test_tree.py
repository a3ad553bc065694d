"""kvtier/reuse/tree.py (block keys, the radix tree) and kvtier/reuse/matching.py (hit rules) on hand-built trees."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import DEFAULT_SCOPE, AttentionLayer, ModelSpec, RecurrentLayer, ReuseScope
from kvtier.errors import InvariantError
from kvtier.lifecycle import GroupRule
from kvtier.pages import Page
from kvtier.reuse.block_keys import block_key, scope_key
from kvtier.reuse.matching import find_reuse, snapshot_at
from kvtier.reuse.tokens import TOKEN_BYTES, encode_tokens
from kvtier.reuse.tree import JUMP_BLOCKS, RadixTree

TPB = 4


def enc(tokens) -> bytes:
    return encode_tokens(array("Q", tokens))


def chain(tree: RadixTree, root, tokens: list[int]):
    """Nodes for the full blocks of ``tokens`` under ``root`` (no pages)."""
    nodes, parent = [], root
    for b in range(len(tokens) // TPB):
        parent = tree.child(parent, enc(tokens[b * TPB : (b + 1) * TPB]))
        nodes.append(parent)
    return nodes


_slots = iter(range(1, 1 << 30))


def put_page(node, group: int) -> Page:
    page = Page(group=group, tier=0, slot=next(_slots), priority=35, node=node)
    node.pages[group] = page
    return page


def put_snapshot(node, group: int, offset: int) -> Page:
    page = Page(group=group, tier=1, slot=next(_slots), priority=35, node=node, snapshot_offset=offset)
    node.snapshots[offset] = page
    return page


# -- keys and token encoding ----------------------------------------------------------------------


def test_encode_tokens_is_little_endian_64_bit():
    data = enc([1, 258, 2**64 - 1, 0])
    assert len(data) == 4 * TOKEN_BYTES
    assert data == (1).to_bytes(8, "little") + (258).to_bytes(8, "little") + b"\xff" * 8 + b"\x00" * 8
    assert enc([]) == b""


def test_scope_root_keys():
    scopes = [
        DEFAULT_SCOPE,
        ReuseScope(lora_id=1),
        ReuseScope(lora_id="1"),
        ReuseScope(salt="1"),
        ReuseScope(salt=b"1"),
        ReuseScope(lora_id=1, salt="1"),
    ]
    keys = [scope_key(s) for s in scopes]
    assert len(set(keys)) == len(scopes)
    assert all(len(k) == 16 for k in keys)
    expected = hashlib.blake2b(b"|scope:i1|-", digest_size=16, person=b"kvtier-root-v2").digest()
    assert scope_key(ReuseScope(lora_id=1)) == expected
    tree = RadixTree(1, TPB)
    assert [tree.root(s).key for s in scopes] == keys


def test_block_keys_chain_from_the_scope_root():
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    b0, b1 = enc([11, 12, 13, 14]), enc([15, 16, 17, 18])
    n0 = tree.child(root, b0)
    n1 = tree.child(n0, b1)
    k0 = hashlib.blake2b(b0, digest_size=16, key=scope_key(DEFAULT_SCOPE)).digest()
    k1 = hashlib.blake2b(b1, digest_size=16, key=k0).digest()
    assert (n0.key, n1.key) == (k0, k1)
    assert block_key(k0, b1) == k1
    # The same block under another parent, or in another scope, has another key.
    assert tree.child(root, b1).key != k1
    other = tree.root(ReuseScope(salt="tenant-b"))
    assert tree.child(other, b0).key != k0
    # Keys do not depend on the tree instance (they name blocks outside the process).
    again = RadixTree(5, TPB)
    assert chain(again, again.root(DEFAULT_SCOPE), [11, 12, 13, 14, 15, 16, 17, 18])[1].key == k1


def test_root_is_created_once_per_scope():
    tree = RadixTree(3, TPB)
    root = tree.root(ReuseScope(lora_id=7))
    assert tree.root(ReuseScope(lora_id=7)) is root
    assert tree.root(DEFAULT_SCOPE) is not root
    assert (root.block, root.parent, root.tokens, root.pages) == (-1, None, b"", [None, None, None])
    assert len(tree.roots) == 2


def test_child_is_created_once():
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    block = enc([1, 2, 3, 4])
    node = tree.child(root, block)
    assert tree.child(root, block) is node
    assert root.children == {block: node}
    assert (node.parent, node.block, node.tokens, node.scope) == (root, 0, block, DEFAULT_SCOPE)
    assert node.pages == [None, None] and node.snapshots == {} and node.users == 0
    grandchild = tree.child(node, enc([5, 6, 7, 8]))
    assert grandchild.block == 1
    assert set(tree.nodes()) == {node, grandchild}


# -- walk / partial_children / prune ----------------------------------------------------------------

TOKENS = list(range(100, 116))  # four blocks


def test_walk_follows_full_blocks_up_to_the_limit():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS[:12])
    data = enc(TOKENS)
    assert tree.walk(root, data, 16) == nodes
    assert tree.walk(root, data, 12) == nodes
    assert tree.walk(root, data, 11) == nodes[:2]
    assert tree.walk(root, data, 4) == nodes[:1]
    assert tree.walk(root, data, 3) == []
    assert tree.walk(root, data, 0) == []
    assert tree.walk(root, enc(TOKENS[:9]), 16) == nodes[:2]  # the input ends first


def test_walk_stops_at_the_first_mismatch():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS)
    changed = [*TOKENS]
    changed[9] = 0  # inside block 2
    assert tree.walk(root, enc(changed), 16) == nodes[:2]
    changed[0] = 0
    assert tree.walk(root, enc(changed), 16) == []
    # A later block that matches again is not reached.
    later = [*TOKENS]
    later[5] = 0
    assert tree.walk(root, enc(later), 16) == nodes[:1]


def walk_block_by_block(tree: RadixTree, root, data: bytes, limit: int):
    """What ``walk`` must return: one dict lookup per block, no runs."""
    path, node, bb = [], root, TPB * TOKEN_BYTES
    for off in range(0, limit // TPB * bb, bb):
        node = node.children.get(data[off : off + bb])
        if node is None:
            break
        path.append(node)
    return path


def test_walk_takes_remembered_runs_only_where_the_bytes_match():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    num_blocks = 3 * JUMP_BLOCKS + 2  # three runs and two blocks
    long = list(range(1000, 1000 + num_blocks * TPB))
    nodes = chain(tree, root, long)
    for _ in range(2):  # the first walk remembers the runs, the second takes them
        assert tree.walk(root, enc(long), len(long)) == nodes
        tree.check_runs()
    j = JUMP_BLOCKS
    for changed_block in (0, 5, j - 1, j, j + 1, 2 * j - 1, 2 * j + 3, num_blocks - 1):
        changed = [*long]
        changed[changed_block * TPB + 1] = 7
        assert tree.walk(root, enc(changed), len(changed)) == nodes[:changed_block]
        assert tree.walk(root, enc(long), len(long)) == nodes
    assert tree.walk(root, enc(long), (j + 4) * TPB + 3) == nodes[: j + 4]
    assert tree.walk(root, enc(long[: (2 * j + 1) * TPB]), len(long)) == nodes[: 2 * j + 1]  # the input ends first
    tree.check_runs()


def test_walk_agrees_with_block_by_block_after_branching_and_pruning():
    rng = random.Random(5)
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    base = list(range(1, (4 * JUMP_BLOCKS + 6) * TPB + 1))
    prompts = []
    for _ in range(60):
        prompt = [*base]
        cut = rng.randrange(len(base))
        prompt[cut:] = [rng.randrange(3) for _ in range(len(base) - cut)]
        prompts.append(prompt)
        nodes = chain(tree, root, prompt)
        tree.walk(root, enc(prompt), len(prompt))  # remembers the runs along it
        if nodes and rng.random() < 0.5:
            tree.prune(nodes[-1])  # drops the branch back to where it meets a kept one
        for other in rng.sample(prompts, min(4, len(prompts))):
            limit = rng.randrange(len(other) + 1)
            assert tree.walk(root, enc(other), limit) == walk_block_by_block(tree, root, enc(other), limit)
        tree.check_runs()


def test_check_runs_finds_a_run_through_a_detached_node():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    long = list(range(1000, 1000 + JUMP_BLOCKS * TPB))
    nodes = chain(tree, root, long)
    tree.walk(root, enc(long), len(long))
    tree.check_runs()
    del nodes[-2].children[nodes[-1].tokens]  # detached behind prune's back
    nodes[-1].parent = None
    with pytest.raises(InvariantError, match="not in the tree"):
        tree.check_runs()


def test_partial_children_rank_by_common_tokens():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    one = tree.child(root, enc([7, 0, 0, 0]))
    three = tree.child(root, enc([7, 8, 9, 0]))
    none = tree.child(root, enc([1, 8, 9, 10]))
    full = tree.child(root, enc([7, 8, 9, 10]))
    got = tree.partial_children(root, enc([7, 8, 9, 10]))
    assert got == [(4, full), (3, three), (1, one)]
    assert none not in [n for _, n in got]
    assert tree.partial_children(root, enc([7, 8])) == [(2, three), (2, full), (1, one)]
    assert tree.partial_children(root, enc([5])) == []
    assert tree.partial_children(root, b"") == []


def test_prune_removes_empty_nodes_upwards_and_then_the_emptied_root():
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    a, b, c = chain(tree, root, TOKENS[:12])
    put_page(a, 1)
    put_page(b, 0)
    tree.prune(c)
    assert b.children == {} and c.parent is None
    assert a.children == {b.tokens: b} and b.parent is a  # b has a page: the walk up stops there
    b.pages[0] = None
    tree.prune(b)
    assert a.children == {} and b.parent is None
    assert root.children == {a.tokens: a}  # a has a page
    a.pages[1] = None
    tree.prune(a)
    assert root.children == {}
    assert tree.roots == {}  # a scope's emptied root goes too: a scope used once costs nothing after
    again = tree.root(DEFAULT_SCOPE)
    assert again is not root and again.key == root.key


def test_prune_walks_up_through_empty_ancestors():
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    *_, deepest = chain(tree, root, TOKENS[:12])
    tree.prune(deepest)
    assert root.children == {}
    assert tree.nodes() == []


@pytest.mark.parametrize("keep", ["page", "snapshot", "users", "child"])
def test_prune_keeps_non_empty_nodes(keep):
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    a, b = chain(tree, root, TOKENS[:8])
    if keep == "page":
        put_page(b, 0)
    elif keep == "snapshot":
        put_snapshot(b, 1, 3)
    elif keep == "users":
        b.users = 1
    else:
        tree.child(b, enc([1, 2, 3, 4]))
    assert not b.is_empty()
    tree.prune(b)
    assert a.children == {b.tokens: b} and b.parent is a
    assert root.children == {a.tokens: a}


def prune_node_by_node(tree: RadixTree, node) -> None:
    """Reference ``prune``: detach while empty, forgetting the run above each detached node by a
    walk up to its anchor for every node."""
    while node.parent is not None and node.is_empty():
        parent = node.parent
        del parent.children[node.tokens]
        node.parent = None
        anchor = parent
        while (anchor.block + 1) % JUMP_BLOCKS and anchor.parent is not None:
            anchor = anchor.parent
        tree._jumps.pop(anchor, None)
        node = parent


BASE = list(range(10, 10 + 4 * JUMP_BLOCKS * TPB))  # tokens >= 10: a tail of small tokens branches off

# (blocks of BASE, then blocks of one small token): prompts sharing a cut and a token share their tails
branches = st.lists(
    st.tuples(st.integers(0, 4 * JUMP_BLOCKS), st.integers(0, 2 * JUMP_BLOCKS), st.integers(0, 2)),
    min_size=1,
    max_size=6,
).filter(lambda shape: any(cut + tail for cut, tail, _ in shape))  # not an empty tree


def paged_tree(shape: list[tuple[int, int, int]]):
    """A tree of the prompts of ``shape``, a page on every node, runs remembered by a walk of each;
    (tree, root, prompts, each prompt's nodes as indices into the tree's nodes in key order, those nodes)."""
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    prompts = [BASE[: cut * TPB] + [token] * (tail * TPB) for cut, tail, token in shape]
    chains = [chain(tree, root, prompt) for prompt in prompts]
    for prompt in prompts:
        tree.walk(root, enc(prompt), len(prompt))
    nodes = sorted(tree.nodes(), key=lambda n: n.key)
    index = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        put_page(node, 0)
    return tree, root, prompts, [[index[n] for n in c] for c in chains], nodes


def tree_state(tree: RadixTree, root):
    """The tree as token paths: its nodes, and its remembered runs (anchor -> run)."""
    path = {root: ()}
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            path[child] = (*path[node], child.tokens)
            stack.append(child)
    runs = {path[a]: (data, [path[n] for n in run]) for a, (data, run) in tree._jumps.items()}
    return sorted(path.values()), runs


@settings(max_examples=150, deadline=None)
@given(branches, st.data())
def test_prune_all_ends_as_pruning_node_by_node(shape, data):
    """A batch of emptied nodes pruned at once leaves the same nodes, the same remembered runs and
    the same walks as pruning them one by one (in any order), and every run still valid."""
    mine, root, prompts, chains, nodes = paged_tree(shape)
    ref, ref_root, _, _, ref_nodes = paged_tree(shape)
    assert tree_state(mine, root) == tree_state(ref, ref_root)
    emptied = set()  # the tail of each prompt from a drawn block, and a few nodes anywhere
    for c in chains:
        emptied.update(c[data.draw(st.integers(0, len(c)), label="kept blocks") :])
    emptied.update(data.draw(st.lists(st.integers(0, len(nodes) - 1), max_size=4), label="also emptied"))
    others = data.draw(st.lists(st.integers(0, len(nodes) - 1), max_size=4), label="also pruned")
    order = data.draw(st.permutations(sorted(emptied) + others), label="order")
    for i in emptied:
        nodes[i].pages[0] = ref_nodes[i].pages[0] = None
    mine.prune_all([nodes[i] for i in order] + [root])
    for i in order:
        prune_node_by_node(ref, ref_nodes[i])
    prune_node_by_node(ref, ref_root)
    assert tree_state(mine, root) == tree_state(ref, ref_root)
    mine.check_runs()
    for prompt in prompts:
        limit = data.draw(st.integers(0, len(prompt)), label="limit")
        expected = walk_block_by_block(mine, root, enc(prompt), limit)
        assert mine.walk(root, enc(prompt), limit) == expected
        assert [n.key for n in ref.walk(ref_root, enc(prompt), limit)] == [n.key for n in expected]


def test_prune_all_forgets_runs_above_a_chain_once():
    """A chain of many blocks detached at once forgets the run of every anchor it passes and the
    one above where it stops, and only those."""
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    j = JUMP_BLOCKS
    long = list(range(1000, 1000 + (3 * j + 5) * TPB))
    nodes = chain(tree, root, long)
    side = chain(tree, nodes[j - 1], [1] * (j * TPB))  # a branch from the first anchor below the root
    tree.walk(root, enc(long), len(long))
    tree.walk(root, enc(long[: j * TPB] + [1] * (j * TPB)), 2 * j * TPB)
    assert set(tree._jumps) == {root, nodes[j - 1], nodes[2 * j - 1]}
    put_page(nodes[j + 3], 0)
    tree.prune_all([nodes[-1]])  # up to nodes[j + 3]: past the anchor nodes[2 * j - 1], stopping below nodes[j - 1]
    assert nodes[j + 3].children == {} and nodes[j + 4].parent is None
    assert set(tree._jumps) == {root}
    assert tree.walk(root, enc(long), len(long)) == nodes[: j + 4]
    assert side[-1].parent is side[-2]
    tree.check_runs()


# -- find_reuse -------------------------------------------------------------------------------------


def rules_of(spec: ModelSpec) -> list[GroupRule]:
    return [GroupRule.of(g, TPB) for g in spec.groups]


def reuse(spec: ModelSpec, tree: RadixTree, root, prompt: list[int], partial: bool = True):
    return find_reuse(tree, root, enc(prompt), len(prompt), rules_of(spec), partial)


FULL = ModelSpec([AttentionLayer(1, 4), AttentionLayer(2, 4)])  # one group: full attention
PROMPT = [*TOKENS[:12], 500, 501]  # three cached blocks, then new tokens


def full_tree(num_blocks: int = 3, missing: tuple[int, ...] = (), spec: ModelSpec = FULL):
    tree = RadixTree(len(spec.groups), TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS[: num_blocks * TPB])
    for b, node in enumerate(nodes):
        if b not in missing:
            put_page(node, 0)
    return tree, root, nodes


def test_full_attention_reuses_every_cached_block():
    tree, root, nodes = full_tree()
    match = reuse(FULL, tree, root, PROMPT)
    assert (match.tokens, match.full_nodes, match.partial) == (12, nodes, None)


@pytest.mark.parametrize(("missing", "expected"), [((2,), 8), ((1,), 4), ((1, 2), 4), ((0,), None), ((0, 2), None)])
def test_full_attention_needs_every_block(missing, expected):
    tree, root, nodes = full_tree(missing=missing)
    match = reuse(FULL, tree, root, PROMPT)
    if expected is None:
        assert match is None
    else:
        assert (match.tokens, match.full_nodes, match.partial) == (expected, nodes[: expected // TPB], None)


def test_other_scope_or_other_tokens_miss():
    tree, root, _ = full_tree()
    assert reuse(FULL, tree, tree.root(ReuseScope(lora_id=1)), PROMPT) is None
    assert reuse(FULL, tree, root, [1, *PROMPT]) is None


@pytest.mark.parametrize("partial", [True, False])
def test_last_input_token_is_never_reused(partial):
    tree, root, nodes = full_tree()
    # The prompt is exactly the cached blocks: at most 11 of its 12 tokens are reused.
    match = reuse(FULL, tree, root, TOKENS[:12], partial)
    if partial:
        assert (match.tokens, match.full_nodes, match.partial) == (11, nodes[:2], nodes[2])
    else:
        assert (match.tokens, match.full_nodes, match.partial) == (8, nodes[:2], None)
    # One more token and the whole three blocks are reused.
    assert reuse(FULL, tree, root, TOKENS[:13], partial).tokens == 12
    assert reuse(FULL, tree, root, TOKENS[:1], partial) is None
    assert reuse(FULL, tree, root, [], partial) is None
    short = reuse(FULL, tree, root, TOKENS[:2], partial)
    if partial:
        assert (short.tokens, short.partial) == (1, nodes[0])
    else:
        assert short is None


def test_partial_reuse_on_and_off():
    tree, root, nodes = full_tree()
    prompt = [*TOKENS[:6], 900, 901, 902]  # shares 2 tokens of block 1
    on = reuse(FULL, tree, root, prompt, partial=True)
    assert (on.tokens, on.full_nodes, on.partial) == (6, nodes[:1], nodes[1])
    off = reuse(FULL, tree, root, prompt, partial=False)
    assert (off.tokens, off.full_nodes, off.partial) == (4, nodes[:1], None)
    first_block = reuse(FULL, tree, root, [*TOKENS[:3], 900, 901], partial=True)
    assert (first_block.tokens, first_block.full_nodes, first_block.partial) == (3, [], nodes[0])
    assert reuse(FULL, tree, root, [*TOKENS[:3], 900, 901], partial=False) is None


def test_partial_reuse_picks_the_longest_sibling_with_a_page():
    tree, root, nodes = full_tree(num_blocks=1)
    three = tree.child(nodes[0], enc([104, 105, 106, 999]))
    one = tree.child(nodes[0], enc([104, 0, 0, 0]))
    put_page(one, 0)
    prompt = [*TOKENS[:4], 104, 105, 106, 7, 8]

    def point():
        match = reuse(FULL, tree, root, prompt)
        return match.tokens, match.full_nodes, match.partial

    assert point() == (5, nodes, one)  # ``three`` matches more tokens but has no page
    put_page(three, 0)
    assert point() == (7, nodes, three)
    one.pages[0] = three.pages[0] = None
    assert point() == (4, nodes, None)


SWA = ModelSpec([AttentionLayer(1, 4, window=6)])  # one group, window 6 (1.5 blocks)
SWA_SINK = ModelSpec([AttentionLayer(1, 4, window=6, sink_tokens=3)])  # one sink block
LONG = [*TOKENS, 777]  # four cached blocks and one new token: the reuse point can be 16


@pytest.mark.parametrize(
    ("spec", "missing", "expected"),
    [
        (SWA, (), 16),
        (SWA, (0, 1), 16),  # at 16, blocks [(17 - 6) // 4, 4) = [2, 4) are needed
        (SWA, (1,), 16),
        (SWA, (3,), 12),  # at 12: [1, 3)
        (SWA, (2,), 8),  # at 12: [1, 3) misses 2; at 8: [0, 2)
        (SWA, (1, 2), 4),  # 16, 12 and 8 each miss a window block; at 4 only [0, 1) is needed
        (SWA_SINK, (1,), 16),  # the sink block 0 is kept, 1 is stale at 16
        (SWA_SINK, (0,), None),  # the sink block is needed at every point
        (SWA_SINK, (0, 1), None),
        (SWA_SINK, (2,), 8),  # at 8: sink 0 + [0, 2)
    ],
)
def test_sliding_window_needs_the_window_and_the_sinks(spec, missing, expected):
    tree, root, nodes = full_tree(num_blocks=4, missing=missing, spec=spec)
    match = reuse(spec, tree, root, LONG)
    if expected is None:
        assert match is None
    else:
        assert (match.tokens, match.full_nodes, match.partial) == (expected, nodes[: expected // TPB], None)


@pytest.mark.parametrize(
    ("window", "sink_tokens", "history", "first_live"),
    [
        (5, 0, 8, 1),  # the token at 8 attends to [4, 8]: block 0 is stale
        (5, 0, 7, 0),  # the token at 7 attends to [3, 7]
        (6, 0, 16, 2),
        (6, 0, 3, 0),  # nothing stale yet (the formula goes negative)
        (100, 0, 50, 0),
        (1, 0, 8, 2),  # only the token itself
        (5, 3, 8, 1),  # one sink block, the stale range [1, 1) is empty
        (5, 5, 20, 4),  # two sink blocks, then blocks [2, 4) stale
        (4, 9, 6, 3),  # three sink blocks: nothing is stale before them
    ],
)
def test_group_rule_first_live_block(window, sink_tokens, history, first_live):
    spec = ModelSpec([AttentionLayer(1, 4, window=window, sink_tokens=sink_tokens), AttentionLayer(1, 4)])
    swa, full = (GroupRule.of(g, TPB) for g in spec.groups)
    assert swa.sink_blocks == -(-sink_tokens // TPB)
    assert swa.first_live_block(history) == first_live
    assert full.first_live_block(history) == 0  # full attention: nothing is ever stale


def test_sliding_window_point_counts_the_token_after_it():
    # Window 5 at reuse point 8: the next token (8) attends to [4, 8], so block 0 is not needed.
    spec = ModelSpec([AttentionLayer(1, 4, window=5)])
    tree, root, nodes = full_tree(num_blocks=2, missing=(0,), spec=spec)
    match = reuse(spec, tree, root, TOKENS[:9])
    assert (match.tokens, match.full_nodes, match.partial) == (8, nodes, None)
    # Window 6 at 8: the token at 8 attends to [3, 8], which reaches into block 0.
    wider = ModelSpec([AttentionLayer(1, 4, window=6)])
    tree, root, _ = full_tree(num_blocks=2, missing=(0,), spec=wider)
    assert reuse(wider, tree, root, TOKENS[:9]) is None


def test_sliding_window_partial_hit_needs_its_block_and_the_window():
    for window, block0, expected in [(6, True, 7), (6, False, None), (2, False, 7)]:
        spec = ModelSpec([AttentionLayer(1, 4, window=window)])
        tree, root, nodes = full_tree(num_blocks=2, missing=() if block0 else (0,), spec=spec)
        prompt = [*TOKENS[:7], 900, 901]  # 3 tokens of block 1
        match = reuse(spec, tree, root, prompt)
        if expected is None:
            assert match is None  # at 7 the window [2, 8) starts in block 0; at 4 too
        else:
            assert (match.tokens, match.partial) == (expected, nodes[1])  # window 2 at 7: only block 1


MIXED = ModelSpec([AttentionLayer(1, 4), AttentionLayer(1, 4, window=6)])  # group 0 full, group 1 window 6


def test_full_and_sliding_window_groups_together():
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS)
    for node in nodes:
        put_page(node, 0)
    for node in nodes[2:]:
        put_page(node, 1)  # the window group dropped its stale blocks
    assert reuse(MIXED, tree, root, LONG).tokens == 16
    nodes[3].pages[1] = None
    assert reuse(MIXED, tree, root, LONG) is None  # 12 needs window blocks [1, 3): 1 is gone
    put_page(nodes[1], 1)
    assert reuse(MIXED, tree, root, LONG).tokens == 12
    nodes[0].pages[0] = None  # full attention needs every block
    assert reuse(MIXED, tree, root, LONG) is None


HYBRID = ModelSpec([AttentionLayer(1, 4), RecurrentLayer(32)])  # group 0 attention, group 1 recurrent


def hybrid_tree(num_blocks: int = 3):
    tree = RadixTree(2, TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS[: num_blocks * TPB])
    for node in nodes:
        put_page(node, 0)
    return tree, root, nodes


def test_recurrent_group_needs_a_snapshot_at_the_point():
    tree, root, nodes = hybrid_tree()
    assert reuse(HYBRID, tree, root, PROMPT) is None  # every block, no snapshot
    snap8 = put_snapshot(nodes[1], 1, TPB)
    match = reuse(HYBRID, tree, root, PROMPT)
    assert (match.tokens, match.full_nodes, match.partial) == (8, nodes[:2], None)
    assert snapshot_at(match, TPB) is snap8
    snap12 = put_snapshot(nodes[2], 1, TPB)
    match = reuse(HYBRID, tree, root, PROMPT)
    assert (match.tokens, match.partial, snapshot_at(match, TPB)) == (12, None, snap12)


def test_recurrent_snapshot_inside_a_block():
    tree, root, nodes = hybrid_tree()
    snap = put_snapshot(nodes[0], 1, 2)
    match = reuse(HYBRID, tree, root, PROMPT)
    assert (match.tokens, match.full_nodes, match.partial) == (2, [], nodes[0])
    assert snapshot_at(match, TPB) is snap


def test_recurrent_snapshot_in_a_partly_matched_block():
    tree, root, nodes = hybrid_tree()
    snap = put_snapshot(nodes[2], 1, 2)
    put_snapshot(nodes[2], 1, TPB)  # past the divergence: not usable
    prompt = [*TOKENS[:11], 900, 901]  # 3 tokens of block 2 match
    match = reuse(HYBRID, tree, root, prompt)
    assert (match.tokens, match.full_nodes, match.partial) == (10, nodes[:2], nodes[2])
    assert snapshot_at(match, TPB) is snap
    nodes[2].pages[0] = None  # the attention group cannot reuse the partial block
    assert reuse(HYBRID, tree, root, prompt) is None


def test_recurrent_snapshot_never_covers_the_last_token():
    tree, root, nodes = hybrid_tree(num_blocks=2)
    put_snapshot(nodes[1], 1, TPB)
    snap7 = put_snapshot(nodes[1], 1, 3)
    match = reuse(HYBRID, tree, root, TOKENS[:8])  # the snapshot at 8 would cover the last token
    assert (match.tokens, match.partial, snapshot_at(match, TPB)) == (7, nodes[1], snap7)


def test_only_recurrent_layers():
    spec = ModelSpec([RecurrentLayer(16)])
    tree = RadixTree(1, TPB)
    root = tree.root(DEFAULT_SCOPE)
    nodes = chain(tree, root, TOKENS[:12])  # no block pages at all: a recurrent group needs none
    assert reuse(spec, tree, root, PROMPT) is None
    put_snapshot(nodes[2], 0, TPB)
    assert reuse(spec, tree, root, PROMPT).tokens == 12


@pytest.mark.parametrize(
    ("earlier", "prompt"),
    [
        ((0, 2), PROMPT),  # a snapshot after 2 tokens (an earlier 2-token prompt) hides the one after 8
        ((1, 3), TOKENS[:9]),  # a snapshot after 7 tokens hides the one after 8
    ],
)
def test_recurrent_reuse_takes_the_longest_snapshot(earlier, prompt):
    tree, root, nodes = hybrid_tree()
    block, offset = earlier
    put_snapshot(nodes[block], 1, offset)
    snap8 = put_snapshot(nodes[1], 1, TPB)
    match = reuse(HYBRID, tree, root, prompt)
    assert (match.tokens, match.full_nodes, match.partial, snapshot_at(match, TPB)) == (8, nodes[:2], None, snap8)
