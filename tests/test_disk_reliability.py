"""The disk tier under the faults users meet: crashes, damaged or lost indexes, a full disk, a
read-only or busy directory, file modes, scope privacy, managers dropped without ``close``.

Each test reproduces one failure of issue 10 (items 7-12 and 14) and checks what the disk tier
promises instead (docs/reliability.md): a miss, a clear error, or a logged WARNING/ERROR; never
a wrong byte, a crash at startup, or a lost delete.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import random
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

import kvtier
from kvtier.metrics import registry_for
from tests.kvdata import PageOracle
from tests.test_tiers import TPB, convo, manager, prefill

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = [4242 + (i % 5) for i in range(16)]  # a shared system prompt: 4 blocks of 4 tokens
SCOPES = [
    kvtier.ReuseScope(),
    kvtier.ReuseScope(salt="tenant-secret-salt-1"),
    kvtier.ReuseScope(lora_id=7, salt=b"raw-salt-bytes-22"),
    kvtier.ReuseScope(lora_id="adapter-x"),
]


def kvtier_dir(path: Path) -> Path:
    return next(path.glob("kvtier-*"))


def serve(mgr: kvtier.KVCacheManager, tokens: list[int], scope=kvtier.DEFAULT_SCOPE) -> kvtier.KVCache:
    """Create and resume a cache; every reused row must hold its exact bytes. Returns it ACTIVE."""
    cache = mgr.create_cache(tokens, scope=scope)
    assert cache.resume()
    PageOracle(mgr).check(cache, tokens)
    return cache


def run_child(code: str, timeout: int = 120, **popen) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    prelude = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **popen,
    )


# -- item 7: chains under a hot prefix survive a crash ----------------------------------------------


def test_children_of_a_hot_prefix_restore_after_a_crash(tmp_path):
    """The system prompt stays in primary memory (an ACTIVE cache holds it); its children go to disk.

    Before: every child row on disk was an orphan (its parent never written), so a restart after a
    crash restored none. Now the prefix is written along with its first child (a copy).
    """
    code = f"""
    import os
    from tests.test_tiers import manager, prefill, convo
    from tests.test_disk_reliability import SYSTEM
    from tests.kvdata import PageOracle
    mgr = manager({str(tmp_path)!r}, primary=14, host=0, disk=120)
    oracle = PageOracle(mgr)
    hot = mgr.create_cache(SYSTEM + [1])
    assert hot.resume() and hot.resize(17)
    oracle.write(hot, SYSTEM + [1], 0, 17)
    hot.commit(SYSTEM + [1])  # ACTIVE: its pages are locked, never demoted
    for i in range(24):
        prefill(mgr, oracle, SYSTEM + convo(i, 8))
    assert mgr.stats().tiers["disk"].pages_used >= 30, mgr.stats()
    os.kill(os.getpid(), 9)  # a crash: no close, no persist
    """
    out = run_child(code)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    again = manager(tmp_path, primary=14, host=0, disk=120)
    restored = 0
    for i in range(24):
        tokens = SYSTEM + convo(i, 8) + [5]
        cache = serve(again, tokens)
        if cache.reused_by_tier["disk"] >= 8:
            assert cache.num_reused_tokens == 24  # the prefix and the child, both from disk
            restored += 1
        cache.close()
    assert restored >= 16
    assert again.stats().checksum_failures == 0
    again.check_invariants()
    again.close()


def test_no_committed_row_names_a_slot_while_other_bytes_are_written_to_it(tmp_path):
    """What a process killed at any instant leaves: every disk write goes to slots that no committed
    index row names, also the copies of ancestors written into slots just freed by drops (several
    hot prefixes take turns on a disk too small for all of them)."""
    mgr = manager(tmp_path, primary=10, host=0, disk=12)
    planner = mgr._pool.planner.disk_writes
    committed = planner.disk.disk_index._db
    write = planner.writer.write_pages
    written, named_while_written = 0, []

    def checked(pages, slots):
        nonlocal written
        named = {row[0] for row in committed.execute("SELECT slot FROM pages WHERE grp = ?", (pages[0].group,))}
        named_while_written.extend(s for s in slots if s in named)
        written += len(slots)
        return write(pages, slots)

    planner.writer.write_pages = checked
    oracle = PageOracle(mgr)
    prefixes = [[900 + 37 * k + j for j in range(8)] for k in range(6)]  # 6 hot prefixes of 2 blocks
    hot = []
    for i in range(60):
        prefix = prefixes[i % 6]
        if i % 6 == 0:
            for cache in hot:
                cache.close()
            hot = []
        keep = mgr.create_cache(prefix + [1])  # the prefix stays locked in primary memory: copied to disk
        assert keep.resume()
        hot.append(keep)
        prefill(mgr, oracle, prefix + convo(i, 8))
    for cache in hot:
        cache.close()
    assert written > 100
    assert named_while_written == []
    mgr.check_invariants()
    mgr.close()


def test_a_promoted_parent_keeps_its_children_restorable(tmp_path):
    """After a restart the prefix is read back into memory; a crash then must not orphan the children."""
    mgr = manager(tmp_path, primary=8, host=0, disk=80)
    oracle = PageOracle(mgr)
    for i in range(10):
        prefill(mgr, oracle, SYSTEM + convo(i, 8))
    mgr.close()
    again = manager(tmp_path, primary=8, host=0, disk=80)
    serve(again, SYSTEM + convo(0, 8) + [5]).close()  # promotes the prefix out of its disk slots
    again.close(persist=False)  # as a crash after that operation: nothing more is written
    third = manager(tmp_path, primary=8, host=0, disk=80)
    for i in range(1, 10):
        cache = serve(third, SYSTEM + convo(i, 8) + [5])
        assert cache.num_reused_tokens == 24
        cache.close()
    third.check_invariants()
    third.close()


# -- item 8: a full disk ----------------------------------------------------------------------------


def test_write_failures_are_rate_limited(tmp_path):
    """Every disk write fails (RLIMIT_FSIZE): a handful of WARNING lines, not one per failed page."""
    code = f"""
    import logging, resource, signal
    from tests.test_tiers import manager, prefill, convo
    from tests.kvdata import PageOracle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    mgr = manager({str(tmp_path)!r}, primary=6, host=4, disk=40)
    oracle = PageOracle(mgr)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
    for i in range(300):
        prefill(mgr, oracle, convo(i % 40))
    mgr.check_invariants()
    print("demotions", mgr.stats().demotions)
    """
    out = run_child(code)
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING kvtier.storage")]
    assert 1 <= len(warnings) <= 3, warnings[:10]
    assert "summarised every" in warnings[0]


def test_failed_index_commits_keep_their_deletes(tmp_path):
    """The index cannot grow (RLIMIT_FSIZE below its WAL) while page slots can still be written.

    Before: a failed commit dropped its pending deletes, slots were rewritten under rows that still
    named them, and after a restart those rows failed their checksums. Now a commit that fails keeps
    its changes and no slot is rewritten until they are in: every restored row reads back intact.
    """
    code = f"""
    import logging, resource, signal
    from pathlib import Path
    from tests.test_tiers import manager, prefill, convo
    from tests.kvdata import PageOracle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=40)
    oracle = PageOracle(mgr)
    for i in range(12):
        prefill(mgr, oracle, convo(i))
    wal = next(Path({str(tmp_path)!r}).glob("kvtier-*/index.sqlite-wal"))
    limit = max(wal.stat().st_size, 1)
    assert limit > 8 * mgr.page_bytes(0), limit  # low page slots stay writable
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    for i in range(12, 60):
        prefill(mgr, oracle, convo(i % 30))
    mgr.check_invariants()
    mgr.close()
    print("ok")
    """
    out = run_child(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "index update failed" in out.stderr
    again = manager(tmp_path, primary=6, host=0, disk=40)
    assert again.stats().tiers["disk"].pages_used > 0
    for i in range(30):
        serve(again, convo(i) + [1]).close()
    assert again.stats().checksum_failures == 0
    again.close()


def test_a_directory_opened_while_its_file_system_is_full_is_served_read_only_and_kept(tmp_path):
    """No file can grow (RLIMIT_FSIZE, as on a full disk) when a manager opens a directory: its
    index cannot be written, so the manager serves it read-only, and a manager opened later has
    every page. Before, the index was taken for damaged, moved aside and every page lost."""
    mgr = manager(tmp_path, primary=6, host=0, disk=40)
    oracle = PageOracle(mgr)
    for i in range(12):
        prefill(mgr, oracle, convo(i))
    mgr.close()
    before = manager(tmp_path, primary=6, host=0, disk=40)
    on_disk = before.stats().tiers["disk"].pages_used
    before.close()
    code = f"""
    import logging, resource, signal
    from tests.test_tiers import manager, convo
    from tests.kvdata import PageOracle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))
    mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=40)
    oracle = PageOracle(mgr)
    for i in range(12):  # served from the directory, read-only
        cache = mgr.create_cache(convo(i) + [1])
        assert cache.resume()
        oracle.check(cache, convo(i) + [1])
        cache.close()
    stats = mgr.stats()
    mgr.close()
    print(stats.tiers["disk"].pages_used, stats.disk_resets, stats.hit_tokens["disk"])
    """
    out = run_child(code)
    assert out.returncode == 0, out.stderr[-3000:]
    pages, resets, hits = map(int, out.stdout.split()[-3:])
    assert (resets, pages) == (0, on_disk) and hits > 0
    assert "cannot be written now" in out.stderr
    after = manager(tmp_path, primary=6, host=0, disk=40)
    assert after.stats().tiers["disk"].pages_used == on_disk and after.stats().disk_resets == 0
    assert not list(tmp_path.rglob("*.damaged"))
    after.close()


@pytest.mark.parametrize("limit", [4096, 40_000])
def test_a_new_directory_on_a_full_file_system_loses_nothing_it_never_had(tmp_path, limit):
    """A first manager whose files cannot grow past ``limit`` bytes, then one with room. Before, the
    first reported "every page it named lost" with ``disk_resets`` 1 for a directory that never
    held a page, and at 40,000 bytes left tables without their meta rows, which the next manager
    moved aside as damaged, reporting a loss again."""
    code = f"""
    import logging, resource, signal
    from tests.test_tiers import manager
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=40)
    print(mgr.stats().disk_resets)
    mgr.close()
    """
    out = run_child(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0"
    assert "cannot be used" not in out.stderr and "lost" not in out.stderr.replace("nothing in it is lost", "")
    after = manager(tmp_path, primary=6, host=0, disk=40)
    assert after.stats().disk_resets == 0
    assert not list(tmp_path.rglob("*.damaged"))
    after.close()


# -- items 9 and 10: damaged, lost or unusable directories -----------------------------------------


def persist_scoped(path: Path, kind: str = "hybrid") -> None:
    """Conversations under every scope, on a model with recurrent snapshots, closed onto disk."""
    mgr = manager(path, kind=kind, primary=10, host=0, disk=200, snapshot_interval_blocks=2)
    oracle = PageOracle(mgr)
    for s, scope in enumerate(SCOPES):
        for i in range(3):
            tokens = convo(10 * s + i, 18)
            cache = mgr.create_cache(tokens, scope=scope)
            assert cache.resume() and cache.resize(len(tokens))
            for start in range(0, len(tokens), 8):
                end = min(len(tokens), start + 8)
                oracle.write(cache, tokens, start, end)
                cache.commit(tokens[start:end])
            cache.close()
    mgr.close()


def serve_scoped(mgr: kvtier.KVCacheManager, close: bool = True) -> int:
    """Every conversation under its scope, byte-exact; returns the reused tokens. Checks and closes
    ``mgr`` if ``close``."""
    reused = 0
    for s, scope in enumerate(SCOPES):
        for i in range(3):
            cache = serve(mgr, convo(10 * s + i, 18) + [3], scope)
            reused += cache.num_reused_tokens
            cache.close()
    if close:
        mgr.check_invariants()
        mgr.close()
    return reused


def test_random_damage_to_the_index_never_stops_startup(tmp_path, caplog):
    """Bytes flipped at random in the index (and its WAL): the manager always starts and serves only
    exact bytes; an index it cannot read is reported (ERROR, ``disk_resets``) and started empty.

    Before: some flips raised ``UnicodeDecodeError`` or ``TypeError`` from ``KVCacheManager(...)``.
    """
    pristine = tmp_path / "pristine"
    persist_scoped(pristine)
    rng = random.Random(10)
    resets = 0
    for trial in range(30):
        path = tmp_path / f"t{trial}"
        shutil.copytree(pristine, path)
        for name in ("index.sqlite", "index.sqlite-wal"):
            target = kvtier_dir(path) / name
            if target.exists() and target.stat().st_size:
                data = bytearray(target.read_bytes())
                for _ in range(rng.choice([1, 3, 20, 100])):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                target.write_bytes(bytes(data))
        caplog.clear()
        mgr = manager(path, kind="hybrid", primary=10, host=0, disk=200, snapshot_interval_blocks=2)
        reset = mgr.stats().disk_resets
        assert reset in (0, 1)
        if reset:
            resets += 1
            assert any(r.levelno == logging.ERROR and "lost" in r.getMessage() for r in caplog.records)
        serve_scoped(mgr)
        shutil.rmtree(path)
    assert resets > 0  # some flips do make the whole index unreadable


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE meta SET value = CAST(x'c328ff' AS TEXT) WHERE name = 'fingerprint'",  # not UTF-8
        "PRAGMA writable_schema = ON; UPDATE sqlite_master SET name = CAST(x'e5e5' AS TEXT) WHERE name = 'meta'",
        "UPDATE pages SET grp = 'one' WHERE rowid % 2 = 0",  # text where a number belongs
        "UPDATE pages SET slot = 2.5 WHERE rowid % 3 = 0",
    ],
)
def test_damaged_values_in_the_index_never_stop_startup(tmp_path, sql):
    """Before: ``UnicodeDecodeError`` / ``TypeError`` from ``KVCacheManager(...)``: the server could not start."""
    persist_scoped(tmp_path)
    db = sqlite3.connect(kvtier_dir(tmp_path) / "index.sqlite")
    db.executescript(sql)
    db.close()
    mgr = manager(tmp_path, kind="hybrid", primary=10, host=0, disk=200, snapshot_interval_blocks=2)
    assert mgr.stats().disk_resets == ("meta" in sql or "schema" in sql)
    serve_scoped(mgr)


@pytest.mark.parametrize("damage", ["empty", "deleted", "foreign"])
def test_a_lost_index_is_reported_with_what_was_lost(tmp_path, caplog, damage):
    """Before: an index truncated to 0 bytes or deleted restored nothing and said nothing."""
    persist_scoped(tmp_path, kind="llama")
    directory = kvtier_dir(tmp_path)
    index = directory / "index.sqlite"
    for side in ("index.sqlite-wal", "index.sqlite-shm"):
        (directory / side).unlink(missing_ok=True)
    if damage == "empty":
        index.write_bytes(b"")
    elif damage == "deleted":
        index.unlink()
    else:
        db = sqlite3.connect(index)
        db.execute("UPDATE meta SET value = '1' WHERE name = 'schema'")
        db.commit()
        db.close()
    with caplog.at_level(logging.ERROR):
        mgr = manager(tmp_path, kind="llama", primary=10, host=0, disk=200)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "lost" in errors[0] and "starts empty" in errors[0], errors
    if damage == "foreign":
        assert "its 48 pages lost" in errors[0] and (directory / "index.sqlite.damaged").exists()
    assert mgr.stats().disk_resets == 1
    text = generate_latest(registry_for(mgr)).decode()
    assert "kvtier_disk_resets_total 1.0" in text
    assert serve_scoped(mgr) == 0
    again = manager(tmp_path, kind="llama", primary=10, host=0, disk=200)  # the new index is sound
    assert again.stats().disk_resets == 0
    again.close()


def test_a_disk_path_that_is_a_file_is_refused(tmp_path):
    """Before: accepted; the manager reported 64 disk pages and dropped everything sent there."""
    path = tmp_path / "kv"
    path.write_bytes(b"not a directory")
    with pytest.raises(ValueError, match="is a file"):
        manager(path)
    with pytest.raises(ValueError, match="is a file"):
        manager(path / "below")
    assert path.read_bytes() == b"not a directory" and sorted(tmp_path.iterdir()) == [path]


def _without_dac_override() -> None:
    """In the child: even root then obeys file modes (CAP_DAC_OVERRIDE, _READ_SEARCH, FOWNER dropped)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_read_only_directory_is_served_read_only(tmp_path):
    """Before: opened read-write and the whole tier given up. Now its pages are served, nothing is
    written, and one WARNING says so. Served again in the same process: a page pushed out of memory
    lands on the bytes it left on disk (before, it was dropped: each page served once a process)."""
    persist_scoped(tmp_path, kind="llama")
    directory = kvtier_dir(tmp_path)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}
    for p in directory.iterdir():
        p.chmod(0o400)
    directory.chmod(0o500)
    code = f"""
    import logging
    from tests.test_tiers import manager
    from tests.test_disk_reliability import serve_scoped
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    mgr = manager({str(tmp_path)!r}, kind="llama", primary=10, host=4, disk=200)
    assert mgr.stats().disk_resets == 0
    print("reused", serve_scoped(mgr, close=False), serve_scoped(mgr))
    """
    try:
        out = run_child(code, preexec_fn=_without_dac_override if os.geteuid() == 0 else None)
    finally:
        directory.chmod(0o700)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == [str(4 * 3 * 16)] * 2  # every conversation's full blocks, twice
    read_only = [line for line in out.stderr.splitlines() if "read-only" in line]
    assert len(read_only) == 1 and read_only[0].startswith("WARNING"), out.stderr[-2000:]
    assert "ERROR" not in out.stderr
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}
    assert after == before


