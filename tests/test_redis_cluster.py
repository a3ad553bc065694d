"""The Redis store and connector on a three-node Redis Cluster (real servers on loopback).

Blocks spread over every node; two engines share prefixes through the cluster; slots moved
between nodes are followed (MOVED/ASK); a killed node costs the misses of its own keys only; a
hung node (SIGSTOP) stalls an engine step by at most the timeout. Tests that kill, stall or
reshard a node get a cluster of their own; the others share one (``KVTIER_TEST_REDIS_CLUSTER_URL``
when CI started one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvtier
from kvtier.connector import BlockKeyspace, RedisConnector, RedisStore
from kvtier.connector.keys import scope_tag
from kvtier.connector.redis_urls import parse_redis_url
from kvtier.engine import SamplingParams
from kvtier.models import build_model
from tests.test_connector import TPB, engine
from tests.test_engine import check_against_oracle, prompts_for

redis = pytest.importorskip("redis")
from redis.cluster import ClusterNode, RedisCluster, key_slot  # noqa: E402

from tests.redis_topologies import LocalCluster, wait_until  # noqa: E402

CLUSTER_URL_ENV = "KVTIER_TEST_REDIS_CLUSTER_URL"
SLOTS = 16384


def require_cluster_tools() -> None:
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not on PATH (install the redis-server package) and {CLUSTER_URL_ENV} is unset")


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A cluster shared by this module's tests that leave it as it is."""
    url = os.environ.get(CLUSTER_URL_ENV)
    if url:
        yield url
        return
    require_cluster_tools()
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster for one test that kills, stalls or reshards a node."""
    require_cluster_tools()
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


def keys_per_primary(url: str, match: str) -> dict[str, int]:
    """How many keys matching ``match`` each primary of the cluster at ``url`` holds."""
    target = parse_redis_url(url)
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    with RedisCluster(startup_nodes=nodes, password=target.password, socket_timeout=5) as rc:
        return {
            node.name: sum(1 for _ in rc.get_redis_connection(node).scan_iter(match=match, count=1000))
            for node in rc.get_primaries()
        }


def fresh_space() -> BlockKeyspace:
    return BlockKeyspace(uuid.uuid4().hex, TPB)


def fresh_keys(n: int) -> tuple[str, list[str]]:
    space = fresh_space()
    return space.prefix, [space.key(kvtier.DEFAULT_SCOPE, i.to_bytes(16, "little"), 0) for i in range(n)]


def pages(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size, dtype=np.uint8) for _ in range(n)]


def test_keys_carry_no_hash_tag_so_one_model_spreads_over_the_slots():
    _, keys = fresh_keys(3000)
    assert not any("{" in key or "}" in key for key in keys)
    slots = [key_slot(key.encode()) for key in keys]
    thirds = np.bincount(np.array(slots) * 3 // SLOTS, minlength=3)
    assert len(set(slots)) > 2500 and thirds.min() > 800  # close to uniform over three equal slot ranges


def test_round_trip_lands_on_every_node(cluster_url):
    store = RedisStore(cluster_url)
    prefix, keys = fresh_keys(60)
    data = pages(60, 2048, seed=1)
    assert store.put_many(list(zip(keys, data, strict=True))) == [True] * 60
    per_node = keys_per_primary(cluster_url, prefix + "/*")
    assert len(per_node) == 3 and min(per_node.values()) > 0 and sum(per_node.values()) == 60
    assert store.get_many(keys, [2048] * 60) == [p.tobytes() for p in data]
    assert store.get_many(keys, [2047] * 60) == [None] * 60
    assert store.contains_many(keys + fresh_keys(1)[1]) == [True] * 60 + [False]
    target = parse_redis_url(cluster_url)
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    with RedisCluster(startup_nodes=nodes, password=target.password, socket_timeout=5) as rc:
        rc.delete(keys[0])
        rc.sadd(keys[0], "member")  # another tool's set under kvtier's prefix: absent, replaced by a save
    assert store.contains_many(keys[:2]) == [False, True]
    assert store.put_many([(keys[0], data[0])]) == [True]
    assert store.get_many(keys[:1], [2048]) == [data[0].tobytes()]
    store.delete_many(keys)
    assert store.contains_many(keys) == [False] * 60
    assert sum(keys_per_primary(cluster_url, prefix + "/*").values()) == 0
    store.close()


def test_two_engines_share_prefixes_through_the_cluster(llama, cluster_url):
    prompts = prompts_for(llama, [120, 90, 70], seed=21, shared=40)
    scope = kvtier.ReuseScope(salt=uuid.uuid4().bytes)  # keys of this test only, on a shared cluster
    cold_connector = RedisConnector(cluster_url)
    with engine(llama, 200, cold_connector) as cold:
        outs = cold.generate(prompts, SamplingParams(max_tokens=4), scope=scope)
        assert all(o.reused_tokens_by_tier.get("connector", 0) == 0 for o in outs)
    stats = cold_connector.stats()
    assert stats.saved_pages > 0 and stats.errors == 0 and stats.saved_bytes > 0
    per_node = keys_per_primary(cluster_url, f"kvtier/*/{scope_tag(scope)}/*")
    assert len(per_node) == 3 and min(per_node.values()) > 0  # blocks on every node
    distinct_prompt_blocks = sum(len(p) // TPB for p in prompts) - 2 * (40 // TPB)  # the shared blocks once
    assert distinct_prompt_blocks <= sum(per_node.values()) <= stats.saved_pages
    warm_connector = RedisConnector(cluster_url)
    with engine(llama, 200, warm_connector) as warm:
        outs = warm.generate(prompts, SamplingParams(max_tokens=4), scope=scope)
        check_against_oracle(llama, prompts, outs, 4)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.reused_tokens_by_tier["connector"] == min(len(prompt) // TPB * TPB, len(prompt) - 1)
    stats = warm_connector.stats()
    assert stats.loaded_pages > 0 and stats.missed_pages == 0 and stats.errors == 0


def test_slots_moved_to_another_node_are_followed(own_cluster):
    store = RedisStore(own_cluster.url)
    prefix, keys = fresh_keys(200)
    data = pages(200, 512, seed=2)
    assert all(store.put_many(list(zip(keys, data, strict=True))))
    source, dest = own_cluster.nodes[0], own_cluster.nodes[1]
    before = own_cluster.keys_on(source, prefix + "/*")
    subprocess.run(
        ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{source.port}"]
        + ["--cluster-from", own_cluster.node_id(source), "--cluster-to", own_cluster.node_id(dest)]
        + ["--cluster-slots", "3000", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    moved = before - own_cluster.keys_on(source, prefix + "/*")
    assert moved and moved <= own_cluster.keys_on(dest, prefix + "/*")
    # The store's slot table is stale: each moved key is redirected (MOVED), and the client learns.
    assert store.get_many(keys, [512] * 200) == [p.tobytes() for p in data]
    fresh = pages(200, 512, seed=3)
    assert store.put_many(list(zip(keys, fresh, strict=True))) == [True] * 200
    assert store.get_many(keys, [512] * 200) == [p.tobytes() for p in fresh]
    store.close()


def test_a_killed_node_costs_the_misses_of_its_own_keys_only(own_cluster, caplog):
    store = RedisStore(own_cluster.url, socket_timeout_s=0.5, retry_after_s=0.3)
    prefix, keys = fresh_keys(90)
    data = pages(90, 1024, seed=4)
    assert all(store.put_many(list(zip(keys, data, strict=True))))
    victim = own_cluster.nodes[2]
    lost = own_cluster.keys_on(victim, prefix + "/*")
    assert 0 < len(lost) < 90
    victim.kill()
    expected = [None if k in lost else p.tobytes() for k, p in zip(keys, data, strict=True)]
    for _ in range(3):  # at once, during the back-off, and after it (the node is retried and still down)
        start = time.monotonic()
        assert store.get_many(keys, [1024] * 90) == expected
        assert store.contains_many(keys) == [k not in lost for k in keys]
        assert store.put_many(list(zip(keys, data, strict=True))) == [k not in lost for k in keys]
        assert time.monotonic() - start < 0.5
        time.sleep(0.2)
    assert any(f"node 127.0.0.1:{victim.port}" in r.getMessage() for r in caplog.records)
    # Once the others have marked it failed, they keep serving their slots (full coverage not required).
    wait_until(lambda: slots_marked_failed(own_cluster.nodes[0].port), 30, "the node marked failed")
    assert store.get_many(keys, [1024] * 90) == expected
    store.close()


def slots_marked_failed(port: int) -> int:
    """How many slots the node on ``port`` holds to be on a failed node (not just suspected)."""
    with redis.Redis("127.0.0.1", port, socket_timeout=5) as c:
        return int(c.cluster("info")["cluster_slots_fail"])


def test_a_node_killed_mid_run_gives_misses_and_correct_tokens(llama, own_cluster):
    prompts = prompts_for(llama, [130, 110, 100], seed=22)
    with engine(llama, 200, RedisConnector(own_cluster.url)) as cold:
        cold.generate(prompts, SamplingParams(max_tokens=2))
    connector = RedisConnector(own_cluster.url, timeout_s=0.5)
    with engine(llama, 200, connector) as eng:
        first = eng.generate(prompts[:1], SamplingParams(max_tokens=3))
        own_cluster.nodes[1].kill()
        rest = eng.generate(prompts[1:], SamplingParams(max_tokens=3))
        later = eng.generate(prompts_for(llama, [90], seed=23), SamplingParams(max_tokens=3))  # the engine goes on
        check_against_oracle(llama, prompts, first + rest, 3)
        check_against_oracle(llama, prompts_for(llama, [90], seed=23), later, 3)
    assert first[0].reused_tokens_by_tier["connector"] == 128
    assert any(
        out.reused_tokens_by_tier.get("connector", 0) < (len(p) - 1) // TPB * TPB
        for p, out in zip(prompts[1:], rest, strict=True)
    )
    stats = connector.stats()
    assert stats.missed_pages > 0 and stats.errors > 0  # misses on asks, failed saves of the dead node's pages
    assert stats.saved_pages > 0  # the live nodes took theirs


def test_a_hung_node_stalls_a_step_by_at_most_the_timeout(llama, own_cluster):
    """SIGSTOP one node: the step that meets it waits about the timeout for the store, no more; the
    node is then backed off, so no later step waits for it. Its keys are misses; tokens stay right."""
    timeout_s = 0.5
    prompts = prompts_for(llama, [100, 120, 80, 110], seed=24)
    with engine(llama, 200, RedisConnector(own_cluster.url)) as cold:
        cold.generate(prompts, SamplingParams(max_tokens=2))
    connector = RedisConnector(own_cluster.url, timeout_s=timeout_s, retry_after_s=60)
    with engine(llama, 200, connector, max_batch_size=1) as eng:
        eng.generate(prompts_for(llama, [40], seed=25), SamplingParams(max_tokens=2))  # connected, warmed up
        baseline, _ = run_steps(eng, connector, prompts_for(llama, [100, 120], seed=26))
        stalled = own_cluster.nodes[0]
        stalled.pause()
        try:
            (times, stalls), outputs = run_steps(eng, connector, prompts)
        finally:
            stalled.resume()
        check_against_oracle(llama, prompts, outputs, 3)
    assert timeout_s * 0.9 <= max(stalls) <= timeout_s + 0.2, stalls  # the hang was met, and cost one timeout
    assert sum(stalls) - max(stalls) <= 0.5, stalls  # then backed off: no step waited for it again
    assert max(times) <= max(baseline[0]) + timeout_s + 1.0, (times, baseline[0])  # wall clock, with CPU noise
    assert connector.stats().missed_pages > 0


def run_steps(eng, connector, prompts) -> tuple[tuple[list[float], list[float]], list]:
    """Run ``prompts`` step by step: (each step's wall time, each step's store wait), and the outputs in order."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
    times, stalls, outputs = [], [], {}
    while eng.has_unfinished_requests():
        start, stall = time.monotonic(), connector.stats().stall_s
        outputs.update((o.request_id, o) for o in eng.step())
        times.append(time.monotonic() - start)
        stalls.append(connector.stats().stall_s - stall)
    return (times, stalls), [outputs[i] for i in ids]


