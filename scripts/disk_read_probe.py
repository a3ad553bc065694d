"""Disk read ceiling of the machine (not product code): write a file, drop the page cache, read it
back with N threads using positional reads, with and without the disk tier's page checksum.

Usage: python3 scripts/disk_read_probe.py DIR [GiB] [page MiB]
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.storage.page_files import page_checksum

directory, gib = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
page = int(float(sys.argv[3]) * (1 << 20)) if len(sys.argv) > 3 else 4 << 20
n = int(gib * (1 << 30)) // page
path = os.path.join(directory, "probe.bin")
data = np.random.default_rng(0).integers(1, 255, page, dtype=np.uint8)
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
t0 = time.perf_counter()
for i in range(n):
    os.pwrite(fd, memoryview(data), i * page)
os.fsync(fd)
print(f"write {n * page / (time.perf_counter() - t0) / 1e9:.2f} GB/s ({n} x {page} B)")
out = [np.empty(page, dtype=np.uint8) for _ in range(n)]
for threads in (4, 8, 16):
    for check in (False, True):
        os.system("sync; echo 3 > /proc/sys/vm/drop_caches")

        def read(i, check=check):
            os.preadv(fd, [memoryview(out[i])], i * page)
            return page_checksum(out[i]) if check else 0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(n)))
        print(f"read threads={threads:>2} checksum={check!s:<5} {n * page / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
t0 = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    list(pool.map(page_checksum, out))
print(f"checksum only, 8 threads: {n * page / (time.perf_counter() - t0) / 1e9:.2f} GB/s")
os.close(fd)
os.remove(path)
