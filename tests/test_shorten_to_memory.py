"""A cache that must not wait for the disk gives up the reused blocks from its first page there
(``KVCache.reused_in_memory``, ``KVCache.shorten_to_memory``), as vLLM's scheduler half does
before it answers: the resume after it reads nothing from disk, and what it kept is byte for byte
what was written.
"""

from __future__ import annotations

import random

import pytest

import kvtier
from tests.kvdata import PageOracle, small_spec
from tests.test_disk_write_behind import memory_and_disk
from tests.test_host_prefetch import damage_on_disk
from tests.test_tiers import convo, manager, prefill
from tests.test_write_through import TPB, copied, serve


def fillers(mgr, oracle, count, base=50_000):
    for k in range(count):
        serve(mgr, oracle, [base + 100 * k + i for i in range(4 * TPB + 1)])


def on_disk(mgr, oracle, prompt):
    """Publish ``prompt``'s blocks, then push them all to disk."""
    serve(mgr, oracle, prompt)
    fillers(mgr, oracle, 4)


def resume_from_memory(mgr, oracle, cache, tokens) -> None:
    """``cache`` resumes without reading the disk and holds the bytes written for ``tokens``."""
    read = copied(mgr, "disk->")
    assert cache.resume()
    assert copied(mgr, "disk->") == read
    oracle.check(cache, tokens)


def test_a_prefix_whose_tail_is_still_on_disk_keeps_its_head(tmp_path):
    mgr, oracle = memory_and_disk(tmp_path / "disk", 8, write_behind=False)  # the vLLM layout
    prompt = [900 + i for i in range(5 * TPB + 1)]
    on_disk(mgr, oracle, prompt)
    cache = mgr.create_cache(prompt + [1])  # holds the 5 blocks on disk, as a lease does before its read
    assert cache.num_reused_tokens == 5 * TPB and cache.reused_in_memory == 0
    hog = mgr.create_cache([70_000 + i for i in range(5 * TPB)])
    assert hog.resume() and hog.resize(5 * TPB)  # 5 of the 8 slots locked: room for 3 pages
    job = mgr.prefetch_to_host(prompt + [1])
    assert job is not None and job.num_pages == 3 and job.wait(10)
    mgr.maintain()  # lands blocks 0-2; blocks 3 and 4 stay on disk
    assert cache.reused_in_memory == 3 * TPB and cache.num_reused_tokens == 5 * TPB
    before = mgr.stats()
    assert cache.shorten_to_memory() == 2 * TPB
    after = mgr.stats()
    assert cache.num_reused_tokens == cache.num_committed_tokens == cache.reused_in_memory == 3 * TPB
    assert cache.reused_by_tier == {"primary": 3 * TPB, "host": 0, "disk": 0}
    assert after.hit_tokens == before.hit_tokens  # none counted before the request uses its reuse
    assert after.recomputed_tokens - before.recomputed_tokens == 2 * TPB
    assert cache.shorten_to_memory() == 0  # nothing left on disk
    hog.close()
    resume_from_memory(mgr, oracle, cache, prompt + [1])
    assert cache.resize(len(prompt))
    oracle.write(cache, prompt, 3 * TPB, len(prompt))  # the blocks given up, recomputed
    cache.commit(prompt[3 * TPB :])
    used = mgr.stats()  # counted at the first commit, for the tier the kept blocks were found on
    assert used.hit_tokens == {**before.hit_tokens, "primary": before.hit_tokens["primary"] + 3 * TPB}
    cache.close()
    mgr.check_invariants()
    again = mgr.create_cache(prompt + [2])
    assert again.num_reused_tokens == 5 * TPB  # the tree kept every block
    assert again.resume()
    oracle.check(again, prompt + [2])
    again.close()
    mgr.close()


