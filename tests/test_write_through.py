"""Write-through copies in host memory and the primary tier's free reserve (``maintain``).

A published page copied to host memory is later demoted by taking its copy's slot: no byte
moves on the critical path, and the page comes back byte for byte. A page promoted from host
memory leaves its bytes there as a copy, so pushing it out again moves nothing either.
"""

from __future__ import annotations

import logging

import pytest

import kvtier
from tests.kvdata import PageOracle, small_spec

TPB = 4


def manager(primary_pages: int, host_pages: int, *, write_through=True, reserve=0.0, min_priority=0, min_hits=0):
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()
    tiers = [
        kvtier.PrimaryTier(primary_pages * page, free_reserve=reserve),
        kvtier.HostTier(
            host_pages * page,
            write_through=write_through,
            write_through_min_priority=min_priority,
            write_through_min_hits=min_hits,
        ),
    ]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    return mgr, PageOracle(mgr), page


def serve(mgr, oracle, prompt, priority=35):
    """Create, resume, check what was reused, write and commit the rest, close."""
    cache = mgr.create_cache(prompt, priority=priority)
    assert cache.resume()
    oracle.check(cache, prompt)
    start = cache.num_committed_tokens
    assert cache.resize(len(prompt))
    oracle.write(cache, prompt, start, len(prompt))
    cache.commit(prompt[start:])
    cache.close()
    return cache.num_reused_tokens


def copied(mgr, edge: str) -> int:
    return sum(n for key, n in mgr.stats().bytes_copied.items() if key.startswith(edge))


def fill_primary(mgr, oracle, blocks: int, base: int) -> None:
    """Another request's published blocks push out what the primary tier held."""
    serve(mgr, oracle, [base + i for i in range(blocks * TPB + 1)])


