"""Host and disk tiers: the demotion cascade, promotion, persistence, and real failures."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvtier
from kvtier.storage import disk_dir
from kvtier.tiering import duplex, mover
from kvtier.tiering.tier import Tier
from tests.kvdata import PageOracle, small_spec
from tests.test_write_through import copied

TPB = 4
ROOT = Path(__file__).resolve().parents[1]


def page_demand(spec: kvtier.ModelSpec, interval: int = 4) -> float:
    probe = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=[kvtier.PrimaryTier(1 << 22)]))
    demand = sum(
        probe.page_bytes(g.group_id) / (interval if g.kind is kvtier.GroupKind.RECURRENT else 1)
        for g in probe.layer_groups
    )
    probe.close()
    return demand


def manager(path, kind="llama", primary=8, host=8, disk=32, **config) -> kvtier.KVCacheManager:
    spec = small_spec(kind)
    d = page_demand(spec)
    tiers = [kvtier.PrimaryTier(int(d * primary) + 1)]
    if host:
        tiers.append(kvtier.HostTier(int(d * host) + 1))
    if disk:
        tiers.append(kvtier.DiskTier(int(d * disk) + 1, path))
    return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers, **config))


def prefill(mgr, oracle, tokens, keep=False, chunk=None):
    """Create, resume and compute a prompt; ``chunk`` splits the prefill (recurrent snapshots need it)."""
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    oracle.check(cache, tokens)
    start = cache.num_committed_tokens
    assert cache.resize(len(tokens))
    while start < len(tokens):
        end = min(len(tokens), start + (chunk or len(tokens)))
        oracle.write(cache, tokens, start, end)
        cache.commit(tokens[start:end])
        start = end
    if keep:
        cache.suspend()
        return cache
    cache.close()
    return None


def convo(i: int, n: int = 24) -> list[int]:
    return [10_000 * (i + 1) + j for j in range(n)]


def test_a_chain_on_disk_loses_its_deepest_blocks_first(tmp_path):
    """Before: a demoted chain's blocks left the disk in the order 2, 0, 1: room for another prompt
    dropped blocks 2 and 0, and block 1 kept its slot with no way to reach it."""
    mgr = manager(tmp_path, primary=4, host=0, disk=4)
    oracle = PageOracle(mgr)
    first, second, third = (convo(i, 3 * TPB) + [7] for i in range(3))
    for tokens in (first, second, third):  # each pushes the one before it to the disk
        prefill(mgr, oracle, tokens)
    cache = mgr.create_cache(first + [1])
    assert cache.reused_by_tier["disk"] == TPB  # its first block, the one the disk had room for
    assert cache.resume()
    oracle.check(cache, first + [1])
    cache.close()
    mgr.check_invariants()
    mgr.close()


def compute(mgr, oracle, tokens, priority, recompute=False) -> None:
    """Create a cache at ``priority``, resume it (its reuse given up if ``recompute``), compute and
    commit the rest of ``tokens``, close it."""
    cache = mgr.create_cache(tokens, priority=priority)
    if recompute:
        cache.shorten_reuse(0)
    assert cache.resume()
    start = cache.num_committed_tokens
    assert cache.resize(len(tokens))
    oracle.write(cache, tokens, start, len(tokens))
    cache.commit(tokens[start:])
    cache.close()


def copy_as_killed(mgr: kvtier.KVCacheManager, tmp_path) -> None:
    """Copy ``tmp_path / "live"``, ``mgr``'s disk directory, to ``tmp_path / "killed"``: the files
    as a kill leaves them once the disk index's commits started so far have landed (they run on
    a thread of their own; one still running at a kill is lost, and so are the blocks it names)."""
    for tier in mgr._pool.tiers:
        if tier.disk_index is not None:
            assert tier.disk_index.flush()
    shutil.copytree(tmp_path / "live", tmp_path / "killed")


def restart_as_killed(mgr, tmp_path, caplog, tokens, from_disk, **sizes) -> None:
    """Start a manager on a copy of ``mgr``'s directory ``tmp_path / "live"`` (``copy_as_killed``): no
    page is dropped as unreachable, and ``tokens`` reuse ``from_disk`` tokens from the disk, exactly."""
    copy_as_killed(mgr, tmp_path)
    after = manager(tmp_path / "killed", **sizes)
    assert not [r for r in caplog.records if "lay below blocks with no page left" in r.getMessage()]
    cache = after.create_cache(tokens)
    assert cache.reused_by_tier["disk"] == from_disk
    assert cache.resume()
    PageOracle(after).check(cache, tokens)
    cache.close()
    after.check_invariants()
    after.close()


def test_a_copy_a_promotion_left_above_a_chain_on_disk_outlives_the_chain(tmp_path, caplog):
    """Before: a resume of a chain's first block left a spare copy of it on disk, above the chain's
    other blocks, and a spare copy was the first page to go when the disk needed room. A process
    killed then left blocks no restart could reach (dropped with a WARNING), and the prefix was
    lost. Now the disk drops a chain from its deepest block up: what a kill leaves restores whole."""
    mgr = manager(tmp_path / "live", primary=4, host=0, disk=4)
    oracle = PageOracle(mgr)
    first, second, third = (convo(i, 3 * TPB) + [7] for i in range(3))
    prefill(mgr, oracle, first)
    prefill(mgr, oracle, second)  # pushes the first prompt's 3 blocks to the disk
    head = mgr.create_cache(first[:TPB] + [1])
    assert head.resume()  # its first block up: the disk keeps a copy, above the other two
    prefill(mgr, oracle, third[: 2 * TPB] + [5])  # the second prompt goes down; the disk drops 2 pages
    restart_as_killed(mgr, tmp_path, caplog, first + [1], TPB, primary=4, host=0, disk=4)  # the chain's top block
    head.close()
    mgr.check_invariants()
    mgr.close()


def test_a_copy_kept_above_a_chain_on_disk_does_not_renew_the_chain(tmp_path, caplog):
    """Before: when the spare copy a resume left above a chain on disk was the disk's first victim,
    the copy and the whole chain below it became the disk's most recently used pages, so a newer
    prompt's blocks went before that older chain. Now the copy is kept and the chain keeps its
    place: the disk still drops least recently used first, and what a kill leaves restores whole."""
    mgr = manager(tmp_path / "live", primary=4, host=0, disk=6)
    oracle = PageOracle(mgr)
    older, newer, third, fourth = (convo(i, 3 * TPB) + [7] for i in range(4))
    prefill(mgr, oracle, older)
    prefill(mgr, oracle, newer)  # pushes the older prompt's 3 blocks to the disk
    head = mgr.create_cache(older[:TPB] + [1])
    assert head.resume()  # its first block up: the disk keeps a copy, above the other two
    prefill(mgr, oracle, third[: 2 * TPB] + [5])  # the newer prompt's 3 blocks go down: the disk is full
    prefill(mgr, oracle, fourth[: 2 * TPB] + [5])  # 2 more: the older chain's 2 blocks make the room
    cache = mgr.create_cache(newer)
    assert cache.reused_by_tier.get("disk") == 3 * TPB
    cache.close()
    cache = mgr.create_cache(older)
    assert cache.num_reused_tokens == TPB  # the block in memory; the 2 below it were the oldest
    cache.close()
    restart_as_killed(mgr, tmp_path, caplog, newer, 3 * TPB, primary=4, host=0, disk=6)
    head.close()
    mgr.check_invariants()
    mgr.close()


def test_a_block_on_disk_stays_while_a_block_below_it_is_in_memory(tmp_path):
    """Before: a prompt recomputed over its prefix on disk (its reuse given up) published 2 new
    blocks below it in memory; when the disk made room, it dropped that prefix's last blocks, which
    nothing on disk needed, and the 2 blocks in memory could never be matched again (the prompt's
    next turn reused 1 block). Now a block on disk stays while a block below it is in memory."""
    mgr = manager(tmp_path, primary=6, host=0, disk=4)
    oracle = PageOracle(mgr)
    prefix, turn = convo(0, 3 * TPB), convo(1, 2 * TPB)
    compute(mgr, oracle, prefix + [7], 10)
    compute(mgr, oracle, prefix + turn + [7], 90, recompute=True)  # 2 blocks below the prefix, in memory
    compute(mgr, oracle, convo(3, 3 * TPB) + [7], 50)  # the prefix (priority 10) goes to the disk
    compute(mgr, oracle, convo(4, 3 * TPB) + [7], 50)  # the disk makes room: its lowest priority is the prefix
    back = prefix + turn + [1]
    cache = mgr.create_cache(back)
    assert cache.reused_by_tier == {"primary": 2 * TPB, "host": 0, "disk": 3 * TPB}
    assert cache.resume()
    oracle.check(cache, back)
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_blocks_computed_again_and_built_on_stay_with_the_blocks_below():
    """Before: a cache made before a prompt's blocks were published computed them again and built 2
    blocks below them; the tree kept its older pages of those blocks, which nothing had used since,
    and the last tier dropped them first, so the 2 blocks could never be matched (1 block was
    reused). Now a cache that builds on blocks it computed again uses their pages as a match would."""
    mgr = manager(None, primary=8, host=8, disk=0)
    oracle = PageOracle(mgr)
    prefix, turn = convo(0, 3 * TPB), convo(1, 2 * TPB)
    late = mgr.create_cache(prefix + turn + [7])  # made before the prefix is published: matches nothing
    compute(mgr, oracle, prefix + [7], 35)
    for i in range(2):
        compute(mgr, oracle, convo(10 + i, 3 * TPB) + [7], 35)  # the prefix goes down to the host tier
    assert late.resume() and late.resize(len(prefix + turn) + 1)
    oracle.write(late, prefix + turn + [7], 0, len(prefix + turn) + 1)
    late.commit(prefix + turn + [7])
    late.close()
    for i in range(2):
        compute(mgr, oracle, convo(20 + i, 3 * TPB) + [7], 35)  # the host tier drops its oldest pages
    back = prefix + turn + [1]
    cache = mgr.create_cache(back)
    assert cache.num_reused_tokens == 5 * TPB
    assert cache.resume()
    oracle.check(cache, back)
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_room_for_a_chain_on_disk_never_drops_the_blocks_above_it(tmp_path, caplog):
    """Before: a prompt's 2 blocks (priority 20) came back from the disk, grew 2 more (priority 60),
    and all 4 went down again: the first 2 onto their copies, then the room the other 2 needed
    was made by dropping those 2, the disk's lowest priority. The disk kept blocks no match or
    restart could reach. Now blocks on the disk above ones arriving outlive them, at their priority."""
    mgr = manager(tmp_path / "live", primary=6, host=0, disk=6)
    oracle = PageOracle(mgr)

    base = convo(0, 2 * TPB)
    longer = base + convo(2, 2 * TPB)
    compute(mgr, oracle, base + [7], 20)
    compute(mgr, oracle, convo(1, 5 * TPB) + [7], 35)  # pushes the 2 blocks to the disk
    compute(mgr, oracle, longer + [7], 60)  # they come back up, 2 more blocks below them
    compute(mgr, oracle, convo(3, 5 * TPB) + [7], 35)  # pushes all 4 to the disk
    cache = mgr.create_cache(longer + [1])
    assert cache.reused_by_tier["disk"] == 4 * TPB
    cache.close()
    copy_as_killed(mgr, tmp_path)
    after = manager(tmp_path / "killed", primary=6, host=0, disk=6)
    assert not [r for r in caplog.records if "lay below blocks with no page left" in r.getMessage()]
    cache = after.create_cache(longer + [1])
    assert cache.reused_by_tier["disk"] == 4 * TPB
    assert cache.resume()
    PageOracle(after).check(cache, longer + [1])
    cache.close()
    after.check_invariants()
    after.close()
    mgr.check_invariants()
    mgr.close()


def test_a_long_chain_restored_top_first_is_dropped_in_one_walk(tmp_path, monkeypatch):
    """A restart indexes the disk's pages in slot order: a chain's top first, each block holding up
    the next. Before: making room walked the whole chain below the search's deepest block, once per
    block (600 blocks: 40,705 walks of a page's dependents). Now the search keeps the chain from its
    highest block in one walk, and the drops then go from the deepest block up."""
    blocks = 600
    walks = 0
    dependents = Tier._dependents

    def counted(self, page):
        nonlocal walks
        walks += 1
        return dependents(self, page)

    def compute(mgr, tokens):
        cache = mgr.create_cache(tokens)
        assert cache.resume() and cache.resize(len(tokens))
        cache.commit(tokens[cache.num_committed_tokens :])
        cache.close()

    mgr = manager(tmp_path, primary=blocks + 50, host=0, disk=blocks + 10)
    compute(mgr, convo(0, blocks * TPB) + [7])
    mgr.close()  # persisted: the chain is on the disk, in slot order
    mgr = manager(tmp_path, primary=blocks + 50, host=0, disk=blocks + 10)
    monkeypatch.setattr(Tier, "_dependents", counted)
    for i in range(1, 40):  # each pushes 30 blocks down: the disk drops most of the chain
        compute(mgr, convo(i, blocks // 20 * TPB) + [7])
    assert mgr.stats().drops > blocks // 2
    assert walks < 10 * blocks
    cache = mgr.create_cache(convo(0, blocks * TPB) + [1])
    assert 0 < cache.reused_by_tier["disk"] < blocks * TPB  # the chain's top is left, reachable
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_block_dropped_from_the_disk_takes_its_sliding_window_page_along(tmp_path, caplog):
    """Before: the disk dropped a block's full-attention page and kept its sliding-window page, which
    no match could reach any more: it held a disk slot until it was the least recently used, and a
    restart dropped it with a WARNING. Now it goes with the block's full-attention page."""
    mgr = manager(tmp_path / "live", kind="swa", primary=6, host=0, disk=8)
    oracle = PageOracle(mgr)
    for i in range(6):  # each pushes the one before it to the disk, which drops the oldest
        prefill(mgr, oracle, convo(i, 3 * TPB) + [7])
    assert mgr.stats().drops > 0
    mgr.check_invariants()
    copy_as_killed(mgr, tmp_path)
    after = manager(tmp_path / "killed", kind="swa", primary=6, host=0, disk=8)
    assert not [r for r in caplog.records if "lay below blocks with no page left" in r.getMessage()]
    assert after.stats().tiers["disk"].pages_used == mgr.stats().tiers["disk"].pages_used
    after.close()
    mgr.close()


def test_cascade_demotes_to_host_then_disk_and_promotes_back(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=32)
    oracle = PageOracle(mgr)
    for i in range(5):  # 5 conversations x 6 blocks = 30 pages through an 8-page primary tier
        prefill(mgr, oracle, convo(i))
    stats = mgr.stats()
    assert stats.demotions >= 22 and stats.drops == 0
    assert stats.tiers["disk"].pages_used >= 14
    assert stats.bytes_copied["primary->host:cpu"] > 0 and stats.bytes_copied["host->disk:file"] > 0
    back = convo(0) + [1, 2]  # the oldest conversation returns: its pages are on disk
    cache = mgr.create_cache(back)
    assert cache.num_reused_tokens == 24
    assert cache.reused_by_tier["disk"] == 24
    assert cache.resume()
    oracle.check(cache, back)
    assert mgr.stats().bytes_copied["disk->primary:file"] == 6 * mgr.page_bytes(0)
    cache.close()  # its reuse counted as hits (it committed nothing)
    assert mgr.stats().hit_tokens["disk"] == 24
    mgr.check_invariants()
    mgr.close()


def test_every_conversation_comes_back_whole_when_the_tiers_hold_them_all(tmp_path):
    """30 pages in 48 slots: disk copies of pages that are also in memory must give way before any
    page whose only bytes are on disk is dropped (a copy is evicted first)."""
    mgr = manager(tmp_path, primary=8, host=8, disk=32)
    oracle = PageOracle(mgr)
    for i in range(5):
        prefill(mgr, oracle, convo(i))
    for _ in range(2):
        for i in range(5):
            tokens = convo(i) + [1, 2]
            cache = mgr.create_cache(tokens)
            assert cache.num_reused_tokens == 24, i
            assert cache.resume()
            oracle.check(cache, tokens)
            cache.close()
    assert mgr.stats().drops == 0
    mgr.check_invariants()
    mgr.close()


def test_resume_moves_pages_in_one_copier_call_per_tier_and_group(tmp_path):
    mgr = manager(tmp_path, kind="hybrid", primary=16, host=40, disk=0)
    oracle = PageOracle(mgr)
    kept = [prefill(mgr, oracle, convo(i), keep=True) for i in range(3)]
    calls = []
    real_copy = mgr._pool.mover.copier.copy

    def counting_copy(src, dst, pairs, page_bytes, stream=None):
        calls.append(len(pairs))
        return real_copy(src, dst, pairs, page_bytes, stream)

    mgr._pool.mover.copier.copy = counting_copy
    assert kept[0].resume()  # its pages were demoted to host by the two later requests
    oracle.check(kept[0], convo(0))
    # demotions of others' pages (one call per group) and promotions (one call per group)
    assert len(calls) <= 4 and sum(calls) >= 6
    mgr.check_invariants()
    mgr.close()


def test_suspended_pages_are_never_dropped_and_room_fails_cleanly(tmp_path):
    mgr = manager(tmp_path, primary=6, host=6, disk=6)
    oracle = PageOracle(mgr)
    kept = [prefill(mgr, oracle, convo(i), keep=True) for i in range(3)]  # 18 pages fill all tiers
    other = mgr.create_cache(convo(9))
    assert other.resume()
    assert not other.resize(4)
    assert mgr.stats().drops == 0
    other.close()
    assert not kept[0].resume()  # every tier is full of held pages: no room to swap, nothing moved
    assert kept[2].resume()  # its pages are still in the primary tier
    oracle.check(kept[2], convo(2))
    kept[2].close()
    for i in (0, 1):  # with room again, the others come back byte for byte
        assert kept[i].resume()
        oracle.check(kept[i], convo(i))
        kept[i].suspend()
    mgr.check_invariants()
    mgr.close()


def test_two_suspended_caches_that_fill_both_tiers_take_turns(tmp_path, swap_way):
    """No disk: one suspended cache fills the primary tier, another the host tier. Resuming either
    swaps them through the swap scratch, with no free slot anywhere; without the scratch a swap
    needs one free host slot for its head start, and the resume fails cleanly (nothing moved)."""
    mgr = manager(tmp_path, primary=6, host=6, disk=0)
    oracle = PageOracle(mgr)
    kept = [prefill(mgr, oracle, convo(i), keep=True) for i in range(2)]
    assert all(t.pages_used == t.pages_total for t in mgr.stats().tiers.values())
    if swap_way == "head start":
        assert not kept[0].resume()
        assert kept[1].resume()  # its pages are still in the primary tier
        oracle.check(kept[1], convo(1))
    else:
        for turn in range(4):
            cache = kept[turn % 2]
            assert cache.resume()
            oracle.check(cache, convo(turn % 2))
            cache.suspend()
    assert mgr.stats().drops == 0
    mgr.check_invariants()
    mgr.close()


def test_prefetch_promotes_a_prefix_toward_primary(tmp_path):
    mgr = manager(tmp_path, primary=8, host=8, disk=32)
    oracle = PageOracle(mgr)
    for i in range(4):
        prefill(mgr, oracle, convo(i))
    assert mgr.prefetch(convo(0) + [5]) == 6
    cache = mgr.create_cache(convo(0) + [5])
    assert cache.reused_by_tier["primary"] == 24
    assert cache.resume()
    oracle.check(cache, convo(0) + [5])
    mgr.check_invariants()
    mgr.close()


def persist_conversations(path, count: int = 3) -> None:
    """A manager with an 8-page primary tier and a disk tier computes ``count`` conversations and closes."""
    mgr = manager(path, primary=8, host=0, disk=32)
    oracle = PageOracle(mgr)
    for i in range(count):
        prefill(mgr, oracle, convo(i))
    mgr.close()


def serve_intact(mgr: kvtier.KVCacheManager, count: int) -> None:
    """Every conversation comes back byte for byte, from whatever survived on disk; then close."""
    oracle = PageOracle(mgr)
    for i in range(count):
        tokens = convo(i) + [1]
        cache = mgr.create_cache(tokens)
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    mgr.check_invariants()
    mgr.close()


def test_restart_finds_pages_on_disk(tmp_path):
    persist_conversations(tmp_path)
    again = manager(tmp_path, primary=8, host=0, disk=32)
    oracle = PageOracle(again)
    assert again.stats().tiers["disk"].pages_used == 18  # demoted ones, and the rest persisted at close
    assert [again.create_cache(convo(i) + [1]).num_reused_tokens for i in range(3)] == [24, 24, 24]
    cache = again.create_cache(convo(0) + [1])
    assert cache.reused_by_tier["disk"] == 24
    assert cache.resume()
    oracle.check(cache, convo(0) + [1])
    again.check_invariants()
    again.close()


def test_other_model_starts_clean_and_leaves_files_alone(tmp_path):
    persist_conversations(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "-wal" not in p.name}
    other = manager(tmp_path, kind="swa", primary=8, host=0, disk=32)
    assert other.stats().tiers["disk"].pages_used == 0
    assert other.create_cache(convo(0) + [1]).num_reused_tokens == 0
    other.close()
    for p, data in before.items():
        if p.suffix == ".pages":
            assert p.read_bytes() == data


def flip_bytes(path: Path, offsets: list[int]) -> None:
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def test_flipped_page_bytes_are_a_miss_never_a_wrong_page(tmp_path):
    persist_conversations(tmp_path)
    again = manager(tmp_path, primary=8, host=0, disk=32)
    page_bytes = again.page_bytes(0)
    again.close(persist=False)
    pages_file = next(tmp_path.rglob("group0.pages"))
    flip_bytes(pages_file, list(range(7, pages_file.stat().st_size, page_bytes)))  # one byte in every slot
    again = manager(tmp_path, primary=8, host=0, disk=32)
    oracle = PageOracle(again)
    tokens = convo(0) + [1]
    cache = again.create_cache(tokens)
    assert cache.reused_by_tier["disk"] > 0
    assert cache.resume()  # every page it took from disk fails its checksum: it starts over
    assert cache.num_committed_tokens == 0
    assert again.stats().checksum_failures >= 1
    oracle.check(cache, tokens)
    assert again.create_cache(tokens).num_reused_tokens == 0  # damaged pages are never offered again
    again.check_invariants()
    again.close()


def test_damaged_index_is_a_miss_never_a_crash(tmp_path):
    persist_conversations(tmp_path)
    index = next(tmp_path.rglob("index.sqlite"))
    flip_bytes(index, list(range(100, index.stat().st_size, 97)))
    serve_intact(manager(tmp_path, primary=8, host=0, disk=32), 3)


def test_index_rows_with_wrong_values_are_rejected(tmp_path):
    persist_conversations(tmp_path)
    index = next(tmp_path.rglob("index.sqlite"))
    db = sqlite3.connect(index)
    at_depth = "block_key IN (SELECT block_key FROM nodes WHERE depth = {})"
    db.execute("UPDATE nodes SET tokens = zeroblob(length(tokens)) WHERE depth = 1")  # breaks the key chain
    db.execute(f"UPDATE pages SET slot = slot + 1000 WHERE {at_depth.format(2)}")  # out of range
    db.execute(f"UPDATE pages SET checksum = checksum + 1 WHERE {at_depth.format(0)}")  # data no longer matches
    db.commit()
    db.close()
    again = manager(tmp_path, primary=8, host=0, disk=32)
    oracle = PageOracle(again)
    tokens = convo(0) + [1]
    cache = again.create_cache(tokens)
    assert cache.num_reused_tokens <= 4
    assert cache.resume()
    oracle.check(cache, tokens)
    again.check_invariants()
    again.close()


def run_python(code: str, timeout: int = 120, **env_vars: str) -> subprocess.CompletedProcess:
    """``code`` in a Python process of its own, the source tree importable, ``env_vars`` set."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


SUBPROCESS_PRELUDE = """
import resource, signal, sys
sys.path.insert(0, {root!r})
from tests.test_tiers import manager, prefill, convo
from tests.kvdata import PageOracle
import kvtier
"""


def test_failing_disk_writes_keep_pages_where_they_were(tmp_path):
    """A file-size limit makes every disk write past it fail with EFBIG, a real OS-level failure."""
    code = (
        SUBPROCESS_PRELUDE.format(root=str(ROOT))
        + f"""
mgr = manager({str(tmp_path)!r}, primary=6, host=8, disk=40)
oracle = PageOracle(mgr)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))  # every write to a page file now fails
kept = prefill(mgr, oracle, convo(0), keep=True)  # 6 held pages
for i in range(1, 5):
    prefill(mgr, oracle, convo(i))  # pushes the held pages to host; tree-only pages get dropped
