"""Room made in a full cascade never strands the blocks below a dropped block.

Before: with a sliding-window group beside a full-attention one, the disk refused to drop a
block's full-attention page whenever the block below it still had its sliding-window page there,
even when that block's full-attention page was leaving too (and would take it along), so a batch
of victims found no room on disk; ``MovePlanner.make_room`` then dropped primary pages in plain
least-recently-used order, parents first, and the blocks below them stayed in memory and on disk
where no match could reach them (recent prompts lost all reuse, a restart dropped them with a
WARNING). Now the disk counts those pages as leaving with their block (``Tier.orphans``), and
keeps no block for the pages of a block below it that no match can reach
(``Tier._reachable_below``), so the batch finds room there.
"""

from __future__ import annotations

import numpy as np
import torch

import kvtier
from tests.row_oracle import RowOracle, prefill, reuse

TPB = 4


def make_manager(path, kind: str, primary: int, host: int, disk: int) -> kvtier.KVCacheManager:
    """Tiers sized in pages of every group (one full-attention layer, and a second one as ``kind`` says)."""
    second = kvtier.AttentionLayer(2, 8, window=8) if kind == "swa" else kvtier.AttentionLayer(2, 8)
    layers = [kvtier.AttentionLayer(2, 8), second] if kind != "llama" else [kvtier.AttentionLayer(2, 8)]
    spec = kvtier.ModelSpec(layers, torch.float16, model_id=f"chain-{kind}")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 20)]))
    page = sum(probe.page_bytes(g.group_id) for g in probe.layer_groups)
    probe.close()
    tiers = [kvtier.PrimaryTier(page * primary)]
    if host:
        tiers.append(kvtier.HostTier(page * host))
    if disk:
        tiers.append(kvtier.DiskTier(page * disk, str(path)))
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, device="cpu"))


def unreachable(mgr: kvtier.KVCacheManager, tier: int | None = None) -> int:
    """Published pages (in ``tier``, or anywhere) no match can reach: in a block that, or a block
    above which, has no page of a full-attention group."""
    full = [g.group_id for g in mgr.layer_groups if g.kind is kvtier.GroupKind.ATTENTION and g.window is None]
    count = 0
    stack = [(child, True) for root in mgr._pool.tree.roots.values() for child in root.children.values()]
    while stack:
        node, reachable = stack.pop()
        reachable = reachable and all(node.pages[g] is not None for g in full)
        if not reachable:
            pages = [page for page in (*node.pages, *node.snapshots.values()) if page is not None]
            count += sum(tier is None or page.tier == tier for page in pages)
        stack.extend((child, reachable) for child in node.children.values())
    return count


def blocks_in(mgr: kvtier.KVCacheManager, tier: int) -> list[int]:
    """The blocks whose full-attention page is in ``tier``."""
    return sorted(n.block for n in mgr._pool.tree.nodes() if n.pages[0] is not None and n.pages[0].tier == tier)


def prompt(i: int) -> list[int]:
    """Prompt ``i``: 8-28 tokens of its own (2-7 blocks), then two more (a partial block)."""
    rng = np.random.default_rng([i, 1])
    return [int(x) for x in rng.integers(1, 50_000, 8 + 4 * (i % 6))] + [0, i]


def fill_and_probe(path, kind: str) -> tuple[list[int], int]:
    """The audit's run: 16 prompts through primary 12 / host 4 / disk 48 pages; (reuse of prompts
    15..10 asked again, unreachable pages after the fills)."""
    mgr = make_manager(path, kind, primary=12, host=4, disk=48)
    rows = RowOracle(mgr)
    for i in range(16):
        prefill(mgr, rows, prompt(i))
    stranded = unreachable(mgr)
    mgr.check_invariants()
    reused = [reuse(mgr, rows, prompt(i)[:-2] + [99]) for i in (15, 14, 13, 12, 11, 10)]
    assert unreachable(mgr) == 0
    mgr.check_invariants()
    mgr.close()
    return reused, stranded


def test_recent_prompts_keep_their_reuse_when_a_sliding_window_group_shares_the_disk(tmp_path):
    """Before: 15 pages no match could reach sat in host memory and on disk, prompts 12 and 11
    reused nothing while the older prompt 10 kept all of its; with both layers full attention the
    same run stranded nothing. Now the sliding-window layer changes nothing about what is kept."""
    full, full_stranded = fill_and_probe(tmp_path / "full", "full")
    swa, swa_stranded = fill_and_probe(tmp_path / "swa", "swa")
    assert full_stranded == 0
    assert swa_stranded == 0
    assert swa == full
    assert swa[3] > 0 and swa[4] > 0  # prompts 12 and 11


def test_a_block_on_disk_is_not_kept_for_a_block_below_it_that_no_match_can_reach(tmp_path):
    """A block whose full-attention page is gone (lost, damaged) is reached by nothing: its
    sliding-window page left on disk needs no block above it. Before, it kept its parent's pages
    on disk as if a chain went through it."""
    mgr = make_manager(tmp_path, "swa", primary=8, host=0, disk=32)
    rows = RowOracle(mgr)
    prefill(mgr, rows, prompt(5))  # 7 full blocks, pushed to disk by the next prompt (6 blocks)
    prefill(mgr, rows, prompt(4))
    disk = mgr._pool.tiers[-1]
    child = next(node for node in mgr._pool.tree.nodes() if node.block == 6)  # prompt 5's last block
    parent = child.parent
    assert all(page.tier == disk.index for page in (parent.pages[0], *child.pages))
    assert disk.holds_chain_below(parent.pages[0])
    mgr._pool.residency.mark_damaged(child.pages[0], failed_checksum=False)  # lost: nothing reaches the block
    assert child.pages[1] is not None and child.pages[1].tier == disk.index
    assert not disk.holds_chain_below(parent.pages[0])
    assert reuse(mgr, rows, prompt(5)) == 6 * TPB
    mgr.check_invariants()
    mgr.close()


def test_a_batch_of_drops_from_one_chain_on_disk_takes_the_sliding_window_pages_along(tmp_path):
    """Room for several pages on a full disk, the least recently used being one prompt's chain:
    its deepest blocks go, each with its sliding-window page there. Before, every block but the deepest
    counted the sliding-window page of the block below it as a page that still needed it, so no
    batch of two or more found room."""
    mgr = make_manager(tmp_path, "swa", primary=8, host=0, disk=8)
    rows = RowOracle(mgr)
    prefill(mgr, rows, prompt(5))  # 7 full blocks, pushed to disk by the next prompt (6 blocks)
    prefill(mgr, rows, prompt(4))
    disk = mgr._pool.tiers[-1]
    slots = disk.storage.slots[0]
    on_disk = blocks_in(mgr, disk.index)
    assert on_disk == [1, 2, 3, 4, 5, 6]
    assert mgr._pool.residency.drop_for_room(disk.index, 0, slots.num_free + 3)
    on_disk = blocks_in(mgr, disk.index)
    assert on_disk == [1, 2, 3]
    assert unreachable(mgr, disk.index) == 0
    mgr.check_invariants()
    assert reuse(mgr, rows, prompt(5)) == 4 * TPB
    mgr.check_invariants()
    mgr.close()
