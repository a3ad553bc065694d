"""kvtier/stats.py: CacheStats.hit_rate and the counters behind it."""

from __future__ import annotations

import pytest

import kvtier
from kvtier.stats import CacheStats, Counters, TierStats


def stats(hit_tokens: dict[str, int], lookup_tokens: int) -> CacheStats:
    return CacheStats(
        tiers={"primary": TierStats(8, 3, 8192, 3072)},
        hit_tokens=hit_tokens,
        lookup_tokens=lookup_tokens,
        evictions=1,
        demotions=2,
        promotions=3,
        drops=4,
        checksum_failures=5,
        bytes_copied={"primary->host:cpu": 4096},
    )


def test_hit_rate_sums_every_tier():
    assert stats({"primary": 30, "host": 20, "disk": 10}, 120).hit_rate == pytest.approx(0.5)
    assert stats({"primary": 7}, 7).hit_rate == 1.0
    assert stats({"primary": 0, "host": 3}, 12).hit_rate == pytest.approx(0.25)


def test_hit_rate_without_lookups_is_zero():
    assert stats({"primary": 0, "host": 0}, 0).hit_rate == 0.0
    assert stats({}, 0).hit_rate == 0.0


def test_stats_are_frozen():
    s = stats({"primary": 1}, 2)
    with pytest.raises(AttributeError):
        s.evictions = 0  # type: ignore[misc]


def test_counters_start_at_zero():
    c = Counters()
    assert (c.lookup_tokens, c.evictions, c.demotions, c.promotions, c.drops, c.checksum_failures) == (0,) * 6
    assert c.hit_tokens["host"] == 0 and dict(c.bytes_copied) == {}
    other = Counters()
    other.hit_tokens["primary"] += 5
    other.add_copy("primary", "host", "cpu", 64)
    assert c.hit_tokens["primary"] == 0 and dict(c.bytes_copied) == {}  # no shared defaults


def test_add_copy_keys_and_sums():
    c = Counters()
    c.add_copy("primary", "host", "copy_engine", 4096)
    c.add_copy("primary", "host", "copy_engine", 1024)
    c.add_copy("primary", "host", "kernel", 512)
    c.add_copy("host", "primary", "copy_engine", 256)
    c.add_copy("host", "disk", "file", 128)
    c.add_copy("disk", "primary", "file", 0)
    assert dict(c.bytes_copied) == {
        "primary->host:copy_engine": 5120,
        "primary->host:kernel": 512,
        "host->primary:copy_engine": 256,
        "host->disk:file": 128,
        "disk->primary:file": 0,
    }


def test_manager_stats_count_lookups_hits_and_copies():
    spec = kvtier.ModelSpec.uniform(2, 2, 8)
    probe = kvtier.CacheConfig(tokens_per_block=4, tiers=[kvtier.PrimaryTier(1 << 20)])
    page = kvtier.KVCacheManager(spec, probe)
    page_bytes = page.page_bytes(0)
    page.close()
    config = kvtier.CacheConfig(
        tokens_per_block=4, tiers=[kvtier.PrimaryTier(4 * page_bytes), kvtier.HostTier(16 * page_bytes)]
    )
    mgr = kvtier.KVCacheManager(spec, config)
    try:
        first = list(range(10, 22))  # 12 tokens: 3 blocks published
        cache = mgr.create_cache(first)
        assert cache.resume() and cache.resize(len(first))
        cache.commit(first)
        cache.close()
        again = mgr.create_cache([*first, 99])  # 13 tokens, 12 reused from the primary tier
        assert again.num_reused_tokens == 12
        again.close()
        other = list(range(50, 66))  # 4 new blocks: the primary tier (4 pages) demotes to host
        cache = mgr.create_cache(other)
        assert cache.resume() and cache.resize(len(other))
        cache.commit(other)
        cache.close()
        s = mgr.stats()
        assert s.lookup_tokens == 12 + 13 + 16
        assert s.hit_tokens == {"primary": 12, "host": 0, "disk": 0}
        assert s.hit_rate == pytest.approx(12 / 41)
        assert s.demotions == s.evictions == 3
        assert s.bytes_copied == {"primary->host:cpu": 3 * page_bytes}
        assert set(s.tiers) == {"primary", "host"}
        assert (s.tiers["host"].pages_used, s.tiers["host"].bytes_used) == (3, 3 * page_bytes)
    finally:
        mgr.close()
