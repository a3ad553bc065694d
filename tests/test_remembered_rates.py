"""Rates a manager measured outlive it in its disk tier's index (``DiskIndex.measured``): the next
manager on the directory weighs its first disk load as the last one weighed its last."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
import torch

import kvtier
from kvtier.storage.disk_dir import DiskDirectory
from kvtier.storage.disk_index import INDEX_FILE, DiskIndex
from tests.kvdata import PageOracle, small_spec
from tests.test_write_through import serve

TPB = 16
BANDWIDTH = "disk_to_cpu_bytes_per_s"
PREFILL = "prefill_cpu_tokens_per_s"


def disk_manager(path, primary_pages: int = 6, disk_pages: int = 64) -> kvtier.KVCacheManager:
    spec = small_spec("llama")
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, [kvtier.PrimaryTier(1 << 20)]))
    page = probe.page_bytes(0)
    probe.close()
    tiers = [kvtier.PrimaryTier(primary_pages * page), kvtier.DiskTier(disk_pages * page, path)]
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(TPB, tiers))


def push_down(mgr, oracle, base: int) -> None:
    """Serve prompts that take every primary slot: what was there goes to disk."""
    for i in range(3):
        serve(mgr, oracle, [base + 100 * i + j for j in range(2 * TPB + 1)])


def measured(path) -> dict:
    """The ``measured`` table of the one tier directory under ``path``."""
    [directory] = [d for d in path.iterdir() if d.name.startswith("kvtier-")]
    with sqlite3.connect(directory / INDEX_FILE) as db:
        return dict(db.execute("SELECT name, value FROM measured").fetchall())


def test_a_restarted_manager_weighs_its_first_disk_load_with_the_remembered_bandwidth(tmp_path):
    prompt = [500 + i for i in range(4 * TPB + 1)]
    first = disk_manager(tmp_path)
    oracle = PageOracle(first)
    serve(first, oracle, prompt)
    push_down(first, oracle, 10_000)
    first.set_prefill_rate(1e6)
    assert serve(first, oracle, [*prompt, 1]) == 4 * TPB  # loaded from disk: its bandwidth is measured now
    bandwidth = first._pool.load_cost.bandwidth[1]
    assert bandwidth is not None
    first._pool.load_cost.observe(1, 1, 1.0)  # then a read of one byte a second
    push_down(first, oracle, 20_000)
    first.close()
    assert measured(tmp_path) == {BANDWIDTH: 1.0, PREFILL: 1e6}

    second = disk_manager(tmp_path)
    assert second._pool.load_cost.bandwidth[1] == 1.0
    assert second.remembered_prefill_rate == 1e6
    assert second._pool.load_cost.prefill_rate is None  # offered, not used by itself
    second.set_prefill_rate(1e6)
    cache = second.create_cache([*prompt, 2])
    assert cache.num_reused_tokens == 0  # the first disk hit is weighed: recomputed
    cache.close()
    assert second.stats().recomputed_tokens == 4 * TPB
    second.close()

    third = disk_manager(tmp_path)  # without a prefill rate nothing is weighed: the pages are intact
    assert serve(third, PageOracle(third), [*prompt, 3]) == 4 * TPB
    third.close()


def test_measures_go_with_the_next_changes_and_at_close(tmp_path):
    directory = DiskDirectory(tmp_path / "d")
    index = DiskIndex(directory, "fp")
    index.remember("a", 2.5)
    assert index.flush()
    with sqlite3.connect(directory.file(INDEX_FILE)) as db:
        assert db.execute("SELECT count(*) FROM measured").fetchone() == (0,)  # a measure alone waits
    index.close()
    reopened = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    assert reopened.measured == {"a": 2.5}
    reopened.close()


@pytest.mark.parametrize(
    "value", ["text", b"\x00", 0.0, -3.0, float("inf"), -7], ids=lambda v: type(v).__name__ + repr(v)
)
def test_a_damaged_measure_is_ignored_and_the_index_kept(tmp_path, value):
    directory = DiskDirectory(tmp_path / "d")
    index = DiskIndex(directory, "fp")
    index.remember("good", 4.0)
    index.close()
    with sqlite3.connect(tmp_path / "d" / INDEX_FILE) as db:
        db.execute("INSERT INTO measured VALUES (?, ?)", ("bad", value))
    reopened = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    assert reopened.measured == {"good": 4.0} and reopened.resets == 0
    reopened.close()


def test_an_index_from_before_the_measures_gains_their_table(tmp_path):
    directory = DiskDirectory(tmp_path / "d")
    DiskIndex(directory, "fp").close()
    with sqlite3.connect(tmp_path / "d" / INDEX_FILE) as db:
        db.execute("DROP TABLE measured")
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    assert index.measured == {} and index.resets == 0
    index.remember("a", 1.5)
    index.close()
    assert DiskIndex(DiskDirectory(tmp_path / "d"), "fp").measured == {"a": 1.5}


def test_a_read_only_directory_offers_its_measures_and_writes_none(tmp_path):
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    index.remember("a", 3.0)
    index.close()
    before = (tmp_path / "d" / INDEX_FILE).read_bytes()
    os.chmod(tmp_path / "d", stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(tmp_path / "d", os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
        assert index.measured == {"a": 3.0}
        index.remember("a", 9.0)
        index.close()
        assert (tmp_path / "d" / INDEX_FILE).read_bytes() == before
    finally:
        os.chmod(tmp_path / "d", stat.S_IRWXU)


def test_rates_are_kept_per_kind_of_device(tmp_path):
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    index.remember("disk_to_cuda_bytes_per_s", 5e9)
    index.remember("prefill_cuda_tokens_per_s", 4e4)
    index.close()
    from kvtier.tiering.load_cost import LoadCost

    reopened = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    on_cpu = LoadCost(2, (1, reopened), "cpu")
    assert on_cpu.bandwidth[1] is None and on_cpu.remembered_prefill_rate is None
    on_cuda = LoadCost(2, (1, reopened), "cuda")
    assert on_cuda.bandwidth[1] == 5e9 and on_cuda.remembered_prefill_rate == 4e4
    reopened.close()


def test_an_engine_restarted_on_a_slow_disk_recomputes_its_first_disk_hit(tmp_path):
    """The engine calibrates its prefill rate when built; the disk's speed comes from the index."""
    from kvtier.engine import SamplingParams
    from kvtier.models import build_model
    from tests.test_engine import check_against_oracle, engine, prompts_for

    model = build_model("tiny-llama", torch.device("cpu"), torch.float64, seed=0)
    prompt, *others = prompts_for(model, [80, 80, 80, 80], seed=5)
    with engine(model, 16, disk_blocks=64, path=tmp_path, recompute_when_faster=True) as eng:
        eng.generate([prompt], SamplingParams(max_tokens=2))
        eng.generate(others, SamplingParams(max_tokens=2))  # the prompt's pages go down to disk
        eng.cache_manager._pool.load_cost.observe(1, 1, 1.0)  # the disk read one byte a second
    for weigh in (True, False):
        with engine(model, 16, disk_blocks=64, path=tmp_path, recompute_when_faster=weigh) as eng:
            out = eng.generate([prompt], SamplingParams(max_tokens=3))
            check_against_oracle(model, [prompt], out, 3)
            if weigh:
                assert sum(out[0].reused_tokens_by_tier.values()) == 0
                assert eng.cache_manager.stats().recomputed_tokens >= 64
            else:
                assert out[0].reused_tokens_by_tier["disk"] == len(prompt) - 1


def test_a_directory_with_pages_and_no_kept_speed_is_sampled_when_opened(tmp_path, monkeypatch):
    """A directory written by a process that never read from it: the next manager reads a few of its
    pages when it opens it, so its first disk hit is weighed too; an empty directory is not read."""
    from tests.disk_speed import slow_disk_reads

    empty = disk_manager(tmp_path)
    assert empty._pool.load_cost.bandwidth[1] is None
    prompt = [600 + i for i in range(4 * TPB + 1)]
    oracle = PageOracle(empty)
    serve(empty, oracle, prompt)
    push_down(empty, oracle, 60_000)
    empty.close()
    assert BANDWIDTH not in measured(tmp_path)  # nothing was read from this disk
    slow_disk_reads(monkeypatch, 1e6)
    mgr = disk_manager(tmp_path)
    assert mgr._pool.load_cost.bandwidth[1] < 2e6  # sampled at open: about what this disk reads
    mgr.set_prefill_rate(1e6)
    cache = mgr.create_cache([*prompt, 1])
    assert cache.num_reused_tokens == 0  # the first disk hit is weighed: recomputed
    cache.close()
    mgr.close()
    assert measured(tmp_path)[BANDWIDTH] < 2e6
