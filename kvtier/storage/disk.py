"""The disk tier's storage: one preallocated page file per layer group, slot-addressed.

Slot ``i`` of group ``g`` is bytes ``[i * page_bytes[g], (i + 1) * page_bytes[g])`` of
``group<g>.pages`` in the tier's directory. Files are sized at start (sparse), read and written
with positional I/O (``os.pwrite`` / ``os.preadv``) from a small thread pool, and every page
carries a checksum (8-byte blake2b) that is verified on every read. A failed or short write or
read, or a checksum mismatch, is reported per page and never raises: the caller treats the page
as missing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.storage.slots import SlotAllocator

log = logging.getLogger(__name__)

# Positional I/O and checksumming both release the GIL, so a few threads overlap them.
IO_THREADS = min(8, max(2, os.cpu_count() or 2))


def page_checksum(data: np.ndarray) -> int:
    """The checksum stored with a page: 64 bits of blake2b over its bytes, as a signed int (SQLite's INTEGER).

    hashlib releases the GIL while hashing, so the I/O threads checksum in parallel.
    """
    return int.from_bytes(hashlib.blake2b(memoryview(data), digest_size=8).digest(), "little", signed=True)


class DiskStorage:
    """Page files and slot allocators of one disk tier, under ``directory``."""

    def __init__(self, directory: Path, page_bytes: Sequence[int], num_slots: Sequence[int]) -> None:
        self.directory = directory
        self.page_bytes = tuple(page_bytes)
        self.slots = tuple(SlotAllocator(n) for n in num_slots)
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="kvtier-disk")
        self._fds: list[int | None] = []
        for g, (pb, n) in enumerate(zip(self.page_bytes, num_slots, strict=True)):
            self._fds.append(_open_page_file(directory, g, pb * n))

    def write(self, group: int, slots: Sequence[int], pages: Sequence[np.ndarray]) -> list[int | None]:
        """Write whole pages to slots; per page its checksum, or None if the write failed."""
        fd, pb = self._fds[group], self.page_bytes[group]
        if fd is None:
            return [None] * len(slots)

        def one(slot: int, data: np.ndarray) -> int | None:
            try:
                checksum = page_checksum(data)
                written = os.pwrite(fd, memoryview(data), slot * pb)
            except OSError as exc:
                log.warning("kvtier disk tier: write of group %d slot %d failed: %s", group, slot, exc)
                return None
            if written != pb:
                log.warning(
                    "kvtier disk tier: short write of group %d slot %d (%d of %d bytes)", group, slot, written, pb
                )
                return None
            return checksum

        return _run(self._pool, one, slots, pages)

    def read(
        self, group: int, slots: Sequence[int], into: Sequence[np.ndarray], checksums: Sequence[int]
    ) -> list[bool]:
        """Read whole pages from slots into ``into``; per page True if it read fully and its checksum matches."""
        fd, pb = self._fds[group], self.page_bytes[group]
        if fd is None:
            return [False] * len(slots)

        def one(slot: int, out: np.ndarray, checksum: int) -> bool:
            try:
                got = os.preadv(fd, [memoryview(out)], slot * pb)
            except OSError as exc:
                log.warning("kvtier disk tier: read of group %d slot %d failed: %s", group, slot, exc)
                return False
            if got != pb:
                return False
            return page_checksum(out) == checksum

        return _run(self._pool, one, slots, into, checksums)

    def close(self) -> None:
        """Close the files and stop the I/O threads. Idempotent."""
        self._pool.shutdown(wait=True)
        for fd in self._fds:
            if fd is not None:
                os.close(fd)
        self._fds = []


def _run(pool: ThreadPoolExecutor, fn, *iterables) -> list:
    """``fn`` over the arguments on the I/O threads; on the calling thread once the interpreter is exiting.

    At exit (``atexit``, where a manager never closed is closed) a pool takes no new work.
    """
    try:
        futures = [pool.submit(fn, *args) for args in zip(*iterables, strict=True)]
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return [fn(*args) for args in zip(*iterables, strict=True)]
    return [future.result() for future in futures]


def _open_page_file(directory: Path, group: int, size: int) -> int | None:
    """The page file of a group, sized (sparse) to ``size``; None, logged, if it cannot be had."""
    path = directory / f"group{group}.pages"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.warning("kvtier disk tier: cannot open %s (%s); the disk tier will store nothing", path, exc)
        return None
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    except OSError as exc:  # a full or size-limited file system: writes past the end will fail
        log.warning("kvtier disk tier: cannot size %s to %d bytes (%s)", path, size, exc)
    return fd
