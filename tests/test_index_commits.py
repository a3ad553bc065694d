"""The disk index commits on a thread of its own: the pool's thread (vLLM's scheduler thread under
``kvtier.vllm``) never waits for SQLite's log write, which the kernel may hold while the disk
writes back; only a writer about to rewrite slots waits for the commit that frees them.

Before: every commit ran on the pool's thread, after each operation that changed the index and
after each write-behind batch landed.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time

from kvtier.storage.disk_dir import DiskDirectory
from kvtier.storage.disk_index import DiskIndex, NodeRow, PageRow
from kvtier.storage.page_files import DiskStorage
from tests.test_disk_write_behind import make, prompt_of, serve


def block(n: int) -> tuple[NodeRow, PageRow]:
    key = os.urandom(8) + n.to_bytes(8, "little")
    return NodeRow(key, os.urandom(16), b"", os.urandom(64), 1), PageRow(key, 0, 0, n, n * 7919, 0)


def slots_named(index: DiskIndex, group: int = 0) -> dict[bytes, int]:
    """Block key -> slot of the group's page rows committed to the file (a connection of its own)."""
    db = sqlite3.connect(index.path)
    try:
        return dict(db.execute("SELECT block_key, slot FROM pages WHERE grp = ?", (group,)))
    finally:
        db.close()


def held_commits(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Commits that wait for ``release`` (``started`` is set once one waits)."""
    started, release = threading.Event(), threading.Event()
    commit = DiskIndex._commit

    def held(self, changes):
        started.set()
        release.wait()
        commit(self, changes)

    monkeypatch.setattr(DiskIndex, "_commit", held)
    return started, release


def test_a_commit_runs_off_the_callers_thread_and_flush_waits_for_it(tmp_path, monkeypatch):
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    started, release = held_commits(monkeypatch)
    node, page = block(1)
    index.put_node(node)
    index.put(page)
    begun = time.monotonic()
    future = index.commit_soon()
    assert time.monotonic() - begun < 0.5 and not future.done()
    assert started.wait(10)
    assert slots_named(index) == {}
    flushed = []
    waiter = threading.Thread(target=lambda: flushed.append(index.flush()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # flush waits for the commit in flight
    release.set()
    waiter.join(10)
    assert flushed == [True] and future.exception() is None
    assert slots_named(index) == {page.block_key: 1}
    index.close()


def test_a_failed_commit_gives_back_its_changes_and_those_of_the_commits_after_it_in_order(
    tmp_path, monkeypatch, caplog
):
    """The first commit fails while a second waits behind it: the second is not tried (it would
    land before the first's changes), and both come back before the changes made since; the next
    flush commits, for each key, its last change."""
    index = DiskIndex(DiskDirectory(tmp_path / "d"), "fp")
    started, release = threading.Event(), threading.Event()
    real = DiskIndex._commit

    class FailingDisk:
        def __enter__(self):
            raise sqlite3.OperationalError("disk I/O error")

        def __exit__(self, *exc):
            return False

    def fails_once(self, changes):
        if started.is_set():
            return real(self, changes)
        started.set()
        release.wait()
        db, self._db = self._db, FailingDisk()
        try:
            real(self, changes)
        finally:
            self._db = db

    monkeypatch.setattr(DiskIndex, "_commit", fails_once)
    (node_a, page_a), (node_b, page_b), (node_c, page_c) = block(1), block(2), block(3)
    index.put_node(node_a)
    index.put(page_a)
    index.put_node(node_b)
    index.put(page_b)
    first = index.commit_soon()
    assert started.wait(10)
    index.delete(page_a.block_key, 0, 0)  # after the first: a's row must end deleted
    index.delete_node(node_a.block_key)
    index.put(PageRow(page_b.block_key, 0, 0, 9, 99, 0))  # b's row must end in slot 9
    second = index.commit_soon()
    index.put_node(node_c)  # buffered, not started
    index.put(page_c)
    release.set()
    assert isinstance(first.exception(10), sqlite3.OperationalError)
    assert second.exception(10) is not None  # not tried
    assert slots_named(index) == {}
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk_index"):
        assert index.flush()
    assert "disk I/O error" in caplog.text
    assert slots_named(index) == {page_b.block_key: 9, page_c.block_key: 3}
    index.close()


def test_write_behind_writes_no_slot_that_a_committed_row_still_names(tmp_path, monkeypatch):
    """With commits that take a while, write-behind fills a small disk and then drops its least
    recently used pages for room: its worker writes a slot only once the removal of the row that
    named it is committed (it waits for that commit, off the pool's thread)."""
    commit = DiskIndex._commit

    def slow(self, changes):
        time.sleep(0.005)
        commit(self, changes)

    monkeypatch.setattr(DiskIndex, "_commit", slow)
    mgr, oracle = make(tmp_path / "disk", blocking_writes=False)
    index = mgr._pool.tiers[2].disk_index
    write = DiskStorage.write
    written, named_while_written = [], []

    def checked(self, group, slots, pages):
        named = set(slots_named(index, group).values())
        named_while_written.extend(slot for slot in slots if slot in named)
        written.extend(slots)
        return write(self, group, slots, pages)

    monkeypatch.setattr(DiskStorage, "write", checked)
    for i in range(80):
        serve(mgr, oracle, prompt_of(1000 * (i + 1), blocks=3))
        mgr.maintain()
        mgr._pool.write_behind.poll(wait=True)
    assert mgr.stats().tiers["disk"].pages_used == mgr.stats().tiers["disk"].pages_total
    assert len(written) > 2 * mgr.stats().tiers["disk"].pages_total  # slots written again and again
    assert named_while_written == []
    mgr.check_invariants()
    mgr.close()
