"""Building the run-time tiers from the configured ones.

The disk tier is opened first: its directory lock (``DiskTierBusyError`` when another manager
holds it) and its checks (``ValueError`` for a path that is a file) come before any memory is
allocated, and a failure to allocate memory releases the directory again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.config import CacheConfig, DiskTier, HostTier, PrimaryTier, write_through_enabled
from kvtier.layout import PageGeometry
from kvtier.spec import GroupKind, ModelSpec
from kvtier.storage.disk_dir import DiskDirectory, other_directories
from kvtier.storage.disk_index import DiskIndex
from kvtier.storage.memory import MemoryStorage
from kvtier.storage.page_files import DiskStorage
from kvtier.storage.pinned import allocate_host_buffer
from kvtier.tiering.sizing import slots_per_group
from kvtier.tiering.tier import Tier

log = logging.getLogger(__name__)


def build_tiers(spec: ModelSpec, config: CacheConfig, geometries: Sequence[PageGeometry]) -> list[Tier]:
    """One ``Tier`` per configured tier, warm to cold, each quota split across layer groups."""
    device = torch.device(config.device)
    page_bytes = [g.page_bytes for g in geometries]
    last = len(config.tiers) - 1
    slots = [slots_per_group(t.bytes, geometries, config.snapshot_interval_blocks, t.name) for t in config.tiers]
    disk: Tier | None = None
    if isinstance(config.tiers[last], DiskTier):
        chain_groups = frozenset(g.group_id for g in spec.groups if g.kind is GroupKind.ATTENTION)
        fingerprint = layout_fingerprint(spec, config, geometries)
        disk = _disk_tier(config.tiers[last], last, fingerprint, page_bytes, slots[last], chain_groups)
    tiers: list[Tier] = []
    try:
        for index, tier_config in enumerate(config.tiers):
            if isinstance(tier_config, PrimaryTier):
                storage = MemoryStorage(
                    page_bytes, slots[index], lambda n, _p: torch.empty(n, dtype=torch.uint8, device=device)
                )
            elif isinstance(tier_config, HostTier):
                storage = MemoryStorage(page_bytes, slots[index], lambda n, p: allocate_host_buffer(n, p, device))
            elif disk is not None:  # the configuration keeps a DiskTier last
                tiers.append(disk)
                continue
            else:
                raise ValueError(f"{type(tier_config).__name__} can only be the last tier")
            keeps = isinstance(tier_config, HostTier) and write_through_enabled(config)
            tiers.append(Tier(tier_config.name, index, storage, is_last=index == last, keeps_copies=keeps))
    except BaseException:
        if disk is not None:
            disk.storage.close()
            disk.disk_index.close()
        raise
    return tiers


def _disk_tier(
    config: DiskTier,
    index: int,
    fingerprint: str,
    page_bytes: list[int],
    slots: list[int],
    chain_groups: frozenset[int],
) -> Tier:
    """The disk tier in ``<path>/kvtier-<fingerprint>`` (``~`` in ``path`` is the user's home): its
    directory, index and page files; ``chain_groups`` are the full-attention groups (``Tier.chain_groups``)."""
    directory = DiskDirectory(Path(os.fspath(config.path)).expanduser() / f"kvtier-{fingerprint}")
    _warn_of_other_directories(directory.path, config.bytes)
    try:
        disk_index = DiskIndex(directory, fingerprint)
        storage = DiskStorage(directory, page_bytes, slots)
    except BaseException:
        directory.close()
        raise
    return Tier(config.name, index, storage, is_last=True, disk_index=disk_index, chain_groups=chain_groups)


def _warn_of_other_directories(path: Path, capacity: int) -> None:
    """One WARNING when the other models' and layouts' directories beside ``path`` use more than a
    tier's capacity: each has a capacity of its own, so a path served to many checkpoints (a new
    fingerprint each) grows without bound; kvtier never deletes them."""
    others = other_directories(path)
    used = sum(d.bytes_used for d in others)
    if used <= capacity:
        return
    oldest = others[0]
    log.warning(
        "kvtier disk tier: %d other directories under %s (other models, checkpoints or layouts) use %s, "
        "more than this tier's %s; each keeps its own capacity and none is removed: delete those no longer "
        "served (the least recently used: %s, %s)",
        len(others),
        path.parent,
        _size(used),
        _size(capacity),
        oldest.name,
        time.strftime("%Y-%m-%d %H:%M", time.localtime(oldest.last_used)),
    )


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB, or MiB or bytes where that would read 0.0 GiB."""
    if nbytes >= 2**30 // 10:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20 // 10:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes} bytes"


def layout_fingerprint(spec: ModelSpec, config: CacheConfig, geometries: Sequence[PageGeometry]) -> str:
    """Names everything that decides a page's bytes and a block's key: the model, block size, page sizes."""
    desc = f"{spec.fingerprint()}|tpb={config.tokens_per_block}|pages={[g.page_bytes for g in geometries]}"
    return hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()
