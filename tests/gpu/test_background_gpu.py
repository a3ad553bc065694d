"""Background work on a CUDA device, byte for byte: write-through copies racing the compute that
reuses their source slots, demotions and promotions running both ways at once, disk reads sent
up part by part, and prefetches from disk into pinned host memory."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import kvtier
from kvtier.tiering import duplex, mover
from tests.kvdata import PageOracle
from tests.test_background_properties import machine
from tests.test_write_through import serve

TPB = 16
# 2 MiB pages: a write-through batch takes long enough on the link for a missing wait to show
BIG = kvtier.ModelSpec.uniform(32, 8, 128, torch.float16)


def big_manager(tmp_path, primary, host, disk=0, write_through=True, reserve=0.0):
    probe = kvtier.KVCacheManager(BIG, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 24)], device="cuda"))
    page = probe.page_bytes(0)
    probe.close()
    tiers = [
        kvtier.PrimaryTier(primary * page, free_reserve=reserve),
        kvtier.HostTier(host * page, write_through=write_through),
    ]
    if disk:
        tiers.append(kvtier.DiskTier(disk * page, os.path.join(tmp_path, "disk")))
    mgr = kvtier.KVCacheManager(BIG, kvtier.CacheConfig(TPB, tiers, device="cuda"))
    return mgr, PageOracle(mgr)


def prompt(i: int, blocks: int) -> list[int]:
    return [100_000 * (i + 1) + j for j in range(blocks * TPB + 1)]


def test_write_through_copies_race_new_writes(tmp_path):
    mgr, oracle = big_manager(tmp_path, primary=24, host=96)
    for round_ in range(6):
        kept = prompt(round_, 20)
        serve(mgr, oracle, kept)
        mgr.maintain()  # 20 x 2 MiB go down on the background stream...
        serve(mgr, oracle, prompt(50 + round_, 22))  # ...while these take their slots at once
        assert serve(mgr, oracle, kept + [1]) == 20 * TPB
    stats = mgr.stats()
    assert stats.demotions > 0
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("min_part_mib, several_parts", [(2, True), (32, False)])  # victims: at most 40 MiB
def test_duplex_resume_is_exact(tmp_path, monkeypatch, min_part_mib, several_parts):
    monkeypatch.setattr(duplex, "DUPLEX_MIN_PART_BYTES", min_part_mib << 20)
    demotions = []  # pages per primary->host copy of a duplex move
    run_duplex, copy_edge = mover.Mover._duplex, mover.Mover._copy_edge
    inside = []

    def counted_duplex(self, *args):
        inside.append(True)
        try:
            run_duplex(self, *args)
        finally:
            inside.pop()

    def counted_edge(self, edge, pairs, stream):
        if inside and edge[:2] == (0, 1):
            demotions.append(len(pairs))
        copy_edge(self, edge, pairs, stream)

    monkeypatch.setattr(mover.Mover, "_duplex", counted_duplex)
    monkeypatch.setattr(mover.Mover, "_copy_edge", counted_edge)
    mgr, oracle = big_manager(tmp_path, primary=24, host=256, write_through=False)  # never full: no swap
    for round_ in range(4):
        kept = prompt(round_, 20)
        serve(mgr, oracle, kept)
        serve(mgr, oracle, prompt(60 + round_, 22))  # kept goes down, the primary tier is full
        before = mgr.stats().bytes_copied.get("primary->host:copy_engine", 0)
        demotions.clear()
        assert serve(mgr, oracle, kept + [2]) == 20 * TPB  # victims down while kept comes up
        assert mgr.stats().bytes_copied.get("primary->host:copy_engine", 0) > before
        assert demotions and (len(demotions) > 1) == several_parts
    mgr.check_invariants()
    mgr.close()


def pushed_down(mgr, oracle):
    """Four rounds, each a 20-block prompt that a longer one pushes down to the full host tier;
    yields it, for the caller to resume (its pages swap places with the primary tier's)."""
    for round_ in range(4):
        kept = prompt(round_, 20)
        serve(mgr, oracle, kept)
        serve(mgr, oracle, prompt(60 + round_, 22))
        yield kept


@pytest.mark.parametrize("min_part_mib", [2, 32])  # both directions at once in parts, or in turn
def test_swap_resume_is_exact(tmp_path, monkeypatch, min_part_mib):
    """The host tier is full: victims land in the slots the resumed pages leave, byte for byte."""
    monkeypatch.setattr(duplex, "DUPLEX_MIN_PART_BYTES", min_part_mib << 20)
    monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 0)  # the head start (the scratch: the test below)
    schedules = []
    real = mover.schedule
    monkeypatch.setattr(mover, "schedule", lambda *a, **k: schedules.append(real(*a, **k)) or schedules[-1])
    mgr, oracle = big_manager(tmp_path, primary=24, host=24, write_through=False)
    for kept in pushed_down(mgr, oracle):
        schedules.clear()
        assert serve(mgr, oracle, kept + [2]) == 20 * TPB
        swaps = [s for s in schedules if s.swaps]
        assert swaps and len(swaps[0].parts) > 1
        if min_part_mib == 2:  # each part's demotion runs beside an earlier part's promotion
            assert all(p.after_up <= k - 2 for k, p in enumerate(swaps[0].parts))
    mgr.check_invariants()
    mgr.close()


