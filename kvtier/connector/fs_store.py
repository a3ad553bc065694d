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
past it the least recently used values are removed (``_Budget``). A value's last use is its
file's modification time: set by the write, refreshed by every read and every ``contains_many``
hit. Removal is an ``unlink``, so a reader in another process that has the file open still reads
the whole value and a later one misses: never a torn value. A file system that fills before the
budget does (writes fail with ``ENOSPC`` or ``EDQUOT``) also has its least recently used values
removed, to make room for the writes that failed, which are tried once more; a value that could
not fit even in an emptied store removes nothing and is not stored.

Everything the store creates is private to the user: directories 0700, files 0600, set exactly
whatever the umask (a directory that already exists is left as it is).

I/O errors (a read-only or full disk, a file-size limit, a path that cannot exist) and damaged
values are reported as failures and misses, never raised, and logged at WARNING: the first of
each kind at once, then at most one line per ``warn_interval_s`` (``kvtier.storage.log_limit``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvtier.connector.block_codec import HEADER_BYTES, Buffer, decode_page, encode_page
from kvtier.connector.store import check_keys, check_sizes
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.storage.page_files import default_io_threads

log = logging.getLogger(__name__)

IO_THREADS = default_io_threads()  # the disk tier's default: file I/O and checksums overlap on a few threads
VALUE_SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"
DEFAULT_MAX_BYTES: Final = 64 << 30
WARN_INTERVAL_S: Final = 60.0
EVICT_TO: Final = 0.9  # an eviction pass leaves at most this share of the budget
STALE_TEMP_S: Final = 600.0  # a temporary file this old was left by a killed writer
PRIVATE_DIR: Final = 0o700
PRIVATE_FILE: Final = 0o600
NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})  # a full file system or quota: eviction makes room
_HEX: Final = frozenset("0123456789abcdef")


@dataclass(slots=True)
class _Read:
    """What reading one key found: a payload, a damaged value, an I/O error, or (all unset) no file."""

    payload: bytes | None = None
    damaged: bool = False
    error: OSError | None = None


@dataclass(slots=True)
class _Value:
    """A value file found by a scan: its size and last use (modification time) then."""

    path: str
    size: int
    mtime_ns: int


