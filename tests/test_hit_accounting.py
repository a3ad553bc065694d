"""``stats().hit_tokens`` counts the reuse a request really uses, by the tier it came from.

A cache's reuse counts once settled, at its first ``commit`` or its ``close``; reuse given up before
(a checksum failure on the way in, ``shorten_reuse``, ``recompute_from``) counts in
``recomputed_tokens`` instead, and no count ever goes down; a block with no page of
its own (stale in a sliding window, between recurrent snapshots) counts for the tier of the pages
after it; ``cache_for_prefix`` is the same request: no second lookup.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kvtier
from kvtier.errors import CacheStateError

TPB = 4


def serve(mgr: kvtier.KVCacheManager, tokens: list[int], chunk: int | None = None) -> None:
    """Run ``tokens`` as a request (committed ``chunk`` tokens at a time) and close it."""
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    step = chunk or len(tokens)
    for start in range(cache.num_committed_tokens, len(tokens), step):
        cache.commit(tokens[start : start + step])
    cache.close()


def fillers(mgr: kvtier.KVCacheManager, count: int, length: int, chunk: int | None = None, first: int = 0) -> None:
    """Serve ``count`` prompts of ``length`` fresh tokens (``first``: the first one's number)."""
    for i in range(first, first + count):
        serve(mgr, [50_000 + 1_000 * i + j for j in range(length)], chunk)


def totals(mgr: kvtier.KVCacheManager, since: tuple | None = None) -> tuple[dict[str, int], int, int]:
    """(hit tokens by tier, lookup tokens, recomputed tokens), less those of ``since``."""
    s = mgr.stats()
    hits, lookups, recomputed = dict(s.hit_tokens), s.lookup_tokens, s.recomputed_tokens
    if since is not None:
        hits = {tier: n - since[0][tier] for tier, n in hits.items()}
        lookups, recomputed = lookups - since[1], recomputed - since[2]
    return hits, lookups, recomputed


def test_a_recurrent_reuse_counts_for_the_tier_its_snapshot_came_from():
    spec = kvtier.ModelSpec([kvtier.RecurrentLayer(64)], torch.float32, model_id="recurrent")
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(64 * 6), kvtier.HostTier(64 * 64)], snapshot_interval_blocks=3)
    with kvtier.KVCacheManager(spec, config) as mgr:
        prompt = list(range(100, 124))
        serve(mgr, prompt, chunk=TPB)  # snapshots after 12 and 24 tokens
        fillers(mgr, 20, 24, chunk=TPB)  # they go down to host memory
        before, _, _ = totals(mgr)
        cache = mgr.create_cache([*prompt, 7])
        assert cache.num_reused_tokens == 24
        assert cache.reused_by_tier == {"primary": 0, "host": 24, "disk": 0}
        cache.close()
        after, _, _ = totals(mgr)
        assert after["host"] - before["host"] == 24 and after["primary"] == before["primary"]


def test_stale_sliding_window_blocks_count_for_the_tier_of_the_window_after_them():
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 4, window=8)], torch.float32, model_id="window")
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(128 * 12), kvtier.HostTier(128 * 64)])
    with kvtier.KVCacheManager(spec, config) as mgr:
        prompt = list(range(100, 140))
        serve(mgr, prompt)
        fillers(mgr, 3, 40)  # the window's pages go down to host memory
        cache = mgr.create_cache([*prompt, 7])
        assert cache.num_reused_tokens == 40
        assert cache.reused_by_tier == {"primary": 0, "host": 40, "disk": 0}
        cache.close()


def primary_and_disk(tmp_path, primary_pages: int) -> tuple[kvtier.ModelSpec, kvtier.CacheConfig]:
    """One attention layer (128-byte pages), a primary tier of ``primary_pages`` and a disk tier."""
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 4)], torch.float32, model_id="on-disk")
    tiers = [kvtier.PrimaryTier(128 * primary_pages), kvtier.DiskTier(128 * 64, tmp_path)]
    return spec, kvtier.CacheConfig(TPB, tiers)


