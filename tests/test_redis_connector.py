"""The Redis connector's knobs against a real server: selective saving, TTL, metrics, and a hung server.

Selective saving keeps out of the store the requests below a priority, or the blocks of prefixes
seen fewer than N times; what it saves is served to a new engine like everything else. The
connector's counters are exported to Prometheus beside the cache's.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from prometheus_client import generate_latest

import kvtier
from kvtier.connector import ConnectorStats, RedisConnector, SavePolicy
from kvtier.connector.save_policy import PrefixSightings
from kvtier.connector.store_metrics import ConnectorCollector
from kvtier.engine import SamplingParams
from kvtier.metrics import registry_for
from kvtier.models import build_model
from tests.test_connector import TPB, engine
from tests.test_engine import check_against_oracle, prompts_for

redis = pytest.importorskip("redis")
from tests.redis_topologies import wait_until  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return build_model("tiny-llama", "cpu", torch.float64, seed=0)


def fresh_scope() -> kvtier.ReuseScope:
    """A scope no other test uses, so the tests share one server without sharing keys."""
    return kvtier.ReuseScope(salt=uuid.uuid4().bytes)


def reused(model, url, prompts, scope) -> list[int]:
    """Tokens a new engine loads from the store for each prompt (checking its tokens against the oracle)."""
    with engine(model, 200, RedisConnector(url)) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=2), scope=scope)
    check_against_oracle(model, prompts, outs, 2)
    return [o.reused_tokens_by_tier.get("connector", 0) for o in outs]


def full_reuse(prompt) -> int:
    return min(len(prompt) // TPB * TPB, len(prompt) - 1)


def test_save_policy_forms():
    assert SavePolicy.parse("all") == SavePolicy() == SavePolicy.parse(SavePolicy())
    assert SavePolicy.parse("priority>=50") == SavePolicy(min_priority=50)
    assert SavePolicy.parse(" seen >= 3 ") == SavePolicy(min_seen=3)
    assert SavePolicy.parse("priority>=10,seen>=2") == SavePolicy(min_priority=10, min_seen=2)
    for bad in ("", "some", "priority>50", "priority>=-1", "priority>=101", "seen>=0", "seen>=2,seen>=3", "seen>=x"):
        with pytest.raises(ValueError, match=r"save policy|min_"):
            SavePolicy.parse(bad)
    with pytest.raises(TypeError):
        SavePolicy.parse(2)
    with pytest.raises(TypeError):
        SavePolicy(min_seen=True)


def test_prefix_sightings_are_bounded_and_forget_the_least_recent():
    sightings = PrefixSightings(capacity=3)
    assert sightings.see([b"a", b"b"]) == [1, 1]
    assert sightings.see([b"a", b"c"]) == [2, 1]
    assert sightings.see([b"d"]) == [1]  # b"b" was seen least recently: forgotten
    assert len(sightings) == 3
    assert sightings.see([b"b", b"a"]) == [1, 3]


def test_only_requests_of_high_enough_priority_are_saved(llama, redis_url):
    low, high = prompts_for(llama, [70, 90], seed=41)
    scope = fresh_scope()
    connector = RedisConnector(redis_url, save_policy="priority>=50")
    with engine(llama, 200, connector) as eng:
        eng.generate([low], SamplingParams(max_tokens=2), scope=scope, priority=10)
        skipped = connector.stats().skipped_pages
        eng.generate([high], SamplingParams(max_tokens=2), scope=scope, priority=60)
    stats = connector.stats()
    assert skipped == (70 + 1) // TPB and stats.saved_pages == (90 + 1) // TPB
    assert reused(llama, redis_url, [low, high], scope) == [0, full_reuse(high)]


def test_only_prefixes_seen_often_enough_are_saved(llama, redis_url):
    system = prompts_for(llama, [48], seed=42)[0]  # three blocks every conversation shares
    chats = [system + tail for tail in prompts_for(llama, [40, 40, 40], seed=43)]
    scope = fresh_scope()
    connector = RedisConnector(redis_url, save_policy="seen>=2")
    with engine(llama, 200, connector) as eng:
        eng.generate(chats[:1], SamplingParams(max_tokens=2), scope=scope)
        assert connector.stats().saved_pages == 0  # everything seen once
        eng.generate(chats[1:2], SamplingParams(max_tokens=2), scope=scope)
    assert connector.stats().saved_pages == 48 // TPB  # the shared prefix, now seen twice; no chat's own blocks
    assert reused(llama, redis_url, chats[2:], scope) == [48]


def test_values_carry_the_ttl(llama, redis_url):
    scope = fresh_scope()
    with engine(llama, 200, RedisConnector(redis_url, ttl_seconds=300)) as eng:
        eng.generate(prompts_for(llama, [40], seed=44), SamplingParams(max_tokens=2), scope=scope)
    raw = redis.Redis.from_url(redis_url)
    keys = list(raw.scan_iter(match=f"kvtier/*/{kvtier.connector.keys.scope_tag(scope)}/*"))
    assert len(keys) == 2 and all(0 < raw.pttl(k) <= 300_000 for k in keys)
    raw.close()


def test_connector_metrics_beside_the_cache_metrics(llama, redis_url):
    prompts = prompts_for(llama, [80, 60], seed=45)
    scope = fresh_scope()
    with engine(llama, 200, RedisConnector(redis_url)) as cold:
        cold.generate(prompts, SamplingParams(max_tokens=2), scope=scope)
    connector = RedisConnector(redis_url)
    with engine(llama, 200, connector) as warm:
        warm.generate(prompts + prompts_for(llama, [50], seed=46), SamplingParams(max_tokens=2), scope=scope)
        wait_until(lambda: connector.stats().saved_pages == 50 // TPB, 30, "the saves")  # they run on a thread
        registry = registry_for(warm.cache_manager)
        registry.register(ConnectorCollector(connector))
        text = generate_latest(registry).decode()
    stats = connector.stats()
    assert isinstance(stats, ConnectorStats)
    page = stats.loaded_bytes // stats.loaded_pages
    assert stats.loaded_pages == 80 // TPB + 60 // TPB  # every full block (the last one holds the clamped token)
    assert stats.missed_pages == 50 // TPB and stats.errors == 0  # the new prompt's blocks
    assert stats.saved_pages == 50 // TPB  # only those: the store had the others
    assert stats.saved_bytes == stats.saved_pages * page and stats.stall_s > 0
    assert "kvtier_tier_pages_capacity" in text  # the cache's
    assert f"kvtier_connector_loaded_pages_total {float(stats.loaded_pages)}" in text
    assert f"kvtier_connector_saved_bytes_total {float(stats.saved_bytes)}" in text
    assert f"kvtier_connector_missed_pages_total {float(stats.missed_pages)}" in text
    assert "kvtier_connector_errors_total 0.0" in text and "kvtier_connector_stall_seconds_total" in text


def test_a_hung_server_stalls_a_step_by_at_most_the_timeout(llama, start_redis):
    server = start_redis()
    prompts = prompts_for(llama, [90, 70], seed=47)
    with engine(llama, 200, RedisConnector(server.url)) as cold:
        cold.generate(prompts, SamplingParams(max_tokens=2))
    connector = RedisConnector(server.url, timeout_s=0.4, retry_after_s=60)
    with engine(llama, 200, connector) as eng:
        eng.generate(prompts_for(llama, [30], seed=48), SamplingParams(max_tokens=2))  # connected
        server.pause()
        try:
            stalls = []
            ids = [eng.add_request(p, SamplingParams(max_tokens=3)) for p in prompts]
            outputs = {}
            while eng.has_unfinished_requests():
                before = connector.stats().stall_s
                outputs.update((o.request_id, o) for o in eng.step())
                stalls.append(connector.stats().stall_s - before)
        finally:
            server.resume()
        check_against_oracle(llama, prompts, [outputs[i] for i in ids], 3)
    assert 0.4 * 0.9 <= max(stalls) <= 0.4 + 0.2 and sum(stalls) - max(stalls) <= 0.3, stalls
    assert all(outputs[i].reused_tokens_by_tier.get("connector", 0) == 0 for i in ids)