def test_swap_resume_through_the_scratch_is_exact(tmp_path, monkeypatch):
    """The same swaps with a scratch that holds their victims: parked on the device, then landed in
    the slots the resumed pages leave, byte for byte, and no host page dropped for a head start."""
    monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 128 << 20)
    through = []
    real = mover.Mover._swap_through_scratch
    monkeypatch.setattr(mover.Mover, "_swap_through_scratch", lambda self, *a: through.append(a[1]) or real(self, *a))
    mgr, oracle = big_manager(tmp_path, primary=24, host=24, write_through=False)
    for kept in pushed_down(mgr, oracle):
        through.clear()
        drops = mgr.stats().drops
        assert serve(mgr, oracle, kept + [2]) == 20 * TPB
        assert through and through[0].parked > 0 and mgr.stats().drops == drops
    mgr.check_invariants()
    mgr.close()


def test_disk_reads_and_writes_go_part_by_part_through_two_parts_of_staging(tmp_path, monkeypatch):
    """Pages demoted to disk and read back go through the pinned staging one part at a time, each
    half of it reused once its last copy is done: the bytes come back exact and the staging holds
    two parts, not the whole call."""
    monkeypatch.setattr(mover, "DISK_CHUNK_BYTES", 3 << 20)  # a part is one page: many parts
    probe = kvtier.KVCacheManager(BIG, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 24)], device="cuda"))
    page = probe.page_bytes(0)
    probe.close()
    tiers = [kvtier.PrimaryTier(24 * page), kvtier.DiskTier(96 * page, os.path.join(tmp_path, "d"))]
    mgr = kvtier.KVCacheManager(BIG, kvtier.CacheConfig(TPB, tiers, device="cuda"))
    oracle = PageOracle(mgr)
    kept = prompt(0, 20)
    serve(mgr, oracle, kept)
    serve(mgr, oracle, prompt(1, 22))
    cache = mgr.create_cache(kept + [3])
    assert cache.num_reused_tokens == 20 * TPB and cache.reused_by_tier["disk"] >= 16 * TPB
    assert cache.resume()
    oracle.check(cache, kept + [3])
    assert mgr._pool.mover._staging.num_bytes <= 2 * page
    cache.close()
    mgr.close()


def test_prefetch_to_pinned_host_memory(tmp_path):
    mgr, oracle = big_manager(tmp_path, primary=24, host=24, disk=128, write_through=True)
    kept = prompt(0, 20)
    serve(mgr, oracle, kept)
    for k in range(4):
        serve(mgr, oracle, prompt(10 + k, 22))
    job = mgr.prefetch_to_host(kept + [1])
    assert job is not None and job.wait(30)
    cache = mgr.create_cache(kept + [4])
    assert cache.reused_by_tier["host"] == 20 * TPB
    assert cache.resume()
    oracle.check(cache, kept + [4])
    cache.close()
    mgr.check_invariants()
    mgr.close()


@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_background_operations_on_gpu(kind):
    m = machine(kind, {"primary": 8, "host": 6, "disk": 20}, reserve=0.2, device="cuda")
    m.TestCase.settings = settings(
        max_examples=8, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    m.TestCase().runTest()


@pytest.mark.parametrize("kind", ["llama", "swa"])
def test_selective_write_through_on_gpu(kind):
    """Write-through of pages reused at least once (``HostTier.write_through_min_hits``) on the
    background stream: the others are demoted by copying, beside the copies."""
    m = machine(kind, {"primary": 10, "host": 12}, reserve=0.2, device="cuda", min_hits=1)
    m.TestCase.settings = settings(
        max_examples=8, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    m.TestCase().runTest()
