"""The disk directory of one vLLM engine among several that name the same ``disk_path``.

Engines of one model configured alike (replicas behind a load balancer, one per GPU of a machine)
all name the same ``disk_path``, and a disk tier's directory belongs to one manager at a time (an
OS lock, ``DiskTierBusyError``). The first engine takes ``disk_path`` itself; each next one takes
the first of ``disk_path/replica-1``, ``disk_path/replica-2``, ... that no live engine holds, up
to ``MAX_REPLICAS`` directories, and says so in a WARNING. Each has its own ``disk_bytes``.

The pages in any of these directories are valid for every engine of the model (inside each, the
tier's directory is named by the model's layout fingerprint, ``model_id`` included), so an engine
restarted into another engine's directory serves that one's prefixes. Engines of other models
never contend: their tier directories have other names.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

from kvtier.errors import DiskTierBusyError

log = logging.getLogger(__name__)

MAX_REPLICAS = 64  # directories tried, ``disk_path`` included, before the last refusal is raised

Opened = TypeVar("Opened")


def replica_path(disk_path: str, replica: int) -> str:
    """Replica ``replica``'s directory: ``disk_path`` itself for 0, ``disk_path/replica-<k>`` after."""
    return disk_path if replica == 0 else os.path.join(disk_path, f"replica-{replica}")


def open_first_free(disk_path: str, open_at: Callable[[str], Opened]) -> Opened:
    """``open_at(path)`` for the first replica directory of ``disk_path`` whose tier no live manager
    holds. ``open_at`` must raise ``DiskTierBusyError`` having changed nothing when the directory is
    held; after ``MAX_REPLICAS`` refusals the last one is raised."""
    refusal: DiskTierBusyError | None = None
    for replica in range(MAX_REPLICAS):
        path = replica_path(disk_path, replica)
        try:
            opened = open_at(path)
            break
        except DiskTierBusyError as busy:
            if replica == MAX_REPLICAS - 1:
                raise
            refusal = busy
    if refusal is not None:
        log.warning(
            "kvtier.vllm: other engines hold this model's disk directories under %s (the last: %s); this "
            "engine keeps its disk pages in %s, with disk_bytes of its own",
            disk_path,
            refusal,
            path,
        )
    return opened
