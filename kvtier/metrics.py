"""``CacheStats`` as Prometheus metrics (``prometheus-client``).

``CacheCollector(manager)`` reads ``manager.stats()`` at every scrape, so the figures are always
current and the manager's hot paths pay nothing; a closed manager exports nothing. Register it on a registry, or call
``serve(manager, port)`` to expose it over HTTP (a ``MetricsServer``: the port it bound, ``close``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.errors import CacheStateError
from kvtier.manager import KVCacheManager

_TIER_GAUGES = (  # (name, help, TierStats field), labelled by tier
    ("kvtier_tier_pages_capacity", "Pages a tier can hold", "pages_total"),
    ("kvtier_tier_pages_used", "Pages a tier holds now", "pages_used"),
    ("kvtier_tier_bytes_capacity", "Bytes of a tier's quota", "bytes_total"),
    ("kvtier_tier_bytes_used", "Bytes a tier holds now", "bytes_used"),
)
_COUNTERS = (  # (CacheStats field, help), exported as kvtier_<field>_total
    ("lookup_tokens", "Prompt tokens looked up for reuse"),
    ("evictions", "Pages forced out of a tier to make room"),
    ("demotions", "Pages moved to a colder tier"),
    ("promotions", "Pages moved to a warmer tier"),
    ("drops", "Pages discarded from the cache"),
    ("checksum_failures", "Pages not read back intact: a checksum mismatch, a short read or a read error"),
    ("disk_resets", "Disk tier directories that could not be read and started empty"),
    (
        "recomputed_tokens",
        "Cached prompt tokens recomputed: loading them was estimated slower, or their reuse was given up",
    ),
)
_HITS = (
    "kvtier_hit_tokens",
    "Prompt tokens reused, by the tier they came from (counted at a cache's first commit or close)",
)
_COPIED = ("kvtier_bytes_copied", "Bytes moved between tiers, by edge and path")


class CacheCollector(Collector):
    """Exports one manager's stats; names start with ``kvtier_``. Every counter only grows.

    It holds the manager weakly: serving its metrics does not keep alive a manager its owner
    dropped (which is then closed as ``close()`` would, ``kvtier.manager``), and a closed or
    collected manager exports nothing. ``describe`` names the metrics without reading the
    manager, so a scrape may ask for some by name (``/metrics?name[]=...``)."""

    def __init__(self, manager: KVCacheManager) -> None:
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        self._manager = weakref.ref(manager)

    @property
    def manager(self) -> KVCacheManager | None:
        """The manager exported, or None once it was collected."""
        return self._manager()

    def describe(self) -> Iterator[Metric]:
        for name, doc, _ in _TIER_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["tier"])
        yield CounterMetricFamily(*_HITS, labels=["tier"])
        for field, doc in _COUNTERS:
            yield CounterMetricFamily(f"kvtier_{field}", doc)
        yield CounterMetricFamily(*_COPIED, labels=["src", "dst", "path"])

    def collect(self) -> Iterator[Metric]:
        manager = self._manager()
        if manager is None:
            return
        try:
            stats = manager.stats()
        except CacheStateError:  # a closed manager has nothing more to report
            return
        del manager  # (a scrape keeps no reference to it)
        for name, doc, field in _TIER_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, tier_stats in stats.tiers.items():
                gauge.add_metric([tier], getattr(tier_stats, field))
            yield gauge
        hits = CounterMetricFamily(*_HITS, labels=["tier"])
        for tier, n in stats.hit_tokens.items():
            hits.add_metric([tier], n)
        yield hits
        for field, doc in _COUNTERS:
            yield CounterMetricFamily(f"kvtier_{field}", doc, value=getattr(stats, field))
        copied = CounterMetricFamily(*_COPIED, labels=["src", "dst", "path"])
        for key, n in stats.bytes_copied.items():
            edge, path = key.split(":", 1)
            src, dst = edge.split("->", 1)
            copied.add_metric([src, dst, path], n)
        yield copied


def registry_for(manager: KVCacheManager) -> CollectorRegistry:
    """A fresh registry holding only this manager's metrics."""
    registry = CollectorRegistry()
    registry.register(CacheCollector(manager))
    return registry


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running ``serve``: its ``registry``, the ``port`` it bound (the one chosen for port 0), and
    ``url``; ``close()`` stops it (idempotent; also on leaving a ``with`` block)."""

    registry: CollectorRegistry
    port: int
    url: str
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(manager: KVCacheManager, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve the manager's metrics at ``http://addr:port/metrics`` from a background thread.

    ``port``: 0..65535 (0: any free port, see ``MetricsServer.port``); ``TypeError``/``ValueError``
    otherwise, before anything is served."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int, got {port!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be a TCP port (0-65535), got {port}")
    registry = registry_for(manager)
    server, thread = start_http_server(port, addr=addr, registry=registry)
    bound = server.server_port
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(addr, addr)  # every address: this host's
    host = f"[{host}]" if ":" in host else host
    return MetricsServer(registry, bound, f"http://{host}:{bound}/metrics", server, thread)