def test_the_first_call_waits_for_a_hung_cluster_at_most_the_timeout(own_cluster):
    """Discovery (connecting to the URL's node) runs in the background: a call waits for it at
    most the timeout and answers misses; once the node answers, the store works."""
    hung = own_cluster.nodes[0]
    store = RedisStore(f"redis-cluster://127.0.0.1:{hung.port}", socket_timeout_s=0.5, retry_after_s=0.2)
    _, keys = fresh_keys(6)
    hung.pause()
    try:
        start = time.monotonic()
        assert store.get_many(keys) == [None] * 6
        assert store.put_many([(k, b"v") for k in keys]) == [False] * 6
        assert time.monotonic() - start < 0.5 + 0.3
    finally:
        hung.resume()
    wait_until(lambda: store.put_many([(k, b"v") for k in keys]) == [True] * 6, 10, "the cluster to be discovered")
    assert store.get_many(keys) == [b"v"] * 6
    store.close()


def leave_slots_mid_migration(cluster: LocalCluster, prefix: str, source, dest, moved_slots: int) -> list[str]:
    """Mark up to ``moved_slots`` of ``source``'s slots holding keys under ``prefix`` as moving to
    ``dest`` and move their keys, leaving the slots mid-migration, as a reshard whose target stopped
    answering leaves them: ``source`` answers ``ASK`` for those keys. Returns the keys moved."""
    mine = sorted(cluster.keys_on(source, prefix + "/*"))
    by_slot: dict[int, list[str]] = {}
    for key in mine:
        by_slot.setdefault(key_slot(key.encode()), []).append(key)
    source_id, dest_id = cluster.node_id(source), cluster.node_id(dest)
    moved = []
    with RedisCluster(host="127.0.0.1", port=source.port, socket_timeout=5) as rc:
        src, dst = rc.get_node("127.0.0.1", source.port), rc.get_node("127.0.0.1", dest.port)
        for slot, slot_keys in list(by_slot.items())[:moved_slots]:
            rc.get_redis_connection(dst).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            rc.get_redis_connection(src).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dest_id)
            rc.get_redis_connection(src).execute_command(
                "MIGRATE", "127.0.0.1", dest.port, "", 0, 5000, "KEYS", *slot_keys
            )
            moved += slot_keys
    return moved