def test_reuse_lost_to_a_checksum_failure_moves_to_recomputed(tmp_path):
    spec, config = primary_and_disk(tmp_path, 16)
    prompt = list(range(100, 132))
    with kvtier.KVCacheManager(spec, config) as mgr:
        serve(mgr, prompt)  # persisted at close
    (page_file,) = tmp_path.glob("*/group0.pages")
    data = bytearray(page_file.read_bytes())
    for offset in range(0, len(data), 128):
        data[offset + 5] ^= 0xFF  # every page damaged
    page_file.write_bytes(bytes(data))
    with kvtier.KVCacheManager(spec, config) as mgr:
        cache = mgr.create_cache([*prompt, 1])
        assert totals(mgr) == ({"primary": 0, "host": 0, "disk": 0}, 33, 0)
        assert cache.resume() and cache.num_committed_tokens == 0
        assert totals(mgr) == ({"primary": 0, "host": 0, "disk": 0}, 33, 32)
        assert mgr.stats().checksum_failures > 0
        cache.close()
        assert totals(mgr) == ({"primary": 0, "host": 0, "disk": 0}, 33, 32)


def memory_manager() -> kvtier.KVCacheManager:
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 4)], torch.float32, model_id="memory")
    tiers = [kvtier.PrimaryTier(128 * 64), kvtier.HostTier(128 * 8)]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))


def test_recompute_from_moves_the_tail_of_the_reuse_to_recomputed_and_keeps_the_pages():
    with memory_manager() as mgr:
        prompt = list(range(100, 124))
        serve(mgr, prompt)
        base = totals(mgr)
        cache = mgr.create_cache([*prompt[:22], 1])  # 5 whole blocks and 2 tokens of the sixth
        assert cache.num_reused_tokens == 22
        assert totals(mgr, base) == ({"primary": 0, "host": 0, "disk": 0}, 23, 0)
        assert cache.recompute_from(np.int64(9)) == 13
        assert totals(mgr, base) == ({"primary": 0, "host": 0, "disk": 0}, 23, 13)
        assert cache.recompute_from(30) == 0  # what was moved stays moved
        assert cache.recompute_from(9) == 0
        assert cache.num_reused_tokens == 22 and cache.reused_by_tier["primary"] == 22  # counts only
        assert cache.shorten_reuse(4) == 18  # moves only what was still counted
        assert totals(mgr, base) == ({"primary": 0, "host": 0, "disk": 0}, 23, 18)
        with pytest.raises(TypeError):
            cache.recompute_from(2.0)
        with pytest.raises(ValueError):
            cache.recompute_from(-1)
        assert totals(mgr, base) == ({"primary": 0, "host": 0, "disk": 0}, 23, 18)
        cache.close()  # the reuse kept is counted now
        assert totals(mgr, base) == ({"primary": 4, "host": 0, "disk": 0}, 23, 18)
        with pytest.raises(CacheStateError):
            cache.recompute_from(0)


def test_cache_for_prefix_holds_a_new_caches_reuse_and_counts_no_lookup():
    with memory_manager() as mgr:
        prompt = list(range(100, 124))
        serve(mgr, prompt)
        cache = mgr.create_cache([*prompt[:22], 1])
        counted = totals(mgr)
        shorter = cache.cache_for_prefix(np.int64(10))
        assert shorter.num_reused_tokens == 9 and shorter.num_committed_tokens == 9
        assert totals(mgr) == counted
        assert shorter.resume() and cache.resume()
        assert np.array_equal(shorter.page_indices(0)[:2], cache.page_indices(0)[:2])  # the same blocks
        shorter.close()  # closing the shorter cache takes no count back
        assert totals(mgr) == counted
        with pytest.raises(ValueError):
            cache.cache_for_prefix(23)  # more than it holds
        with pytest.raises(TypeError):
            cache.cache_for_prefix(None)
        assert totals(mgr) == counted
        cache.close()
        with pytest.raises(CacheStateError):
            cache.cache_for_prefix(1)
        mgr.check_invariants()


def test_a_numpy_priority_is_taken_as_the_int_it_holds():
    with memory_manager() as mgr:
        cache = mgr.create_cache([1, 2, 3], priority=np.int64(80))
        assert cache.priority == 80 and type(cache.priority) is int
        cache.close()
        with pytest.raises(ValueError):
            mgr.create_cache([1, 2, 3], priority=np.int64(101))


def damage_slots(tmp_path, first_slot: int, page: int = 128) -> None:
    """Flip a byte of every page from ``first_slot`` on in the disk tier's page file."""
    (page_file,) = tmp_path.glob("*/group0.pages")
    data = bytearray(page_file.read_bytes())
    for offset in range(first_slot * page, len(data), page):
        data[offset + 5] ^= 0xFF
    page_file.write_bytes(bytes(data))