# -- item 11: one manager per directory -----------------------------------------------------------


def test_a_second_manager_on_the_directory_is_refused(tmp_path):
    """Before: two managers silently overwrote each other's slots and rows."""
    first = manager(tmp_path, primary=6, host=0, disk=40)
    oracle = PageOracle(first)
    for i in range(4):
        prefill(first, oracle, convo(i))
    directory = kvtier_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if not p.name.endswith(("-wal", "-shm"))}
    with pytest.raises(kvtier.DiskTierBusyError, match=f"pid {os.getpid()} "):
        manager(tmp_path, primary=6, host=0, disk=40)
    after = {p.name: p.read_bytes() for p in directory.iterdir() if not p.name.endswith(("-wal", "-shm"))}
    assert after == before
    serve(first, convo(0) + [1]).close()  # the first manager goes on as before
    first.close()
    second = manager(tmp_path, primary=6, host=0, disk=40)  # free once the first is closed
    serve(second, convo(1) + [1]).close()
    second.close()


@contextlib.contextmanager
def manager_in_another_process(tmp_path):
    """A child process holding a manager over ``tmp_path`` (ready when this yields it); killed after."""
    code = f"""
    import time
    from tests.test_tiers import manager
    mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=40)
    print("ready", flush=True)
    time.sleep(60)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_manager_in_another_process_holds_the_directory(tmp_path):
    with (
        manager_in_another_process(tmp_path) as child,
        pytest.raises(kvtier.DiskTierBusyError, match=f"pid {child.pid} "),
    ):
        manager(tmp_path, primary=6, host=0, disk=40)
    manager(tmp_path, primary=6, host=0, disk=40).close()  # the lock died with its holder


def test_a_lock_file_removed_under_its_holder_lets_no_second_manager_in(tmp_path):
    """A cleaner of old files in /tmp may remove the lock file while its manager runs. Before, a
    second process then made a new one, locked it and wrote into the same index and page files
    (checksum failures after). The directory itself is locked too."""
    with manager_in_another_process(tmp_path):
        (lock,) = tmp_path.glob("*/lock")
        lock.unlink()
        with pytest.raises(kvtier.DiskTierBusyError, match="lock file was removed"):
            manager(tmp_path, primary=6, host=0, disk=40)
    manager(tmp_path, primary=6, host=0, disk=40).close()  # the locks died with their holder


@pytest.mark.parametrize("then", ["nothing", "another manager"])
def test_a_directory_removed_under_its_manager_is_served_read_only_and_left_alone(tmp_path, caplog, then):
    """``rm -rf`` of a live manager's directory (a cleaner of old files in /tmp, an operator clearing
    the cache). Before, nothing noticed: demotions and the close-time persist went on writing into
    the removed files, space ``df`` counted and nobody could read again, and a manager made on the
    path meanwhile was left its own directory only by luck of descriptors. Now the first write
    after the removal says so once and the tier writes nothing more; what it wrote before is still
    served, byte for byte, from the files it holds open."""
    mgr = manager(tmp_path, primary=4, host=0, disk=40)
    oracle = PageOracle(mgr)
    early = [convo(i, 3 * TPB) + [7] for i in range(3)]
    for tokens in early:  # each pushes the one before it to the disk
        prefill(mgr, oracle, tokens)
    on_disk = mgr.stats().tiers["disk"].pages_used
    assert on_disk > 0
    shutil.rmtree(kvtier_dir(tmp_path))
    other = manager(tmp_path, primary=4, host=0, disk=40) if then == "another manager" else None
    if other is not None:  # it made a new directory at the path: its pages are its own
        prefill(other, PageOracle(other), convo(50, 3 * TPB) + [7])
        prefill(other, PageOracle(other), convo(51, 3 * TPB) + [7])
        other.close()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for i in range(3, 6):  # more demotions: none is written any more
            prefill(mgr, oracle, convo(i, 3 * TPB) + [7])
        cache = serve(mgr, early[0] + [1])  # still served from the open files, exact bytes
        assert cache.reused_by_tier["disk"] > 0
        cache.close()
        assert mgr.stats().tiers["disk"].pages_used <= on_disk
        mgr.check_invariants()
        mgr.close()  # persists nothing
    removed = [r for r in caplog.records if "was removed or replaced while this manager used it" in r.getMessage()]
    assert len(removed) == 1 and removed[0].levelno == logging.WARNING
    again = manager(tmp_path, primary=4, host=0, disk=40)
    if other is None:
        assert again.create_cache(early[0] + [1]).num_reused_tokens == 0  # the removal stands
    else:  # the other manager's directory holds its pages, untouched
        cache = serve(again, convo(50, 3 * TPB) + [7, 1])
        assert cache.reused_by_tier["disk"] > 0
        cache.close()
    again.close()


def test_a_relative_directory_is_still_its_managers_after_the_process_changes_directory(tmp_path, monkeypatch):
    """The check for a removed directory looks at where it was opened: a ``chdir`` after a relative
    ``DiskTier`` path is no removal (in review, it made the tier read-only and lost the persist)."""
    monkeypatch.chdir(tmp_path)
    mgr = manager("kvdisk", primary=4, host=0, disk=40)
    oracle = PageOracle(mgr)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    prompts = [convo(i, 3 * TPB) + [7] for i in range(4)]
    for tokens in prompts:
        prefill(mgr, oracle, tokens)
    assert mgr._pool.tiers[-1].writable
    mgr.close()
    monkeypatch.chdir(tmp_path)
    again = manager("kvdisk", primary=4, host=0, disk=40)
    cache = serve(again, prompts[-1] + [1])
    assert cache.reused_by_tier["disk"] == 3 * TPB
    cache.close()
    again.close()


def test_a_new_directory_on_a_full_file_system_stores_nothing_and_leaves_nothing_half_made(
    tmp_path, caplog, monkeypatch
):
    """The secret of a new directory cannot be written (ENOSPC): one ERROR that says the directory
    cannot be used (before: "cannot read"), and no ``secret.new`` left behind; a later manager with
    room uses the directory as new."""
    from kvtier.storage import disk_dir

    real_write = os.write

    def full(fd, data):
        if len(data) == disk_dir.SECRET_BYTES:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(disk_dir.os, "write", full)
    with caplog.at_level(logging.ERROR):
        mgr = manager(tmp_path, primary=6, host=0, disk=40)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot use" in errors[0] and "No space left" in errors[0], errors
    assert not list(tmp_path.glob("*/secret*"))
    oracle = PageOracle(mgr)
    prefill(mgr, oracle, convo(0))  # served from memory all the same
    mgr.close()
    monkeypatch.setattr(disk_dir.os, "write", real_write)
    with manager(tmp_path, primary=6, host=0, disk=40) as again:
        assert again.stats().tiers["disk"].pages_total > 0
        assert list(tmp_path.glob("*/secret"))


def test_a_snapshot_demoted_to_disk_brings_its_blocks_full_attention_pages(tmp_path):
    """A recurrent snapshot leaves for the disk while its block's full-attention page stays in
    memory, held by the running request: the disk gets a copy of that page (and of the blocks
    above), so a process killed then restarts with the snapshot reachable. Before, it lay on disk
    below no full-attention page; the next start after a kill dropped it (0 of 2 restored in an
    audit's case)."""
    mgr = manager(tmp_path, kind="hybrid", primary=12, host=0, disk=80)
    oracle = PageOracle(mgr)
    tokens = convo(0, 20 * TPB)
    cache = mgr.create_cache(tokens)
    assert cache.resume()
    for end in range(2 * TPB, len(tokens) + 1, 2 * TPB):  # grows until the primary tier is full of it
        if not cache.resize(end):
            break
        start = cache.num_committed_tokens
        oracle.write(cache, tokens, start, end)
        cache.commit(tokens[start:end])
    disk = mgr._pool.tiers[-1]
    on_disk = [page for owners in disk.owners for page in owners if page is not None]
    assert any(page.group not in disk.chain_groups for page in on_disk)  # a snapshot went down
    whole: dict[int, bool] = {}
    assert all(disk.chain_whole(page.node, whole, on_disk=True) for page in on_disk)
    cache.close()
    mgr.close()


def sleeping_fork() -> int:
    """A forked child that sleeps until killed, as a DataLoader worker or a pool process lives on."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(30)
        finally:
            os._exit(0)
    return pid


def descriptor_of(path: Path) -> int:
    """This process's open descriptor of ``path``."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(path):
                return int(fd)
    raise LookupError(path)


@pytest.mark.parametrize("copy", ["forked", "passed"])
def test_a_closed_manager_frees_the_directory_while_its_child_lives(tmp_path, copy):
    """A child of the manager's process outlives ``close`` with a copy of the lock's descriptor: forked
    (a DataLoader worker, a multiprocessing pool), or passed on (as by a fork outside Python).

    Before: the child shared the lock, so a new manager on the directory was refused until it exited.
    """
    first = manager(tmp_path, primary=6, host=0, disk=40)
    oracle = PageOracle(first)
    for i in range(4):
        prefill(first, oracle, convo(i))
    if copy == "forked":
        child = sleeping_fork()
    else:
        lock = descriptor_of(kvtier_dir(tmp_path) / "lock")
        child = subprocess.Popen(["sleep", "30"], pass_fds=[lock]).pid
    try:
        with pytest.raises(kvtier.DiskTierBusyError, match=f"pid {os.getpid()} "):
            manager(tmp_path, primary=6, host=0, disk=40)  # the child did not release the lock
        first.close()
        second = manager(tmp_path, primary=6, host=0, disk=40)
        cache = serve(second, convo(0) + [1])
        assert cache.reused_by_tier["disk"] > 0
        cache.close()
        second.close()
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # it lived throughout
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_killed_manager_frees_the_directory_while_its_forked_child_lives(tmp_path):
    """Before: after the holder was killed (-9), its forked child kept the lock until it exited."""
    code = f"""
    import time
    from tests.test_disk_reliability import sleeping_fork
    from tests.test_tiers import manager
    mgr = manager({str(tmp_path)!r}, primary=6, host=0, disk=40)
    pid = sleeping_fork()
    print(pid, flush=True)
    time.sleep(30)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    grandchild = None
    try:
        grandchild = int(owner.stdout.readline())
        with pytest.raises(kvtier.DiskTierBusyError, match=f"pid {owner.pid} "):
            manager(tmp_path, primary=6, host=0, disk=40)  # the grandchild did not release the lock
        owner.kill()
        owner.wait()
        os.kill(grandchild, 0)  # still there
        manager(tmp_path, primary=6, host=0, disk=40).close()
    finally:
        owner.kill()
        owner.wait()
        if grandchild is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)


# -- item 12: private files, no scope in plain text ------------------------------------------------


def test_files_are_private_and_scopes_are_not_stored(tmp_path):
    old_umask = os.umask(0o022)
    try:
        path = tmp_path / "new" / "deeper"
        persist_scoped(path, kind="llama")
        # a restart opens the WAL and shared-memory files again: they keep the mode too
        again = manager(path, kind="llama", primary=10, host=0, disk=200)
        directory = kvtier_dir(path)
        for d in (tmp_path / "new", path, directory):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        files = list(directory.iterdir())
        assert {"index.sqlite", "index.sqlite-wal", "lock", "secret", "group0.pages"} <= {f.name for f in files}
        for f in files:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        stored = b"".join(f.read_bytes() for f in files)
        for secret in (b"tenant-secret-salt-1", b"raw-salt-bytes-22", b"adapter-x"):
            for form in (secret, secret.hex().encode(), secret.hex().encode().hex().encode()):
                assert form not in stored, form
        assert serve_scoped(again) == 4 * 3 * 16  # every scope finds its own pages again
    finally:
        os.umask(old_umask)


def test_scopes_never_claim_each_others_restored_blocks(tmp_path):
    """The same tokens under four scopes; after a restart each scope reuses only its own pages, and a
    depth-0 row given another scope's tag is not claimed (its key does not chain from that root)."""
    mgr = manager(tmp_path, primary=8, host=0, disk=120)
    for scope in SCOPES[:3]:
        tokens = convo(0, 12)
        cache = mgr.create_cache(tokens, scope=scope)
        assert cache.resume() and cache.resize(12)
        PageOracle(mgr).write(cache, tokens, 0, 12)
        cache.commit(tokens)
        cache.close()
    mgr.close()
    index = kvtier_dir(tmp_path) / "index.sqlite"
    db = sqlite3.connect(index)
    tags = [t for (t,) in db.execute("SELECT DISTINCT scope_tag FROM nodes WHERE depth = 0")]
    assert len(tags) == 3
    db.execute("UPDATE nodes SET scope_tag = ? WHERE scope_tag = ?", (tags[0], tags[1]))  # two claim one tag
    db.commit()
    db.close()
    again = manager(tmp_path, primary=8, host=0, disk=120)
    reused = []
    for scope in [*SCOPES[:3], SCOPES[3]]:
        cache = serve(again, convo(0, 12) + [1], scope)
        reused.append(cache.num_reused_tokens)
        cache.close()
    assert reused.count(12) == 2 and reused[3] == 0, reused
    again.check_invariants()
    again.close()


# -- item 14: a manager dropped without close ------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_dropped_manager_releases_its_files_and_directory(tmp_path):
    """Before: a manager dropped without close() kept one descriptor per layer group, for good."""
    for _ in range(2):  # warm up what a first manager loads once (libraries, thread pools)
        manager(tmp_path, kind="hybrid", primary=8, host=0, disk=40).close()
    gc.collect()
    baseline = open_fds()
    for i in range(5):
        mgr = manager(tmp_path, kind="hybrid", primary=8, host=0, disk=40)
        prefill(mgr, PageOracle(mgr), convo(i))
        del mgr  # no close(): the next manager on the directory must still start
    gc.collect()
    deadline = time.monotonic() + 5
    while open_fds() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)  # I/O threads finish exiting
    assert open_fds() <= baseline