def test_keys_redirected_to_a_hung_node_cost_one_timeout_then_that_node_is_backed_off(own_cluster):
    """Slots left mid-migration to a node that then hangs (SIGSTOP): the keys its ``ASK`` replies
    point to are misses, a call costs about a timeout more, and later calls none while that node
    is backed off; every other key reads back exact, and once the node answers the moved keys do
    too. Before, each redirected key was sent again on its own through the cluster client, outside
    any back-off: a timeout per key, on every call (20.6 s for 54 keys at a 0.5 s timeout)."""
    timeout_s = 0.5
    store = RedisStore(own_cluster.url, socket_timeout_s=timeout_s, retry_after_s=60)
    prefix, keys = fresh_keys(120)
    data = dict(zip(keys, pages(120, 256, seed=41), strict=True))
    assert all(store.put_many(list(data.items())))
    source, dest = own_cluster.nodes[0], own_cluster.nodes[1]
    moved = leave_slots_mid_migration(own_cluster, prefix, source, dest, moved_slots=12)
    assert len(moved) >= 10
    assert store.get_many(keys, [256] * 120) == [data[k].tobytes() for k in keys]  # ASK followed
    on_dest = own_cluster.keys_on(dest, prefix + "/*")  # its own keys and the moved ones
    dest.pause()
    try:
        for call in range(3):
            start = time.monotonic()
            got = store.get_many(keys, [256] * 120)
            took = time.monotonic() - start
            assert took <= (2 * timeout_s + 1.0 if call == 0 else 0.5), (call, took)
            for key, value in zip(keys, got, strict=True):
                assert value == (None if key in on_dest else data[key].tobytes()), key
    finally:
        dest.resume()
    store.close()
    fresh = RedisStore(own_cluster.url, socket_timeout_s=timeout_s)  # no back-off: the moved keys read back
    assert fresh.get_many(moved, [256] * len(moved)) == [data[k].tobytes() for k in moved]
    fresh.close()


def test_a_call_that_meets_close_from_another_thread_fails_as_on_a_closed_store(cluster_url, monkeypatch):
    """``close`` lands after a call's check that the store is open, before it fans out to the nodes:
    the call raises the closed store's ``ValueError``. Before, the client's own error (``RuntimeError:
    cannot schedule new futures after shutdown``, or an ``AttributeError`` on a single server)."""
    store = RedisStore(cluster_url)
    _, keys = fresh_keys(30)
    assert all(store.put_many([(k, p) for k, p in zip(keys, pages(30, 64, seed=5), strict=True)]))
    transport = store._transport
    ready = transport._ready_client

    def ready_then_closed():
        client = ready()
        store.close()  # another thread's close, right after this call's check
        return client

    monkeypatch.setattr(transport, "_ready_client", ready_then_closed)
    with pytest.raises(ValueError, match="is closed"):
        store.get_many(keys)
