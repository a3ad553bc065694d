"""Warnings about a store's failed items, at most one line per kind per interval.

A store that keeps failing (a full disk, a server out of memory, damaged values) fails every
call in the same way; one WARNING line per call would flood the engine's log. ``ThrottledWarning``
logs the first of a kind at once, then at most one per ``interval_s``, each line saying how many
of that kind were held back since the last one. Thread-safe.
"""

from __future__ import annotations

import logging
import math
import threading
import time


class ThrottledWarning:
    """``warn(kind, message, *args)`` logs at WARNING unless ``kind`` was logged in the last ``interval_s``."""

    def __init__(self, log: logging.Logger, interval_s: float) -> None:
        self._log = log
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` (plus the count held back), or count it as held back."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, -math.inf):
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._next[kind] = now + self._interval_s
            held = self._held.pop(kind, 0)
        if held:
            message += f" ({held} more such calls since the last warning)"
        self._log.warning(message, *args)
