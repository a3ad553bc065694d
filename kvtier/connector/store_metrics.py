"""A connector's ``ConnectorStats`` as Prometheus metrics (``prometheus-client``), beside the cache's.

``ConnectorCollector(connector)`` reads ``connector.stats()`` at every scrape; names start with
``kvtier_connector_``. Register it on the registry that holds the cache's metrics::

    registry = kvtier.metrics.registry_for(engine.cache_manager)
    registry.register(ConnectorCollector(connector))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.connector.store_stats import ConnectorStats

_METRICS = (
    ("saved_pages", "kvtier_connector_saved_pages", "Pages the connector's store took"),
    ("saved_bytes", "kvtier_connector_saved_bytes", "Payload bytes the connector's store took"),
    ("loaded_pages", "kvtier_connector_loaded_pages", "Pages loaded from the store into the cache"),
    ("loaded_bytes", "kvtier_connector_loaded_bytes", "Payload bytes loaded from the store into the cache"),
    ("missed_pages", "kvtier_connector_missed_pages", "Pages asked of the store that it did not have or deliver"),
    ("errors", "kvtier_connector_errors", "Pages whose save failed or that the store could not deliver intact"),
    ("skipped_pages", "kvtier_connector_skipped_pages", "Pages the save policy chose not to save"),
    ("unasked_tokens", "kvtier_connector_unasked_tokens", "Prompt tokens not asked of a store slower than recomputing"),
    ("stall_s", "kvtier_connector_stall_seconds", "Seconds the engine's thread waited for the store"),
)


class _HasStats(Protocol):
    def stats(self) -> ConnectorStats: ...


class ConnectorCollector(Collector):
    """Exports one connector's counters (``describe`` names them without reading the connector,
    so a scrape may ask for some by name)."""

    def __init__(self, connector: _HasStats) -> None:
        self.connector = connector

    def describe(self) -> Iterator[Metric]:
        for _, name, doc in _METRICS:
            yield CounterMetricFamily(name, doc)

    def collect(self) -> Iterator[Metric]:
        stats = self.connector.stats()
        for field, name, doc in _METRICS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
