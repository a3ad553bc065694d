"""Warnings for failures that repeat (a full disk fails every write): the first at once, then summaries.

``RateLimitedWarning`` logs its first event in full, then counts the events that follow and logs
one summary line (the count and the last event) when an event arrives ``interval_s`` or more after
the previous line, and at ``flush`` (a close). A failing disk that is written to 1,000 times a
second thus logs a line a minute, not 1,000 a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

SUMMARY_INTERVAL_S = 60.0


class RateLimitedWarning:
    """One kind of repeated failure, e.g. "page write failed". Thread-safe (a store fails on its
    callers' threads and its own at once)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        interval_s: float = SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        self._since_line = 0
        self._last_detail = ""
        self._last_line_at: float | None = None
        self._lock = threading.Lock()

    def __call__(self, detail: str) -> None:
        """Record one failure described by ``detail``; log it now or fold it into the next summary."""
        with self._lock:
            self._record(detail)

    def _record(self, detail: str) -> None:
        self.total += 1
        now = self.clock()
        if self._last_line_at is None:
            self.logger.warning(
                "kvtier: %s: %s (further ones are summarised every %.0f s)", self.what, detail, self.interval_s
            )
            self._last_line_at = now
            return
        self._since_line += 1
        self._last_detail = detail
        if now - self._last_line_at >= self.interval_s:
            self._summarise(now)

    def flush(self) -> None:
        """Log the failures counted since the last line, if any."""
        with self._lock:
            if self._since_line:
                self._summarise(self.clock())

    def _summarise(self, now: float) -> None:
        assert self._last_line_at is not None
        self.logger.warning(
            "kvtier: %s: %d more in the last %.0f s (%d in all; the last: %s)",
            self.what,
            self._since_line,
            now - self._last_line_at,
            self.total,
            self._last_detail,
        )
        self._since_line = 0
        self._last_line_at = now
