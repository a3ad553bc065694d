"""``kvtier probe --disk PATH``: the read ceiling of the disk under PATH, and the page checksum's speed.

A temporary file (``--disk-mib``, 256-4096 MiB) of pages is written under PATH, synced, dropped
from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, a hint: a file system may keep
it), and read back with positional reads (``os.preadv``, as the disk tier reads) from 1, 4 and 8
threads; then the disk tier's page checksum runs over 128 MiB of pages in memory from the same threads. The
disk tier reads at about the smaller of the two. The file is removed in every case.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.storage.page_files import page_checksum

PROBE_THREADS = (1, 4, 8)
PAGE_BYTES = 4 << 20
MIN_MIB, MAX_MIB = 256, 4096
CHECKSUM_PAGES = 32  # 128 MiB of pages in memory: more than a CPU's caches hold


def probe_disk(directory: str, mib: int) -> list[tuple[str, str]]:
    """(name, value) rows: write speed, cold read GB/s per thread count, checksum GB/s per thread count.

    ``ValueError`` for a size outside [256, 4096] MiB or a PATH that is not a directory.
    """
    if not MIN_MIB <= mib <= MAX_MIB:
        raise ValueError(f"--disk-mib must be within [{MIN_MIB}, {MAX_MIB}], got {mib}")
    if not os.path.isdir(directory):
        raise ValueError(f"--disk {directory!r} is not a directory")
    pages = mib * (1 << 20) // PAGE_BYTES
    data = np.random.default_rng().integers(1, 256, PAGE_BYTES, dtype=np.uint8)
    local = threading.local()  # one read buffer per thread
    rows = []
    in_memory = np.resize(data, (CHECKSUM_PAGES, PAGE_BYTES))
    fd, path = tempfile.mkstemp(prefix="kvtier-disk-probe-", dir=directory)
    try:
        start = time.perf_counter()
        for i in range(pages):
            os.pwrite(fd, memoryview(data), i * PAGE_BYTES)
        os.fsync(fd)
        rows.append(
            ("disk write", f"{_gbps(pages, time.perf_counter() - start)} ({mib} MiB, {PAGE_BYTES >> 20} MiB pages)")
        )
        for threads in PROBE_THREADS:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def read(i: int) -> int:
                if not hasattr(local, "page"):
                    local.page = np.empty(PAGE_BYTES, dtype=np.uint8)
                return os.preadv(fd, [memoryview(local.page)], i * PAGE_BYTES)

            seconds = _timed(threads, read, pages)
            rows.append((f"disk read, {threads} thread{'s' if threads > 1 else ''}", f"{_gbps(pages, seconds)} (cold)"))
    finally:
        os.close(fd)
        os.remove(path)
    for threads in PROBE_THREADS:
        seconds = _timed(threads, lambda i: page_checksum(in_memory[i % CHECKSUM_PAGES]), pages)
        rows.append((f"page checksum, {threads} thread{'s' if threads > 1 else ''}", _gbps(pages, seconds)))
    return rows


def _timed(threads: int, fn: Callable[[int], object], count: int) -> float:
    """Seconds to run ``fn(i)`` for i in range(count) on ``threads`` threads (each i on one thread)."""
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(fn, range(count)))
        return time.perf_counter() - start


def _gbps(pages: int, seconds: float) -> str:
    return f"{pages * PAGE_BYTES / seconds / 1e9:.2f} GB/s"
