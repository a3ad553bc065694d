"""Back-off and rate-limited warnings for what stands behind a store: one Redis server (or one node
of a cluster), or the file system of a ``FileSystemStore``.

A server that cannot be reached (refused, timed out, connection lost), or a file system whose I/O
hangs, is left alone for
``retry_after_s``: calls meanwhile answer misses at once, without touching the network; the
first call after that tries again. A failure is logged at WARNING at most once per
``warn_interval_s``, with a count of the calls answered misses since the last line; the first
answer after a failure is logged at INFO. Thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time

DETAIL_CHARS = 300  # of a failure's text in a warning (redis-py's can hold its whole connection pool's repr)


class ServerHealth:
    """Whether to try ``name`` now, and the log lines about its failures (``kind``: "redis store", "fs store")."""

    def __init__(
        self, name: str, log: logging.Logger, retry_after_s: float, warn_interval_s: float, kind: str = "redis store"
    ) -> None:
        self.name = name
        self.kind = kind
        self._log = log
        self._retry_after_s = retry_after_s
        self._warn_interval_s = warn_interval_s
        self._lock = threading.Lock()
        self._down_until = -math.inf
        self._next_warning = -math.inf
        self._unlogged = 0
        self._failing = False

    def available(self) -> bool:
        """False while backed off (the caller answers misses, and that call is counted for the next warning)."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self._unlogged += 1
                return False
            return True

    def answered(self) -> None:
        """The server answered: end the failure (logged once at INFO)."""
        with self._lock:
            if not self._failing:
                return
            self._failing = False
        self._log.info("kvtier %s %s: it answers again", self.kind, self.name)

    def failed(self, op: str, exc: BaseException, server_down: bool) -> None:
        """``op`` failed with ``exc``; back off if ``server_down``; warn unless warned recently."""
        now = time.monotonic()
        with self._lock:
            if server_down:
                self._down_until = now + self._retry_after_s
                self._failing = True
            if now < self._next_warning:
                self._unlogged += 1
                return
            self._next_warning = now + self._warn_interval_s
            unlogged, self._unlogged = self._unlogged, 0
        action = f"answering misses for {self._retry_after_s:g}s, then retrying" if server_down else "answering misses"
        self._log.warning(
            "kvtier %s %s: %s failed (%s: %s); %s (%d more calls answered misses since the last warning)",
            self.kind,
            self.name,
            op,
            type(exc).__name__,
            _shortened(str(exc)),
            action,
            unlogged,
        )


def _shortened(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + "..."
