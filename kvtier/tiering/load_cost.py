"""The load-or-recompute decision: never make time to first token worse than recomputing.

Loading a cached block costs its bytes over the measured bandwidth of the tier it is on (0 on
the primary tier); recomputing a token costs one over the engine's measured prefill rate. For a
prompt of ``L`` tokens whose cached prefix has blocks ``0..n-1``, reusing the first ``c`` blocks
costs ``load(0..c-1) + (L - c * tokens_per_block) / rate``; the cut ``c`` with the least cost is
kept (the longest among equals), the rest is recomputed. Blocks are loaded in prefix order, so
the cost is evaluated for every cut in one pass.

Bandwidths are measured online, per source tier, from the mover's own copies: a measurement
slower than the estimate replaces it at once, a faster one moves it by a weighted mean (a disk
read from the OS page cache is fast, the same read cold is not: loads err toward recomputing,
which costs at most the gain of a load). A tier never measured yet is assumed to win (its first
load measures it). With
no prefill rate (nothing told the pool one) every cached block is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SMOOTHING = 0.3  # weight of the newest measurement


class LoadCost:
    """Measured bandwidths per tier (bytes/s into the primary tier) and the prefill rate (tokens/s)."""

    def __init__(self, num_tiers: int) -> None:
        self.bandwidth: list[float | None] = [math.inf] + [None] * (num_tiers - 1)
        self.prefill_rate: float | None = None

    def observe(self, tier: int, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` from ``tier`` into the primary tier took ``seconds``."""
        if tier == 0 or nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self.bandwidth[tier]
        if old is None or rate < old:
            self.bandwidth[tier] = rate  # a slower read counts at once (the OS page cache went cold)
        else:
            self.bandwidth[tier] = (1 - SMOOTHING) * old + SMOOTHING * rate

    def set_prefill_rate(self, tokens_per_second: float) -> None:
        if not tokens_per_second > 0 or not math.isfinite(tokens_per_second):
            raise ValueError(f"a prefill rate is a finite number of tokens per second > 0, got {tokens_per_second!r}")
        self.prefill_rate = float(tokens_per_second)

    def block_seconds(self, tier_bytes: Sequence[tuple[int, int]]) -> float:
        """Estimated seconds to load one block whose pages are ``(tier, bytes)``; 0 where unknown."""
        total = 0.0
        for tier, nbytes in tier_bytes:
            bandwidth = self.bandwidth[tier]
            if bandwidth is not None:
                total += nbytes / bandwidth
        return total

    def best_cut(self, block_seconds: Sequence[float], prompt_tokens: int, tokens_per_block: int) -> int:
        """The number of leading cached blocks worth loading for a prompt of ``prompt_tokens``."""
        rate = self.prefill_rate
        n = len(block_seconds)
        if rate is None or n == 0:
            return n
        best, best_cost = 0, prompt_tokens / rate
        load = 0.0
        for c in range(1, n + 1):
            load += block_seconds[c - 1]
            cost = load + max(prompt_tokens - c * tokens_per_block, 0) / rate
            if cost <= best_cost:
                best, best_cost = c, cost
        return best
