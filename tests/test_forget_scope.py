"""``KVCacheManager.forget_scope``: every block of a scope leaves every tier at once (pages a cache
holds stay with it until it lets go), other scopes keep theirs, and a restart finds none of it."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvtier
from tests.disk_speed import slow_disk_reads
from tests.kvdata import PageOracle, small_spec

TPB = 4
OLD = kvtier.ReuseScope(salt="weights-1")
OTHER = kvtier.ReuseScope(salt="tenant")


def make(path, pages: int = 12) -> kvtier.KVCacheManager:
    """Primary and host tiers of ``pages`` pages each, and a disk tier on ``path`` (None: none)."""
    spec = small_spec()
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = sum(probe.page_bytes(g.group_id) for g in probe.layer_groups)
    probe.close()
    tiers = [kvtier.PrimaryTier(page * pages), kvtier.HostTier(page * pages)]
    if path is not None:
        tiers.append(kvtier.DiskTier(page * 8 * pages, path))
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))


def publish(mgr, oracle, tokens, scope) -> kvtier.KVCache:
    cache = mgr.create_cache(tokens, scope)
    assert cache.resume() and cache.resize(len(tokens))
    oracle.write(cache, tokens, cache.num_committed_tokens, len(tokens))
    cache.commit(tokens[cache.num_committed_tokens :])
    return cache


def reused(mgr, tokens, scope) -> int:
    cache = mgr.create_cache([*tokens, 1], scope)
    n = cache.num_reused_tokens
    cache.close()
    return n


def disk_tokens(mgr, tokens) -> int:
    cache = mgr.create_cache([*tokens, 1], OLD)
    n = cache.reused_by_tier.get("disk", 0)
    cache.close()
    return n


def test_a_forgotten_scope_leaves_every_tier_and_others_keep_theirs(tmp_path):
    rng = np.random.default_rng(5)
    mgr = make(tmp_path / "disk")
    oracle = PageOracle(mgr)
    prompts = [rng.integers(3, 30_000, 6 * TPB).tolist() for _ in range(8)]  # more than the primary tier holds
    for tokens in prompts:
        publish(mgr, oracle, tokens, OLD).close()
        mgr.maintain()
    kept = publish(mgr, oracle, prompts[0][: 3 * TPB] + [7] * TPB, OTHER)
    kept.close()
    held_tokens = prompts[-1]
    held = mgr.create_cache([*held_tokens, 9], OLD)  # a suspended cache holding an old block chain
    assert held.num_reused_tokens == len(held_tokens)
    before = mgr.stats()
    assert {t: before.tiers[t].pages_used > 0 for t in ("primary", "host", "disk")} == {
        "primary": True,
        "host": True,
        "disk": True,
    }
    dropped = mgr.forget_scope(OLD)
    after = mgr.stats()
    mgr.check_invariants()
    used = lambda stats: sum(t.pages_used for t in stats.tiers.values())  # noqa: E731
    assert dropped > 0 and used(after) <= used(before) - dropped  # (a dropped page's copies go too)
    assert used(after) == 6 + 4  # what is left: the held chain's 6 pages and the other scope's 4
    assert after.drops == before.drops + dropped
    assert all(reused(mgr, tokens, OLD) == 0 for tokens in prompts[:-1])
    assert reused(mgr, prompts[0][: 3 * TPB] + [7] * TPB, OTHER) == 4 * TPB
    assert held.resume()  # its pages stayed with it, bytes and all
    oracle.check(held, [*held_tokens, 9])
    held.close()
    mgr.check_invariants()
    assert reused(mgr, held_tokens, OLD) == 0
    assert mgr.forget_scope(OLD) == 0 and mgr.forget_scope(kvtier.ReuseScope(salt="never used")) == 0
    with pytest.raises(TypeError, match="ReuseScope"):
        mgr.forget_scope("weights-1")
    mgr.close()
    again = make(tmp_path / "disk")  # a restart on the same directory: none of it comes back
    assert all(reused(again, tokens, OLD) == 0 for tokens in prompts)
    assert reused(again, prompts[0][: 3 * TPB] + [7] * TPB, OTHER) == 4 * TPB
    again.close()


def test_a_scope_forgotten_while_a_prefetch_reads_its_pages_from_disk(tmp_path, monkeypatch):
    """A read into host memory still running when its scope is forgotten: its pages are freed once
    it lands or is cancelled, and none of them is matched again."""
    rng = np.random.default_rng(6)
    mgr = make(tmp_path / "disk")
    oracle = PageOracle(mgr)
    prompts = [rng.integers(3, 30_000, 6 * TPB).tolist() for _ in range(8)]
    for tokens in prompts:
        publish(mgr, oracle, tokens, OLD).close()
        mgr.maintain()
    on_disk = next(t for t in prompts if disk_tokens(mgr, t))
    slow_disk_reads(monkeypatch, 64 << 10)
    job = mgr.prefetch_to_host(on_disk, OLD)
    assert job is not None and not job.done()
    assert mgr.forget_scope(OLD) > 0
    mgr.check_invariants()
    job.wait(30)
    mgr.maintain()  # lands what was read
    mgr.check_invariants()
    assert all(reused(mgr, tokens, OLD) == 0 for tokens in prompts)
    assert sum(t.pages_used for t in mgr.stats().tiers.values()) == 0
    mgr.close()


def old_request(mgr: kvtier.KVCacheManager, oracle: PageOracle, tokens: list[int], n: int) -> kvtier.KVCache:
    """An ACTIVE request of the old weights under ``OLD`` that computed and committed its first ``n`` tokens."""
    running = mgr.create_cache([*tokens, 1], OLD)
    assert running.resume() and running.resize(n)
    oracle.write(running, tokens, 0, n)
    running.commit(tokens[:n])
    return running


@pytest.mark.parametrize("state", ["active", "suspended"])
def test_a_cache_open_while_its_scope_is_forgotten_publishes_nothing_more(tmp_path, state):
    """Before: a cache open across ``forget_scope`` went on publishing its later blocks (of the old
    weights) under the chain the tree kept for it; once a new request filled the first blocks
    again, the next one was served the old blocks behind them."""
    rng = np.random.default_rng(6)
    mgr = make(tmp_path / "disk")
    tokens = rng.integers(3, 30_000, 6 * TPB).tolist()
    old, new = PageOracle(mgr), PageOracle(mgr, weights=1)
    running = old_request(mgr, old, tokens, 2 * TPB)  # two blocks of the old weights published
    if state == "suspended":
        running.suspend()
    mgr.forget_scope(OLD)
    assert running.resume() and running.resize(6 * TPB)
    old.write(running, tokens, 2 * TPB, 6 * TPB)
    running.commit(tokens[2 * TPB : 6 * TPB])  # the request goes on; none of this may be served
    running.close()
    assert reused(mgr, tokens, OLD) == 0
    publish(mgr, new, tokens, OLD).close()  # a request of the new weights
    cache = mgr.create_cache([*tokens, 1], OLD)
    assert cache.num_reused_tokens == 6 * TPB and cache.resume()
    new.check(cache, [*tokens, 1])  # every reused byte of the new weights
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_cache_that_starts_over_after_its_scope_was_forgotten_adopts_nothing(tmp_path):
    """Before: a suspended cache of the old weights whose disk page failed its checksum after
    ``forget_scope`` matched its tokens again and adopted the blocks a request of the new weights
    had published there: a prefix of other weights under its own later blocks."""
    rng = np.random.default_rng(8)
    mgr = make(tmp_path / "disk", pages=8)
    tokens = rng.integers(3, 30_000, 6 * TPB).tolist()
    old, new = PageOracle(mgr), PageOracle(mgr, weights=1)
    running = old_request(mgr, old, tokens, 2 * TPB)
    running.suspend()
    for _ in range(12):  # other requests push its pages down to disk
        publish(mgr, PageOracle(mgr), rng.integers(3, 30_000, 4 * TPB).tolist(), OTHER).close()
        mgr.maintain()
    pool = mgr._pool
    disk = next(t for t in pool.tiers if t.is_disk)
    held = running._table.live_pages()
    assert held and all(page.tier == disk.index for page in held)
    mgr.forget_scope(OLD)
    publish(mgr, new, tokens[: 2 * TPB], OLD).close()  # the new weights publish the same two blocks
    page = held[0]
    os.pwrite(disk.storage._fds[page.group], b"\xff" * 64, page.slot * disk.storage.page_bytes[page.group])
    assert running.resume()  # the damaged page: the cache starts over
    assert running.num_committed_tokens == 0  # as with reuse off: nothing of the new weights adopted
    assert running.resize(6 * TPB)
    old.write(running, tokens, 0, 6 * TPB)
    running.commit(tokens)
    running.close()
    cache = mgr.create_cache([*tokens, 1], OLD)
    assert cache.num_reused_tokens == 2 * TPB and cache.resume()
    new.check(cache, [*tokens[: 2 * TPB], 1])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_cache_for_a_prefix_of_a_request_whose_scope_was_forgotten_matches_and_publishes_nothing(tmp_path):
    """``cache_for_prefix`` of a cache open across ``forget_scope``. Before, the new cache matched
    the scope's new tree (adopting blocks of the new weights) and published what it committed
    there, so a later request of the new weights was served the old weights' bytes."""
    rng = np.random.default_rng(9)
    mgr = make(tmp_path / "disk")
    tokens = rng.integers(3, 30_000, 4 * TPB).tolist()
    old, new = PageOracle(mgr), PageOracle(mgr, weights=1)
    running = old_request(mgr, old, tokens, 4 * TPB)
    mgr.forget_scope(OLD)
    publish(mgr, new, tokens[: 2 * TPB], OLD).close()  # the new weights publish the first two blocks
    prefix = running.cache_for_prefix(3 * TPB)
    assert prefix.num_reused_tokens == 0  # nothing of the new weights adopted
    assert prefix.resume() and prefix.resize(3 * TPB)
    old.write(prefix, tokens, 0, 3 * TPB)
    prefix.commit(tokens[: 3 * TPB])
    prefix.close()
    running.close()
    cache = mgr.create_cache([*tokens, 1], OLD)
    assert cache.num_reused_tokens == 2 * TPB and cache.resume()  # only the new weights' blocks
    new.check(cache, [*tokens[: 2 * TPB], 1])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_scopes_used_once_leave_nothing_behind_once_their_blocks_are_gone():
    mgr = make(None, pages=6)  # primary + host, no disk: blocks pushed out of host memory are dropped
    oracle = PageOracle(mgr)
    for i in range(40):  # a salt per request, as per-user isolation gives
        tokens = [300 + 7 * i + j for j in range(9)]
        publish(mgr, oracle, tokens, kvtier.ReuseScope(salt=f"user-{i}")).close()
    assert len(mgr._pool.tree.roots) <= 12  # only the scopes whose blocks are still cached
    mgr.check_invariants()
    mgr.close()


