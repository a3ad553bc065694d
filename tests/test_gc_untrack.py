"""The reuse tree's records (nodes, pages, nodes' page lists) are not scanned by Python's cyclic
garbage collector, and still freed: the tree takes its cycles apart when its pool dies.

Before, each cached block cost a full collection 4 tracked objects (about 0.7 ms per 1,000 blocks
on the development CPU, docs/benchmarks.md section 70), a pause on whichever thread the collection
fell (vLLM's scheduler thread under ``kvtier.vllm``).
"""

from __future__ import annotations

import gc
import random
import threading
import time
import tracemalloc

import pytest
import torch

import kvtier
from kvtier.pages import Node, Page

TPB = 16
BLOCKS = 1024


def manager(tmp_path, disk: bool) -> kvtier.KVCacheManager:
    spec = kvtier.ModelSpec.uniform(1, 1, 8, torch.float16, model_id="gc-untrack")
    page = 2 * TPB * 8 * 2
    tiers = [kvtier.PrimaryTier(BLOCKS // 2 * page), kvtier.HostTier(BLOCKS * page)]
    if disk:
        tiers.append(kvtier.DiskTier(BLOCKS * page, tmp_path / "disk"))
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))


def publish(mgr: kvtier.KVCacheManager, blocks: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(blocks // 64):
        tokens = [rng.getrandbits(30) for _ in range(64 * TPB)]
        cache = mgr.create_cache(tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens)
        cache.close()


def test_the_trees_records_are_not_scanned_by_the_collector(tmp_path):
    mgr = manager(tmp_path, disk=False)
    publish(mgr, 256, seed=1)
    node = next(iter(mgr._pool.tree.roots.values()))
    child = next(iter(node.children.values()))
    page = next(p for p in child.pages if p is not None)
    assert isinstance(child, Node) and isinstance(page, Page)
    assert not gc.is_tracked(child) and not gc.is_tracked(page) and not gc.is_tracked(child.pages)
    mgr.close()


def wait_for_thread(name: str) -> None:
    deadline = time.monotonic() + 30
    while any(t.name == name for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped without close"])
def test_a_pool_that_dies_frees_its_tree(tmp_path, disk, closed):
    """Managers of 1,024 cached blocks made and let go of, one after the other: the Python memory
    they leave behind does not grow with them (a tree left whole would keep about 0.5 MB each)."""
    tracemalloc.start()
    try:
        left = []
        for round_ in range(4):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            mgr = manager(tmp_path / str(round_), disk)
            publish(mgr, BLOCKS, seed=round_)
            if closed:
                mgr.close()
            del mgr
            wait_for_thread("kvtier-close-dropped")
            gc.collect()
            left.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    assert max(left[1:]) < 200_000, left  # (the first round also fills caches of Python's own)


@pytest.mark.parametrize("restart", [False, True], ids=["in memory", "restored from disk"])
def test_a_recurrent_models_snapshots_are_not_scanned_by_the_collector(tmp_path, restart):
    """The dict of a node's recurrent state snapshots goes out of the collector's sight with its
    first snapshot (CPython tracks a dict again when a page goes in), also as a restart reads the
    disk index back."""
    spec = kvtier.ModelSpec(
        [kvtier.AttentionLayer(1, 8), kvtier.RecurrentLayer(64)], torch.float16, model_id="gc-untrack-recurrent"
    )
    page = 2 * TPB * 8 * 2
    tiers = [kvtier.PrimaryTier(256 * page), kvtier.HostTier(256 * page), kvtier.DiskTier(512 * page, tmp_path)]
    config = kvtier.CacheConfig(TPB, tiers, snapshot_interval_blocks=1)
    mgr = kvtier.KVCacheManager(spec, config)
    rng = random.Random(3)
    for _ in range(4):
        tokens = [rng.getrandbits(30) for _ in range(16 * TPB)]
        cache = mgr.create_cache(tokens)
        assert cache.resume()
        for end in range(TPB, len(tokens) + 1, TPB):  # a snapshot after each block
            assert cache.resize(end)
            cache.commit(tokens[end - TPB : end])
        cache.close()
    if restart:
        mgr.close()
        mgr = kvtier.KVCacheManager(spec, config)
    nodes = [node for node in mgr._pool.tree.nodes(dormant=True) if node.snapshots]
    assert len(nodes) >= 64
    assert not any(gc.is_tracked(node.snapshots) for node in nodes)
    assert not any(gc.is_tracked(page) for node in nodes for page in node.snapshots.values())
    mgr.close()