def test_a_process_killed_while_closing_keeps_the_pages_it_persisted_before(tmp_path):
    """Before: the close-time persist committed the index once, after its last page: a process killed
    during it (SIGKILL at the 13th of 18 page writes here) restored none of the pages it had written."""
    code = f"""
    import os, signal
    import kvtier.tiering.disk_writes as disk_writes
    from tests.test_tiers import manager, prefill, convo
    from tests.kvdata import PageOracle
    mgr = manager({str(tmp_path)!r}, primary=30, host=0, disk=40)
    for i in range(3):
        prefill(mgr, PageOracle(mgr), convo(i))  # 18 pages, all still in the primary tier
    disk_writes.PERSIST_CHUNK_BYTES = 2 * mgr.page_bytes(0)  # parts of two pages
    writes, write = [0], os.pwrite

    def killed_at_the_13th(fd, data, offset):
        writes[0] += 1
        if writes[0] == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(fd, data, offset)

    os.pwrite = killed_at_the_13th
    mgr.close()
    """
    out = run_child(code)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    again = manager(tmp_path, primary=30, host=0, disk=40)
    assert again.stats().tiers["disk"].pages_used == 12  # six parts of two pages, written and committed
    reused = [serve(again, convo(i) + [1]).num_reused_tokens for i in range(3)]  # each byte-exact
    assert reused == [16, 16, 16] and again.stats().checksum_failures == 0  # parents first: 4 blocks each
    again.check_invariants()
    again.close()


