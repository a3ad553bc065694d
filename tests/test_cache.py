"""KVCache life cycle, lengths, reuse and eviction on the primary tier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from tests.kvdata import PageOracle, small_spec

TPB = 4


def make(kind: str = "llama", pages: int = 64, **config) -> tuple[kvtier.KVCacheManager, PageOracle]:
    spec = small_spec(kind)
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 20)]))
    demand = sum(
        probe.page_bytes(g.group_id)
        / (config.get("snapshot_interval_blocks", 4) if g.kind is kvtier.GroupKind.RECURRENT else 1)
        for g in probe.layer_groups
    )
    probe.close()
    quota = int(demand * pages) + 1
    cfg = kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(quota)], **config)
    mgr = kvtier.KVCacheManager(spec, cfg)
    return mgr, PageOracle(mgr)


def run_request(mgr, oracle, tokens, scope=kvtier.DEFAULT_SCOPE, priority=35, chunk=None, close=True):
    """Create, resume, prefill in chunks (write + commit), like an engine would."""
    cache = mgr.create_cache(tokens, scope=scope, priority=priority)
    assert cache.resume()
    oracle.check(cache, tokens)
    pos = cache.num_committed_tokens
    step = chunk or len(tokens)
    while pos < len(tokens):
        end = min(len(tokens), pos + step)
        assert cache.resize(end)
        oracle.write(cache, tokens, pos, end)
        cache.commit(tokens[pos:end])
        pos = end
    oracle.check(cache, tokens)
    mgr.check_invariants()
    if close:
        cache.close()
        mgr.check_invariants()
    return cache


def test_new_cache_is_suspended_and_empty():
    mgr, _ = make()
    cache = mgr.create_cache([1, 2, 3])
    assert cache.state is kvtier.CacheState.SUSPENDED
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens) == (0, 0, 0)
    assert cache.num_reused_tokens == 0
    assert cache.reused_by_tier == {"primary": 0, "host": 0, "disk": 0}  # every tier, configured or not
    with pytest.raises(kvtier.CacheStateError):
        cache.page_indices(0)
    assert cache.resume()
    assert cache.state is kvtier.CacheState.ACTIVE
    assert cache.page_indices(0).tolist() == []
    mgr.check_invariants()


def test_resize_commit_and_lengths():
    mgr, oracle = make()
    tokens = list(range(10, 30))
    cache = mgr.create_cache(tokens)
    cache.resume()
    assert cache.resize(6)
    assert len(cache.page_indices(0)) == 2
    oracle.write(cache, tokens, 0, 6)
    cache.commit(tokens[:6])
    assert (cache.num_committed_tokens, cache.history_length, cache.capacity) == (6, 6, 6)
    with pytest.raises(ValueError, match="past capacity"):
        cache.commit([1])
    assert cache.num_committed_tokens == 6
    assert cache.resize(9, history=8)
    assert cache.history_length == 8
    with pytest.raises(ValueError, match="below history"):
        cache.resize(7)
    with pytest.raises(ValueError, match="never decreases"):
        cache.resize(9, history=7)
    assert cache.resize(8)  # shrink to history
    assert len(cache.page_indices(0)) == 2
    oracle.check(cache, tokens)
    mgr.check_invariants()


def test_bad_input_raises_and_changes_nothing():
    mgr, _ = make()
    with pytest.raises(TypeError):
        mgr.create_cache([1, 2.5])
    with pytest.raises(TypeError):
        mgr.create_cache("abc")
    with pytest.raises(ValueError):
        mgr.create_cache([1, -2])
    with pytest.raises(ValueError):
        mgr.create_cache([1, 2], priority=101)
    with pytest.raises(TypeError):
        mgr.create_cache([1, 2], priority=5.0)
    with pytest.raises(TypeError):
        mgr.create_cache([1, 2], scope="tenant")
    cache = mgr.create_cache([1, 2, 3])
    cache.resume()
    cache.resize(4)
    before = (cache.capacity, cache.history_length, cache.num_committed_tokens, cache.page_indices(0).tolist())
    with pytest.raises(TypeError):
        cache.commit([1, "x"])
    with pytest.raises(TypeError):
        cache.resize(5.0)
    with pytest.raises(ValueError):
        cache.resize(-1)
    with pytest.raises(ValueError):
        cache.page_indices(3)
    for not_a_layer in (99, [0], True, "0"):
        with pytest.raises(ValueError, match="layer"):
            mgr.kv_views(not_a_layer)
    for unordered_or_raw in (bytearray(16), memoryview(bytes(16)), {1: 2, 3: 4}, {1, 2}, frozenset({1})):
        with pytest.raises(TypeError):  # raw bytes are not token ids; a set or dict has no order
            mgr.create_cache(unordered_or_raw)
        with pytest.raises(TypeError):
            cache.commit(unordered_or_raw)
    assert (cache.capacity, cache.history_length, cache.num_committed_tokens, cache.page_indices(0).tolist()) == before
    assert mgr.stats().lookup_tokens == 3
    mgr.check_invariants()


def test_numpy_integers_are_taken_as_the_ints_they_hold():
    """As lengths and ids: their own arithmetic would wrap (unsigned) or overflow against Python ints."""
    mgr, _ = make()
    cache = mgr.create_cache([1, 2, 3])
    cache.resume()
    assert cache.resize(np.uint64(12))
    assert cache.resize(np.int64(8)) and type(cache.capacity) is int
    assert cache.resize(10**30) is False  # beyond every tier: False at once, nothing changed
    assert cache.capacity == 8
    assert cache.page_indices(np.int64(0)).tolist() == cache.page_indices(0).tolist()
    assert mgr.kv_views(np.int64(1))["k"].data_ptr() == mgr.kv_views(1)["k"].data_ptr()
    mgr.check_invariants()
    mgr.close()
    with pytest.raises(kvtier.CacheStateError):
        mgr.remembered_prefill_rate  # noqa: B018 - closed: refused as every other call


def test_quota_too_small_for_one_page():
    with pytest.raises(ValueError, match=r"too small: .* no page"):
        kvtier.KVCacheManager(small_spec(), kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(100)]))


def test_full_block_reuse_shares_pages_and_bytes():
    mgr, oracle = make()
    tokens = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
    run_request(mgr, oracle, tokens)
    again = mgr.create_cache(tokens + [5, 6])
    assert again.num_reused_tokens == 16  # the partial fifth block was never published
    assert again.reused_by_tier == {"primary": 16, "host": 0, "disk": 0}
    again.resume()
    oracle.check(again, tokens + [5, 6])
    mgr.check_invariants()


def test_last_input_token_is_never_reused():
    mgr, oracle = make()
    tokens = list(range(200, 216))  # exactly 4 blocks
    run_request(mgr, oracle, tokens)
    same = mgr.create_cache(tokens)
    assert same.num_reused_tokens == 15  # the last block is reused partially, its last token computed
    same.resume()
    oracle.check(same, tokens)
    slots_first = same.page_indices(0)
    mgr.check_invariants()
    assert same.resize(16)
    oracle.write(same, tokens, 15, 16)
    same.commit(tokens[15:])
    assert same.page_indices(0).tolist() == slots_first.tolist()
    oracle.check(same, tokens)


def test_partial_reuse_copies_into_a_private_page():
    mgr, oracle = make()
    a = list(range(300, 316))
    run_request(mgr, oracle, a, close=False)
    b = a[:10] + [7, 7, 7, 7, 7, 7]
    cache = mgr.create_cache(b)
    assert cache.num_reused_tokens == 10
    cache.resume()
    oracle.check(cache, b)
    assert cache.resize(16)
    oracle.write(cache, b, 10, 16)  # overwrites rows 10.. of block 2: must not touch a's page
    cache.commit(b[10:])
    first = mgr.create_cache(a)
    first.resume()
    oracle.check(first, a)
    mgr.check_invariants()


def test_partial_reuse_disabled_stops_at_block_boundary():
    mgr, oracle = make(enable_partial_reuse=False)
    a = list(range(400, 416))
    run_request(mgr, oracle, a)
    cache = mgr.create_cache(a[:10] + [1, 1, 1])
    assert cache.num_reused_tokens == 8


def test_scopes_never_share():
    mgr, oracle = make()
    tokens = list(range(500, 520))
    run_request(mgr, oracle, tokens, scope=kvtier.ReuseScope(lora_id=1))
    assert reused(mgr, tokens, kvtier.ReuseScope(lora_id=2)) == 0
    assert reused(mgr, tokens, kvtier.ReuseScope(lora_id=1, salt="x")) == 0
    assert reused(mgr, tokens, kvtier.ReuseScope()) == 0
    assert reused(mgr, tokens, kvtier.ReuseScope(lora_id=1)) == 19


def test_reuse_disabled():
    mgr, oracle = make(enable_reuse=False)
    tokens = list(range(20))
    run_request(mgr, oracle, tokens)
    assert reused(mgr, tokens) == 0
    assert mgr.stats().tiers["primary"].pages_used == 0


def test_resize_returns_false_and_changes_nothing_when_full():
    mgr, _ = make(pages=6)
    tokens = list(range(40))
    cache = mgr.create_cache(tokens)
    cache.resume()
    assert cache.resize(24)  # 6 pages
    before = cache.page_indices(0).tolist()
    assert not cache.resize(25)
    assert cache.capacity == 24 and cache.page_indices(0).tolist() == before
    mgr.check_invariants()


def reused(mgr, tokens, scope=kvtier.DEFAULT_SCOPE) -> int:
    """How many tokens of ``tokens`` a new cache would reuse (the probe cache is closed again)."""
    cache = mgr.create_cache(tokens, scope=scope)
    n = cache.num_reused_tokens
    cache.close()
    return n


def test_eviction_drops_lowest_priority_then_lru():
    mgr, oracle = make(pages=8)
    low = [1000 + i for i in range(9)]  # 2 full blocks published, the partial third one freed
    mid_old = [2000 + i for i in range(9)]
    mid_new = [3000 + i for i in range(9)]
    run_request(mgr, oracle, low, priority=10)
    run_request(mgr, oracle, mid_old, priority=50)
    run_request(mgr, oracle, mid_new, priority=50)
    assert mgr.stats().tiers["primary"].pages_used == 6
    hog = mgr.create_cache(list(range(5000, 5020)))
    hog.resume()
    assert hog.resize(16)  # 4 pages: 2 free + 2 evicted, the priority-10 blocks
    assert hog.resize(20)  # 1 more: the least recently used of priority 50, mid_old's tail block
    assert reused(mgr, low) == 0
    assert reused(mgr, mid_old) == 4
    assert reused(mgr, mid_new) == 8
    assert mgr.stats().drops == 3 == mgr.stats().evictions
    mgr.check_invariants()


def test_active_and_suspended_pages_are_never_dropped():
    mgr, oracle = make(pages=6)
    a = list(range(24))
    cache = run_request(mgr, oracle, a, close=False)
    cache.suspend()
    other = mgr.create_cache(list(range(100, 130)))
    assert other.resume()
    assert not other.resize(4)  # every page is held by the suspended cache
    assert cache.resume()
    oracle.check(cache, a)
    mgr.check_invariants()


def test_close_is_idempotent_and_state_errors():
    mgr, oracle = make()
    cache = run_request(mgr, oracle, list(range(12)), close=False)
    cache.close()
    cache.close()
    assert cache.state is kvtier.CacheState.CLOSED
    with pytest.raises(kvtier.CacheStateError):
        cache.resume()
    with pytest.raises(kvtier.CacheStateError):
        cache.resize(4)
    with pytest.raises(kvtier.CacheStateError):
        cache.commit([1])
    mgr.check_invariants()


def test_sliding_window_releases_stale_blocks_in_place():
    mgr, oracle = make("swa")
    window_group = next(g.group_id for g in mgr.layer_groups if g.window)
    full_group = next(g.group_id for g in mgr.layer_groups if not g.window)
    tokens = list(range(600, 640))
    cache = run_request(mgr, oracle, tokens, chunk=5, close=False)
    swa = cache.page_indices(window_group)
    full = cache.page_indices(full_group)
    assert len(swa) == len(full) == 10
    # W=10, sink 3 tokens -> 1 sink block; h=40 -> stale blocks [1, (41 - 10) // 4) = [1, 7)
    assert (swa[1:7] == kvtier.BAD_PAGE_INDEX).all()
    assert (swa[[0, 7, 8, 9]] >= 0).all() and (full >= 0).all()
    cache.close()
    longer = tokens + [1, 2, 3]
    again = mgr.create_cache(longer)
    assert again.num_reused_tokens == 40
    again.resume()
    oracle.check(again, longer)
    mgr.check_invariants()


def test_sliding_window_blocks_published_while_live_serve_any_prefix():
    mgr, oracle = make("swa", pages=40)
    tokens = list(range(700, 740))
    run_request(mgr, oracle, tokens, chunk=4)
    assert reused(mgr, tokens[:21]) == 20
    mgr.check_invariants()


def test_recurrent_snapshots_at_interval_and_input_end():
    mgr, oracle = make("hybrid", snapshot_interval_blocks=2)
    prompt = list(range(800, 819))  # 19 tokens: snapshots at 8, 16 and the input end, 19
    first = run_request(mgr, oracle, prompt, chunk=4, close=False)
    # before block 4 fills, the input-end snapshot has no block to hang on: reuse stops at 16
    assert reused(mgr, prompt + [1, 2, 3, 4, 5]) == 16
    # one generated token fills block 4, which publishes it with the snapshot at offset 3
    sequence = [*prompt, 42]
    assert first.resize(20)
    oracle.write(first, sequence, 19, 20)
    first.commit([42])
    first.close()
    follow = [*prompt, 9, 9, 9, 9, 9, 9]  # diverges inside block 4, right after the input end
    cache = mgr.create_cache(follow)
    assert cache.num_reused_tokens == 19
    cache.resume()
    oracle.check(cache, follow)
    mgr.check_invariants()


def test_recurrent_state_page_is_one_entry():
    mgr, _ = make("hybrid")
    rec = next(g.group_id for g in mgr.layer_groups if g.kind is kvtier.GroupKind.RECURRENT)
    cache = mgr.create_cache([1, 2, 3])
    cache.resume()
    idx = cache.page_indices(rec)
    assert idx.dtype == np.int32 and idx.shape == (1,)


def test_kv_views_and_layout_alias_the_same_memory():
    mgr, _ = make("hybrid")
    views = mgr.kv_views(0)
    assert set(views) == {"k", "v"}
    assert views["k"].shape[1:] == (TPB, 2, 8)
    state = mgr.kv_views(1)["state"]
    assert state.dtype == torch.uint8 and state.shape[1] == 96
    region = mgr.layout().groups[0].regions[0]
    assert mgr.layout().tokens_per_block == TPB
    assert region.size == region.stride == mgr.page_bytes(0)
    page = region.as_tensor()[3]
    page.zero_()  # a pool's memory is not zeroed: on a GPU it may hold an earlier test's values
    views["k"][3].fill_(1.5)
    views["v"][3].fill_(-2.0)
    k_bytes = TPB * 2 * 8 * 2
    assert (page[:k_bytes].view(torch.float16) == 1.5).all()
    assert (page.view(torch.float16) == -2.0).sum() == TPB * 2 * 8
    assert region.base == mgr.layout().groups[0].regions[0].base


def test_stats_count_hits_lookups_and_occupancy():
    mgr, oracle = make()
    tokens = list(range(900, 917))
    run_request(mgr, oracle, tokens)
    cache = mgr.create_cache(tokens + [1])
    stats = mgr.stats()
    assert stats.lookup_tokens == 17 + 18
    assert stats.hit_tokens == {"primary": 0, "host": 0, "disk": 0}  # counted once the request uses them
    assert stats.tiers["primary"].pages_used == 4
    assert stats.tiers["primary"].bytes_used == 4 * mgr.page_bytes(0)
    assert cache.resume() and cache.resize(18)
    cache.commit([1, 1])
    stats = mgr.stats()
    assert stats.hit_tokens == {"primary": 16, "host": 0, "disk": 0}
    assert 0 < stats.hit_rate < 1


def test_a_failed_resize_of_a_model_with_two_groups_evicts_nothing():
    """A sliding-window group with room to make and a full-attention group without (an active
    cache holds every page): ``resize`` returns False and no cached page is evicted. Before, the
    first group's room was made (a cached page dropped) before the second was found short."""
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 4, window=4), kvtier.AttentionLayer(1, 4)], torch.float32)
    with kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(2048)])) as mgr:
        tokens = list(range(100, 132))
        holder = mgr.create_cache(tokens)
        assert holder.resume() and holder.resize(32)
        holder.commit(tokens)  # the full-attention group's pages all held; stale window pages cached
        before = mgr.stats()
        other = mgr.create_cache([1] * 5)
        assert other.resume()
        assert other.resize(4) is False and other.capacity == 0
        after = mgr.stats()
        assert (after.drops, after.evictions) == (before.drops, before.evictions)
        mgr.check_invariants()
        holder.close()
        other.close()


