"""The disk tier's storage: one preallocated page file per layer group, slot-addressed.

Slot ``i`` of group ``g`` is bytes ``[i * page_bytes[g], (i + 1) * page_bytes[g])`` of
``group<g>.pages`` in the tier's directory (``kvtier.storage.disk_dir``). Files are created 0600,
sized at start (sparse), read and written with positional I/O (``os.pwrite`` / ``os.preadv``)
from a small thread pool, and every page carries a checksum (XXH3-64) that is verified on every
read. A failed or short write or read, or a checksum mismatch, is reported per page and
never raises: the caller treats the page as missing. Failures are logged as rate-limited
warnings (a full disk fails every write; it logs one line, then a summary a minute).

``KVTIER_DISK_IO_THREADS`` (1-64, read when a disk tier opens) sets the pool's threads; unset,
``default_io_threads()``. Disks differ: ``kvtier probe --disk PATH`` reads a disk tier there with
1, 4, 8 and the configured count and names the fastest. A value that is not an integer in range
logs a WARNING and the default is kept.

A read-only directory's files are opened read-only (``writable`` is False: nothing is written);
an unusable directory has no slots at all. The files are closed by ``close``, or when the storage
is collected (a manager dropped without ``close``).

``found`` keeps each page file's size as it was found, before it was sized: the restore
(``kvtier.tiering.disk_restore``) believes no index row whose slot those bytes do not hold (a
file deleted or truncated between runs; sizing it again would read back holes, never the pages).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final

import numpy as np
import xxhash

from kvtier import interrupts
from kvtier.knobs import parse_int64
from kvtier.storage.disk_dir import DiskDirectory, open_private
from kvtier.storage.log_limit import RateLimitedWarning
from kvtier.storage.slots import SlotAllocator

log = logging.getLogger(__name__)

DISK_IO_THREADS_ENV: Final = "KVTIER_DISK_IO_THREADS"
MAX_IO_THREADS: Final = 64


def default_io_threads() -> int:
    """Positional I/O and checksumming both release the GIL, so a few threads overlap them."""
    return min(8, max(2, os.cpu_count() or 2))


@functools.cache
def parse_io_threads(raw: str | None) -> int:
    """``KVTIER_DISK_IO_THREADS`` from its raw value: 1..64 threads; unset or bad (WARNING) -> the
    default. Cached per value, so a bad one is reported once, not at every disk tier opened."""
    default = default_io_threads()
    instead = f"keeping the default of {default} threads"
    value = parse_int64(DISK_IO_THREADS_ENV, raw, instead)
    if value is None:
        return default
    if not 1 <= value <= MAX_IO_THREADS:
        log.warning("%s=%r is out of range (1..%d); %s", DISK_IO_THREADS_ENV, raw, MAX_IO_THREADS, instead)
        return default
    return value


def page_checksum(data: np.ndarray) -> int:
    """The checksum stored with a page: XXH3-64 (seed 0) of its bytes, as a signed int (SQLite's INTEGER).

    It detects damage, not tampering (the files are private to their user). xxhash releases the
    GIL while hashing, so the I/O threads checksum in parallel. Changing the function changes
    what the index's checksums mean: bump ``disk_index.SCHEMA_VERSION`` with it.
    """
    value = xxhash.xxh3_64_intdigest(memoryview(data))
    return value - (1 << 64) if value >= 1 << 63 else value


class DiskStorage:
    """Page files and slot allocators of one disk tier, in a locked ``DiskDirectory``; ``io_threads``
    positional reads and writes run at once (the knob's value when the tier opened)."""

    def __init__(self, directory: DiskDirectory, page_bytes: Sequence[int], num_slots: Sequence[int]) -> None:
        self.directory = directory.path
        self.page_bytes = tuple(page_bytes)
        if not directory.readable:
            num_slots = [0] * len(self.page_bytes)  # nothing can be kept: report no disk pages at all
        self.slots = tuple(SlotAllocator(n) for n in num_slots)
        self.io_threads = parse_io_threads(os.environ.get(DISK_IO_THREADS_ENV))
        self._pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="kvtier-disk")
        self._fds: list[int | None] = []
        self._finalizer = weakref.finalize(self, _release, self._pool, self._fds)
        self._finalizer.atexit = False  # at exit a manager never closed may still persist through them
        found: list[FoundFile] = []
        for g, (pb, n) in enumerate(zip(self.page_bytes, self.slots, strict=True)):
            opener = _open_page_file if directory.writable else _open_page_file_read_only
            fd, was = opener(directory, g, pb * n.num_slots) if directory.readable else (None, FoundFile(g))
            self._fds.append(fd)
            found.append(was)
        self.found: tuple[FoundFile, ...] = tuple(found)
        self.writable = directory.writable and all(fd is not None for fd in self._fds)
        self._write_failures = RateLimitedWarning(log, "disk tier page write failed")
        self._read_failures = RateLimitedWarning(log, "disk tier page read failed")

    def write(self, group: int, slots: Sequence[int], pages: Sequence[np.ndarray]) -> list[int | None]:
        """Write whole pages to slots; per page its checksum, or None if the write failed."""
        fd, pb = self._fds[group], self.page_bytes[group]
        if fd is None or not self.writable:
            return [None] * len(slots)

        def one(slot: int, data: np.ndarray) -> int | str:
            try:
                checksum = page_checksum(data)
                written = os.pwrite(fd, memoryview(data), slot * pb)
            except Exception as exc:  # the disk's (OSError) or the host's (MemoryError): not written
                return f"group {group} slot {slot}: {type(exc).__name__}: {exc}"
            if written != pb:
                return f"group {group} slot {slot}: short write ({written} of {pb} bytes)"
            return checksum

        results = _run(self._pool, one, slots, pages)
        _log_failures(results, self._write_failures)
        return [None if isinstance(r, str) else r for r in results]

    def read(
        self, group: int, slots: Sequence[int], into: Sequence[np.ndarray], checksums: Sequence[int]
    ) -> list[bool]:
        """Read whole pages from slots into ``into``; per page True if it read fully and its checksum matches."""
        fd, pb = self._fds[group], self.page_bytes[group]
        if fd is None:
            return [False] * len(slots)

        def one(slot: int, out: np.ndarray, checksum: int) -> bool | str:
            try:
                got = os.preadv(fd, [memoryview(out)], slot * pb)
                return got == pb and page_checksum(out) == checksum
            except Exception as exc:  # the disk's (OSError) or the host's (MemoryError): not read
                return f"group {group} slot {slot}: {type(exc).__name__}: {exc}"

        results = _run(self._pool, one, slots, into, checksums)
        _log_failures(results, self._read_failures)
        return [r is True for r in results]

    def file_bytes(self, group: int) -> int:
        """The size of a group's page file now (0 when it is not open or cannot be looked at)."""
        fd = self._fds[group] if group < len(self._fds) else None
        if fd is None:
            return 0
        try:
            return os.fstat(fd).st_size
        except OSError:
            return 0

    def close(self) -> None:
        """Close the files and stop the I/O threads. Idempotent."""
        self._write_failures.flush()
        self._read_failures.flush()
        self._pool.shutdown(wait=True)
        self._finalizer()


def _release(pool: ThreadPoolExecutor, fds: list[int | None]) -> None:
    """Close the page files (also when the storage is collected without ``close``)."""
    pool.shutdown(wait=False)
    for fd in fds:
        if fd is not None:
            os.close(fd)
    fds.clear()


def _log_failures(results: list, failures: RateLimitedWarning) -> None:
    """Log (rate-limited, on the calling thread) the results that describe an I/O error."""
    for result in results:
        if isinstance(result, str):
            failures(result)


def _run(pool: ThreadPoolExecutor, fn, *iterables) -> list:
    """``fn`` over the arguments on the I/O threads; on the calling thread once the interpreter is exiting.

    At exit (``atexit``, where a manager never closed is closed) a pool takes no new work.
    """
    try:
        futures = [pool.submit(fn, *args) for args in zip(*iterables, strict=True)]
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return [fn(*args) for args in zip(*iterables, strict=True)]
    try:
        with interrupts.may_be_cut_short():  # a Ctrl-C need not wait for the whole read or write
            return [future.result() for future in futures]
    except BaseException:  # an interrupt: none is left writing into buffers the caller hands on
        for future in futures:
            future.cancel()
        wait(futures)
        raise


@dataclass(frozen=True, slots=True)
class FoundFile:
    """A group's page file as the tier found it when it opened: ``size`` its bytes then (before it
    was sized), 0 when ``missing``; None when it was not looked at (it could not be opened, or the
    directory cannot be read): nothing is known of its pages."""

    group: int
    name: str = ""
    size: int | None = None
    missing: bool = False

    def holds(self, slot: int, page_bytes: int) -> bool:
        """Whether the file held every byte of ``slot`` (True when nothing is known of it)."""
        return self.size is None or (slot + 1) * page_bytes <= self.size


def _open_page_file(directory: DiskDirectory, group: int, size: int) -> tuple[int | None, FoundFile]:
    """The page file of a group, private and sized (sparse) to ``size``, and what was found of it; no
    descriptor, logged, if it cannot be had."""
    path = directory.file(f"group{group}.pages")
    missing = False
    try:
        try:
            fd = open_private(path, os.O_RDWR)
        except FileNotFoundError:
            missing = True
            fd = open_private(path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        log.error("kvtier disk tier: cannot open %s (%s); the disk tier will store nothing", path, exc)
        return None, FoundFile(group, path.name)
    found = FoundFile(group, path.name, None, missing)
    try:
        found_size = 0 if missing else os.fstat(fd).st_size
        found = FoundFile(group, path.name, found_size, missing)
        if found_size != size:
            os.ftruncate(fd, size)
    except OSError as exc:  # a full or size-limited file system: writes past the end will fail
        log.warning("kvtier disk tier: cannot size %s to %d bytes (%s)", path, size, exc)
    return fd, found


def _open_page_file_read_only(directory: DiskDirectory, group: int, size: int) -> tuple[int | None, FoundFile]:
    """The page file of a read-only directory, for reading its pages, and what was found of it; no
    descriptor when there is none."""
    path = directory.file(f"group{group}.pages")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, FoundFile(group, path.name, 0, missing=True)
    except OSError:
        return None, FoundFile(group, path.name)
    try:
        return fd, FoundFile(group, path.name, os.fstat(fd).st_size)
    except OSError:
        return fd, FoundFile(group, path.name)
