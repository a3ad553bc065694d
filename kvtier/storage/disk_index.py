"""The disk tier's persistent index: which block lives in which slot, in SQLite (WAL).

Two tables:

- ``nodes``: one row per block that has a page on disk or a descendant that has one: its key,
  its parent's key, its tokens and depth. A block's row is written with its own first page row
  or its first descendant's, so every page row's chain back to its scope's root is in the index
  whenever the page row is: what a process killed at any point leaves behind restores.
- ``pages``: one row per page on disk: (block key, group, snapshot offset) -> slot, checksum,
  priority, and a seal (a hash of the row's other fields): a row changed by damage is rejected.

A third table, ``measured``, keeps rates measured by the managers that used the directory (the
disk's read bandwidth, the engine's prefill rate; ``remember``), so that a manager started later
weighs its first disk load as the last one did. A missing, damaged or foreign value is ignored:
it is an estimate, never data. Measures are committed with the next batch of changes and at close.

A scope is stored only as a keyed hash (a *tag*, keyed by the directory's secret), in the rows of
depth 0; token ids are stored as they are (the files are private to their user).

Consistency with the slots: changes are buffered and committed in one transaction per manager
operation, and before a slot is rewritten (the writer waits for ``flush``, or for the future of
``commit_soon``, first), so a row never names a slot rewritten with other data. Commits run on a
thread of their own (``kvtier-index-commit``), one at a time in the order they were started, so
the pool's thread (vLLM's scheduler thread under ``kvtier.vllm``) never waits for SQLite's log
write, which the kernel may throttle while the disk writes back; only a caller about to rewrite
slots waits. A commit that fails keeps its changes, and those of the commits started after it
(not tried: they would land out of order), for the next one. A commit never runs a checkpoint of
SQLite's log, which waits for the disk: those run on a thread of their own
(``kvtier.storage.wal_checkpoints``).

Opening reads every row. An index that cannot be read (damaged, of another schema or secret, or
lost while page files remain) is reported with an ERROR line saying what was lost, moved aside
(``*.damaged``) and replaced by an empty one; ``resets`` counts it. A read-only directory's
index is read from a private copy and never written; so is the index of a directory whose file
system will not have it written at open (full, failing: an ERROR line says so), which is kept as
it is for a later manager.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import shutil
import sqlite3
import struct
import tempfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.storage.disk_dir import DiskDirectory, make_private, open_private
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.storage.wal_checkpoints import WalCheckpoints

log = logging.getLogger(__name__)

INDEX_FILE = "index.sqlite"
SCHEMA_VERSION = "3"  # 3: page checksums are XXH3-64 (schema 2 stored blake2b-64: reported, started empty)
_SIDE_FILES = ("-wal", "-shm")
CHECKPOINT_CLOSE_WAIT_S = 10.0  # at close, the wait for a checkpoint in progress (past it, the log stays)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    block_key BLOB PRIMARY KEY,
    parent_key BLOB NOT NULL,
    scope_tag BLOB NOT NULL,
    tokens BLOB NOT NULL,
    depth INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS pages (
    block_key BLOB NOT NULL,
    grp INTEGER NOT NULL,
    snapshot_offset INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    seal INTEGER NOT NULL,
    PRIMARY KEY (block_key, grp, snapshot_offset)
);
"""
_MEASURED_TABLE = "CREATE TABLE IF NOT EXISTS measured (name TEXT PRIMARY KEY, value REAL NOT NULL)"
# SQLite's primary result codes that say the file system, not the file, is in the way: PERM, BUSY,
# LOCKED, NOMEM, READONLY, IOERR, FULL (a damaged file gives CORRUPT or NOTADB).
_SQLITE_FILE_SYSTEM_STATE = frozenset({3, 5, 6, 7, 8, 10, 13})
_OS_FILE_SYSTEM_STATE = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOMEM, errno.EMFILE}
)
# What a damaged or foreign file can raise while it is read.
_UNREADABLE = (sqlite3.Error, OSError, ValueError, TypeError, UnicodeError, OverflowError, struct.error)


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One block: at depth 0 ``parent_key`` is empty and ``scope_tag`` names its scope; deeper, the reverse."""

    block_key: bytes
    parent_key: bytes
    scope_tag: bytes
    tokens: bytes
    depth: int


@dataclass(frozen=True, slots=True)
class PageRow:
    """One page on disk. ``checksum`` is stored as a signed 64-bit value (SQLite's INTEGER)."""

    block_key: bytes
    group: int
    snapshot_offset: int
    slot: int
    checksum: int
    priority: int

    def seal(self) -> int:
        """A hash of every field: a row whose stored seal differs was changed by damage."""
        fields = struct.pack("<qqqqq", self.group, self.snapshot_offset, self.slot, self.checksum, self.priority)
        return int.from_bytes(hashlib.blake2b(fields + self.block_key, digest_size=8).digest(), "little", signed=True)


class _Unusable(Exception):
    """The index file is there but cannot be used (what is wrong with it is the message)."""


class _NotTried(Exception):
    """A commit not tried because one started before it failed: its changes go back with that one's."""


@dataclass(slots=True)
class _Changes:
    """Changes not committed yet: for each key, the last change made to it."""

    nodes: dict[bytes, NodeRow] = field(default_factory=dict)
    node_deletes: set[bytes] = field(default_factory=set)
    puts: dict[tuple[bytes, int, int], PageRow] = field(default_factory=dict)
    deletes: set[tuple[bytes, int, int]] = field(default_factory=set)
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> bool:
        """Whether a row is changed (measures alone are not)."""
        return bool(self.nodes or self.node_deletes or self.puts or self.deletes)

    def then(self, newer: _Changes) -> None:
        """Fold in ``newer``, changes made after these: for each key, the later change stays."""
        _overlay(self.nodes, self.node_deletes, newer.nodes, newer.node_deletes)
        _overlay(self.puts, self.deletes, newer.puts, newer.deletes)
        self.measured.update(newer.measured)


def _overlay(puts: dict, deletes: set, newer_puts: dict, newer_deletes: set) -> None:
    """Rows written (``puts``) and removed (``deletes``), each key in one of them, followed by
    later ones: a key's later change replaces its earlier one."""
    for key, row in newer_puts.items():
        deletes.discard(key)
        puts[key] = row
    for key in newer_deletes:
        puts.pop(key, None)
        deletes.add(key)


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


_COMMITTED: Future = _done()  # what ``commit_soon`` answers when nothing is left to commit


class DiskIndex:
    """The SQLite index of one disk tier directory; ``close`` also releases the directory."""

    def __init__(self, directory: DiskDirectory, fingerprint: str) -> None:
        self.directory = directory
        self.path = directory.file(INDEX_FILE)
        self.resets = 0
        self.rejected = 0  # rows dropped when read: wrong types or a broken seal
        self.nodes: list[NodeRow] = []  # as read at open, shallowest first
        self.pages: list[PageRow] = []
        self.measured: dict[str, float] = {}  # as read at open: finite values > 0 only
        self._secret = directory.secret or b""
        self._meta = {
            b"fingerprint": fingerprint.encode(),
            b"schema": SCHEMA_VERSION.encode(),
            b"secret": hashlib.blake2b(b"kvtier-secret-check", key=self._secret, digest_size=16).hexdigest().encode(),
        }
        self._pending = _Changes()
        self._commits: deque[tuple[_Changes, Future]] = deque()  # started, not yet seen to end, oldest first
        self._committer: ThreadPoolExecutor | None = None  # started at the first commit
        self._broken = False  # a commit failed: the committer tries none of those queued after it
        self._failures = RateLimitedWarning(log, "disk tier index update failed")
        self._db: sqlite3.Connection | None = None
        self._checkpoints: WalCheckpoints | None = None
        if not directory.readable:
            return
        if directory.writable:
            self._db = self._open_writable()
            self._checkpoints = self._checkpoint_in_background(self._db)
        else:
            self._read_only_copy()

    # -- opening -------------------------------------------------------------------------------

    def _open_writable(self) -> sqlite3.Connection | None:
        """The index opened for writing; None when the file system will not have it written now
        (the directory is then served read-only, ``_serve_read_only``)."""
        try:
            db = _connect(self.path)
        except _UNREADABLE as exc:
            if _file_system_state(exc):
                return self._serve_read_only(exc)
            return self._reset(None, f"it cannot be opened ({exc})")
        try:
            if self._load(db):
                db.execute(_MEASURED_TABLE)  # an index from before the table was added
                return db
            if self.directory.had_pages:  # missing or empty, while page files remain from an earlier manager
                self._report("it is missing or empty while page files remain", "every page in them")
            _create(db, self._meta)
        except _UNREADABLE + (_Unusable,) as exc:
            if _file_system_state(exc):
                db.close()
                return self._serve_read_only(exc)
            return self._reset(db, str(exc))
        return db

    def _checkpoint_in_background(self, db: sqlite3.Connection | None) -> WalCheckpoints | None:
        """Checkpoints of ``db``'s log off the committing thread (``kvtier.storage.wal_checkpoints``);
        None for an index kept in memory (or none)."""
        if db is None or not db.execute("PRAGMA database_list").fetchone()[2]:
            return None
        try:
            checkpoints = WalCheckpoints(self.path)
        except RuntimeError:  # no thread can be started now: the commits checkpoint, SQLite's default
            return None
        db.execute("PRAGMA wal_autocheckpoint=0")
        return checkpoints

    def _serve_read_only(self, exc: BaseException) -> None:
        """The file system will not have the index written now (full, failing, read-only): nothing
        is moved aside or lost; this manager serves the directory read-only, from a private copy
        of its index, and writes nothing to it (the page files are opened read-only after this)."""
        log.error(
            "kvtier disk tier: the index %s cannot be written now (%s); this manager serves the directory "
            "read-only and writes nothing to it; nothing in it is lost (a manager started once the file "
            "system has room takes it back)",
            self.path,
            exc,
        )
        self.directory.writable = False
        self.directory.why_not_writable = f"its index cannot be written ({exc})"
        self._read_only_copy()

    def _read_only_copy(self) -> None:
        """Read a read-only directory's index from a private copy (SQLite would write beside the
        original); where no copy can be made (a file system full too, a file size limit), in place
        as an immutable file if it has no write-ahead log to replay (a manager that closed leaves none)."""
        try:
            with tempfile.TemporaryDirectory(prefix="kvtier-index-") as tmp:
                try:
                    for suffix in ("", "-wal"):
                        source = Path(str(self.path) + suffix)
                        if source.exists():
                            shutil.copyfile(source, Path(tmp) / (INDEX_FILE + suffix))
                except OSError:
                    if _has_log(self.path):
                        raise
                    found = self._load_closed(_connect_immutable(self.path))
                else:
                    found = self._load_closed(_connect(Path(tmp) / INDEX_FILE))
        except _UNREADABLE + (_Unusable,) as exc:
            if self.directory.had_pages:  # else a new directory: no page was ever written, none is lost
                self._report(f"it cannot be read ({exc})", "every page it named")
            self.nodes, self.pages, self.rejected = [], [], 0
            return
        if not found and self.directory.had_pages:
            self._report("it is missing or empty while page files remain", "every page in them")

    def _load_closed(self, db: sqlite3.Connection) -> bool:
        """``_load`` from ``db``, closed after."""
        try:
            return self._load(db)
        finally:
            db.close()

    def _load(self, db: sqlite3.Connection) -> bool:
        """Read every row; False for a new (empty) file, ``_Unusable`` for one that is not this index."""
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return False
        if not {b"meta", b"nodes", b"pages"} <= tables:
            raise _Unusable(f"it has the tables {sorted(t.decode(errors='replace') for t in tables)}")
        found = dict(db.execute("SELECT name, value FROM meta").fetchall())
        if not found and not self.directory.had_pages:  # a creation cut short before this version made it whole
            return False
        if found != self._meta:
            if found.get(b"schema") != self._meta[b"schema"]:
                schema = found.get(b"schema", b"?").decode(errors="replace")
                raise _Unusable(f"it was written by schema {schema}, this is {SCHEMA_VERSION}")
            if found.get(b"secret") != self._meta[b"secret"]:
                raise _Unusable("it does not match the directory's secret file")
            raise _Unusable("it belongs to another model or page layout")
        check = db.execute("PRAGMA quick_check").fetchall()
        if check != [(b"ok",)]:
            raise _Unusable(f"SQLite finds it damaged: {check[0][0][:200]!r}")
        nodes = db.execute("SELECT block_key, parent_key, scope_tag, tokens, depth FROM nodes").fetchall()
        pages = db.execute(
            "SELECT block_key, grp, snapshot_offset, slot, checksum, priority, seal FROM pages"
        ).fetchall()
        self.nodes = sorted((r for r in map(_node_row, nodes) if r is not None), key=lambda r: r.depth)
        self.pages = [r for r in map(_page_row, pages) if r is not None]
        self.rejected = len(nodes) + len(pages) - len(self.nodes) - len(self.pages)
        if b"measured" in tables:
            self.measured = _measures(db.execute("SELECT name, value FROM measured").fetchall())
        return True

    def _reset(self, db: sqlite3.Connection | None, why: str) -> sqlite3.Connection:
        """Report the index as lost, move it aside and start an empty one (in memory if even that fails)."""
        lost = _count_pages(db)
        if db is not None:
            db.close()
        self._report(f"{why}; moved aside to {self.path.name}.damaged", lost)
        self.nodes, self.pages, self.rejected = [], [], 0
        try:
            for suffix in ("", *_SIDE_FILES):
                p = Path(str(self.path) + suffix)
                if p.exists():
                    p.replace(Path(str(p) + ".damaged"))
            db = _connect(self.path)
            _create(db, self._meta)
            return db
        except _UNREADABLE as exc:
            log.error("kvtier disk tier: cannot create %s (%s); its pages last until the process ends", self.path, exc)
            db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            _create(db, self._meta)
            return db

    def _report(self, why: str, lost: str) -> None:
        """One ERROR line: which index, what is wrong with it, what was lost. A directory resets once at most."""
        self.resets = 1
        log.error(
            "kvtier disk tier: the index %s cannot be used: %s; %s lost, the directory starts empty",
            self.path,
            why,
            lost,
        )

    # -- changes -------------------------------------------------------------------------------

    def scope_tag(self, scope: bytes) -> bytes:
        """The keyed hash that stands for an encoded scope in this directory."""
        return hashlib.blake2b(scope, key=self._secret, digest_size=16, person=b"kvtier-scope").digest()

    def put_node(self, row: NodeRow) -> None:
        self._pending.node_deletes.discard(row.block_key)
        self._pending.nodes[row.block_key] = row

    def delete_node(self, block_key: bytes) -> None:
        self._pending.nodes.pop(block_key, None)
        self._pending.node_deletes.add(block_key)

    def put(self, row: PageRow) -> None:
        key = (row.block_key, row.group, row.snapshot_offset)
        self._pending.deletes.discard(key)
        self._pending.puts[key] = row

    def delete(self, block_key: bytes, group: int, snapshot_offset: int) -> None:
        key = (block_key, group, snapshot_offset)
        self._pending.puts.pop(key, None)
        self._pending.deletes.add(key)

    def remember(self, name: str, value: float) -> None:
        """Keep a measured rate for managers started later (committed with the next changes)."""
        self._pending.measured[name] = value

    def commit_soon(self, measures_alone: bool = False) -> Future:
        """Start committing the buffered changes in one transaction on the committing thread; never
        waits. The future ends once they, and every commit started before, are in the file (its
        exception set when that commit failed: the changes are then kept, logged at the next call,
        and go with the next commit). Remembered measures go with the changes; alone, only if
        ``measures_alone`` (at close)."""
        self._take_ended()
        pending = self._pending
        if not pending.rows and not (measures_alone and pending.measured):
            return self._commits[-1][1] if self._commits else _COMMITTED
        self._pending = _Changes()
        if self._db is None:  # read-only: nothing is written to the directory, so nothing can disagree
            return _COMMITTED
        if self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-index-commit")
        try:
            future = self._committer.submit(self._commit, pending)
        except RuntimeError:  # the interpreter is exiting (a close at exit): committed here, after the others
            wait([started for _, started in self._commits])
            future = Future()
            try:
                self._commit(pending)
                future.set_result(None)
            except (sqlite3.Error, _NotTried) as exc:
                future.set_exception(exc)
        self._commits.append((pending, future))
        return future

    def flush(self, measures_alone: bool = False) -> bool:
        """``commit_soon`` and wait: True once every change buffered so far is in the file, False
        (logged, rate-limited) when a commit failed; its changes are kept for the next one, so a
        delete is never lost and a row never names a slot that a writer (which waits for this
        first) rewrote."""
        future = self.commit_soon(measures_alone)
        future.exception()  # waits
        return self._take_ended()

    def _commit(self, changes: _Changes) -> None:
        """On the committing thread: one transaction of ``changes``."""
        if self._broken:
            raise _NotTried()
        db = self._db
        assert db is not None
        try:
            with db:
                db.execute("BEGIN")
                db.executemany("INSERT OR REPLACE INTO measured VALUES (?, ?)", list(changes.measured.items()))
                db.executemany(
                    "DELETE FROM pages WHERE block_key = ? AND grp = ? AND snapshot_offset = ?", changes.deletes
                )
                db.executemany("DELETE FROM nodes WHERE block_key = ?", [(k,) for k in changes.node_deletes])
                db.executemany(
                    "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?)",
                    [(r.block_key, r.parent_key, r.scope_tag, r.tokens, r.depth) for r in changes.nodes.values()],
                )
                db.executemany(
                    "INSERT OR REPLACE INTO pages VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (r.block_key, r.group, r.snapshot_offset, r.slot, r.checksum, r.priority, r.seal())
                        for r in changes.puts.values()
                    ],
                )
        except sqlite3.Error:
            self._broken = True
            raise
        if self._checkpoints is not None:
            self._checkpoints.committed(db.total_changes)

    def _take_ended(self) -> bool:
        """Let go of the commits that ended at the front of the line. When one failed, it and those
        after it (waited for: the committer tries none of them) give their changes back, before
        the ones buffered since, and the failure is logged; False then."""
        commits = self._commits
        while commits and commits[0][1].done():
            changes, future = commits.popleft()
            failure = future.exception()
            if failure is None:
                continue
            wait([later for _, later in commits])
            for later, _ in commits:
                changes.then(later)
            commits.clear()
            changes.then(self._pending)
            self._pending = changes
            self._broken = False
            self._failures(f"{self.path}: {failure}; the changes are kept and retried, disk writes wait for them")
            return False
        return True

    def close(self) -> None:
        """Commit what is pending, close the file and release the directory. Idempotent."""
        if self._db is not None:
            self.flush(measures_alone=True)
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
            if self._checkpoints is not None:  # its connection closes first: the last to close removes the log
                self._checkpoints.close(CHECKPOINT_CLOSE_WAIT_S)
            self._db.close()
            self._db = None
        self._failures.flush()
        self.directory.close()