def test_write_through_demotes_without_copying():
    mgr, oracle, page = manager(primary_pages=6, host_pages=16)
    prompt = [100 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    assert copied(mgr, "primary->host") == 0
    assert mgr.maintain() == 4  # the prompt's 4 full blocks
    assert copied(mgr, "primary->host") == 4 * page
    assert mgr.maintain() == 0  # nothing new
    demotions = mgr.stats().demotions
    fill_primary(mgr, oracle, 5, 5000)
    assert mgr.stats().demotions - demotions >= 4
    assert copied(mgr, "primary->host") == 4 * page  # the demotions took the copies' slots
    assert serve(mgr, oracle, prompt + [7]) == 4 * TPB  # back from host, byte for byte
    mgr.check_invariants()
    mgr.close()


def test_promoted_page_keeps_its_host_copy():
    mgr, oracle, page = manager(primary_pages=6, host_pages=16, write_through=True)
    prompt = [200 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    mgr.maintain()
    fill_primary(mgr, oracle, 5, 6000)
    mgr.maintain()
    before = copied(mgr, "primary->host")
    serve(mgr, oracle, prompt + [9])  # promoted from host: the host slots keep the bytes
    fill_primary(mgr, oracle, 5, 7000)
    mgr.maintain()
    assert serve(mgr, oracle, prompt + [8]) == 4 * TPB
    stats = mgr.stats()
    # the prompt's pages went down twice more without a copy; only the fillers were written through
    assert copied(mgr, "primary->host") - before <= 2 * 5 * page + page
    assert stats.hit_tokens["host"] >= 8 * TPB
    mgr.check_invariants()
    mgr.close()


def test_without_write_through_demotions_copy():
    mgr, oracle, page = manager(primary_pages=6, host_pages=16, write_through=False)
    prompt = [300 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, prompt)
    assert mgr.maintain() == 0
    fill_primary(mgr, oracle, 5, 5000)
    assert copied(mgr, "primary->host") >= 4 * page
    assert serve(mgr, oracle, prompt + [7]) == 4 * TPB
    mgr.close()


def test_write_through_never_pushes_pages_out_of_host():
    mgr, oracle, _ = manager(primary_pages=6, host_pages=4)
    a = [400 + i for i in range(4 * TPB + 1)]
    serve(mgr, oracle, a)
    fill_primary(mgr, oracle, 5, 5000)  # a's 4 blocks go to host, which is then full
    host = mgr.stats().tiers["host"]
    assert host.pages_used == host.pages_total == 4
    assert mgr.maintain() == 0  # the fillers find no free host slot and push nothing out
    assert serve(mgr, oracle, a + [1]) == 4 * TPB
    mgr.check_invariants()
    mgr.close()


def test_min_priority_selects_pages():
    mgr, oracle, _ = manager(primary_pages=8, host_pages=16, min_priority=50)
    serve(mgr, oracle, [500 + i for i in range(2 * TPB + 1)], priority=35)
    serve(mgr, oracle, [600 + i for i in range(3 * TPB + 1)], priority=80)
    assert mgr.maintain() == 3
    mgr.close()


def test_min_hits_copies_only_blocks_reused_that_often():
    """Write-through selective by reuse (as SGLang's ``write_through_selective``): a block computed
    once and never asked again is not copied; one reused twice is, and is then demoted without a
    copy and served back from host memory byte for byte."""
    mgr, oracle, page = manager(primary_pages=8, host_pages=16, min_hits=2)
    shared = [700 + i for i in range(3 * TPB)]
    serve(mgr, oracle, shared + [1])  # computes and publishes the 3 shared blocks
    assert mgr.maintain() == 0  # published, never reused: not copied
    assert serve(mgr, oracle, shared + [2]) == 3 * TPB
    assert mgr.maintain() == 0  # reused once
    assert serve(mgr, oracle, shared + [3]) == 3 * TPB
    assert mgr.maintain() == 3  # reused twice: the 3 shared blocks, nothing else
    assert copied(mgr, "primary->host") == 3 * page
    fill_primary(mgr, oracle, 7, 8000)  # pushes the shared blocks down: they take their copies' slots
    assert copied(mgr, "primary->host") == 3 * page
    assert mgr.maintain() == 0  # the filler's blocks were never reused
    assert serve(mgr, oracle, shared + [4]) == 3 * TPB
    assert mgr.stats().hit_tokens["host"] >= 3 * TPB
    mgr.check_invariants()
    mgr.close()


def test_reuse_is_counted_only_for_a_write_through_policy_that_reads_it():
    for min_hits, write_through, counted in ((0, True, False), (1, False, False), (1, True, True)):
        mgr, oracle, _ = manager(primary_pages=8, host_pages=16, write_through=write_through, min_hits=min_hits)
        prompt = [800 + i for i in range(2 * TPB + 1)]
        serve(mgr, oracle, prompt)
        serve(mgr, oracle, prompt)
        pages = [p for p in mgr._pool.tiers[0].owners[0] if p is not None]
        assert pages and all(p.hits == (1 if counted else 0) for p in pages)
        mgr.close()


def test_a_cache_counts_one_reuse_of_the_prefix_it_kept_at_its_first_resume():
    """A reuse given up and adopted again (``shorten_reuse``) counts once, for what is kept; a cache
    never resumed, or resumed again, counts nothing more."""
    mgr, oracle, _ = manager(primary_pages=8, host_pages=16, min_hits=1)
    prompt = [900 + i for i in range(3 * TPB + 1)]
    serve(mgr, oracle, prompt)
    blocks = sorted((p for p in mgr._pool.tiers[0].owners[0] if p is not None), key=lambda p: p.node.block)
    assert len(blocks) == 3
    mgr.create_cache(prompt).close()  # never resumed: nothing reused
    assert [p.hits for p in blocks] == [0, 0, 0]
    cache = mgr.create_cache(prompt)
    assert cache.shorten_reuse(2 * TPB) == TPB  # keeps the first two blocks
    assert cache.resume()
    cache.suspend()
    assert cache.resume()  # the same cache again
    cache.close()
    assert [p.hits for p in blocks] == [1, 1, 0]
    assert mgr.maintain() == 2
    mgr.check_invariants()
    mgr.close()


def test_a_write_through_policy_without_write_through_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        mgr, _, _ = manager(primary_pages=4, host_pages=4, write_through=False, min_priority=50, min_hits=2)
    assert "write_through_min_priority=50, write_through_min_hits=2) has no effect" in caplog.text
    mgr.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        mgr, _, _ = manager(primary_pages=4, host_pages=4, write_through=True, min_hits=2)
        mgr.close()
        mgr, _, _ = manager(primary_pages=4, host_pages=4, write_through=False)
        mgr.close()
    assert "no effect" not in caplog.text


def test_free_reserve_keeps_slots_free():
    mgr, oracle, _ = manager(primary_pages=8, host_pages=16, write_through=False, reserve=0.25)
    fill_primary(mgr, oracle, 7, 9000)
    assert mgr.stats().tiers["primary"].pages_used == 7
    mgr.maintain()
    assert mgr.stats().tiers["primary"].pages_used == 6  # ceil(0.25 * 8) slots kept free
    assert mgr.stats().tiers["host"].pages_used == 1
    assert serve(mgr, oracle, [9000 + i for i in range(7 * TPB + 1)] + [3]) == 7 * TPB
    mgr.check_invariants()
    mgr.close()


def test_a_free_reserve_never_keeps_more_than_half_of_a_tier_free():
    """Before: rounded up past the share's cap: 0.5 of 3 slots kept 2 free, of 1 slot the whole tier."""
    for slots, kept in ((1, 0), (3, 1), (8, 4)):
        mgr, oracle, _ = manager(primary_pages=slots, host_pages=8, write_through=False, reserve=0.5)
        assert mgr._pool.background.reserve == [kept]
        mgr.close()
    mgr, oracle, _ = manager(primary_pages=1, host_pages=8, write_through=False, reserve=0.5)
    serve(mgr, oracle, [7000 + i for i in range(TPB)])
    mgr.maintain()
    assert mgr.stats().tiers["primary"].pages_used == 1  # its one page stays where it is
    mgr.close()


def test_a_free_reserve_without_a_tier_below_drops_nothing_and_says_so(caplog):
    """Before: with the primary tier alone, ``maintain`` dropped cached blocks to keep the reserve
    free (12 published blocks in 16 slots at 0.5: 4 dropped, a returning prompt reused 32 of 48
    tokens), though a request needing room drops one on demand as cheaply."""
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(16 * page, free_reserve=0.5)]))
    assert "free_reserve=0.5) has no effect" in caplog.text
    oracle = PageOracle(mgr)
    prompt = [4000 + i for i in range(12 * TPB + 1)]
    serve(mgr, oracle, prompt)
    mgr.maintain()
    assert mgr.stats().drops == 0 and mgr.stats().tiers["primary"].pages_used == 12
    assert serve(mgr, oracle, prompt) == 12 * TPB
    mgr.close()