class FileSystemStore:
    """Pages as files under ``path`` (a local or shared file system), at most about ``max_bytes``; a ``BlockStore``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        io_threads: int = IO_THREADS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        warn_interval_s: float = WARN_INTERVAL_S,
    ) -> None:
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise TypeError(f"FileSystemStore needs a non-empty path, got {path!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads <= 0:
            raise ValueError(f"io_threads must be a positive int, got {io_threads!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        interval = warn_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 <= interval < math.inf:
            raise ValueError(f"warn_interval_s must be a finite number >= 0, got {warn_interval_s!r}")
        self.root = Path(path).expanduser()  # ``~/kv``: the user's home, not a directory named ``~``
        kinds = ("read", "verify", "write", "delete")  # each: the first logged at once, then a summary per interval
        self._failures = {kind: RateLimitedWarning(log, f"fs store {self.root}", interval) for kind in kinds}
        self.max_bytes = max_bytes
        try:
            _make_private_dirs(self.root)
        except OSError as exc:
            log.warning("kvtier fs store: cannot create %s (%s); every put will fail", self.root, exc)
        self._budget = _Budget(self.root, max_bytes)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-fs-store")

    def path_of(self, key: str) -> Path:
        """The file that holds the value of ``key``."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.root / digest[:2] / digest[2:4] / (digest + VALUE_SUFFIX)

    def get_many(self, keys: Sequence[str], expected_sizes: Sequence[int] | None = None) -> list[bytes | None]:
        """Per key its verified payload, or None: missing, unreadable, damaged, or of the wrong size."""
        keys = check_keys(keys)
        sizes = check_sizes(expected_sizes, len(keys))
        reads = list(self._open_pool().map(self._get_one, keys, sizes))
        errors = [r.error for r in reads if r.error is not None]
        damaged = sum(r.damaged for r in reads)
        if errors:
            self._failures["read"](f"{len(errors)} of {len(keys)} reads failed: {errors[0]}")
        if damaged:
            self._failures["verify"](f"{damaged} of {len(keys)} values failed verification")
        return [r.payload for r in reads]

    def put_many(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each payload under its key, atomically; per item True if it was stored.

        A value larger than the whole budget is not stored. Past the budget, or when the file system
        is full, the least recently used values are evicted before this returns (on the calling thread).
        """
        items = list(items)
        keys = check_keys([key for key, _ in items])
        blobs = [encode_page(data, key) for key, (_, data) in zip(keys, items, strict=True)]
        errors = self._write_all(keys, blobs)
        failed = [err for err in errors if err is not None]
        if failed:
            self._failures["write"](f"{len(failed)} of {len(keys)} writes failed: {failed[0]}")
        self._budget.add(sum(len(blob) for blob, err in zip(blobs, errors, strict=True) if err is None))
        return [err is None for err in errors]

    def _write_all(self, keys: list[str], blobs: list[bytes]) -> list[OSError | None]:
        """Write every blob under its key; per key the error, if any.

        The writes that found the file system full are tried once more, after an eviction pass made
        room for them; an error left is the one of that second try.
        """
        pool = self._open_pool()
        errors = list(pool.map(self._put_one, keys, blobs))
        full = [i for i, err in enumerate(errors) if err is not None and err.errno in NO_SPACE]
        if full:
            full = [full[j] for j in self._budget.make_room([len(blobs[i]) for i in full])]
            retried = pool.map(self._put_one, [keys[i] for i in full], [blobs[i] for i in full])
            for i, err in zip(full, retried, strict=True):
                errors[i] = err
        return errors

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Per key whether its file exists (not verified); a hit counts as a use, like a read."""
        self._open_pool()
        return [_touch(self.path_of(key)) for key in check_keys(keys)]

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove the files of ``keys``; missing files are fine, other failures are logged."""
        self._open_pool()
        failed: list[OSError] = []
        for key in check_keys(keys):
            try:
                self.path_of(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(exc)
        if failed:
            self._failures["delete"](f"{len(failed)} deletes failed: {failed[0]}")

    def close(self) -> None:
        """Stop the I/O threads. Idempotent."""
        for failures in self._failures.values():
            failures.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _open_pool(self) -> ThreadPoolExecutor:
        """The I/O threads; ``ValueError`` once the store is closed."""
        if self._pool is None:
            raise ValueError(f"the FileSystemStore at {self.root} is closed")
        return self._pool

    def _get_one(self, key: str, size: int | None) -> _Read:
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                # One byte past the expected length is enough to see that a value is too long.
                blob = f.read() if size is None else f.read(HEADER_BYTES + size + 1)
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
        if len(blob) > self.max_bytes:
            return OSError(errno.EFBIG, f"a value of {len(blob)} bytes is larger than the budget of {self.max_bytes}")
        final = self.path_of(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            fd = _create(tmp)
        except OSError as exc:
            return exc
        try:
            with open(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a temporary file is never read as a value, even if it stays
                tmp.unlink()
            return exc
        return None


class _Budget:
    """Keeps a store's directory under ``max_bytes``, and within a full file system, by evicting the
    least recently used values.

    Each process keeps an estimate of the directory's bytes: its last scan (at its first write,
    then at each pass), less what that pass removed, plus what it wrote since. When the estimate
    passes ``max_bytes`` it scans the directory again, so every process's files count, and removes
    the values used longest ago until at most ``EVICT_TO`` of the budget is left; a value used
    again since the scan (its time changed) is kept. Between passes each writing process adds at
    most about ``(1 - EVICT_TO) * max_bytes`` unseen by the others, so P processes writing at once
    may overshoot by about P times that.

    A file system smaller than ``max_bytes`` (or a quota) fills before the estimate passes it:
    writes then fail for want of space, and ``make_room`` runs a pass sized by the bytes the scan
    finds and the writes that failed instead. Passes of several processes may overlap: each only
    removes files, and one already gone is fine.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._used: int | None = None  # None until the first write scans the directory

    def add(self, written: int) -> None:
        """Count ``written`` new bytes; evict when the directory is estimated past the budget."""
        if not written:
            return
        with self._lock:
            if self._used is None:
                self._used = sum(v.size for v in self.scan())  # what was just written included
            else:
                self._used += written
            if self._used > self.max_bytes:
                self._used = self.evict(self.scan(), int(self.max_bytes * EVICT_TO))

    def make_room(self, sizes: list[int]) -> list[int]:
        """After writes of ``sizes`` bytes each found the file system full: the indices of those that
        removing values can make room for (in order, while their sum fits in the values' bytes plus
        the space still free), and remove the least recently used values until at most ``EVICT_TO``
        of the value bytes there are left and at least that sum of them is gone. A write that could
        not fit even in an emptied store removes nothing for itself."""
        with self._lock:
            values = self.scan()
            present = sum(v.size for v in values)
            room = present + _free_bytes(self.root)
            fitting: list[int] = []
            needed = 0
            for i, size in enumerate(sizes):
                if needed + size <= room:
                    fitting.append(i)
                    needed += size
            if fitting:
                self._used = self.evict(values, max(0, min(int(present * EVICT_TO), present - needed)))
            return fitting

    def scan(self) -> list[_Value]:
        """Every value file under the root; temporary files older than ``STALE_TEMP_S`` are removed."""
        values = []
        stale_before = time.time_ns() - int(STALE_TEMP_S * 1e9)
        for leaf in self._leaf_dirs():
            for entry in _entries(leaf):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                name = entry.name
                if name.endswith(VALUE_SUFFIX) and not name.startswith("."):
                    values.append(_Value(entry.path, st.st_size, st.st_mtime_ns))
                elif name.endswith(TEMP_SUFFIX) and st.st_mtime_ns < stale_before:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return values

    def evict(self, values: list[_Value], target: int) -> int:
        """Remove the least recently used of ``values`` (a scan) until at most ``target`` bytes of them
        remain; the bytes left."""
        left = sum(v.size for v in values)
        values.sort(key=lambda v: v.mtime_ns)
        failed: list[OSError] = []
        removed = 0
        for value in values:
            if left <= target:
                break
            try:
                if os.stat(value.path).st_mtime_ns != value.mtime_ns:
                    continue  # read or rewritten since the scan: recently used after all
                os.unlink(value.path)
                removed += 1
            except FileNotFoundError:
                pass  # evicted by another process
            except OSError as exc:
                failed.append(exc)
                continue
            left -= value.size
        if failed:
            log.warning("kvtier fs store: %d evictions under %s failed: %s", len(failed), self.root, failed[0])
        log.debug("kvtier fs store: evicted %d values under %s; %d bytes left", removed, self.root, left)
        return left

    def _leaf_dirs(self) -> Iterator[str]:
        """The fan-out directories ``<root>/<xx>/<yy>`` (other entries under the root are not the store's)."""
        for top in _entries(self.root):
            if _is_fan_out(top):
                yield from (leaf.path for leaf in _entries(top.path) if _is_fan_out(leaf))


def _entries(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_fan_out(entry: os.DirEntry) -> bool:
    name = entry.name
    return len(name) == 2 and name[0] in _HEX and name[1] in _HEX and entry.is_dir(follow_symlinks=False)


def _free_bytes(root: Path) -> float:
    """Bytes a writer may still add to the file system under ``root``; infinite when it cannot be
    told (a quota may allow less: ``make_room`` then removes values that do not suffice)."""
    try:
        st = os.statvfs(root)
    except (OSError, AttributeError):  # no such directory any more; no statvfs on this platform
        return math.inf
    return st.f_bavail * st.f_frsize


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
    """A new private file at ``tmp`` (its fan-out directories made if missing), open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(tmp, flags, PRIVATE_FILE)
    except FileNotFoundError:
        _make_private_dirs(tmp.parent)
        fd = os.open(tmp, flags, PRIVATE_FILE)
    with contextlib.suppress(OSError):  # the mode asked for is already no wider; make it exact
        os.fchmod(fd, PRIVATE_FILE)
    return fd


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
    if not target.is_dir():
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
