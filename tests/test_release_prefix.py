"""``KVCache.release_prefix``: a caller that holds a prefix's KV elsewhere lets go of its pages."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from tests.kvdata import PageOracle
from tests.test_tiers import TPB, convo, manager


def computed(mgr, oracle, tokens) -> kvtier.KVCache:
    """An ACTIVE cache that computed and committed ``tokens``."""
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    start = cache.num_committed_tokens
    assert cache.resize(len(tokens))
    oracle.write(cache, tokens, start, len(tokens))
    cache.commit(tokens[start:])
    return cache


def used_pages(mgr, tier: str = "primary") -> int:
    return mgr.stats().tiers[tier].pages_used


def test_an_active_caches_released_blocks_make_room_and_stay_reusable_byte_exact(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=0)
    oracle = PageOracle(mgr)
    first = convo(0, 6 * TPB + 1)
    cache = computed(mgr, oracle, first)  # 7 primary pages, all locked
    other = mgr.create_cache(convo(1, 4 * TPB))
    assert other.resume()
    assert not other.resize(4 * TPB)  # 1 free page for 4

    assert cache.release_prefix(5 * TPB + 2) == 5  # the full blocks before token 22
    indices = cache.page_indices(0)
    assert (indices[:5] == kvtier.BAD_PAGE_INDEX).all() and (indices[5:] != kvtier.BAD_PAGE_INDEX).all()
    mgr.check_invariants()
    assert other.resize(4 * TPB)  # the released pages went down to host memory
    assert used_pages(mgr, "host") == 3
    oracle.write(other, convo(1, 4 * TPB), 0, 4 * TPB)
    other.commit(convo(1, 4 * TPB))
    other.close()

    more = first + convo(2, 2 * TPB)  # the cache goes on: its blocks after the released ones publish as before
    assert cache.resize(len(more))
    oracle.write(cache, more, len(first), len(more))
    cache.commit(more[len(first) :])
    oracle.check(cache, more)  # (the rows it still holds)
    cache.close()
    mgr.check_invariants()

    again = mgr.create_cache(more + [7])
    assert again.num_reused_tokens == len(more) // TPB * TPB
    assert again.reused_by_tier["host"] > 0
    assert again.resume()
    oracle.check(again, more + [7])
    again.close()
    mgr.check_invariants()
    mgr.close()


def test_release_prefix_checks_its_argument_and_changes_nothing_on_a_bad_one(tmp_path):
    mgr = manager(tmp_path, primary=8, host=0, disk=0)
    oracle = PageOracle(mgr)
    tokens = convo(0, 5 * TPB)
    cache = computed(mgr, oracle, tokens)
    before = cache.page_indices(0)
    with pytest.raises(ValueError, match="more than the cache's 20 committed tokens"):
        cache.release_prefix(5 * TPB + 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        cache.release_prefix(-1)
    with pytest.raises(TypeError, match="must be an int"):
        cache.release_prefix("8")
    assert np.array_equal(cache.page_indices(0), before)
    assert cache.release_prefix(2 * TPB + 3) == 2
    assert cache.release_prefix(TPB) == 2  # below what is released: nothing changes
    assert cache.release_prefix(3) == 2
    assert (cache.page_indices(0)[:2] == kvtier.BAD_PAGE_INDEX).all()
    assert (cache.page_indices(0)[2:] == before[2:]).all()
    cache.close()
    with pytest.raises(kvtier.CacheStateError):
        cache.release_prefix(0)
    mgr.check_invariants()
    mgr.close()


def test_a_suspended_cache_resumed_locks_none_of_its_released_blocks(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=0)
    oracle = PageOracle(mgr)
    tokens = convo(0, 6 * TPB)
    cache = computed(mgr, oracle, tokens)
    cache.release_prefix(4 * TPB)
    cache.suspend()
    filler = computed(mgr, oracle, convo(1, 8 * TPB))  # every primary page: the cache's go to host memory
    filler.close()
    assert cache.resume()
    indices = cache.page_indices(0)
    assert (indices[:4] == kvtier.BAD_PAGE_INDEX).all() and (indices[4:] != kvtier.BAD_PAGE_INDEX).all()
    oracle.check(cache, tokens)
    mgr.check_invariants()
    assert cache.release_prefix(len(tokens)) == 6
    assert (cache.page_indices(0) == kvtier.BAD_PAGE_INDEX).all()
    cache.close()
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("kind", ["swa", "hybrid"])
def test_a_released_prefix_of_a_sliding_window_or_recurrent_model_is_reused(tmp_path, kind):
    """Sink blocks go too; a recurrent state page stays, and its snapshots are kept as before."""
    mgr = manager(tmp_path, kind=kind, primary=16, host=16, disk=0)
    oracle = PageOracle(mgr)
    tokens = convo(0, 8 * TPB + 1)
    cache = mgr.create_cache(tokens)
    assert cache.resume() and cache.resize(len(tokens))
    for start in range(0, len(tokens), TPB):  # block by block: a recurrent model keeps its snapshots
        end = min(start + TPB, len(tokens))
        oracle.write(cache, tokens, start, end)
        cache.commit(tokens[start:end])
    assert cache.release_prefix(6 * TPB) == 6
    for group in mgr.layer_groups:
        indices = cache.page_indices(group.group_id)
        if group.kind is kvtier.GroupKind.RECURRENT:
            assert indices[0] != kvtier.BAD_PAGE_INDEX
        else:
            assert (indices[:6] == kvtier.BAD_PAGE_INDEX).all()
    mgr.check_invariants()
    oracle.check(cache, tokens)
    cache.close()
    again = mgr.create_cache(tokens + [5])
    assert again.num_reused_tokens == 8 * TPB
    assert again.resume()
    oracle.check(again, tokens + [5])
    again.close()
    mgr.check_invariants()
    mgr.close()


def test_with_reuse_off_released_pages_are_freed(tmp_path):
    mgr = manager(tmp_path, primary=8, host=0, disk=0, enable_reuse=False)
    oracle = PageOracle(mgr)
    cache = computed(mgr, oracle, convo(0, 6 * TPB))
    assert used_pages(mgr) == 6
    cache.release_prefix(4 * TPB)
    assert used_pages(mgr) == 2
    mgr.check_invariants()
    cache.close()
    mgr.close()
