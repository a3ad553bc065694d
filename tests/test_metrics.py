"""The Prometheus export mirrors ``CacheStats``, read at scrape time, also over HTTP."""

from __future__ import annotations

import dataclasses
import gc
import socket
import urllib.request
import weakref

import pytest
from prometheus_client import generate_latest

import kvtier
from kvtier.metrics import CacheCollector, registry_for, serve
from tests.kvdata import PageOracle, small_spec


def busy_manager(tmp_path) -> kvtier.KVCacheManager:
    spec = small_spec()
    page = 2 * 2 * 2 * 8 * 4 * 2  # 2 layers x k/v x 4 tokens x 2 heads x 8 dims x fp16
    config = kvtier.CacheConfig(4, [kvtier.PrimaryTier(page * 4), kvtier.HostTier(page * 40)])
    mgr = kvtier.KVCacheManager(spec, config)
    oracle = PageOracle(mgr)
    for i in range(3):
        tokens = [i * 100 + j for j in range(12)]
        cache = mgr.create_cache(tokens)
        cache.resume()
        cache.resize(12)
        oracle.write(cache, tokens, 0, 12)
        cache.commit(tokens)
        cache.close()
    mgr.create_cache([0, 1, 2, 3, 4, 5, 6]).close()
    return mgr


def test_metrics_mirror_stats(tmp_path):
    mgr = busy_manager(tmp_path)
    stats = mgr.stats()
    text = generate_latest(registry_for(mgr)).decode()
    assert f'kvtier_tier_pages_used{{tier="host"}} {float(stats.tiers["host"].pages_used)}' in text
    assert f"kvtier_demotions_total {float(stats.demotions)}" in text
    assert f'kvtier_hit_tokens_total{{tier="host"}} {float(stats.hit_tokens["host"])}' in text
    assert f"kvtier_lookup_tokens_total {float(stats.lookup_tokens)}" in text
    assert 'kvtier_bytes_copied_total{dst="host",path="cpu",src="primary"}' in text
    assert stats.demotions > 0 and stats.hit_tokens["host"] > 0
    for field in dataclasses.fields(stats):  # every counter of the stats is exported (a missing one was)
        if field.type == "int" or field.type is int:
            assert f"kvtier_{field.name}_total {float(getattr(stats, field.name))}" in text, field.name


def test_metrics_over_http(tmp_path):
    mgr = busy_manager(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve(mgr, port) as server:
        assert server.port == port and server.url == f"http://127.0.0.1:{port}/metrics"
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
    assert "kvtier_tier_pages_capacity" in body and "kvtier_evictions_total" in body


def test_a_server_on_port_0_tells_its_port_and_stops(tmp_path):
    """Before, ``serve(mgr, 0)`` returned the registry alone: the port it bound was unknown and the
    server could not be stopped."""
    mgr = busy_manager(tmp_path)
    server = serve(mgr, 0)
    assert server.port > 0
    body = urllib.request.urlopen(server.url, timeout=5).read().decode()
    assert "kvtier_lookup_tokens_total" in body
    server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=5)
    mgr.close()


def test_a_closed_manager_exports_nothing(tmp_path):
    mgr = busy_manager(tmp_path)
    registry = registry_for(mgr)
    mgr.close()
    assert "kvtier_tier_pages_capacity" not in generate_latest(registry).decode()


def test_a_registry_needs_a_manager():
    """Before, registry_for(None) was accepted and every scrape failed with an AttributeError."""
    with pytest.raises(TypeError, match="manager must be a KVCacheManager, got NoneType"):
        registry_for(None)


@pytest.mark.parametrize(("port", "error"), [(70000, ValueError), (-1, ValueError), ("9100", TypeError)])
def test_serve_names_a_bad_port_before_serving(tmp_path, port, error):
    """Before, OverflowError from bind (70000) or socket.gaierror (-1)."""
    mgr = busy_manager(tmp_path)
    with pytest.raises(error, match="port must be"):
        serve(mgr, port)
    mgr.close()


def test_metrics_asked_for_by_name_are_served_and_gauges_have_no_counter_suffix(tmp_path):
    """``/metrics?name[]=...`` (a scrape of some metrics) serves those. Before, the collectors named
    nothing ahead of a scrape, so the filter matched nothing: an empty body. And two gauges ended in
    ``_total``, the suffix Prometheus keeps for counters."""
    mgr = busy_manager(tmp_path)
    with serve(mgr, 0) as server:
        body = urllib.request.urlopen(f"{server.url}?name[]=kvtier_drops_total", timeout=5).read().decode()
        whole = urllib.request.urlopen(server.url, timeout=5).read().decode()
    assert "kvtier_drops_total" in body and "kvtier_evictions_total" not in body
    for line in whole.splitlines():
        if line.startswith("# TYPE ") and line.endswith(" gauge"):
            assert not line.split()[2].endswith("_total"), line
    assert 'kvtier_tier_pages_capacity{tier="host"}' in whole
    mgr.close()


def test_serving_a_manager_does_not_keep_it_alive(tmp_path):
    """A manager its owner drops while its metrics are served is collected (and closed as ``close``
    would); the server then exports nothing. Before, the served registry kept it, its memory and
    its disk directory, for as long as the server object lived, closed or not."""
    mgr = busy_manager(tmp_path)
    gone = weakref.ref(mgr)
    with serve(mgr, 0) as server:
        assert "kvtier_drops_total" in urllib.request.urlopen(server.url, timeout=5).read().decode()
        del mgr
        gc.collect()
        assert gone() is None
        assert "kvtier_" not in urllib.request.urlopen(server.url, timeout=5).read().decode()


def test_a_second_managers_collector_on_one_registry_is_refused(tmp_path):
    """Two managers' metrics on one registry would be series of the same names and labels: the
    registry refuses the second (each manager is served on a port of its own). Before, it took it,
    and every scrape served each series twice."""
    first, second = busy_manager(tmp_path), busy_manager(tmp_path)
    registry = registry_for(first)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(CacheCollector(second))
    first.close()
    second.close()
