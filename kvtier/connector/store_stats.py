"""What a connector did with its store, counted: ``ConnectorStats`` (a snapshot) and its counters.

Pages are (block, layer group) pages; bytes are payload bytes (without the store's framing).

- ``saved_pages`` / ``saved_bytes``: pages the store took.
- ``loaded_pages`` / ``loaded_bytes``: pages copied from the store into the cache.
- ``missed_pages``: pages after the local prefix that the longest offer would load and the store
  did not have (absent, expired, or its server down) or could not deliver intact (a sliding
  window's pages stale at the prompt's end are never saved, and never counted).
- ``errors``: pages whose save failed, and pages the store listed but could not deliver intact.
- ``skipped_pages``: pages not saved because of the save policy.
- ``unasked_tokens``: prompt tokens the store was not asked for because, with the engine's
  prefill rate and the store's measured speed, recomputing them was expected to be faster
  (``kvtier.connector.store_speed``).
- ``stall_s``: seconds the engine's thread spent waiting for the store: the existence checks of
  asks and, with ``load_async=False`` (the default), the fetch in the ask; asynchronous fetches
  and saves (with their existence checks) run on threads of their own and are not counted.

Counters only grow; ``snapshot()`` is consistent (taken under one lock), cheap, and thread-safe.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace


@dataclass(slots=True)
class ConnectorStats:
    """A snapshot of one connector's counters (see the module docstring)."""

    saved_pages: int = 0
    saved_bytes: int = 0
    loaded_pages: int = 0
    loaded_bytes: int = 0
    missed_pages: int = 0
    errors: int = 0
    skipped_pages: int = 0
    unasked_tokens: int = 0
    stall_s: float = 0.0


COUNTERS = tuple(f.name for f in fields(ConnectorStats))


class ConnectorCounters:
    """The live counters behind ``ConnectorStats``, updated from the engine's thread and the save thread."""

    def __init__(self) -> None:
        self._stats = ConnectorStats()
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        """Add to the named counters (``KeyError`` for a name that is not one)."""
        with self._lock:
            for name, amount in amounts.items():
                if name not in COUNTERS:
                    raise KeyError(f"no connector counter {name!r}")
                setattr(self._stats, name, getattr(self._stats, name) + amount)

    def snapshot(self) -> ConnectorStats:
        with self._lock:
            return replace(self._stats)
