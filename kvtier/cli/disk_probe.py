"""``kvtier probe --disk PATH``: the read ceiling of the disk under PATH, and the page checksum's speed.

A temporary file (``--disk-mib``, 256-4096 MiB) of pages is written under PATH, synced, dropped
from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, a hint: a file system may keep
it), and read back with positional reads (``os.preadv``, as the disk tier reads) from 1, 4 and 8
threads; then the disk tier's page checksum runs over 128 MiB of pages in memory from the same threads. The
disk tier reads at about the smaller of the two. The file is removed in every case.

Last, the disk tier itself: a manager on the CPU publishes as many 4 MiB pages and closes (they
are written to a disk tier under PATH), a second manager opens the same directory, the page
files are dropped from the page cache, and resuming the prefix reads, checks and places every
page; its rate and its share of the best raw read are printed. The tier reads with its
configured I/O threads (``KVTIER_DISK_IO_THREADS``) and with 1, 4 and 8 (a fresh pair of managers
each time); when another count read faster, the probe names the setting. The directory is
removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.storage.page_files import DISK_IO_THREADS_ENV, page_checksum, parse_io_threads

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
    rows: list[tuple[str, str]] = []
    raw_reads: dict[int, float] = {}  # threads -> bytes per second
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
            raw_reads[threads] = pages * PAGE_BYTES / seconds
            rows.append((f"disk read, {threads} thread{'s' if threads > 1 else ''}", f"{_gbps(pages, seconds)} (cold)"))
    finally:
        os.close(fd)
        os.remove(path)
    for threads in PROBE_THREADS:
        seconds = _timed(threads, lambda i: page_checksum(in_memory[i % CHECKSUM_PAGES]), pages)
        rows.append((f"page checksum, {threads} thread{'s' if threads > 1 else ''}", _gbps(pages, seconds)))
    best_read = max(raw_reads.values())
    configured = parse_io_threads(os.environ.get(DISK_IO_THREADS_ENV))
    tier_reads: dict[int, float] = {}  # threads -> seconds
    for threads in dict.fromkeys((configured, *PROBE_THREADS)):
        with _io_threads(threads):
            tier_reads[threads] = seconds = _tier_read_seconds(directory, pages)
        share = pages * PAGE_BYTES / seconds / best_read
        label = "disk tier read" if threads == configured else f"disk tier read, {DISK_IO_THREADS_ENV}={threads}"
        plural = "s" if threads > 1 else ""
        rows.append(
            (
                label,
                f"{_gbps(pages, seconds)} (cold, after a restart, {threads} I/O thread{plural}; "
                f"{share:.2f} of the best raw read)",
            )
        )
    fastest = min(tier_reads, key=tier_reads.__getitem__)
    if fastest != configured:
        rows.append(
            (
                "disk I/O threads",
                f"{configured} now; the tier read fastest with {fastest}: {DISK_IO_THREADS_ENV}={fastest}",
            )
        )
    return rows


@contextlib.contextmanager
def _io_threads(threads: int) -> Iterator[None]:
    """``KVTIER_DISK_IO_THREADS`` set to ``threads`` for the disk tiers opened meanwhile (then restored)."""
    before = os.environ.get(DISK_IO_THREADS_ENV)
    os.environ[DISK_IO_THREADS_ENV] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ[DISK_IO_THREADS_ENV]
        else:
            os.environ[DISK_IO_THREADS_ENV] = before


def _tier_read_seconds(directory: str, pages: int) -> float:
    """Seconds to resume a ``pages``-block prefix that only a disk tier under ``directory`` holds."""
    import torch

    import kvtier

    layers = 32
    spec = kvtier.ModelSpec.uniform(layers, 8, 128, torch.bfloat16, model_id="kvtier-disk-probe")  # 128 KiB a token
    tokens_per_block = PAGE_BYTES // (128 << 10)
    prompt = list(range(1, pages * tokens_per_block + 2))
    root = Path(tempfile.mkdtemp(prefix="kvtier-tier-probe-", dir=directory))

    def manager() -> kvtier.KVCacheManager:
        room = (pages + 1) * PAGE_BYTES  # the prefix and the block of its last token
        tiers = [kvtier.PrimaryTier(room), kvtier.DiskTier(room, root / "tier")]
        return kvtier.KVCacheManager(spec, kvtier.CacheConfig(tokens_per_block, tiers))

    try:
        with manager() as first:  # its pages are written to the disk tier when it closes
            cache = first.create_cache(prompt)
            if not (cache.resume() and cache.resize(len(prompt))):
                raise OSError("the probe's primary tier could not hold its prompt")
            for layer in range(layers):
                for view in first.kv_views(layer).values():
                    view.uniform_(0.5, 1.5)  # non-zero bytes in every page
            cache.commit(prompt)
            cache.close()
        page_files = list(root.rglob("*.pages"))
        if not page_files:
            raise OSError(f"the disk tier under {root} wrote no page file")
        for path in page_files:  # cold, as after a reboot
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        with manager() as second:
            for layer in range(layers):  # memory a serving process touched long ago: no page faults timed
                for view in second.kv_views(layer).values():
                    view.zero_()
            start = time.perf_counter()
            cache = second.create_cache(prompt)
            if not cache.resume() or cache.reused_by_tier["disk"] < pages * tokens_per_block:
                raise OSError(f"the disk tier gave back {cache.reused_by_tier['disk']} of {len(prompt) - 1} tokens")
            seconds = time.perf_counter() - start
            cache.close()
        return seconds
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _timed(threads: int, fn: Callable[[int], object], count: int) -> float:
    """Seconds to run ``fn(i)`` for i in range(count) on ``threads`` threads (each i on one thread)."""
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(fn, range(count)))
        return time.perf_counter() - start


def _gbps(pages: int, seconds: float) -> str:
    return f"{pages * PAGE_BYTES / seconds / 1e9:.2f} GB/s"
