"""Disk write-behind (``DiskTier(write_behind=True)``): copies of the coldest host pages written to
disk on a background thread.

A page written behind is later demoted without a write and comes back byte for byte; a page that
moved while its batch was written gets no copy (its host slot may have held other bytes meanwhile);
the copies survive a restart; a process killed, or ending without ``close()``, during a batch
leaves the disk exact.
"""

from __future__ import annotations

import gc
import shutil
import threading
import time

import pytest

import kvtier
from kvtier.config import write_behind_enabled
from kvtier.tiering import disk_write_behind
from tests.holding import hold
from tests.kvdata import PageOracle, small_spec
from tests.test_write_through import TPB, serve

HOST_PAGES = 32


def page_bytes(spec) -> int:
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    size = probe.page_bytes(0)
    probe.close()
    return size


def make(path, write_behind=True, host_tier=True, blocking_writes=True):
    """A CPU manager with a host tier; or, without one, a primary tier as large (host memory)."""
    spec = small_spec("llama")
    page = page_bytes(spec)
    memory = [kvtier.PrimaryTier(6 * page), kvtier.HostTier(HOST_PAGES * page, write_through=False)]
    if not host_tier:
        memory = [kvtier.PrimaryTier((6 + HOST_PAGES) * page)]
    tiers = [*memory, kvtier.DiskTier(64 * page, path, write_behind=write_behind, blocking_writes=blocking_writes)]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    return mgr, PageOracle(mgr)


def prompt_of(base: int, blocks: int = 5) -> list[int]:
    return [base + i for i in range(blocks * TPB + 1)]


def to_host(mgr, oracle, prompt) -> None:
    """Publish ``prompt``'s blocks, then push them out of the primary tier into host memory."""
    serve(mgr, oracle, prompt)
    for k in range(3):
        serve(mgr, oracle, prompt_of(70_000 + 1000 * k, blocks=2))


def write_behind(mgr) -> int:
    """Run one batch to the end and land it; the pages that got a disk copy."""
    mgr.maintain()
    batch = mgr._pool.write_behind.active
    assert batch is not None
    return mgr._pool.write_behind.poll(wait=True)


def pages_of(mgr, prompt) -> list:
    """The pages holding ``prompt``'s cached blocks (as a new request would reuse them)."""
    cache = mgr.create_cache(prompt + [1])
    pages = list(cache._table.live_pages())
    cache.close()
    return pages


def reuse_exactly(mgr, oracle, prompt, tier=None) -> None:
    """A new request for ``prompt`` reuses its five cached blocks (from ``tier``, if given), byte for byte."""
    cache = mgr.create_cache(prompt + [2])
    reused = cache.num_reused_tokens if tier is None else cache.reused_by_tier[tier]
    assert reused == 5 * TPB
    assert cache.resume()
    oracle.check(cache, prompt + [2])
    cache.close()


@pytest.fixture
def written_pages(monkeypatch):
    """Records the pages the disk tier writes on the pool's own thread (demotions)."""
    from kvtier.tiering.mover import Mover

    written = []
    real = Mover.write_pages

    def recording(self, pages, disk_slots):
        written.extend(pages)
        return real(self, pages, disk_slots)

    monkeypatch.setattr(Mover, "write_pages", recording)
    return written