def test_reuse_cut_short_by_a_checksum_failure_keeps_the_tier_its_intact_part_came_from(tmp_path):
    spec, config = primary_and_disk(tmp_path, 16)
    prompt = list(range(100, 132))
    with kvtier.KVCacheManager(spec, config) as mgr:
        serve(mgr, prompt)  # persisted at close, parents first: block b in slot b
    damage_slots(tmp_path, 4)  # the last four blocks
    with kvtier.KVCacheManager(spec, config) as mgr:
        cache = mgr.create_cache([*prompt, 1])
        assert cache.resume() and cache.num_committed_tokens == 16
        # the cache says where the intact part came from (before: "primary", where the failed resume had promoted it)
        assert cache.reused_by_tier == {"primary": 0, "host": 0, "disk": 16} and cache.num_reused_tokens == 16
        cache.close()
        assert totals(mgr) == ({"primary": 0, "host": 0, "disk": 16}, 33, 16)  # counted for the disk


def test_reuse_a_request_took_stays_a_hit_when_its_pages_fail_later(tmp_path):
    spec, config = primary_and_disk(tmp_path, 12)
    prompt = list(range(100, 132))
    with kvtier.KVCacheManager(spec, config) as mgr:
        serve(mgr, prompt)
        fillers(mgr, 3, 40)  # the prompt's pages go down to disk
        cache = mgr.create_cache([*prompt, 1])
        assert cache.num_reused_tokens == 32 and cache.resume()  # the request takes its reuse
        taken = totals(mgr)
        cache.suspend()
        fillers(mgr, 3, 40, first=3)  # its pages go down to disk again (fresh prompts: no hits)
        damage_slots(tmp_path, 0)
        pushed = totals(mgr)
        assert pushed[0] == taken[0] and pushed[2] == taken[2]
        assert cache.resume() and cache.num_committed_tokens < 32  # it starts over: recomputes
        assert totals(mgr)[2] == pushed[2]  # nothing moved to recomputed
        cache.close()
        assert totals(mgr)[0]["disk"] == pushed[0]["disk"] + 32  # what it took is a hit


def test_hits_never_go_down_and_settle_at_the_first_commit():
    """A scrape between a cache's creation and a shortened reuse never sees a hit count drop (a
    Prometheus counter going down reads as a reset: ``increase()`` then adds the whole count).
    Before, ``create_cache`` counted the whole match, and ``recompute_from`` (``kvtier.hf``'s batch
    rows), ``shorten_reuse`` or a checksum failure took part of it back."""
    with memory_manager() as mgr:
        prompt = list(range(100, 124))
        serve(mgr, prompt)
        base = totals(mgr)
        cache = mgr.create_cache([*prompt, 1])
        seen = [totals(mgr, base)]
        assert cache.recompute_from(16) == 8
        seen.append(totals(mgr, base))
        assert cache.resume() and cache.resize(25)
        seen.append(totals(mgr, base))
        cache.commit([1])  # the reuse is used: 16 tokens of it count
        seen.append(totals(mgr, base))
        with pytest.raises(CacheStateError, match="after the cache's first commit"):
            cache.recompute_from(8)
        cache.close()
        seen.append(totals(mgr, base))
        for earlier, later in itertools.pairwise(seen):
            assert all(later[0][tier] >= n for tier, n in earlier[0].items())
            assert later[1] >= earlier[1] and later[2] >= earlier[2]
        assert seen[-1] == ({"primary": 16, "host": 0, "disk": 0}, 25, 8)
        assert seen[3] == seen[-1]  # settled at the commit: the close adds nothing


def test_an_empty_commit_settles_nothing_so_the_reuse_may_still_be_shortened():
    """``commit([])`` computes nothing past the reuse: the hits stay unsettled, and ``shorten_reuse``
    then works as on a cache that committed nothing."""
    with memory_manager() as mgr:
        prompt = list(range(100, 124))
        serve(mgr, prompt)
        base = totals(mgr)
        cache = mgr.create_cache([*prompt[:22], 1])
        assert cache.resume() and cache.resize(22)
        cache.commit([])
        cache.suspend()
        assert cache.shorten_reuse(4) == 18
        cache.close()
        assert totals(mgr, base) == ({"primary": 4, "host": 0, "disk": 0}, 23, 18)
