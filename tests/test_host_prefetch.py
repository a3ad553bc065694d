"""Prefetching a disk prefix into host memory on a background thread (``prefetch_to_host``).

The pages come back byte for byte through the host tier; a cancelled prefetch leaves unread pages
on disk; a damaged page is never reused; a resume while the read runs takes the pages from disk
itself; closing the manager stops the reads.
"""

from __future__ import annotations

import array
import os
import tempfile

import pytest

import kvtier
from kvtier.tiering import host_prefetch
from tests.holding import hold
from tests.kvdata import PageOracle, small_spec
from tests.test_write_through import TPB, serve


@pytest.fixture
def three_tiers():
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()
    with tempfile.TemporaryDirectory() as tmp:

        def make(host_pages=32):
            tiers = [
                kvtier.PrimaryTier(6 * page),
                kvtier.HostTier(host_pages * page, write_through=False),
                kvtier.DiskTier(64 * page, os.path.join(tmp, "disk")),
            ]
            mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
            return mgr, PageOracle(mgr)

        yield make


def to_disk(mgr, oracle, prompt, host_pages=32):
    """Publish ``prompt``'s blocks, then push them past host memory onto disk."""
    serve(mgr, oracle, prompt)
    for k in range(host_pages // 4 + 3):
        serve(mgr, oracle, [50_000 + 100 * k + i for i in range(4 * TPB + 1)])


def test_prefetch_lands_on_host_and_is_reused_byte_for_byte(three_tiers):
    mgr, oracle = three_tiers()
    prompt = [900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    cache = mgr.create_cache(prompt + [1])
    assert cache.reused_by_tier["disk"] == 5 * TPB
    cache.close()
    job = mgr.prefetch_to_host(prompt + [1])
    assert job is not None and job.num_pages == 5
    assert job.wait(10)
    mgr.check_invariants()  # read but not landed: pins and reserved host slots are accounted for
    assert mgr.maintain() == 0
    cache = mgr.create_cache(prompt + [2])
    assert cache.reused_by_tier["host"] == 5 * TPB and cache.reused_by_tier["disk"] == 0
    assert cache.resume()
    oracle.check(cache, prompt + [2])
    cache.close()
    assert mgr.prefetch_to_host(prompt + [3]) is None  # nothing left on disk to read
    mgr.check_invariants()
    mgr.close()


def test_cancelled_prefetch_leaves_unread_pages_on_disk(three_tiers, monkeypatch):
    monkeypatch.setattr(host_prefetch, "PART_BYTES", 1)  # one page per part: cancel stops between pages
    mgr, oracle = three_tiers()
    prompt = [1900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    job = mgr.prefetch_to_host(prompt + [1])
    job.cancel()
    job.wait(10)
    mgr.maintain()
    cache = mgr.create_cache(prompt + [2])
    assert cache.num_reused_tokens == 5 * TPB
    assert cache.reused_by_tier["host"] + cache.reused_by_tier["disk"] == 5 * TPB
    assert cache.resume()
    oracle.check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_prefetch_whose_reads_raise_is_logged_and_lands_nothing(three_tiers, monkeypatch, caplog):
    """Before: ``wait`` raised the read's own exception, and nothing logged it."""
    mgr, oracle = three_tiers()
    prompt = [2400 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)

    def broken(self, job):
        raise RuntimeError("a read went wrong")

    monkeypatch.setattr(host_prefetch.HostPrefetcher, "_read", broken)
    job = mgr.prefetch_to_host(prompt + [1])
    assert job.wait(10)
    mgr.maintain()
    assert "a prefetch from disk to host memory failed" in caplog.text
    cache = mgr.create_cache(prompt + [2])
    assert cache.reused_by_tier["disk"] == 5 * TPB  # the pages stay on disk, reused from there
    assert cache.resume()
    oracle.check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


@pytest.fixture
def held_reads(monkeypatch):
    """Prefetch reads wait for ``release`` before they start; ``started`` is set when one waits."""
    return hold(monkeypatch, host_prefetch.HostPrefetcher, "_read")


def test_resume_during_prefetch_reads_from_disk_itself(three_tiers, held_reads):
    started, release = held_reads
    mgr, oracle = three_tiers()
    prompt = [2900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    job = mgr.prefetch_to_host(prompt + [1])
    assert started.wait(10)
    cache = mgr.create_cache(prompt + [2])
    assert cache.resume()  # promoted straight from disk while the prefetch still waits
    oracle.check(cache, prompt + [2])
    mgr.check_invariants()
    release.set()
    job.wait(10)
    mgr.maintain()  # the pages moved meanwhile: the prefetch lands nothing, frees its host slots
    oracle.check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    assert mgr.stats().tiers["host"].pages_used <= 32
    mgr.close()


def damage_on_disk(mgr, prompt, block: int) -> None:
    """Overwrite part of the disk page of ``prompt``'s block ``block`` (group 0)."""
    pool = mgr._pool
    disk = next(t for t in pool.tiers if t.is_disk)
    node = pool.match(array.array("Q", prompt + [1]), kvtier.ReuseScope()).full_nodes[block]
    os.pwrite(disk.storage._fds[0], b"\xff" * 64, node.pages[0].slot * disk.storage.page_bytes[0])


def test_damaged_page_is_not_reused(three_tiers):
    mgr, oracle = three_tiers()
    prompt = [3900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    damage_on_disk(mgr, prompt, 2)
    job = mgr.prefetch_to_host(prompt + [1])
    job.wait(10)
    mgr.maintain()
    assert mgr.stats().checksum_failures == 1
    cache = mgr.create_cache(prompt + [2])
    assert cache.num_reused_tokens == 2 * TPB  # the intact blocks before the damaged one
    assert cache.resume()
    oracle.check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_close_stops_a_running_prefetch(three_tiers):
    mgr, oracle = three_tiers()
    prompt = [4900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    job = mgr.prefetch_to_host(prompt + [1])
    mgr.close()
    assert job.done()
    mgr2, _ = three_tiers()  # the same directory opens again: nothing was left half written
    assert mgr2.create_cache(prompt + [2]).num_reused_tokens == 5 * TPB
    mgr2.close()


def test_a_cpu_manager_without_a_host_tier_reads_into_its_primary_tier(tmp_path):
    """On the CPU the primary tier is host memory: a prefetch lands there, and a resume then
    reads nothing from disk (the vLLM connector's scheduler half relies on it)."""
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()
    tiers = [kvtier.PrimaryTier(8 * page), kvtier.DiskTier(64 * page, tmp_path / "disk")]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    oracle = PageOracle(mgr)
    prompt = [7900 + i for i in range(5 * TPB + 1)]
    serve(mgr, oracle, prompt)
    for k in range(4):  # other prompts push it out to disk
        serve(mgr, oracle, [60_000 + 100 * k + i for i in range(4 * TPB + 1)])
    assert mgr.create_cache(prompt + [1]).reused_by_tier["disk"] == 5 * TPB
    job = mgr.prefetch_to_host(prompt + [1])
    assert job is not None and job.num_pages == 5 and job.wait(10)
    mgr.maintain()  # lands it
    cache = mgr.create_cache(prompt + [2])
    assert cache.reused_by_tier.get("primary") == 5 * TPB and not cache.reused_by_tier.get("disk")
    read = mgr.stats().bytes_copied
    assert cache.resume()
    assert mgr.stats().bytes_copied == read  # nothing moved: the pages were in place
    oracle.check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_prefetch_without_host_or_disk_returns_none():
    spec = small_spec("llama")
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20), kvtier.HostTier(1 << 20)]))
    assert mgr.prefetch_to_host([1, 2, 3, 4, 5, 6]) is None
    with pytest.raises(TypeError, match="scope"):
        mgr.prefetch_to_host([1, 2, 3], scope="x")
    mgr.close()


def test_page_found_damaged_while_its_prefetch_waits(three_tiers, held_reads):
    """A promotion finds a page damaged while a prefetch still pins it: it is freed when the
    prefetch lets go, and every invariant holds in between."""
    _, release = held_reads
    mgr, oracle = three_tiers()
    prompt = [5900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    pool = mgr._pool
    disk = next(t for t in pool.tiers if t.is_disk)
    page = pool.match(array.array("Q", prompt + [1]), kvtier.ReuseScope()).full_nodes[0].pages[0]
    os.pwrite(disk.storage._fds[0], b"\xff" * 64, page.slot * disk.storage.page_bytes[0])
    job = mgr.prefetch_to_host(prompt + [1])
    mgr.prefetch(prompt + [1])  # promotes the first block, finds it damaged: unpublished while pinned
    assert page.damaged
    mgr.check_invariants()
    release.set()
    job.wait(10)
    mgr.maintain()
    mgr.check_invariants()
    assert mgr.create_cache(prompt + [2]).num_reused_tokens == 0
    mgr.close()


@pytest.mark.parametrize("ending", ["no close", "killed"])
@pytest.mark.parametrize("into", ["host tier", "primary tier"])
def test_a_process_ending_during_a_prefetch_leaves_the_disk_exact(tmp_path, ending, into):
    """A script that never closes its manager, or is killed, while a prefetch reads (into its host
    tier, or into the primary tier of a CPU manager without one): the next manager on the
    directory serves the prefix byte for byte."""
    from tests.test_disk_reliability import run_child

    end = "os.kill(os.getpid(), signal.SIGKILL)" if ending == "killed" else "pass"
    host = "kvtier.HostTier(32 * page, write_through=False)," if into == "host tier" else ""
    code = f"""
    import os, signal
    import kvtier
    from tests.kvdata import PageOracle, small_spec
    from tests.test_host_prefetch import to_disk, TPB
    spec = small_spec("llama")
    page = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])).page_bytes(0)
    tiers = [kvtier.PrimaryTier(6 * page), {host}
             kvtier.DiskTier(64 * page, {str(tmp_path / "disk")!r})]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    prompt = [6900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, PageOracle(mgr), prompt)
    mgr.close()
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))  # the prefix only on disk now
    job = mgr.prefetch_to_host(prompt + [1])
    assert job is not None
    {end}
    """
    out = run_child(code)
    assert out.returncode == (-9 if ending == "killed" else 0), out.stderr[-3000:]
    spec = small_spec("llama")
    page = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)])).page_bytes(0)
    tiers = [kvtier.PrimaryTier(6 * page), kvtier.DiskTier(64 * page, tmp_path / "disk")]
    if into == "host tier":
        tiers.insert(1, kvtier.HostTier(32 * page, write_through=False))
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    prompt = [6900 + i for i in range(5 * TPB + 1)]
    cache = mgr.create_cache(prompt + [2])
    assert cache.num_reused_tokens == 5 * TPB
    assert cache.resume()
    PageOracle(mgr).check(cache, prompt + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_held_prefetch_keeps_its_pages_in_host_memory_until_cancelled(three_tiers):
    """``hold=True``: what landed is neither demoted nor dropped while other prompts push host
    memory to disk; a cancel lets go at the manager's next call, and the pages are ordinary
    evictable host pages again. Without the hold the same traffic sends them back to disk."""
    for held in (True, False):
        mgr, oracle = three_tiers(host_pages=16)
        prompt = [3900 + i for i in range(5 * TPB + 1)]
        to_disk(mgr, oracle, prompt, host_pages=16)
        job = mgr.prefetch_to_host(prompt + [1], hold=held)
        assert job.wait(10)
        mgr.maintain()  # lands it
        for k in range(8):  # traffic that fills host memory several times over
            serve(mgr, oracle, [70_000 + 100 * k + i for i in range(4 * TPB + 1)])
        mgr.check_invariants()  # the held pages' pins are accounted for
        cache = mgr.create_cache(prompt + [2])
        assert cache.reused_by_tier["host"] == (5 * TPB if held else 0)
        cache.close()
        job.cancel()
        mgr.maintain()  # lets go
        mgr.check_invariants()
        for k in range(8):
            serve(mgr, oracle, [80_000 + 100 * k + i for i in range(4 * TPB + 1)])
        cache = mgr.create_cache(prompt + [3])
        assert cache.reused_by_tier["host"] == 0  # released: pushed on like any other page
        assert cache.resume()
        oracle.check(cache, prompt + [3])
        cache.close()
        mgr.check_invariants()
        mgr.close()


def held_read(three_tiers, first_token):
    """A manager, a 3-block prompt pushed to disk, and its held read, landed in host memory."""
    mgr, oracle = three_tiers()
    prompt = [first_token + i for i in range(3 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    job = mgr.prefetch_to_host(prompt + [1], hold=True)
    assert job.wait(10)
    mgr.maintain()
    return mgr, prompt, job


def test_a_manager_closed_while_a_prefetch_holds_pages_lets_go_of_them(three_tiers):
    mgr, prompt, _ = held_read(three_tiers, first_token=4900)
    with pytest.raises(TypeError, match="hold"):
        mgr.prefetch_to_host(prompt + [1], hold="yes")
    import numpy as np

    assert mgr.prefetch_to_host(prompt + [1], hold=np.True_) is None  # a numpy bool is taken (nothing left to read)
    mgr.check_invariants()
    mgr.close()  # persists: the held pages' pins go first


def test_a_held_page_another_request_promotes_is_let_go(three_tiers):
    """Request W waits with a held read of a prefix; request B, same prefix, is resumed first and
    closed. Before, W's hold kept 5 of the 6 primary slots pinned after B closed (a 2-page request
    could no longer resume and grow); the hold keeps pages in host memory only."""
    mgr, oracle = three_tiers()
    prefix = [5900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prefix)
    job = mgr.prefetch_to_host(prefix + [1], hold=True)
    assert job.wait(10)
    mgr.maintain()  # lands it: 5 pages held in host memory
    other = mgr.create_cache(prefix + [2])
    assert other.resume()  # promotes the held pages
    oracle.check(other, prefix + [2])
    other.close()
    assert not job.held and not mgr._pool.prefetcher.pins
    mgr.check_invariants()
    run = mgr.create_cache([7000 + i for i in range(2 * TPB)])
    assert run.resume() and run.resize(2 * TPB)
    run.close()
    job.cancel()
    mgr.maintain()
    mgr.check_invariants()
    mgr.close()


def test_the_invariant_check_lets_go_of_nothing(three_tiers, caplog):
    """``check_invariants`` (run after every call under ``KVTIER_DEBUG=1``) only looks: a cancelled
    hold keeps its pins, and a cache dropped without ``close`` its pages, until the manager's next
    call that lets go of them, as in a run without the check. Before, the check let go of both."""
    mgr, _, job = held_read(three_tiers, first_token=5900)
    assert len(job.held) == 3
    dropped = mgr.create_cache([7100 + i for i in range(2 * TPB + 1)])
    assert dropped.resume() and dropped.resize(2 * TPB + 1)
    del dropped  # never closed: its pages are held until the manager's next call
    job.cancel()
    with caplog.at_level("WARNING", logger="kvtier"):
        mgr.check_invariants()
        assert len(job.held) == 3 and "dropped without close" not in caplog.text
        mgr.maintain()  # the next call that lands reads or makes room lets go of both
        assert job.held == [] and "dropped without close" in caplog.text
    mgr.check_invariants()
    mgr.close()


def test_cached_tokens_in_memory_stops_at_the_first_block_on_disk(three_tiers):
    mgr, oracle = three_tiers()
    prompt = [6900 + i for i in range(5 * TPB + 1)]
    to_disk(mgr, oracle, prompt)
    assert mgr.cached_tokens(prompt + [1]) == 5 * TPB
    assert mgr.cached_tokens(prompt + [1], in_memory=True) == 0
    job = mgr.prefetch_to_host(prompt[: 3 * TPB + 1])  # the first three blocks back in host memory
    assert job.wait(10)
    assert mgr.cached_tokens(prompt + [1], in_memory=True) == 3 * TPB  # (the read is landed first)
    assert mgr.cached_tokens(prompt + [1]) == 5 * TPB
    mgr.check_invariants()
    mgr.close()
