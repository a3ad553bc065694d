"""``KVCache.match_again``: a request that waits to run reuses what was published meanwhile."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from tests.kvdata import PageOracle
from tests.test_release_prefix import computed
from tests.test_tiers import TPB, convo, manager


@pytest.mark.parametrize("kind", ["llama", "swa"])
def test_a_waiting_cache_takes_blocks_published_after_it_was_made_byte_exact(tmp_path, kind):
    """Two requests share a prompt: the second's cache is made while the first has computed only
    2 of its 5 blocks; once the first published all of them, the second reuses them, each row its
    own, and the manager counts one lookup and the hits of what the second used."""
    mgr = manager(tmp_path, kind=kind, primary=16, host=8, disk=0)
    oracle = PageOracle(mgr)
    shared = convo(3, 5 * TPB) + [9]
    first = computed(mgr, oracle, shared[: 2 * TPB])
    waiting = mgr.create_cache(shared)
    assert 0 < waiting.num_reused_tokens <= 2 * TPB
    assert first.resize(len(shared))
    oracle.write(first, shared, 2 * TPB, len(shared))
    first.commit(shared[2 * TPB :])
    first.close()
    lookups = mgr.stats().lookup_tokens

    before = waiting.num_reused_tokens
    assert waiting.match_again(shared) == 5 * TPB - before
    assert waiting.num_reused_tokens == 5 * TPB
    assert waiting.match_again(shared) == 0  # nothing more to reuse
    mgr.check_invariants()
    assert waiting.resume()
    oracle.check(waiting, shared)
    assert waiting.resize(len(shared))
    oracle.write(waiting, shared, 5 * TPB, len(shared))
    waiting.commit(shared[5 * TPB :])
    stats = mgr.stats()
    assert stats.lookup_tokens == lookups
    assert sum(stats.hit_tokens.values()) == 5 * TPB
    waiting.close()
    mgr.check_invariants()
    mgr.close()


def test_match_again_refuses_a_cache_that_went_on_and_other_tokens_changing_nothing(tmp_path):
    mgr = manager(tmp_path, primary=16, host=8, disk=0)
    oracle = PageOracle(mgr)
    shared = convo(4, 4 * TPB) + [9]
    computed(mgr, oracle, shared[:TPB]).close()
    waiting = mgr.create_cache(shared)
    with pytest.raises(ValueError, match="input tokens the cache was made for"):
        waiting.match_again(shared[:-1])
    with pytest.raises(ValueError, match="input tokens the cache was made for"):
        waiting.match_again([1, *shared[1:]])
    assert waiting.num_reused_tokens == TPB
    assert waiting.resume()
    before = waiting.page_indices(0)
    with pytest.raises(kvtier.CacheStateError, match="SUSPENDED cache holding only its reused prefix"):
        waiting.match_again(shared)
    assert np.array_equal(waiting.page_indices(0), before) and waiting.num_reused_tokens == TPB
    waiting.close()
    mgr.check_invariants()
    mgr.close()


def test_a_cache_that_gave_up_reuse_keeps_what_it_has(tmp_path):
    """Tokens given up were counted as recomputed: matching them again would count them twice."""
    mgr = manager(tmp_path, primary=16, host=8, disk=0)
    oracle = PageOracle(mgr)
    shared = convo(5, 4 * TPB) + [9]
    computed(mgr, oracle, shared[: 3 * TPB]).close()
    waiting = mgr.create_cache(shared)
    assert waiting.shorten_reuse(TPB) == 2 * TPB
    recomputed = mgr.stats().recomputed_tokens
    assert waiting.match_again(shared) == 0
    assert waiting.num_reused_tokens == TPB and mgr.stats().recomputed_tokens == recomputed
    waiting.close()
    assert sum(mgr.stats().hit_tokens.values()) == TPB
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("partial", [False, True])
def test_nothing_published_past_the_reuse_costs_one_lookup_not_a_walk(tmp_path, monkeypatch, partial):
    """vLLM's scheduler asks a waiting request again at every step after saves landed: with no node
    for the block after its reuse, the prefix is not walked again."""
    mgr = manager(tmp_path, primary=16, host=8, disk=0, enable_partial_reuse=partial)
    oracle = PageOracle(mgr)
    shared = convo(6, 4 * TPB) + [9]
    computed(mgr, oracle, shared[: 2 * TPB]).close()
    waiting = mgr.create_cache(shared)
    walks = []
    match = type(mgr._pool).match
    monkeypatch.setattr(type(mgr._pool), "match", lambda *a, **k: walks.append(1) or match(*a, **k))
    assert waiting.match_again(shared) == 0 and walks == []
    computed(mgr, oracle, convo(7, 3 * TPB)).close()  # another prompt: no node after the reuse
    walks.clear()
    assert waiting.match_again(shared) == 0 and walks == []
    computed(mgr, oracle, shared[: 3 * TPB]).close()
    walks.clear()
    assert waiting.match_again(shared) == TPB and walks == [1]
    waiting.close()
    mgr.check_invariants()
    mgr.close()


def test_a_cache_whose_scope_was_forgotten_adopts_nothing_published_after(tmp_path):
    """The weights were replaced while the request waited: its reused prefix is the old weights'
    (the engine restarts such requests), and blocks computed with the new ones are not mixed in."""
    mgr = manager(tmp_path, primary=16, host=8, disk=0)
    oracle = PageOracle(mgr)
    shared = convo(8, 4 * TPB) + [9]
    computed(mgr, oracle, shared[:TPB]).close()
    waiting = mgr.create_cache(shared)
    assert waiting.num_reused_tokens == TPB
    mgr.forget_scope(waiting.scope)
    computed(mgr, oracle, shared[: 3 * TPB]).close()  # published anew, under the same scope
    fresh = mgr.create_cache(shared)
    assert fresh.num_reused_tokens == 3 * TPB
    fresh.close()
    assert waiting.match_again(shared) == 0
    assert waiting.num_reused_tokens == TPB
    assert waiting.resume()
    oracle.check(waiting, shared[:TPB])
    waiting.close()
    mgr.check_invariants()
    mgr.close()
