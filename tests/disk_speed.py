"""A disk tier slower than this machine's disk: every read of its page files also sleeps."""

from __future__ import annotations

import time

from kvtier.storage.page_files import DiskStorage


def slow_disk_reads(monkeypatch, bytes_per_second: float) -> None:
    """Every read of the disk tier's page files also waits bytes / ``bytes_per_second``."""
    read = DiskStorage.read

    def slow(self, group, slots, into, checksums):
        out = read(self, group, slots, into, checksums)
        time.sleep(sum(len(page) for page in into) / bytes_per_second)
        return out

    monkeypatch.setattr(DiskStorage, "read", slow)