def test_a_failed_resume_of_a_model_with_two_groups_moves_nothing():
    """A suspended cache demoted to host memory, and a primary tier whose sliding-window group has
    cached pages to evict but whose full-attention group an active cache holds whole: ``resume``
    returns False having moved no page. Before, the window group's room was made (a page demoted)
    before the full-attention group was found short. Once room is freed the cache resumes with
    its bytes."""
    spec = kvtier.ModelSpec([kvtier.AttentionLayer(1, 4, window=4), kvtier.AttentionLayer(1, 4)], torch.float32)
    config = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(2048), kvtier.HostTier(1 << 16)])
    with kvtier.KVCacheManager(spec, config) as mgr:
        oracle = PageOracle(mgr)
        mine = list(range(200, 216))
        cache = run_request(mgr, oracle, mine, close=False)
        cache.suspend()
        held = list(range(100, 132))
        holder = run_request(mgr, oracle, held, close=False)  # pushes ``cache`` to host memory
        before = mgr.stats()
        assert before.tiers["host"].pages_used > 0
        assert cache.resume() is False and cache.state is kvtier.CacheState.SUSPENDED
        after = mgr.stats()
        assert (after.demotions, after.promotions, after.evictions, after.drops) == (
            before.demotions,
            before.promotions,
            before.evictions,
            before.drops,
        )
        mgr.check_invariants()
        holder.close()
        assert cache.resume()
        oracle.check(cache, mine)
        cache.close()
        mgr.check_invariants()


def test_shorten_reuse_of_a_closed_managers_cache_says_it_is_closed():
    """Every method of a closed manager's caches raises ``CacheStateError``, whatever it is given.
    Before, ``shorten_reuse("x")`` checked its argument first: a ``TypeError``."""
    mgr, _ = make()
    cache = mgr.create_cache([1, 2, 3])
    mgr.close()
    with pytest.raises(kvtier.CacheStateError):
        cache.shorten_reuse("x")
