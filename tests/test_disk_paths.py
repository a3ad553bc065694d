"""Where a disk directory is: processes of one model that name the same path take a directory each
(``kvtier.storage.disk_replicas``), and ``~`` is the user's home."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.storage import disk_replicas


def test_managers_on_one_disk_path_open_the_first_free_replica_directory(tmp_path, monkeypatch, caplog):
    spec = kvtier.ModelSpec.uniform(1, 1, 16, torch.float16, model_id="m")

    def manager(path: str) -> kvtier.KVCacheManager:
        tiers = [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(1 << 20, path)]
        return kvtier.KVCacheManager(spec, kvtier.CacheConfig(4, tiers))

    root = tmp_path / "kv"
    managers = [disk_replicas.open_first_free(str(root), manager) for _ in range(3)]
    for replica in (root, root / "replica-1", root / "replica-2"):
        assert len(list(replica.glob("kvtier-*"))) == 1  # one tier directory in each
    assert "replica-2" in caplog.text
    monkeypatch.setattr(disk_replicas, "MAX_REPLICAS", 3)
    with pytest.raises(kvtier.DiskTierBusyError):  # all three are held
        disk_replicas.open_first_free(str(root), manager)
    managers[1].close()  # a replica that stopped: its directory is free again, and taken
    managers[1] = disk_replicas.open_first_free(str(root), manager)
    assert not (root / "replica-3").exists()
    for m in managers:
        m.close()


def test_a_path_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """``~/kv`` is the user's home, as in a shell; before, a directory named ``~`` was made in the
    working directory (for the disk tier and the filesystem connector alike)."""
    from kvtier.connector import FileSystemConnector

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    spec = kvtier.ModelSpec.uniform(1, 1, 16, torch.float16, model_id="m")
    tiers = [kvtier.PrimaryTier(1 << 20), kvtier.DiskTier(1 << 20, "~/kv")]
    kvtier.KVCacheManager(spec, kvtier.CacheConfig(4, tiers)).close()
    FileSystemConnector("~/store").close()
    assert list((tmp_path / "home" / "kv").glob("kvtier-*")) and (tmp_path / "home" / "store").is_dir()
    assert not (tmp_path / "~").exists()