def test_a_free_reserve_frees_what_it_can_when_active_caches_lock_the_rest():
    """Before: all or nothing: a reserve of 4 of 8 slots with 5 locked by an active cache and 3
    evictable freed none; now the 3 go to host memory."""
    mgr, oracle, _ = manager(primary_pages=8, host_pages=32, write_through=False, reserve=0.5)
    serve(mgr, oracle, [6000 + i for i in range(3 * TPB + 1)])  # 3 published blocks, evictable
    active = mgr.create_cache([7000 + i for i in range(5 * TPB)])
    assert active.resume() and active.resize(5 * TPB)  # 5 pages locked in the primary tier
    assert mgr.stats().tiers["primary"].pages_used == 8
    assert mgr.maintain() == 3
    assert mgr.stats().tiers["primary"].pages_used == 5 and mgr.stats().tiers["host"].pages_used == 3
    mgr.check_invariants()
    active.close()
    mgr.close()


def assert_the_reserve_drops_nothing(mgr, oracle) -> None:
    """12 published blocks in the primary tier, then ``maintain``: no page dropped, all reused."""
    prompt = [4000 + i for i in range(12 * TPB + 1)]
    serve(mgr, oracle, prompt)
    drops = mgr.stats().drops
    mgr.maintain()
    assert mgr.stats().drops == drops
    assert serve(mgr, oracle, prompt) == 12 * TPB


