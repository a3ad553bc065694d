"""A disk tier whose page files were deleted or cut short between two runs, its index kept.

Before, the manager opening the directory saw nothing: no ERROR, ``disk_resets`` 0, the lost
pages counted as used; the page file was silently made again (holes), every lookup failed one
checksum a page (a WARNING a cache, no reuse), and the speed sample at open timed short reads of
the holes as the disk's bandwidth. Now the directory's page files are checked against its index
when it opens (docs/reliability.md): a file that holds none of its pages is reported and the
directory starts empty (API.md 2); a file cut short loses only the pages past its end.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import pytest

import kvtier
from kvtier.tiering.disk_speed import sample_disk_speed
from tests.kvdata import PageOracle
from tests.test_tiers import convo, manager, prefill

COUNT = 4  # conversations of 6 blocks each
SIZES = {"primary": 8, "host": 0, "disk": 64}


def persist(path: Path, kind: str) -> Path:
    """Compute ``COUNT`` conversations with fresh page bytes and close; the tier's directory."""
    mgr = manager(path, kind=kind, **SIZES)
    oracle = PageOracle(mgr)
    for i in range(COUNT):
        prefill(mgr, oracle, convo(i))
    mgr.close()
    return next(path.glob("kvtier-*"))


def page_rows(directory: Path) -> list[tuple[int, int]]:
    """(group, slot) of every page row of the directory's index."""
    with sqlite3.connect(directory / "index.sqlite") as db:
        return db.execute("SELECT grp, slot FROM pages").fetchall()


def kept_bandwidth(directory: Path) -> list:
    with sqlite3.connect(directory / "index.sqlite") as db:
        return db.execute("SELECT value FROM measured WHERE name LIKE 'disk_to_%'").fetchall()


def serve_all(mgr: kvtier.KVCacheManager) -> list[int]:
    """Every conversation looked up and resumed; reused rows byte-exact. Tokens reused from disk, each."""
    oracle = PageOracle(mgr)
    from_disk = []
    for i in range(COUNT):
        tokens = convo(i) + [1]
        cache = mgr.create_cache(tokens)
        from_disk.append(cache.reused_by_tier["disk"])
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    return from_disk


def logged(caplog, level: int = logging.WARNING) -> list[str]:
    """The lines at ``level`` or above, less the manager's own about ``model_id`` (not the disk's)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= level and r.name != "kvtier.manager"]


@pytest.mark.parametrize(
    ("kind", "group", "how"),
    [("llama", 0, "deleted"), ("llama", 0, "emptied"), ("swa", 0, "deleted"), ("swa", 1, "deleted")],
)
def test_a_page_file_lost_between_runs_is_reported_and_the_directory_starts_empty(tmp_path, caplog, kind, group, how):
    """A window group's file lost resets the directory too: its full-attention pages alone serve no match."""
    directory = persist(tmp_path, kind)
    rows = page_rows(directory)
    assert any(g == group for g, _ in rows) and not kept_bandwidth(directory)
    pages = directory / f"group{group}.pages"
    if how == "deleted":
        pages.unlink()
    else:
        os.truncate(pages, 0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        mgr = manager(tmp_path, kind=kind, **SIZES)
        stats = mgr.stats()
        assert stats.disk_resets == 1
        assert stats.tiers["disk"].pages_used == 0
        assert mgr._pool.load_cost.bandwidth[mgr._pool.tiers[-1].index] is None  # no page to sample, no hole timed
        assert serve_all(mgr) == [0] * COUNT
    [line] = logged(caplog, logging.ERROR)
    assert pages.name in line and ("deleted" if how == "deleted" else "cut to 0 bytes") in line, line
    assert f"its {len(rows)} pages lost" in line and "starts empty" in line, line
    assert logged(caplog) == [line]  # no checksum failure, nothing else
    assert mgr.stats().checksum_failures == 0
    oracle = PageOracle(mgr)
    for i in range(COUNT):  # computed again: the directory works
        prefill(mgr, oracle, convo(i))
    mgr.check_invariants()
    mgr.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = manager(tmp_path, kind=kind, **SIZES)
        assert again.stats().disk_resets == 0
        assert again.stats().tiers["disk"].pages_used == len(rows)
        from_disk = serve_all(again)
    assert not logged(caplog), caplog.text
    assert all(n > 0 for n in from_disk), from_disk
    if kind == "llama":
        assert from_disk == [24] * COUNT
    assert again.stats().checksum_failures == 0
    again.check_invariants()
    again.close()


@pytest.mark.parametrize("kind", ["llama", "swa"])
def test_a_page_file_cut_short_loses_only_the_pages_past_its_end(tmp_path, caplog, kind):
    """The pages whose slots lie past the cut (and the blocks below them) are dropped at open: never
    read, never a checksum failure; the others are served byte for byte."""
    directory = persist(tmp_path, kind)
    mgr = manager(tmp_path, kind=kind, **SIZES)
    page_bytes = mgr.page_bytes(0)
    before = serve_all(mgr)  # every conversation from disk, untouched
    mgr.close(persist=False)
    rows = page_rows(directory)
    slots = sorted(s for g, s in rows if g == 0)
    cut = slots[len(slots) // 2]  # half of group 0's pages are past the end; one page cut through
    os.truncate(directory / "group0.pages", cut * page_bytes + page_bytes // 2)
    past = sum(1 for g, s in rows if g == 0 and s >= cut)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        mgr = manager(tmp_path, kind=kind, **SIZES)
        disk = mgr._pool.tiers[-1]
        assert all(page is None for page in disk.owners[0][cut:])
        assert mgr.stats().disk_resets == 0
        left = mgr.stats().tiers["disk"].pages_used
        assert 0 < left <= len(rows) - past
        after = serve_all(mgr)
    [line] = logged(caplog, logging.ERROR)
    assert "group0.pages cut to" in line and f"{past} pages whose bytes are gone were dropped" in line, line
    assert f"{left} pages restored" in line, line
    assert mgr.stats().checksum_failures == 0
    assert not [m for m in logged(caplog) if "checksum" in m], caplog.text
    assert sum(after) < sum(before) and any(after), (before, after)  # some kept, the lost ones not reused
    mgr.check_invariants()
    mgr.close()


def test_the_speed_sample_never_times_reads_past_a_page_file_s_end(tmp_path):
    """A sample with a page that did not read whole and intact is not timed, and a page file shorter
    than the pages the tier holds is not read past its end (a short read measures no disk)."""
    persist(tmp_path, "llama")
    mgr = manager(tmp_path, **SIZES)
    disk = mgr._pool.tiers[-1]
    cost = mgr._pool.load_cost
    assert cost.bandwidth[disk.index] is not None  # sampled at open: the file was whole
    cost.bandwidth[disk.index] = None
    real = disk.storage.read
    disk.storage.read = lambda *args: [False, *real(*args)[1:]]  # one page fails
    try:
        sample_disk_speed(disk, cost)
        assert cost.bandwidth[disk.index] is None
    finally:
        del disk.storage.read
    sample_disk_speed(disk, cost)
    assert cost.bandwidth[disk.index] is not None
    cost.bandwidth[disk.index] = None
    read = []
    disk.storage.read = lambda group, slots, *args: read.extend(slots) or real(group, slots, *args)
    os.ftruncate(disk.storage._fds[0], 0)  # cut while open: every page it holds is past the end
    sample_disk_speed(disk, cost)
    assert cost.bandwidth[disk.index] is None and read == []
    mgr.close(persist=False)