def test_a_damaged_page_ends_the_prefix_in_memory(tmp_path):
    mgr, oracle = memory_and_disk(tmp_path / "disk", 8, write_behind=False)  # the vLLM layout
    prompt = [3900 + i for i in range(5 * TPB + 1)]
    on_disk(mgr, oracle, prompt)
    cache = mgr.create_cache(prompt + [1])
    damage_on_disk(mgr, prompt, 2)
    job = mgr.prefetch_to_host(prompt + [1])
    assert job.num_pages == 5 and job.wait(10)
    mgr.maintain()  # blocks 0, 1, 3 and 4 land; block 2 failed its checksum
    assert mgr.stats().checksum_failures == 1
    assert cache.reused_in_memory == 2 * TPB
    assert cache.shorten_to_memory() == 3 * TPB
    resume_from_memory(mgr, oracle, cache, prompt + [1])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_only_a_suspended_cache_holding_just_its_reuse_is_shortened(tmp_path):
    mgr, oracle = memory_and_disk(tmp_path / "disk", 8, write_behind=False)  # the vLLM layout
    prompt = [5900 + i for i in range(3 * TPB + 1)]
    on_disk(mgr, oracle, prompt)
    cache = mgr.create_cache(prompt + [1])
    assert cache.resume()
    with pytest.raises(kvtier.CacheStateError, match="SUSPENDED"):
        cache.shorten_to_memory()
    assert cache.resize(len(prompt) + 1)
    oracle.write(cache, prompt + [1], 3 * TPB, len(prompt) + 1)
    cache.commit((prompt + [1])[3 * TPB :])
    cache.suspend()
    fillers(mgr, oracle, 4, base=80_000)  # its pages go to disk, its own last block too
    assert cache.reused_in_memory < cache.num_reused_tokens
    with pytest.raises(kvtier.CacheStateError, match="committed"):
        cache.shorten_to_memory()  # it holds pages of its own: they would be lost
    assert cache.num_committed_tokens == len(prompt) + 1
    assert cache.resume()
    oracle.check(cache, prompt + [1])
    cache.close()
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_without_a_disk_tier_nothing_is_given_up():
    mgr = kvtier.KVCacheManager(small_spec("llama"), kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    oracle = PageOracle(mgr)
    prompt = [7900 + i for i in range(3 * TPB + 1)]
    serve(mgr, oracle, prompt)
    cache = mgr.create_cache(prompt + [1])
    assert cache.reused_in_memory == cache.num_reused_tokens == 3 * TPB
    assert cache.shorten_to_memory() == 0
    cache.close()
    mgr.close()


@pytest.mark.parametrize("kind", ["llama", "swa", "hybrid"])
@pytest.mark.parametrize("seed", range(3))
def test_shortened_caches_resume_from_memory_byte_for_byte(kind, seed, tmp_path):
    """Conversations that share prefixes, through tiers small enough for pages to reach the disk:
    every cache over one of them, shortened, resumes without reading the disk and holds the bytes
    written for its tokens (a window or a recurrent state may end its prefix sooner)."""
    rng = random.Random(seed)
    mgr = manager(tmp_path, kind, primary=8, host=6, disk=200, enable_partial_reuse=True)
    oracle = PageOracle(mgr)
    stems = [convo(i, rng.randrange(2, 7) * TPB) for i in range(6)]
    talks = [rng.choice(stems) + [rng.randrange(1, 9_000) for _ in range(rng.randrange(1, 9))] for _ in range(24)]
    given_up = 0
    for i, talk in enumerate(talks):
        prefill(mgr, oracle, talk, chunk=2 * TPB)
        back = rng.choice(talks[: i + 1])
        cache = mgr.create_cache(back)
        kept = cache.reused_in_memory
        given_up += cache.shorten_to_memory()
        assert cache.num_reused_tokens == cache.reused_in_memory <= kept
        resume_from_memory(mgr, oracle, cache, back)
        cache.close()
        mgr.check_invariants()
    assert given_up > 0  # pages were on disk
    mgr.close()


def test_shorten_reuse_gives_up_what_lies_past_its_limit_byte_for_byte():
    mgr = kvtier.KVCacheManager(small_spec("llama"), kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    oracle = PageOracle(mgr)
    serve(mgr, oracle, [8900 + i for i in range(4 * TPB + 1)])
    prompt = [8900 + i for i in range(3 * TPB + 2)]
    cache = mgr.create_cache(prompt + [1])  # three whole blocks, and a partly reused fourth
    assert cache.num_reused_tokens == 3 * TPB + 2
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error):
            cache.shorten_reuse(bad)
    assert cache.num_reused_tokens == 3 * TPB + 2  # refused: nothing changed
    before = mgr.stats()
    assert cache.shorten_reuse(3 * TPB) == 2
    assert cache.shorten_reuse(3 * TPB) == 0
    assert cache.num_reused_tokens == cache.num_committed_tokens == 3 * TPB
    assert cache.reused_by_tier["primary"] == 3 * TPB
    after = mgr.stats()
    assert after.hit_tokens == before.hit_tokens  # counted at the first commit or close
    assert after.recomputed_tokens - before.recomputed_tokens == 2
    assert cache.resume()
    oracle.check(cache, prompt[: 3 * TPB])
    assert cache.resize(len(prompt))
    with pytest.raises(kvtier.CacheStateError, match="shorten_reuse needs a SUSPENDED"):
        cache.shorten_reuse(0)
    cache.close()
    mgr.check_invariants()
    mgr.close()