def test_a_page_written_behind_is_demoted_without_a_write(tmp_path, written_pages):
    mgr, oracle = make(tmp_path / "disk")
    prompt = prompt_of(1000)
    to_host(mgr, oracle, prompt)
    pages = pages_of(mgr, prompt)
    assert len(pages) == 5 and all(p.tier == 1 for p in pages)
    assert write_behind(mgr) >= 5
    disk = mgr._pool.tiers[2]
    copy_slots = {id(p): disk.copies[p].slot for p in pages}
    mgr.check_invariants()
    written_pages.clear()
    for k in range(HOST_PAGES // 4 + 3):  # push the prompt past host memory, no maintain in between
        serve(mgr, oracle, prompt_of(80_000 + 1000 * k, blocks=4))
    assert all(p.tier == 2 and p.slot == copy_slots[id(p)] for p in pages)  # each took its copy's slot
    assert not {id(p) for p in pages} & {id(p) for p in written_pages}
    reuse_exactly(mgr, oracle, prompt, "disk")
    mgr.check_invariants()
    mgr.close()


def test_a_directory_removed_under_its_manager_gets_no_more_pages_written_behind(tmp_path):
    """Write-behind looks at the directory before each batch (``Tier.still_writable``): once it is
    removed, nothing more is written behind (before, batches went on into the removed files)."""
    mgr, oracle = make(tmp_path / "disk")
    prompt = prompt_of(1000)
    to_host(mgr, oracle, prompt)
    shutil.rmtree(next((tmp_path / "disk").glob("kvtier-*")))
    mgr.maintain()
    assert mgr._pool.write_behind.active is None and not mgr._pool.tiers[2].writable
    reuse_exactly(mgr, oracle, prompt, "host")
    mgr.check_invariants()
    mgr.close()


def memory_and_disk(path, primary_pages: int, write_behind: bool = True, blocking_writes: bool = True):
    """A CPU manager without a host tier (its primary tier is host memory, as in the vLLM
    connector), its disk written behind that tier unless ``write_behind`` is False."""
    spec = small_spec("llama")
    page = page_bytes(spec)
    disk = kvtier.DiskTier(64 * page, path, write_behind=write_behind, blocking_writes=blocking_writes)
    tiers = [kvtier.PrimaryTier(primary_pages * page), disk]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    return mgr, PageOracle(mgr)


def test_a_cpu_manager_without_a_host_tier_writes_its_primary_tier_behind(tmp_path, written_pages):
    """On the CPU the primary tier is host memory (as in the vLLM connector): its coldest published
    pages get disk copies in the background, and pushing them out later writes nothing."""
    mgr, oracle = memory_and_disk(tmp_path / "disk", 12)
    prompt = prompt_of(3000)
    serve(mgr, oracle, prompt)
    serve(mgr, oracle, prompt_of(71_000, blocks=5))  # 10 of 12 slots used: fewer free than a batch
    pages = pages_of(mgr, prompt)
    assert write_behind(mgr) >= 5
    disk = mgr._pool.tiers[1]
    assert all(p.tier == 0 and p in disk.copies for p in pages)
    written_pages.clear()
    for k in range(4):  # push the prompt out of the primary tier, no maintain in between
        serve(mgr, oracle, prompt_of(81_000 + 1000 * k, blocks=4))
    assert all(p.tier == 1 for p in pages)
    assert not {id(p) for p in pages} & {id(p) for p in written_pages}
    reuse_exactly(mgr, oracle, prompt, "disk")
    mgr.check_invariants()
    mgr.close()


def test_pages_demoted_onto_their_disk_copies_make_nothing_else_leave_the_disk(tmp_path):
    """Host memory for 4 pages, a disk for 6; prompts of 3 blocks. Before: making room on the disk
    counted the victims that land on their own copies as needing free slots, so a full disk
    dropped another prompt's pages for them (the first prompt was lost here)."""
    spec = small_spec("llama")
    page = page_bytes(spec)
    tiers = [kvtier.PrimaryTier(4 * page), kvtier.DiskTier(6 * page, tmp_path / "disk", write_behind=True)]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))
    oracle = PageOracle(mgr)
    prompts = [prompt_of(10_000 * (i + 1), blocks=3) for i in range(3)]
    for prompt in prompts[:2]:
        serve(mgr, oracle, prompt)  # the one before goes onto its disk copies
        assert write_behind(mgr) == 3
    assert mgr.stats().tiers["disk"].pages_used == 6  # full: the first prompt, the second's copies
    serve(mgr, oracle, prompts[2])  # the second goes onto its copies: no slot wanted on the disk
    assert mgr.stats().drops == 0 and mgr.stats().tiers["disk"].pages_used == 6
    cache = mgr.create_cache(prompts[0] + [2])
    assert cache.reused_by_tier["disk"] == 3 * TPB
    assert cache.resume()
    oracle.check(cache, prompts[0] + [2])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_pages_that_become_evictable_wake_an_idle_write_behind(tmp_path):
    """Nothing to write while every page is held by an active cache; once it closes (no page moved)
    its published pages are written behind."""
    mgr, oracle = memory_and_disk(tmp_path / "disk", 8)
    prompt = prompt_of(5000)
    cache = mgr.create_cache(prompt)
    assert cache.resume() and cache.resize(len(prompt))
    oracle.write(cache, prompt, 0, len(prompt))
    cache.commit(prompt)
    mgr.maintain()
    assert mgr._pool.write_behind.active is None  # its pages are locked: nothing to write
    cache.close()
    assert write_behind(mgr) == 5
    mgr.check_invariants()
    mgr.close()


