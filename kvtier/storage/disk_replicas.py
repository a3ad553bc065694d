"""The disk directory of one process among several that run one model with the same disk path.

The adapters' processes of one model configured alike (vLLM replicas behind a load balancer, one
per GPU of a machine; the ranks of a ``torchrun`` job using ``kvtier.hf``) all name the same disk
path, and a disk tier's directory belongs to one manager at a time (an OS lock,
``DiskTierBusyError``). The first takes the path itself; each next one takes the first of
``path/replica-1``, ``path/replica-2``, ... that no live manager holds, up to ``MAX_REPLICAS``
directories, and says so in a WARNING. Each has the tier's whole quota.

The pages in any of these directories are valid for every process of the model (inside each, the
tier's directory is named by the model's layout fingerprint, ``model_id`` included), so a process
restarted into another one's directory serves that one's prefixes. Processes of other models never
contend: their tier directories have other names. ``KVCacheManager`` itself stays strict: a second
manager on a directory is refused.
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
            "kvtier: other managers hold this model's disk directories under %s (the last: %s); this one "
            "keeps its disk pages in %s, with a quota of its own",
            disk_path,
            refusal,
            path,
        )
    return opened
