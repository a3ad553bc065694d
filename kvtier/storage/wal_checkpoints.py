"""Checkpoints of the disk index's write-ahead log, on a daemon thread of their own.

A checkpoint moves SQLite's write-ahead log into the database file, and under
``synchronous=NORMAL`` it waits for the disk twice (an fsync of the log, then of the file). SQLite's
default runs one on the connection that commits, each time the log passes 1,000 pages: a commit
of the index, on the pool's thread (vLLM's scheduler thread under ``kvtier.vllm``), then waits
for a disk that may be busy writing back gigabytes (docs/benchmarks.md section 66: beside a
12 GiB write, a 99th percentile of 996 ms a commit that way, 6.9 ms with the checkpoints here).

The index turns that off (``PRAGMA wal_autocheckpoint=0``) and calls ``committed`` after each
commit with the connection's running count of changed rows; past ``CHECKPOINT_CHANGES`` rows
since the last wake, a daemon thread wakes and runs a PASSIVE checkpoint on a connection of its
own. A PASSIVE checkpoint takes no lock that a commit waits for, so a commit never waits for a
checkpoint, and a checkpoint stuck on the disk holds only its thread (the log then grows until it
ends). One that fails (the disk failing) is retried at the next wake.

Invariants: the thread never holds the index or its connection (an index dropped without
``close`` stops it, ``weakref.finalize``); its connection is opened and closed on the thread, so
``close`` returns with the index's own connection the last one open (whose close then checkpoints
and removes the log), unless the thread is stuck past the wait given. Crash safety is SQLite's: a
process killed during a checkpoint leaves the log, which the next open replays.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

# Rows changed between checkpoints. Block keys are random, so a commit's rows land on pages all over
# the tables: 0.5-1.1 pages of log a row (measured, tables of 8K-64K blocks), about the 1,000 pages
# at which SQLite's default would checkpoint.
CHECKPOINT_CHANGES = 1000


class _Signals:
    """What the index and the thread share: the wake-up, the stop request and the count of checkpoints done."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.stopping = False
        self.done = 0

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()


class WalCheckpoints:
    """The checkpoints of the index at ``path``, run on the thread ``kvtier-index-checkpoint``."""

    def __init__(self, path: Path) -> None:
        self._signals = _Signals()
        self._woken_at = 0  # the count of changed rows at the last wake
        self._thread = threading.Thread(
            target=_checkpoint_when_woken, args=(path, self._signals), name="kvtier-index-checkpoint", daemon=True
        )
        self._thread.start()
        self._stop = weakref.finalize(self, self._signals.stop)

    @property
    def done(self) -> int:
        """Checkpoints that completed."""
        return self._signals.done

    def committed(self, total_changes: int) -> None:
        """A commit ended, ``total_changes`` (the connection's count) rows changed so far: wake the
        thread once ``CHECKPOINT_CHANGES`` more rows changed since it was last woken. Never waits."""
        if total_changes - self._woken_at >= CHECKPOINT_CHANGES:
            self._woken_at = total_changes
            self._signals.wake.set()

    def close(self, timeout_s: float) -> bool:
        """Stop the thread once the checkpoint it runs (if any) ends; False when it did not end within
        ``timeout_s`` (a disk stuck: it is left to end on its own, holding its connection)."""
        self._stop()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _checkpoint_when_woken(path: Path, signals: _Signals) -> None:
    db: sqlite3.Connection | None = None
    try:
        while True:
            signals.wake.wait()
            signals.wake.clear()
            if signals.stopping:
                return
            try:
                if db is None:
                    db = sqlite3.connect(path, isolation_level=None)
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:
                log.debug("kvtier disk tier: a checkpoint of %s failed (%s); retried at the next wake", path, exc)
                continue
            signals.done += 1
    finally:
        if db is not None:
            db.close()
