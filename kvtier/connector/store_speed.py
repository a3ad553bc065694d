"""How fast a connector's store answers, and whether asking it for a prefix beats recomputing it.

A store that answers slowly (a distant Redis, a loaded shared file system) costs a request the
round trips of its ask: an existence check, then the fetch. Asking pays only when that costs
less than recomputing the tokens the store could give. ``StoreSpeed`` keeps moving averages of
what the store's calls took (an existence check's seconds; a fetch's bytes per second once the
check's latency is taken off) and, given the engine's prefill rate, tells whether an ask of
``tokens`` tokens in ``nbytes`` bytes is expected to take longer than recomputing them
(``faster_to_recompute``).

Until it has timed a check, or without a prefill rate, every ask is made. Before a fetch was
timed, an ask is taken to cost at least the check's two round trips (the check, and the fetch's
latency): a store whose check alone is slower than recomputing is not asked again while the
first fetch is still on its way (an asynchronous load keeps the engine asking others meanwhile). While
asks are skipped, one is still made once ``PROBE_S`` has passed since the last timed call, so a
store that recovers is used again. Thread-safe: fetches may be timed on the connector's threads.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

WEIGHT = 0.25  # of the newest sample in a moving average
PROBE_S = 10.0  # at most this long without a timed call before an ask is made whatever the estimate
MIN_FETCH_S = 1e-6  # a fetch's time past its latency is taken as at least this (bytes per second stay finite)


class StoreSpeed:
    """Moving averages of a store's existence-check seconds and fetch bytes per second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._check_s: float | None = None
        self._fetch_bytes_per_s: float | None = None
        self._timed_at = -math.inf  # when a call was last timed

    def checked(self, seconds: float) -> None:
        """An existence check took ``seconds``."""
        with self._lock:
            self._check_s = _averaged(self._check_s, seconds)
            self._timed_at = self._clock()

    def fetched(self, seconds: float, nbytes: int) -> None:
        """A fetch of ``nbytes`` bytes took ``seconds`` (its latency, taken as a check's, included)."""
        if nbytes <= 0:
            return
        with self._lock:
            latency = self._check_s or 0.0
            self._fetch_bytes_per_s = _averaged(self._fetch_bytes_per_s, nbytes / max(seconds - latency, MIN_FETCH_S))
            self._timed_at = self._clock()

    def estimate(self, nbytes: int) -> float | None:
        """Seconds expected for a check and a fetch of ``nbytes`` bytes (until a fetch was timed, the
        two round trips alone: a lower bound); None until a check was timed."""
        with self._lock:
            if self._check_s is None:
                return None
            transfer = 0.0 if self._fetch_bytes_per_s is None else nbytes / self._fetch_bytes_per_s
            return 2 * self._check_s + transfer

    def faster_to_recompute(self, tokens: int, nbytes: int, prefill_tokens_per_s: float | None) -> bool:
        """Whether recomputing ``tokens`` at ``prefill_tokens_per_s`` is expected to be faster than
        asking the store for them (``nbytes`` of pages); False while unknown, or once ``PROBE_S``
        has passed since a call was timed."""
        expected = self.estimate(nbytes)
        if expected is None or prefill_tokens_per_s is None or self._clock() - self._timed_at >= PROBE_S:
            return False
        return tokens / prefill_tokens_per_s < expected


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - WEIGHT) * average + WEIGHT * sample
