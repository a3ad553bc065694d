"""Building the run-time tiers from the configured ones."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.config import CacheConfig, DiskTier, HostTier, PrimaryTier
from kvtier.layout import PageGeometry
from kvtier.sizing import slots_per_group
from kvtier.spec import ModelSpec
from kvtier.storage.disk import DiskStorage
from kvtier.storage.disk_index import DiskIndex
from kvtier.storage.memory import MemoryStorage
from kvtier.storage.pinned import allocate_host_buffer
from kvtier.tiers import Tier


def build_tiers(spec: ModelSpec, config: CacheConfig, geometries: Sequence[PageGeometry]) -> list[Tier]:
    """One ``Tier`` per configured tier, warm to cold, each quota split across layer groups."""
    device = torch.device(config.device)
    page_bytes = [g.page_bytes for g in geometries]
    tiers: list[Tier] = []
    last = len(config.tiers) - 1
    for index, tier_config in enumerate(config.tiers):
        slots = slots_per_group(tier_config.bytes, geometries, config.snapshot_interval_blocks, tier_config.name)
        disk_index = None
        if isinstance(tier_config, PrimaryTier):
            storage = MemoryStorage(page_bytes, slots, lambda n, _p: torch.empty(n, dtype=torch.uint8, device=device))
        elif isinstance(tier_config, HostTier):
            storage = MemoryStorage(page_bytes, slots, lambda n, p: allocate_host_buffer(n, p, device))
        else:
            assert isinstance(tier_config, DiskTier)
            directory = Path(os.fspath(tier_config.path)) / f"kvtier-{layout_fingerprint(spec, config, geometries)}"
            storage = DiskStorage(directory, page_bytes, slots)
            disk_index = DiskIndex(directory / "index.sqlite", layout_fingerprint(spec, config, geometries))
        tiers.append(Tier(tier_config.name, index, storage, is_last=index == last, disk_index=disk_index))
    return tiers


def layout_fingerprint(spec: ModelSpec, config: CacheConfig, geometries: Sequence[PageGeometry]) -> str:
    """Names everything that decides a page's bytes and a block's key: the model, block size, page sizes."""
    desc = f"{spec.fingerprint()}|tpb={config.tokens_per_block}|pages={[g.page_bytes for g in geometries]}"
    return hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()