def test_scopes_whose_caches_publish_nothing_leave_no_root():
    """A salt per request with prompts shorter than a block, or caches closed before they resume
    (a request aborted in the queue): no root stays. Before, each such scope kept its root for good
    (about 0.5 KB a request)."""
    mgr = make(None, pages=6)
    oracle = PageOracle(mgr)
    for i in range(30):
        short = [300 + 7 * i + j for j in range(TPB - 3)]
        publish(mgr, oracle, short, kvtier.ReuseScope(salt=f"short-{i}")).close()
        mgr.create_cache([400 + i + j for j in range(2 * TPB)], kvtier.ReuseScope(salt=f"queued-{i}")).close()
    assert mgr._pool.tree.roots == {}
    mgr.check_invariants()
    mgr.close()


def test_a_cache_whose_scope_root_emptied_meanwhile_publishes_where_it_is_found():
    mgr = make(None, pages=6)
    oracle = PageOracle(mgr)
    scope = kvtier.ReuseScope(salt="quiet")
    tokens = [41 + 3 * j for j in range(9)]
    waiting = mgr.create_cache(tokens, scope)  # holds its scope's root, has published nothing yet
    publish(mgr, oracle, [7, 8, 9, 10, 11], scope).close()
    for i in range(8):  # other requests push that block out of both tiers: the root empties and goes
        publish(mgr, oracle, [500 + 11 * i + j for j in range(9)], OTHER).close()
    assert scope not in mgr._pool.tree.roots
    assert waiting.resume() and waiting.resize(len(tokens))
    oracle.write(waiting, tokens, 0, len(tokens))
    waiting.commit(tokens)
    waiting.close()
    again = mgr.create_cache([*tokens, 1], scope)
    assert again.num_reused_tokens == 8
    assert again.resume()
    oracle.check(again, [*tokens, 1])
    again.close()
    mgr.check_invariants()
    mgr.close()