st = mgr.stats()
assert st.tiers["disk"].pages_used == 0, st
assert st.drops > 0, st
assert kept.resume()  # its pages stayed on host when they could not go to disk
oracle.check(kept, convo(0))
mgr.check_invariants()
print("ok", st.drops)
"""
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" in out.stderr  # the failures are logged
    assert out.stdout.startswith("ok")


def test_unusable_disk_directory_degrades_to_misses(tmp_path):
    """A disk tier under /proc cannot create its files even as root: a real failure, logged, not raised."""
    serves_without_its_disk(manager("/proc/kvtier-no-such-dir", primary=6, host=0, disk=20))


def test_a_disk_path_whose_parent_cannot_be_listed_degrades_to_misses(tmp_path, caplog):
    """A name past the file system's limit (as a parent this user may not enter) fails the listing of
    the other directories beside it too. Before, that raised a bare ``OSError`` from the manager's
    construction, just after the ERROR that said the tier would be served without it."""
    serves_without_its_disk(manager(str(tmp_path / ("x" * 300) / "kv"), primary=6, host=0, disk=20))
    assert "cannot create" in caplog.text


def serves_without_its_disk(mgr: kvtier.KVCacheManager) -> None:
    """Conversations go through a manager whose disk tier stores nothing: exact pages, no disk page."""
    oracle = PageOracle(mgr)
    for i in range(3):
        prefill(mgr, oracle, convo(i))
    assert mgr.stats().tiers["disk"].pages_used == 0
    tokens = convo(2) + [1]
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    oracle.check(cache, tokens)
    cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_file_system_without_locks_degrades_to_misses(tmp_path, monkeypatch, caplog):
    """Lustre mounted without ``-o flock`` answers ``flock`` with ENOSYS (NFS without lockd: ENOLCK).
    No local file system here refuses locks, so ``flock`` is made to answer as those do. Before, the
    manager's construction failed with that OSError."""

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(disk_dir.fcntl, "flock", no_locks)
    mgr = manager(str(tmp_path), primary=6, host=0, disk=20)
    assert "does not support file locks" in caplog.text
    serves_without_its_disk(mgr)
    assert not list(tmp_path.glob("kvtier-*/index.sqlite"))  # nothing written but the lock file