def test_a_free_reserve_never_drops_a_page_when_the_tier_below_takes_none():
    """Host memory full of a suspended cache's pages, which may not leave it: the reserve's victims
    have nowhere to go. Before, ``maintain`` dropped 4 published primary blocks (a returning prompt
    then reused 32 of 48 tokens)."""
    mgr, oracle, _ = manager(primary_pages=16, host_pages=4, write_through=False, reserve=0.5)
    tokens = [9000 + i for i in range(4 * TPB)]
    held = mgr.create_cache(tokens)
    assert held.resume() and held.resize(len(tokens))
    oracle.write(held, tokens, 0, len(tokens))
    held.suspend()
    big = [5000 + i for i in range(16 * TPB)]
    pusher = mgr.create_cache(big)  # pushes the suspended cache's 4 pages into host memory
    assert pusher.resume() and pusher.resize(len(big))
    pusher.close()
    assert mgr.stats().tiers["host"].pages_used == 4
    assert_the_reserve_drops_nothing(mgr, oracle)
    mgr.check_invariants()
    held.close()
    mgr.close()


def test_a_free_reserve_drops_nothing_through_a_disk_that_does_not_block(tmp_path):
    """Host memory full of pages a held prefetch pins, so the reserve's victims would go on to a
    ``DiskTier(blocking_writes=False)``, which drops what only the tree holds. Before, ``maintain``
    dropped 4 cached primary blocks that way (a returning prompt reused 32 of 48 tokens)."""
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()

    def make():
        tiers = [
            kvtier.PrimaryTier(16 * page, free_reserve=0.5),
            kvtier.HostTier(4 * page, write_through=False),
            kvtier.DiskTier(64 * page, str(tmp_path / "disk"), blocking_writes=False),
        ]
        return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))

    mgr = make()
    held_prompt = [9000 + i for i in range(4 * TPB + 1)]
    serve(mgr, PageOracle(mgr), held_prompt)
    mgr.close()  # persisted: on disk only once made again
    mgr = make()
    oracle = PageOracle(mgr)
    job = mgr.prefetch_to_host(held_prompt, hold=True)
    assert job.wait(10)
    mgr.maintain()
    assert len(job.held) == 4  # host memory full of held pages
    assert_the_reserve_drops_nothing(mgr, oracle)
    job.cancel()
    mgr.check_invariants()
    mgr.close()


def test_numpy_numbers_are_taken_as_settings():
    """Before, ``np.float32`` was refused as a free reserve (``np.float64`` taken) and ``np.int64`` as
    a write-through policy, which ``SchedulerConfig`` takes."""
    import numpy as np

    assert kvtier.PrimaryTier(1 << 20, free_reserve=np.float32(0.25)).free_reserve == 0.25
    host = kvtier.HostTier(1 << 20, write_through_min_priority=np.int64(50), write_through_min_hits=np.int32(2))
    assert (host.write_through_min_priority, host.write_through_min_hits) == (50, 2)
    assert type(host.write_through_min_priority) is int
    with pytest.raises(ValueError, match="write_through_min_hits"):
        kvtier.HostTier(1 << 20, write_through_min_hits=np.int64(-1))


def test_bad_settings_are_typed_errors():
    with pytest.raises(ValueError, match="free_reserve"):
        kvtier.PrimaryTier(1 << 20, free_reserve=0.9)
    with pytest.raises(TypeError, match="free_reserve"):
        kvtier.PrimaryTier(1 << 20, free_reserve="a")
    with pytest.raises(TypeError, match="write_through"):
        kvtier.HostTier(1 << 20, write_through="yes")
    with pytest.raises(ValueError, match="write_through_min_priority"):
        kvtier.HostTier(1 << 20, write_through_min_priority=101)
    for hits in (-1, True, 1.5, "2", 1 << 21):
        with pytest.raises(ValueError, match="write_through_min_hits"):
            kvtier.HostTier(1 << 20, write_through_min_hits=hits)


def test_maintain_after_close_raises():
    mgr, _, _ = manager(primary_pages=4, host_pages=4)
    mgr.close()
    with pytest.raises(kvtier.CacheStateError):
        mgr.maintain()


def test_pages_waiting_for_host_room_stay_watched():
    mgr, oracle, _ = manager(primary_pages=8, host_pages=2)
    serve(mgr, oracle, [1000 + i for i in range(6 * TPB + 1)])  # 6 published blocks, room for 2 copies
    assert mgr.maintain() == 2
    assert mgr.maintain() == 0  # host memory is full of copies: nothing to do
    assert len(mgr._pool.tiers[0].watch) == 4  # the other 4 wait for room, none forgotten
    mgr.close()
