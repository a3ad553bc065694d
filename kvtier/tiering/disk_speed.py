"""The disk's read speed, sampled when a manager opens a directory whose speed nobody measured.

The load cost assumes a tier never measured is faster than recomputing (``load_cost``): the first
load from it measures it. A directory written by a process that never read from it, or by a
version that kept no rates, would so load its first disk hit whatever the disk's speed. When the
disk tier holds pages and no speed is known, ``sample_disk_speed`` reads up to ``SAMPLE_BYTES``
of them (the largest pages first, in slot order) into scratch memory, checksums included, as a
load reads them, and hands the time to the load cost, which keeps it in the directory. Only
pages that lie inside their page file are read, and a sample in which any page does not read
whole and intact is not timed (a short read, or a read of holes, measures no disk): the first
load measures instead. A page that fails its checksum here is left to the load that finds it
(this read serves nothing).
"""

from __future__ import annotations

import time

import numpy as np

from kvtier.tiering.load_cost import LoadCost
from kvtier.tiering.tier import Tier

SAMPLE_BYTES = 4 << 20


def sample_disk_speed(disk: Tier, load_cost: LoadCost) -> None:
    """Time a read of up to ``SAMPLE_BYTES`` of the disk tier's pages, if its speed is not known."""
    if load_cost.bandwidth[disk.index] is not None:
        return
    page_bytes = disk.storage.page_bytes
    for group in sorted(range(len(page_bytes)), key=lambda g: -page_bytes[g]):
        pb = page_bytes[group]
        whole = disk.storage.file_bytes(group) // pb  # the slots its page file holds whole now
        owned = [(slot, page) for slot, page in enumerate(disk.owners[group][:whole]) if page is not None]
        if not owned:
            continue
        owned = owned[: max(1, SAMPLE_BYTES // pb)]
        scratch = np.empty((len(owned), pb), dtype=np.uint8)
        began = time.perf_counter()
        intact = disk.storage.read(group, [slot for slot, _ in owned], list(scratch), [p.checksum for _, p in owned])
        seconds = time.perf_counter() - began
        if all(intact):
            load_cost.observe(disk.index, scratch.nbytes, seconds)
        return
