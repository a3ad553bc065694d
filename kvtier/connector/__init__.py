"""Connectors: external KV stores that supply prefixes and receive finished blocks.

The protocol (``base``): ``KvCacheConnectorScheduler`` and ``KvCacheConnectorWorker``, driven by
the engine through ask / reserve / deliver (``kvtier.engine.connector_driver``). The shipped connectors
(``store_connector``): ``FileSystemConnector(path)`` and ``RedisConnector(url)``, both halves in
one object over a store.

The storage layer behind the shipped connectors:

- ``BlockKeyspace``: the key of one page (model, block size, tensor-parallel shard, reuse scope,
  chained block key, layer group), the same in every process and on every machine.
- ``BlockStore``: the batched interface of a store (get, put, contains, delete, close); a store
  frames and verifies pages itself (``encode_page``/``decode_page``), so callers see only whole,
  verified payloads or misses, and it never raises for a failure of what is behind it.
- ``FileSystemStore(path)``: one file per page, atomic writes, shareable between processes.
- ``RedisStore(url)``: one server, a Redis Cluster or a Sentinel-watched primary (Valkey alike);
  one round trip per batch (per node), optional TTL, back-off while a server is down.
- ``SavePolicy``: which finished blocks a connector saves; ``ConnectorStats``: what it did
  (``kvtier.connector.store_metrics`` exports them to Prometheus).
  ``redis`` is imported only when a ``RedisStore`` is made.
"""

from kvtier.connector.base import (
    ConnectorRequest,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)
from kvtier.connector.block_codec import decode_page, encode_page
from kvtier.connector.fs_store import FileSystemStore
from kvtier.connector.keys import BlockKeyspace
from kvtier.connector.redis_store import RedisStore
from kvtier.connector.save_policy import SavePolicy
from kvtier.connector.store import BlockStore
from kvtier.connector.store_connector import FileSystemConnector, RedisConnector, StoreConnector
from kvtier.connector.store_stats import ConnectorStats

__all__ = [
    "BlockKeyspace",
    "BlockStore",
    "ConnectorRequest",
    "ConnectorStats",
    "FileSystemConnector",
    "FileSystemStore",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "RedisConnector",
    "RedisStore",
    "SavePolicy",
    "SchedulerOutput",
    "StoreConnector",
    "decode_page",
    "encode_page",
]
