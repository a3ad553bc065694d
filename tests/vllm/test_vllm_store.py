"""KVTierConnector's store below the disk tier (``store_url``): another engine finds the pages
there, a damaged value is recomputed, and Redis serves like a shared directory."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM 0.33 (bash .ci/vllm_env.sh)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvtier.config import ReuseScope
from kvtier.connector.fs_store import FileSystemStore
from kvtier.vllm import KVTierConnector
from kvtier.vllm.store_tier import BlockChain, StoreTier
from tests.holding import hold
from tests.vllm.harness import BLOCK, Engine, attention_spec, kv_cache_config, layer_names, prompt, vllm_config

MiB = 1 << 20


def engine(tmp_path: Path, store_url: str, name: str) -> Engine:
    config = vllm_config(tmp_path, {"host_bytes": 4 * MiB, "store_url": store_url}, name="model")
    config.kv_transfer_config.engine_id = name
    return Engine(config, kv_cache_config(config, [(layer_names(3), attention_spec())], 64))


def first_computed(e: Engine, rid: str) -> int:
    return next(step.computed[rid][0] for step in e.log if rid in step.computed)


def save_through(tmp_path: Path, url: str, tokens: list[int]) -> None:
    first = engine(tmp_path, url, "first")
    first.add("r1", tokens, max_tokens=2)
    first.run()
    first.assert_no_leaks()
    first.shutdown()  # waits for the writes in flight


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def test_another_engine_loads_the_prefix_from_the_store(tmp_path, file_url):
    shared = prompt(20, 120)
    save_through(tmp_path, file_url, shared)
    second = engine(tmp_path, file_url, "second")  # nothing in its host memory, no disk tier
    second.poison()
    request = second.add("r2", [*shared, 1, 2], max_tokens=2)
    for _ in range(1000):  # vLLM asks again each step until the fetch from the store is over
        second.step()
        if request.status is not RequestStatus.WAITING:
            break
        time.sleep(0.001)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert second.connector.get_external_cache_hit_sources(request, 112) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 112}
    second.run()
    assert first_computed(second, "r2") == 112
    assert second.kv_scheduler.manager.stats().tiers["primary"].pages_used == 7  # what came is kept in kvtier too
    second.assert_no_leaks()
    second.shutdown()


def test_a_fetch_from_the_store_runs_while_the_others_do(tmp_path, file_url, monkeypatch):
    """While the store's pages are fetched on a background thread the request waits and another
    runs; an aborted one leaks nothing; then the prefix loads byte for byte."""
    shared = prompt(23, 120)
    save_through(tmp_path, file_url, shared)
    started, release = hold(monkeypatch, StoreTier, "_read")
    second = engine(tmp_path, file_url, "second")
    second.poison()
    second.add("r2", [*shared, 1, 2], max_tokens=2)
    second.add("gone", [*shared, 5], max_tokens=2)
    second.add("r3", prompt(24, 40), max_tokens=2)  # nothing stored: it needs nothing from the store
    for _ in range(3):
        second.step()
    assert started.wait(10)
    assert second.requests["r2"].status is RequestStatus.WAITING
    assert any("r3" in step.computed for step in second.log)  # scheduled while the fetch runs
    second.abort("gone")
    release.set()
    second.run()
    assert first_computed(second, "r2") == 112
    second.assert_no_leaks()
    second.shutdown()


def test_a_damaged_store_value_is_recomputed_not_served(tmp_path, file_url):
    shared = prompt(21, 120)
    save_through(tmp_path, file_url, shared)
    second = engine(tmp_path, file_url, "second")
    keyspace = second.kv_scheduler._store.keyspace
    chain = BlockChain(ReuseScope())
    key = keyspace.key(chain.scope, chain.upto(shared, BLOCK, 7)[4], 0)
    path = FileSystemStore(str(tmp_path / "store")).path_of(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    second.poison()
    second.add("r2", [*shared, 3], max_tokens=2)
    second.run()
    assert first_computed(second, "r2") == 4 * BLOCK  # blocks 0..3 from the store, the rest computed
    second.assert_no_leaks()
    second.shutdown()


def test_redis_serves_like_a_shared_directory(tmp_path, redis_url):
    shared = prompt(22, 100)
    save_through(tmp_path, redis_url, shared)
    second = engine(tmp_path, redis_url, "second")
    second.poison()
    second.add("r2", [*shared, 4], max_tokens=2)
    second.run()
    assert first_computed(second, "r2") == 96
    second.shutdown()


def test_store_settings_are_checked(tmp_path):
    config = vllm_config(tmp_path, {"store_url": "ftp://somewhere"})
    kv_config = kv_cache_config(config, [(layer_names(3), attention_spec())], 16)
    with pytest.raises(ValueError, match="store_url must start with"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    config = vllm_config(tmp_path, {"store_url": "file:///tmp/x"}, name="swa")
    groups = [(layer_names(2), attention_spec()), (layer_names(2, first=2), attention_spec(window=32))]
    with pytest.raises(NotImplementedError, match="full-attention models only"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(config, groups, 16))
