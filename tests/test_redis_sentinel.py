"""The Redis store and connector behind Sentinel (real servers on loopback): the primary is asked of
the Sentinel, and found again after a failover to the replica.

The failover tests kill the primary of a setup of their own; the round trip uses
``KVTIER_TEST_REDIS_SENTINEL_URL`` when CI started one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvtier
from kvtier.connector import BlockKeyspace, RedisConnector, RedisStore
from kvtier.connector.redis_urls import parse_redis_url
from kvtier.engine import SamplingParams
from kvtier.models import build_model
from tests.test_connector import TPB, engine
from tests.test_engine import check_against_oracle, prompts_for

redis = pytest.importorskip("redis")
from redis.sentinel import Sentinel  # noqa: E402

from tests.redis_topologies import LocalSentinel, client, wait_until  # noqa: E402

SENTINEL_URL_ENV = "KVTIER_TEST_REDIS_SENTINEL_URL"
FAILOVER_TIMEOUT_S = 60


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip(f"redis-server is not on PATH (install the redis-server package) and {SENTINEL_URL_ENV} is unset")


@pytest.fixture(scope="module")
def sentinel_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get(SENTINEL_URL_ENV)
    if url:
        yield url
        return
    require_redis_server()
    setup = LocalSentinel(tmp_path_factory.mktemp("sentinel"))
    try:
        setup.start()
        yield setup.url
    finally:
        setup.stop()


@pytest.fixture
def own_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    require_redis_server()
    setup = LocalSentinel(tmp_path_factory.mktemp("sentinel"))
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


def fresh_keys(n: int) -> list[str]:
    space = BlockKeyspace(uuid.uuid4().hex, TPB)
    return [space.key(kvtier.DEFAULT_SCOPE, i.to_bytes(16, "little"), 0) for i in range(n)]


def pages(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def replicate(primary_port: int) -> None:
    """Wait until the replica has everything the primary took. ``WAIT`` waits for the writes of its
    own connection only (on a fresh one it returns at once), so the same connection first writes a
    marker: the replication stream is ordered, so once the replica acknowledges the marker it holds
    every write the primary took before it."""
    with client(primary_port) as c, c.pipeline(transaction=False) as pipe:
        pipe.incr("kvtier-test-replication-marker")
        pipe.execute_command("WAIT", 1, 5000)
        assert pipe.execute()[1] == 1


def saves_done(eng) -> bool:
    """Whether every save the engine's connector started has finished (and its pages were released)."""
    eng.connector.poll()
    return not eng.connector.saving


def test_round_trip_through_sentinel_lands_on_the_primary(sentinel_url):
    store = RedisStore(sentinel_url)
    keys, data = fresh_keys(20), pages(20, 4096, seed=1)
    assert store.put_many(list(zip(keys, data, strict=True))) == [True] * 20
    assert store.get_many(keys, [4096] * 20) == data
    assert store.contains_many(keys) == [True] * 20
    target = parse_redis_url(sentinel_url)
    host, port = Sentinel(target.nodes, socket_timeout=5).discover_master(target.service_name)
    with redis.Redis(host, port, socket_timeout=5) as primary:
        assert primary.exists(*keys) == 20
    store.delete_many(keys)
    assert store.contains_many(keys) == [False] * 20
    store.close()


def test_a_sentinel_url_naming_a_plain_server_is_one_short_warning(start_redis, caplog):
    """redis-py's ``MasterNotFoundError`` then holds the whole connection pool's repr: before, a
    WARNING of 1,368 characters. (Before redis-py 8.x the server's ``ResponseError`` to ``SENTINEL
    MASTERS`` comes through instead.)"""
    server = start_redis()
    store = RedisStore(f"redis-sentinel://:pw@127.0.0.1:{server.port}/no-such-service", socket_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert store.contains_many(fresh_keys(2)) == [False, False]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert ("MasterNotFoundError" in line or "unknown command 'SENTINEL'" in line) and len(line) < 600, line
    store.close()


def test_the_store_follows_a_failover_to_the_replica(own_sentinel, caplog):
    caplog.set_level(logging.INFO, logger="kvtier.connector.redis_store")
    store = RedisStore(own_sentinel.url, socket_timeout_s=0.5, retry_after_s=0.2)
    keys, data = fresh_keys(10), pages(10, 1024, seed=2)
    assert all(store.put_many(list(zip(keys, data, strict=True))))
    replicate(own_sentinel.primary.port)
    own_sentinel.primary.kill()
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while (got := store.get_many(keys, [1024] * 10)) != data:
        assert got == [None] * 10  # misses meanwhile, never wrong bytes
        assert time.monotonic() < deadline, "the store did not find the new primary"
        time.sleep(0.1)
    assert own_sentinel.primary_port() == own_sentinel.replica.port
    fresh = pages(10, 1024, seed=3)
    assert store.put_many(list(zip(keys, fresh, strict=True))) == [True] * 10
    with client(own_sentinel.replica.port) as new_primary:
        assert new_primary.exists(*keys) == 10
    assert store.get_many(keys, [1024] * 10) == fresh
    assert "answers again" in caplog.text
    store.close()


def test_bounded_misses_while_no_primary_is_known(own_sentinel):
    """With the primary gone and before the failover, each call answers misses within about the timeout."""
    store = RedisStore(own_sentinel.url, socket_timeout_s=0.5, retry_after_s=0.0)
    keys = fresh_keys(4)
    assert all(store.put_many([(k, b"s" * 64) for k in keys]))
    own_sentinel.primary.kill()
    for _ in range(5):
        start = time.monotonic()
        store.get_many(keys)  # misses until the failover, the values after it
        assert time.monotonic() - start < 0.5 + 0.5
    store.close()


def test_engines_share_prefixes_across_a_failover(llama, own_sentinel):
    before = prompts_for(llama, [110, 90], seed=31)
    after = prompts_for(llama, [100, 80], seed=32)
    connector = RedisConnector(own_sentinel.url, timeout_s=0.5, retry_after_s=0.2)
    probe = fresh_keys(1)
    with engine(llama, 200, connector) as eng:
        eng.generate(before, SamplingParams(max_tokens=2))
        wait_until(lambda: saves_done(eng), 30, "the saves")
        assert connector.store.put_many([(probe[0], b"probe")]) == [True]
        replicate(own_sentinel.primary.port)
        own_sentinel.primary.kill()
        wait_until(lambda: connector.store.get_many(probe) == [b"probe"], FAILOVER_TIMEOUT_S, "the new primary")
        eng.generate(after, SamplingParams(max_tokens=2))  # saved to the new primary
    assert connector.stats().saved_pages > 0
    with engine(llama, 200, RedisConnector(own_sentinel.url)) as warm:
        outs = warm.generate(before + after, SamplingParams(max_tokens=4))
    check_against_oracle(llama, before + after, outs, 4)
    for prompt, out in zip(before + after, outs, strict=True):
        assert out.reused_tokens_by_tier["connector"] == min(len(prompt) // TPB * TPB, len(prompt) - 1)
