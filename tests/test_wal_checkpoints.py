"""The disk index's log is checkpointed on a thread of its own, never by a commit.

Before: SQLite's automatic checkpoint ran inside the commit that took the log past 1,000 pages,
on the pool's thread (vLLM's scheduler thread), and waited there for two fsyncs of a disk that
may be busy writing back gigabytes.
"""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from kvtier.storage import wal_checkpoints
from kvtier.storage.disk_dir import DiskDirectory
from kvtier.storage.disk_index import INDEX_FILE, DiskIndex, NodeRow, PageRow
from tests.test_tiers import run_python

BLOCKS_PER_COMMIT = 500


def add_rows(index: DiskIndex, first: int, count: int) -> None:
    """``count`` blocks (a node row and a page row each) from number ``first``, committed
    ``BLOCKS_PER_COMMIT`` at a time."""
    for start in range(first, first + count, BLOCKS_PER_COMMIT):
        for n in range(start, min(start + BLOCKS_PER_COMMIT, first + count)):
            key = os.urandom(8) + n.to_bytes(8, "little")
            index.put_node(NodeRow(key, os.urandom(16), b"", os.urandom(64), 1 + n % 7))
            index.put(PageRow(key, 0, 0, n, int.from_bytes(os.urandom(7), "little"), n % 3))
        assert index.flush()


def rows_in_file(path: Path) -> int:
    """Page rows in the database file itself, its log ignored (an immutable read)."""
    db = sqlite3.connect(f"{path.as_uri()}?immutable=1", uri=True)
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        return db.execute("SELECT count(*) FROM pages").fetchone()[0] if "pages" in tables else 0
    finally:
        db.close()


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def held_checkpoints(monkeypatch):
    """Checkpoint threads that wait for ``release`` before each checkpoint they run."""
    release = threading.Event()
    checkpoint = wal_checkpoints._checkpoint_when_woken

    def held(path, signals):
        release.wait()
        checkpoint(path, signals)

    monkeypatch.setattr(wal_checkpoints, "_checkpoint_when_woken", held)
    yield release
    release.set()


def test_commits_leave_the_log_to_the_checkpoint_thread(tmp_path, held_checkpoints):
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    wal = Path(str(index.path) + "-wal")
    add_rows(index, 0, 20_000)
    # SQLite's automatic checkpoint would have moved the log into the file past 1,000 pages (4 MiB)
    assert wal.stat().st_size > 8 << 20
    assert rows_in_file(index.path) == 0
    held_checkpoints.set()
    assert wait_for(lambda: index._checkpoints.done >= 1)
    assert rows_in_file(index.path) == 20_000
    index.close()
    assert not wal.exists()  # the index's connection closed last: the log went into the file
    assert rows_in_file(index.path) == 20_000


def test_a_checkpoint_stuck_on_the_disk_holds_no_commit(tmp_path, monkeypatch):
    """The checkpoint thread's connection blocks inside a checkpoint; commits go on."""
    stuck = threading.Event()
    go_on = threading.Event()
    connect = sqlite3.connect

    class StuckConnection:
        def __init__(self, db):
            self.db = db

        def execute(self, sql):
            stuck.set()
            go_on.wait()
            return self.db.execute(sql)

        def close(self):
            self.db.close()

    def connect_where(path, **kwargs):
        db = connect(path, **kwargs)
        return StuckConnection(db) if threading.current_thread().name == "kvtier-index-checkpoint" else db

    monkeypatch.setattr(sqlite3, "connect", connect_where)
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    try:
        add_rows(index, 0, 2_000)
        assert stuck.wait(10)
        t0 = time.perf_counter()
        add_rows(index, 2_000, 6_000)
        assert time.perf_counter() - t0 < 10
        assert not index._checkpoints.close(0.1)  # stuck: left to end on its own
    finally:
        go_on.set()
    index.close()
    again = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    assert len(again.pages) == 8_000
    again.close()


def test_an_index_dropped_without_close_stops_its_thread(tmp_path):
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    thread, signals = index._checkpoints._thread, index._checkpoints._signals
    add_rows(index, 0, 2_000)
    assert wait_for(lambda: signals.done >= 1)
    del index
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_a_process_killed_before_any_checkpoint_keeps_its_commits(tmp_path):
    """The log alone holds the rows (no checkpoint ran); the next open replays it."""
    code = f"""
import os, threading
from pathlib import Path
from kvtier.storage import wal_checkpoints
wal_checkpoints._checkpoint_when_woken = lambda path, signals: threading.Event().wait()
from kvtier.storage.disk_dir import DiskDirectory
from kvtier.storage.disk_index import DiskIndex
from tests.test_wal_checkpoints import add_rows, rows_in_file
index = DiskIndex(DiskDirectory(Path({str(tmp_path / "d")!r})), "fp")
add_rows(index, 0, 5_000)
assert rows_in_file(index.path) == 0
os.kill(os.getpid(), 9)
"""
    out = run_python(code)
    assert out.returncode == -9, out.stderr[-2000:]
    again = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    assert len(again.pages) == 5_000 and len(again.nodes) == 5_000
    again.close()
    assert rows_in_file(tmp_path / "d" / INDEX_FILE) == 5_000