def _file_system_state(exc: BaseException) -> bool:
    """Whether an error opening the index comes from the file system's state (full, failing,
    read-only, busy), not from the file's contents: such an index is kept as it is."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code is not None and code & 0xFF in _SQLITE_FILE_SYSTEM_STATE
    return isinstance(exc, OSError) and exc.errno in _OS_FILE_SYSTEM_STATE


def _connect(path: Path) -> sqlite3.Connection:
    """A connection to ``path`` (created 0600; SQLite gives its side files the same mode)."""
    os.close(open_private(path, os.O_RDWR | os.O_CREAT))
    for suffix in _SIDE_FILES:
        make_private(Path(str(path) + suffix))
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.text_factory = bytes  # a damaged TEXT value must not fail to decode
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
    except BaseException:  # a damaged file can also fail to decode SQLite's own error message
        db.close()
        raise
    return db


def _connect_immutable(path: Path) -> sqlite3.Connection:
    """A connection that reads ``path`` in place and writes nothing beside it (no lock, no side files)."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, check_same_thread=False)
    db.text_factory = bytes
    return db


def _has_log(path: Path) -> bool:
    """Whether the index has a write-ahead log with commits not yet in the file itself."""
    try:
        return Path(str(path) + "-wal").stat().st_size > 0
    except FileNotFoundError:
        return False


