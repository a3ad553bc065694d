"""A close writes no page a restart could not reach, and a demotion none that no match reaches.

Disk slots are counted per layer group. Before: closing a manager whose disk had no room left for
the full-attention pages of the blocks still in memory still wrote their sliding-window pages
(that group had room), and a demotion wrote the pages of a block whose full-attention page was gone
(or one above it). A match needs a full-attention page in its block and every block above, so the
restart dropped those pages again, with a WARNING ("... lay below blocks with no page left ...
they were dropped"): writes and slots wasted on a clean close. Now ``DiskWritePlanner.persist``
writes a block's pages only with (after) its full-attention pages, when its parent's chain is on
disk too, and a demotion drops such unreachable pages (only the reuse tree holds them) instead of
writing them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

import kvtier
from kvtier.reuse.tokens import as_token_array, encode_tokens
from tests.row_oracle import RowOracle, prefill, reuse

TPB = 4
SWA = 1  # the sliding-window group (group 0 is full attention)
UNREACHABLE = "lay below blocks with no page left"


def make_manager(path, primary: int, disk: int) -> kvtier.KVCacheManager:
    """A full-attention layer and a sliding-window one (8 tokens); tiers sized in pages of each group."""
    spec = kvtier.ModelSpec(
        [kvtier.AttentionLayer(2, 8), kvtier.AttentionLayer(2, 8, window=8)], torch.float16, model_id="persist-swa"
    )
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 20)]))
    page = sum(probe.page_bytes(g.group_id) for g in probe.layer_groups)
    probe.close()
    tiers = [kvtier.PrimaryTier(page * primary), kvtier.DiskTier(page * disk, str(path))]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, device="cpu"))


def prompt(i: int) -> list[int]:
    """Prompt ``i``: 8-28 tokens of its own (2-7 blocks), then two more (a partial block)."""
    rng = np.random.default_rng([i, 1])
    return [int(x) for x in rng.integers(1, 50_000, 8 + 4 * (i % 6))] + [0, i]


def chain(mgr: kvtier.KVCacheManager, tokens: list[int]) -> list:
    """The tree's blocks of ``tokens``' full blocks, root first, as far as they go."""
    tree = mgr._pool.tree
    return tree.walk(tree.root(kvtier.DEFAULT_SCOPE), encode_tokens(as_token_array(tokens)), len(tokens))


def unreachable(mgr: kvtier.KVCacheManager, tier: int | None = None) -> int:
    """Published pages (in ``tier``, or anywhere; restored ones waiting for their scope included) no
    match can reach: in a block that, or a block above which, has no full-attention page."""
    tree = mgr._pool.tree
    count = 0
    roots = [*tree.roots.values(), *tree.dormant.values()]
    stack = [(child, True) for root in roots for child in root.children.values()]
    while stack:
        node, reachable = stack.pop()
        reachable = reachable and node.pages[0] is not None
        if not reachable:
            pages = [page for page in (*node.pages, *node.snapshots.values()) if page is not None]
            count += sum(tier is None or page.tier == tier for page in pages)
        stack.extend((child, reachable) for child in node.children.values())
    return count


def on_disk(mgr: kvtier.KVCacheManager) -> list[int]:
    """Pages of each group on the disk tier."""
    disk = mgr._pool.tiers[-1]
    return [sum(page is not None for page in owners) for owners in disk.owners]


def reopen(path, caplog, rows: RowOracle, primary: int, disk: int) -> kvtier.KVCacheManager:
    """A manager started on the disk again; its restore logged no page it had to drop as unreachable."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        mgr = make_manager(path, primary, disk)
    assert not [r for r in caplog.records if UNREACHABLE in r.getMessage()], caplog.text
    rows.mgr = mgr
    assert sum(on_disk(mgr)) > 0
    assert unreachable(mgr) == 0  # every page restored is reachable
    return mgr


def test_close_writes_no_sliding_window_page_whose_block_finds_no_disk_room(tmp_path, caplog):
    """A disk with room for 3 more full-attention pages and 7 more sliding-window ones when the
    manager closes (the disk dropped its least recently used sliding-window pages), prompt B's 6
    blocks in memory. Before, the close wrote the sliding-window pages of B's blocks 3-5 without
    their full-attention pages, and the restart dropped those 3 pages with a WARNING."""
    mgr = make_manager(tmp_path, primary=8, disk=10)
    rows = RowOracle(mgr)
    a, b = prompt(5), prompt(4)  # 7 and 6 full blocks, and a partial one
    prefill(mgr, rows, a)
    prefill(mgr, rows, b)  # pushes A's blocks to disk
    disk = mgr._pool.tiers[-1]
    assert all(page.tier == 0 for node in chain(mgr, b) for page in node.pages)
    assert mgr._pool.residency.drop_for_room(disk.index, SWA, 7)  # sliding-window pages of A go
    assert [s.num_free for s in disk.storage.slots] == [3, 7]
    mgr.check_invariants()
    mgr.close()

    mgr = reopen(tmp_path, caplog, rows, primary=8, disk=10)
    restored = [node for node in mgr._pool.tree.nodes(dormant=True) if any(node.pages)]
    assert all(node.pages[0] is not None for node in restored)  # no block with a sliding-window page alone
    assert on_disk(mgr)[0] == 10
    assert reuse(mgr, rows, b) == 3 * TPB  # B's blocks 0-2 took the 3 slots, parents first
    assert reuse(mgr, rows, a) > 0
    mgr.check_invariants()
    mgr.close()


def test_demotion_drops_the_pages_of_a_block_no_match_reaches(tmp_path, caplog):
    """A block whose full-attention page is lost: its sliding-window page and the pages of the blocks
    below it are reached by nothing. Pushed out of the primary tier, they are dropped; before, they
    were written to disk, and the restart dropped them with a WARNING."""
    mgr = make_manager(tmp_path, primary=8, disk=32)
    rows = RowOracle(mgr)
    a, b = prompt(5), prompt(4)
    prefill(mgr, rows, a)
    lost = chain(mgr, a)[3]
    mgr._pool.residency.mark_damaged(lost.pages[0], failed_checksum=False)  # block 3's page never arrived
    assert unreachable(mgr) == 7  # block 3's sliding-window page, blocks 4-6's pages
    prefill(mgr, rows, b)  # pushes A's blocks out of the primary tier
    disk = mgr._pool.tiers[-1]
    assert unreachable(mgr) < 7  # pushed out: dropped,
    assert unreachable(mgr, disk.index) == 0  # not written
    assert reuse(mgr, rows, a) == 3 * TPB
    mgr.check_invariants()
    mgr.close()

    mgr = reopen(tmp_path, caplog, rows, primary=8, disk=32)
    assert reuse(mgr, rows, a) == 3 * TPB
    assert reuse(mgr, rows, b) == 6 * TPB
    mgr.check_invariants()
    mgr.close()