def test_without_blocking_writes_a_page_not_written_behind_is_dropped_not_written(tmp_path, written_pages):
    """``DiskTier(blocking_writes=False)``: pushed out of host memory, a page with a disk copy
    takes it, one without is dropped (a later miss) and nothing is written on the caller's
    thread; a page a suspended cache holds is still written (it may not be dropped)."""
    mgr, oracle = memory_and_disk(tmp_path / "disk", 12, blocking_writes=False)
    copied_prompt, held_prompt, dropped_prompt = prompt_of(3000), prompt_of(4000, blocks=2), prompt_of(5000, blocks=4)
    serve(mgr, oracle, copied_prompt)
    assert write_behind(mgr) == 5
    held = mgr.create_cache(held_prompt)
    assert held.resume() and held.resize(len(held_prompt))
    oracle.write(held, held_prompt, 0, len(held_prompt))
    held.commit(held_prompt)
    held.suspend()
    held_pages = {id(p) for p in held._table.live_pages()}
    serve(mgr, oracle, dropped_prompt)  # not written behind: no maintain since
    drops = mgr.stats().drops
    for k in range(3):  # push everything out of the primary tier, no maintain in between
        serve(mgr, oracle, prompt_of(81_000 + 1000 * k, blocks=4))
    assert mgr.stats().drops >= drops + 4
    assert written_pages and {id(p) for p in written_pages} <= held_pages  # only the held cache's were written
    reuse_exactly(mgr, oracle, copied_prompt, "disk")
    assert mgr.create_cache(dropped_prompt + [1]).num_reused_tokens == 0
    assert held.resume()
    oracle.check(held, held_prompt)
    held.close()
    mgr.check_invariants()
    mgr.close()


def test_a_batch_writes_the_locked_prefix_above_its_pages_too(tmp_path):
    """A hot prefix held by an active cache is never in the eviction order; a batch of the pages
    below it writes it first, so the chain lands whole (a restart after a crash reaches them)."""
    mgr, oracle = memory_and_disk(tmp_path / "disk", 12)
    system = prompt_of(5000, blocks=3)[:-1]
    hot = mgr.create_cache(system + [1])
    assert hot.resume() and hot.resize(len(system) + 1)
    oracle.write(hot, system + [1], 0, len(system) + 1)
    hot.commit(system + [1])
    serve(mgr, oracle, system + prompt_of(6000, blocks=2))  # two blocks below the hot prefix
    disk = mgr._pool.tiers[1]
    hot_pages = hot._table.live_pages()[:3]
    assert write_behind(mgr) >= 5
    assert all(page in disk.copies and page.locks for page in hot_pages)
    hot.close()
    mgr.check_invariants()
    mgr.close()


def reachable_after_a_crash(mgr) -> bool:
    """Whether every page the disk tier holds (originals and copies) is one a restart could reach:
    its block and every block above have their full-attention pages on disk."""
    disk = mgr._pool.tiers[-1]
    on_disk = [page for owners in disk.owners for page in owners if page is not None]
    whole: dict[int, bool] = {}
    return all(disk.chain_whole(page.node, whole, on_disk=True) for page in on_disk)


def test_pages_below_a_prefix_held_only_on_the_gpu_are_not_written_behind_until_it_is_on_disk(tmp_path):
    """A batch writes what a restart after a crash would reach. Before, pages in host memory below a
    hot prefix held in the primary tier were written without it: a process killed then left rows
    no match could reach, which the next start dropped (with a WARNING about lost pages)."""
    mgr, oracle = make(tmp_path / "disk")
    system = prompt_of(5000, blocks=2)[:-1]
    hot = mgr.create_cache(system + [1])
    assert hot.resume() and hot.resize(len(system) + 1)
    oracle.write(hot, system + [1], 0, len(system) + 1)
    hot.commit(system + [1])
    below = system + prompt_of(6000, blocks=2)
    serve(mgr, oracle, below)
    to_host(mgr, oracle, prompt_of(7000, blocks=2))  # pushes the blocks below the hot prefix to host memory
    tail = pages_of(mgr, below)[2:]
    assert all(page.tier == 1 for page in tail) and all(page.tier == 0 for page in hot._table.live_pages()[:2])
    mgr.maintain()
    mgr._pool.write_behind.poll(wait=True)
    disk = mgr._pool.tiers[2]
    assert disk.copies and not any(page in disk.copies for page in tail)  # others were written
    assert reachable_after_a_crash(mgr)
    hot.close()
    for k in range(3):  # the hot prefix goes to host memory, then the blocks below it can go
        serve(mgr, oracle, prompt_of(80_000 + 1000 * k, blocks=2))
    for _ in range(4):
        mgr.maintain()
        mgr._pool.write_behind.poll(wait=True)
    assert all(page in disk.copies or page.tier == 2 for page in pages_of(mgr, below))
    assert reachable_after_a_crash(mgr)
    mgr.check_invariants()
    mgr.close()