def test_a_dropped_manager_still_persists_its_pages(tmp_path, caplog):
    """Before: a manager dropped without close() (made inside a function) wrote none of its pages in
    memory to disk, silently: a new manager on the directory reused nothing."""

    def serve_and_drop() -> None:
        mgr = manager(tmp_path, primary=30, host=0, disk=40)
        oracle = PageOracle(mgr)
        for i in range(3):
            prefill(mgr, oracle, convo(i))  # 18 pages, all still in the primary tier
        assert mgr.stats().tiers["disk"].pages_used == 0

    with caplog.at_level(logging.WARNING):
        serve_and_drop()
        again = manager(tmp_path, primary=30, host=0, disk=40)  # waits for the dropped one's close
    assert again.stats().tiers["disk"].pages_used == 18
    for i in range(3):
        assert serve(again, convo(i) + [1]).num_reused_tokens == 24
    again.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropped without close()" in w and "written to its disk tier" in w for w in warnings), warnings


def test_a_manager_never_closed_still_persists_at_exit(tmp_path):
    """The storage's finalizers leave the files open at interpreter exit, where the manager is closed
    (and persists its published pages) before the process ends."""
    code = f"""
    from tests.test_tiers import manager, prefill, convo
    from tests.kvdata import PageOracle
    mgr = manager({str(tmp_path)!r}, primary=30, host=0, disk=40)
    for i in range(3):
        prefill(mgr, PageOracle(mgr), convo(i))  # 18 pages, all still in the primary tier
    assert mgr.stats().tiers["disk"].pages_used == 0
    """
    out = run_child(code)
    assert out.returncode == 0, out.stderr[-3000:]
    again = manager(tmp_path, primary=30, host=0, disk=40)
    assert again.stats().tiers["disk"].pages_used == 18
    for i in range(3):
        assert serve(again, convo(i) + [1]).num_reused_tokens == 24
    again.close()