def test_killed_mid_write_restarts_with_only_intact_pages(tmp_path):
    code = (
        SUBPROCESS_PRELUDE.format(root=str(ROOT))
        + f"""
mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=200)
oracle = PageOracle(mgr)
print("ready", flush=True)
i = 0
while True:
    prefill(mgr, oracle, convo(i % 30))
    i += 1
"""
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    import time

    time.sleep(1.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = manager(tmp_path, primary=6, host=0, disk=200)
    assert again.stats().tiers["disk"].pages_used > 0
    serve_intact(again, 30)


@pytest.mark.parametrize("kind", ["swa", "hybrid"])
def test_layer_groups_round_trip_through_disk(tmp_path, kind):
    mgr = manager(tmp_path, kind=kind, primary=10, host=4, disk=60, snapshot_interval_blocks=2)
    oracle = PageOracle(mgr)
    for i in range(6):
        prefill(mgr, oracle, convo(i, 26), chunk=8)  # a snapshot every 2 blocks
    for i in range(6):
        tokens = convo(i, 26) + [3]
        cache = mgr.create_cache(tokens)
        assert cache.num_reused_tokens > 0
        assert cache.resume()
        oracle.check(cache, tokens)
        cache.close()
    mgr.check_invariants()
    mgr.close()


def test_a_partly_reused_page_found_damaged_by_a_prefetch_is_not_copied(tmp_path):
    """The damage is found while promoting the page for a prefetch; the cache that will copy part
    of it must start over rather than copy the bad bytes."""
    persist_conversations(tmp_path, count=1)
    pages_file = next(tmp_path.rglob("group0.pages"))
    again = manager(tmp_path, primary=8, host=0, disk=32)
    flip_bytes(pages_file, list(range(3, pages_file.stat().st_size, again.page_bytes(0))))
    oracle = PageOracle(again)
    tokens = convo(0)[:3] + [7]
    cache = again.create_cache(tokens)
    assert cache.num_reused_tokens == 3  # a partial hit on block 0, still on disk
    again.prefetch(convo(0)[:2] + [9])  # promotes that page: its checksum fails
    assert again.stats().checksum_failures >= 1
    assert cache.resume()
    assert cache.num_committed_tokens == 0
    oracle.check(cache, tokens)
    again.check_invariants()
    again.close()


@pytest.fixture(params=["scratch", "head start"])
def swap_way(request, monkeypatch) -> str:
    """How swaps start in managers built by the test: through the mover's swap scratch (the
    default), or with the head start of ``duplex.swap_lag`` (no scratch)."""
    if request.param == "head start":
        monkeypatch.setattr(mover, "SWAP_SCRATCH_BYTES", 0)
    return request.param


def resume_watching_swaps(cache) -> tuple[list, int]:
    """Resume ``cache``; the duplex schedules the mover made meanwhile, and how many swaps it took
    through its scratch."""
    through = []
    real = mover.Mover._swap_through_scratch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mover.Mover, "_swap_through_scratch", lambda self, *a: through.append(1) or real(self, *a))
        schedules = resume_watching_schedules(cache)
    return schedules, len(through)


def full_tiers(kind: str, write_through: bool):
    """A manager whose primary and host tiers (24 pages each) are full after six 12-page talks; the
    third talk is in host memory, the last two in the primary tier."""
    spec = small_spec(kind)
    d = page_demand(spec)
    tiers = [kvtier.PrimaryTier(int(d * 24) + 1), kvtier.HostTier(int(d * 24) + 1, write_through=write_through)]
    mgr = kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers))
    oracle = PageOracle(mgr)
    talks = [convo(i, 48) for i in range(6)]  # 72 pages a group, 48 slots
    for tokens in talks:
        prefill(mgr, oracle, tokens, chunk=8)  # recurrent snapshots every two blocks
    return mgr, oracle, talks


