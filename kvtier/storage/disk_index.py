"""The disk tier's persistent index: which block lives in which slot, in SQLite (WAL).

One row per published page on disk: (block key, group, snapshot offset) -> slot, checksum,
parent key, scope, the block's tokens, its depth and priority. A new manager on the same
directory rebuilds its reuse tree from these rows. Changes are buffered and committed in one
transaction per manager operation; a page's data is always written before its row is
committed, so a process killed in between leaves at worst a row whose checksum no longer
matches (a miss), never a row that names bytes it did not check.

A damaged or unreadable index is logged, moved aside, and replaced by an empty one: its pages
are then simply missing.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pages (
    block_key BLOB NOT NULL,
    grp INTEGER NOT NULL,
    snapshot_offset INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    parent_key BLOB NOT NULL,
    scope BLOB NOT NULL,
    tokens BLOB NOT NULL,
    depth INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    PRIMARY KEY (block_key, grp, snapshot_offset)
);
"""


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One page on disk. ``checksum`` is stored as a signed 64-bit value (SQLite's INTEGER)."""

    block_key: bytes
    group: int
    snapshot_offset: int
    slot: int
    checksum: int
    parent_key: bytes
    scope: bytes
    tokens: bytes
    depth: int
    priority: int


class DiskIndex:
    """The SQLite index of one disk tier directory."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self._pending_put: dict[tuple[bytes, int, int], IndexRow] = {}
        self._pending_delete: set[tuple[bytes, int, int]] = set()
        try:
            self._db = self._open(str(path), fingerprint)
        except sqlite3.DatabaseError as exc:
            log.warning("kvtier disk tier: index %s is unusable (%s); starting with an empty one", path, exc)
            try:
                _move_aside(path)
                self._db = self._open(str(path), fingerprint)
            except (OSError, sqlite3.DatabaseError) as again:
                log.warning("kvtier disk tier: cannot create %s (%s); the index lives in memory only", path, again)
                self._db = self._open(":memory:", fingerprint)

    @staticmethod
    def _open(target: str, fingerprint: str) -> sqlite3.Connection:
        db = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            found = dict(db.execute("SELECT name, value FROM meta").fetchall())
            expected = {"fingerprint": fingerprint, "schema": SCHEMA_VERSION}
            if found and found != expected:
                raise sqlite3.DatabaseError(f"index belongs to {found}, expected {expected}")
            if not found:
                db.executemany("INSERT INTO meta VALUES (?, ?)", expected.items())
            db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def rows(self) -> list[IndexRow]:
        """Every row, shallowest block first; an unreadable index gives none (and is reset)."""
        try:
            raw = self._db.execute(
                "SELECT block_key, grp, snapshot_offset, slot, checksum, parent_key, scope, tokens, depth, priority "
                "FROM pages ORDER BY depth"
            ).fetchall()
            return [IndexRow(*r) for r in raw]
        except sqlite3.DatabaseError as exc:
            log.warning("kvtier disk tier: cannot read index %s (%s); its pages are treated as missing", self.path, exc)
            return []

    def put(self, row: IndexRow) -> None:
        key = (row.block_key, row.group, row.snapshot_offset)
        self._pending_delete.discard(key)
        self._pending_put[key] = row

    def delete(self, block_key: bytes, group: int, snapshot_offset: int) -> None:
        key = (block_key, group, snapshot_offset)
        self._pending_put.pop(key, None)
        self._pending_delete.add(key)

    def flush(self) -> None:
        """Commit buffered changes in one transaction; a failure is logged and loses only index rows."""
        if not self._pending_put and not self._pending_delete:
            return
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "DELETE FROM pages WHERE block_key = ? AND grp = ? AND snapshot_offset = ?", self._pending_delete
                )
                self._db.executemany(
                    "INSERT OR REPLACE INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            r.block_key,
                            r.group,
                            r.snapshot_offset,
                            r.slot,
                            r.checksum,
                            r.parent_key,
                            r.scope,
                            r.tokens,
                            r.depth,
                            r.priority,
                        )
                        for r in self._pending_put.values()
                    ],
                )
        except sqlite3.Error as exc:
            log.warning("kvtier disk tier: index update failed (%s); those pages will be missing after a restart", exc)
        self._pending_put.clear()
        self._pending_delete.clear()

    def close(self) -> None:
        self.flush()
        self._db.close()


def _move_aside(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        p = Path(str(path) + suffix)
        if p.exists():
            p.replace(Path(str(path) + suffix + ".damaged"))