def test_repeated_failures_log_a_first_line_then_summaries(caplog):
    from kvtier.storage.log_limit import RateLimitedWarning

    now = [0.0]
    warn = RateLimitedWarning(logging.getLogger("kvtier.test"), "page write failed", 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtier.test"):
        for i in range(1000):  # 1,000 failures over 100 s
            now[0] = i / 10
            warn(f"slot {i}: [Errno 28] No space left on device")
        warn.flush()
        warn.flush()  # nothing new: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "slot 0" in lines[0] and "summarised every 60 s" in lines[0]
    assert "600 more in the last 60 s (601 in all; the last: slot 600" in lines[1]
    assert "399 more" in lines[2] and "1000 in all" in lines[2] and "slot 999" in lines[2]


def test_a_restart_with_a_smaller_disk_quota_says_so_and_serves_what_fits(tmp_path, caplog):
    """Before: the pages past the smaller quota were reported at ERROR as rows that "did not check
    out", the words of damage, and the blocks below them kept their slots though no match could
    reach them."""
    mgr = manager(tmp_path, primary=4, host=0, disk=32)
    oracle = PageOracle(mgr)
    prompts = [convo(i, 3 * TPB) + [7] for i in range(8)]  # 24 pages pushed onto the disk
    for tokens in prompts:
        prefill(mgr, oracle, tokens)
    mgr.close()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        again = manager(tmp_path, primary=4, host=0, disk=8)
    assert "lay past its quota" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    served = 0
    oracle = PageOracle(again)
    for tokens in prompts:  # what fits is served, byte for byte
        cache = again.create_cache(tokens + [1])
        served += cache.num_reused_tokens
        assert cache.resume()
        oracle.check(cache, tokens + [1])
        cache.close()
    assert served > 0
    # Every page kept on disk is reachable: a chain whose head went past the quota lost its
    # children too (before, they kept their slots, never to be reused, until evicted).
    assert again.stats().tiers["disk"].pages_used == served // TPB
    assert "could never be reused" in caplog.text
    again.check_invariants()
    again.close()
