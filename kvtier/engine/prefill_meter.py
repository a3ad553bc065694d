"""The engine's measured prefill rate, which the cache manager weighs loads against.

Every step that computes at least ``MIN_TOKENS`` prompt tokens (chunks longer than one token)
adds a sample: tokens over the step's wall time. The first such step is left out (it pays for
the engine's cold start: measured 1.28 s for a chunk that takes 0.38 s warm, on an H200). The
rate is an exponentially weighted mean, handed to ``KVCacheManager.set_prefill_rate`` after each
sample. A step mixing prefill and decode counts
its prefill tokens only, so the rate errs low: loads are kept a little more often than they win.
"""

from __future__ import annotations

MIN_TOKENS = 256  # shorter prefills are dominated by fixed per-step costs
SMOOTHING = 0.3


class PrefillMeter:
    """Tokens per second of prefill, measured over the engine's own steps."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._warm = False

    def observe(self, prefill_tokens: int, seconds: float) -> float | None:
        """One step's prefill tokens and wall time; returns the new rate, or None without a sample."""
        if prefill_tokens < MIN_TOKENS or seconds <= 0:
            return None
        if not self._warm:
            self._warm = True
            return None
        sample = prefill_tokens / seconds
        self.rate = sample if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * sample
        return self.rate