def resume_watching_schedules(cache) -> list:
    """Resume ``cache``; the duplex schedules the mover made meanwhile."""
    schedules = []
    real = mover.schedule
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mover, "schedule", lambda *a, **k: schedules.append(real(*a, **k)) or schedules[-1])
        assert cache.resume()
    return schedules


def come_back_whole(mgr, oracle, talks, reused: dict[int, int]) -> None:
    """Each talk ``i`` of ``reused`` reuses at least ``reused[i]`` tokens and resumes byte for byte."""
    for i, least in reused.items():
        tokens = talks[i] + [7]
        again = mgr.create_cache(tokens)
        assert again.num_reused_tokens >= least, i
        assert again.resume()
        oracle.check(again, tokens)
        again.close()
    mgr.check_invariants()


@pytest.mark.parametrize("write_through", [False, True])
def test_a_resume_on_full_tiers_swaps_places_and_the_host_keeps_its_other_pages(write_through, swap_way):
    """The promoted pages' host slots take the victims: the host keeps every other page through
    the swap scratch; only the head start costs host pages without it."""
    mgr, oracle, talks = full_tiers("llama", write_through)
    full = mgr.stats()
    assert all(t.pages_used == t.pages_total for t in full.tiers.values())
    cache = mgr.create_cache(talks[2] + [7])
    assert cache.reused_by_tier.get("host") == 48
    host = mgr._pool.tiers[1]
    owners_before = list(host.owners[0])
    freed_before = [host.storage.slots[0].times_freed(s) for s in range(len(owners_before))]
    swaps, through_scratch = resume_watching_swaps(cache)
    oracle.check(cache, talks[2] + [7])
    after = mgr.stats()
    assert after.demotions - full.demotions == 12
    head_start = 0 if swap_way == "scratch" else duplex.swap_lag(12, mgr.page_bytes(0))
    if swap_way == "scratch":
        assert through_scratch == 1 and not swaps
    else:
        assert any(s.swaps for s in swaps) and not through_scratch and head_start == 3
    assert after.drops - full.drops == head_start  # not 12
    now = host.owners[0]
    handed = [s for s, p in enumerate(owners_before) if p and p.tier == 0 and now[s] and now[s] not in host.originals]
    assert len(handed) == 12 - head_start  # the victims after the head start took promoted pages' slots...
    for slot in handed:  # ...which count as freed: the disk write-behind sees their bytes changed
        assert host.storage.slots[0].times_freed(slot) == freed_before[slot] + 1
    cache.close()
    come_back_whole(mgr, oracle, talks, {3: 48 - head_start * TPB, 4: 48, 5: 48})  # talk 3 lost the head start
    mgr.close()


