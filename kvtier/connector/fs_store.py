"""A block store in a directory: one file per key, shared safely by several processes.

The value of a key lives in ``<root>/<h[0:2]>/<h[2:4]>/<h>.page``, ``h`` being 32 hex digits of
blake2b over the key (``path_of``): any key maps to a safe fixed-length name, and 65536 leaf
directories spread the files evenly (a million values are about 15 files per directory).

A value is written whole to a temporary file in the same directory
(``.<h>.page.<pid>.<random>.tmp``) and renamed over the old one (``os.replace``), so a reader
sees the old value, the new one, or nothing, never a partial file, even when the writer is
killed mid-write or another process writes the same key. Temporary files never have a value's
name, so a left-over one is never read; the budget's scans remove those older than
``STALE_TEMP_S`` (a writer owns one only while it writes).

Values are framed by ``block_codec`` and verified on every read. There is no fsync: a store is
a cache, and a value torn by a power loss fails its checksum and reads as a miss.

The directory holds at most about ``max_bytes`` of values (default ``DEFAULT_MAX_BYTES``, 64 GiB):
past it a pass on a thread of its own removes the least recently used values
(``kvtier.connector.fs_budget``; ``wait_for_budget`` waits for it). A value's last use is its
file's modification time: set by the write, refreshed by every read and every ``contains_many``
hit. Removal is an ``unlink``, so a reader in another process that has the file open still reads
the whole value and a later one misses: never a torn value. A file system that fills before the
budget does (writes fail with ``ENOSPC`` or ``EDQUOT``) also has its least recently used values
removed, to make room for the writes that failed, which are tried once more (the write waits for
that pass while it makes progress); a value that could not fit even in an emptied store removes
nothing and is not stored.

Everything the store creates is private to the user: directories 0700, files 0600, set exactly
whatever the umask (a directory that already exists is left as it is).

I/O errors (a read-only or full disk, a file-size limit, a path that cannot exist) and damaged
values are reported as failures and misses, never raised, and logged at WARNING: the first of
each kind at once, then at most one line per ``warn_interval_s`` (``kvtier.storage.log_limit``).

I/O that hangs (a hard-mounted network file system whose server died) is bounded: the file I/O
of every call runs on the store's threads (reads, writes and existence checks on pools of their
own, so a check never queues behind large reads), and a call with a read, write, check or
delete (64 files a chunk) running ``timeout_s`` without progress (a large value is read and
written ``IO_CHUNK`` at a time, each part progress), or queued while its pool finished nothing
for ``timeout_s``, answers misses (failures, for puts). Its pool's threads are left to
the hung I/O (``DaemonPool.abandon``; past ``MAX_HUNG_THREADS`` of a pool still alive, no call
of that pool tries), and the store backs off (``store_health``): for ``retry_after_s`` calls answer at once,
without touching the file system. ``close`` waits for a hung thread ``2 * timeout_s`` at most.
Making the directory at construction is bounded the same way: a store built over a mount that
hangs already returns after ``timeout_s``, backed off.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeVar

from kvtier.connector.block_codec import HEADER_BYTES, Buffer, decode_page, encode_page
from kvtier.connector.daemon_pool import DaemonPool, note_progress
from kvtier.connector.fs_budget import EVICT_TO, TEMP_SUFFIX, VALUE_SUFFIX, StoreBudget
from kvtier.connector.store import check_keys, check_sizes
from kvtier.connector.store_health import ServerHealth
from kvtier.storage.disk_dir import check_disk_path
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.storage.page_files import default_io_threads

log = logging.getLogger(__name__)

CREATE_TRIES = 8  # a write makes its fan-out directories again this often when an eviction removes them
IO_THREADS = default_io_threads()  # the disk tier's default: file I/O and checksums overlap on a few threads
DEFAULT_MAX_BYTES: Final = 64 << 30
WARN_INTERVAL_S: Final = 60.0
IO_TIMEOUT_S: Final = 2.0  # a file's I/O without progress this long (after the one before it): the file system hangs
IO_CHUNK: Final = 8 << 20  # a large value is read and written in parts of this many bytes, each one progress
RETRY_AFTER_S: Final = 30.0  # then calls answer misses this long (a dead mount stays dead for minutes)
CHECK_CHUNK: Final = 64  # keys a thread checks (``contains_many``) or deletes in one go
MAX_HUNG_THREADS: Final = 16  # threads of a pool left in hung I/O: past this many, its calls answer misses untried
PRIVATE_DIR: Final = 0o700
PRIVATE_FILE: Final = 0o600
NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})  # a full file system or quota: eviction makes room
T = TypeVar("T")


@dataclass(slots=True)
class _Read:
    """What reading one key found: a payload, a damaged value, an I/O error, or (all unset) no file."""

    payload: bytes | None = None
    damaged: bool = False
    error: OSError | None = None


class FileSystemStore:
    """Pages as files under ``path`` (a local or shared file system), at most about ``max_bytes``; a ``BlockStore``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        io_threads: int = IO_THREADS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        warn_interval_s: float = WARN_INTERVAL_S,
        timeout_s: float = IO_TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise TypeError(f"FileSystemStore needs a non-empty path, got {path!r}")
        if "\0" in os.fsdecode(path):
            raise ValueError(f"the FileSystemStore path holds a NUL byte, which no file name may: {path!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads <= 0:
            raise ValueError(f"io_threads must be a positive int, got {io_threads!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        interval = warn_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 <= interval < math.inf:
            raise ValueError(f"warn_interval_s must be a finite number >= 0, got {warn_interval_s!r}")
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.root = Path(path).expanduser()  # ``~/kv``: the user's home, not a directory named ``~``
        kinds = ("read", "verify", "write", "delete")  # each: the first logged at once, then a summary per interval
        self._failures = {kind: RateLimitedWarning(log, f"fs store {self.root}", interval) for kind in kinds}
        self.max_bytes = max_bytes
        self.timeout_s = float(timeout_s)
        self._health = ServerHealth(str(self.root), log, float(retry_after_s), interval, kind="fs store")
        # daemon threads: the interpreter's exit never waits for a read hung on a dead network mount;
        # reads and writes apart: a save never queues behind such a read
        self._reads = DaemonPool(io_threads, "kvtier-fs-store-read")
        self._writes = DaemonPool(io_threads, "kvtier-fs-store-write")
        self._checks = DaemonPool(io_threads, "kvtier-fs-store-check")  # never queued behind large reads
        self._closed = False
        try:  # (a mount that hangs already: the store starts backed off, as after a hung call)
            self._io("create", self._writes, _make_root, [self.root])
        except OSError as exc:
            log.warning("kvtier fs store: cannot create %s (%s); every put will fail", self.root, exc)
        self._budget = StoreBudget(self.root, max_bytes, self.timeout_s)

    def path_of(self, key: str) -> Path:
        """The file that holds the value of ``key``."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.root / digest[:2] / digest[2:4] / (digest + VALUE_SUFFIX)

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None: missing, unreadable, damaged, or of the wrong size."""
        keys = check_keys(keys)
        sizes = check_sizes(expected_sizes, len(keys))
        self._check_open()
        reads = self._io("read", self._reads, self._get_one, keys, sizes)
        if reads is None:
            return [None] * len(keys)
        errors = [r.error for r in reads if r.error is not None]
        damaged = sum(r.damaged for r in reads)
        if errors:
            self._failures["read"](f"{len(errors)} of {len(keys)} reads failed: {errors[0]}")
        if damaged:
            self._failures["verify"](f"{damaged} of {len(keys)} values failed verification")
        return [r.payload for r in reads]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key, atomically; per item True if it was stored.

        A value larger than ``EVICT_TO`` of the budget (``StoreBudget.value_limit``: no pass would
        leave it in place) is not stored, and refused before it is framed. Past the budget, the
        least recently used values are evicted in the background; when the file system is full,
        this waits for the eviction (while it makes progress) and tries the failed writes once more.
        """
        items = list(items)
        keys = check_keys([key for key, _ in items])
        limit = self._budget.value_limit
        errors: list[OSError | None] = [None] * len(items)
        blobs: dict[int, bytes] = {}
        for i, (key, (_, data)) in enumerate(zip(keys, items, strict=True)):
            size = HEADER_BYTES + _payload_bytes(data)
            if size > limit:
                errors[i] = OSError(
                    errno.EFBIG,
                    f"a value of {size} bytes is larger than {EVICT_TO:.0%} of the budget ({limit} bytes): "
                    "a pass would evict it, and the others with it",
                )
            else:
                blobs[i] = encode_page(data, key)
        for i, err in zip(blobs, self._write_all([keys[i] for i in blobs], list(blobs.values())), strict=True):
            errors[i] = err
        failed = [err for err in errors if err is not None]
        if failed:
            self._failures["write"](f"{len(failed)} of {len(keys)} writes failed: {failed[0]}")
        self._budget.add(sum(len(blob) for i, blob in blobs.items() if errors[i] is None))
        return [err is None for err in errors]

    def _write_all(self, keys: list[str], blobs: list[bytes]) -> list[OSError | None]:
        """Write every blob under its key; per key the error, if any.

        The writes that found the file system (or quota) full are tried once more when an eviction
        pass could make room for them (``StoreBudget.make_room``); an error left is the one of that
        second try, or the first.
        """
        self._check_open()
        hung = OSError(errno.ETIMEDOUT, "the file system hangs (or has hung lately): not written")
        errors = self._io("write", self._writes, self._put_one, keys, blobs)
        if errors is None:
            return [hung] * len(keys)
        full = [i for i, err in enumerate(errors) if err is not None and err.errno in NO_SPACE]
        if full:
            quota_spent = errno.EDQUOT in {err.errno for err in errors if err is not None}
            retry = [full[j] for j in self._budget.make_room([len(blobs[i]) for i in full], quota_spent)]
            retried = self._io(
                "write", self._writes, self._put_one, [keys[i] for i in retry], [blobs[i] for i in retry]
            )
            for i, err in zip(retry, retried or [hung] * len(retry), strict=True):
                errors[i] = err
        return errors

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether its file exists (not verified); a hit counts as a use, like a read."""
        self._check_open()
        paths = [self.path_of(key) for key in check_keys(keys)]
        chunks = [paths[i : i + CHECK_CHUNK] for i in range(0, len(paths), CHECK_CHUNK)]
        found = self._io("check", self._checks, _touch_all, chunks)
        return [False] * len(paths) if found is None else [hit for chunk in found for hit in chunk]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the files of ``keys``; missing files are fine, other failures are logged."""
        self._check_open()
        paths = [self.path_of(key) for key in check_keys(keys)]
        chunks = [paths[i : i + CHECK_CHUNK] for i in range(0, len(paths), CHECK_CHUNK)]
        failed = [exc for chunk in self._io("delete", self._writes, _unlink_all, chunks) or [] for exc in chunk]
        if failed:
            self._failures["delete"](f"{len(failed)} deletes failed: {failed[0]}")

    def wait_for_budget(self, timeout_s: float | None = None) -> bool:
        """Wait until the budget's eviction passes started so far have ended (the directory is then
        within the budget, as far as this process knows); False after ``timeout_s`` (None: no limit)."""
        return self._budget.wait(timeout_s)

    def close(self) -> None:
        """Stop the I/O threads (an eviction pass between two files). Idempotent."""
        for failures in self._failures.values():
            failures.flush()
        if not self._closed:
            self._closed = True
            # the calls queued run first (a put_many running meanwhile ends whole); a thread in hung
            # I/O is left to it after a while, as its caller gives up on it
            deadline = time.monotonic() + 2 * self.timeout_s
            for pool in (self._reads, self._writes, self._checks):
                pool.shutdown(wait=True, timeout=max(0.0, deadline - time.monotonic()))
            self._budget.close(timeout_s=max(0.0, deadline - time.monotonic()))

    def _io(self, op: str, pool: DaemonPool, fn: Callable[..., T], *iterables: Iterable[Any]) -> list[T] | None:
        """``[fn(*args) for args in zip(*iterables)]`` on ``pool``'s threads, or None when the file
        system is taken as hung: backed off now, too many threads still in hung I/O, or a call of
        these that made no progress for ``timeout_s`` (running that long, or queued while the pool
        finished nothing): the pool's threads are then left to the hung I/O, the store backs off,
        and a WARNING says so. None too when another caller's giving up cancelled these calls."""
        if not self._health.available():
            return None
        hung = pool.hung_threads()
        if hung >= MAX_HUNG_THREADS:  # (each retry on a dead mount would leave more)
            self._health.failed(op, TimeoutError(f"{hung} of its threads are still in I/O that hangs"), True)
            return None
        submitted = time.monotonic()
        try:
            futures = [pool.submit(fn, *args) for args in zip(*iterables, strict=True)]
        except RuntimeError as exc:  # closed meanwhile (the call fails as on a closed store), or no thread started
            self._check_open()
            self._health.failed(op, exc, server_down=True)
            return None
        for future in futures:  # in the order they run
            while True:
                active = getattr(future, "active_at", None)  # its start or its last progress
                since = active if active is not None else max(pool.last_finished(), submitted)
                idle = time.monotonic() - since  # no progress for so long
                if idle >= self.timeout_s and not future.done():
                    pool.abandon(future.generation)
                    stalled = TimeoutError(
                        f"a file's I/O made no progress for {self.timeout_s:g} s: the file system hangs"
                    )
                    self._health.failed(op, stalled, server_down=True)
                    return None
                try:
                    future.exception(timeout=self.timeout_s - idle)
                    break
                except CancelledError:
                    return None
                except FutureTimeout:
                    continue
        self._health.answered()
        return [future.result() for future in futures]

    def _check_open(self) -> None:
        """``ValueError`` once the store is closed."""
        if self._closed:
            raise ValueError(f"the FileSystemStore at {self.root} is closed")

    def _get_one(self, key: str, size: int | None) -> _Read:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                # One byte past the expected length is enough to see that a value is too long.
                blob = _read_in_parts(f, None if size is None else HEADER_BYTES + size + 1)
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return _Read()
        except OSError as exc:
            return _Read(error=exc)
        payload = decode_page(blob, size, key)
        if payload is None:
            if _damaged(path, inode, key):
                _remove(path, inode)
            return _Read(damaged=True)
        _touch(path)
        return _Read(payload=bytes(payload))

    def _put_one(self, key: str, blob: bytes) -> OSError | None:
        """Write ``blob`` to a temporary file next to the value and rename it over; the error, if any."""
        final = self.path_of(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = _create(tmp)
        except OSError as exc:
            return exc
        try:
            with open(fd, "wb") as f:
                view = memoryview(blob)
                for start in range(0, len(view), IO_CHUNK):
                    f.write(view[start : start + IO_CHUNK])
                    note_progress()
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a temporary file is never read as a value, even if it stays
                tmp.unlink()
            return exc
        return None


def _read_in_parts(f: BinaryIO, limit: int | None) -> bytes:
    """Up to ``limit`` bytes of ``f`` (None: to its end), ``IO_CHUNK`` at a time, each part reported
    as progress (a long read of a large value on a slow file system is no hang)."""
    parts = []
    left = math.inf if limit is None else limit
    while left > 0:
        want = int(min(IO_CHUNK, left))
        part = f.read(want)
        parts.append(part)
        note_progress()
        left -= len(part)
        if len(part) < want:  # the end of the file (a buffered read returns less only there)
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _payload_bytes(data: Buffer) -> int:
    """The bytes of a payload, without copying it (0 for an object that is no buffer: framing it
    raises the error that says so)."""
    try:
        return memoryview(data).nbytes
    except TypeError:
        return 0


def _touch_all(paths: list[Path]) -> list[bool]:
    return [_touch(path) for path in paths]


def _unlink_all(paths: list[Path]) -> list[OSError]:
    """Remove these files; the errors (a missing file is none)."""
    failed = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append(exc)
    return failed


def _touch(path: Path) -> bool:
    """Mark a value used now; whether it exists."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except OSError:  # not ours to touch (another user's file, a read-only file system): existence only
        return path.is_file()
    return True


def _create(tmp: Path) -> int:
    """A new private file at ``tmp`` (its fan-out directories made if missing, again if an eviction
    pass removed them as they emptied meanwhile), open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    for attempt in range(CREATE_TRIES):
        try:
            fd = os.open(tmp, flags, PRIVATE_FILE)
            break
        except FileNotFoundError:
            if attempt == CREATE_TRIES - 1:
                raise
        with contextlib.suppress(FileNotFoundError):  # a level removed while the next is made: made again
            _make_private_dirs(tmp.parent)
    with contextlib.suppress(OSError):  # the mode asked for is already no wider; make it exact
        os.fchmod(fd, PRIVATE_FILE)
    return fd


def _make_root(root: Path) -> None:
    """``check_disk_path`` (``ValueError`` for a path under a regular file), then the directory made."""
    check_disk_path(root, "the FileSystemStore path")
    _make_private_dirs(root)


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents as 0700 directories; ``OSError`` if it cannot be a directory."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR)
        except FileExistsError:
            continue  # made by another process meanwhile
        with contextlib.suppress(OSError):
            os.chmod(directory, PRIVATE_DIR)  # exactly, whatever the umask
    target = missing[0] if missing else path
    try:
        mode = os.stat(target).st_mode  # (one look: checked twice, a removal between was "not a directory")
    except FileNotFoundError:  # removed meanwhile (an eviction pass empties fan-out directories): made again
        raise FileNotFoundError(errno.ENOENT, "removed while it was made", str(target)) from None
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(target))


def _damaged(path: Path, inode: int, key: str) -> bool:
    """Whether the value of ``key`` read from ``path`` fails verification whole (not just the size
    one caller expected)."""
    try:
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_ino == inode and decode_page(f.read(), None, key) is None
    except OSError:
        return False


def _remove(path: Path, inode: int) -> None:
    """Remove a damaged value, so the next put of its key writes it again (it would otherwise count as
    present, and be kept as recently used, for good); not a value a writer renamed over it since it
    was read. Best effort: a failure leaves it, still a miss."""
    try:
        if os.stat(path).st_ino == inode:
            path.unlink()
    except OSError:
        pass