@pytest.fixture
def held_writes(monkeypatch):
    """Write-behind batches wait for ``release`` before they write; ``started`` is set when one waits."""
    return hold(monkeypatch, disk_write_behind.DiskWriteBehind, "_write")


def test_a_page_that_moves_while_its_batch_is_written_gets_no_copy(tmp_path, held_writes):
    started, release = held_writes
    mgr, oracle = make(tmp_path / "disk")
    prompt, other = prompt_of(2000), prompt_of(3000)
    to_host(mgr, oracle, other)
    to_host(mgr, oracle, prompt)
    moved, stayed = pages_of(mgr, prompt), pages_of(mgr, other)
    mgr.maintain()
    assert started.wait(10)
    batch = mgr._pool.write_behind.active
    assert {id(p) for p in moved + stayed} <= {id(p) for p in batch.pages}
    cache = mgr.create_cache(prompt + [1])  # promoted while its bytes are being written
    assert cache.resume()
    oracle.check(cache, prompt + [1])
    cache.close()
    to_host(mgr, oracle, prompt_of(4000))  # pushes it back into host memory, maybe into the same slots
    mgr.check_invariants()  # the batch's disk slots are reserved, owned by no page
    release.set()
    assert mgr._pool.write_behind.poll(wait=True) >= len(stayed)
    disk = mgr._pool.tiers[2]
    assert not any(p in disk.copies for p in moved)
    assert all(p in disk.copies for p in stayed)
    mgr.check_invariants()
    for k in range(HOST_PAGES // 4 + 3):
        serve(mgr, oracle, prompt_of(90_000 + 1000 * k, blocks=4))
    for tokens in (prompt, other):
        reuse_exactly(mgr, oracle, tokens)
    mgr.close()


def test_copies_written_behind_survive_a_restart(tmp_path):
    mgr, oracle = make(tmp_path / "disk")
    prompt = prompt_of(5000)
    to_host(mgr, oracle, prompt)
    assert write_behind(mgr) >= 5
    mgr.close()
    mgr, oracle = make(tmp_path / "disk")
    reuse_exactly(mgr, oracle, prompt, "disk")
    mgr.check_invariants()
    mgr.close()


MEMORY = {  # make()'s keywords: a host tier; host memory as the primary tier; that, dropping what is not written behind
    "host-tier": {},
    "cpu-primary": {"host_tier": False},
    "cpu-primary-dropping": {"host_tier": False, "blocking_writes": False},
}


@pytest.mark.parametrize(
    ("ending", "memory"),
    [("killed", "host-tier"), ("killed", "cpu-primary"), ("killed", "cpu-primary-dropping")]
    + [("no close", "host-tier"), ("no close", "cpu-primary")],
)
def test_a_process_ending_during_a_batch_leaves_the_disk_exact(tmp_path, ending, memory):
    """Killed, or exiting without ``close()``, while a batch writes: the next manager serves what
    was on disk, and (no close: persisted at exit) the pages that were in memory, byte for byte."""
    from tests.test_disk_reliability import run_child

    end = "os.kill(os.getpid(), signal.SIGKILL)" if ending == "killed" else "pass"
    code = f"""
    import os, signal, time
    from tests.test_disk_write_behind import make, prompt_of, to_host
    mgr, oracle = make({str(tmp_path / "disk")!r}, **{MEMORY[memory]!r})
    prompt = prompt_of(6000)
    to_host(mgr, oracle, prompt)
    mgr.close()  # the prompt is on disk now
    mgr, oracle = make({str(tmp_path / "disk")!r}, **{MEMORY[memory]!r})
    for k in range(4):
        to_host(mgr, oracle, prompt_of(7000 + 1000 * k))
    mgr.maintain()
    assert mgr._pool.write_behind.active is not None
    time.sleep(0.01)
    {end}
    """
    out = run_child(code)
    assert out.returncode == (-9 if ending == "killed" else 0), out.stderr[-3000:]
    mgr, oracle = make(tmp_path / "disk", **MEMORY[memory])
    mgr.check_invariants()
    reuse_exactly(mgr, oracle, prompt_of(6000))
    if ending == "no close":
        for k in range(4):
            reuse_exactly(mgr, oracle, prompt_of(7000 + 1000 * k))
    mgr.close()


def test_close_waits_for_a_running_batch(tmp_path, held_writes):
    started, release = held_writes
    mgr, oracle = make(tmp_path / "disk")
    to_host(mgr, oracle, prompt_of(8000))
    mgr.maintain()
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    mgr.close()  # lands the batch, then persists and closes the files
    assert mgr._pool.write_behind.active is None


def test_write_behind_setting(tmp_path):
    page = page_bytes(small_spec("llama"))
    disk = kvtier.DiskTier(64 * page, tmp_path / "disk")
    host = kvtier.HostTier(8 * page)
    with pytest.raises(TypeError, match="write_behind"):
        kvtier.DiskTier(64 * page, tmp_path / "disk", write_behind="yes")
    cpu = kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(8 * page), host, disk])
    assert not write_behind_enabled(cpu)  # off by default on a CPU device, on for CUDA
    on = kvtier.DiskTier(64 * page, tmp_path / "disk", write_behind=True)
    assert write_behind_enabled(kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(8 * page), host, on]))
    alone = [kvtier.PrimaryTier(8 * page), on]  # no host tier: on the CPU, the primary tier is host memory
    assert write_behind_enabled(kvtier.CacheConfig(TPB, alone))
    with pytest.raises(ValueError, match="needs a HostTier"):  # no host memory above the disk to write from
        kvtier.CacheConfig(TPB, alone, device="cuda")
    assert not write_behind_enabled(kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(8 * page), disk], device="cuda"))
    assert not write_behind_enabled(kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(8 * page), disk]))  # off by default
    mgr = kvtier.KVCacheManager(small_spec("llama"), kvtier.CacheConfig(TPB, alone))
    assert mgr._pool.write_behind.host is mgr._pool.tiers[0]
    mgr.close()