@pytest.mark.parametrize("kind", ["swa", "hybrid"])
def test_a_resume_on_full_tiers_swaps_places_for_every_kind_of_group(kind, swap_way):
    mgr, oracle, talks = full_tiers(kind, write_through=False)
    before = mgr.stats()
    assert all(t.pages_used >= t.pages_total - 1 for t in before.tiers.values())
    cache = mgr.create_cache(talks[2] + [7])
    assert cache.reused_by_tier.get("host") == 48
    swaps, through_scratch = resume_watching_swaps(cache)
    oracle.check(cache, talks[2] + [7])
    after = mgr.stats()
    assert after.drops - before.drops < after.demotions - before.demotions
    assert (through_scratch > 0) if swap_way == "scratch" else any(s.swaps for s in swaps)
    cache.close()
    come_back_whole(mgr, oracle, talks, {3: TPB, 4: 48, 5: 48})
    mgr.close()


@pytest.mark.parametrize("write_through", [False, True])
def test_a_prefetch_on_full_tiers_swaps_places_too(write_through, swap_way):
    """A prefetch promotes a whole prefix as a resume does: only the head start, if any, costs host
    pages (page by page, each victim would drop a host page), and nothing else is lost."""
    mgr, oracle, talks = full_tiers("llama", write_through)
    full = mgr.stats()
    swaps = []
    real = mover.schedule
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mover, "schedule", lambda *a, **k: swaps.append(real(*a, **k)) or swaps[-1])
        assert mgr.prefetch(talks[2] + [7]) == 12
    after = mgr.stats()
    assert after.promotions - full.promotions == 12
    head_start = 0 if swap_way == "scratch" else duplex.swap_lag(12, mgr.page_bytes(0))
    assert (not swaps) if swap_way == "scratch" else any(s.swaps for s in swaps)
    assert after.drops - full.drops == head_start
    cache = mgr.create_cache(talks[2] + [7])
    assert cache.reused_by_tier.get("primary") == 48 and not cache.reused_by_tier.get("host")
    cache.close()
    come_back_whole(mgr, oracle, talks, {2: 48, 3: 48 - head_start * TPB, 4: 48, 5: 48})
    mgr.close()