def _create(db: sqlite3.Connection, meta: dict[bytes, bytes]) -> None:
    """The tables and the meta rows, in one transaction: a file system that fails part way leaves
    the file as it was (tables without meta would read as another index's)."""
    try:
        db.executescript(f"BEGIN; {_SCHEMA}; {_MEASURED_TABLE};")
        rows = [(k.decode(), v.decode()) for k, v in meta.items()]
        db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _measures(rows: list[tuple]) -> dict[str, float]:
    """The readable measures: a name of text and a finite value > 0 (anything else is skipped)."""
    found = {}
    for name, value in rows:
        if isinstance(name, bytes) and type(value) is float and math.isfinite(value) and value > 0:
            try:
                found[name.decode()] = value
            except UnicodeError:
                continue
    return found


def _count_pages(db: sqlite3.Connection | None) -> str:
    """'N pages' if the damaged index can still count them, else a phrase that says it cannot."""
    if db is not None:
        try:
            (n,) = db.execute("SELECT count(*) FROM pages").fetchone()
            return f"its {n} pages"
        except _UNREADABLE:
            pass
    return "every page it named"


def _node_row(raw: tuple) -> NodeRow | None:
    key, parent, tag, tokens, depth = raw
    if not all(isinstance(x, bytes) for x in (key, parent, tag, tokens)) or type(depth) is not int or depth < 0:
        return None
    return NodeRow(key, parent, tag, tokens, depth)


def _page_row(raw: tuple) -> PageRow | None:
    key, *numbers, seal = raw
    if not isinstance(key, bytes) or not all(type(x) is int for x in (*numbers, seal)):
        return None
    row = PageRow(key, *numbers)
    try:
        return row if row.seal() == seal else None
    except struct.error:
        return None