def test_failed_writes_leave_no_copy_and_free_their_slots(tmp_path, monkeypatch):
    from kvtier.storage.page_files import DiskStorage

    mgr, oracle = make(tmp_path / "disk")
    prompt = prompt_of(9000)
    to_host(mgr, oracle, prompt)
    used = mgr.stats().tiers["disk"].pages_used
    monkeypatch.setattr(DiskStorage, "write", lambda self, group, slots, pages: [None] * len(slots))  # disk full
    assert write_behind(mgr) == 0
    assert mgr.stats().tiers["disk"].pages_used <= used
    assert not mgr._pool.tiers[2].copies
    mgr.check_invariants()
    monkeypatch.undo()
    reuse_exactly(mgr, oracle, prompt)
    mgr.close()


def test_a_manager_dropped_during_a_batch_lets_the_next_one_open_its_directory(tmp_path, held_writes):
    """A manager dropped without close() while a batch is written stays alive, holding the
    directory, until the batch is done: the next manager of the process waits for that, not for a
    manager still in use, which it refuses at once."""
    started, release = held_writes
    mgr, oracle = memory_and_disk(tmp_path / "disk", 12)
    serve(mgr, oracle, prompt_of(3000))
    serve(mgr, oracle, prompt_of(71_000, blocks=5))
    mgr.maintain()
    assert started.wait(10)
    del mgr, oracle  # no close()
    gc.collect()
    threading.Timer(0.3, release.set).start()
    again, oracle = memory_and_disk(tmp_path / "disk", 12)  # waits for the batch, then opens the directory
    serve(again, oracle, prompt_of(5000))
    reuse_exactly(again, oracle, prompt_of(5000))
    again.check_invariants()
    began = time.monotonic()
    with pytest.raises(kvtier.DiskTierBusyError):  # a manager in use: refused without waiting
        memory_and_disk(tmp_path / "disk", 12)
    assert time.monotonic() - began < 5
    again.close()