def test_a_prefetch_without_room_for_the_whole_prefix_moves_what_fits():
    """With only six primary pages evictable, a 12-page prefetch moves its first six, in prefix
    order; the rest stays in host memory and everything comes back byte for byte."""
    mgr, oracle, talks = full_tiers("llama", write_through=False)
    active = [mgr.create_cache(talks[5] + [7]), mgr.create_cache(talks[4][:24] + [7])]
    assert all(cache.resume() for cache in active)  # 18 of the 24 primary pages locked
    assert mgr.prefetch(talks[2] + [7]) == 6
    cache = mgr.create_cache(talks[2] + [7])
    assert cache.reused_by_tier.get("primary") == 24 and cache.reused_by_tier.get("host") == 24
    cache.close()
    for cache in active:
        cache.close()
    come_back_whole(mgr, oracle, talks, {2: 48, 4: 48, 5: 48})
    mgr.close()


def test_swaps_beside_disk_write_behind_restart_byte_for_byte(tmp_path, swap_way):
    """Resumes that swap places while write-behind copies host pages to disk; a restart on the same
    directory serves only bytes that belong to their tokens."""
    spec = small_spec("llama")
    d = page_demand(spec)

    def open_manager(write_behind: bool) -> kvtier.KVCacheManager:
        tiers = [
            kvtier.PrimaryTier(int(d * 24) + 1),
            kvtier.HostTier(int(d * 24) + 1, write_through=False),
            kvtier.DiskTier(int(d * 40) + 1, tmp_path, write_behind=write_behind),
        ]
        return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block=TPB, tiers=tiers))

    mgr = open_manager(write_behind=True)
    oracle = PageOracle(mgr)
    talks = [convo(i, 48) for i in range(8)]
    for tokens in talks:
        prefill(mgr, oracle, tokens)
        mgr.maintain()
    swaps, through_scratch = [], 0
    for r in range(12):
        tokens = talks[(r * 3) % 8] + [7]
        cache = mgr.create_cache(tokens)
        schedules, through = resume_watching_swaps(cache)
        swaps += schedules
        through_scratch += through
        oracle.check(cache, tokens)
        cache.close()
        mgr.maintain()  # lands a write-behind batch, starts the next
    assert (through_scratch > 0) if swap_way == "scratch" else any(s.swaps for s in swaps)
    assert copied(mgr, "host->disk") > 0
    mgr.close()
    again = open_manager(write_behind=False)
    found = []
    for tokens in talks:
        cache = again.create_cache(tokens + [7])
        found.append(cache.num_reused_tokens)
        cache.close()
    assert sum(found) >= 3 * 48  # what fits in the disk tier, at least
    come_back_whole(again, PageOracle(again), talks, dict(enumerate(found)))
    again.close()
