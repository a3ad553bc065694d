"""The reuse points of a match and what each loads (``kvtier.reuse.reuse_points``), and the
load-or-recompute decision that prices them on models with sliding windows and recurrent states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import kvtier
from kvtier.reuse.matching import find_reuse
from kvtier.reuse.reuse_points import reuse_points
from kvtier.reuse.tokens import encode_tokens

TPB = 4


def publish(mgr: kvtier.KVCacheManager, tokens: list[int], block_by_block: bool = True) -> None:
    """Serve ``tokens`` as one request; committed a block at a time, each boundary is a snapshot point."""
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    step = TPB if block_by_block else len(tokens)
    for start in range(cache.num_committed_tokens, len(tokens), step):
        end = min(start + step, len(tokens))
        assert cache.resize(end)
        cache.commit(tokens[start:end])
    cache.close()
    mgr.maintain()


def hybrid_spec(window: int, sink: int) -> kvtier.ModelSpec:
    layers = [
        kvtier.AttentionLayer(1, 8),
        kvtier.AttentionLayer(2, 8, window=window, sink_tokens=sink),
        kvtier.RecurrentLayer(512),
    ]
    return kvtier.ModelSpec(layers, torch.float16, model_id="reuse-points")


def bytes_by_tier(pages, mgr: kvtier.KVCacheManager, num_tiers: int) -> list[int]:
    out = [0] * num_tiers
    for page in pages:
        out[page.tier] += mgr.page_bytes(page.group)
    return out


@pytest.mark.parametrize(
    ("window", "sink", "interval", "seed"), [(6, 0, 2, 0), (9, 4, 1, 1), (4, 1, 3, 2), (1, 0, 1, 3)]
)
def test_each_point_loads_what_a_cache_reusing_that_far_uses(window, sink, interval, seed):
    """For every block boundary: it is a point exactly where matching has a hit, and the point's bytes
    per tier are those of the pages a match cut there would use; pages spread over both tiers."""
    rng = random.Random(seed)
    spec = hybrid_spec(window, sink)
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = max(probe.page_bytes(g) for g in range(3))
    probe.close()
    tiers = [kvtier.PrimaryTier(96 * page), kvtier.HostTier(1 << 20)]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers, snapshot_interval_blocks=interval))
    prompt = [rng.randrange(1, 1000) for _ in range(20 * TPB + 3)]
    publish(mgr, prompt)
    for _ in range(8):  # others push part of the prompt's pages down to host memory
        publish(mgr, [rng.randrange(1000, 2000) for _ in range(12 * TPB)])
    pool = mgr._pool
    root = pool.tree.find_root(kvtier.ReuseScope())
    token_bytes = encode_tokens(np.array(prompt + [7], dtype=np.uint64))
    match = find_reuse(pool.tree, root, token_bytes, len(prompt) + 1, pool.rules, True)
    points = reuse_points(match, pool.rules, pool.tiers[0].storage.page_bytes, 2)
    assert points.tokens[0] == 0 and points.tokens[-1] == match.tokens
    assert points.tokens == sorted(set(points.tokens))
    on_host = 0
    for c in range(1, len(match.full_nodes) + 1):
        cut = find_reuse(pool.tree, root, token_bytes, c * TPB + 1, pool.rules, True)
        if cut is None or cut.tokens != c * TPB:
            assert c * TPB not in points.tokens
            continue
        k = points.tokens.index(c * TPB)
        assert points.tier_bytes[k].tolist() == bytes_by_tier(cut.pages(pool.rules), mgr, 2)
        on_host += points.tier_bytes[k][1] > 0
    assert points.tier_bytes[-1].tolist() == bytes_by_tier(match.pages(pool.rules), mgr, 2)
    assert on_host, "no point loads from host memory: the case tests nothing"
    mgr.close()


def disk_manager(spec: kvtier.ModelSpec, tmp_path, interval: int) -> kvtier.KVCacheManager:
    tiers = [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(64 << 20, str(tmp_path))]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers, snapshot_interval_blocks=interval))


def test_a_recurrent_snapshot_slower_to_load_than_recomputing_is_recomputed(tmp_path):
    """A large state snapshot on disk is priced: a short prompt behind it is recomputed."""
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 8), kvtier.RecurrentLayer(256 << 10)], torch.float16)
    prompt = [random.randrange(1, 1000) for _ in range(8 * TPB)]
    with disk_manager(spec, tmp_path, 8) as mgr:
        publish(mgr, prompt, block_by_block=False)
    with disk_manager(spec, tmp_path, 8) as mgr:  # restarted: every page is on disk
        pool = mgr._pool
        pool.load_cost.bandwidth[pool.disk_tier] = 1e8  # 100 MB/s: the snapshot alone takes 2.6 ms
        blocks = 8 * mgr.page_bytes(0) / 1e8  # the attention pages: 2.6 us
        mgr.set_prefill_rate(len(prompt) / (30 * blocks))  # recomputing the prompt: 79 us
        cache = mgr.create_cache(prompt + [5])
        assert cache.num_reused_tokens == 0
        assert mgr.stats().recomputed_tokens == len(prompt)
        cache.close()


def test_stale_sliding_window_pages_are_not_priced(tmp_path):
    """Reusing a long prefix of a sliding-window model loads only the window's blocks (and one
    snapshot): it is taken where loading every block would have been slower than recomputing."""
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(8, 128, window=4), kvtier.RecurrentLayer(256)], torch.float16)
    prompt = [random.randrange(1, 1000) for _ in range(64 * TPB)]
    with disk_manager(spec, tmp_path, 1) as mgr:
        publish(mgr, prompt)
    with disk_manager(spec, tmp_path, 1) as mgr:
        pool = mgr._pool
        pool.load_cost.bandwidth[pool.disk_tier] = 1e8
        window = (mgr.page_bytes(0) + mgr.page_bytes(1)) / 1e8  # one block in the window and a snapshot
        every_block = 64 * mgr.page_bytes(0) / 1e8
        mgr.set_prefill_rate(len(prompt) / (window * every_block) ** 0.5)  # recomputing costs between the two
        cache = mgr.create_cache(prompt + [5])
        assert cache.num_reused_tokens == len(prompt)
        assert cache.reused_by_tier["disk"] > 0
        assert mgr.stats().recomputed_tokens == 0
        cache.close()
